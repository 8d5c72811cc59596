"""PullMany and PushMany requests read, and PullMany replies written, in passes over arrays, not
a Python step per entry.

A request of many small entries (200,000 one-id pulls of one table) cost a parsed message, a
plan, a store call (two Redis round trips) and a reply built per entry: 75 s on a read-only
Redis PS, where one entry of the same 200,000 ids took well under a second (issue 44). Here the
entries are read in one native pass (csrc/id_index_module.cpp parse_row_entries) into columns:
each entry's table (an index into the distinct names), where its ids and rows lie in the
message, its segment ref. The service then makes one store call per table, and the reply's
fields are laid out with numpy (their varints written for all entries at once) and its rows
and missing masks copied in by ranges (copy_ranges). The message is read where it lies: no
entry's bytes become a Python object. Without a compiler the same columns come from
wire.py's reader, slower but as linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynemb.ps_server.wire import MalformedMessage, _fields, _segment_ref, filled_bytes

# the most entries one PullMany or PushMany may have unless --max-request-entries says otherwise:
# a trainer's step sends one per table per PS; thousands of tables still fit
DEFAULT_MAX_ENTRIES = 1 << 16
# the most ids one request may carry unless --max-request-ids says otherwise (over its entries):
# twice what a 16 MiB client chunk of ids holds, half of what a 64 MiB message could
DEFAULT_MAX_IDS = 1 << 22
ID_BYTES = 8

_native = None  # the compiled module, or False where it cannot be built


def _module():
    global _native
    if _native is None:
        try:
            from dynemb.ps_server import native

            _native = native.id_index()
        except (RuntimeError, ImportError, OSError):  # no compiler here: wire.py's reader
            _native = False
    return _native


class TooManyEntries(Exception):
    """A request of more entries than the limit it was read under (only counted past it)."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


@dataclass(slots=True)
class RowEntries:
    """A PullManyRequest's or PushManyRequest's entries, as columns over its bytes.

    Attributes:
        data: the request's bytes.
        names: the distinct table names, in order of first use.
        table: each entry's table, an index into names.
        ids_at, ids_len: where each entry's ids lie in data (bytes).
        rows_at, rows_len: where each push's rows lie in data (0, 0 for pulls).
        has_ref: whether the entry names a segment (rows_to, rows_from).
        refs: (segment, offset, size) of each entry (zeros without one).
    """

    data: bytes
    names: list[str]
    table: np.ndarray
    ids_at: np.ndarray
    ids_len: np.ndarray
    rows_at: np.ndarray
    rows_len: np.ndarray
    has_ref: np.ndarray
    refs: np.ndarray

    def __len__(self) -> int:
        return len(self.table)


def _from_columns(data: bytes, cols: np.ndarray, raw_names: list) -> RowEntries:
    try:
        names = [bytes(n).decode("utf-8") for n in raw_names]
    except UnicodeDecodeError:
        raise MalformedMessage("a table name is not valid UTF-8") from None
    return RowEntries(
        data,
        names,
        cols[:, 0],
        cols[:, 1],
        cols[:, 2],
        cols[:, 3],
        cols[:, 4],
        cols[:, 5].astype(bool),
        cols[:, 6:9],
    )


def _read_in_python(data, ref_field: int, rows_field: int, max_entries: int) -> tuple[int, np.ndarray, list]:
    """parse_row_entries' columns through wire.py's reader (no compiler here)."""
    buf = memoryview(data).cast("B")
    rows: list[list[int]] = []
    names: list[bytes] = []
    index: dict[bytes, int] = {}
    count = 0
    for number, wire_type, value in _fields(buf, 0, len(buf)):
        if number != 1:
            continue
        if wire_type != 2:
            raise MalformedMessage(f"field 1 has wire type {wire_type}, expected 2")
        count += 1
        if count > max_entries:
            continue
        assert isinstance(value, memoryview)
        row, name = [0] * 9, b""
        for n, w, v in _fields(value, 0, len(value)):
            if n not in (1, 2, rows_field, ref_field):
                continue
            if w != 2:
                raise MalformedMessage(f"field {n} has wire type {w}, expected 2")
            assert isinstance(v, memoryview)
            if n == 1:
                name = bytes(v)
            elif n == 2:
                row[1], row[2] = _offset(buf, v), len(v)
            elif n == rows_field:
                row[3], row[4] = _offset(buf, v), len(v)
            else:
                row[5] = 1
                row[6:9] = _segment_ref(v)
        row[0] = index.setdefault(name, len(names))
        if row[0] == len(names):
            names.append(name)
        rows.append(row)
    return count, np.array(rows, dtype=np.int64).reshape(-1, 9), names


