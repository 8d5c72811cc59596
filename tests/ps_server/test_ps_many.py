"""PullMany / PushMany: several tables' rows in one call per PS, through real PS processes.
The same rows as one call per table, in the same order with every other call on those
tables; a bad entry writes nothing of any entry."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import TableNotFound

SCHEMAS = {"user": (8, 8, "fp32"), "item": (4, 0, "fp16"), "ad": (16, 16, "bf16")}


def create(ps: PSClient) -> None:
    for name, (dim, state, dtype) in SCHEMAS.items():
        ps.create_table(name, dim=dim, state_width=state, dtype=dtype)


def random_rows(rng, name: str, n: int) -> np.ndarray:
    dim, state, _ = SCHEMAS[name]
    return rng.standard_normal((n, dim + state)).astype(np.float32)


@pytest.fixture(params=["embedded", "redis"])
def three_shards(request, make_ps):
    """Three PS processes: the client shards every table's ids over them."""
    if request.param == "redis":
        url, namespace = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace")
        # one Redis, three namespaces: three shards that share nothing
        return [make_ps("--backend", url, "--namespace", f"{namespace}_{k}").address for k in range(3)]
    return [make_ps().address for _ in range(3)]


@pytest.mark.slow
def test_many_tables_in_one_call_equal_one_call_per_table(three_shards):
    rng = np.random.default_rng(0)
    # a small message size: each shard's tables are packed into several messages
    with PSClient(three_shards, chunk_bytes=96 << 10) as ps:
        create(ps)
        given = {}
        for name in SCHEMAS:
            ids = rng.integers(-(1 << 62), 1 << 62, 3000)
            ids[-10:] = ids[:10]  # repeated ids: the last row wins, as in one push
            given[name] = (ids, random_rows(rng, name, len(ids)))
        assert ps.push_many(given) == sum(len(ids) for ids, _ in given.values())
        asked = {name: np.concatenate([ids[:500], rng.integers(0, 1000, 50)]) for name, (ids, _) in given.items()}
        asked["empty"] = np.zeros(0, np.int64)
        ps.create_table("empty", dim=2)
        many = ps.pull_many(asked)
        assert list(many) == list(asked)
        for name, ids in asked.items():
            one = ps.pull(name, ids)
            np.testing.assert_array_equal(many[name].rows, one.rows, err_msg=name)
            np.testing.assert_array_equal(many[name].missing, one.missing, err_msg=name)
        for name, (_, rows) in given.items():  # and they are the rows pushed, in the table's dtype
            want = rows[-10:].astype(ps.schema(name).np_dtype)
            np.testing.assert_array_equal(many[name].rows[:10], want, err_msg=name)
            assert many[name].missing[:500].sum() == 0 and many[name].missing[500:].sum() > 0


def test_many_calls_keep_call_order_with_single_table_calls(make_ps):
    rng = np.random.default_rng(1)
    with PSClient(make_ps().address, lanes=3) as ps:
        create(ps)
        ids = np.arange(200)
        for round_ in range(20):  # async calls interleaved: each must see the one made before it
            a = {name: (ids, random_rows(rng, name, 200)) for name in SCHEMAS}
            b = random_rows(rng, "user", 200)
            ps.push_async("user", ids, random_rows(rng, "user", 200))
            ps.push_many_async(a)
            f_after_many = ps.pull_async("user", ids)
            ps.push_async("user", ids, b)
            f_many = ps.pull_many_async({"user": ids, "item": ids})
            np.testing.assert_array_equal(f_after_many.result().rows, a["user"][1], err_msg=f"round {round_}")
            got = f_many.result()
            np.testing.assert_array_equal(got["user"].rows, b)
            np.testing.assert_array_equal(got["item"].rows, a["item"][1].astype(np.float16))


def test_a_push_then_pull_in_one_hand_off_pulls_after_the_push_whatever_it_did(make_ps):
    rng = np.random.default_rng(2)
    with PSClient(make_ps().address) as ps:
        create(ps)
        ids = np.arange(100)
        given = {name: (ids, random_rows(rng, name, 100)) for name in SCHEMAS}
        pushed, pulled = ps.push_then_pull_many_async(given, {name: ids for name in SCHEMAS})
        assert pushed.result() == 100 * len(SCHEMAS)
        got = pulled.result()
        for name, (_, rows) in given.items():
            np.testing.assert_array_equal(got[name].rows, rows.astype(ps.schema(name).np_dtype), err_msg=name)
        # a failed push fails its own future; the pull still runs, after it, as two calls would
        pushed, pulled = ps.push_then_pull_many_async({"no_such_table": given["user"]}, {"user": ids})
        with pytest.raises(TableNotFound):
            pushed.result()
        np.testing.assert_array_equal(pulled.result()["user"].rows, given["user"][1])


