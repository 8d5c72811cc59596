"""A Redis table's layout by default: sized by the rows it declares (expected_rows), its buckets
kept as listpacks by the store raising Redis's listpack limits, and tables of huge bucket counts
never listed bucket by bucket. Each test runs a redis-server of its own (Redis's own config),
as the limits are the whole server's."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from helpers import dynemb, wait_until

from dynemb.ps_server.backends import redis_config, redis_keys
from dynemb.ps_server.backends.redis_keys import MAX_BUCKETS, buckets_for, dropped_key, meta_key
from dynemb.ps_server.backends.redis_store import RedisStore
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import MAX_EXPECTED_ROWS, TableSchema
from dynemb.testing.local_redis import RedisClusterProcesses, RedisProcess

LIMITS = (redis_config.VALUE, redis_config.ENTRIES)


def limits(proc: RedisProcess) -> dict[str, int]:
    with proc.client() as r:
        return {name: int(r.config_get(name)[name]) for name in LIMITS}


def bucket_keys_there(proc: RedisProcess, namespace: str, table: str) -> list[bytes]:
    with proc.client() as r:
        # its bucket keys: beside them, its deletion log and sweep keys go with the dropped table's sweep
        return list(r.scan_iter(match=f"dn:{namespace}:{table}:*r:{{*".encode(), count=10000))


@pytest.mark.slow
def test_a_declared_table_is_sized_by_its_rows_and_stays_compact(redis_process):
    """50,000 rows of 512 B declared: 3,125 buckets of ~16 rows, each a listpack, <= 1.2x raw."""
    proc = redis_process()
    assert limits(proc)[redis_config.VALUE] < 512  # Redis's default (64): 512-byte rows make hashtables
    store = RedisStore.from_url(proc.url, namespace="lay")
    n = 50_000
    schema = TableSchema("emb", dim=64, state_width=64, expected_rows=n)  # 512-byte rows
    with proc.client() as r:
        before = r.info("memory")["used_memory"]
    assert store.create_table(schema)
    assert store.num_buckets_of("emb") == n // 16 == buckets_for(n, 16, 4096)
    assert limits(proc)[redis_config.VALUE] >= 512
    rng = np.random.default_rng(5)
    ids = rng.choice(1 << 62, size=n, replace=False).astype(np.int64)
    rows = rng.random((n, schema.width), dtype=np.float32)
    for lo in range(0, n, 16384):
        store.push("emb", ids[lo : lo + 16384], rows[lo : lo + 16384])
    with proc.client() as r:
        used = r.info("memory")["used_memory"] - before
        keys = bucket_keys_there(proc, "lay", "emb")
        assert len(keys) > 0.99 * (n // 16)
        pipe = r.pipeline(transaction=False)
        for key in keys:
            pipe.object("encoding", key)
        assert set(pipe.execute()) == {b"listpack"}
    raw = 8 + schema.row_bytes
    assert used / n <= 1.2 * raw, f"{used / n:.1f} B a row, {used / n / raw:.3f}x raw"
    got, found = store.pull("emb", ids[:1000])
    assert found.all() and np.array_equal(got, rows[:1000])
    # the declared rows are the table's, shown with it; creating it again with another count is
    # no conflict and changes nothing
    assert store.schema("emb").expected_rows == n
    assert not store.create_table(TableSchema("emb", dim=64, state_width=64, expected_rows=10))
    assert store.num_buckets_of("emb") == n // 16 and store.schema("emb").expected_rows == n
    # a table that declares nothing gets the store's bucket count
    store.create_table(TableSchema("plain", dim=4))
    assert store.num_buckets_of("plain") == 4096 and store.schema("plain").expected_rows == 0
    store.close()


def test_bucket_counts_are_bounded():
    assert buckets_for(1, 16, 4096) == 1
    assert buckets_for(17, 16, 4096) == 2
    assert buckets_for(10**10, 16, 4096) == MAX_BUCKETS == 1 << 28  # ~37 rows a bucket
    assert buckets_for(MAX_EXPECTED_ROWS, 1, 4096) == MAX_BUCKETS
    assert buckets_for(0, 16, 99) == 99
    with pytest.raises(InvalidArgument, match=r"expected_rows must be an integer in \[0, 2\^48"):
        TableSchema("t", dim=1, expected_rows=MAX_EXPECTED_ROWS + 1)
    with pytest.raises(InvalidArgument, match="expected_rows"):
        TableSchema("t", dim=1, expected_rows=-1)
    # not part of the schema's identity
    assert TableSchema("t", dim=1, expected_rows=5) == TableSchema("t", dim=1)
    assert "expected_rows" not in TableSchema("t", dim=1, expected_rows=5).to_dict()
    assert TableSchema.from_proto(TableSchema("t", dim=1, expected_rows=5).to_proto()).expected_rows == 5


def test_listpack_off_leaves_redis_config_alone(redis_process):
    proc = redis_process()
    before = limits(proc)
    store = RedisStore.from_url(proc.url, namespace="off", listpack="off")
    store.create_table(TableSchema("emb", dim=64, state_width=64, expected_rows=1000))
    store.push("emb", np.arange(100, dtype=np.int64), np.ones((100, 128), np.float32))
    store.check_config()
    assert limits(proc) == before
    with proc.client() as r:  # and so 512-byte rows are hashtables
        assert {r.object("encoding", k) for k in bucket_keys_there(proc, "off", "emb")} == {b"hashtable"}
    store.close()
    with pytest.raises(InvalidArgument, match="listpack must be one of"):
        RedisStore.from_url(proc.url, listpack="on")


def test_limits_are_raised_never_lowered(redis_process):
    proc = redis_process([f"{redis_config.VALUE} 4096", f"{redis_config.ENTRIES} 64"])
    store = RedisStore.from_url(proc.url, namespace="up", rows_per_bucket=32)
    store.create_table(TableSchema("emb", dim=64, state_width=64, expected_rows=1000))
    assert limits(proc) == {redis_config.VALUE: 4096, redis_config.ENTRIES: 8 * 32}
    # a Redis that lost them (restarted: CONFIG SET is not persisted) gets them again
    with proc.client() as r:
        r.config_set(redis_config.ENTRIES, 128)
    store.create_table(TableSchema("other", dim=8, expected_rows=1000))
    assert limits(proc)[redis_config.ENTRIES] == 8 * 32
    store.close()


def test_the_ps_flags_are_checked():
    from dynemb.ps_server.server import ServeConfig

    with pytest.raises(ValueError, match="--redis-listpack must be auto or off"):
        ServeConfig(redis_listpack="on")
    with pytest.raises(ValueError, match=r"--redis-rows-per-bucket must be in \[1, 65536\]"):
        ServeConfig(redis_rows_per_bucket=0)
    with pytest.raises(InvalidArgument, match=r"rows_per_bucket must be an integer in \[1, 65536\]"):
        RedisStore.from_url("redis://127.0.0.1:1/0", rows_per_bucket=1 << 17)


@pytest.mark.parametrize("refusal", ["renamed", "acl"])
def test_a_redis_that_refuses_config_gets_one_warning_and_works(redis_process, refusal, caplog, request):
    if refusal == "renamed":
        proc = redis_process(['rename-command CONFIG ""'])
        url = proc.url
    else:  # an ACL user without +@admin (CONFIG is an admin command)
        acl = ["user ps on >pw ~* &* +@all -@admin", "user default off"]
        proc = RedisProcess(acl, client_kwargs={"username": "ps", "password": "pw"}).start()
        request.addfinalizer(proc.close)
        url = f"redis://ps:pw@{proc.address}/0"
    store = RedisStore.from_url(url, namespace="no")
    with caplog.at_level(logging.INFO, logger="dynemb.ps"):
        for name in ("a", "b"):
            store.create_table(TableSchema(name, dim=64, state_width=64, expected_rows=1000))
            store.push(name, np.arange(10, dtype=np.int64), np.full((10, 128), 2, np.float32))
            rows, found = store.pull(name, np.arange(10, dtype=np.int64))
            assert found.all() and (rows == 2).all()
        store.check_config()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    # 516: the 512-byte row and its 4-byte stamp
    assert "refused CONFIG" in warnings[0] and "`hash-max-listpack-value 516`" in warnings[0], warnings[0]
    store.close()


def test_a_table_of_older_metadata_reads_as_before(redis_process):
    """Metadata written before expected_rows existed: its bucket count stands, nothing declared."""
    proc = redis_process()
    schema = TableSchema("old", dim=4)
    meta = {"format": 1, "num_buckets": 64, "schema": schema.to_dict(), "created": "0123456789abcdef"}
    with proc.client() as r:
        r.hset(meta_key("ns"), "old", json.dumps(meta, sort_keys=True))  # and no row count, as then
    store = RedisStore.from_url(proc.url, namespace="ns")
    assert store.num_buckets_of("old") == 64 and store.schema("old") == schema
    assert store.schema("old").expected_rows == 0
    ids = np.arange(500, dtype=np.int64)
    store.push("old", ids, np.ones((500, 4), np.float32))
    assert store.num_rows("old") == 500
    assert len(bucket_keys_there(proc, "ns", "old")) == 64  # 500 ids over 64 buckets: all of them
    assert not store.create_table(TableSchema("old", dim=4, expected_rows=10**6))  # no conflict
    assert store.num_buckets_of("old") == 64
    store.close()


@pytest.mark.slow
def test_a_table_of_millions_of_buckets_is_not_visited_bucket_by_bucket(redis_process):
    """2^24 buckets, 3,000 rows: count, export, clear and drop take seconds, not the minutes that
    16M commands would (and no 16M-entry list is made)."""
    proc = redis_process()
    store = RedisStore.from_url(proc.url, namespace="big", rows_per_bucket=1)
    store.create_table(TableSchema("huge", dim=2, expected_rows=1 << 24))
    assert store.num_buckets_of("huge") == 1 << 24
    ids = np.arange(3000, dtype=np.int64)
    rows = np.arange(6000, dtype=np.float32).reshape(3000, 2)
    store.push("huge", ids, rows)
    t0 = time.monotonic()
    with proc.client() as r:
        r.hdel(b"{" + meta_key("big") + b"}:rows", "huge")  # recounted bucket by bucket
    assert store.num_rows("huge") == 3000
    got = sorted((int(i), tuple(row)) for c_ids, c_rows in store.export("huge", 700) for i, row in zip(c_ids, c_rows))
    assert got == [(i, (2.0 * i, 2.0 * i + 1)) for i in range(3000)]
    assert store.clear("huge") == 3000 and store.num_rows("huge") == 0
    store.push("huge", ids[:100], rows[:100])
    assert store.drop_table("huge") == 100
    assert time.monotonic() - t0 < 30
    assert bucket_keys_there(proc, "big", "huge") == []
    store.close()


@pytest.mark.slow
def test_the_ps_raises_the_limits_for_its_tables_at_start_and_shares_out_declared_rows(redis_process, make_ps):
    proc = redis_process()
    # a table made with the config left alone (e.g. by a PS of --redis-listpack off)
    off = make_ps("--backend", proc.url, "--namespace", "srv", "--redis-listpack", "off")
    with PSClient(off.address, timeout=30) as client:
        client.create_table("wide", dim=128, state_width=128, expected_rows=3200)  # 1 KiB rows
        assert client.describe_table("wide").schema.expected_rows == 3200
    assert limits(proc)[redis_config.VALUE] < 1024
    # a PS of the defaults raises the limit for it at its start, and says so
    ps = make_ps("--backend", proc.url, "--namespace", "srv")
    wait_until(lambda: limits(proc)[redis_config.VALUE] >= 1024, timeout=30, what="limit raised at start")
    wait_until(lambda: "raised hash-max-listpack-value" in ps.log(), timeout=10, what="the INFO line")
    # two PS shards (separate namespaces): each asked for its share, describe sums them
    other = make_ps("--backend", proc.url, "--namespace", "srv2")
    with PSClient([ps.address, other.address], timeout=30) as client:
        client.create_table("split", dim=8, expected_rows=3201)
        assert client.describe_table("split").schema.expected_rows == 3201
        assert [t.schema.expected_rows for t in client.list_tables() if t.schema.name == "split"] == [3201]
    for namespace, share in (("srv", 1601), ("srv2", 1600)):
        store = RedisStore.from_url(proc.url, namespace=namespace, listpack="off")
        assert store.schema("split").expected_rows == share
        assert store.num_buckets_of("split") == -(-share // 16)
        store.close()


@pytest.mark.slow
def test_the_cli_declares_expected_rows(redis_process, make_ps, tmp_path):
    proc = redis_process()
    ps = make_ps("--backend", proc.url, "--namespace", "cli")
    at = ("--ps", ps.address)
    dynemb("ps", "create-table", "t", "--dim", "8", "--expected-rows", "1000", *at, check=True)
    assert json.loads(dynemb("ps", "describe", "t", *at, check=True).stdout)["expected_rows"] == 1000
    with PSClient(ps.address, timeout=30) as client:
        client.push("t", np.arange(300, dtype=np.int64), np.ones((300, 8), np.float32))
    dynemb("table", "export", "--table", "t", "--out", str(tmp_path), "--quiet", *at, check=True)
    # imported as a new table: sized for the folder's rows, or for what --expected-rows says
    dynemb("table", "import", str(tmp_path / "t"), "--as", "t2", "--quiet", *at, check=True)
    dynemb("table", "import", str(tmp_path / "t"), "--as", "t3", "--expected-rows", "64000", "--quiet", *at, check=True)
    store = RedisStore.from_url(proc.url, namespace="cli", listpack="off")
    assert [store.num_buckets_of(t) for t in ("t", "t2", "t3")] == [63, 19, 4000]
    assert store.schema("t2").expected_rows == 300
    store.close()


def test_the_trainer_declares_each_tables_universe():
    from dynemb.trainer.config import DataConfig, TrainConfig
    from dynemb.trainer.schemas import ps_schema

    cfg = TrainConfig(data=DataConfig(universe=123_456))
    assert ps_schema(cfg, 0).expected_rows == 123_456


@pytest.mark.slow
def test_every_cluster_master_gets_the_limits_and_huge_tables_scan_them_all(redis_binaries, caplog, monkeypatch):
    cluster = RedisClusterProcesses(masters=3).start()
    try:
        store = RedisStore.from_url(cluster.url, namespace="cl", rows_per_bucket=1)
        with caplog.at_level(logging.INFO, logger="dynemb.ps"):
            store.create_table(TableSchema("wide", dim=256, expected_rows=1 << 21))  # 1 KiB rows, 2^21 buckets
        values = [int(n.client().config_get(redis_config.VALUE)[redis_config.VALUE]) for n in cluster.nodes]
        assert values == [1024 + 4] * 3  # the row and its stamp
        assert sum("raised hash-max-listpack-value" in r.getMessage() for r in caplog.records) == 1
        ids = np.arange(2000, dtype=np.int64)
        rows = np.ones((2000, 256), np.float32)
        store.push("wide", ids, rows)
        assert all(n.client().dbsize() > 300 for n in cluster.nodes)  # rows on every master
        t0 = time.monotonic()
        assert sum(len(i) for i, _ in store.export("wide", 500)) == 2000
        assert store.drop_table("wide") == 2000  # SCAN on every master finds every bucket
        assert time.monotonic() - t0 < 30  # not 2M commands each
        # no key left, metadata neither: only the drop's record, for the sweep of what late writes
        # leave, and the log of drops
        left = sorted(k for n in cluster.nodes for k in n.client().keys())
        assert left == sorted([dropped_key("cl"), redis_keys.drops_key("cl")])
        # the drop's own sweep (nothing due yet) ends first: a create while it runs starts none
        store._sweeper.join(timeout=60)
        monkeypatch.setattr(redis_keys, "SWEEP_DROPPED_AFTER_S", 0.0)
        store.create_table(TableSchema("next", dim=2))  # sweeps it: by SCAN too, not 2M commands
        store._sweeper.join(timeout=60)  # the sweep runs on a thread of its own
        assert time.monotonic() - t0 < 30
        assert dropped_key("cl") not in [k for n in cluster.nodes for k in n.client().keys()]
        store.close()
    finally:
        cluster.close()
