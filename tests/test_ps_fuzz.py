"""Fuzzing a running PS (embedded store, and Redis): more than 10,000 malformed or hostile
requests per backend, made by hypothesis from the proto's messages (random bytes in every
field, huge and negative sizes sent as raw varints, unknown enums, mismatched sizes, bytes
that parse as no message, import streams cut half-way or changing spec, exports dropped
half-way). The PS must answer every one with OK or a clear status and a message, never die,
and leave the rows stored before, in tables the fuzzer can only send invalid requests to,
bit for bit as they were."""

from __future__ import annotations

import threading
import uuid

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynemb.local import LocalPS
from protos import ps_pb2
from ps_server.client import PSClient
from ps_server.wire import _varint

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
PATH = {m.name: f"/{SERVICE.full_name}/{m.name}" for m in SERVICE.methods}
CLEAR = {  # what a hostile request may get: a status that says what was wrong with it
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.CANCELLED,  # only for the streams this test cuts itself
}
VICTIMS = {"victim_f32": (8, 4, "fp32"), "victim_f16": (3, 0, "fp16"), "victim_bf16": (5, 5, "bf16")}
FUZZ_TABLES = ["fz_a", "fz_b", "fz.c-1"]
EXAMPLES, PER_EXAMPLE = 220, 50  # 11,000 requests per backend


def varint(n: int) -> bytes:
    return _varint(n & ((1 << 64) - 1))  # a negative number as protobuf writes an int64: ten bytes


def field(number: int, wire_type: int, payload: bytes | int) -> bytes:
    if wire_type == 0:
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


# -- strategies ---------------------------------------------------------------------

names = st.sampled_from(FUZZ_TABLES + ["", "x" * 129, "bad name", "../etc", "t\x00"]) | st.text(max_size=40)
id_bytes = (st.binary(max_size=2048)
            | st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=300).map(lambda v: np.array(v, "<i8").tobytes()))
row_bytes = st.binary(max_size=4096) | st.integers(0, 3000).map(lambda n: np.ones(n, "<f4").tobytes())
u32 = st.sampled_from([0, 1, 2, 3, 8, 64, 1 << 20, (1 << 31) - 1, (1 << 32) - 1]) | st.integers(0, (1 << 32) - 1)
enum = st.sampled_from([0, 1, 2, 3, 4, 5, -1, 99, (1 << 31) - 1, -(1 << 31)])
doubles = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def specs(draw, name=names):
    init = ps_pb2.Initializer(kind=draw(enum), a=draw(doubles), b=draw(doubles), seed=draw(st.integers(0, (1 << 64) - 1)),
                              state_init=draw(doubles))
    return ps_pb2.TableSpec(name=draw(name), dim=draw(u32), state_width=draw(u32), dtype=draw(enum), initializer=init)


def structured(method: str, draw) -> bytes:
    """A request of the method's own type with hostile field values."""
    if method == "CreateTable":
        msg = ps_pb2.CreateTableRequest(spec=draw(specs())) if draw(st.booleans()) else ps_pb2.CreateTableRequest()
    elif method in ("DescribeTable",):
        msg = ps_pb2.DescribeTableRequest(table=draw(names))
    elif method == "DropTable":
        msg = ps_pb2.DropTableRequest(table=draw(st.sampled_from(FUZZ_TABLES) | st.text(max_size=20)),
                                      missing_ok=draw(st.booleans()))
    elif method in ("Pull", "Delete"):
        msg = getattr(ps_pb2, f"{method}Request")(table=draw(names), ids=draw(id_bytes))
    elif method == "Push":
        msg = ps_pb2.PushRequest(table=draw(names), ids=draw(id_bytes), rows=draw(row_bytes))
    elif method == "PullMany":
        msg = ps_pb2.PullManyRequest(pulls=[ps_pb2.PullRequest(table=draw(names), ids=draw(id_bytes))
                                            for _ in range(draw(st.integers(0, 4)))])
    elif method == "PushMany":
        msg = ps_pb2.PushManyRequest(pushes=[ps_pb2.PushRequest(table=draw(names), ids=draw(id_bytes), rows=draw(row_bytes))
                                             for _ in range(draw(st.integers(0, 4)))])
    elif method == "Export":
        msg = ps_pb2.ExportRequest(table=draw(names), rows_per_chunk=draw(u32))
    elif method == "ListTables":
        msg = ps_pb2.ListTablesRequest()
    else:
        msg = ps_pb2.StatsRequest()
    return msg.SerializeToString()