def test_a_bad_entry_writes_nothing_of_any_entry(make_ps):
    proc = make_ps()
    with PSClient(proc.address) as ps:
        create(ps)
        ids = np.arange(10, dtype=np.int64)
        good = ps_pb2.PushRequest(table="user", ids=ids.tobytes(), rows=np.ones((10, 16), np.float32).tobytes())
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(proc.address))
        cases = [
            (
                ps_pb2.PushRequest(table="item", ids=ids.tobytes(), rows=np.ones((10, 3), np.float16).tobytes()),
                grpc.StatusCode.INVALID_ARGUMENT,
                "item",
            ),
            (ps_pb2.PushRequest(table="nope", ids=ids.tobytes(), rows=b""), grpc.StatusCode.NOT_FOUND, "nope"),
            (
                ps_pb2.PushRequest(table="item", ids=b"1234567", rows=b""),
                grpc.StatusCode.INVALID_ARGUMENT,
                "multiple of 8",
            ),
        ]
        for bad, code, named in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.PushMany(ps_pb2.PushManyRequest(pushes=[good, bad]), timeout=10)
            assert info.value.code() == code and named in info.value.details()
        assert ps.pull("user", ids).missing.all()  # the good entry before the bad one: not written
        with pytest.raises(grpc.RpcError) as info:
            stub.PullMany(
                ps_pb2.PullManyRequest(
                    pulls=[
                        ps_pb2.PullRequest(table="user", ids=ids.tobytes()),
                        ps_pb2.PullRequest(table="nope", ids=ids.tobytes()),
                    ]
                )
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()
        assert stub.PullMany(ps_pb2.PullManyRequest(), timeout=10).pulls == []  # nothing asked, nothing answered


def test_a_pull_of_many_tables_over_the_message_limit_is_refused_by_name(make_ps):
    proc = make_ps("--max-message-mb", "1")
    with PSClient(proc.address) as ps:
        create(ps)
    ids = np.arange(20_000, dtype=np.int64).tobytes()  # 20k rows of 64 B per table: over 1 MiB together
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(proc.address))
    with pytest.raises(grpc.RpcError) as info:
        stub.PullMany(ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table=t, ids=ids) for t in ("user", "user")]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max message size" in info.value.details() and "40000 rows" in info.value.details()
    with PSClient(proc.address, max_message_bytes=1 << 20) as ps:  # the client cuts it under the limit
        got = ps.pull_many({"user": np.arange(40_000), "ad": np.arange(10_000)})
        assert got["user"].rows.shape == (40_000, 16) and got["ad"].missing.all()


# -- many entries: one store call per table, and bounded (issue 44) ----------------------------------------------------


def redis_calls(r) -> int:
    return sum(v["calls"] for v in r.info("commandstats").values())


