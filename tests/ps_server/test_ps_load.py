"""bench/ps_load.py: the load test runs end to end on real processes, and its checks can fail.

- A short run (redis-server and PS started by the bench itself) exits 0 with zero errors
  and figures that agree with one another.
- Against a PS started here (the --ps path), calls given too short a deadline are counted
  by status code and the run exits 1 naming them.
- The memory-growth rule on made-up series: a leak fails it, spikes in flight do not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from bench.load_observe import growth

pytestmark = pytest.mark.slow


def run_bench(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "ps_load.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ps_load.py"), "--json", str(out), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert json.loads(out.read_text()) == result  # the file holds the same result as the line
    return done, result


def test_short_run_passes_with_zero_errors_and_sane_figures(tmp_path):
    done, r = run_bench(
        "--clients",
        "4",
        "--procs",
        "2",
        "--duration",
        "4",
        "--batch",
        "256",
        "--id-space",
        "4000",
        "--pull-fraction",
        "0.5",
        "--warmup-fraction",
        "0.5",
        tmp_path=tmp_path,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert r["ok"] and r["failures"] == [] and "PASS:" in done.stdout
    assert r["errors_total"] == 0 and r["errors"] == {}
    assert r["ps_metrics_errors"] == {}  # read from the PS's /metrics, before and after
    assert r["requests"]["pull"] > 0 and r["requests"]["push"] > 0
    assert r["requests"]["all"] == r["requests"]["pull"] + r["requests"]["push"]
    assert 3.9 <= r["seconds"] < 4 + 30  # the run lasted its duration, plus at most one call's timeout
    assert r["requests_per_s"] == pytest.approx(r["requests"]["all"] / r["seconds"], rel=0.01)
    assert r["rows_per_s"] == pytest.approx(r["requests_per_s"] * 256, rel=0.01)
    for method in ("pull", "push", "all"):
        lat = r["latency_ms"][method]
        assert lat["count"] == r["requests"][method]
        assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"] < 30_000
    assert r["rows_stored"] == {"before": 4000, "after": 4000}
    for name in ("ps_rss", "redis_used_memory"):
        mem = r["memory"][name]
        assert mem["at_warmup_end_bytes"] > 1 << 20 and mem["at_end_bytes"] > 1 << 20
        assert mem["growth"] == pytest.approx(mem["at_end_bytes"] / mem["at_warmup_end_bytes"] - 1, abs=1e-3)
        assert mem["growth"] <= mem["limit"] == 0.10
    assert r["memory_samples"] >= 4
    assert r["cpu_seconds"]["ps"] > 0 and r["cpu_seconds"]["redis"] > 0 and r["cpu_seconds"]["clients"] > 0


@pytest.mark.cluster
def test_a_run_on_a_cluster_it_starts_sums_redis_over_the_masters(tmp_path, redis_binaries):
    args = ["--clients", "2", "--procs", "1", "--duration", "4", "--batch", "128", "--id-space", "2000"]
    done, r = run_bench(*args, "--cluster", "3", "--warmup-fraction", "0.5", tmp_path=tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert r["ok"] and r["errors_total"] == 0 and "over redis+cluster://" in r["target"]
    assert r["rows_stored"] == {"before": 2000, "after": 2000}
    # three masters' used_memory (an empty one alone holds about 1 MiB) and CPU, summed
    assert r["memory"]["redis_used_memory"]["at_end_bytes"] > 3 << 20
    assert r["cpu_seconds"]["redis"] > 0
    bad = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ps_load.py"), "--cluster", "3", "--redis", "redis://x:1/0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--cluster" in bad.stderr


def test_failed_calls_are_counted_by_status_code_and_fail_the_run(tmp_path, redis_server, redis_namespace, make_ps):
    ps = make_ps("--backend", redis_server.url, "--namespace", redis_namespace)
    done, r = run_bench(
        "--ps",
        ps.address,
        "--ps-pid",
        str(ps.proc.pid),
        "--ps-metrics",
        f"http://127.0.0.1:{ps.metrics_port}/metrics",
        "--redis",
        redis_server.url,
        "--clients",
        "2",
        "--procs",
        "1",
        "--duration",
        "2",
        "--sample-seconds",
        "0.5",
        "--batch",
        "2048",
        "--id-space",
        "4096",
        "--timeout",
        "0.003",
        tmp_path=tmp_path,
    )
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert not r["ok"]
    # 3 ms is far too short for 2,048 rows through the PS and Redis: those calls fail as such
    assert r["errors"].get("DEADLINE_EXCEEDED", 0) > 0
    assert r["errors_total"] == sum(r["errors"].values())
    by_method = r["errors_by_method"]
    assert sum(by_method["pull"].values()) + sum(by_method["push"].values()) == r["errors_total"]
    failure = next(f for f in r["failures"] if "calls failed" in f)
    assert failure.startswith(f"{r['errors_total']:,} calls failed") and "DEADLINE_EXCEEDED" in failure
    assert f"FAIL: {failure}" in done.stdout
    assert r["memory"]["ps_rss"] is not None and r["memory"]["redis_used_memory"] is not None  # --ps-pid, --redis


def test_memory_growth_rule_fails_a_leak_and_ignores_spikes():
    t = np.arange(0, 61, 1.0)
    steady = np.full_like(t, 200e6)
    steady[[15, 40, 59]] = 260e6  # messages in flight at a sampling instant
    g = growth(t, steady, warmup_end=12, end=60, window=6)
    assert g.ratio == pytest.approx(0.0) and g.peak == 260e6
    leak = 200e6 + 1e6 * t  # +1 MB a second: +48 MB from warm-up's end to the end
    g = growth(t, leak, warmup_end=12, end=60, window=6)
    assert g.at_warmup_end == pytest.approx(200e6 + 9.5e6) and g.at_end == pytest.approx(200e6 + 57.5e6)
    assert g.ratio == pytest.approx(48e6 / 209.5e6) and g.ratio > 0.10
    with pytest.raises(ValueError, match="no memory samples"):
        growth([], [], warmup_end=1, end=2, window=1)
