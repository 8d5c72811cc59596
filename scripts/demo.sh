#!/usr/bin/env bash
# The main job, on a fresh machine: sets up .venv, then runs `dynemb demo`
# (a PS on the embedded store, a table created, rows pulled and pushed).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/dynemb demo "$@"