def test_many_small_entries_cost_one_store_call_per_table_and_answer_as_pulls(make_ps, own_redis_url):
    """2,000 entries of one or two ids over two tables, some empty, some never pushed: the reply
    is, entry by entry, what a Pull of that entry answers, and the PS made a handful of Redis
    commands, not two per entry (which made 200,000 entries take 36-75 s)."""
    import redis

    proc = make_ps("--backend", own_redis_url, "--namespace", "many")
    with PSClient(proc.address) as ps:
        ps.create_table("t", dim=4)
        ps.create_table("u", dim=2, state_width=1, dtype="fp16")
        ps.push("t", np.arange(0, 3000, 2), np.arange(6000, dtype=np.float32).reshape(1500, 4))
        ps.push("u", np.arange(1000), np.ones((1000, 3), np.float32))
    rng = np.random.default_rng(1)
    entries = [
        ps_pb2.PullRequest(table=("t", "u")[k % 2], ids=rng.integers(0, 3000, k % 3, dtype=np.int64).tobytes())
        for k in range(2000)
    ]
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(proc.address))
    r = redis.Redis.from_url(own_redis_url)
    before = redis_calls(r)
    for table in ("t", "u"):  # what one Pull per table of the same ids costs: an HMGET per bucket
        stub.Pull(ps_pb2.PullRequest(table=table, ids=b"".join(e.ids for e in entries if e.table == table)))
    per_table = redis_calls(r) - before - 1  # the INFO itself
    before = redis_calls(r)
    reply = stub.PullMany(ps_pb2.PullManyRequest(pulls=entries))
    commands = redis_calls(r) - before - 1
    assert commands <= per_table + 2, f"{commands} Redis commands for a PullMany, {per_table} for a Pull per table"
    assert len(reply.pulls) == len(entries)
    for entry, got in zip(entries, reply.pulls):
        assert got == stub.Pull(entry)  # the same fields, missing masks and initialised rows included

    pushes = [
        ps_pb2.PushRequest(table="t", ids=np.int64(k).tobytes(), rows=np.full(4, k, np.float32).tobytes())
        for k in range(2000)
    ]
    before = redis_calls(r)
    stub.Push(
        ps_pb2.PushRequest(table="t", ids=np.arange(2000).tobytes(), rows=np.zeros((2000, 4), np.float32).tobytes())
    )
    one_push = redis_calls(r) - before - 1
    before = redis_calls(r)
    written = stub.PushMany(ps_pb2.PushManyRequest(pushes=pushes))
    commands = redis_calls(r) - before - 1
    assert commands <= one_push + 2, f"{commands} Redis commands for a PushMany, {one_push} for one Push of its ids"
    assert [p.rows_written for p in written.pushes] == [1] * 2000
    with PSClient(proc.address) as ps:
        assert np.array_equal(
            ps.pull("t", np.arange(2000)).rows, np.repeat(np.arange(2000, dtype=np.float32), 4).reshape(-1, 4)
        )


def test_a_batch_over_the_entry_or_id_limit_is_refused_naming_it(make_ps):
    proc = make_ps("--max-request-entries", "100", "--max-request-ids", "1000")
    with PSClient(proc.address) as ps:
        ps.create_table("t", dim=4)
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(proc.address))
    one = np.int64(7).tobytes()
    row = np.ones(4, np.float32).tobytes()
    many_ids = np.arange(1001, dtype=np.int64).tobytes()
    refused = {
        "entries": [
            lambda: stub.PullMany(ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table="t", ids=one)] * 101)),
            lambda: stub.PushMany(
                ps_pb2.PushManyRequest(pushes=[ps_pb2.PushRequest(table="t", ids=one, rows=row)] * 101)
            ),
        ],
        "ids": [
            lambda: stub.Pull(ps_pb2.PullRequest(table="t", ids=many_ids)),
            lambda: stub.Delete(ps_pb2.DeleteRequest(table="t", ids=many_ids)),
            lambda: stub.Touch(ps_pb2.TouchRequest(table="t", ids=many_ids)),
            lambda: stub.PullMany(
                ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table="t", ids=many_ids[:4800])] * 2)
            ),
        ],
    }
    for limit, calls in refused.items():
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"(--max-request-{limit})" in info.value.details(), info.value.details()
    # at the limits: served
    assert len(stub.PullMany(ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table="t", ids=one)] * 100)).pulls) == 100
    assert len(stub.Pull(ps_pb2.PullRequest(table="t", ids=many_ids[:8000])).missing) == 125


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_entries_read_as_protobuf_reads_them_and_damage_is_malformed(native, monkeypatch):
    from dynemb.ps_server import entries
    from dynemb.ps_server.wire import MalformedMessage

    if not native:
        monkeypatch.setattr(entries, "_native", False)
    ref = ps_pb2.SegmentRef(segment=3, offset=1 << 40, size=24)
    pushes = [
        ps_pb2.PushRequest(table="t", ids=np.arange(3).tobytes(), rows=b"r" * 12),
        ps_pb2.PushRequest(table="ü", ids=b"", rows_from=ref),
        ps_pb2.PushRequest(table="t"),
    ]
    data = ps_pb2.PushManyRequest(pushes=pushes).SerializeToString()
    got = entries.parse_row_entries(data, 4, 3, 10)
    assert got.names == ["t", "ü"] and got.table.tolist() == [0, 1, 0]
    assert got.joined_ids.tobytes() == b"".join(p.ids for p in pushes)
    assert got.joined_rows.tobytes() == b"".join(p.rows for p in pushes)
    for k, p in enumerate(pushes):
        assert (got.ids_len[k], got.rows_len[k]) == (len(p.ids), len(p.rows))
        assert bool(got.has_ref[k]) == p.HasField("rows_from")
    assert got.refs[1].tolist() == [3, 1 << 40, 24]
    pulls = [ps_pb2.PullRequest(table="u", ids=b"i" * 16), ps_pb2.PullRequest(table="t", rows_to=ref)]
    pulled = entries.parse_row_entries(ps_pb2.PullManyRequest(pulls=pulls).SerializeToString(), 3, 0, 10)
    assert pulled.names == ["u", "t"] and pulled.ids_len.tolist() == [16, 0] and pulled.rows_len.tolist() == [0, 0]
    assert pulled.has_ref.tolist() == [False, True] and pulled.refs.tolist() == [[0, 0, 0], [3, 1 << 40, 24]]
    with pytest.raises(entries.TooManyEntries) as info:
        entries.parse_row_entries(data, 4, 3, 2)
    assert info.value.count == 3
    for cut in range(1, len(data)):  # every truncation: read as protobuf reads it, or malformed
        try:
            expected = len(ps_pb2.PushManyRequest.FromString(data[:cut]).pushes)
        except Exception:  # noqa: BLE001 - protobuf's own refusal
            expected = None
        try:
            assert len(entries.parse_row_entries(data[:cut], 4, 3, 10)) == expected
        except MalformedMessage:
            pass


