"""RedisStore against real redis-server processes: standalone, ACL/password, TLS, Cluster, down and back."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from contextlib import nullcontext

import grpc
import numpy as np
import pytest
import redis
import xxhash
from helpers import pause

from dynemb.ps_server.backends import open_store, redis_keys, redis_store, redis_tables
from dynemb.ps_server.backends.redis_store import RedisStore, _split_cluster_url
from dynemb.ps_server.errors import (
    BackendUnavailable,
    DeadlineExceeded,
    InvalidArgument,
    PSError,
    TableExists,
    TableNotFound,
)
from dynemb.ps_server.hashing import ROW_HASH_SEED, bucket_of
from dynemb.ps_server.schema import DTYPES, Initializer, TableSchema
from dynemb.testing.local_redis import RedisProcess

I64 = np.iinfo(np.int64)
# ids whose 8 bytes hold NULs, at the end too (bytes-typed numpy 'S8' would strip them)
AWKWARD_IDS = np.array(
    [0, 1, 256, 1 << 56, -1, -256, I64.min, I64.max, I64.min + 1, 1 << 32, 0xFF00, 2**31, -(2**31) - 1],
    dtype=np.int64,
)


@pytest.fixture
def store(redis_url, redis_namespace):
    s = RedisStore.from_url(redis_url, namespace=redis_namespace)
    yield s
    s.close()


def random_rows(rng, n: int, schema: TableSchema) -> np.ndarray:
    if schema.dtype == "bf16":  # raw bit patterns, NaN and inf ones included
        return rng.integers(0, 1 << 16, (n, schema.width), dtype=np.uint16)
    return rng.standard_normal((n, schema.width)).astype(schema.np_dtype)


def unique_ids(rng, n: int) -> np.ndarray:
    ids = np.unique(rng.integers(I64.min, I64.max, n + n // 10 + 16, dtype=np.int64))
    return rng.permutation(ids)[:n]


def expected_bucket(i: int, num_buckets: int) -> int:
    """The bucket from the xxhash package itself, not from the vectorised copy: the hash's
    top 32 bits scaled to [0, num_buckets)."""
    h = xxhash.xxh64_intdigest(int(i).to_bytes(8, "little", signed=True), seed=ROW_HASH_SEED)
    return ((h >> 32) * num_buckets) >> 32


# -- rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_each_dtype(store, dtype):
    rng = np.random.default_rng(1)
    schema = TableSchema("emb", dim=8, state_width=3, dtype=dtype)
    assert store.create_table(schema) is True
    ids = unique_ids(rng, 3000)
    rows = random_rows(rng, len(ids), schema)
    assert store.push("emb", ids, rows) == len(ids)

    order = rng.permutation(len(ids))
    missing = np.setdiff1d(unique_ids(rng, 50), ids)
    query = np.concatenate([ids[order], missing])
    got, found = store.pull("emb", query)
    assert got.dtype == DTYPES[dtype] and got.shape == (len(query), schema.width)
    assert found[: len(ids)].all() and not found[len(ids) :].any()
    # compare bits: NaN payloads and -0.0 must survive as they are
    assert got[: len(ids)].tobytes() == rows[order].tobytes()
    assert store.num_rows("emb") == len(ids)


def test_binary_unsafe_ids(store):
    schema = TableSchema("ids", dim=2)
    store.create_table(schema)
    rows = np.arange(len(AWKWARD_IDS) * 2, dtype=np.float32).reshape(-1, 2)
    store.push("ids", AWKWARD_IDS, rows)
    got, found = store.pull("ids", AWKWARD_IDS[::-1])
    assert found.all()
    np.testing.assert_array_equal(got, rows[::-1])
    exported = np.concatenate([i for i, _ in store.export("ids", 5)])
    assert sorted(exported.tolist()) == sorted(AWKWARD_IDS.tolist())
    # a neighbour of each id (one bit apart) is a different row
    _, found = store.pull("ids", AWKWARD_IDS ^ np.int64(2))
    assert not found.any()


def test_layout_in_redis(store, redis_url, redis_namespace):
    ns, nb = redis_namespace, 64
    store.num_buckets = nb
    schema = TableSchema("lay.out-1", dim=4, state_width=2, dtype="fp16")
    store.create_table(schema)
    rng = np.random.default_rng(2)
    ids = np.concatenate([AWKWARD_IDS, unique_ids(rng, 500)])
    rows = random_rows(rng, len(ids), schema)
    store.push(schema.name, ids, rows)

    r = redis.Redis.from_url(redis_url)
    keys = sorted(r.scan_iter(match=f"dn:{ns}:*".encode(), count=1000))
    meta = f"dn:{ns}:tables".encode()
    assert meta in keys and r.type(meta) == b"hash"
    bucket_keys = [k for k in keys if k != meta]
    # the table's creation token is in every key (a table created again under the name has others)
    token = json.loads(r.hget(meta, "lay.out-1"))["created"]
    assert re.fullmatch(rb"[0-9a-f]{12}", token.encode())
    pattern = re.compile(rb"^dn:" + ns.encode() + rb":lay\.out-1:" + token.encode() + rb":r:\{lay\.out-1\.(\d+)\}$")
    stored = {}
    for key in bucket_keys:
        m = pattern.match(key)
        assert m, key
        assert key.count(b"{") == 1 and key.count(b"}") == 1  # exactly one hash tag
        assert r.type(key) == b"hash"  # no per-id string keys anywhere
        bucket = int(m.group(1))
        assert 0 <= bucket < nb
        for field, value in r.hgetall(key).items():
            assert len(field) == 8
            i = int.from_bytes(field, "little", signed=True)
            assert expected_bucket(i, nb) == bucket
            stored[i] = value
    assert len(bucket_keys) <= nb and len(bucket_keys) > nb // 2  # 513 ids cover most of 64 buckets
    assert len(stored) == len(ids)
    for i, row in zip(ids.tolist(), rows):  # the row's bytes, then its stamp: when it was written
        assert stored[i][:-4] == row.astype("<f2").tobytes()
        assert abs(int.from_bytes(stored[i][-4:], "little") - time.time()) < 60
    r.close()


def test_duplicates_in_one_push_last_wins(store):
    store.create_table(TableSchema("dup", dim=3))
    ids = np.array([7, 8, 7, 0, 7, 0], dtype=np.int64)
    rows = np.arange(18, dtype=np.float32).reshape(6, 3)
    assert store.push("dup", ids, rows) == 6
    got, found = store.pull("dup", np.array([7, 8, 0], dtype=np.int64))
    assert found.all()
    np.testing.assert_array_equal(got, rows[[4, 1, 5]])
    assert store.num_rows("dup") == 3
    # the same id many times across a pipeline-sized batch
    ids = np.full(5000, 42, dtype=np.int64)
    rows = np.arange(5000 * 3, dtype=np.float32).reshape(5000, 3)
    store.push("dup", ids, rows)
    got, _ = store.pull("dup", np.array([42], dtype=np.int64))
    np.testing.assert_array_equal(got[0], rows[-1])


def test_batches_split_over_several_pipelines(store, monkeypatch):
    monkeypatch.setattr(redis_keys, "PIPELINE_MAX_IDS", 50)  # ~40 pipelines per 2000 ids
    schema = TableSchema("split", dim=3)
    store.num_buckets = 64
    store.create_table(schema)
    rng = np.random.default_rng(10)
    ids = unique_ids(rng, 2000)
    rows = random_rows(rng, 2000, schema)
    dup_ids = np.concatenate([ids, ids[:100]])  # the repeats carry the rows that must win
    dup_rows = np.concatenate([rows, rows[:100] + 1])
    store.push("split", dup_ids, dup_rows)
    got, found = store.pull("split", ids)
    assert found.all()
    np.testing.assert_array_equal(got[:100], rows[:100] + 1)
    np.testing.assert_array_equal(got[100:], rows[100:])
    assert store.num_rows("split") == 2000
    assert store.delete("split", ids[:700]) == 700
    assert sum(len(i) for i, _ in store.export("split", 64)) == 1300


def test_a_big_write_goes_in_parts_one_run_of_buckets_each(store, monkeypatch):
    """A write of more than WRITE_PART_BYTES goes to Redis in parts, each sent as soon as it is
    made: every bucket in exactly one part (one command per bucket, as in one request), and a
    repeated id's last row still wins; a delete too."""
    monkeypatch.setattr(redis_keys, "WRITE_PART_BYTES", 4096)
    schema = TableSchema("parts", dim=3)
    store.num_buckets = 64
    store.create_table(schema)
    assert store._native is not None
    real, made = store._native, []

    class Counted:  # the compiled module, its write requests counted
        def __getattr__(self, name):
            return getattr(real, name)

        def plain_write_request(self, ids, *rest):
            request, commands = real.plain_write_request(ids, *rest)
            made.append((bucket_of(np.asarray(ids), 64), commands))
            return request, commands

    monkeypatch.setattr(store, "_native", Counted())
    rng = np.random.default_rng(11)
    ids = unique_ids(rng, 2000)
    rows = random_rows(rng, 2000, schema)
    dup_ids = np.concatenate([ids, ids[:100]])
    dup_rows = np.concatenate([rows, rows[:100] + 1])
    assert store.push("parts", dup_ids, dup_rows) == 2100
    assert len(made) == redis_keys.WRITE_PARTS_MAX
    runs = [(b.min(), b.max()) for b, _ in made]
    assert all(hi < lo for (_, hi), (lo, _) in zip(runs, runs[1:]))  # runs of buckets, in order
    assert sum(commands for _, commands in made) == len(np.unique(bucket_of(ids, 64)))
    got, found = store.pull("parts", ids)
    assert found.all()
    np.testing.assert_array_equal(got[:100], rows[:100] + 1)
    np.testing.assert_array_equal(got[100:], rows[100:])
    assert store.num_rows("parts") == 2000
    made.clear()
    assert store.delete("parts", ids[:1500]) == 1500  # 12 KB of fields: 2 parts
    assert len(made) == 2 and store.num_rows("parts") == 500
    _, found = store.pull("parts", ids)
    assert not found[:1500].any() and found[1500:].all()


