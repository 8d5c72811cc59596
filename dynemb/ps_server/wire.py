"""PullResponse and PushRequest (and their many-table forms) written and read around the
rows without copying them.

protobuf copies a bytes field on the way in and again on the way out, and numpy's
tobytes() copies before that: three copies of an 8 MiB batch per side. These messages
carry nearly all the PS's bytes, so they are written in protobuf's wire form directly
(tag, length, payload per field; see dynemb/protos/ps.proto for the field numbers), and read
the same way: the parse_* functions return memoryviews into the received bytes, where
the generated classes would copy each bytes field twice (into the message, then into a
new bytes object on access); protobuf's Python API has no zero-copy access to a bytes
field, hence this small hand-written reader. Fields the reader does not know are
skipped, as protobuf does. tests/ps_server/test_ps_wire.py checks both directions against the
generated code, and that a damaged message raises MalformedMessage, never anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

#: bytes a request or reply may need beyond its rows (fields, ids' framing); chunk sizes leave it free
MESSAGE_OVERHEAD = 4096


def _varint(n: int) -> bytes:
    if n < 0x80:  # most lengths and counts in a message of small replies
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL_VARINTS = [bytes((i,)) for i in range(0x80)]


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _bytes_field(number: int, payload) -> list:
    """A length-delimited field (wire type 2): tag, length, payload (any bytes-like)."""
    return [_varint(number << 3 | 2), _varint(len(payload)), payload]


def _array(a: np.ndarray) -> memoryview:
    return np.ascontiguousarray(a).data.cast("B")


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


def push_request_parts(
    table: str, ids: np.ndarray, rows: np.ndarray | None, rows_from: tuple[int, int, int] | None = None
) -> list:
    """PushRequest{table=1, ids=2, rows=3, rows_from=4}; ids as little-endian int64; rows_from
    (segment, offset, size) in place of rows (shm.py)."""
    parts = _bytes_field(1, table.encode()) if table else []
    if len(ids):
        parts += _bytes_field(2, _array(ids.astype("<i8", copy=False)))
    if rows is not None and rows.size:
        parts += _bytes_field(3, _array(rows))
    if rows_from is not None:
        parts += _nested(4, segment_ref_parts(*rows_from))
    return parts


def segment_ref_parts(segment: int, offset: int, size: int) -> list:
    """SegmentRef{segment=1, offset=2, size=3}: varints, zero ones left out."""
    parts = []
    for number, value in ((1, segment), (2, offset), (3, size)):
        if value:
            parts += [_varint(number << 3 | 0), _varint(value)]
    return parts


# -- pull replies built in place ---------------------------------------------------

#: fill(rows) writes a reply's rows into the (n, width) array it is given and returns
#: (missing bitmap, number missing)
RowsFill = Callable[[np.ndarray], "tuple[bytes, int]"]


@dataclass(slots=True)
class ReplyPlan:
    """One PullResponse to build: n rows of `width` values of `dtype`, written by fill into
    the message, or into `into` (a client's segment, shm.py) with no rows in the message."""

    n: int
    width: int
    dtype: np.dtype
    fill: RowsFill
    into: np.ndarray | None = None

    @property
    def rows_bytes(self) -> int:
        """The rows' bytes in the message."""
        return 0 if self.into is not None else self.n * self.width * self.dtype.itemsize


def _pull_tail(missing: bytes, num_missing: int) -> bytes:
    """The fields after the rows: the bitmap and count, left out when nothing is missing."""
    if not num_missing:
        return b""
    return b"".join([*_bytes_field(2, missing), _varint(3 << 3 | 0), _varint(num_missing)])


def _tail_max(n: int) -> int:
    mask = (n + 7) // 8
    return 1 + _varint_len(mask) + mask + 1 + _varint_len(n) if n else 0


def _head(plan: ReplyPlan) -> bytes:
    """The rows field's tag and length (no field at all for no rows, as protobuf does)."""
    return b"\x0a" + _varint(plan.rows_bytes) if plan.rows_bytes else b""  # field 1, wire type 2


def _write_reply(buf: memoryview, pos: int, plan: ReplyPlan, head: bytes) -> int:
    """The PullResponse of plan at buf[pos:], rows filled in place; returns where it ends."""
    buf[pos : pos + len(head)] = head
    pos += len(head)
    if plan.into is not None:
        rows = plan.into
    elif plan.n:
        rows = np.frombuffer(buf, dtype=plan.dtype, count=plan.n * plan.width, offset=pos).reshape(plan.n, plan.width)
    else:
        rows = np.empty((0, plan.width), dtype=plan.dtype)
    missing, num_missing = plan.fill(rows)
    del rows  # no array over the message may outlive the fill (see filled_bytes)
    pos += plan.rows_bytes
    tail = _pull_tail(missing, num_missing)
    buf[pos : pos + len(tail)] = tail
    return pos + len(tail)


def _joined(plans: list[ReplyPlan]) -> bytes:
    """The same PullManyResponse built apart and joined: one more copy of the rows."""
    replies = []
    for plan in plans:
        rows = plan.into if plan.into is not None else np.empty((plan.n, plan.width), dtype=plan.dtype)
        missing, num_missing = plan.fill(rows)
        replies.append(
            pull_response_parts(
                rows[:0] if plan.into is not None else rows, missing if num_missing else b"", num_missing
            )
        )
    return encode_pull_many_response(replies)


# the native module's filled_bytes; False where it cannot be built (see filled_bytes)
_native_filled_bytes: Callable[[int, Callable[[memoryview], int]], bytes] | Literal[False] | None = None


def filled_bytes(capacity: int, fill: Callable[[memoryview], int]) -> bytes:
    """bytes of at most `capacity` written in place by fill(view) -> bytes used: the compiled
    id index module's filled_bytes (dynemb/ps_server/csrc), else a bytearray copied once."""
    global _native_filled_bytes
    if _native_filled_bytes is None:
        try:
            from dynemb.ps_server import native

            _native_filled_bytes = native.id_index().filled_bytes
        except (RuntimeError, ImportError, OSError):  # no compiler here: one copy more
            _native_filled_bytes = False
    if _native_filled_bytes:
        return _native_filled_bytes(capacity, fill)
    buf = bytearray(capacity)
    with memoryview(buf) as view:
        used = fill(view)
    return bytes(memoryview(buf)[:used])


def build_pull_response(plan: ReplyPlan) -> bytes:
    """PullResponse bytes with plan's rows written straight into them."""
    head = _head(plan)
    capacity = len(head) + plan.rows_bytes + _tail_max(plan.n)
    return filled_bytes(capacity, lambda buf: _write_reply(buf, 0, plan, head))


def build_pull_many_response(plans: list[ReplyPlan]) -> bytes:
    """PullManyResponse bytes, each reply's rows written straight into them.

    A nested reply's length goes before it but is known only after its rows are read (the
    missing fields follow them). Room for the length is left by its largest possible
    varint, which is also its actual width unless a reply's smallest and largest possible
    sizes straddle a varint boundary (a 128**k-byte edge): then the message is joined."""
    layout, capacity = [], 0
    for plan in plans:
        head = _head(plan)
        least = len(head) + plan.rows_bytes
        most = least + _tail_max(plan.n)
        width = _varint_len(most)
        if _varint_len(least) != width:
            return _joined(plans)
        layout.append((plan, head, width))
        capacity += 1 + width + most

    def fill(buf: memoryview) -> int:
        pos = 0
        for plan, head, width in layout:
            buf[pos] = 1 << 3 | 2
            start = pos + 1 + width
            end = _write_reply(buf, start, plan, head)
            buf[pos + 1 : start] = _varint(end - start)
            pos = end
        return pos

    return filled_bytes(capacity, fill)


def encode_push_request(table: str, ids: np.ndarray, rows: np.ndarray) -> bytes:
    """A PushRequest's bytes (see push_request_parts)."""
    return b"".join(push_request_parts(table, ids, rows))


def encode_pull_many_response(replies: list[list]) -> bytes:
    """PullManyResponse{repeated PullResponse pulls=1} from each reply's pull_response_parts."""
    return b"".join(part for reply in replies for part in _nested(1, reply))


def encode_push_many_request(pushes: list[list]) -> bytes:
    """PushManyRequest{repeated PushRequest pushes=1} from each push's push_request_parts."""
    return b"".join(part for push in pushes for part in _nested(1, push))


# -- reading --------------------------------------------------------------------


class MalformedMessage(ValueError):
    """Bytes that are not a valid message of the expected type (what the generated code's
    DecodeError would be)."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise MalformedMessage("a varint runs past the end of its message or is over 10 bytes")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int):
    """(field number, wire type, value) of each field in buf[pos:end]: an int for varints, a
    memoryview for length-delimited fields, None for fixed-width ones (skipped)."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise MalformedMessage("a field numbered 0")
        value: int | memoryview | None
        if wire_type == 0:
            value, pos = _read_varint(buf, pos, end)
        elif wire_type == 2:
            size, pos = _read_varint(buf, pos, end)
            if size > end - pos:
                raise MalformedMessage(f"field {number} claims {size} bytes, {end - pos} are left")
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            if pos > end:
                raise MalformedMessage(f"fixed-width field {number} runs past the end of its message")
            value = None
        else:  # groups (3, 4) are proto2-only; nothing in dynemb/protos/ps.proto has them
            raise MalformedMessage(f"field {number} has wire type {wire_type}, which this message never uses")
        yield number, wire_type, value


def _check(number: int, wire_type: int, want: int, message: str) -> None:
    if wire_type != want:
        raise MalformedMessage(f"{message} field {number} has wire type {wire_type}, expected {want}")


@dataclass(slots=True)
class PullReply:
    """A PullResponse as read by parse_pull_response: views into the received bytes."""

    rows: memoryview
    missing: memoryview
    num_missing: int


@dataclass(slots=True)
class PushCall:
    """A PushRequest as read by parse_push_request: views into the received bytes."""

    table: str
    ids: memoryview
    rows: memoryview
    rows_from: tuple[int, int, int] | None = None  # (segment, offset, size)


_EMPTY = memoryview(b"")


def _pull_reply(buf: memoryview, pos: int, end: int) -> PullReply:
    rows, missing, num_missing = _EMPTY, _EMPTY, 0
    for number, wire_type, value in _fields(buf, pos, end):
        if number == 1:
            _check(number, wire_type, 2, "PullResponse")
            rows = value
        elif number == 2:
            _check(number, wire_type, 2, "PullResponse")
            missing = value
        elif number == 3:
            _check(number, wire_type, 0, "PullResponse")
            num_missing = value
    return PullReply(rows, missing, num_missing)


def _push_call(buf: memoryview, pos: int, end: int) -> PushCall:
    table, ids, rows, rows_from = _EMPTY, _EMPTY, _EMPTY, None
    for number, wire_type, value in _fields(buf, pos, end):
        if number in (1, 2, 3, 4):
            _check(number, wire_type, 2, "PushRequest")
            if number == 1:
                table = value
            elif number == 2:
                ids = value
            elif number == 3:
                rows = value
            else:
                rows_from = _segment_ref(value)
    try:
        name = str(table, "utf-8")
    except UnicodeDecodeError:
        raise MalformedMessage("PushRequest's table name is not valid UTF-8") from None
    return PushCall(name, ids, rows, rows_from)


def _segment_ref(buf: memoryview) -> tuple[int, int, int]:
    ref = [0, 0, 0]  # segment, offset, size
    for number, wire_type, value in _fields(buf, 0, len(buf)):
        if number in (1, 2, 3):
            _check(number, wire_type, 0, "SegmentRef")
            ref[number - 1] = value
    return ref[0], ref[1], ref[2]


def _repeated(data, number: int, message: str, read) -> list:
    buf = memoryview(data).cast("B")
    out = []
    for n, wire_type, value in _fields(buf, 0, len(buf)):
        if n == number:
            _check(n, wire_type, 2, message)
            out.append(read(value, 0, len(value)))
    return out


def parse_pull_response(data) -> PullReply:
    """The PullReply of a PullResponse's bytes, its rows a view of data."""
    buf = memoryview(data).cast("B")
    return _pull_reply(buf, 0, len(buf))


def parse_pull_many_response(data) -> list[PullReply]:
    """The PullReply of each PullResponse in a PullManyResponse's bytes."""
    return _repeated(data, 1, "PullManyResponse", _pull_reply)


def parse_push_request(data) -> PushCall:
    """The PushCall of a PushRequest's bytes, its ids and rows views of data."""
    buf = memoryview(data).cast("B")
    return _push_call(buf, 0, len(buf))


@dataclass(slots=True)
class PushManyCall:
    """A PushManyRequest read in place: one PushCall per table."""

    pushes: list[PushCall]


def parse_push_many_request(data) -> PushManyCall:
    """The PushManyCall of a PushManyRequest's bytes."""
    return PushManyCall(_repeated(data, 1, "PushManyRequest", _push_call))
