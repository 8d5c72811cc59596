"""Serialized PullResponse and PushRequest (and their many-table forms), built around one
copy of the rows.

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


def _nested(number: int, parts: list) -> list:
    """A message field (wire type 2) around an already encoded message's parts; no copy."""
    return [_varint(number << 3 | 2), _varint(sum(len(p) for p in parts)), *parts]


def pull_response_parts(rows: np.ndarray, missing: bytes, num_missing: int) -> list:
    """PullResponse{rows=1, missing=2, num_missing=3}; empty fields left out, as protobuf does."""
    parts = _bytes_field(1, _array(rows)) if rows.size else []
    if missing:
        parts += _bytes_field(2, missing)
    if num_missing:
        parts += [_varint(3 << 3 | 0), _varint(num_missing)]
    return parts


def push_request_parts(table: str, ids: np.ndarray, rows: np.ndarray) -> list:
    """PushRequest{table=1, ids=2, rows=3}; ids as little-endian int64."""
    parts = _bytes_field(1, table.encode()) if table else []
    if len(ids):
        parts += _bytes_field(2, _array(ids.astype("<i8", copy=False)))
    if rows.size:
        parts += _bytes_field(3, _array(rows))
    return parts


def encode_pull_response(rows: np.ndarray, missing: bytes, num_missing: int) -> bytes:
    return b"".join(pull_response_parts(rows, missing, num_missing))


def encode_push_request(table: str, ids: np.ndarray, rows: np.ndarray) -> bytes:
    return b"".join(push_request_parts(table, ids, rows))


def encode_pull_many_response(replies: list[list]) -> bytes:
    """PullManyResponse{repeated PullResponse pulls=1} from each reply's pull_response_parts."""
    return b"".join(part for reply in replies for part in _nested(1, reply))


def encode_push_many_request(pushes: list[list]) -> bytes:
    """PushManyRequest{repeated PushRequest pushes=1} from each push's push_request_parts."""
    return b"".join(part for push in pushes for part in _nested(1, push))