def test_a_write_request_reads_its_rows_where_they_are():
    """plain_write_request's rows_at: id i's row is rows[rows_at[i]], the same request as with
    the rows copied out; a position that is no row, or rows_at on a delete, is refused."""
    from dynemb.ps_server.native import redis_rows

    mod = redis_rows()
    rng = np.random.default_rng(5)
    ids = unique_ids(rng, 300)
    rows = rng.standard_normal((300, 4)).astype(np.float32)
    at = rng.permutation(300)[:120]
    args = (16, 64, b"dn:t:r:{t.", b"stmp")
    assert mod.plain_write_request(ids[at], rows, *args, at) == mod.plain_write_request(ids[at], rows[at], *args)
    with pytest.raises(ValueError, match=r"rows_at\[1\] = 300 is not a row of the 300 given"):
        mod.plain_write_request(ids[:2], rows, *args, np.array([0, 300]))
    with pytest.raises(ValueError, match="rows_at is for rows, not a delete"):
        mod.plain_write_request(ids[:2], None, *args, np.array([0, 1]))


BACKENDS = ["standalone", pytest.param("cluster", marks=pytest.mark.cluster)]


def swept(store: RedisStore) -> None:
    """Wait for the sweep of dropped tables' keys that a create or drop started, if any."""
    if store._sweeper is not None:
        store._sweeper.join(timeout=60)
        assert not store._sweeper.is_alive()


def url_of(request, backend: str) -> str:
    """The URL of the session's standalone Redis, or of its Redis Cluster."""
    if backend == "standalone":
        return request.getfixturevalue("redis_url")
    return request.getfixturevalue("redis_cluster").url


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("native_rows", [True, False])
def test_write_planned_before_a_drop_lands_nowhere(request, redis_namespace, native_rows, backend, monkeypatch, caplog):
    """A push or delete that read the table's metadata before the table was dropped and created
    again under its name (another schema, or the same) writes nothing into it: it writes into the
    dropped table's own bucket keys (its creation token's; writes are plain HSETs and HDELs, which
    no script checks), which a later create or drop unlinks once the drop is SWEEP_DROPPED_AFTER_S
    old, not before; on standalone Redis it fails with TableNotFound (its count change finds the
    token changed)."""
    url = url_of(request, backend)
    store = RedisStore.from_url(url, namespace=redis_namespace, num_buckets=16, native_rows=native_rows)
    other = RedisStore.from_url(url, namespace=redis_namespace, num_buckets=16)
    assert (store._native is not None) == native_rows
    old, new = TableSchema("race", dim=4), TableSchema("race", dim=6)
    rng = np.random.default_rng(5)
    ids = unique_ids(rng, 500)
    kept = random_rows(rng, 300, new)
    read_meta = store._meta
    planned: list = []

    def meta_then_recreate(table: str):
        meta = read_meta(table)
        planned.append(meta)
        other.drop_table(table)  # between the write's metadata read and its commands
        other.create_table(new)
        other.push(table, ids[:300], kept)
        return meta

    def orphans() -> int:  # rows in the bucket keys of the tables of that name dropped before
        return sum(int(store.client.hlen(k)) for m in planned for k in store.client.scan_iter(match=m.prefix + b"*"))

    late = pytest.raises(TableNotFound, match="re-created meanwhile") if backend == "standalone" else nullcontext()
    store.create_table(old)
    store.push("race", ids, random_rows(rng, 500, old))
    store._meta = meta_then_recreate
    with late:
        store.push("race", ids, random_rows(rng, 500, old))
    got, found = other.pull("race", ids)
    np.testing.assert_array_equal(found, np.arange(500) < 300)  # no ghost rows of the old dim
    np.testing.assert_array_equal(got[:300], kept)
    assert other.num_rows("race") == 300  # and no count change of the late write
    assert orphans() == 500
    with late:  # re-created with the same schema
        store.delete("race", ids)
    assert other.pull("race", ids)[1].sum() == 300 and other.num_rows("race") == 300
    del store._meta
    store.push("race", ids[300:310], random_rows(rng, 10, new))  # a write planned now reaches the new table
    assert other.num_rows("race") == 310
    # the orphan keys go once their drop is old enough, not before
    assert other.create_table(TableSchema("next", dim=2))
    swept(other)
    assert orphans() == 500
    r = store.client
    dropped = redis_keys.dropped_key(redis_namespace)
    records = r.zrange(dropped, 0, -1, withscores=True)
    assert [json.loads(m)["created"] for m, _ in records] == [json.loads(m.raw)["created"] for m in planned]
    r.zadd(dropped, {m: t - redis_keys.SWEEP_DROPPED_AFTER_S - 1 for m, t in records[:1]})  # the first drop, older
    with caplog.at_level(logging.INFO, logger="dynemb.ps"):
        assert other.drop_table("next") == 0
        swept(other)
        assert orphans() == 0
    said = [rec.getMessage() for rec in caplog.records if "writes in flight left" in rec.getMessage()]
    assert len(said) == 1 and all("after table 'race' was dropped" in m for m in said)
    left = r.zrange(dropped, 0, -1)
    assert records[0][0] not in left and records[1][0] in left  # the later drop's record waits its turn
    assert other.pull("race", ids)[1].sum() == 310 and other.num_rows("race") == 310  # the live table untouched
    monkeypatch.setattr(redis_keys, "SWEEP_DROPPED_AFTER_S", 0.0)
    assert other.drop_table("race") == 310
    swept(other)
    assert r.exists(dropped) == 0  # every record swept and forgotten
    store.close()
    other.close()