def raw(draw) -> bytes:
    """Bytes built field by field: negative and huge numbers, lengths that lie, unknown fields."""
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        number = draw(st.integers(1, 6) | st.integers(7, 1 << 20))
        kind = draw(st.sampled_from(["int", "bytes", "lying", "garbage"]))
        if kind == "int":
            parts.append(field(number, 0, draw(st.integers(-(1 << 63), (1 << 64) - 1))))
        elif kind == "bytes":
            parts.append(field(number, 2, draw(st.binary(max_size=64))))
        elif kind == "lying":  # a length far past the end of the message
            parts.append(varint(number << 3 | 2) + varint(draw(st.integers(1 << 20, 1 << 62))) + b"xy")
        else:
            parts.append(draw(st.binary(min_size=1, max_size=32)))
    return b"".join(parts)


@st.composite
def requests(draw):
    method = draw(st.sampled_from([m for m in PATH if m != "Import"] + ["Import"] * 2))
    if method == "Import":
        chunks = []
        for k in range(draw(st.integers(0, 4))):
            chunk = ps_pb2.RowChunk(ids=draw(id_bytes), rows=draw(row_bytes), replace=draw(st.booleans()))
            if k == 0 or draw(st.booleans()):
                chunk.spec.CopyFrom(draw(specs(st.sampled_from(FUZZ_TABLES) | st.text(max_size=20))))
            chunks.append(chunk.SerializeToString() if draw(st.booleans()) else draw(st.binary(max_size=64)))
        return method, chunks, draw(st.booleans())  # the last: cut the stream half-way
    body = structured(method, draw) if draw(st.booleans()) else raw(draw)
    return method, body, draw(st.booleans())  # the last (Export): drop it after the first chunk


# -- the PS under fire --------------------------------------------------------------


def victims(ps: PSClient) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for name in VICTIMS:
        chunks = list(ps.export(name))
        ids = np.concatenate([c[0] for c in chunks])
        rows = np.concatenate([c[1] for c in chunks])
        order = np.argsort(ids)
        out[name] = (ids[order], rows[order].view(np.uint8))
    return out


@pytest.fixture(scope="module", params=["embedded", "redis"])
def target(request):
    args = ["--not-serving-seconds", "0", "--workers", "8"]
    if request.param == "redis":
        args += ["--backend", request.getfixturevalue("redis_url"), "--namespace", f"fuzz{uuid.uuid4().hex[:8]}"]
    proc = LocalPS(*args).start()
    client = PSClient(proc.address, timeout=30)
    rng = np.random.default_rng(0)
    for name, (dim, state, dtype) in VICTIMS.items():
        client.create_table(name, dim=dim, state_width=state, dtype=dtype)
        ids = rng.integers(-(1 << 63), (1 << 63) - 1, 500)
        client.push(name, ids, rng.standard_normal((500, dim + state)).astype(np.float32))
    before = victims(client)
    channel = grpc.insecure_channel(proc.address, options=[("grpc.max_send_message_length", 1 << 30)])
    yield proc, channel, client
    after = victims(client)
    for name in VICTIMS:  # nothing the fuzzer sent changed a stored row
        np.testing.assert_array_equal(after[name][0], before[name][0], err_msg=name)
        np.testing.assert_array_equal(after[name][1], before[name][1], err_msg=name)
    assert proc.proc.poll() is None and client.health() == ["SERVING"]
    channel.close()
    client.close()
    proc.close()


