"""An import into an empty disk table, loaded in bulk whatever order its ids come in: an external
bucket sort on the PS's own disk, next to its database, then the table files of disk_load.py.

Why by hand: RocksDB ingests table files whose keys ascend, but an import's chunks come in any
order (a checkpoint's shards, a TF migration's, each PS's share of a client's chunks) and may
repeat an id (its last row wins), and a table may be far bigger than memory. No library here
sorts such a stream into table files: rocksdict binds RocksDB's writer and ingest only, numpy
sorts in memory.

How: each chunk's rows, with their ids, go to one of 2,048 bucket files by the top 11 bits of the
id's key order (disk_layout.py: the id with its sign bit flipped), appended a batch of SORT_BYTES
at a time, so the buckets are disjoint and ascending. At the end each bucket (small neighbours
together) is read back, stable-sorted by id, each id's last occurrence kept, and handed to the
table files' writer in order; its file is deleted once read. Hashed ids spread evenly: 10^9 rows of
68 B make buckets of ~37 MB. Ids bunched in a few buckets (small integers share their top bits)
make a bucket over SORT_BYTES: it is split again the same way, into as many buckets as its rows
need, by the range its ids span (each split puts its least and greatest id apart, so splitting
ends). An import that fits in SORT_BYTES is sorted in memory, no file written. Memory: about three
times SORT_BYTES. Disk: the ids and rows once, and the table files as they are written (free disk
about 1.2x the imported rows' bytes at the peak).

Locks: none while the stream is spilled (it may take long; pushes to the table go on).
disk_load.fill_empty then holds the table's lock from its check that the table is still empty
through the ingest, the table files' writing included, as load_sorted always did: simplest, and
no push lands between the check and the ingest unseen; a push or drop of the table waits for it.
A table that got rows or a change log meanwhile is written by pushes from the sorted spill.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dynemb.ps_server.backends import disk_load
from dynemb.ps_server.codec import rows_for_table
from dynemb.ps_server.errors import BackendUnavailable
from dynemb.ps_server.schema import TableSchema

if TYPE_CHECKING:
    from dynemb.ps_server.backends.disk import DiskStore, _DiskTable

log = logging.getLogger("dynemb.ps")

SORT_BYTES = 64 << 20  # records (id and row) sorted or buffered in memory at once
# 2,048 buckets: 10^9 rows of 68 B (76 with their ids) make buckets of ~37 MB; not more, as each
# nonempty bucket is a file made (33-600 us each here) and written each batch
_TOP_BITS = 11
_MAX_BITS = 12  # a split makes up to 2**_MAX_BITS buckets, as many as its rows need
_SIGN = np.uint64(1 << 63)  # as disk_layout.id_bytes: flipped, the ids' unsigned order is their keys'
_CHUNK = 65_536  # rows handed to the table files' writer at once (it makes Python lists of them)


def import_rows(store: DiskStore, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]], replace: bool) -> int:
    """See DiskStore.import_rows.

    Args:
        store: the disk store.
        table: the table (it exists once the first chunk was taken).
        chunks: (ids, rows) pairs in any order, ids may repeat.
        replace: clear the table first, once the first chunk was taken.

    Returns:
        The rows written: every chunk's ids, repeats included (as pushes count them).
    """
    taken = iter(chunks)
    first = next(taken, None)  # the caller checks it (and creates the table) as it is taken
    if first is None:
        return 0
    if replace:
        store.clear(table)
    t = store._table(table)
    chunks = itertools.chain([first], taken)
    if not _empty(store, t):
        return _push(store, table, chunks)
    folder = disk_load.spill_folder(store)
    try:
        spill = ImportSort(folder, t.schema, SORT_BYTES)
        for ids, rows in chunks:  # no lock meanwhile: a stream may take long
            spill.add(ids, rows)
        loaded = disk_load.fill_empty(store, t, spill.sorted_chunks(), folder, 1 << 22)
        if loaded is None:  # a push or a change log came while the rows were spilled: after it, as pushes
            _push(store, table, spill.sorted_chunks())
        else:
            log.info(
                "disk store %s: table %r: %d rows imported in bulk (%d distinct)", store.path, table, spill.rows, loaded
            )
        return spill.rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _empty(store: DiskStore, t: _DiskTable) -> bool:
    """Whether t may be loaded in bulk now: no rows, no change log (fill_empty checks again)."""
    with t.lock:
        store._live(t)
        return disk_load.fillable(t)


def _push(store: DiskStore, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
    """Write chunks by pushes; the rows written."""
    return sum(store.push(table, ids, rows) for ids, rows in chunks if len(ids))


def _take(records: np.ndarray, which: np.ndarray) -> np.ndarray:
    """records[which] (positions or a mask), as whole records: numpy copies a structured
    array's fields one by one, 6x slower (135 against 21 ms for 500,000 of 76 B)."""
    return records.view(f"V{records.dtype.itemsize}")[which].view(records.dtype)