def test_batch_replies_written_natively_equal_numpy_and_protobuf(monkeypatch):
    """pull_many_reply and push_many_reply of the compiled module, byte for byte those of the
    numpy layout and of the generated code: tables of other row sizes interleaved, entries of
    no ids, rows into segments (none in the message), missing ids, varints past one byte."""
    from dynemb.ps_server import entries

    module = entries._module()
    if not module:
        pytest.skip("no compiler: only the numpy layout runs here")
    rng = np.random.default_rng(3)
    row_bytes = np.array([16, 8, 96], dtype=np.int64)
    n = 300
    counts = rng.choice([0, 1, 2, 9, 200], size=n).astype(np.int64)
    table = rng.integers(0, 3, size=n).astype(np.int64)
    in_message = rng.random(n) > 0.1
    missing = rng.random(int(counts.sum())) < 0.05
    starts = np.cumsum(counts) - counts
    tables, expected = [], []
    for t in range(3):
        own = np.flatnonzero(table == t)
        rows = rng.integers(0, 256, size=int(counts[own].sum()) * int(row_bytes[t]), dtype=np.uint8)
        tables.append(entries.PulledTable(rows.reshape(-1, int(row_bytes[t])), own))
    for e in range(n):
        own = tables[table[e]].entries
        first = int(counts[own[own < e]].sum())
        rows = tables[table[e]].rows[first : first + counts[e]].tobytes() if in_message[e] else b""
        gone = missing[starts[e] : starts[e] + counts[e]]
        mask = np.packbits(gone, bitorder="little").tobytes() if gone.any() else b""
        expected.append(ps_pb2.PullResponse(rows=rows, missing=mask, num_missing=int(gone.sum())))
    want = ps_pb2.PullManyResponse(pulls=expected).SerializeToString()
    assert module.pull_many_reply(counts, table, in_message, missing, row_bytes, [t.rows for t in tables]) == want
    assert entries._pull_many_reply(counts, row_bytes[table], in_message, missing, tables) == want
    assert max(len(p.rows) for p in expected) >= 128 * 96  # a rows length of two varint bytes
    most = entries.pull_many_reply_size(counts, table, in_message, row_bytes)
    monkeypatch.setattr(entries, "_native", False)
    assert len(want) <= most <= entries.pull_many_reply_size(counts, table, in_message, row_bytes)
    monkeypatch.undo()

    pushed = np.array([0, 1, 127, 128, 300, 1 << 40], dtype=np.int64)
    want = ps_pb2.PushManyResponse(pushes=[ps_pb2.PushResponse(rows_written=int(c)) for c in pushed])
    assert module.push_many_reply(pushed) == want.SerializeToString()
    # arguments that disagree are refused before a byte is written, never read past
    all_rows = [t.rows for t in tables]
    with pytest.raises(ValueError, match="out of its buffers"):
        module.pull_many_reply(counts, np.full(n, 3), in_message, missing, row_bytes, all_rows)
    with pytest.raises(ValueError, match="out of its buffers"):
        module.pull_many_reply(counts, table, in_message, missing[:-1], row_bytes, all_rows)
    with pytest.raises(ValueError, match="another length"):
        module.pull_many_reply(counts, table, in_message, np.append(missing, False), row_bytes, all_rows)
    with pytest.raises(ValueError, match="past the end"):
        module.pull_many_reply(counts, table, in_message, missing, row_bytes, [t.rows[:1] for t in tables])
