"""PullMany and PushMany requests read, and their replies written, in passes over arrays, not
a Python step per entry.

A request of many small entries (200,000 one-id pulls of one table) cost a parsed message, a
plan, a store call (two Redis round trips) and a reply built per entry: 75 s on a read-only
Redis PS, where one entry of the same 200,000 ids took well under a second (issue 44). Here the
entries are read in one native pass (csrc/id_index_module.cpp parse_row_entries) into columns
(each entry's table, an index into the distinct names, its ids' and rows' lengths, its segment
ref) and their ids and rows joined; the service then makes one store call per table, and the
reply is written in one native pass too (pull_many_reply, push_many_reply). No entry's bytes
become a Python object, and few arrays are made per entry: at 200,000 entries each fresh
array's pages cost about as much as the work on it. Without a compiler the same columns come
from wire.py's reader and the replies from numpy, slower but as linear.
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
    """A PullManyRequest's or PushManyRequest's entries, as columns.

    Attributes:
        data: the request's bytes.
        names: the distinct table names, in order of first use.
        table: each entry's table, an index into names.
        ids_len: each entry's ids bytes.
        rows_len: each push's rows bytes in the message (0 for pulls).
        has_ref: whether the entry names a segment (rows_to, rows_from).
        refs: (segment, offset, size) of each entry (zeros without one).
        joined_ids: every entry's ids bytes, in entry order (uint8).
        joined_rows: every push's rows bytes in the message, in entry order (uint8; empty for pulls).
    """

    data: bytes
    names: list[str]
    table: np.ndarray
    ids_len: np.ndarray
    rows_len: np.ndarray
    has_ref: np.ndarray
    refs: np.ndarray
    joined_ids: np.ndarray
    joined_rows: np.ndarray

    def __len__(self) -> int:
        return len(self.table)


def _from_columns(data: bytes, cols: np.ndarray, raw_names: list, refs: np.ndarray, ids, rows) -> RowEntries:
    """RowEntries over parse_row_entries' columns, (2 or 3, entries), each contiguous: table,
    ids_len (and rows_len of a push); refs: (entry, segment, offset, size) of the entries that
    name a segment; ids, rows: their bytes joined."""
    try:
        names = [bytes(n).decode("utf-8") for n in raw_names]
    except UnicodeDecodeError:
        raise MalformedMessage("a table name is not valid UTF-8") from None
    n = cols.shape[1]
    # a pull's rows lengths and a batch's refs without a segment: read-only zeros, no memory
    rows_len = cols[2] if len(cols) == 3 else np.broadcast_to(np.int64(0), (n,))
    has_ref = np.zeros(n, dtype=bool)
    has_ref[refs[:, 0]] = True
    if len(refs):
        entry_refs = np.zeros((n, 3), dtype=np.int64)
        entry_refs[refs[:, 0]] = refs[:, 1:]
    else:
        entry_refs = np.broadcast_to(np.int64(0), (n, 3))
    ids, rows = (np.frombuffer(b, dtype=np.uint8) for b in (ids, rows))
    return RowEntries(data, names, cols[0], cols[1], rows_len, has_ref, entry_refs, ids, rows)


def _read_in_python(data, ref_field: int, rows_field: int, max_entries: int) -> tuple:
    """parse_row_entries' answer through wire.py's reader (no compiler here)."""
    buf = memoryview(data).cast("B")
    cols: list[list[int]] = []
    refs: list[list[int]] = []
    names: list[bytes] = []
    index: dict[bytes, int] = {}
    ids: list[memoryview] = []
    rows: list[memoryview] = []
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
        name, entry_ids, entry_rows, ref = b"", memoryview(b""), memoryview(b""), None
        for n, w, v in _fields(value, 0, len(value)):
            if n not in (1, 2, rows_field, ref_field):
                continue
            if w != 2:
                raise MalformedMessage(f"field {n} has wire type {w}, expected 2")
            assert isinstance(v, memoryview)
            if n == 1:
                name = bytes(v)
            elif n == 2:
                entry_ids = v
            elif n == rows_field:
                entry_rows = v
            else:
                ref = _segment_ref(v)
        table = index.setdefault(name, len(names))
        if table == len(names):
            names.append(name)
        if ref is not None:
            refs.append([len(cols), *ref])
        cols.append([table, len(entry_ids), len(entry_rows)])
        ids.append(entry_ids)
        rows.append(entry_rows)
    columns = np.array(cols, dtype=np.int64).reshape(-1, 3).T[: 3 if rows_field else 2].copy()
    return count, columns, names, np.array(refs, dtype=np.int64).reshape(-1, 4), b"".join(ids), b"".join(rows)


def parse_row_entries(data, ref_field: int, rows_field: int, max_entries: int) -> RowEntries:
    """The entries of a PullManyRequest (ref_field 3, rows_field 0) or PushManyRequest (4, 3).

    Raises:
        MalformedMessage: bytes that are no such message.
        TooManyEntries: more than max_entries entries (counted, not read).
    """
    module = _module()
    if module:
        try:
            count, raw, names, raw_refs, ids, rows = module.parse_row_entries(data, ref_field, rows_field, max_entries)
        except ValueError as exc:
            raise MalformedMessage(str(exc)) from None
        if raw is None:
            raise TooManyEntries(count)
        cols = np.frombuffer(raw, dtype=np.int64).reshape(3 if rows_field else 2, count)
        refs = np.frombuffer(raw_refs, dtype=np.int64).reshape(-1, 4)
    else:
        count, cols, names, refs, ids, rows = _read_in_python(data, ref_field, rows_field, max_entries)
        if count > max_entries:
            raise TooManyEntries(count)
    return _from_columns(data, cols, names, refs, ids, rows)


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


# -- a PullManyResponse laid out for all entries at once -----------------------------------


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's varint (values >= 0): a comparison per width up to the largest's, so
    one pass for a batch of small values (a search over all ten widths cost 1 ms per 200,000)."""
    lengths = np.ones(len(values), dtype=np.int64)
    top = int(values.max()) if len(values) else 0
    step = 1 << 7
    while step <= top:
        lengths += values >= step
        step <<= 7
    return lengths