@dataclasses.dataclass
class _Bucket:
    """One bucket file: its records' count and their least and greatest key order."""

    path: Path
    rows: int
    low: int
    high: int


class _Buckets:
    """Records appended to bucket files by their ids' key order k: file b holds those with
    k >> shift == base + b (b < 2**bits), so the files are disjoint and ascending in b.

    Args:
        folder: where the files go (made at the first write).
        dtype: the records' dtype (an "id" field first).
        bits, shift, base: the range each file covers, above.
        batch_rows: records held before they are appended to their files.
    """

    def __init__(self, folder: Path, dtype: np.dtype, bits: int, shift: int, base: int, batch_rows: int) -> None:
        self.folder, self.dtype, self.batch_rows = folder, dtype, batch_rows
        self.shift, self.base = np.uint64(shift), np.uint64(base)
        self.rows = np.zeros(1 << bits, dtype=np.int64)
        self.low = np.full(1 << bits, np.iinfo(np.uint64).max, dtype=np.uint64)
        self.high = np.zeros(1 << bits, dtype=np.uint64)
        self.held: list[np.ndarray] = []
        self._held_rows = 0

    def add(self, records: np.ndarray) -> None:
        """Take records (appended to their files once batch_rows are held)."""
        self.held.append(records)
        self._held_rows += len(records)
        if self._held_rows >= self.batch_rows:
            self._flush()

    def spilled(self) -> bool:
        """Whether any record went to a file (else every one is still held)."""
        return bool(self.rows.any())

    def _flush(self) -> None:
        """Append the records held to their files: one write a bucket a batch, not a chunk."""
        if not self.held:
            return
        records = np.concatenate(self.held)
        self.held, self._held_rows = [], 0
        keys = records["id"].view(np.uint64) ^ _SIGN
        which = ((keys >> self.shift) - self.base).astype(np.uint16)
        order = np.argsort(which, kind="stable")  # a radix sort; stable keeps each id's arrival order
        records, keys, which = _take(records, order), keys[order], which[order]
        starts = np.flatnonzero(np.diff(which)) + 1
        starts = np.concatenate(([0], starts)).astype(np.int64)
        numbers = which[starts].astype(np.int64)
        self.low[numbers] = np.minimum(self.low[numbers], np.minimum.reduceat(keys, starts))
        self.high[numbers] = np.maximum(self.high[numbers], np.maximum.reduceat(keys, starts))
        ends = np.append(starts[1:], len(records))
        try:
            self.folder.mkdir(exist_ok=True)
            for b, s, e in zip(numbers.tolist(), starts.tolist(), ends.tolist()):
                with open(self.folder / f"{b:04d}", "ab") as f:
                    records[s:e].tofile(f)
                self.rows[b] += e - s
        except OSError as exc:  # disk full: nothing was loaded yet
            raise BackendUnavailable(f"disk backend: spilling an import to {self.folder} failed ({exc})") from None

    def buckets(self) -> list[_Bucket]:
        """The files written, ascending (every record held appended first)."""
        self._flush()
        return [
            _Bucket(self.folder / f"{b:04d}", int(self.rows[b]), int(self.low[b]), int(self.high[b]))
            for b in np.flatnonzero(self.rows).tolist()
        ]