def _offset(outer: memoryview, inner: memoryview) -> int:
    """Where the view inner (a slice of outer) starts in outer; 0 for an empty one."""
    if not len(inner):
        return 0
    address = np.frombuffer(inner, np.uint8).__array_interface__["data"][0]
    return address - np.frombuffer(outer, np.uint8).__array_interface__["data"][0]


def parse_row_entries(data, ref_field: int, rows_field: int, max_entries: int) -> RowEntries:
    """The entries of a PullManyRequest (ref_field 3, rows_field 0) or PushManyRequest (4, 3).

    Raises:
        MalformedMessage: bytes that are no such message.
        TooManyEntries: more than max_entries entries (counted, not read).
    """
    module = _module()
    if module:
        try:
            count, cols, names = module.parse_row_entries(data, ref_field, rows_field, max_entries)
        except ValueError as exc:
            raise MalformedMessage(str(exc)) from None
        if cols is None:
            raise TooManyEntries(count)
        table = np.frombuffer(cols, dtype=np.int64).reshape(-1, 9)
    else:
        count, table, names = _read_in_python(data, ref_field, rows_field, max_entries)
        if count > max_entries:
            raise TooManyEntries(count)
    return _from_columns(data, table, names)


def copy_ranges(dest, dest_at: np.ndarray, src, src_at: np.ndarray, lengths: np.ndarray) -> None:
    """dest[dest_at[i]:][:lengths[i]] = src[src_at[i]:][:lengths[i]] for each i (bytes-like buffers)."""
    dest_at, src_at, lengths = (np.ascontiguousarray(a, dtype=np.int64) for a in (dest_at, src_at, lengths))
    module = _module()
    if module:
        module.copy_ranges(dest, dest_at, src, src_at, lengths)
        return
    to, frm = memoryview(dest).cast("B"), memoryview(src).cast("B")
    for d, s, n in zip(dest_at.tolist(), src_at.tolist(), lengths.tolist()):
        to[d : d + n] = frm[s : s + n]


