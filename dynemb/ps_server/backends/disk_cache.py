"""The disk store's hot rows in this process's memory: a pool per table in front of RocksDB.

A lookup through RocksDB costs 1-3 us a key even when its row cache holds the row (the binding's
bytes objects, MultiGet's sort, the cache's own lookup), against ~0.1 us for a row of the
embedded store. So a hot row must not go to RocksDB at all: each table keeps an id index (the
embedded store's compiled IdIndex, id -> slot) over a numpy pool of row bytes, and a pull copies
its hits out in one compiled call and asks RocksDB only for the misses, which are then admitted.

The pool is write-through: every write reaches RocksDB (through its WAL, as before) and then the
pool, so a pooled row always equals its stored one, an eviction costs nothing, and an id found in
the pool is known to be stored (a push's exact row count needs no read for it). Eviction is CLOCK:
a reference bit per slot, set by a hit, cleared as the hand passes; the hand takes slots whose bit
is clear, a whole batch of victims in a few numpy steps.

Concurrency: the store reads RocksDB without its table lock, so a row read before a write may
come back after it. Each pool counts its writes (`version`) and keeps the ids of the last
_RECENT of them: a pull notes the version before it reads, and admits only ids no write touched
since (all of them when none did; none when more than _RECENT did, or a clear did), nor one
being written now. A write holds its pooled rows first (hold: served from RocksDB until the
write lands in the pool), so no pull sees the old row from the pool after another saw the new
one from RocksDB.

Memory: cache_bytes less RocksDB's share (disk_config.POOL_SHARE) is shared by every table's
pool, counting each slot's row, stamp, id, bits and its index entry (SLOT_OVERHEAD); a pool grows
while the share has room, then evicts within itself.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from dynemb.ps_server import native
from dynemb.ps_server.backends.id_index import SLOT_BYTES, IdIndex
from dynemb.ps_server.lifecycle import STAMP_DTYPE

# bytes a slot costs beside its row: stamp 4, id 8, reference bit 1, and the index's entry
# (16-byte slots kept at most half full, so ~2-4 slots an entry as it doubles: 3 taken; 2.2 at the
# 10^7-row bench's 474,418 rows); its state byte is left out (~1% of a 68-byte row's slot)
SLOT_OVERHEAD = 4 + 8 + 1 + 3 * SLOT_BYTES
# writes whose ids a pool keeps for the admission check (a pull outrun by more admits nothing)
_RECENT = 32
_FIRST_SLOTS = 1024
# a slot's state: no row; a row; a row being written (a hit goes to RocksDB until the write lands)
_FREE, _LIVE, _HELD = 0, 1, 2


class PoolBudget:
    """The bytes every table's pool may hold together.

    Args:
        max_bytes: the pools' share of cache_bytes.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.used = 0
        self._lock = threading.Lock()

    def take(self, want: int) -> int:
        """Up to want bytes, as many as are left; returns how many were taken."""
        with self._lock:
            got = max(0, min(want, self.max_bytes - self.used))
            self.used += got
            return got

    def give_back(self, nbytes: int) -> None:
        """Return bytes a dropped pool held."""
        with self._lock:
            self.used = max(0, self.used - nbytes)


