"""A batched int64 id → int64 row-number map: the compiled map of dynemb/ps_server/csrc/id_index.h.

The embedded store looks up and inserts whole batches of ids, one batch per table per
request (26 tables x ~300 ids a trainer step). A Python dict costs ~100 bytes and a Python
call per id; numpy probing costs dozens of whole-array steps per batch. Here a batch is
one C call (about a microsecond plus a few ns per id in cache), 16 bytes per slot, at most
half the slots used.

This wrapper converts ids to a 1-D contiguous int64 array (or refuses them, naming why)
and allocates every output array; the C module checks each size again against the
buffers it gets.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from dynemb.ps_server import native

SLOT_BYTES = 16


def _int64s(a, what: str) -> np.ndarray:
    """a as a 1-D C-contiguous native int64 array: integer arrays are converted, others refused."""
    if type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous:
        return a  # the store's case: no copy
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {a.shape}")
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind in "fb"):
        raise TypeError(f"{what} must be integers (int64), got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


class IdIndex:
    """The id → row-number map of one table; lookups and inserts take a whole batch of ids at once.

    Args:
        capacity: how many ids to make room for at first (the map grows as needed).
        seed: the hash seed; None draws a random one.
    """

    def __init__(self, capacity: int = 1024, seed: int | None = None) -> None:
        self._c = native.id_index()
        # a random hash seed per index: ids crafted to share one probe chain can't be precomputed
        seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed & (2**64 - 1)
        self._h = self._c.new(min(max(int(capacity), 0), 1 << 40), seed)  # freed with self._h
        # The store locks each table around its calls; this lock also keeps any other caller
        # from running two calls at once (the C side drops the GIL and is not thread-safe).
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Slots allocated."""
        return self._c.capacity(self._h)

    def __len__(self) -> int:
        return self._c.size(self._h)

    def nbytes(self) -> int:
        """Bytes of memory the map holds."""
        return self._c.nbytes(self._h)

    def lookup(self, ids) -> np.ndarray:
        """The value of each id, or -1 where absent."""
        ids = _int64s(ids, "ids")
        out = np.empty(len(ids), dtype=np.int64)
        with self._lock:
            self._c.lookup(self._h, ids, out, None)
        return out

    def pull_rows(self, ids, table: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Each id's row of table (rows numbered by this index's values) into out, in one C
        call; returns the positions of the ids absent (their rows in out untouched)."""
        ids = _int64s(ids, "ids")
        missing = np.empty(len(ids), dtype=np.int64)
        row_bytes = table.strides[0] if table.ndim == 2 else table.itemsize
        with self._lock:
            k = self._c.pull_rows(self._h, table, row_bytes, ids, out, missing)
        return missing[:k]

    def push_rows(self, ids, table: np.ndarray, rows: np.ndarray, next_value: int) -> int:
        """A push in one C call: each absent id gets the next value from next_value on (table's
        rows from there must be free, and table have room for len(ids) of them); then rows[i]
        is copied to ids[i]'s row of table, in order (a repeated id's last row stays). Returns
        how many ids were new."""
        ids = _int64s(ids, "ids")
        row_bytes = table.itemsize * (table.shape[1] if table.ndim == 2 else 1)
        if row_bytes == 0:
            raise ValueError("push_rows: the table's rows have no columns")
        if rows.dtype != table.dtype or not rows.flags.c_contiguous or rows.size * rows.itemsize < len(ids) * row_bytes:
            raise ValueError(
                f"rows must be {len(ids)} contiguous rows of {row_bytes} bytes ({table.dtype}), "
                f"got {rows.shape} {rows.dtype}"
            )
        with self._lock:
            return self._c.push_rows(self._h, table, row_bytes, ids, rows, next_value)

    def insert(self, ids, values) -> None:
        """Add ids that are NOT present (the caller checked), distinct within the call."""
        ids, values = _int64s(ids, "ids"), _int64s(values, "values")
        if len(ids) != len(values):
            raise ValueError(f"{len(ids)} ids but {len(values)} values")
        with self._lock:
            self._check(self._c.insert(self._h, ids, None, values, None))

    def lookup_or_insert(self, ids, new_values, unused=None) -> np.ndarray:
        """The value of each id; the absent ones are inserted, with values from new_values(k),
        k being how many of the ids are absent. An id may repeat (every occurrence gets its
        value): an absent id that repeats takes the value of its first occurrence, and the
        values its repeats were given go to unused(values) (the store frees those rows).
        Nothing here sorts: a push costs one lookup and one insert, however many are new."""
        ids = _int64s(ids, "ids")
        n = len(ids)
        out = np.empty(n, dtype=np.int64)
        missing = np.empty(n, dtype=np.int64)
        with self._lock:
            k = self._c.lookup(self._h, ids, out, missing)
            if k:
                where = missing[:k]
                values = _int64s(new_values(k), "new values")
                if len(values) != k:
                    raise ValueError(f"new_values({k}) returned {len(values)} values")
                # the insert finds a repeat's entry made by its first occurrence and gives it
                # that value, so a value that did not land is one a repeat was given
                self._check(self._c.insert(self._h, ids, where, values, out))
                if unused is not None:
                    spare = out[where] != values
                    if spare.any():
                        unused(values[spare])
        return out

    def remove(self, ids) -> np.ndarray:
        """Remove ids; returns the values of those that were present (each once)."""
        ids = _int64s(ids, "ids")
        out = np.empty(len(ids), dtype=np.int64)
        with self._lock:
            k = self._c.remove(self._h, ids, out)
        return out[:k].copy()

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values) of every entry, copies, in no particular order."""
        with self._lock:
            n = len(self)
            keys, values = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
            got = self._c.items(self._h, keys, values)
        assert got == n, (got, n)
        return keys, values

    def clear(self) -> None:
        """Remove every id and give the slots' memory back (down to the smallest table)."""
        with self._lock:
            self._c.clear(self._h)

    @staticmethod
    def _check(status: int) -> None:
        if status == -1:
            raise MemoryError("out of memory growing an id index")
        if status == -2:
            raise ValueError("id index values must be >= 0 (row numbers)")
