"""bench/ps_load.py: the load test runs end to end on real processes, and its checks can fail.

- A short run (redis-server and PS started by the bench itself) exits 0 with zero errors
  and figures that agree with one another.
- Against a PS started here (the --ps path), calls given too short a deadline are counted
  by status code and the run exits 1 naming them.
- The memory-growth rule on made-up series: a leak fails it, spikes in flight do not.
- --ttl: a table whose rows expire, fed new ids, settles within its bounds with no live row
  lost, and empties after; the steady-size rule on made-up series fails a table that keeps
  growing, one that lost rows, and one that swings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from bench.load_observe import Lifetimes, growth, steady_size

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


def test_a_ttl_table_fed_new_ids_settles_at_its_steady_size(tmp_path):
    # Redis's memory follows the rows stored, which may move within the steady-size band (1.67
    # here, judged below): its 10% default failed once on a loaded machine (rows 9,984 at
    # warm-up's end, 11,681 at the end: +15.7%), so it is given the band; the PS's RSS keeps 10%
    done, r = run_bench(
        *("--ttl", "4", "--sweep-every", "0.5", "--push-rate", "2000", "--duration", "24"),
        *("--clients", "2", "--procs", "1", "--batch", "256", "--id-space", "10000", "--max-redis-growth", "0.67"),
        tmp_path=tmp_path,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert r["ok"] and r["failures"] == [] and "PASS:" in done.stdout and "no live row lost" in done.stdout
    assert r["errors_total"] == 0 and r["ps_metrics_errors"] == {}
    assert r["requests"]["pull"] > 0 and r["requests"]["push"] > 0
    e = r["expiry"]
    st = e["steady"]
    assert e["pass_every_s"] == 0.5 and e["pull_window_s"] == 2
    assert e["new_ids_pushed"] == r["requests"]["push"] * 256
    assert st["new_ids_per_s"] == pytest.approx(2000, rel=0.2)  # the rate asked, if the box keeps up
    assert st["samples"] >= 5 and st["bounds_rows"][0] <= st["steady_rows"] <= st["bounds_rows"][1]
    assert st["max_over_min"] <= st["band"] and st["kept_share"] <= 0.5
    # the steady size is rate x lifetime: between TTL and the longest a row stays
    assert 4 * st["new_ids_per_s"] * 0.8 <= st["steady_rows"] <= st["lifetime_s"]["most"] * st["new_ids_per_s"] * 1.2
    assert "steady size:" in done.stdout and "bounds:" in done.stdout and "; rows stored: " in done.stdout
    # after the load every row expired and was deleted by a sweep, none lost on the way
    drain = e["drain"]
    assert drain["rows_left"] == 0 and drain["rows_expired"] == drain["rows_pushed"] == e["new_ids_pushed"]
    assert r["memory_skipped"] is None and r["memory_warmup_end_s"] >= st["lifetime_s"]["most"]
    assert r["memory"]["ps_rss"]["growth"] <= 0.10


def test_steady_size_rule_fails_growth_loss_and_swings():
    life = Lifetimes(ttl=10, pass_every=1.25, poll=0.25, pass_seconds=0.5)
    t = np.arange(0, 81, 1.0)
    pushed = 1000.0 * t  # 1,000 new ids a second
    # settled: each row stays 10 s + a saw-tooth of the passes (0 to 2 s)
    settled = np.minimum(t, 10 + (t % 2)) * 1000
    s = steady_size(t, settled.tolist(), pushed, end=80, lifetimes=life, in_flight=0)
    assert s.failures == [] and s.samples == 21
    assert s.rate == pytest.approx(1000) and s.expected == pytest.approx(11_250)
    assert s.least == pytest.approx(10_000) and s.most == pytest.approx(life.most * 1000)
    assert s.least <= s.median <= s.most
    assert abs(s.kept) < 0.1
    # no rows ever expire: the table keeps growing, over its bounds
    s = steady_size(t, pushed.tolist(), pushed, end=80, lifetimes=life)
    assert s.kept == pytest.approx(1.0) and any("still grew" in f for f in s.failures)
    assert any("is over the" in f for f in s.failures)
    # a sweeper falling behind: passes as long as the table is big, so the bounds widen with them,
    # but the table still keeps 60% of its new ids
    slow = dataclasses.replace(life, pass_seconds=40)
    s = steady_size(t, (600 * t + 10_000).tolist(), pushed, end=80, lifetimes=slow)
    assert not any("is over the" in f for f in s.failures) and any("still grew" in f for f in s.failures)
    # rows lost: fewer than were pushed in the last TTL
    s = steady_size(t, (settled * 0.7).tolist(), pushed, end=80, lifetimes=life)
    assert any("rows were lost" in f for f in s.failures)
    # swings past the band (here, every other count read low), and counts not read
    swinging = settled * np.where(t % 2 == 0, 1.0, 0.6)
    assert any("did not settle" in f for f in steady_size(t, swinging.tolist(), pushed, 80, life).failures)
    unread = [None] * len(t)
    assert "too few to judge" in steady_size(t, unread, pushed, end=80, lifetimes=life).failures[0]
