#!/usr/bin/env bash
# The whole suite N times (default 5), each run in a random order of its own, to find tests that
# depend on their order or on what runs beside them. Prints each run's seed, its last line and
# its failures; the logs stay in .test-orders/. Exits non-zero if any run failed.
#   scripts/test_orders.sh [N] [pytest args...]      e.g.  scripts/test_orders.sh 5
#   rerun one order:  scripts/test.sh --randomly-seed=SEED
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
shift || true
mkdir -p .test-orders
failed=0
for i in $(seq 1 "$runs"); do
  seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  log=.test-orders/seed-$seed.log
  start=$(date +%s)
  scripts/test.sh --randomly-seed="$seed" -p no:cacheprovider "$@" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  echo "run $i of $runs: seed $seed, exit $rc, ${secs}s: $(grep -E '(passed|failed|error)' "$log" | tail -1)"
  if [ "$rc" != 0 ]; then
    failed=$((failed + 1))
    grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
  fi
done
echo "$failed of $runs runs failed (logs in .test-orders/)"
[ "$failed" = 0 ]