@pytest.mark.parametrize("native_rows", [True, False])
def test_write_during_a_drop_lands_nowhere(redis_url, redis_namespace, native_rows):
    """A push planned before a drop that runs after the drop cleared the buckets (but before it
    removed the metadata) writes nothing into the new table of that name, which starts empty."""
    store = RedisStore.from_url(redis_url, namespace=redis_namespace, num_buckets=16, native_rows=native_rows)
    other = RedisStore.from_url(redis_url, namespace=redis_namespace, num_buckets=16)
    schema = TableSchema("mid", dim=4)
    store.create_table(schema)
    ids = np.arange(200, dtype=np.int64)
    rows = random_rows(np.random.default_rng(6), 200, schema)
    read_meta = store._meta
    clear_buckets = other._delete_buckets
    pushed: list = []

    def clear_then_push(meta):
        n = clear_buckets(meta)
        with pytest.raises(TableNotFound, match="re-created meanwhile"):
            store.push("mid", ids, rows)  # planned with the metadata read before the drop
        pushed.append(True)
        return n

    store.push("mid", ids[:10], rows[:10])  # rows to clear (an empty table's buckets are not visited)
    planned = read_meta("mid")
    store._meta = lambda table, dropping=False: planned
    other._delete_buckets = clear_then_push
    assert other.drop_table("mid") == 10 and pushed
    other.create_table(schema)
    assert not other.pull("mid", ids)[1].any() and other.num_rows("mid") == 0
    store.close()
    other.close()


def test_drop_cut_short_is_finished(store, redis_namespace):
    """A drop cut short after marking the table leaves no table (not listed, not found); a
    create of that name finishes the drop and starts empty, and a retried drop finishes it too."""
    schema = TableSchema("cut", dim=3)
    ids = np.arange(50, dtype=np.int64)
    for finish in ("create", "drop"):
        store.create_table(schema)
        store.push("cut", ids, np.ones((50, schema.width), dtype=schema.np_dtype))
        clear_buckets = store._delete_buckets

        def killed(meta):
            raise ConnectionError("PS killed mid-drop")

        store._delete_buckets = killed
        with pytest.raises(ConnectionError):
            store.drop_table("cut")
        store._delete_buckets = clear_buckets
        assert "cut" not in [s.name for s in store.list_tables()] and store.schemas(["cut"]) == {}
        with pytest.raises(TableNotFound):
            store.pull("cut", ids)
        with pytest.raises(TableNotFound):
            store.push("cut", ids, np.ones((50, schema.width), dtype=schema.np_dtype))
        if finish == "create":
            assert store.create_table(schema) is True
            assert not store.pull("cut", ids)[1].any() and store.num_rows("cut") == 0
            assert store.drop_table("cut") == 0
        else:
            assert store.drop_table("cut") == 50
        assert store.drop_table("cut") is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_drop_finished_by_another_spares_the_table_created_since(request, redis_namespace, monkeypatch, backend):
    """Drop A marks the table and clears its first pipeline of buckets; drop B (another PS on
    the namespace) finishes the drop, and the table is created again and written to; A's
    remaining clears then leave the new table's rows, and A's end leaves its metadata (also
    when A had cleared every bucket already). A clear overtaken the same way stops with
    TableNotFound, the new table's rows and count intact."""
    url = url_of(request, backend)
    a = RedisStore.from_url(url, namespace=redis_namespace, num_buckets=16)
    b = RedisStore.from_url(url, namespace=redis_namespace, num_buckets=16)
    old, new = TableSchema("again", dim=2), TableSchema("again", dim=3)
    rng = np.random.default_rng(12)
    ids = unique_ids(rng, 600)
    new_ids, new_rows = ids[:400], random_rows(rng, 400, new)
    run_scripted = a._run_scripted
    clear_shas = {a._sha(redis_tables._CLEAR_BUCKET_LUA), a._sha(redis_tables._CLEAR_BUCKETS_LUA)}
    overtaken: list = []

    def overtake(fill):
        queued = redis_store._Queued()
        fill(queued)
        replies = run_scripted(fill)
        if queued.commands[0][1] in clear_shas and not overtaken:  # after A's first pipeline
            overtaken.append(b.drop_table("again"))
            b.create_table(new)
            b.push("again", new_ids, new_rows)
        return replies

    a._run_scripted = overtake
    for step, per_pipeline in (("drop", 4), ("clear", 4), ("drop", 16)):
        monkeypatch.setattr(redis_keys, "PIPELINE_MAX_IDS", per_pipeline)  # buckets per pipeline of clears
        in_first = int(sum(expected_bucket(i, 16) < per_pipeline for i in ids.tolist()))
        overtaken.clear()
        b.create_table(old)
        b.push("again", ids, random_rows(rng, 600, old))
        if step == "drop":
            assert a.drop_table("again") == in_first  # what A removed itself
        else:
            with pytest.raises(TableNotFound, match=f"dropped meanwhile, after {in_first} of its rows"):
                a.clear("again")
        assert overtaken == [600 - in_first]
        assert b.schema("again") == new
        got, found = b.pull("again", new_ids)
        assert found.all()
        np.testing.assert_array_equal(got, new_rows)
        assert b.num_rows("again") == 400
        assert b.drop_table("again") == 400
    a.close()
    b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_drop_overtaken_before_its_first_clear_spares_the_table_created_since(request, redis_namespace, backend):
    """Drop A marks the table and checks its metadata before its first pipeline of clears; before
    that pipeline arrives, drop B (another PS) finishes the drop and the table is created again
    and written to. A's clears (on Cluster: scripts that cannot see the metadata) then touch
    only the dropped table's keys: the new table keeps every row and its count; A stops."""
    url = url_of(request, backend)
    a = RedisStore.from_url(url, namespace=redis_namespace, num_buckets=16)
    b = RedisStore.from_url(url, namespace=redis_namespace, num_buckets=16)
    old, new = TableSchema("again", dim=2), TableSchema("again", dim=2)  # the same schema, even
    rng = np.random.default_rng(13)
    ids = unique_ids(rng, 600)
    new_ids, new_rows = ids[:400], random_rows(rng, 400, new)
    run_scripted = a._run_scripted
    clear_shas = {a._sha(redis_tables._CLEAR_BUCKET_LUA), a._sha(redis_tables._CLEAR_BUCKETS_LUA)}
    overtaken: list = []

    def overtake(fill):
        queued = redis_store._Queued()
        fill(queued)
        if queued.commands[0][1] in clear_shas and not overtaken:  # before A's first pipeline of clears
            overtaken.append(b.drop_table("again"))
            b.create_table(new)
            b.push("again", new_ids, new_rows)
        return run_scripted(fill)

    a._run_scripted = overtake
    for step in ("drop", "clear"):
        overtaken.clear()
        b.create_table(old)
        b.push("again", ids, random_rows(rng, 600, old))
        if step == "drop":
            assert a.drop_table("again") == 0  # B had removed every row
        else:
            with pytest.raises(TableNotFound, match="dropped meanwhile, after 0 of its rows"):
                a.clear("again")
        assert overtaken == [600]
        got, found = b.pull("again", ids)
        np.testing.assert_array_equal(found, np.arange(600) < 400)
        np.testing.assert_array_equal(got[:400], new_rows)
        assert b.num_rows("again") == 400
        assert b.drop_table("again") == 400
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_row_path_and_redis_py_agree(redis_url, redis_namespace, dtype):
    """The compiled row path (one call builds a pull's HMGETs or a push's script, one reads
    the replies) reads and writes exactly what redis-py's commands do, in the same layout."""
    fast = RedisStore.from_url(redis_url, namespace=redis_namespace, num_buckets=64)
    slow = RedisStore.from_url(redis_url, namespace=redis_namespace, native_rows=False)
    assert fast._native is not None and slow._native is None
    schema = TableSchema("agree", dim=5, state_width=2, dtype=dtype)
    fast.create_table(schema)
    rng = np.random.default_rng(11)
    ids = np.concatenate([AWKWARD_IDS, unique_ids(rng, 3000)])
    rows = random_rows(rng, len(ids), schema)
    assert fast.push("agree", ids[::2], rows[::2]) == len(ids[::2])
    assert slow.push("agree", ids[1::4], rows[1::4]) == len(ids[1::4])
    asked = np.concatenate([ids, ids[:50], unique_ids(rng, 100)])  # repeats, and ids never written
    got_fast, found_fast = fast.pull("agree", asked)
    got_slow, found_slow = slow.pull("agree", asked)
    np.testing.assert_array_equal(found_fast, found_slow)
    np.testing.assert_array_equal(got_fast.view(np.uint16), got_slow.view(np.uint16))  # bit for bit
    written = np.zeros(len(ids), dtype=bool)
    written[::2] = written[1::4] = True
    np.testing.assert_array_equal(found_fast[: len(ids)], written)
    np.testing.assert_array_equal(got_fast[: len(ids)][written].view(np.uint16), rows[written].view(np.uint16))
    assert not got_fast[~found_fast].any()  # absent rows read as zeros
    out = np.full((len(asked), schema.width), 7, dtype=schema.np_dtype)
    np.testing.assert_array_equal(fast.pull_into("agree", asked, out), np.flatnonzero(~found_slow))
    assert fast.num_rows("agree") == slow.num_rows("agree") == int(written.sum())
    assert fast.delete("agree", ids[:1000]) == int(written[:1000].sum())
    assert slow.num_rows("agree") == int(written[1000:].sum())
    fast.close()
    slow.close()