class ImportSort:
    """An import's (ids, rows) chunks, in any order, spilled to disk and read back ascending by
    id, each id once with its last row (see the module doc).

    Args:
        folder: an empty folder of its own (the caller removes it).
        schema: the table's schema (the rows' width and dtype).
        sort_bytes: records held in memory at once.
    """

    def __init__(self, folder: Path, schema: TableSchema, sort_bytes: int = SORT_BYTES) -> None:
        self.folder, self.schema = folder, schema
        self.dtype = np.dtype([("id", "<i8"), ("row", schema.np_dtype, (schema.width,))])
        self.max_rows = max(1, sort_bytes // self.dtype.itemsize)
        self.rows = 0  # taken, repeats included
        self._splits = 0
        self._top = _Buckets(folder / "buckets", self.dtype, _TOP_BITS, 64 - _TOP_BITS, 0, self.max_rows)

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Take a chunk (rows checked against the table)."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = rows_for_table(rows, self.schema, len(ids))
        records = np.empty(len(ids), dtype=self.dtype)
        records["id"] = ids
        records["row"] = rows
        self._top.add(records)
        self.rows += len(ids)

    def sorted_chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, rows) of every id taken, ascending, each with its last row, in chunks of at most
        _CHUNK; each bucket file is deleted once read (read them once). An import that fits in
        memory is sorted there, no file written."""
        if self._top.spilled():
            runs = self._sorted(self._top.buckets())
        else:
            runs = iter([self._last(np.concatenate(self._top.held))] if self._top.held else [])
        for records in runs:
            for s in range(0, len(records), _CHUNK):
                part = records[s : s + _CHUNK]
                yield np.ascontiguousarray(part["id"]), np.ascontiguousarray(part["row"])

    def _sorted(self, buckets: list[_Bucket]) -> Iterator[np.ndarray]:
        """The records of buckets (disjoint, ascending), sorted, each id's last: neighbours that
        fit in memory read together, a bucket that does not split again."""
        group: list[_Bucket] = []
        held = 0
        for bucket in buckets:
            if bucket.rows > self.max_rows:
                if group:
                    yield self._last_of(group)
                    group, held = [], 0
                if bucket.low == bucket.high:  # one id, repeated: its last row is the last record
                    yield self._read(bucket.path, bucket.rows - 1)
                else:
                    yield from self._sorted(self._split(bucket))
                continue
            if held + bucket.rows > self.max_rows:
                yield self._last_of(group)
                group, held = [], 0
            group.append(bucket)
            held += bucket.rows
        if group:
            yield self._last_of(group)

    def _last_of(self, group: list[_Bucket]) -> np.ndarray:
        """The records of group's files, sorted by id, each id's last occurrence."""
        return self._last(np.concatenate([self._read(b.path) for b in group]))

    @staticmethod
    def _last(records: np.ndarray) -> np.ndarray:
        """records sorted by id, each id's last occurrence."""
        records = _take(records, np.argsort(records["id"], kind="stable"))
        ids = records["id"]
        last = np.ones(len(ids), dtype=bool)
        last[:-1] = ids[1:] != ids[:-1]
        return _take(records, last)

    def _split(self, bucket: _Bucket) -> list[_Bucket]:
        """A bucket too big for memory spilled again into buckets over the range its ids span."""
        parts = -(-bucket.rows // self.max_rows)
        bits = min(_MAX_BITS, parts.bit_length())  # evenly spread ids: up to about max_rows / 2 a bucket
        spread = (bucket.low ^ bucket.high).bit_length()
        shift = max(0, spread - bits)
        self._splits += 1
        folder = self.folder / f"split-{self._splits}"
        sub = _Buckets(folder, self.dtype, bits, shift, bucket.low >> shift, self.max_rows)
        try:
            with open(bucket.path, "rb") as f:
                while len(records := np.fromfile(f, dtype=self.dtype, count=self.max_rows)):
                    sub.add(records)
            bucket.path.unlink()
        except OSError as exc:
            raise BackendUnavailable(f"disk backend: reading an import's spill {bucket.path} failed ({exc})") from None
        return sub.buckets()

    def _read(self, path: Path, start: int = 0) -> np.ndarray:
        """The records of a bucket file from record `start`; the file is deleted."""
        try:
            with open(path, "rb") as f:
                f.seek(start * self.dtype.itemsize)
                records = np.fromfile(f, dtype=self.dtype)
            path.unlink()
        except OSError as exc:
            raise BackendUnavailable(f"disk backend: reading an import's spill {path} failed ({exc})") from None
        return records
