"""Rows that expire, through real PS processes: the sweeper, its lease among the PSes over one
Redis, a PS killed mid-sweep, the RPCs, the metrics and the CLI (the stores' own rules:
test_lifecycle.py)."""

from __future__ import annotations

import json
import re
import signal
import time

import numpy as np
import pytest
from helpers import dynemb, wait_until

from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.lifecycle import Lifecycle

SWEEP = ("--sweep-every", "0.5")


def rows_of(ids: np.ndarray, dim: int = 4) -> np.ndarray:
    return np.repeat(ids.astype(np.float32)[:, None], dim, axis=1)


def metric(ps, name: str, table: str) -> float:
    m = re.search(rf'^{name}{{table="{re.escape(table)}"}} (\S+)$', ps.metrics_text(), re.M)
    return float(m.group(1)) if m else 0.0


def test_a_ps_sweeps_what_expired_and_keeps_what_is_touched(make_ps):
    ps = make_ps(*SWEEP)
    with PSClient(ps.address, timeout=30) as client:
        with pytest.raises(InvalidArgument, match="ttl 2 s is out of range"):
            client.create_table("bad", dim=4, lifecycle=Lifecycle(ttl_s=2))
        info = client.create_table("exp", dim=4, lifecycle=Lifecycle(ttl_s=4))
        assert info.lifecycle.ttl_s == 4 and info.lifecycle.touch_interval_s == 1
        ids = np.arange(1000, dtype=np.int64)
        client.push("exp", ids, rows_of(ids))
        resident = ids[:100]  # what a trainer would hold: touched within every touch interval

        def swept() -> bool:
            stored, every = client.touch("exp", resident)
            assert stored == 100 and every == 1
            return client.describe_table("exp").num_rows == 100

        wait_until(swept, timeout=30, interval=0.5, what="the rows nobody used swept")
        got = client.pull("exp", ids)
        assert not got.missing[:100].any() and got.missing[100:].all()
        np.testing.assert_array_equal(got.rows[:100], rows_of(resident))
        info = client.describe_table("exp")
        assert info.last_sweep is not None and info.last_sweep.deleted + info.last_sweep.scanned > 0
        deleted = client.read_deletions("exp")
        assert sorted(set(deleted.ids.tolist())) == ids[100:].tolist() and not deleted.gap
        assert client.read_deletions("exp", deleted.cursor).ids.size == 0
        assert metric(ps, "dynemb_ps_rows_expired_total", "exp") == 900
        assert "dynemb_ps_sweep_seconds_count" in ps.metrics_text()
        # a table set never to expire again keeps its rows however long nobody uses them
        info = client.set_lifecycle("exp", Lifecycle())
        assert not info.lifecycle.active
        time.sleep(5)
        assert client.describe_table("exp").num_rows == 100
        # a table dropped: its rows leave with it, which the log of drops says
        start = client.read_drops()
        client.drop_table("exp")
        drops = client.read_drops(start.cursor)
        assert [d.table for d in drops.drops] == ["exp"] and drops.drops[0].time > time.time() - 60


