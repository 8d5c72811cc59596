"""The disk store's logs, kept in RocksDB beside the rows: a table's deletion and change logs
(ids, with when; the same cursors and gaps as the embedded store's IdLog, id_log.py) and the
log of tables dropped.

An id log's entry is one key, `table number (4) + kind (1) + its first cursor (8, big-endian)`,
whose value is its time (float64) and its ids (int64 little-endian). An entry goes into the same
WriteBatch as the rows it records, so after a crash the log and the rows agree. Only the cursor
after the newest (`end`) and of the oldest kept entry are in memory: a log of 2^30 ids costs no
RAM, and a reader seeks to its cursor.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from dynemb.ps_server.backends.disk_layout import table_prefix
from dynemb.ps_server.backends.id_log import END, read_to
from dynemb.ps_server.lifecycle import DROP_LOG_ENTRIES, Deletions, Drop, Drops

DELETIONS = b"d"
CHANGES = b"c"
_SEQ_BYTES = 8
_TIME = np.dtype("<f8")


class DiskIdLog:
    """One table's deletion or change log in the logs column family.

    Args:
        db: the Rdict (default column family: where a skipped count's end is kept).
        logs: the logs column family's Rdict.
        logs_handle: its handle, for WriteBatch puts.
        number: the table's number.
        kind: DELETIONS or CHANGES.
        max_ids: ids kept, the newest (whole entries).
    """

    def __init__(self, db, logs, logs_handle, number: int, kind: bytes, max_ids: int) -> None:
        self._db, self._logs, self._handle = db, logs, logs_handle
        self.prefix = table_prefix(number) + kind
        self.max_ids = max_ids
        self._end_key = b"logend/" + self.prefix
        self._lock = threading.Lock()
        self.first, self.end = self._bounds()

    def _key(self, seq: int) -> bytes:
        return self.prefix + seq.to_bytes(_SEQ_BYTES, "big")

    def _seq(self, it) -> int | None:
        """The first cursor of the entry an iterator is at, None if it is past this log."""
        if it.valid() and it.key().startswith(self.prefix):
            return int.from_bytes(it.key()[len(self.prefix) :], "big")
        return None

    def _bounds(self) -> tuple[int, int]:
        """(first cursor kept, end) as the database holds them."""
        stored = self._db.get(self._end_key)
        end = int.from_bytes(stored, "little") if stored else 0
        it = self._logs.iter()
        it.seek(self.prefix)
        first = self._seq(it)
        it.seek_for_prev(self.prefix + b"\xff" * _SEQ_BYTES)
        last = self._seq(it)
        if last is not None:
            end = max(end, last + (len(it.value()) - _TIME.itemsize) // 8)
        del it
        return (end if first is None else first), end

    def append(self, batch, ids: np.ndarray, when: float | None = None) -> None:
        """Log ids in batch (written by the caller; its cursors count from now on)."""
        if len(ids) == 0:
            return
        value = np.array([time.time() if when is None else when], dtype=_TIME).tobytes()
        value += np.ascontiguousarray(ids, dtype="<i8").tobytes()
        with self._lock:
            batch.put(self._key(self.end), value, self._handle)  # first == end (none kept): this one is first
            self.end += len(ids)
            if self.end - self.first > self.max_ids:  # trim to the entries that start in the newest max_ids
                it = self._logs.iter()
                it.seek(self._key(self.end - self.max_ids))
                keep = (
                    int.from_bytes(it.key()[len(self.prefix) :], "big")
                    if it.valid() and it.key().startswith(self.prefix)
                    else None
                )
                del it
                # none starts there: the newest entry (just put) alone is kept
                keep = self.end - len(ids) if keep is None else keep
                if keep > self.first:  # point deletes of the entries that fall out
                    it = self._logs.iter()
                    it.seek(self._key(self.first))
                    while it.valid() and it.key() < self._key(keep):
                        batch.delete(it.key(), self._handle)
                        it.next()
                    del it
                    self.first = keep

    def skip(self, batch) -> None:
        """Skip a count: a reader across it is told of a gap (the log was off for a while)."""
        with self._lock:
            if self.first == self.end:  # none kept: the oldest kept is still the end
                self.first += 1
            self.end += 1
            batch.put(self._end_key, self.end.to_bytes(8, "little"))

    def read(self, after: int | None, limit: int) -> Deletions:
        """Up to limit ids logged after cursor `after` (None: the oldest kept; END: none, the end's cursor)."""
        with self._lock:
            first, end = self.first, self.end
        if after == END:
            return Deletions(np.zeros(0, np.int64), np.zeros(0, np.float64), str(end), False)
        gap = after is not None and not first <= after <= end
        at = first if after is None else max(after, first)
        ids: list[np.ndarray] = []
        times: list[np.ndarray] = []
        got = 0
        it = self._logs.iter()
        it.seek_for_prev(self._key(at))
        if not (it.valid() and it.key().startswith(self.prefix)):
            it.seek(self.prefix)
        while got < limit and it.valid() and it.key().startswith(self.prefix):
            start = int.from_bytes(it.key()[len(self.prefix) :], "big")
            value = it.value()
            entry = np.frombuffer(value, dtype="<i8", offset=_TIME.itemsize)
            if start + len(entry) <= at:
                it.next()
                continue
            if start > at:  # a count skipped: what was not logged there is missing
                if got:
                    break
                gap, at = True, start
            take = entry[at - start :][: limit - got]
            ids.append(take.astype(np.int64))
            times.append(np.full(len(take), np.frombuffer(value[: _TIME.itemsize], dtype=_TIME)[0]))
            at += len(take)
            got += len(take)
            it.next()
        del it
        return read_to(ids, times, at, end, got < limit, gap)


class DropLog:
    """The store's log of tables dropped (default column family), the newest DROP_LOG_ENTRIES."""

    PREFIX = b"drop/"

    def __init__(self, db) -> None:
        self._db = db
        self._lock = threading.Lock()
        it = db.iter()
        it.seek_for_prev(self.PREFIX + b"\xff" * _SEQ_BYTES)
        last = it.key() if it.valid() and it.key().startswith(self.PREFIX) else None
        del it
        self.end = int.from_bytes(last[len(self.PREFIX) :], "big") + 1 if last else 0

    def _key(self, seq: int) -> bytes:
        return self.PREFIX + seq.to_bytes(_SEQ_BYTES, "big")

    def append(self, batch, table: str, when: float) -> None:
        """Log a drop in batch, trimming what falls out of the kept entries."""
        with self._lock:
            batch.put(self._key(self.end), json.dumps([table, when]).encode())
            self.end += 1
            if self.end > DROP_LOG_ENTRIES:  # the one that falls out
                batch.delete(self._key(self.end - DROP_LOG_ENTRIES - 1))

    def read(self, after: int | None, limit: int) -> Drops:
        """Up to limit drops after cursor `after` (None: the oldest kept; END: the end's cursor)."""
        with self._lock:
            end = self.end
        if after == END:
            return Drops([], str(end), False)
        it = self._db.iter()
        it.seek(self.PREFIX)
        first = (
            int.from_bytes(it.key()[len(self.PREFIX) :], "big")
            if it.valid() and it.key().startswith(self.PREFIX)
            else end
        )
        gap = after is not None and not first <= after <= end
        start = first if after is None else max(after, first)
        it.seek(self._key(start))
        got: list[Drop] = []
        while len(got) < max(1, limit) and it.valid() and it.key().startswith(self.PREFIX):
            name, when = json.loads(it.value())
            got.append(Drop(str(name), float(when)))
            it.next()
        del it
        return Drops(got, str(min(end, start + len(got))), gap)
