"""The ID transformer's id → slot map: open addressing with linear probing.

An ID's home position is fastrange(fmix64(id ^ seed) >> 32, size), computed here in torch
ops exactly as the kernel computes it. Two implementations of one small API (find,
insert, erase), 16 bytes per slot each:
- KernelSlotMap (CPU): 8-byte entries {tag, slot} at most half full, used by the compiled
  kernel (csrc/slot_map.cpp), which also runs the transformer's two per-batch passes
  (lookup, admit) over them.
- TorchSlotMap (CUDA, or CPU for reference): 12-byte entries (int64 keys, int32 vals
  tensors) at most 3/4 full; vectorised rounds of torch ops, one probe step per round for
  every pending ID; deletion leaves tombstones, rebuilt away when they pile up.
"""

from __future__ import annotations

import torch

EMPTY, DELETED = -1, -2
WINDOW = 8  # torch version: map entries looked at per probe round
MAP_SEED = 0x51_07
COIN_SEED = 0xC0_1E
_FMIX = (0xFF51AFD7ED558CCD - (1 << 64), 0xC4CEB9FE1A85EC53 - (1 << 64))


def map_size(capacity: int, load: float) -> int:
    size = max(16, int(capacity / load) + 1)
    if size >= 1 << 31:
        raise ValueError(f"capacity {capacity:,} is too large for one table's slot map (at most ~1.6e9 per rank)")
    return size


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def fmix64(x: torch.Tensor) -> torch.Tensor:
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
        from idtransformer.kernel import ops

        self.ops = ops()
        self.size = map_size(capacity, load=0.5)
        self.records = records
        self.entries = self.ops.huge_empty([2 * self.size], torch.int32).fill_(EMPTY)

    @property
    def nbytes(self) -> int:
        return self.entries.numel() * 4

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.find(self.entries, self.records, ids, MAP_SEED)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Enter ids (absent, distinct) at slots; their records must already hold them."""
        self.ops.insert(self.entries, self.records, slots, MAP_SEED)

    def erase(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Remove the ids held in slots (their records still hold them)."""
        self.ops.erase(self.entries, self.records, slots, MAP_SEED)


class TorchSlotMap:
    """The torch-ops map: keys (int64) and vals (int32 slot; -1 empty, -2 deleted) tensors;
    deletion leaves tombstones, rebuilt away when they pile up."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.size = map_size(capacity, load=0.75)
        self.keys = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.vals = torch.full((self.size,), EMPTY, dtype=torch.int32, device=device)
        self.live = 0
        self.tombstones = 0

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * 8 + self.vals.numel() * 4

    def _window(self, start: torch.Tensor) -> torch.Tensor:
        """(n, WINDOW) positions from each start on, wrapping at the end."""
        return torch.remainder(start.unsqueeze(1) + torch.arange(WINDOW, device=start.device), self.size)

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Position of each id in the map, or -1. Each round looks at WINDOW consecutive
        entries per pending id, so a chain takes few rounds (each a host sync on CUDA)."""
        found = torch.full_like(ids, -1)
        start = home(ids, self.size)
        pending = torch.arange(len(ids), device=ids.device)
        while pending.numel():
            window = self._window(start[pending])
            v = self.vals[window]
            match = (v >= 0) & (self.keys[window] == ids[pending].unsqueeze(1))
            stop = match | (v == EMPTY)  # linear probing ends at the first empty entry
            stopped = stop.any(1)
            first = torch.argmax(stop.to(torch.int8), dim=1, keepdim=True)  # the first True
            hit = stopped & match.gather(1, first).squeeze(1)
            found[pending[hit]] = window.gather(1, first).squeeze(1)[hit]
            start[pending] = start[pending] + WINDOW
            pending = pending[~stopped]
        return found

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self._positions(ids)
        return torch.where(pos >= 0, self.vals[pos.clamp(min=0)].to(torch.int64), -1)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        if self.live + len(ids) + self.tombstones > (self.size * 7) // 8:
            self._rebuild()
        start = home(ids, self.size)
        pending = torch.arange(len(ids), device=ids.device)
        slots = slots.to(torch.int32)
        while pending.numel():
            window = self._window(start[pending])
            free = self.vals[window] < 0
            has = free.any(1)
            first = torch.argmax(free.to(torch.int8), dim=1, keepdim=True)
            cand, cand_pos = pending[has], window.gather(1, first).squeeze(1)[has]
            # several new ids may want one free position: the first in sorted order takes it
            sorted_pos, order = torch.sort(cand_pos, stable=True)
            lead = torch.ones_like(sorted_pos, dtype=torch.bool)
            lead[1:] = sorted_pos[1:] != sorted_pos[:-1]
            winner, at = cand[order[lead]], sorted_pos[lead]
            self.tombstones -= int((self.vals[at] == DELETED).sum())
            self.keys[at] = ids[winner]
            self.vals[at] = slots[winner]
            placed = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
            placed[winner] = True
            # no free entry in the window: look further; lost a race: look again from the same start
            start[pending[~has]] += WINDOW
            pending = pending[~placed[pending]]
        self.live += len(ids)

    def erase(self, ids: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        pos = self._positions(ids)
        if bool((pos < 0).any()):
            raise KeyError("erase of ids that are not in the slot map")
        self.vals[pos] = DELETED
        self.live -= len(ids)
        self.tombstones += len(ids)

    def _rebuild(self) -> None:
        # Tombstones lengthen probe chains: re-insert the live entries into a clean map.
        live = torch.nonzero(self.vals >= 0).squeeze(1)
        ids, slots = self.keys[live].clone(), self.vals[live].clone()
        self.vals.fill_(EMPTY)
        self.live = self.tombstones = 0
        self.insert(ids, slots)


def coin(ids: torch.Tensor, step: int) -> torch.Tensor:
    """Uniform [0, 1) per id from a hash of (id, step, seed): reproducible, no generator state."""
    r = fmix64(ids * (0x9E3779B97F4A7C15 - (1 << 64)) ^ ((step << 32) ^ COIN_SEED))
    return _lsr(r, 11).to(torch.float64) * 2.0**-53


def make_slot_map(capacity: int, records: torch.Tensor, backend: str) -> KernelSlotMap | TorchSlotMap:
    if backend == "kernel":
        return KernelSlotMap(capacity, records)
    if backend == "torch":
        return TorchSlotMap(capacity, records.device)
    raise ValueError(f"slot map backend {backend!r} is not one of 'kernel', 'torch'")
