"""PullMany / PushMany: several tables' rows in one call per PS, through real PS processes.
The same rows as one call per table, in the same order with every other call on those
tables; a bad entry writes nothing of any entry."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server.client import PSClient

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
