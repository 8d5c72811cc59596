"""A store that lost its data is named, not served on empty (issue 44): a real redis-server
restarted without persistence under a real PS, the same restart with the data kept, a store
that never held a table, and the embedded store's files deleted under it."""

from __future__ import annotations

import shutil
import time

import grpc
import numpy as np
import pytest
from helpers import wait_until

from dynemb.ps_server.client import PSClient
from dynemb.ps_server.client.retry import RetryPolicy
from dynemb.ps_server.errors import DataLoss
from dynemb.testing.local_redis import RedisClusterProcesses, RedisProcess

LOST = "dynemb_ps_backend_lost_data"
ONCE = RetryPolicy(attempts=1)


def metric(ps, name: str) -> float:
    for line in ps.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the PS's /metrics")


@pytest.fixture
def redis(redis_binaries):
    """A redis-server of this test's own, without persistence (no AOF, no RDB saves)."""
    with RedisProcess() as proc:
        yield proc


def test_a_redis_restarted_empty_under_a_ps_is_named_and_not_served(redis, make_ps):
    ps = make_ps("--backend", redis.url, "--namespace", "lose")
    with PSClient(ps.address, timeout=10, retry=ONCE) as client:
        client.create_table("t", dim=4)
        client.push("t", np.arange(10), np.ones((10, 4), np.float32))
        time.sleep(2.5)  # the backend watch's next looks (every second) see the table and mark the store
        assert metric(ps, LOST) == 0
        redis.stop()
        redis.start()  # same port, no persistence: empty
        restarted = time.monotonic()
        # the backend watch finds it by itself, no call needed
        wait_until(lambda: metric(ps, LOST) == 1, timeout=10, what="the lost-data metric")
        print(f"named {time.monotonic() - restarted:.1f} s after the restart")
        with pytest.raises(DataLoss, match=r"lost namespace 'lose'.s data: its marker .* is gone") as info:
            client.pull("t", np.arange(10))
        assert info.value.code == grpc.StatusCode.DATA_LOSS and redis.address in str(info.value)
        # no table is created anew over the loss, nor any other call served on the empty store
        with pytest.raises(DataLoss):
            client.create_table("t", dim=4)
        with pytest.raises(DataLoss):
            client.list_tables()
    assert ps.log().count("LOST ITS DATA") == 1  # one line, not one per check or call


def test_a_cluster_master_restarted_empty_is_named(redis_binaries, make_ps):
    """On Cluster a master restarted without persistence comes back with its slots and none of
    their rows; the tables' metadata, on another master, still says they exist: only a marker on
    each master tells (pulls would answer the rows as never pushed)."""
    cluster = RedisClusterProcesses(masters=3).start()
    try:
        ps = make_ps("--backend", cluster.url, "--namespace", "clu")
        with PSClient(ps.address, timeout=30) as client:
            client.create_table("t", dim=4)
            client.push("t", np.arange(3000), np.ones((3000, 4), np.float32))
        time.sleep(2.5)
        meta = "dn:clu:tables"
        rows_only = [n for n in cluster.nodes if not _holds(n, meta)]  # masters without the metadata
        rows_only[0].stop()
        rows_only[0].start()  # its nodes.conf kept: back with its slots, empty
        restarted = time.monotonic()
        wait_until(lambda: metric(ps, LOST) == 1, timeout=30, what="the lost-data metric")
        print(f"named {time.monotonic() - restarted:.1f} s after the master's restart")
        assert "LOST ITS DATA" in ps.log() and "marker {dn:clu:marker." in ps.log()
    finally:
        cluster.close()


def _holds(node: RedisProcess, key: str) -> bool:
    """Whether this Cluster node serves the key's slot (others answer MOVED)."""
    import redis as redis_py

    try:
        return bool(node.client().exists(key))
    except redis_py.ResponseError:
        return False


def test_a_redis_restarted_with_its_data_is_served_on(redis, make_ps):
    ps = make_ps("--backend", redis.url, "--namespace", "keep")
    with PSClient(ps.address, timeout=30) as client:
        client.create_table("t", dim=4)
        client.push("t", np.arange(10), np.ones((10, 4), np.float32))
        time.sleep(2.5)
        redis.client().save()  # an RDB its restart loads again
        redis.stop()
        redis.start()
        time.sleep(2.5)
        assert not client.pull("t", np.arange(10)).missing.any()
    assert metric(ps, LOST) == 0 and "LOST ITS DATA" not in ps.log()


def test_a_redis_that_never_held_a_table_lost_nothing(redis, make_ps):
    ps = make_ps("--backend", redis.url, "--namespace", "new")
    time.sleep(2.5)
    redis.stop()
    redis.start()
    with PSClient(ps.address, timeout=30) as client:
        client.create_table("t", dim=4)  # a new store: its first table is no loss
        assert [t.schema.name for t in client.list_tables()] == ["t"]
    assert metric(ps, LOST) == 0


def test_the_embedded_stores_files_deleted_are_named_and_its_rows_kept(make_ps, tmp_path):
    folder = tmp_path / "store"
    first = make_ps("--backend", f"embedded://{folder}")
    with PSClient(first.address, timeout=30) as client:
        client.create_table("t", dim=4)
        client.push("t", np.arange(10), np.ones((10, 4), np.float32))
    assert first.stop() == 0  # saved: generation 1
    ps = make_ps("--backend", f"embedded://{folder}")
    time.sleep(2.5)
    assert metric(ps, LOST) == 0
    shutil.rmtree(folder)
    wait_until(lambda: metric(ps, LOST) == 1, timeout=10, what="the lost-data metric")
    assert "saved files in" in ps.log() and "LOST ITS DATA" in ps.log()
    with PSClient(ps.address, timeout=30) as client:  # its rows are in the process: served on
        assert not client.pull("t", np.arange(10)).missing.any()
    assert ps.stop() == 0
    again = make_ps("--backend", f"embedded://{folder}")  # and saved again at its shutdown
    with PSClient(again.address, timeout=30) as client:
        assert not client.pull("t", np.arange(10)).missing.any()
