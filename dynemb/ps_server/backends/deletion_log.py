"""The embedded store's deletion log of one table: ids that left it, in memory, bounded.

Cursors are the count of ids logged before a point, as decimal text; the log keeps the newest
`max_ids` (whole entries), and a read from before what it keeps says so (gap). The Redis
backend keeps the same log in a Redis stream (redis_keys.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.lifecycle import Deletions

# Ids a table's deletion log keeps by default (8 bytes each, and 8 of time).
LOG_MAX_IDS = 1 << 22


def parse_cursor(after: str, where: str) -> int | None:
    """A log cursor as its number ("": None, the oldest kept); InvalidArgument naming it if it is not one."""
    if not after:
        return None
    if not after.isdigit() or len(after) > 20:
        raise InvalidArgument(f"{where}: deletion log cursor {after[:40]!r} is not one this store gave")
    return int(after)


class DeletionLog:
    """Ids deleted from one table, with when, the newest max_ids kept."""

    def __init__(self, max_ids: int = LOG_MAX_IDS) -> None:
        self.max_ids = max_ids
        self._entries: deque[tuple[int, float, np.ndarray]] = deque()  # (first seq, time, ids)
        self._kept = 0
        self.end = 0  # ids ever logged: the cursor after the newest
        self._lock = threading.Lock()

    def append(self, ids: np.ndarray, when: float | None = None) -> None:
        if len(ids) == 0:
            return
        ids = np.array(ids, dtype=np.int64)  # a copy: the caller's array may be reused
        with self._lock:
            self._entries.append((self.end, time.time() if when is None else when, ids))
            self.end += len(ids)
            self._kept += len(ids)
            while self._kept > self.max_ids and len(self._entries) > 1:
                self._kept -= len(self._entries.popleft()[2])

    @property
    def start(self) -> int:
        """The cursor of the oldest id kept."""
        with self._lock:
            return self._entries[0][0] if self._entries else self.end

    def read(self, after: int | None, limit: int) -> Deletions:
        """Up to limit ids logged after cursor `after` (None: from the oldest kept)."""
        with self._lock:
            entries = list(self._entries)
            end = self.end
        first = entries[0][0] if entries else end
        gap = after is not None and after < first
        after = first if after is None else after
        ids, times = [], []
        at = max(after, first)
        got = 0
        for start, when, entry in entries:
            stop = start + len(entry)
            if stop <= at:
                continue
            take = entry[at - start :][: max(0, limit - got)]
            if len(take) == 0:
                break
            ids.append(take)
            times.append(np.full(len(take), when))
            at += len(take)
            got += len(take)
        at = min(at, end)
        return Deletions(
            np.concatenate(ids) if ids else np.zeros(0, np.int64),
            np.concatenate(times) if times else np.zeros(0, np.float64),
            str(at),
            gap,
        )

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(ids, times, first cursor) of everything kept: for a save."""
        d = self.read(None, 1 << 62)
        return d.ids, d.times, self.start

    def restore(self, ids: np.ndarray, times: np.ndarray, first: int) -> None:
        """The log as saved by snapshot()."""
        with self._lock:
            self._entries.clear()
            self._kept = 0
            self.end = first
        if len(ids):  # one entry per run of one time
            cuts = np.flatnonzero(np.diff(times)) + 1
            for part_ids, part_times in zip(np.split(ids, cuts), np.split(times, cuts)):
                self.append(part_ids, float(part_times[0]))
