"""Rows through real PS processes: every dtype, both backends, many shards, chunking, export/import, restart."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from helpers import wait_until

from dynemb.ps_server.backends.embedded import STALL_ENV
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.hashing import shard_of
from dynemb.ps_server.schema import Initializer, TableSchema
from dynemb.testing.local_ps import LocalPS

DTYPES = {"fp32": np.float32, "fp16": np.float16}


def random_rows(rng, schema: TableSchema, n: int) -> np.ndarray:
    if schema.dtype == "bf16":  # bf16 travels as its 16 raw bits
        return rng.integers(0, 1 << 16, (n, schema.width), dtype=np.uint16)
    return rng.standard_normal((n, schema.width)).astype(DTYPES[schema.dtype])


def round_trip(ps: PSClient, table: str, dtype: str, n: int = 3000, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    init = Initializer("uniform", -0.1, 0.1, seed=5, state_init=0.5)
    info = ps.create_table(table, dim=12, state_width=3, dtype=dtype, initializer=init)
    assert info.num_rows == 0 and info.schema.dtype == dtype
    ids = rng.choice(1 << 62, n, replace=False).astype(np.int64) - (1 << 61)
    ids[:4] = [0, -1, 256, (1 << 63) - 1]  # bytes that end in zeros, the sign bit, the extremes

    fresh = ps.pull(table, ids)
    assert fresh.missing.all()
    again = ps.pull(table, ids[::-1])
    assert np.array_equal(again.rows[::-1], fresh.rows), "missing rows must initialise the same each pull"
    assert fresh.rows.dtype == info.schema.np_dtype and fresh.rows.shape == (n, 15)
    if dtype != "bf16":
        assert np.all(np.abs(fresh.embeddings.astype(np.float32)) <= 0.1)
        assert np.all(fresh.state == np.asarray(0.5, dtype=fresh.rows.dtype))

    rows = random_rows(rng, info.schema, n)
    assert ps.push(table, ids, rows) == n
    got = ps.pull(table, ids)
    assert not got.missing.any()
    assert np.array_equal(got.rows, rows)
    mixed = np.concatenate([ids[:10], np.array([123456789, 987654321], dtype=np.int64)])
    got = ps.pull(table, mixed)
    assert got.missing.tolist() == [False] * 10 + [True, True]
    assert np.array_equal(got.rows[:10], rows[:10])
    assert ps.describe_table(table).num_rows == n
    assert ps.delete(table, np.concatenate([ids[:100], [424242]])) == 100
    assert ps.pull(table, ids[:100]).missing.all()
    assert np.array_equal(ps.pull(table, ids[100:]).rows, rows[100:])
    assert ps.describe_table(table).num_rows == n - 100
    assert table in [t.schema.name for t in ps.list_tables()]
    assert ps.drop_table(table) == n - 100
    assert table not in [t.schema.name for t in ps.list_tables()]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "bytes"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_embedded(embedded_ps, dtype, shared_memory):
    # rows through shared memory (the default on one host, dynemb/ps_server/shm.py) and as bytes
    with PSClient(embedded_ps.address, shared_memory=shared_memory) as ps:
        round_trip(ps, f"rt_{dtype}_{shared_memory}", dtype)
        assert (ps._pools[0] is not None) == shared_memory


@pytest.fixture(scope="module")
def redis_ps(redis_url):
    ps = LocalPS("--backend", redis_url, "--namespace", "rows_tests", "--not-serving-seconds", "0").start()
    yield ps
    ps.close()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_redis(redis_ps, dtype):
    with PSClient(redis_ps.address) as ps:
        round_trip(ps, f"rt_{dtype}", dtype, seed=1)


@pytest.mark.cluster
def test_round_trip_redis_cluster(redis_cluster, make_ps):
    ps_proc = make_ps("--backend", redis_cluster.url, "--namespace", "cl")
    with PSClient(ps_proc.address) as ps:
        assert ps.stats()[0].backend == "redis-cluster"
        round_trip(ps, "rt_cluster", "fp32", n=20000, seed=2)


def test_repeated_id_in_a_push_keeps_its_last_row(embedded_client):
    embedded_client.create_table("dups", dim=2)
    ids = np.array([7, 8, 7, 9, 7], dtype=np.int64)
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    embedded_client.push("dups", ids, rows)
    assert np.array_equal(embedded_client.pull("dups", [7, 8, 9]).rows, rows[[4, 1, 3]])


@pytest.mark.slow
def test_many_shards_each_ps_holds_its_own_ids(make_ps):
    procs = [make_ps() for _ in range(3)]
    addresses = [p.address for p in procs]
    rng = np.random.default_rng(3)
    ids = rng.choice(1 << 50, 50000, replace=False).astype(np.int64)
    rows = rng.standard_normal((len(ids), 8)).astype(np.float32)
    with PSClient(addresses, chunk_bytes=256 << 10) as ps:
        ps.create_table("sharded", dim=6, state_width=2)
        assert ps.push("sharded", ids, rows) == len(ids)
        got = ps.pull("sharded", ids)
        assert np.array_equal(got.rows, rows) and not got.missing.any()
        assert ps.describe_table("sharded").num_rows == len(ids)
        exported = list(ps.export("sharded"))
        copy = TableSchema("sharded_copy", 6, 2)
        assert ps.import_rows(copy, exported) == len(ids)  # one stream per PS, each id to its owner
        assert np.array_equal(ps.pull("sharded_copy", ids).rows, rows)
    owner = shard_of(ids, 3)
    for shard, address in enumerate(addresses):
        with PSClient(address) as one:
            mine = ids[owner == shard]
            assert one.describe_table("sharded").num_rows == len(mine) > 0
            assert one.describe_table("sharded_copy").num_rows == len(mine)
            assert not one.pull("sharded", mine[:50]).missing.any()
            assert one.pull("sharded", ids[owner != shard][:50]).missing.all()
    all_ids = np.concatenate([i for i, _ in exported])
    assert sorted(all_ids.tolist()) == sorted(ids.tolist())


def test_small_messages_are_chunked(make_ps):
    proc = make_ps("--max-message-mb", "0.25")
    rng = np.random.default_rng(4)
    ids = np.arange(20000, dtype=np.int64) * 3
    rows = rng.standard_normal((len(ids), 32)).astype(np.float32)  # 2.5 MiB in all, ten times the limit
    with PSClient(proc.address, max_message_bytes=256 << 10) as ps:
        ps.create_table("chunked", dim=32)
        ps.push("chunked", ids, rows)
        assert np.array_equal(ps.pull("chunked", ids).rows, rows)
        assert sum(len(i) for i, _ in ps.export("chunked")) == len(ids)


def test_export_then_import_reproduces_every_row(embedded_client, make_ps):
    rng = np.random.default_rng(5)
    ids = rng.choice(1 << 40, 7000, replace=False).astype(np.int64)
    rows = rng.standard_normal((len(ids), 5)).astype(np.float32)
    embedded_client.create_table("exp", dim=4, state_width=1, initializer=Initializer("constant", 2.0))
    embedded_client.push("exp", ids, rows)
    chunks = list(embedded_client.export("exp", rows_per_chunk=1000))
    assert all(len(i) <= 1000 for i, _ in chunks) and sum(len(i) for i, _ in chunks) == len(ids)
    schema = embedded_client.schema("exp")

    other = make_ps()
    with PSClient(other.address) as target:
        assert target.import_rows(schema, chunks) == len(ids)
        assert target.schema("exp", refresh=True) == schema
        assert np.array_equal(target.pull("exp", ids).rows, rows)
        # replace=True first deletes what the table held
        target.push("exp", [1, 2, 3], np.ones((3, 5), np.float32))
        assert target.import_rows(schema, chunks[:2], replace=True) == sum(len(i) for i, _ in chunks[:2])
        assert target.describe_table("exp").num_rows == sum(len(i) for i, _ in chunks[:2])
        assert target.pull("exp", [1]).missing.all()


@pytest.mark.slow
def test_restarted_ps_finds_tables_and_rows_in_redis(redis_url, redis_namespace, make_ps):
    rng = np.random.default_rng(6)
    ids = rng.choice(1 << 40, 5000, replace=False).astype(np.int64)
    rows = rng.standard_normal((len(ids), 9)).astype(np.float32)
    first = make_ps("--backend", redis_url, "--namespace", redis_namespace)
    with PSClient(first.address) as ps:
        ps.create_table("kept", dim=8, state_width=1, initializer=Initializer("normal", 0, 0.01, seed=3))
        ps.push("kept", ids, rows)
    assert first.stop() == 0
    second = make_ps("--backend", redis_url, "--namespace", redis_namespace, "--redis-buckets", "64")
    with PSClient(second.address) as ps:
        info = ps.describe_table("kept")
        assert info.num_rows == len(ids) and info.schema.initializer.kind == "normal"
        assert np.array_equal(ps.pull("kept", ids).rows, rows)


@pytest.mark.slow
def test_embedded_store_with_a_directory_survives_a_graceful_restart(make_ps, tmp_path):
    backend = f"embedded://{tmp_path}/tables"
    rng = np.random.default_rng(7)
    ids = rng.choice(1 << 40, 3000, replace=False).astype(np.int64)
    first = make_ps("--backend", backend)
    with PSClient(first.address) as ps:
        ps.create_table("kept32", dim=4, state_width=2, initializer=Initializer("uniform", -1, 1, seed=4))
        ps.create_table("kept_bf16", dim=3, dtype="bf16")
        ps.create_table("empty", dim=2)
        ps.create_table("dropped", dim=2)
        rows32 = rng.standard_normal((len(ids), 6)).astype(np.float32)
        rows16 = rng.integers(0, 1 << 16, (len(ids), 3), dtype=np.uint16)
        ps.push("kept32", ids, rows32)
        ps.push("kept_bf16", ids, rows16)
        ps.push("dropped", [1], np.ones((1, 2), np.float32))
        ps.delete("kept32", ids[:10])
        ps.drop_table("dropped")
    assert first.stop() == 0
    second = make_ps("--backend", backend)
    with PSClient(second.address) as ps:
        assert [t.schema.name for t in ps.list_tables()] == ["empty", "kept32", "kept_bf16"]
        assert ps.describe_table("kept32").schema.initializer.seed == 4
        got = ps.pull("kept32", ids)
        assert got.missing[:10].all() and not got.missing[10:].any()
        assert np.array_equal(got.rows[10:], rows32[10:])
        assert np.array_equal(ps.pull("kept_bf16", ids).rows, rows16)
        assert ps.describe_table("empty").num_rows == 0


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_concurrent_clients_keep_their_rows_apart(backend, embedded_ps, redis_ps):
    import threading

    address = embedded_ps.address if backend == "embedded" else redis_ps.address
    with PSClient(address) as ps:
        ps.create_table("conc", dim=7, state_width=1)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            rng = np.random.default_rng(k)
            ids = np.arange(k * 100_000, k * 100_000 + 3000, dtype=np.int64)
            with PSClient(address) as ps:
                for step in range(5):
                    rows = rng.standard_normal((len(ids), 8)).astype(np.float32)
                    ps.push("conc", ids, rows)
                    got = ps.pull("conc", ids)
                    assert np.array_equal(got.rows, rows), f"worker {k} step {step} read another's rows"
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with PSClient(address) as ps:
        assert ps.describe_table("conc").num_rows == 6 * 3000


@pytest.mark.slow
def test_embedded_store_killed_mid_save_restarts_with_every_table_of_one_save(make_ps, tmp_path):
    """kill -9 while the drain's save has written 2 of 5 table files: the restart loads the save before."""
    backend = f"embedded://{tmp_path}/tables"
    ids = np.arange(200, dtype=np.int64)
    first = make_ps("--backend", backend)
    with PSClient(first.address) as ps:
        for name in "abcd":
            ps.create_table(name, dim=2)
            ps.push(name, ids, np.full((200, 2), 1, np.float32))
    assert first.stop() == 0
    second = make_ps("--backend", backend, env={STALL_ENV: "2"})
    with PSClient(second.address) as ps:
        for name in "abcd":
            ps.push(name, ids, np.full((200, 2), 2, np.float32))
        ps.create_table("e", dim=2)
    second.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "save stalled after 2 table files" in second.log(), timeout=30, what="the save to stall")
    second.stop(signal.SIGKILL)
    assert sorted(p.name for p in (tmp_path / "tables" / "gen-00000002").iterdir()) == [
        "a.safetensors",
        "b.safetensors",
    ]
    third = make_ps("--backend", backend)
    with PSClient(third.address) as ps:
        assert [t.schema.name for t in ps.list_tables()] == ["a", "b", "c", "d"]
        for name in "abcd":
            got = ps.pull(name, ids)
            assert not got.missing.any() and (got.rows == 1).all(), name
        ps.push("a", ids, np.full((200, 2), 3, np.float32))
    assert third.stop() == 0  # a save after the torn one completes, and is what loads next
    fourth = make_ps("--backend", backend)
    with PSClient(fourth.address) as ps:
        assert (ps.pull("a", ids).rows == 3).all() and (ps.pull("d", ids).rows == 1).all()