def gather(data, at: np.ndarray, lengths: np.ndarray, dtype, width: int = 1) -> np.ndarray:
    """The ranges of data at `at` joined into one array of dtype, `width` values a row."""
    total = int(lengths.sum())
    out = np.empty(total // np.dtype(dtype).itemsize, dtype=dtype)
    dest = np.cumsum(lengths) - lengths
    copy_ranges(out, dest, data, at, lengths)
    return out.reshape(-1, width) if width > 1 else out


# -- a PullManyResponse laid out for all entries at once -----------------------------------


# the smallest value of each varint width past one byte
_VARINT_STEPS = np.array([1 << bits for bits in range(7, 64, 7)], dtype=np.uint64)


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's varint."""
    return np.searchsorted(_VARINT_STEPS, values.astype(np.uint64), side="right") + 1


def write_varints(buf: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """Each value's varint into buf (uint8) at its position."""
    v, at = values.astype(np.uint64), at.astype(np.int64)
    while len(v):
        more = v >= 0x80
        buf[at] = (v & np.uint64(0x7F)) | (more.astype(np.uint64) << np.uint64(7))
        v, at = v[more] >> np.uint64(7), at[more] + 1


@dataclass(slots=True)
class PulledTable:
    """One table's part of a PullMany: its rows pulled (in entry order), which of them are missing."""

    rows: np.ndarray  # (n, width) of the table's dtype
    entries: np.ndarray  # the entries of this table, ascending
    first: np.ndarray  # each of those entries' first row in rows


def pull_many_reply_size(counts: np.ndarray, row_bytes: np.ndarray, in_message: np.ndarray) -> int:
    """The largest PullManyResponse for these entries (every mask present): what to check
    against the message limit before any row is read."""
    rb = np.where(in_message, counts * row_bytes, 0)
    mb = (counts + 7) // 8
    sub = np.where(rb > 0, 1 + varint_lengths(rb) + rb, 0) + 1 + varint_lengths(mb) + mb + 1 + varint_lengths(counts)
    return int((1 + varint_lengths(sub) + sub).sum())


def pull_many_reply(
    counts: np.ndarray, row_bytes: np.ndarray, in_message: np.ndarray, missing: np.ndarray, tables: list[PulledTable]
) -> bytes:
    """PullManyResponse bytes: per entry PullResponse{rows=1, missing=2, num_missing=3}, empty
    fields left out as protobuf does.

    Args:
        counts: each entry's ids.
        row_bytes: each entry's table's row bytes.
        in_message: whether the entry's rows go in the reply (not into a segment).
        missing: a bool per id of all entries, in entry order: never pushed.
        tables: each table's rows pulled.
    """
    ends = np.cumsum(counts)
    firsts = ends - counts
    missed = np.concatenate([[0], np.cumsum(missing, dtype=np.int64)])
    nm = missed[ends] - missed[firsts]
    rb = np.where(in_message, counts * row_bytes, 0)
    mb = np.where(nm > 0, (counts + 7) // 8, 0)
    rows_field = np.where(rb > 0, 1 + varint_lengths(rb) + rb, 0)
    sub = rows_field + np.where(nm > 0, 1 + varint_lengths(mb) + mb + 1 + varint_lengths(nm), 0)
    size = 1 + varint_lengths(sub) + sub
    start = np.cumsum(size) - size
    body = start + 1 + varint_lengths(sub)
    has_rows = rb > 0
    rows_at = body + 1 + varint_lengths(rb)
    has_mask = np.flatnonzero(nm > 0)
    mask_at = body + rows_field + 1 + varint_lengths(mb)
    masks, mask_start = _masks(counts, firsts, mb, missing), np.cumsum(mb) - mb

    def fill(view: memoryview) -> int:
        buf = np.frombuffer(view, dtype=np.uint8)
        buf[start] = 0x0A  # field 1, a message
        write_varints(buf, start + 1, sub)
        buf[body[has_rows]] = 0x0A  # rows=1
        write_varints(buf, body[has_rows] + 1, rb[has_rows])
        for t in tables:
            sel = has_rows[t.entries]
            per_row = t.rows.shape[1] * t.rows.dtype.itemsize
            copy_ranges(view, rows_at[t.entries[sel]], t.rows, t.first[sel] * per_row, rb[t.entries[sel]])
        buf[body[has_mask] + rows_field[has_mask]] = 0x12  # missing=2
        write_varints(buf, body[has_mask] + rows_field[has_mask] + 1, mb[has_mask])
        copy_ranges(view, mask_at[has_mask], masks, mask_start[has_mask], mb[has_mask])
        count_at = mask_at[has_mask] + mb[has_mask]
        buf[count_at] = 0x18  # num_missing=3, a varint
        write_varints(buf, count_at + 1, nm[has_mask])
        del buf  # no array over the message may outlive the fill (wire.filled_bytes)
        return int(size.sum())

    return filled_bytes(int(size.sum()), fill)


def push_many_reply(counts: np.ndarray) -> bytes:
    """PushManyResponse bytes: per entry PushResponse{rows_written=1} of its count (none for 0)."""
    field = np.where(counts > 0, 1 + varint_lengths(counts), 0)  # at most 11 bytes: a one-byte length
    size = 2 + field
    start = np.cumsum(size) - size
    buf = np.zeros(int(size.sum()), dtype=np.uint8)
    buf[start] = 0x0A  # field 1, a message
    buf[start + 1] = field
    some = np.flatnonzero(counts > 0)
    buf[start[some] + 2] = 0x08  # rows_written=1, a varint
    write_varints(buf, start[some] + 3, counts[some])
    return buf.tobytes()


def _masks(counts: np.ndarray, firsts: np.ndarray, mask_bytes: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """Each entry's missing bitmap (bit i, little bit order: its id i), of mask_bytes[e] bytes
    (0 for an entry with none missing), all joined."""
    ids = np.flatnonzero(missing)
    entry = np.searchsorted(firsts + counts, ids, side="right")
    bits = np.zeros(8 * int(mask_bytes.sum()), dtype=bool)
    bits[8 * (np.cumsum(mask_bytes) - mask_bytes)[entry] + ids - firsts[entry]] = True
    return np.packbits(bits, bitorder="little")
