"""dynemb/ps_server/wire.py writes PullResponse and PushRequest by hand: the generated code must read them back."""

import numpy as np
import pytest

from dynemb.protos import ps_pb2
from dynemb.ps_server.wire import ReplyPlan, build_pull_many_response, build_pull_response, encode_push_request


def _pull(n: int, width: int, dtype: str, seed: int) -> tuple[ReplyPlan, ps_pb2.PullResponse]:
    """A reply to build (the PS's own writer) and the same reply as the generated code has it."""
    rng = np.random.default_rng(seed)
    rows = rng.random((n, width)).astype(dtype) if dtype != "<u2" else rng.integers(0, 1 << 16, (n, width), dtype="<u2")
    marks = rng.random(n) < 0.3
    num_missing = int(marks.sum())
    missing = np.packbits(marks, bitorder="little").tobytes() if num_missing else b""

    def fill(out):
        out[:] = rows
        return missing, num_missing

    plan = ReplyPlan(n, width, np.dtype(dtype), fill)
    return plan, ps_pb2.PullResponse(rows=rows.tobytes(), missing=missing, num_missing=num_missing)


@pytest.mark.parametrize("n,width,dtype", [(0, 4, "<f4"), (1, 1, "<f2"), (3, 7, "<u2"), (5000, 128, "<f4")])
def test_pull_response_is_byte_identical_to_generated(n, width, dtype):
    plan, want = _pull(n, width, dtype, n)
    assert build_pull_response(plan) == want.SerializeToString()


@pytest.mark.parametrize("table,n", [("t", 0), ("user.v2", 1), ("x" * 128, 3000)])
def test_push_request_parses_as_generated(table, n):
    rng = np.random.default_rng(n)
    ids = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
    rows = rng.random((n, 9)).astype(np.float32)
    wire = encode_push_request(table, ids, rows)
    parsed = ps_pb2.PushRequest.FromString(wire)
    assert parsed.table == table
    assert np.array_equal(np.frombuffer(parsed.ids, "<i8"), ids)
    assert parsed.rows == rows.tobytes()
    assert wire == ps_pb2.PushRequest(table=table, ids=ids.tobytes(), rows=rows.tobytes()).SerializeToString()


def test_non_contiguous_rows_are_written_in_row_order():
    rows = np.arange(40, dtype=np.float32).reshape(8, 5)[::2]  # a strided view
    parsed = ps_pb2.PushRequest.FromString(encode_push_request("t", np.arange(4), rows))
    assert np.array_equal(np.frombuffer(parsed.rows, np.float32).reshape(4, 5), rows)


def test_many_table_messages_are_byte_identical_to_generated():
    from dynemb.ps_server.wire import encode_push_many_request, push_request_parts

    rng = np.random.default_rng(7)
    pulls, pushes = [], []
    for n in (0, 1, 300, 200_000):  # the last one's length needs a 3-byte varint
        pulls.append(_pull(n, 4, "<f4", n))
        pushes.append((f"t{n}", rng.integers(-(1 << 62), 1 << 62, n), rng.random((n, 4)).astype("<f4")))
    got = build_pull_many_response([plan for plan, _ in pulls])
    assert got == ps_pb2.PullManyResponse(pulls=[want for _, want in pulls]).SerializeToString()
    got = encode_push_many_request([push_request_parts(*p) for p in pushes])
    want = ps_pb2.PushManyRequest(
        pushes=[ps_pb2.PushRequest(table=t, ids=i.astype("<i8").tobytes(), rows=r.tobytes()) for t, i, r in pushes]
    ).SerializeToString()
    assert got == want


# -- reading in place -------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dynemb.ps_server.wire import (  # noqa: E402
    MalformedMessage,
    parse_pull_many_response,
    parse_pull_response,
    parse_push_many_request,
    parse_push_request,
)

_blobs = st.binary(max_size=300)


@settings(max_examples=200, deadline=None)
@given(rows=_blobs, missing=_blobs, num_missing=st.integers(0, (1 << 64) - 1))
def test_pull_response_reads_as_generated_writes(rows, missing, num_missing):
    wire = ps_pb2.PullResponse(rows=rows, missing=missing, num_missing=num_missing).SerializeToString()
    got = parse_pull_response(wire)
    assert (bytes(got.rows), bytes(got.missing), got.num_missing) == (rows, missing, num_missing)


