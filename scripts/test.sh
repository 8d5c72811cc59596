#!/usr/bin/env bash
# The whole test suite, on a fresh machine: sets up .venv and redis-server, then runs pytest.
# Extra arguments go to pytest, e.g.  scripts/test.sh -k redis -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export DYNEMB_REDIS_SERVER="$PWD/.bin/redis-server"
exec .venv/bin/python -m pytest "$@"
