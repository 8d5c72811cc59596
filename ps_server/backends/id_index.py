"""A batched int64 → row-index hash map on numpy arrays (open addressing, linear probing).

The embedded store looks up and inserts whole batches of ids. A Python dict costs
~100 bytes and a Python call per id; this map costs 17 bytes per slot (key, value,
state) and does each probe round as one vectorised numpy step over every id still
probing. No library offers a vectorised int64 map for numpy, hence this file.

Slots are EMPTY, USED or DELETED (a tombstone, so probe chains stay intact after a
delete). The table doubles (and drops tombstones) when more than half its slots
are not empty, so probe chains stay short.
"""

from __future__ import annotations

import numpy as np

from ps_server.hashing import xxh64_ids

EMPTY, USED, DELETED = 0, 1, 2
WINDOW = 8  # slots of a probe chain looked at per vectorised round
_OFFSETS = np.arange(WINDOW, dtype=np.int64)
_HASH_SEED = 0x5EED_1D


class IdIndex:
    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self._alloc(cap)
        self.size = 0  # live keys
        self._tombstones = 0

    def _alloc(self, cap: int) -> None:
        self.keys = np.zeros(cap, dtype=np.int64)
        self.values = np.zeros(cap, dtype=np.int64)
        self.state = np.zeros(cap, dtype=np.uint8)
        self._mask = np.uint64(cap - 1)

    @property
    def capacity(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return self.size

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (xxh64_ids(ids, _HASH_SEED) & self._mask).astype(np.int64)

    def _find_slots(self, ids: np.ndarray, free: np.ndarray | None = None) -> np.ndarray:
        """The slot holding each id, or -1. With `free` (an int64 array of len(ids)), also
        the first slot on each missing id's probe chain that an insert could take (EMPTY or
        DELETED), so the insert need not walk the chain again."""
        n = len(ids)
        found = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return found
        if self.size == 0:
            if free is not None:
                free[:] = self._home(ids)
            return found
        mask = int(self._mask)
        pos = self._home(ids)
        pending = np.arange(n)
        while pending.size:
            # WINDOW slots of each chain per round: chains are short at this load, so one
            # round nearly always ends every walk (each round is a dozen whole-array steps)
            win = (pos[pending, None] + _OFFSETS) & mask
            st = self.state[win]
            match = (st == USED) & (self.keys[win] == ids[pending, None])
            stop = match | (st == EMPTY)  # a chain ends at its first EMPTY slot
            ended = stop.any(1)
            at = stop.argmax(1)
            rows = np.arange(len(pending))
            hit = ended & match[rows, at]
            found[pending[hit]] = win[rows, at][hit]
            if free is not None:
                open_ = st != USED
                first = open_.any(1) & (free[pending] < 0)
                free[pending[first]] = win[rows, open_.argmax(1)][first]
            pending = pending[~ended]
            pos[pending] = (pos[pending] + WINDOW) & mask
        return found

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id, or -1 where absent."""
        slots = self._find_slots(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        hit = slots >= 0
        out[hit] = self.values[slots[hit]]
        return out

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Add ids that are NOT present (the caller checked), distinct within the call."""
        if len(ids) == 0:
            return
        self._reserve(len(ids))
        self._place(ids, values, self._home(ids))

    def lookup_or_insert(self, ids: np.ndarray, new_values) -> np.ndarray:
        """The value of each id (distinct within the call); the absent ones are inserted with
        new_values(k), k being how many are absent, in the order they come. One probe walk
        serves both: an absent id's insert starts at the first free slot its lookup passed."""
        self._reserve(len(ids))  # before the walk: growing rehashes, which would move the slots
        free = np.full(len(ids), -1, dtype=np.int64)
        slots = self._find_slots(ids, free)
        out = np.full(len(ids), -1, dtype=np.int64)
        hit = slots >= 0
        out[hit] = self.values[slots[hit]]
        missing = np.flatnonzero(~hit)
        if len(missing):
            out[missing] = new_values(len(missing))
            self._place(ids[missing], out[missing], free[missing])
        return out

    def _place(self, ids: np.ndarray, values: np.ndarray, pos: np.ndarray) -> None:
        """Put absent ids at the first non-USED slot from pos on (room was reserved)."""
        mask = int(self._mask)
        pos = pos.copy()
        pending = np.arange(len(ids))
        while pending.size:
            win = (pos[pending, None] + _OFFSETS) & mask
            open_ = self.state[win] != USED
            has = open_.any(1)
            target = win[np.arange(len(pending)), open_.argmax(1)]
            pos[pending[~has]] = (pos[pending[~has]] + WINDOW) & mask
            cand, cand_pos = pending[has], target[has]
            # several new ids may want one free slot: the first takes it, the rest probe on
            slot, first = np.unique(cand_pos, return_index=True)
            winner = cand[first]
            self._tombstones -= int((self.state[slot] == DELETED).sum())
            self.keys[slot] = ids[winner]
            self.values[slot] = values[winner]
            self.state[slot] = USED
            self.size += len(slot)
            placed = np.zeros(len(ids), dtype=bool)
            placed[winner] = True
            losers = cand[~placed[cand]]
            pos[losers] = (target[has][~placed[cand]] + 1) & mask
            pending = pending[~placed[pending]]

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove ids; returns the values of those that were present (each once)."""
        slots = self._find_slots(np.unique(ids))
        slots = slots[slots >= 0]
        vals = self.values[slots].copy()
        self.state[slots] = DELETED
        self.size -= len(slots)
        self._tombstones += len(slots)
        return vals

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self.state == USED
        return self.keys[live].copy(), self.values[live].copy()

    def clear(self) -> None:
        self._alloc(16)
        self.size = 0
        self._tombstones = 0

    def _reserve(self, extra: int) -> None:
        # Keep at most half the slots non-empty so probe chains stay short.
        need = self.size + extra
        if 2 * (need + self._tombstones) <= self.capacity:
            return
        cap = self.capacity
        while 2 * need > cap:
            cap *= 2
        keys, values = self.items()
        self._alloc(cap)
        self.size = 0
        self._tombstones = 0
        self.insert(keys, values)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.state.nbytes
