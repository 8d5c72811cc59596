"""The ID transformer's id → slot map for the exact backends. Two implementations of one small
API (find, insert, erase), at most 16 bytes per slot each:
- KernelSlotMap (CPU): open addressing with linear probing, 8-byte entries {tag, slot} at
  most half full, used by the compiled kernel (csrc/slot_map.cpp), which also runs the
  transformer's two per-batch passes (lookup, admit) over them. An ID's home position is
  fastrange(fmix64(id ^ seed) >> 32, size); `home` computes it in torch ops, as the kernel does.
- SortedSlotMap (backend "torch", any device): the resident ids sorted, with their slots;
  bulk torch ops (searchsorted, merge, compaction), no host round-trips.
Which map holds the ids does not change a transformer's results (slots, admissions,
evictions): the tests hold the two backends to identical ones. The triton backend's map is
set-associative and has a contract of its own (bucket_map.py).
"""

from __future__ import annotations

import torch

EMPTY = -1
MAP_SEED = 0x51_07
COIN_SEED = 0xC0_1E
_FMIX = (0xFF51AFD7ED558CCD - (1 << 64), 0xC4CEB9FE1A85EC53 - (1 << 64))


def map_size(capacity: int, load: float) -> int:
    """Entries of a map holding capacity ids at most at load; raises ValueError beyond 2^31."""
    size = max(16, int(capacity / load) + 1)
    if size >= 1 << 31:
        raise ValueError(f"capacity {capacity:,} is too large for one table's slot map (at most ~1.6e9 per rank)")
    return size


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer, elementwise on int64 (as the kernel computes it)."""
    x = x ^ _lsr(x, 33)
    x = x * _FMIX[0]
    x = x ^ _lsr(x, 33)
    x = x * _FMIX[1]
    return x ^ _lsr(x, 33)


def home(ids: torch.Tensor, size: int, seed: int = MAP_SEED) -> torch.Tensor:
    """Home position of each id: the kernel's fastrange(fmix64(id ^ seed), size)."""
    return (_lsr(fmix64(ids ^ seed), 32) * size) >> 32


class KernelSlotMap:
    """The compiled kernel's map: 8-byte entries {uint32 tag, int32 slot} in an int32 tensor
    of 2 * size elements, size = 2 * capacity; a tag match is confirmed on the slot's record
    (the transformer's (capacity, 2) int64 `records`: id, meta). See csrc/slot_map.cpp."""

    def __init__(self, capacity: int, records: torch.Tensor) -> None:
        if records.device.type != "cpu":
            raise ValueError(f"the slot-map kernel runs on CPU, not {records.device}")
        from dynemb.idtransformer.kernel import ops

        self.ops = ops()
        self.size = map_size(capacity, load=0.5)
        self.records = records
        self.entries = self.ops.huge_empty([2 * self.size], torch.int32).fill_(EMPTY)

    @property
    def nbytes(self) -> int:
        """Bytes the entries take."""
        return self.entries.numel() * 4

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it is not in the map."""
        return self.ops.find(self.entries, self.records, ids, MAP_SEED)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Enter ids (absent, distinct) at slots; their records must already hold them."""
        self.ops.insert(self.entries, self.records, slots, MAP_SEED)

    def erase(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Remove the ids held in slots (their records still hold them)."""
        self.ops.erase(self.entries, self.records, slots, MAP_SEED)


class SortedSlotMap:
    """The torch-ops map: the resident ids in ascending order (int64) and their slots (int32)
    alongside. A batch's lookups are one searchsorted; an insert merges the sorted new ids in
    (two searchsorteds and a scatter); an erase compacts with a prefix sum. Every step is a
    fixed number of bulk ops whatever the ids collide on, and none needs the host: on CUDA
    that is what matters (a probing hash map in torch ops needs a round, with a host sync,
    per probe step). 12 bytes per resident id."""

    _TOP = torch.iinfo(torch.int64).max

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.keys = torch.empty(0, dtype=torch.int64, device=device)
        self.vals = torch.empty(0, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes the sorted ids and their slots take."""
        return self.keys.numel() * 8 + self.vals.numel() * 4

    def _at(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position in keys clamped to a valid one, whether the id is there)."""
        pos = torch.searchsorted(self.keys, ids).clamp_(max=self.keys.numel() - 1)
        return pos, self.keys[pos] == ids

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id (int64), -1 where it is not in the map."""
        if self.keys.numel() == 0:
            return torch.full_like(ids, -1)
        pos, there = self._at(ids)
        return torch.where(there, self.vals[pos].to(torch.int64), -1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Enter ids (absent, distinct) at slots."""
        if ids.numel() == 0:
            return
        new, order = torch.sort(ids)
        n_old, n_new = self.keys.numel(), new.numel()
        # where each lands in the merged order: its rank in its own list plus how many of
        # the other list come before it
        at_new = torch.searchsorted(self.keys, new) + torch.arange(n_new, device=new.device)
        at_old = torch.searchsorted(new, self.keys) + torch.arange(n_old, device=new.device)
        keys = torch.empty(n_old + n_new, dtype=torch.int64, device=new.device)
        vals = torch.empty(n_old + n_new, dtype=torch.int32, device=new.device)
        keys[at_old], vals[at_old] = self.keys, self.vals
        keys[at_new], vals[at_new] = new, slots[order].to(torch.int32)
        self.keys, self.vals = keys, vals

    def erase(self, ids: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Remove ids; all must be present (the transformer erases what its records hold)."""
        if ids.numel() == 0:
            return
        pos, _ = self._at(ids)
        keep = torch.ones_like(self.keys, dtype=torch.bool)
        keep[pos] = False
        n = self.keys.numel() - ids.numel()  # known on the host: no sync for the compaction
        # kept entries go to their rank among the kept, erased ones to a spare last place
        dest = torch.where(keep, torch.cumsum(keep, 0) - 1, n)
        keys = torch.empty(n + 1, dtype=torch.int64, device=ids.device).scatter_(0, dest, self.keys)
        vals = torch.empty(n + 1, dtype=torch.int32, device=ids.device).scatter_(0, dest, self.vals)
        self.keys, self.vals = keys[:n], vals[:n]


def coin(ids: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) per id from a hash of (id, step, seed): reproducible, no generator state
    (step: one for all, or each id's)."""
    r = fmix64(ids * (0x9E3779B97F4A7C15 - (1 << 64)) ^ ((step << 32) ^ COIN_SEED))
    return _lsr(r, 11).to(torch.float64) * 2.0**-53


def make_slot_map(capacity: int, records: torch.Tensor, backend: str) -> KernelSlotMap | SortedSlotMap:
    """The slot map of a backend: 'kernel' (KernelSlotMap) or 'torch' (SortedSlotMap); a
    triton table's map lives in its BucketTables (bucket_tables.py)."""
    if backend == "kernel":
        return KernelSlotMap(capacity, records)
    if backend == "torch":
        return SortedSlotMap(capacity, records.device)
    raise ValueError(f"slot map backend {backend!r} is not one of 'kernel', 'torch' (triton: BucketTables)")