def test_compiled_row_path_reply_bigger_than_foreseen_and_dropped_connections(store, redis_url, monkeypatch):
    schema = TableSchema("big", dim=256)
    store.create_table(schema)
    rng = np.random.default_rng(12)
    ids = unique_ids(rng, 2000)
    rows = random_rows(rng, 2000, schema)
    store.push("big", ids, rows)
    exchange = store._exchange
    sizes = []

    def foresee_little(request, replies, expect_bytes, take=None):  # the buffer must grow as the 2 MB come
        buf, end = exchange(request, replies, 1, take)
        sizes.append(len(buf))
        return buf, end

    monkeypatch.setattr(store, "_exchange", foresee_little)
    store._buffers.buf = bytearray(1024)
    got, found = store.pull("big", ids)
    assert found.all() and np.array_equal(got, rows)
    assert sizes[-1] >= 2000 * schema.row_bytes
    # Redis closes every pooled connection (as on a restart or a client timeout): the row path,
    # which reads the socket itself, still gets a live connection
    r = redis.Redis.from_url(redis_url)
    assert r.client_kill_filter(_type="normal", skipme=True) >= 1
    got, found = store.pull("big", ids)
    assert found.all() and np.array_equal(got, rows)
    r.client_kill_filter(_type="normal", skipme=True)
    assert store.push("big", ids[:10], rows[:10] + 1) == 10
    assert store.num_rows("big") == 2000
    r.close()
    # a thread keeps a reply buffer up to the limit for its next call, not a bigger one
    store.pull("big", ids[:100])
    assert store._buffers.buf is not None
    monkeypatch.setattr(redis_keys, "REPLY_BUFFER_KEEP_BYTES", 1 << 20)
    got, _ = store.pull("big", ids)  # ~2 MB of replies
    assert np.array_equal(got[10:], rows[10:]) and store._buffers.buf is None


def test_listpack_buckets_read_the_same_and_outgrow_into_hashtables(redis_namespace):
    """The memory layout of docs/ps.md "Redis memory": buckets kept as listpacks (rows under
    hash-max-listpack-value) hold the same keys and rows, and a bucket that outgrows
    hash-max-listpack-entries turns into a hashtable with every row still read back."""
    with RedisProcess(["hash-max-listpack-value 1024", "hash-max-listpack-entries 8"]) as proc:
        # listpack="off": the limits above stay (auto would raise entries to 8 x 16 rows a bucket)
        store = RedisStore.from_url(proc.url, namespace=redis_namespace, num_buckets=16, listpack="off")
        schema = TableSchema("lp", dim=64, state_width=64)  # 512-byte rows: hashtables under Redis's defaults
        store.create_table(schema)
        rng = np.random.default_rng(13)
        ids = unique_ids(rng, 400)
        rows = random_rows(rng, 400, schema)
        r = proc.client()
        store.push("lp", ids[:50], rows[:50])  # ~3 rows a bucket
        encodings = {r.object("encoding", store._meta("lp").key(b)) for b in range(16)} - {None}
        assert encodings == {b"listpack"}
        store.push("lp", ids[50:], rows[50:])  # ~25 a bucket: over 8
        encodings = {r.object("encoding", store._meta("lp").key(b)) for b in range(16)}
        assert encodings == {b"hashtable"}
        got, found = store.pull("lp", ids)
        assert found.all() and np.array_equal(got, rows)
        slow = RedisStore.from_url(proc.url, namespace=redis_namespace, native_rows=False)
        got, _ = slow.pull("lp", ids[:50])
        assert np.array_equal(got, rows[:50])
        slow.close()
        assert store.num_rows("lp") == 400
        r.close()
        store.close()


def test_foreign_data_is_an_error_not_garbage(store, redis_url, redis_namespace):
    store.create_table(TableSchema("bad", dim=2))
    ids = np.arange(200, dtype=np.int64)
    store.push("bad", ids, np.ones((200, 2), np.float32))
    r = redis.Redis.from_url(redis_url)
    victim = int(bucket_of(ids[:1], store.num_buckets)[0])
    key = store._meta("bad").key(victim)
    r.hset(key, ids[:1].tobytes(), b"\0" * 13)  # 13 bytes where an 8-byte row and its 4-byte stamp go
    for call in (lambda: store.pull("bad", ids), lambda: list(store.export("bad", 50))):
        with pytest.raises(PSError, match="wrong size"):
            call()
    r.delete(key)
    r.set(key, b"not a hash")
    with pytest.raises(PSError, match="WRONGTYPE"):
        store.pull("bad", ids)
    r.delete(key)
    r.close()


def test_delete_and_num_rows(store):
    store.create_table(TableSchema("del", dim=2))
    rng = np.random.default_rng(3)
    ids = unique_ids(rng, 1000)
    store.push("del", ids, random_rows(rng, 1000, store.schema("del")))
    assert store.num_rows("del") == 1000
    gone = ids[:300]
    never = np.setdiff1d(unique_ids(rng, 20), ids)
    assert store.delete("del", np.concatenate([gone, never, gone[:10]])) == 300
    assert store.num_rows("del") == 700
    assert store.delete("del", gone) == 0
    _, found = store.pull("del", ids)
    assert not found[:300].any() and found[300:].all()
    assert store.delete("del", np.zeros(0, dtype=np.int64)) == 0


def test_pull_and_push_empty_and_bad_input(store):
    schema = TableSchema("e", dim=4, dtype="bf16")
    store.create_table(schema)
    rows, found = store.pull("e", np.zeros(0, dtype=np.int64))
    assert rows.shape == (0, 4) and found.shape == (0,)
    assert store.push("e", np.zeros(0, dtype=np.int64), np.zeros((0, 4), dtype=np.uint16)) == 0
    with pytest.raises(InvalidArgument, match=r"shape \(2, 4\)"):
        store.push("e", np.array([1, 2]), np.zeros((2, 5), dtype=np.uint16))
    with pytest.raises(InvalidArgument, match="bf16"):  # floats are not bf16 bit patterns
        store.push("e", np.array([1, 2]), np.zeros((2, 4), dtype=np.float32))
    assert store.num_rows("e") == 0


def test_export_every_row_once(store):
    schema = TableSchema("exp", dim=5, state_width=1)
    store.num_buckets = 128
    store.create_table(schema)
    rng = np.random.default_rng(4)
    ids = unique_ids(rng, 2500)
    rows = random_rows(rng, len(ids), schema)
    store.push("exp", ids, rows)
    for per_chunk in (1000, 37, 100_000):
        chunks = list(store.export("exp", per_chunk))
        assert all(0 < len(i) <= per_chunk and len(i) == len(r) for i, r in chunks)
        got_ids = np.concatenate([i for i, _ in chunks])
        got_rows = np.concatenate([r for _, r in chunks])
        assert len(got_ids) == len(ids) and len(np.unique(got_ids)) == len(ids)
        where = {i: k for k, i in enumerate(ids.tolist())}
        np.testing.assert_array_equal(got_rows, rows[[where[i] for i in got_ids.tolist()]])
    assert len(chunks) == 1
    store.create_table(TableSchema("empty", dim=1))
    assert list(store.export("empty", 10)) == []


