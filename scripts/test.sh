#!/usr/bin/env bash
# The whole test suite, on a fresh machine: sets up .venv and redis-server, checks lint, format
# and types (ruff, mypy), then runs pytest.
# Extra arguments go to pytest, e.g.  scripts/test.sh -k redis -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export DYNEMB_REDIS_SERVER="$PWD/.bin/redis-server"
# lint, format and types first: seconds, and a failure names the file and line
echo "[test] ruff check, ruff format --check, mypy"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
