#!/usr/bin/env bash
# The whole test suite, on a fresh machine: sets up .venv and redis-server, checks lint, format
# and types (ruff, mypy), then runs pytest on parallel workers (pytest-xdist).
# Extra arguments go to pytest, e.g.  scripts/test.sh -k redis -x   (-n 0: one process, no workers)
# DYNEMB_TEST_WORKERS sets the workers: by default twice the cores, as most of the suite's time
# is spent waiting on the processes it starts (docs/development.md has the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export DYNEMB_REDIS_SERVER="$PWD/.bin/redis-server"
# lint, format and types first: seconds, and a failure names the file and line
echo "[test] ruff check, ruff format --check, mypy"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
workers=${DYNEMB_TEST_WORKERS:-$(( $(nproc) * 2 ))}
# pytest keeps each test module's rewritten asserts in __pycache__ only where Python may write
# bytecode: without it every worker rewrites all ~190 modules again (~6 s of a core each)
unset PYTHONDONTWRITEBYTECODE
# tests handed out one at a time, in the order tests/conftest.py puts them (the longest first),
# the tests of a few modules that share a costly fixture as one: tests/conftest.py's scheduler
# for --dist load (xdist's own hands out chunks of consecutive tests: one would hold every long one)
exec .venv/bin/python -m pytest -n "$workers" --dist load "$@"