@settings(max_examples=200, deadline=None)
@given(pushes=st.lists(st.tuples(st.text(max_size=20), _blobs, _blobs), max_size=5))
def test_push_requests_read_as_generated_writes(pushes):
    msgs = [ps_pb2.PushRequest(table=t, ids=i, rows=r) for t, i, r in pushes]
    for m, (t, i, r) in zip(msgs, pushes):
        got = parse_push_request(m.SerializeToString())
        assert (got.table, bytes(got.ids), bytes(got.rows)) == (t, i, r)
    many = parse_push_many_request(ps_pb2.PushManyRequest(pushes=msgs).SerializeToString())
    assert [(p.table, bytes(p.ids), bytes(p.rows)) for p in many.pushes] == pushes


def test_pull_many_response_reads_each_reply_in_order():
    replies = [ps_pb2.PullResponse(rows=bytes([k]) * k, missing=b"\x01" * k, num_missing=k) for k in range(4)]
    got = parse_pull_many_response(ps_pb2.PullManyResponse(pulls=replies).SerializeToString())
    assert [(bytes(g.rows), bytes(g.missing), g.num_missing) for g in got] == [
        (r.rows, r.missing, r.num_missing) for r in replies
    ]


def test_rows_are_read_in_place_not_copied():
    wire = encode_push_request("t", np.arange(4), np.ones((4, 8), np.float32))
    got = parse_push_request(wire)
    assert got.rows.obj is wire  # a view of the received bytes
    assert np.array_equal(np.frombuffer(got.rows, np.float32), np.ones(32, np.float32))


def test_unknown_fields_are_skipped_as_protobuf_does():
    # a newer writer's extra fields of every wire type: varint 7, fixed64 8, bytes 9, fixed32 10
    extra = (
        bytes([7 << 3 | 0, 0x96, 0x01, 8 << 3 | 1])
        + b"\0" * 8
        + bytes([9 << 3 | 2, 2])
        + b"hi"
        + bytes([10 << 3 | 5])
        + b"\0" * 4
    )
    wire = extra + ps_pb2.PushRequest(table="t", ids=b"\1" * 8, rows=b"\2" * 4).SerializeToString() + extra
    assert ps_pb2.PushRequest.FromString(wire).table == "t"  # the generated code agrees it is valid
    got = parse_push_request(wire)
    assert (got.table, bytes(got.ids), bytes(got.rows)) == ("t", b"\1" * 8, b"\2" * 4)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_damaged_messages_raise_malformed_message_and_nothing_else(data):
    """Cut or flip any byte of a valid message: the reader either reads something (as the
    generated code does) or raises MalformedMessage; what the generated code refuses, it refuses."""
    wire = bytearray(
        ps_pb2.PushManyRequest(
            pushes=[ps_pb2.PushRequest(table="tab", ids=b"\1" * 16, rows=b"\2" * 40)] * 2
        ).SerializeToString()
    )
    if data.draw(st.booleans()):
        wire = wire[: data.draw(st.integers(0, len(wire) - 1))]
    else:
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        ps_pb2.PushManyRequest.FromString(bytes(wire))
        generated_ok = True
    except Exception:
        generated_ok = False
    try:
        parse_push_many_request(bytes(wire))
        ours_ok = True
    except MalformedMessage:
        ours_ok = False
    if not generated_ok:
        assert not ours_ok, "the generated code refuses this message; the reader must too"


@pytest.mark.parametrize(
    "wire,why",
    [
        (b"\x0a\x05abc", "claims 5 bytes"),
        (b"\x0a", "varint runs past"),
        (b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "over 10 bytes"),
        (b"\x0b", "wire type 3"),
        (b"\x00\x01", "numbered 0"),
        (b"\x08\x01", "wire type 0, expected 2"),
        (b"\x0a\x02\xff\xfe", "not valid UTF-8"),
    ],
)
def test_each_damage_is_named(wire, why):
    with pytest.raises(MalformedMessage, match=why):
        parse_push_request(wire)


# -- pull replies built in place -------------------------------------------------------

from dynemb.ps_server import wire  # noqa: E402