def write_varints(buf: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """Each value's varint (values >= 0) into buf (uint8) at its position."""
    v = np.asarray(values, dtype=np.int64)
    while len(v):
        more = v >= 0x80
        if not more.any():  # the last byte of every varint left
            buf[at] = v
            return
        buf[at] = (v & 0x7F) | (more * 0x80)
        v, at = v[more] >> 7, at[more] + 1


@dataclass(slots=True)
class PulledTable:
    """One table's part of a PullMany: its rows pulled (in entry order), which of them are missing."""

    rows: np.ndarray  # (n, width) of the table's dtype: its entries' rows, in their order
    entries: np.ndarray  # the entries of this table, ascending


def pull_many_reply_size(counts: np.ndarray, table: np.ndarray, in_message: np.ndarray, row_bytes: np.ndarray) -> int:
    """The largest PullManyResponse for these entries (every mask present): what to check
    against the message limit before any row is read. table: each entry's table, an index
    into row_bytes, each table's row bytes."""
    module = _module()
    if module:
        counts, table, row_bytes = (np.ascontiguousarray(a, dtype=np.int64) for a in (counts, table, row_bytes))
        return module.pull_many_reply_size(counts, table, np.ascontiguousarray(in_message, dtype=bool), row_bytes)
    rb = np.where(in_message, counts * row_bytes[table], 0)
    mb = (counts + 7) // 8
    sub = np.where(rb > 0, 1 + varint_lengths(rb) + rb, 0) + 1 + varint_lengths(mb) + mb + 1 + varint_lengths(counts)
    return int((1 + varint_lengths(sub) + sub).sum())


def pull_many_reply(
    counts: np.ndarray,
    table: np.ndarray,
    in_message: np.ndarray,
    missing: np.ndarray,
    row_bytes: np.ndarray,
    tables: list[PulledTable],
) -> bytes:
    """PullManyResponse bytes: per entry PullResponse{rows=1, missing=2, num_missing=3}, empty
    fields left out as protobuf does. Written in one native pass (csrc/id_index_module.cpp
    pull_many_reply): laid out with numpy, a batch of 200,000 one-id entries spent more on
    its temporary arrays' fresh pages than on its rows.

    Args:
        counts: each entry's ids.
        table: each entry's table, an index into row_bytes and tables.
        in_message: whether the entry's rows go in the reply (not into a segment).
        missing: a bool per id of all entries, in entry order: never pushed.
        row_bytes: each table's row bytes.
        tables: each table's rows pulled.
    """
    module = _module()
    if module:
        counts, table, row_bytes = (np.ascontiguousarray(a, dtype=np.int64) for a in (counts, table, row_bytes))
        in_message, missing = (np.ascontiguousarray(a, dtype=bool) for a in (in_message, missing))
        return module.pull_many_reply(counts, table, in_message, missing, row_bytes, [t.rows for t in tables])
    return _pull_many_reply(counts, row_bytes[table], in_message, missing, tables)


def _pull_many_reply(
    counts: np.ndarray, row_bytes: np.ndarray, in_message: np.ndarray, missing: np.ndarray, tables: list[PulledTable]
) -> bytes:
    """pull_many_reply laid out with numpy (no compiler here); row_bytes: each entry's table's.
    The missing fields are laid out only for the entries that have some."""
    rb = np.where(in_message, counts * row_bytes, 0)
    rows_head = np.where(rb > 0, 1 + varint_lengths(rb), 0)  # tag and length of the rows field
    sub = rows_head + rb
    firsts = np.cumsum(counts) - counts
    missed = np.concatenate([[0], np.cumsum(missing, dtype=np.int64)])
    nm = missed[firsts + counts] - missed[firsts]
    has_mask = np.flatnonzero(nm)
    mb = (counts[has_mask] + 7) // 8  # of the entries in has_mask, as what follows
    nm_masked = nm[has_mask]
    mb_head = 1 + varint_lengths(mb)
    sub[has_mask] += mb_head + mb + 1 + varint_lengths(nm_masked)
    sub_head = 1 + varint_lengths(sub)
    size = sub_head + sub
    start = np.cumsum(size) - size
    body = start + sub_head
    has_rows = np.flatnonzero(rb)
    rows_at = body + rows_head
    mask_at = body[has_mask] + rows_head[has_mask] + rb[has_mask] + mb_head
    masks, mask_start = _masks(counts, firsts, has_mask, mb, missing)
    total = int(size.sum())

    def fill(view: memoryview) -> int:
        buf = np.frombuffer(view, dtype=np.uint8)
        buf[start] = 0x0A  # field 1, a message
        write_varints(buf, start + 1, sub)
        buf[body[has_rows]] = 0x0A  # rows=1
        write_varints(buf, body[has_rows] + 1, rb[has_rows])
        for t in tables:
            n = counts[t.entries]
            sel = rb[t.entries] > 0
            per_row = t.rows.shape[1] * t.rows.dtype.itemsize
            first = (np.cumsum(n) - n)[sel]
            copy_ranges(view, rows_at[t.entries[sel]], t.rows, first * per_row, rb[t.entries[sel]])
        buf[mask_at - mb_head] = 0x12  # missing=2
        write_varints(buf, mask_at - mb_head + 1, mb)
        copy_ranges(view, mask_at, masks, mask_start, mb)
        count_at = mask_at + mb
        buf[count_at] = 0x18  # num_missing=3, a varint
        write_varints(buf, count_at + 1, nm_masked)
        del buf  # no array over the message may outlive the fill (wire.filled_bytes)
        return total

    return filled_bytes(total, fill)


def push_many_reply(counts: np.ndarray) -> bytes:
    """PushManyResponse bytes: per entry PushResponse{rows_written=1} of its count (none for 0)."""
    module = _module()
    if module:
        return module.push_many_reply(np.ascontiguousarray(counts, dtype=np.int64))
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


def _masks(counts: np.ndarray, firsts: np.ndarray, has_mask: np.ndarray, mb: np.ndarray, missing: np.ndarray):
    """The missing bitmaps (bit i, little bit order: the entry's id i) of the entries has_mask,
    mb[k] bytes for has_mask[k], joined, and where each starts."""
    mask_start = np.cumsum(mb) - mb
    ids = np.flatnonzero(missing)
    if not len(ids):
        return np.zeros(0, dtype=np.uint8), mask_start
    entry = np.searchsorted(firsts + counts, ids, side="right")
    k = np.searchsorted(has_mask, entry)  # the entry's place among those with a mask
    bits = np.zeros(8 * int(mb.sum()), dtype=bool)
    bits[8 * mask_start[k] + ids - firsts[entry]] = True
    return np.packbits(bits, bitorder="little"), mask_start