@pytest.mark.slow
def test_one_ps_sweeps_a_table_and_another_takes_over_when_it_dies(redis_url, redis_namespace, make_ps):
    """Two PSes over one Redis: one holds the table's sweep lease and sweeps; killed, its lease
    runs out and the other sweeps."""
    flags = ("--backend", redis_url, "--namespace", redis_namespace, *SWEEP)
    first, second = make_ps(*flags), make_ps(*flags)
    with PSClient(first.address, timeout=30) as client:
        client.create_table("shared", dim=4, lifecycle=Lifecycle(ttl_s=4))
        ids = np.arange(500, dtype=np.int64)
        client.push("shared", ids[:200], rows_of(ids[:200]))
        wait_until(lambda: client.describe_table("shared").num_rows == 0, timeout=30, interval=0.5, what="a sweep")
        time.sleep(1.5)  # passes a second apart: each PS has tried the table by now
        by_ps = [metric(ps, "dynemb_ps_rows_expired_total", "shared") for ps in (first, second)]
        assert sorted(by_ps) == [0, 200], by_ps  # one PS swept, the other did not
        holder, other = (first, second) if by_ps[0] else (second, first)
    holder.stop(signal.SIGKILL)
    with PSClient(other.address, timeout=30) as client:
        client.push("shared", ids[200:], rows_of(ids[200:]))
        wait_until(lambda: client.describe_table("shared").num_rows == 0, timeout=40, interval=0.5, what="a takeover")
        assert metric(other, "dynemb_ps_rows_expired_total", "shared") == 300


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["standalone", "cluster"])
def test_a_ps_killed_mid_sweep_loses_no_row_that_had_not_expired(request, backend, redis_namespace, make_ps):
    """kill -9 of the sweeping PS while it deletes a big table's expired rows: every row that had
    not expired is there, with its values, and none of them was even logged as deleted."""
    url = request.getfixturevalue("redis_url" if backend == "standalone" else "redis_cluster")
    flags = ("--backend", url if isinstance(url, str) else url.url, "--namespace", redis_namespace)
    loader = make_ps(*flags, "--sweep-every", "0")  # sweeps nothing
    ttl = 20
    old, live = np.arange(150_000, dtype=np.int64), np.arange(150_000, 200_000, dtype=np.int64)
    with PSClient(loader.address, timeout=60) as client:
        # a ttl long enough that the live rows outlast a PS started and a sweep begun on a loaded
        # machine (10 s was too short beside a parallel run's other tests)
        client.create_table("big", dim=4, expected_rows=200_000, lifecycle=Lifecycle(ttl_s=ttl))
        for lo in range(0, len(old), 20_000):
            client.push("big", old[lo : lo + 20_000], rows_of(old[lo : lo + 20_000]))
        time.sleep(ttl - 3)
        client.push("big", live, rows_of(live))  # ttl s after this, they too expire: check before
        pushed_live = time.time()
        time.sleep(3.5)
        sweeper = make_ps(*flags, *SWEEP)
        wait_until(
            lambda: 0 < client.describe_table("big").num_rows < 200_000, timeout=10, interval=0.01, what="a sweep"
        )
        sweeper.stop(signal.SIGKILL)
        got = client.pull("big", live)
        assert time.time() - pushed_live < ttl, "the check came after the live rows expired: the test is too slow"
        assert not got.missing.any()
        np.testing.assert_array_equal(got.rows, rows_of(live))
        assert client.describe_table("big").num_rows >= len(live)
        log = client.read_deletions("big")
        assert not np.isin(live, log.ids).any()  # nothing live was even a candidate


def test_cli_sets_and_shows_a_tables_lifecycle(embedded_ps):
    at = ("--ps", embedded_ps.address)
    assert "--sweep-every" in dynemb("ps", "serve", "--help").stdout
    assert "--ttl" in dynemb("ps", "create-table", "--help").stdout
    out = dynemb("ps", "create-table", "life", "--dim", "2", "--ttl", "30d", "--max-rows", "1e6", *at)
    assert out.returncode == 0, out.stderr
    assert "ttl=30d max_rows=1000000 touch_every=180h" in out.stdout
    out = dynemb("ps", "lifecycle", "life", "--ttl", "12h", *at)
    assert out.returncode == 0 and "life: ttl=12h max_rows=none touch_every=3h" in out.stdout, out
    doc = json.loads(dynemb("ps", "describe", "life", *at).stdout)
    assert doc["lifecycle"]["ttl_s"] == 12 * 3600 and doc["lifecycle"]["touch_every_s"] == 3 * 3600
    assert "last_sweep" in doc and doc["expired_reads"] == 0  # a sweep of nothing, or none yet
    out = dynemb("ps", "lifecycle", "life", *at)
    assert out.returncode == 1 and "give --ttl" in out.stderr and "Traceback" not in out.stderr
    out = dynemb("ps", "lifecycle", "life", "--ttl", "1", *at)
    assert out.returncode == 1 and "ttl 1 s is out of range" in out.stderr
    out = dynemb("ps", "lifecycle", "life", "--ttl", "soon", *at)
    assert out.returncode == 2 and "duration" in out.stderr
    assert dynemb("ps", "lifecycle", "life", "--never", *at).stdout.strip() == "life: rows never expire"
    assert "lifecycle" not in json.loads(dynemb("ps", "describe", "life", *at).stdout)