class RowPool:
    """One table's hot rows (see the module doc). Each method takes the pool's lock for a few
    compiled or numpy steps; none reads RocksDB.

    Args:
        row_bytes: bytes of one row as stored (without its stamp).
        budget: the store's shared budget.
    """

    def __init__(self, row_bytes: int, budget: PoolBudget) -> None:
        self.row_bytes = row_bytes
        self.slot_bytes = row_bytes + SLOT_OVERHEAD
        self.budget = budget
        self.lock = threading.Lock()
        self.index = IdIndex()
        self._held = 0  # bytes taken from the budget
        self._arrays(0)
        self.used = 0  # slots handed out: [0, used) hold a row or are free (id -1)
        self.hand = 0
        self.version = 0
        self._recent: deque[tuple[int, np.ndarray | None]] = deque(maxlen=_RECENT)
        self._writing: np.ndarray | None = None  # ids of the write in flight (one: under the table's lock)
        self.hits = 0
        self.misses = 0
        self._scatter = native.id_index().scatter

    def _arrays(self, capacity: int) -> None:
        self.rows = np.zeros((capacity, self.row_bytes), dtype=np.uint8)
        self.stamps = np.zeros(capacity, dtype=STAMP_DTYPE)
        self.ids = np.full(capacity, -1, dtype=np.int64)  # -1: a free slot (ids may be -1 too: see live)
        self.live = np.zeros(capacity, dtype=np.uint8)  # _FREE, _LIVE or _HELD
        self.ref = np.zeros(capacity, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def __len__(self) -> int:
        return len(self.index)

    def nbytes(self) -> int:
        """Bytes the pool holds now (its arrays and its index)."""
        return self.capacity * (self.row_bytes + 4 + 8 + 1 + 1) + self.index.nbytes()

    # -- reads --------------------------------------------------------------------------------

    def gather(self, ids: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Copy the pooled rows of ids into out (n rows of row_bytes, any dtype) at their
        positions, marking them used.

        Args:
            ids: int64, contiguous.
            out: where rows go; rows of ids not pooled are left as they were.

        Returns:
            (positions of the ids found, their stamps (0: none), the version before any read of
            the rest may start, for admit).
        """
        with self.lock:
            slots = self.index.lookup(ids)
            hit = slots >= 0
            hit[hit] = self.live[slots[hit]] == _LIVE
            at = np.flatnonzero(hit)
            found = slots[at]
            if len(at):
                self._scatter(out, self.row_bytes, at, self.rows, found)
                self.ref[found] = 1
            self.hits += len(at)
            self.misses += len(ids) - len(at)
            return at, self.stamps[found], self.version

    def pooled(self, ids: np.ndarray) -> np.ndarray:
        """Which of ids are pooled (so stored: the pool holds only stored rows)."""
        with self.lock:
            return self.index.lookup(ids) >= 0

    # -- changes ------------------------------------------------------------------------------

    def admit(self, ids: np.ndarray, rows: np.ndarray, stamps: np.ndarray, since: int) -> None:
        """Pool rows read from RocksDB, unless a write since version `since` touched their ids.

        Args:
            ids: int64 (may repeat: the first of each is taken).
            rows: (len(ids), row_bytes) uint8, as stored.
            stamps: their stamps (0: none).
            since: the version gather returned before the read.
        """
        if not len(ids):
            return
        with self.lock:
            if since != self.version:
                written = [w for v, w in self._recent if v > since]
                if len(written) < self.version - since or any(w is None for w in written):
                    return  # more writes than kept, or a clear: which rows are current is unknown
                keep = ~np.isin(ids, np.concatenate(written))  # type: ignore[arg-type]
                ids, rows, stamps = ids[keep], rows[keep], stamps[keep]
            if self._writing is not None:  # read before that write landed in RocksDB, maybe
                keep = ~np.isin(ids, self._writing)
                ids, rows, stamps = ids[keep], rows[keep], stamps[keep]
            if len(ids) > 1:
                ids, first = np.unique(ids, return_index=True)
                rows, stamps = rows[first], stamps[first]
            absent = np.flatnonzero(self.index.lookup(ids) < 0)
            if len(absent) < len(ids):
                ids, rows, stamps = ids[absent], rows[absent], stamps[absent]
            self._place(ids, rows, stamps)

    def hold(self, ids: np.ndarray) -> None:
        """Before RocksDB takes a write or delete of ids (under the table's lock): their pooled
        rows are served by RocksDB, and no read admits them, until write or forget."""
        with self.lock:
            self._wrote(ids)
            self._writing = self._recent[-1][1]
            slots = self.index.lookup(ids)
            self.live[slots[slots >= 0]] = _HELD

    def write(self, ids: np.ndarray, rows: np.ndarray, stamp: int) -> None:
        """After RocksDB took a write of rows (distinct ids): the pooled ones overwritten, the
        rest admitted; the hold ends.

        Args:
            ids: distinct int64.
            rows: (len(ids), row_bytes) uint8.
            stamp: the stamp they were written with (0: none).
        """
        with self.lock:
            self._wrote(ids)
            self._writing = None
            slots = self.index.lookup(ids)
            hit = slots >= 0
            if hit.any():
                where = slots[hit]
                self._scatter(self.rows, self.row_bytes, where, np.ascontiguousarray(rows), np.flatnonzero(hit))
                self.stamps[where] = stamp
                self.live[where] = _LIVE
            if not hit.all():
                new = ~hit
                self._place(ids[new], rows[new], np.full(int(new.sum()), stamp, dtype=STAMP_DTYPE))

    def forget(self, ids: np.ndarray) -> None:
        """After RocksDB deleted ids' rows, or a write failed: their slots freed; the hold ends."""
        with self.lock:
            self._wrote(ids)
            self._writing = None
            slots = self.index.remove(ids)
            self.live[slots] = _FREE
            self.ids[slots] = -1
            self.ref[slots] = 0

    def clear(self) -> None:
        """Forget every row (a clear of the table): the slots stay allocated, all free."""
        with self.lock:
            self.version += 1
            self._recent.append((self.version, None))
            self.index.clear()
            self.live[:] = _FREE
            self.ids[:] = -1
            self.ref[:] = 0
            self.hand = 0

    def close(self) -> None:
        """Give the pool's memory back (a drop of the table)."""
        with self.lock:
            self.version += 1
            self._recent.append((self.version, None))
            self.index.clear()
            self._arrays(0)
            self.used = self.hand = 0
            self.budget.give_back(self._held)
            self._held = 0

    # -- under the lock -----------------------------------------------------------------------

    def _wrote(self, ids: np.ndarray) -> None:
        self.version += 1
        self._recent.append((self.version, ids.copy()))

    def _place(self, ids: np.ndarray, rows: np.ndarray, stamps: np.ndarray) -> None:
        """Put rows of ids (distinct, none pooled) into free, fresh or evicted slots."""
        k = len(ids)
        if not k:
            return
        slots = self._slots(k)
        if len(slots) < k:  # a pool with no room at all (a tiny budget among many tables)
            ids, rows, stamps = ids[: len(slots)], rows[: len(slots)], stamps[: len(slots)]
            if not len(slots):
                return
        gone = self.live[slots] != _FREE
        if gone.any():
            self.index.remove(self.ids[slots[gone]])
        self.index.insert(ids, slots)
        self._scatter(self.rows, self.row_bytes, slots, np.ascontiguousarray(rows), np.arange(len(slots)))
        self.stamps[slots] = stamps
        self.ids[slots] = ids
        self.live[slots] = _LIVE
        self.ref[slots] = 0

    def _slots(self, k: int) -> np.ndarray:
        """Up to k distinct slots for new rows (k at most the pool's capacity): fresh ones while
        the budget lasts, then CLOCK's victims among the others."""
        if self.used + k > self.capacity:
            self._grow(self.used + k)
        k = min(k, self.capacity)
        take = min(k, self.capacity - self.used)
        fresh = np.arange(self.used, self.used + take, dtype=np.int64)
        self.used += take
        if take == k:
            return fresh
        self.ref[fresh] = 2  # taken: not a victim as well
        return np.concatenate([fresh, self._victims(k - take)])

    def _grow(self, want: int) -> None:
        """Enlarge the arrays toward want slots (doubling), as far as the budget allows."""
        target = max(want, 2 * self.capacity, _FIRST_SLOTS)
        got = self.budget.take((target - self.capacity) * self.slot_bytes)
        extra = got // self.slot_bytes
        self.budget.give_back(got - extra * self.slot_bytes)
        if extra <= 0:
            return
        self._held += extra * self.slot_bytes
        old: list[np.ndarray] = [self.rows, self.stamps, self.ids, self.live, self.ref]
        n = self.capacity
        self._arrays(n + extra)
        grown: list[np.ndarray] = [self.rows, self.stamps, self.ids, self.live, self.ref]
        for new, was in zip(grown, old):
            new[:n] = was

    def _victims(self, k: int) -> np.ndarray:
        """k slots of [0, used) by CLOCK: free ones and those not used since the hand passed;
        the bits of the slots passed over are cleared. Picked slots are marked 2 until _place
        fills them, so a hand that goes round twice cannot pick one again; k must not exceed
        the slots not so marked."""
        picked: list[np.ndarray] = []
        while k:
            end = min(self.used, self.hand + max(4 * k, 4096))
            window = self.ref[self.hand : end]
            free = np.flatnonzero(window == 0)
            if len(free) >= k:
                free = free[:k]
                passed = window[: free[-1] + 1]
                passed[passed == 1] = 0
                window[free] = 2
                picked.append(self.hand + free)
                self.hand = (self.hand + int(free[-1]) + 1) % self.used
                break
            window[window == 1] = 0
            window[free] = 2
            picked.append(self.hand + free)
            k -= len(free)
            self.hand = end % self.used
        return np.concatenate(picked) if len(picked) != 1 else picked[0]
