"""Serialized PullResponse and PushRequest, built around one copy of the rows.

protobuf copies a bytes field on the way in and again on the way out, and numpy's
tobytes() copies before that: three copies of an 8 MiB batch per side. These two
messages carry nearly all the PS's bytes, so they are written in protobuf's wire form
directly (tag, length, payload per field; see protos/ps.proto for the field numbers)
and parsed by the generated classes like any other message. tests/test_ps_wire.py
checks both against the generated code.
"""

from __future__ import annotations

import numpy as np


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bytes_field(number: int, payload) -> list:
    """A length-delimited field (wire type 2): tag, length, payload (any bytes-like)."""
    return [_varint(number << 3 | 2), _varint(len(payload)), payload]


def _array(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def encode_pull_response(rows: np.ndarray, missing: bytes, num_missing: int) -> bytes:
    """PullResponse{rows=1, missing=2, num_missing=3}; empty fields left out, as protobuf does."""
    parts = _bytes_field(1, _array(rows)) if rows.size else []
    if missing:
        parts += _bytes_field(2, missing)
    if num_missing:
        parts += [_varint(3 << 3 | 0), _varint(num_missing)]
    return b"".join(parts)


def encode_push_request(table: str, ids: np.ndarray, rows: np.ndarray) -> bytes:
    """PushRequest{table=1, ids=2, rows=3}; ids as little-endian int64."""
    parts = _bytes_field(1, table.encode()) if table else []
    if len(ids):
        parts += _bytes_field(2, _array(ids.astype("<i8", copy=False)))
    if rows.size:
        parts += _bytes_field(3, _array(rows))
    return b"".join(parts)
