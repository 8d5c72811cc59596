#!/usr/bin/env bash
# Before a release: the whole suite with the long counts (--soak: the PS fuzz's 10,000 hostile
# requests a run), then an hour of load on one PS over Redis (bench/ps_load.py --soak).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/test.sh --soak "$@"
.venv/bin/python bench/ps_load.py --soak
