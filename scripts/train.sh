#!/usr/bin/env bash
# The main job, on a fresh machine: sets up .venv, then trains a small DLRM on synthetic
# Criteo-like data with dynamic tables (10% of each table's IDs on the device) over the
# embedded PS, in one process, and prints the held-out AUC. Flags go to `dynemb train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/dynemb train "$@"
