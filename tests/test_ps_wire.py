"""ps_server/wire.py writes PullResponse and PushRequest by hand: the generated code must read them back."""

import numpy as np
import pytest

from protos import ps_pb2
from ps_server.wire import encode_pull_response, encode_push_request


@pytest.mark.parametrize("n,width,dtype", [(0, 4, "<f4"), (1, 1, "<f2"), (3, 7, "<u2"), (5000, 128, "<f4")])
def test_pull_response_parses_as_generated(n, width, dtype):
    rng = np.random.default_rng(n)
    rows = rng.random((n, width)).astype(dtype) if dtype != "<u2" else rng.integers(0, 1 << 16, (n, width), dtype="<u2")
    missing = np.packbits(rng.random(n) < 0.3, bitorder="little").tobytes()
    num_missing = int(np.unpackbits(np.frombuffer(missing, np.uint8)).sum())
    wire = encode_pull_response(rows, missing, num_missing)
    parsed = ps_pb2.PullResponse.FromString(wire)
    assert parsed.rows == rows.tobytes()
    assert parsed.missing == missing
    assert parsed.num_missing == num_missing
    # byte-identical to what protobuf writes for the same message
    assert wire == ps_pb2.PullResponse(rows=rows.tobytes(), missing=missing, num_missing=num_missing).SerializeToString()


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
    parsed = ps_pb2.PullResponse.FromString(encode_pull_response(rows, b"", 0))
    assert np.array_equal(np.frombuffer(parsed.rows, np.float32).reshape(4, 5), rows)


def test_many_table_messages_are_byte_identical_to_generated():
    from ps_server.wire import (encode_pull_many_response, encode_push_many_request, pull_response_parts,
                                push_request_parts)

    rng = np.random.default_rng(7)
    pulls, pushes = [], []
    for n in (0, 1, 300, 200_000):  # the last one's length needs a 3-byte varint
        rows = rng.random((n, 4)).astype("<f4")
        missing = np.packbits(rng.random(n) < 0.5, bitorder="little").tobytes()
        pulls.append((rows, missing, n // 3))
        pushes.append((f"t{n}", rng.integers(-(1 << 62), 1 << 62, n), rows))
    got = encode_pull_many_response([pull_response_parts(*p) for p in pulls])
    want = ps_pb2.PullManyResponse(pulls=[ps_pb2.PullResponse(rows=r.tobytes(), missing=m, num_missing=k)
                                          for r, m, k in pulls]).SerializeToString()
    assert got == want
    got = encode_push_many_request([push_request_parts(*p) for p in pushes])
    want = ps_pb2.PushManyRequest(pushes=[ps_pb2.PushRequest(table=t, ids=i.astype("<i8").tobytes(), rows=r.tobytes())
                                          for t, i, r in pushes]).SerializeToString()
    assert got == want