def test_clear_and_drop(own_redis_url, redis_namespace):
    redis_url = own_redis_url
    store = RedisStore.from_url(redis_url, namespace=redis_namespace)
    rng = np.random.default_rng(5)
    for name in ("a", "b"):
        schema = TableSchema(name, dim=2)
        store.create_table(schema)
        store.push(name, unique_ids(rng, 400), random_rows(rng, 400, schema))
    assert store.clear("a") == 400
    assert store.num_rows("a") == 0 and store.num_rows("b") == 400
    assert store.schema("a") == TableSchema("a", dim=2)  # the table stays
    assert store.clear("a") == 0

    assert store.drop_table("b") == 400
    assert store.drop_table("b") is None
    assert [s.name for s in store.list_tables()] == ["a"]
    with pytest.raises(TableNotFound):
        store.num_rows("b")
    r = redis.Redis.from_url(redis_url)
    leftover = list(r.scan_iter(match=f"dn:{redis_namespace}:b:*".encode()))
    assert leftover == []
    # a new table of the same name starts empty
    store.create_table(TableSchema("b", dim=3))
    assert store.num_rows("b") == 0
    # the buckets go a run at a time: a script per CLEAR_KEYS_PER_SCRIPT of them, not one each
    store.push("b", unique_ids(rng, 400), random_rows(rng, 400, TableSchema("b", dim=3)))
    r.config_resetstat()
    assert store.drop_table("b") == 400
    runs = -(-store.num_buckets // redis_keys.CLEAR_KEYS_PER_SCRIPT)
    assert runs <= calls(r, "evalsha") <= runs + 3  # (the drop's own mark, log and end)
    r.close()
    store.close()


def test_a_malformed_redis_url_is_refused_naming_it_and_the_forms_not_its_password():
    for url, bad in (
        ("redis://localhost:63x79/0", "redis://localhost:63x79/0"),
        ("redis://bob:s3cret@h:6x/0", "bob:***@h:6x"),
    ):
        with pytest.raises(InvalidArgument) as err:
            RedisStore.from_url(url, namespace="t")
        msg = str(err.value)
        assert bad in msg and "expected redis://[user:password@]host:port" in msg and "s3cret" not in msg, msg


def test_table_errors_name_what_is_wrong(store, redis_namespace):
    schema = TableSchema("t1", dim=4, state_width=2, dtype="fp16", initializer=Initializer("uniform", -0.1, 0.1, 9))
    assert store.create_table(schema) is True
    assert store.create_table(schema) is False
    other = TableSchema("t1", dim=8)
    with pytest.raises(TableExists) as err:
        store.create_table(other)
    msg = str(err.value)
    assert "'t1'" in msg and "'dim': 4" in msg and "'dim': 8" in msg and "fp16" in msg
    for call in (
        lambda: store.schema("nope"),
        lambda: store.num_rows("nope"),
        lambda: store.pull("nope", np.array([1])),
        lambda: store.push("nope", np.array([1]), np.zeros((1, 4), np.float32)),
        lambda: store.delete("nope", np.array([1])),
        lambda: store.export("nope", 10),  # raises at the call, not at the first chunk
        lambda: store.clear("nope"),
    ):
        with pytest.raises(TableNotFound) as err:
            call()
        assert "'nope'" in str(err.value) and redis_namespace in str(err.value)
    assert store.drop_table("nope") is None


def test_restart_finds_tables_and_rows(redis_url, redis_namespace):
    rng = np.random.default_rng(6)
    first = RedisStore.from_url(redis_url, namespace=redis_namespace, num_buckets=64)
    schemas = [TableSchema("x", dim=3, dtype="bf16"), TableSchema("y", dim=2, state_width=2)]
    data = {}
    for s in schemas:
        first.create_table(s)
        ids = unique_ids(rng, 700)
        data[s.name] = (ids, random_rows(rng, 700, s))
        first.push(s.name, *data[s.name])
    first.close()

    # another PS process with another default bucket count: the tables keep their own
    again = open_store(redis_url, namespace=redis_namespace, num_buckets=4096)
    assert isinstance(again, RedisStore) and again.kind == "redis"
    assert again.list_tables() == schemas
    for s in schemas:
        ids, rows = data[s.name]
        assert again.num_rows(s.name) == 700
        got, found = again.pull(s.name, ids)
        assert found.all() and got.tobytes() == rows.tobytes()
        assert again.create_table(s) is False
    again.close()


def test_namespaces_are_isolated(redis_url, redis_namespace):
    a = RedisStore.from_url(redis_url, namespace=redis_namespace + "-a")
    b = RedisStore.from_url(redis_url, namespace=redis_namespace + "-b")
    a.create_table(TableSchema("same", dim=2))
    b.create_table(TableSchema("same", dim=5))  # no clash: another namespace
    ids = np.arange(100, dtype=np.int64)
    a.push("same", ids, np.ones((100, 2), np.float32))
    assert b.num_rows("same") == 0
    _, found = b.pull("same", ids)
    assert not found.any()
    assert a.drop_table("same") == 100
    assert b.schema("same").dim == 5 and a.list_tables() == []
    a.close()
    b.close()


def test_concurrent_threads(store):
    schema = TableSchema("mt", dim=4)
    store.create_table(schema)
    errors = []

    def work(k: int) -> None:
        try:
            rng = np.random.default_rng(100 + k)
            ids = np.arange(k * 10_000, k * 10_000 + 2000, dtype=np.int64)
            rows = random_rows(rng, 2000, schema)
            for _ in range(3):
                store.push("mt", ids, rows)
                got, found = store.pull("mt", ids)
                assert found.all() and np.array_equal(got, rows)
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.num_rows("mt") == 8 * 2000


def test_unix_socket_url(redis_server, redis_namespace):
    s = RedisStore.from_url(f"unix://{redis_server.unix_socket}?db=0", namespace=redis_namespace)
    s.create_table(TableSchema("u", dim=1))
    s.push("u", np.array([5]), np.array([[2.5]], np.float32))
    got, found = s.pull("u", np.array([5, 6]))
    assert found.tolist() == [True, False] and got[0, 0] == 2.5
    s.close()


# -- URLs and connections --------------------------------------------------------------------


def test_bad_urls_and_options(redis_url):
    with pytest.raises(InvalidArgument, match="scheme"):
        open_store("mongodb://x")
    with pytest.raises(InvalidArgument, match="no_such_option"):
        RedisStore.from_url(redis_url, no_such_option=1)
    with pytest.raises(InvalidArgument, match="namespace"):
        RedisStore.from_url(redis_url, namespace="a:b")
    with pytest.raises(InvalidArgument, match="host:port"):
        RedisStore.from_url("redis+cluster://10.0.0.1")


def test_cluster_url_parsing():
    nodes, kw = _split_cluster_url(
        "rediss+cluster://ps%40user:p%3Aw%2Fd@10.0.0.1:7000,[::1]:7001/0?ssl_cert_reqs=none&socket_keepalive=true"
    )
    assert nodes == [("10.0.0.1", 7000), ("::1", 7001)]
    assert kw["username"] == "ps@user" and kw["password"] == "p:w/d"
    assert kw["ssl"] is True and kw["ssl_cert_reqs"] == "none" and kw["socket_keepalive"] is True
    assert "host" not in kw and "db" not in kw
    nodes, kw = _split_cluster_url("redis+cluster://a:1")
    assert nodes == [("a", 1)] and "ssl" not in kw and "password" not in kw
    with pytest.raises(InvalidArgument, match="database 0"):
        _split_cluster_url("redis+cluster://a:1/3")


def test_acl_user_and_password(redis_auth, redis_namespace):
    s = RedisStore.from_url(redis_auth.url, namespace=redis_namespace)
    s.ping()
    s.create_table(TableSchema("acl", dim=2))
    s.push("acl", np.array([1, 2]), np.ones((2, 2), np.float32))
    assert s.num_rows("acl") == 2
    s.close()
    # requirepass: the default user, password only
    s = RedisStore.from_url(redis_auth.url_for("", redis_auth.default_password), namespace=redis_namespace)
    assert s.num_rows("acl") == 2
    s.close()


@pytest.mark.parametrize("case", ["wrong password", "unknown user", "no password"])
def test_refused_authentication(redis_auth, redis_namespace, case):
    wrong = "not-the-password"
    url = {
        "wrong password": redis_auth.url_for(redis_auth.user, wrong),
        "unknown user": redis_auth.url_for("nobody", wrong),
        "no password": redis_auth.url_for(None, None),
    }[case]
    s = RedisStore.from_url(url, namespace=redis_namespace)
    for call in (s.ping, lambda: s.create_table(TableSchema("z", dim=1)), lambda: s.pull("z", np.array([1]))):
        with pytest.raises(BackendUnavailable) as err:
            call()
        msg = str(err.value)
        assert "authentication" in msg and redis_auth.address in msg
        assert wrong not in msg and redis_auth.password not in msg
    s.close()


def test_tls(redis_tls, redis_namespace):
    for s in (
        RedisStore.from_url(f"{redis_tls.url}?ssl_ca_certs={redis_tls.ca_file}", namespace=redis_namespace),
        RedisStore.from_url(redis_tls.url, namespace=redis_namespace, ssl_ca_certs=redis_tls.ca_file),
    ):
        s.create_table(TableSchema("tls", dim=16, dtype="fp16"))
        rng = np.random.default_rng(7)
        ids = unique_ids(rng, 2000)
        rows = random_rows(rng, 2000, s.schema("tls"))
        s.push("tls", ids, rows)
        got, found = s.pull("tls", ids)
        assert found.all() and got.tobytes() == rows.tobytes()
        s.close()
    # without the CA the server's certificate is not trusted
    untrusting = RedisStore.from_url(redis_tls.url, namespace=redis_namespace)
    with pytest.raises(BackendUnavailable) as err:
        untrusting.ping()
    assert redis_tls.proc.address in str(err.value) and "CERTIFICATE_VERIFY_FAILED" in str(err.value)
    untrusting.close()
    # and plain redis:// to a TLS port gets no answer it understands
    plain = RedisStore.from_url(
        redis_tls.url.replace("rediss://", "redis://"), namespace=redis_namespace, socket_timeout=1.0, retries=0
    )
    with pytest.raises(BackendUnavailable):
        plain.ping()
    plain.close()


def test_redis_down_then_back(redis_process, redis_namespace):
    proc = redis_process()
    s = RedisStore.from_url(proc.url, namespace=redis_namespace, socket_timeout=2.0)
    s.create_table(TableSchema("d", dim=2))
    ids = np.arange(500, dtype=np.int64)
    rows = np.random.default_rng(8).random((500, 2), dtype=np.float32)
    s.push("d", ids, rows)
    proc.client().save()  # so the restarted server loads the rows again
    proc.stop()

    for call in (s.ping, lambda: s.pull("d", ids), lambda: s.push("d", ids, rows), lambda: s.num_rows("d")):
        with pytest.raises(BackendUnavailable) as err:
            call()
        assert proc.address in str(err.value)

    proc.start()
    s.ping()
    got, found = s.pull("d", ids)
    assert found.all() and np.array_equal(got, rows)
    s.push("d", ids[:10], rows[:10] + 1)
    assert s.num_rows("d") == 500
    np.testing.assert_array_equal(s.pull("d", ids[:10])[0], rows[:10] + 1)
    s.close()


def test_redis_hung_times_out(redis_process, redis_namespace):
    proc = redis_process()
    s = RedisStore.from_url(proc.url, namespace=redis_namespace, socket_timeout=0.3, retries=0)
    s.create_table(TableSchema("h", dim=2))
    pause(proc.proc.pid)
    try:
        with pytest.raises(BackendUnavailable, match="Timeout") as err:
            s.pull("h", np.arange(10))
        assert proc.address in str(err.value)
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    assert s.num_rows("h") == 0  # the connection that timed out was dropped, a new one works
    s.close()


# -- Cluster ---------------------------------------------------------------------------------


@pytest.mark.cluster
def test_cluster_round_trip_spread_over_masters(redis_cluster, redis_namespace):
    s = open_store(redis_cluster.url, namespace=redis_namespace)
    assert isinstance(s, RedisStore) and s.kind == "redis-cluster"
    schema = TableSchema("clu", dim=8, state_width=8)
    assert s.create_table(schema) is True
    rng = np.random.default_rng(9)
    ids = np.unique(np.concatenate([AWKWARD_IDS, unique_ids(rng, 20_000)]))  # sorted
    rows = random_rows(rng, len(ids), schema)
    s.push("clu", ids, rows)
    assert s.num_rows("clu") == len(ids)
    query = rng.permutation(ids)
    got, found = s.pull("clu", query)
    assert found.all()
    np.testing.assert_array_equal(got, rows[np.searchsorted(ids, query)])

    per_node = {}
    for node in redis_cluster.nodes:
        c = node.client()
        per_node[node.address] = len(list(c.scan_iter(match=f"dn:{redis_namespace}:clu:*".encode(), count=1000)))
        c.close()
    assert all(n > 0 for n in per_node.values()), per_node
    # one key per touched bucket, each on exactly one node
    assert sum(per_node.values()) == len({expected_bucket(i, 4096) for i in ids.tolist()})

    assert s.delete("clu", ids[:1000]) == 1000
    exported = np.concatenate([i for i, _ in s.export("clu", 3000)])
    assert sorted(exported.tolist()) == sorted(ids[1000:].tolist())
    assert s.clear("clu") == len(ids) - 1000
    assert s.drop_table("clu") == 0 and s.list_tables() == []
    s.close()


@pytest.mark.cluster
def test_cluster_over_tls_with_acl_user(redis_tls_cluster, redis_namespace):
    s = RedisStore.from_url(redis_tls_cluster.url, namespace=redis_namespace)
    assert s.kind == "redis-cluster"
    schema = TableSchema("sec", dim=4, dtype="bf16")
    s.create_table(schema)
    rng = np.random.default_rng(11)
    ids = unique_ids(rng, 3000)
    rows = random_rows(rng, 3000, schema)
    s.push("sec", ids, rows)
    got, found = s.pull("sec", ids)
    assert found.all() and got.tobytes() == rows.tobytes()
    assert s.num_rows("sec") == 3000
    s.close()

    wrong = "not-the-password"
    with pytest.raises(BackendUnavailable) as err:
        RedisStore.from_url(redis_tls_cluster.url_for(redis_tls_cluster.user, wrong), namespace=redis_namespace)
    msg = str(err.value)
    assert "authentication" in msg and redis_tls_cluster.cluster.addresses[0] in msg and wrong not in msg


# -- many tables: kept row counts, small per-table state ----------------------------------


def calls(r: redis.Redis, command: str) -> int:
    """How often the server ran `command` since its stats were reset (scripts' commands included)."""
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def true_rows(r, namespace: str, table: str) -> int:
    # bucket keys only: beside them are the table's deletion log (a stream) and sweep keys
    return sum(r.hlen(k) for k in r.scan_iter(match=f"dn:{namespace}:{table}:*r:{{*".encode(), count=1000))


def check_counts_follow_every_write(s: RedisStore, true_count) -> None:
    s.create_table(TableSchema("cnt", dim=2))
    rng = np.random.default_rng(4)
    ids = unique_ids(rng, 3000)
    rows = random_rows(rng, 3000, TableSchema("cnt", dim=2))
    steps = [
        lambda: s.push("cnt", ids[:2000], rows[:2000]),
        lambda: s.push("cnt", np.concatenate([ids[1000:2500], ids[2400:2500]]), rows[:1600]),  # old, new, repeated
        lambda: s.delete("cnt", np.concatenate([ids[:500], ids[:10], unique_ids(rng, 50)])),  # repeated, missing
        lambda: s.push("cnt", ids[:0], rows[:0]),
        lambda: s.clear("cnt"),
        lambda: s.push("cnt", ids[:700], rows[:700]),
    ]
    for step in steps:
        step()
        assert s.num_rows("cnt") == true_count("cnt")
    assert s.drop_table("cnt") == 700
    s.create_table(TableSchema("cnt", dim=2))  # a new table of the same name starts at 0
    assert s.num_rows("cnt") == 0 == true_count("cnt")


def test_row_counts_follow_every_write_without_scanning_buckets(store, redis_url, redis_namespace):
    r = redis.Redis.from_url(redis_url)
    original = store.num_rows

    def counted(table: str) -> int:  # the count, read with no HLEN at all
        before = calls(r, "hlen")
        n = original(table)
        assert calls(r, "hlen") == before
        return n

    store.num_rows = counted
    check_counts_follow_every_write(store, lambda t: true_rows(r, redis_namespace, t))
    r.script_flush()  # as after a Redis restart: the scripts are loaded again, nothing written twice
    store.push("cnt", np.arange(10), np.zeros((10, 2), np.float32))
    assert store.num_rows("cnt") == 10 == true_rows(r, redis_namespace, "cnt")
    r.close()


def test_a_row_count_below_zero_is_recounted(store, redis_url, redis_namespace, caplog):
    """Rows written uncounted (on Cluster, by a PS killed between a write and its count change)
    and deleted since take the count below 0, which ListTables cannot answer (a row count is
    unsigned on the wire): a count below 0 is recounted from the buckets and kept."""
    r = redis.Redis.from_url(redis_url)
    rows = redis_keys.rows_key(redis_namespace)
    store.create_table(TableSchema("late", dim=2))
    r.hdel(rows, "late")  # no count: the push is not counted
    store.push("late", np.arange(5), np.ones((5, 2), np.float32))
    r.hset(rows, "late", 0)  # counting from 0 again
    store.delete("late", np.arange(3))  # its count goes to -3 while 2 rows remain
    assert int(r.hget(rows, "late")) == -3
    assert (
        dict((s.name, n) for s, n in store.list_tables_with_rows())["late"]
        == 2
        == true_rows(r, redis_namespace, "late")
    )
    assert int(r.hget(rows, "late")) == 2 and store.num_rows("late") == 2
    (record,) = [rec for rec in caplog.records if "row count was below 0" in rec.getMessage()]
    assert record.levelname == "WARNING"
    assert "'late'" in record.getMessage() and "should not happen: please report it" in record.getMessage()
    r.hset(rows, "late", -1)
    assert store.num_rows("late") == 2
    r.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_table_of_metadata_format_1_keeps_its_keys(request, redis_namespace, monkeypatch, backend):
    """A table created by a version whose bucket keys had no creation token (metadata format 1)
    reads, writes, counts, exports, clears and drops in those keys, through the compiled row
    path and redis-py's alike; created again, it gets format 2 and keys with its token.
    Metadata of a newer format, or with a token unfit for key names, is refused by name."""
    url = url_of(request, backend)
    fast = RedisStore.from_url(url, namespace=redis_namespace)
    slow = RedisStore.from_url(url, namespace=redis_namespace, native_rows=False)
    r = fast.client
    schema = TableSchema("old", dim=3)
    old_meta = {"format": 1, "num_buckets": 32, "schema": schema.to_dict(), "created": "0123456789abcdef"}
    r.hset(redis_keys.meta_key(redis_namespace), "old", json.dumps(old_meta, sort_keys=True))
    r.hset(redis_keys.rows_key(redis_namespace), "old", 0)
    prefix = f"dn:{redis_namespace}:old:r:{{old.".encode()
    assert fast._meta("old").prefix == prefix and fast._meta("old").key(7) == prefix + b"7}"

    side_keys = fast._meta("old").side_keys  # its deletion log and sweep keys, beside the buckets

    def stored() -> dict[int, bytes]:  # what the format-1 keys hold, read with no help from the store
        out = {}
        for key in r.scan_iter(match=f"dn:{redis_namespace}:old:*".encode()):
            if key in side_keys:
                continue
            assert key.startswith(prefix), key  # no key of another layout
            bucket = int(key[len(prefix) : -1])
            for field, value in r.hgetall(key).items():
                i = int.from_bytes(field, "little", signed=True)
                assert expected_bucket(i, 32) == bucket
                out[i] = value
        return out

    rng = np.random.default_rng(21)
    ids = unique_ids(rng, 700)
    rows = random_rows(rng, 700, schema)
    fast.push("old", ids[:400], rows[:400])
    slow.push("old", ids[400:], rows[400:])
    assert stored() == {i: row.tobytes() for i, row in zip(ids.tolist(), rows)}
    for s in (fast, slow):
        got, found = s.pull("old", ids)
        assert found.all()
        np.testing.assert_array_equal(got, rows)
    assert fast.delete("old", ids[:50]) == 50 and slow.delete("old", ids[50:100]) == 50
    assert fast.num_rows("old") == 600 == len(stored())
    exported = {int(i): row.tobytes() for c_ids, c_rows in fast.export("old", 128) for i, row in zip(c_ids, c_rows)}
    assert exported == stored() and len(exported) == 600
    assert fast.clear("old") == 600 and stored() == {} and fast.num_rows("old") == 0
    fast.push("old", ids, rows)
    monkeypatch.setattr(redis_keys, "SWEEP_DROPPED_AFTER_S", 0.0)  # and its record forgotten at once
    assert fast.drop_table("old") == 700 and stored() == {}
    swept(fast)
    assert r.exists(redis_keys.dropped_key(redis_namespace)) == 0
    # created again: the new layout
    assert fast.create_table(schema)
    again = json.loads(r.hget(redis_keys.meta_key(redis_namespace), "old"))
    assert again["format"] == redis_keys.META_FORMAT == 3
    assert "num_buckets" not in again and again["buckets"] == 4096  # older versions read num_buckets: they refuse it
    assert fast._meta("old").prefix == f"dn:{redis_namespace}:old:{again['created']}:r:{{old.".encode()
    fast.push("old", ids[:10], rows[:10])
    assert len(list(r.scan_iter(match=fast._meta("old").prefix + b"*"))) > 0
    assert not [k for k in r.scan_iter(match=f"dn:{redis_namespace}:old:*".encode()) if k.startswith(prefix)]
    assert slow.pull("old", ids[:10])[1].all() and fast.num_rows("old") == 10
    # metadata this version cannot read names what is wrong
    for name, meta, says in (
        ("newer", {**old_meta, "format": 4}, "metadata format 4 is newer than this version's 3: upgrade dynemb"),
        ("badtok", {**old_meta, "format": 2, "buckets": 32, "created": "0123{x}"}, '"created" must be a hex token'),
        ("notok", {k: v for k, v in old_meta.items() if k != "created"} | {"format": 2, "buckets": 32}, "created"),
    ):
        r.hset(redis_keys.meta_key(redis_namespace), name, json.dumps(meta))
        with pytest.raises(PSError, match=re.escape(f"metadata of table {name!r}") + ".*" + re.escape(says)):
            fast.pull(name, ids[:1])
    # a dropped format-1 table is forgotten by the sweep, its keys left: they carry no token, so
    # they may be those of a table an older PS created since under the name
    dropped = redis_keys.dropped_key(redis_namespace)
    r.zadd(dropped, {json.dumps(old_meta, sort_keys=True): 0})
    r.hset(prefix + b"3}", b"\x01" * 8, b"\x00" * 12)
    fast._sweep_dropped()
    assert r.exists(dropped) == 0 and r.hlen(prefix + b"3}") == 1
    fast.close()
    slow.close()


@pytest.mark.cluster
def test_row_counts_on_cluster(redis_cluster, redis_namespace):
    s = open_store(redis_cluster.url, namespace=redis_namespace)
    nodes = [node.client() for node in redis_cluster.nodes]
    check_counts_follow_every_write(s, lambda t: sum(true_rows(c, redis_namespace, t) for c in nodes))
    for c in nodes:  # as after a failover to a node that never loaded the scripts
        c.script_flush()
    s.push("cnt", np.arange(10), np.zeros((10, 2), np.float32))
    s.delete("cnt", np.arange(3))
    assert s.num_rows("cnt") == 7 == sum(true_rows(c, redis_namespace, "cnt") for c in nodes)
    # the count hash shares the table hash's slot, so create and drop change both in one script
    assert s.client.keyslot(redis_keys.rows_key(redis_namespace)) == s.client.keyslot(
        redis_keys.meta_key(redis_namespace)
    )
    for c in nodes:
        c.close()
    s.close()


def test_listing_many_tables_takes_two_commands(own_redis_url):
    redis_url = own_redis_url
    store = RedisStore.from_url(redis_url, namespace="t")
    for i in range(40):
        store.create_table(TableSchema(f"l{i:02d}", dim=2))
        store.push(f"l{i:02d}", np.arange(i), np.zeros((i, 2), np.float32))
    r = redis.Redis.from_url(redis_url)
    r.config_resetstat()
    listed = store.list_tables_with_rows()
    stats = r.info("commandstats")
    assert [(sch.name, n) for sch, n in listed] == [(f"l{i:02d}", i) for i in range(40)]
    assert {k: v["calls"] for k, v in stats.items() if not k.startswith(("cmdstat_config", "cmdstat_info"))} == {
        "cmdstat_hgetall": 2
    }
    r.close()
    store.close()


def test_tables_of_an_older_version_are_counted_once_and_listing_stops_at_the_deadline(store, redis_url):
    r = redis.Redis.from_url(redis_url)
    for name in ("old1", "old2", "old3"):
        store.create_table(TableSchema(name, dim=2))
        store.push(name, np.arange(30), np.zeros((30, 2), np.float32))
        r.hdel(redis_keys.rows_key(store.namespace), name)  # as an older version left it: no count
    times = iter([1.0, 0.0])
    with pytest.raises(DeadlineExceeded, match="listing tables: the call's deadline passed"):
        store.list_tables_with_rows(lambda: next(times))
    assert r.hget(redis_keys.rows_key(store.namespace), "old1") == b"30"  # counted before the deadline
    assert r.hget(redis_keys.rows_key(store.namespace), "old2") is None  # not counted after it
    assert store.num_rows("old2") == 30 and r.hget(redis_keys.rows_key(store.namespace), "old2") == b"30"
    store.push("old2", np.arange(25, 40), np.zeros((15, 2), np.float32))  # from now on kept by each write
    store.delete("old2", np.arange(5))
    assert [n for _, n in store.list_tables_with_rows(lambda: 1.0)] == [30, 35, 30]
    r.close()


def test_per_table_state_is_small_and_leaves_with_the_table(store, redis_url, redis_namespace, monkeypatch):
    """A PS that used many tables keeps about 1 KB for each, and nothing for tables dropped
    through another PS once it lists the tables or uses one of them again."""
    import tracemalloc

    other = RedisStore.from_url(redis_url, namespace=redis_namespace)
    names = [f"m{i}" for i in range(200)]
    for name in names:
        other.create_table(TableSchema(name, dim=2))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for name in names:
        store.push(name, np.arange(3), np.zeros((3, 2), np.float32))
        store.pull(name, np.arange(3))
    per_table = (tracemalloc.get_traced_memory()[0] - before) / len(names)
    tracemalloc.stop()
    assert per_table < 8 << 10, per_table  # was ~285 KB: the key of each of 4,096 buckets
    for name in names[:150]:
        other.drop_table(name)
    with pytest.raises(TableNotFound):
        store.pull("m0", np.arange(3))
    store.list_tables()
    assert sorted(store._cache) == sorted(names[150:])
    monkeypatch.setattr(redis_keys, "META_CACHE_TABLES", 20)  # and at most this many, dropped or not
    for i in range(30):
        other.create_table(TableSchema(f"n{i}", dim=2))
        store.num_rows(f"n{i}")
    assert list(store._cache) == [f"n{i}" for i in range(10, 30)]  # the least recently used went
    other.close()


def test_a_sweep_runs_beside_creates_and_drops_not_in_them(store, monkeypatch):
    """The sweep of dropped tables' keys (which may visit every bucket of a big table) runs on a
    thread of its own: a create or drop returns while it is still going, one sweep at a time."""
    going, release, calls = threading.Event(), threading.Event(), []

    def slow_sweep() -> int:
        calls.append(threading.current_thread().name)
        going.set()
        release.wait(30)
        return 0

    monkeypatch.setattr(store, "_sweep_dropped", slow_sweep)
    assert store.create_table(TableSchema("a", dim=2))  # returns with its sweep still going
    assert going.wait(10) and store._sweeper is not None and store._sweeper.is_alive()
    assert store.create_table(TableSchema("b", dim=2)) and store.drop_table("a") == 0
    assert calls == ["dynemb-redis-sweep"]  # none started beside the running one
    release.set()
    swept(store)


def test_a_schema_lookup_and_the_row_call_after_it_share_one_metadata_read(store, redis_url, monkeypatch):
    """The service looks a table's schema up to check a request, then pulls or pushes: one
    HGET of the metadata for both. A create or drop through the store since, or more than
    FRESH_METADATA_S, and the row call reads it again (so a table dropped and created again
    here is written, not refused as re-created)."""
    r = redis.Redis.from_url(redis_url)
    schema = TableSchema("fresh", dim=4)
    store.create_table(schema)
    ids = np.arange(100, dtype=np.int64)
    store.push("fresh", ids, np.ones((100, 4), np.float32))

    def hgets(call) -> int:
        before = calls(r, "hget")
        call()
        return calls(r, "hget") - before

    assert hgets(lambda: (store.schema("fresh"), store.pull("fresh", ids))) == 1
    assert hgets(lambda: (store.schemas(["fresh"]), store.pull("fresh", ids), store.pull("fresh", ids))) == 0
    assert hgets(lambda: store.pull("fresh", ids)) == 0  # still within FRESH_METADATA_S of the lookup
    # a lookup itself always reads: it is where a call meets a table dropped meanwhile, or a
    # paused Redis before anything is written (the service checks the deadline after it)
    assert hgets(lambda: (store.schema("fresh"), store.schema("fresh"))) == 2
    store.schema("fresh")
    assert store.drop_table("fresh") == 100 and store.create_table(TableSchema("fresh", dim=4))
    store.push("fresh", ids[:10], np.ones((10, 4), np.float32))  # the new table's metadata, read again
    assert store.num_rows("fresh") == 10
    monkeypatch.setattr(redis_keys, "FRESH_METADATA_S", 0.0)
    assert hgets(lambda: (store.schema("fresh"), store.pull("fresh", ids))) == 2
    r.close()


def test_a_store_that_keeps_changing_under_a_call_is_retried_by_clients(redis_url, redis_namespace, monkeypatch):
    """A create or metadata change that lost its race with other PSes CREATE_TRIES times answers
    UNAVAILABLE, which clients retry until their deadline, not INTERNAL, which they give up on
    at once (issue 44's sweep: a loop bounded by a count, not by the caller's deadline)."""
    store = RedisStore.from_url(redis_url, namespace=redis_namespace)
    try:
        monkeypatch.setattr(redis_keys, "CREATE_TRIES", 0)  # as if every try lost its race
        with pytest.raises(PSError, match="try again") as info:
            store.create_table(TableSchema("t", 4))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        store.close()