def send(channel: grpc.Channel, method: str, body, cut: bool) -> grpc.StatusCode:
    ident = lambda b: b  # noqa: E731 - bytes go out as they are
    if method == "Import":
        call = channel.stream_unary(PATH[method], request_serializer=ident, response_deserializer=ident)
        if cut:  # half the chunks, then the client gives up on the call
            half = body[: len(body) // 2]
            gate = threading.Event()

            def stream():
                yield from half
                gate.wait(5)

            future = call.future(stream(), timeout=30)
            future.cancel()
            gate.set()
            return grpc.StatusCode.CANCELLED
        try:
            call(iter(body), timeout=30)
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return checked(err)
    if method == "Export":
        call = channel.unary_stream(PATH[method], request_serializer=ident, response_deserializer=ident)
        try:
            replies = call(body, timeout=30)
            for _ in replies:
                if cut:
                    replies.cancel()
                    return grpc.StatusCode.CANCELLED
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return checked(err)
    call = channel.unary_unary(PATH[method], request_serializer=ident, response_deserializer=ident)
    try:
        call(body, timeout=30)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return checked(err)


def checked(err: grpc.RpcError) -> grpc.StatusCode:
    code = err.code()
    if code == grpc.StatusCode.CANCELLED:
        return code
    assert code in CLEAR, f"{code}: {err.details()}"
    assert err.details(), f"{code} without a message"
    return code


def hostile_to_victims(draw) -> tuple[str, bytes, bool]:
    """A request naming a victim table that must fail: wrong sizes, another schema."""
    name = draw(st.sampled_from(sorted(VICTIMS)))
    dim, state, _ = VICTIMS[name]
    kind = draw(st.sampled_from(["push_width", "push_ids", "pull_ids", "create_other", "import_other", "many"]))
    if kind == "push_width":
        n = draw(st.integers(1, 50))
        return "Push", ps_pb2.PushRequest(table=name, ids=np.arange(n, dtype="<i8").tobytes(),
                                          rows=np.ones(n * (dim + state) + 1, "<f4").tobytes()).SerializeToString(), False
    if kind in ("push_ids", "pull_ids"):
        ids = draw(st.binary(min_size=1, max_size=100).filter(lambda b: len(b) % 8))
        msg = (ps_pb2.PushRequest(table=name, ids=ids, rows=b"") if kind == "push_ids"
               else ps_pb2.PullRequest(table=name, ids=ids))
        return kind.split("_")[0].capitalize(), msg.SerializeToString(), False
    other = ps_pb2.TableSpec(name=name, dim=dim + 1, state_width=state, dtype=ps_pb2.FP32)
    if kind == "create_other":
        return "CreateTable", ps_pb2.CreateTableRequest(spec=other).SerializeToString(), False
    if kind == "import_other":
        chunk = ps_pb2.RowChunk(spec=other, replace=True, ids=np.arange(3, dtype="<i8").tobytes(),
                                rows=np.ones(3 * (dim + 1 + state), "<f4").tobytes())
        return "Import", [chunk.SerializeToString()], False
    good = ps_pb2.PushRequest(table=name, ids=np.arange(2, dtype="<i8").tobytes(),
                              rows=np.zeros(2 * (dim + state), "<f4").tobytes())
    bad = ps_pb2.PushRequest(table="no_such_table", ids=b"", rows=b"")
    return "PushMany", ps_pb2.PushManyRequest(pushes=[good, bad]).SerializeToString(), False


SENT = {"embedded": 0, "redis": 0}


@given(data=st.data())
@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_hostile_requests_get_clear_answers_and_change_no_stored_row(target, data):
    proc, channel, _ = target
    backend = "redis" if "--backend" in proc.args else "embedded"
    for _ in range(PER_EXAMPLE):
        if data.draw(st.integers(0, 9)) == 0:
            method, body, cut = hostile_to_victims(data.draw)
            code = send(channel, method, body, cut)
            assert code != grpc.StatusCode.OK, f"{method} on a victim table was accepted"
        else:
            method, body, cut = data.draw(requests())
            send(channel, method, body, cut)
        SENT[backend] += 1
    assert proc.proc.poll() is None, f"the PS died:\n{proc.log()[-4000:]}"


def test_the_fuzzer_sent_enough(target):
    """Runs after the fuzz test of its backend (same module fixture)."""
    proc, _, client = target
    backend = "redis" if "--backend" in proc.args else "embedded"
    assert SENT[backend] >= 10_000, SENT
    assert client.health() == ["SERVING"]