def _plan(n: int, width: int, seed: int, dtype="<f4") -> tuple[ReplyPlan, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = rng.random((n, width)).astype(dtype)
    missing = rng.random(n) < 0.25

    def fill(out):
        out[:] = rows
        k = int(missing.sum())
        return (np.packbits(missing, bitorder="little").tobytes() if k else b""), k

    return ReplyPlan(n, width, np.dtype(dtype), fill), rows, missing


def _check(reply, rows, missing):
    assert reply.rows == rows.tobytes()
    assert reply.num_missing == missing.sum()
    if reply.num_missing:
        assert np.array_equal(
            np.unpackbits(np.frombuffer(reply.missing, np.uint8), bitorder="little", count=len(missing)).astype(bool),
            missing,
        )


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("n,width", [(0, 3), (1, 1), (5, 7), (4000, 128)])
def test_pull_response_built_in_place_parses_as_generated(monkeypatch, native, n, width):
    if not native:
        monkeypatch.setattr(wire, "_native_filled_bytes", False)  # the bytearray fallback
    plan, rows, missing = _plan(n, width, n)
    _check(ps_pb2.PullResponse.FromString(build_pull_response(plan)), rows, missing)


@pytest.mark.parametrize("native", [True, False])
def test_pull_many_response_built_in_place_parses_as_generated(monkeypatch, native):
    if not native:
        monkeypatch.setattr(wire, "_native_filled_bytes", False)
    # sizes around varint edges: a reply's length with and without its missing fields
    # straddles 128 bytes for (13, 2): then the message is joined instead
    shapes = [(0, 4), (1, 1), (13, 2), (300, 5), (1000, 128), (3, 3)]
    built = [_plan(n, w, k) for k, (n, w) in enumerate(shapes)]
    got = ps_pb2.PullManyResponse.FromString(build_pull_many_response([p for p, _, _ in built]))
    assert len(got.pulls) == len(shapes)
    for reply, (_, rows, missing) in zip(got.pulls, built):
        _check(reply, rows, missing)


def test_filled_bytes_refuses_a_fill_that_overruns_or_fails():
    from dynemb.ps_server import native

    filled = native.id_index().filled_bytes
    assert filled(8, lambda v: v.__setitem__(slice(0, 3), b"abc") or 3) == b"abc"  # shrunk to what was used
    with pytest.raises(ValueError, match="used 9 of 8"):
        filled(8, lambda v: 9)
    with pytest.raises(ZeroDivisionError):
        filled(8, lambda v: 1 // 0)
    escaped = []
    filled(8, lambda v: escaped.append(v) or 0)
    with pytest.raises(ValueError, match="released"):  # the view itself is dead once filled_bytes returns
        escaped[0][0] = 1


# -- rows through a segment (dynemb/ps_server/shm.py) -------------------------------------

from dynemb.ps_server.wire import push_request_parts  # noqa: E402

_u64 = st.integers(0, (1 << 64) - 1)


@given(pushes=st.lists(st.tuples(st.text(max_size=20), _blobs, st.tuples(_u64, _u64, _u64)), max_size=4))
def test_push_requests_with_rows_from_read_as_generated_writes(pushes):
    for table, ids, (segment, offset, size) in pushes:
        generated = ps_pb2.PushRequest(
            table=table, ids=ids, rows_from=ps_pb2.SegmentRef(segment=segment, offset=offset, size=size)
        ).SerializeToString()
        got = parse_push_request(generated)
        assert (got.table, bytes(got.ids), bytes(got.rows), got.rows_from) == (table, ids, b"", (segment, offset, size))
        # and ours reads back the same through the generated code
        ours = b"".join(
            push_request_parts(table, np.frombuffer(ids[: len(ids) // 8 * 8], "<i8"), None, (segment, offset, size))
        )
        back = ps_pb2.PushRequest.FromString(ours)
        assert (back.rows_from.segment, back.rows_from.offset, back.rows_from.size) == (segment, offset, size)
        assert back.HasField("rows_from") and back.rows == b""


def test_a_push_without_rows_from_reads_as_none():
    assert parse_push_request(ps_pb2.PushRequest(table="t", rows=b"\0" * 8).SerializeToString()).rows_from is None


@pytest.mark.parametrize("native", [True, False])
def test_pull_replies_with_rows_in_a_segment_carry_only_the_missing_marks(monkeypatch, native):
    if not native:
        monkeypatch.setattr(wire, "_native_filled_bytes", False)
    into = np.zeros((300, 5), np.float32)
    plan, rows, missing = _plan(300, 5, 1)
    plan.into = into
    other, other_rows, other_missing = _plan(20, 3, 2)
    got = ps_pb2.PullManyResponse.FromString(build_pull_many_response([plan, other]))
    assert got.pulls[0].rows == b"" and np.array_equal(into, rows)  # the rows went to `into`
    assert got.pulls[0].num_missing == int(missing.sum())
    _check(got.pulls[1], other_rows, other_missing)  # a reply beside it keeps its rows
    one = ps_pb2.PullResponse.FromString(build_pull_response(plan))
    assert one.rows == b"" and one.num_missing == int(missing.sum())
