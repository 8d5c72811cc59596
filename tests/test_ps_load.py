"""bench/ps_load.py, briefly: a few clients for a few seconds against a real PS over a real
Redis; it must finish with no errors, sane figures and exit 0."""

from __future__ import annotations

import json
import subprocess
import sys

from dynemb.local import REPO


def test_a_short_load_run_passes_its_own_checks(tmp_path):
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, "bench/ps_load.py", "--clients", "6", "--procs", "2", "--seconds", "5",
                          "--ids", "4000", "--batch", "64", "--no-progress", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["failed"] == []
    assert r["requests"] > 50 and r["rows_per_s"] > 0
    for op in ("pull", "push"):
        assert r[op]["n"] > 0 and 0 < r[op]["p50_ms"] <= r[op]["p99_ms"] <= r[op]["max_ms"]
    assert r["ps_rss_mib"][0] > 10 and r["redis_used_memory_mib"][0] > 1  # 4000 rows of 512 B are in Redis
    assert "p99 ms" in run.stdout and "errors: none" in run.stdout


def test_bad_settings_are_refused():
    run = subprocess.run([sys.executable, "bench/ps_load.py", "--clients", "0"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--clients" in run.stderr
