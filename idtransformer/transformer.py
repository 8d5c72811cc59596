"""IDTransformer: global int64 IDs → slots [0, capacity) of a bounded table, batch by batch.

    t = IDTransformer(capacity=1_000_000, policy=EvictionPolicy("hybrid"), admit_threshold=2)
    out = t.transform(ids)          # ids: int64 tensor, any shape, CPU or CUDA
    out.slots                       # same shape; -1 where an ID was not admitted (yet)
    out.admitted_ids/_slots         # new residents: pull their rows (or initialise them)
    out.evicted_ids/_slots          # gone: push their rows before the slots are reused
    t.release(out.slots)            # with transform(..., pin=True): the batch is done

Every distinct ID of a batch gets its own slot in the same call; a batch with more
distinct IDs than the table holds is refused. When the table is full, a fraction of it
(policy.evict_fraction) is freed at once, lowest policy scores first (see policy.py),
never a slot the current batch uses or one pinned by a batch still in flight.

This version is written in vectorised torch ops (one implementation for CPU and CUDA);
its probe rounds compact the pending IDs, which costs a device sync per round on CUDA.
A compiled kernel for speed is the next step (issue 3's benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from idtransformer.admission import CountMinSketch
from idtransformer.hashing import xxh64
from idtransformer.policy import EvictionPolicy

EMPTY, DELETED = -1, -2
_MAP_SEED = 0x51_07


@dataclass
class TransformResult:
    slots: torch.Tensor
    admitted_ids: torch.Tensor
    admitted_slots: torch.Tensor
    evicted_ids: torch.Tensor
    evicted_slots: torch.Tensor
    rejected_ids: torch.Tensor  # seen, but below the admission threshold: no slot yet


def _lowest(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n lowest scores, ties going to the lowest index (so CPU and CUDA agree;
    topk's tie order differs between them). A k-th-value cut is O(capacity), a sort is not."""
    kth = torch.kthvalue(scores, n).values
    below = scores < kth
    at = scores == kth
    take_at = at & (torch.cumsum(at, 0) <= n - below.sum())
    return torch.nonzero(below | take_at).squeeze(1)


