"""The embedded store's logs of one table's ids, in memory, bounded: its deletion log (ids that
left it) and its change log (ids pushed to it, change_log.py).

Cursors are the count of ids logged before a point, as decimal text; a log keeps the newest
`max_ids` (whole entries), and a read from before what it keeps, or from past its end (a cursor
of another log: the table was dropped and made again, or the store restored from older files),
says so (gap). The Redis backend keeps the same logs in Redis streams (redis_keys.py).
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


# The cursor "$": the log's end now (a read from it returns no ids, and the cursor of the end).
END = -1


def parse_cursor(after: str, where: str, log: str = "deletion log") -> int | None:
    """A log cursor as its number ("": None, the oldest kept; "$": END); InvalidArgument naming
    it if it is not one."""
    if not after:
        return None
    if after == "$":
        return END
    if not after.isdigit() or len(after) > 20:
        raise InvalidArgument(f"{where}: {log} cursor {after[:40]!r} is not one this store gave")
    return int(after)


class IdLog:
    """Ids logged for one table, with when, the newest max_ids kept."""

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

    def skip(self) -> None:
        """Skip a count: a reader that reads across it is told of a gap (the log stopped
        logging for a while: what happened then is not in it)."""
        with self._lock:
            self.end += 1

    @property
    def start(self) -> int:
        """The cursor of the oldest id kept."""
        with self._lock:
            return self._entries[0][0] if self._entries else self.end

    def read(self, after: int | None, limit: int) -> Deletions:
        """Up to limit ids logged after cursor `after` (None: from the oldest kept)."""
        with self._lock:
            if after == END:
                return Deletions(np.zeros(0, np.int64), np.zeros(0, np.float64), str(self.end), False)
            entries = list(self._entries)
            end = self.end
        first = entries[0][0] if entries else end
        gap = after is not None and not first <= after <= end
        after = first if after is None else after
        ids, times = [], []
        at = max(after, first)
        got = 0
        for start, when, entry in entries:
            stop = start + len(entry)
            if stop <= at:
                continue
            if start > at:  # a count skipped (skip()): what was not logged there is missing
                if got:
                    break
                gap, at = True, start
            take = entry[at - start :][: max(0, limit - got)]
            if len(take) == 0:
                break
            ids.append(take)
            times.append(np.full(len(take), when))
            at += len(take)
            got += len(take)
        return read_to(ids, times, at, end, got < limit, gap)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids, times, runs, end) of everything kept, for a save: runs (k, 2) int64 holds each
        entry's first cursor and length, so that restore() numbers them as they were."""
        with self._lock:
            entries = list(self._entries)
            end = self.end
        if not entries:
            return np.zeros(0, np.int64), np.zeros(0, np.float64), np.zeros((0, 2), np.int64), end
        ids = np.concatenate([e[2] for e in entries])
        times = np.concatenate([np.full(len(e[2]), e[1]) for e in entries])
        runs = np.array([(e[0], len(e[2])) for e in entries], dtype=np.int64)
        return ids, times, runs, end

    def restore(self, ids: np.ndarray, times: np.ndarray, runs: np.ndarray | None, end: int) -> None:
        """The log as saved by snapshot() (runs None: saved without, one run from end - len(ids)).

        Raises:
            ValueError: runs that do not fit the ids or the end.
        """
        if runs is None:
            runs = np.array([(end - len(ids), len(ids))], dtype=np.int64) if len(ids) else np.zeros((0, 2), np.int64)
        runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        if int(runs[:, 1].sum()) != len(ids) or len(times) != len(ids) or (len(runs) and runs[-1].sum() > end):
            raise ValueError(f"a log of {len(ids)} ids whose runs or end ({end}) do not fit them")
        entries: deque[tuple[int, float, np.ndarray]] = deque()
        at = 0
        for start, n in runs:
            entries.append((int(start), float(times[at]) if n else 0.0, np.array(ids[at : at + n], dtype=np.int64)))
            at += int(n)
        with self._lock:
            self._entries = entries
            self._kept = len(ids)
            self.end = end


def read_to(ids: list[np.ndarray], times: list[np.ndarray], at: int, end: int, to_end: bool, gap: bool) -> Deletions:
    """A read of a log (this one's or the disk store's) ended at count `at` of its `end`: the
    ids and times read, and the cursor. to_end: it read all there was (under its limit), so a
    count skipped past `at` is a gap too, and the cursor is the end."""
    if to_end:
        gap |= at < end
        at = end
    return Deletions(
        np.concatenate(ids) if ids else np.zeros(0, np.int64),
        np.concatenate(times) if times else np.zeros(0, np.float64),
        str(min(at, end)),
        gap,
    )