class SlotMap:
    """id → slot, open addressing with linear probing on two int64 tensors (keys, values)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = 1 << max(4, (size - 1).bit_length())
        self.mask = self.size - 1
        self.keys = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.values = torch.full((self.size,), EMPTY, dtype=torch.int64, device=device)

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return xxh64(ids, _MAP_SEED) & self.mask

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Position of each id in the map, or -1."""
        found = torch.full_like(ids, -1)
        pos = self._home(ids)
        pending = torch.arange(len(ids), device=ids.device)
        while pending.numel():
            p = pos[pending]
            v = self.values[p]
            hit = (v >= 0) & (self.keys[p] == ids[pending])
            found[pending[hit]] = p[hit]
            go_on = ~hit & (v != EMPTY)
            pending = pending[go_on]
            pos[pending] = (p[go_on] + 1) & self.mask
        return found

    def insert(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Add distinct ids that are not present."""
        pos = self._home(ids)
        pending = torch.arange(len(ids), device=ids.device)
        while pending.numel():
            p = pos[pending]
            free = self.values[p] < 0
            cand, cand_pos = pending[free], p[free]
            # several new ids may want one free position: the first in sorted order takes it
            sorted_pos, order = torch.sort(cand_pos, stable=True)
            first = torch.ones_like(sorted_pos, dtype=torch.bool)
            first[1:] = sorted_pos[1:] != sorted_pos[:-1]
            winner, at = cand[order[first]], sorted_pos[first]
            self.keys[at] = ids[winner]
            self.values[at] = values[winner]
            placed = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
            placed[winner] = True
            left = ~placed[pending]
            pending = pending[left]
            pos[pending] = (p[left] + 1) & self.mask

    def remove_at(self, positions: torch.Tensor) -> None:
        self.values[positions] = DELETED


class IDTransformer:
    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy = EvictionPolicy(),
        admit_threshold: int = 1,
        sketch_width: int = 1 << 20,
        sketch_depth: int = 4,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if admit_threshold < 1:
            raise ValueError(f"admit_threshold must be >= 1, got {admit_threshold}")
        self.capacity, self.policy, self.admit_threshold = capacity, policy, admit_threshold
        self.device = torch.device(device)
        dev = self.device
        self.map = SlotMap(2 * capacity, dev)  # at most half full of live IDs
        self.slot_id = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.occupied = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.last_access = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.freq = torch.zeros(capacity, dtype=torch.uint8, device=dev)
        self.pins = torch.zeros(capacity, dtype=torch.int32, device=dev)
        self.sketch = CountMinSketch(sketch_width, sketch_depth, dev) if admit_threshold > 1 else None
        self.generator = torch.Generator(device=dev).manual_seed(seed)
        self.step = 0
        self._tombstones = 0

    def __len__(self) -> int:
        return int(self.occupied.sum())

    # -- the batched call --------------------------------------------------------

    def transform(self, ids: torch.Tensor, pin: bool = False) -> TransformResult:
        if ids.dtype != torch.int64:
            raise TypeError(f"ids must be an int64 tensor, got {ids.dtype}")
        flat = ids.reshape(-1).to(self.device)
        uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        if len(uniq) > self.capacity:
            raise ValueError(
                f"batch has {len(uniq)} distinct IDs but the table holds {self.capacity}: "
                f"use a larger capacity or smaller batches"
            )
        step = self.step
        slots = self.slot_of_positions(self.map.find(uniq))
        hit = slots >= 0
        hit_slots = slots[hit]
        self.last_access[hit_slots] = step
        self.freq[hit_slots] = self.policy.bump(self.freq[hit_slots], counts[hit], self.generator)

        missing, missing_counts = uniq[~hit], counts[~hit]
        if self.sketch is not None and len(missing):
            admit = self.sketch.add(missing, missing_counts) >= self.admit_threshold
        else:
            admit = torch.ones_like(missing, dtype=torch.bool)
        new_ids = missing[admit]
        in_use = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        in_use[hit_slots] = True
        evicted_ids, evicted_slots = self._make_room(len(new_ids), in_use)

        free = torch.nonzero(~self.occupied).squeeze(1)[: len(new_ids)]
        self._rehash_if_needed(len(new_ids))
        self.map.insert(new_ids, free)
        self.slot_id[free] = new_ids
        self.occupied[free] = True
        self.last_access[free] = step
        self.freq[free] = self.policy.initial_freq

        missing_slots = torch.full_like(missing, -1)
        missing_slots[admit] = free
        slots[~hit] = missing_slots
        out = slots[inverse].reshape(ids.shape)
        if pin:
            held = slots[slots >= 0]
            self.pins[held] += 1
        self.step += 1
        return TransformResult(out, new_ids, free, evicted_ids, evicted_slots, missing[~admit])

    def slot_of_positions(self, positions: torch.Tensor) -> torch.Tensor:
        slots = torch.full_like(positions, -1)
        ok = positions >= 0
        slots[ok] = self.map.values[positions[ok]]
        return slots

    def release(self, slots: torch.Tensor) -> None:
        """Unpin the slots of a batch transformed with pin=True (its distinct slots once)."""
        held = torch.unique(slots.reshape(-1).to(self.device))
        held = held[held >= 0]
        if bool((self.pins[held] <= 0).any()):
            raise ValueError("release of slots that are not pinned (released twice?)")
        self.pins[held] -= 1

    def _make_room(self, need: int, in_use: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        free = self.capacity - int(self.occupied.sum())
        if need <= free:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, empty
        movable = self.occupied & ~in_use & (self.pins == 0)
        n_movable = int(movable.sum())
        short = need - free
        if n_movable < short:
            raise RuntimeError(
                f"no room: {need} new IDs, {free} free slots, and only {n_movable} slots that are "
                f"neither used by this batch nor pinned by one in flight (release finished batches)"
            )
        n = min(n_movable, max(short, int(self.policy.evict_fraction * self.capacity)))
        scores = self.policy.scores(self.last_access, self.freq, self.step)
        scores = torch.where(movable, scores, torch.iinfo(torch.int64).max)
        victims = _lowest(scores, n)
        evicted = self.slot_id[victims]
        self.map.remove_at(self.map.find(evicted))
        self._tombstones += n
        self.occupied[victims] = False
        return evicted, victims

    def _rehash_if_needed(self, incoming: int) -> None:
        # Tombstones lengthen probe chains; rebuild once live + dead fill 3/4 of the map.
        if int(self.occupied.sum()) + incoming + self._tombstones <= 3 * self.map.size // 4:
            return
        slots = torch.nonzero(self.occupied).squeeze(1)
        self.map = SlotMap(self.map.size, self.device)
        self.map.insert(self.slot_id[slots], slots)
        self._tombstones = 0

    def expire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Evict now every unpinned ID idle longer than policy.ttl_steps: (ids, slots)."""
        if self.policy.ttl_steps is None:
            raise ValueError("this transformer's policy has no ttl_steps")
        idle = self.step - self.last_access
        gone = self.occupied & (idle > self.policy.ttl_steps) & (self.pins == 0)
        victims = torch.nonzero(gone).squeeze(1)
        evicted = self.slot_id[victims]
        self.map.remove_at(self.map.find(evicted))
        self._tombstones += len(victims)
        self.occupied[victims] = False
        return evicted, victims

    # -- state -------------------------------------------------------------------

    def state_dict(self) -> dict:
        slots = torch.nonzero(self.occupied).squeeze(1)
        state = {
            "capacity": self.capacity,
            "step": self.step,
            "slots": slots.cpu(),
            "ids": self.slot_id[slots].cpu(),
            "last_access": self.last_access.cpu(),
            "freq": self.freq.cpu(),
            "pins": self.pins.cpu(),
            "generator": self.generator.get_state(),
        }
        if self.sketch is not None:
            state["sketch"] = self.sketch.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["capacity"] != self.capacity:
            raise ValueError(f"state is of a table of {state['capacity']} slots, this one has {self.capacity}")
        dev = self.device
        self.step = int(state["step"])
        self.occupied.zero_()
        slots, ids = state["slots"].to(dev), state["ids"].to(dev)
        self.occupied[slots] = True
        self.slot_id[slots] = ids
        self.last_access.copy_(state["last_access"].to(dev))
        self.freq.copy_(state["freq"].to(dev))
        self.pins.copy_(state["pins"].to(dev))
        self.generator.set_state(state["generator"])
        self.map = SlotMap(self.map.size, dev)
        self.map.insert(ids, slots)
        self._tombstones = 0
        if self.sketch is not None:
            self.sketch.load_state_dict(state["sketch"])
