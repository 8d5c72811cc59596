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

State per slot, one 16-byte record: the ID it holds (int64) and a `meta` word: last access
step (int32, -1 = free), log frequency counter (uint8), pin count (uint8), and 16 bits the
kernel uses within a call; `slot_id`, `last_access`, `freq` and `pins` are views of it.
Plus the id → slot map (slot_map.py), 16 bytes per slot: 32 bytes per slot in all.

Three backends (backend.py):
- "kernel" (CPU): a compiled kernel (csrc/slot_map.cpp) does a batch in two passes (lookup,
  then admit), in an exact global order (victims by lowest score then slot, the lowest free
  slots to the admitted in order of first sighting): the oracle.
- "torch" (any device): the same results, call by call, in bulk torch ops over a sorted map
  (on CUDA about a dozen host syncs per batch).
- "triton" (CUDA, the default there when triton imports): a set-associative map
  (bucket_map.py, bucket_tables.py): an ID's bucket of `bucket_size` slots comes from its hash,
  a full bucket evicts its lowest-score slot that no batch in flight pins, and every table of a
  rank shares one storage and one launch, with one device-to-host copy per call. Which slot an
  ID gets differs from the kernel's; an ID whose bucket has no slot that may go is left out for
  the batch (slot -1) instead of the batch being refused, so its transform never raises
  TooManyIDs, NoRoom or a full pin count, and `evict_fraction` has no meaning there.
bench/idtransformer_bench.py --device cuda measures them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from dynemb.idtransformer.admission import CountMinSketch
from dynemb.idtransformer.backend import BACKENDS, DEFAULT_BUCKET, check_triton_device, triton_available
from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.policy import DEFAULT_POLICY, EvictionPolicy
from dynemb.idtransformer.results import TransformResult
from dynemb.idtransformer.slot_map import COIN_SEED, MAP_SEED, KernelSlotMap, SortedSlotMap, coin, make_slot_map

if TYPE_CHECKING:
    from dynemb.idtransformer.bucket_tables import BucketTables

FREE = -1
_MAX_PINS = 255
_MAX_HITS = 0xFFFF  # the kernel counts a batch's sightings of an ID in 16 bits
_PINS_FULL = f"a slot is pinned by {_MAX_PINS} batches in flight, the most it can be (keep fewer in flight)"
_NOT_PINNED = "release of slots that are not pinned (released twice?)"


class Lookup(NamedTuple):
    """A batch's first pass (hits touched, the missing listed)."""

    slots: torch.Tensor  # a hit's slot; the k-th distinct missing ID (in order of first sighting): -(k + 2)
    new_ids: torch.Tensor  # the distinct missing IDs, k-th at k
    new_counts: torch.Tensor  # their sightings in the batch (int32)
    seen: torch.Tensor  # the distinct resident slots the batch uses
    hits: torch.Tensor  # sightings of resident IDs (0-dim)


class Admission(NamedTuple):
    """A batch's second pass (room made, the admitted placed, the placeholders replaced)."""

    admitted_ids: torch.Tensor
    admitted_slots: torch.Tensor
    evicted_ids: torch.Tensor
    evicted_slots: torch.Tensor
    distinct_slots: torch.Tensor  # every slot the batch uses: the seen, then the admitted
    pinned: bool  # whether the distinct slots were pinned here (the kernel does that with pin)


class TooManyIDs(ValueError):
    """A batch with more distinct IDs than the table has slots: it cannot be placed at all."""


class NoRoom(RuntimeError):
    """Not enough slots free or evictable for a batch's new IDs (the rest are in use or pinned)."""


def too_many_ids(distinct: int, capacity: int) -> TooManyIDs:
    """The TooManyIDs error for a batch of distinct IDs in a table of capacity slots."""
    return TooManyIDs(
        f"batch has {distinct} distinct IDs but the table holds {capacity}: use a larger capacity or smaller batches"
    )


def _no_room(need: int, free: int, movable: int) -> NoRoom:
    return NoRoom(
        f"no room: {need} new IDs, {free} free slots, and only {movable} slots that are "
        f"neither used by this batch nor pinned by one in flight (a larger table or fewer batches in flight make room)"
    )


def _lowest(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n lowest scores in ascending order, ties going to the lowest index (so
    CPU and CUDA agree; topk's tie order differs between them). On CPU a k-th-value cut (O(C));
    on CUDA a stable radix sort, about ten times faster there than kthvalue."""
    if scores.is_cuda:
        return torch.sort(torch.sort(scores, stable=True).indices[:n]).values
    kth = torch.kthvalue(scores, n).values
    below = scores < kth
    at = scores == kth
    take_at = at & (torch.cumsum(at, 0) <= n - below.sum())
    return torch.nonzero(below | take_at).squeeze(1)


class IDTransformer:
    """Global int64 IDs -> slots [0, capacity) of one bounded table, batch by batch.

    Args:
        capacity: slots in the table (the rows the device keeps).
        policy: which resident IDs leave first when new ones need room (LRU, LFU, hybrid, TTL).
        admit_threshold: sightings an ID needs before it gets a slot (1: at once); counted in a
            count-min sketch of `sketch_width` x `sketch_depth` counters.
        device: where the table's records live.
        backend: "auto" (the compiled kernel on CPU; on CUDA triton where it imports, else torch
            ops), "kernel", "triton" or "torch".
        bucket_size: triton only: slots a bucket, a power of two in [32, 1024] (tables
            transformed together need the same).

    Raises:
        ValueError: capacity or admit_threshold below 1; an unknown backend, or triton where it
            cannot run (not installed; CPU tensors without TRITON_INTERPRET=1).
    """

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy = DEFAULT_POLICY,
        admit_threshold: int = 1,
        sketch_width: int = 1 << 20,
        sketch_depth: int = 4,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        bucket_size: int = DEFAULT_BUCKET,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if admit_threshold < 1:
            raise ValueError(f"admit_threshold must be >= 1, got {admit_threshold}")
        self.capacity, self.policy, self.admit_threshold = capacity, policy, admit_threshold
        self.device = dev = torch.device(device)
        if backend == "auto":
            backend = "kernel" if dev.type == "cpu" else ("triton" if triton_available() else "torch")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {('auto',) + BACKENDS}")
        if backend == "triton":
            check_triton_device(dev)
        self.backend = backend
        self.bucket_size = bucket_size
        self.sketch = CountMinSketch(sketch_width, sketch_depth, dev) if admit_threshold > 1 else None
        self.step = 0
        self.resident = 0
        self._policy_settings: tuple | None = None  # (policy, the kernel's settings for it, where step and resident go)
        # one 16-byte record per slot: (id, meta); the rest are views of it (little-endian
        # meta: bytes 0-3 last access, 4 freq, 5 pins)
        self.space: BucketTables | None = None  # triton: the map its state lives in
        if backend == "triton":  # in a BucketTables of its own until it joins others'
            from dynemb.idtransformer.bucket_tables import BucketTables

            BucketTables([self])
            return
        if backend == "kernel":  # read at random: on 2 MiB pages (see the kernel's huge_empty)
            from dynemb.idtransformer.kernel import ops

            records = ops().huge_empty([capacity, 2], torch.int64).zero_()
        else:
            records = torch.zeros(capacity, 2, dtype=torch.int64, device=dev)
        records[:, 1] = 0xFFFFFFFF  # last access -1: free
        self.bind(records, make_slot_map(capacity, records, backend))

    def bind(self, records: torch.Tensor, slot_map: KernelSlotMap | SortedSlotMap) -> None:
        """Make records (capacity, 2) int64 and slot_map this table's state (kernel, torch)."""
        self.records = records
        self.slot_id = records[:, 0]
        self.meta = records[:, 1]
        self.last_access = records.view(torch.int32)[:, 2]
        self.freq = records.view(torch.uint8)[:, 12]
        self.pins = records.view(torch.uint8)[:, 13]
        self.map = slot_map

    def __len__(self) -> int:
        return self.resident

    @property
    def nbytes(self) -> int:
        """Bytes of per-slot state, map included (the admission sketch is fixed-size, apart)."""
        if self.space is not None:
            return self.capacity * self.space.map.nbytes // self.space.map.rows
        return self.records.numel() * 8 + self.map.nbytes

    # -- the batched call --------------------------------------------------------

    def transform(self, ids: torch.Tensor, pin: bool = False) -> TransformResult:
        """Map a batch of IDs to slots (see the module's docstring).

        Args:
            ids: the batch's IDs, any shape, any integer dtype (see ids.py).
            pin: every slot the batch uses gets one more pin, held until release().

        Returns:
            The slots (ids' shape; -1 for an ID not admitted yet), the IDs admitted (rows to
            pull) and evicted (rows to push) with their slots, those below the admission
            threshold, the hit count and the batch's distinct slots.

        Raises (refusals):
        - TooManyIDs (more distinct IDs than slots): nothing changed.
        - with pin, RuntimeError "a slot is pinned by 255 batches in flight" when a resident ID
          of the batch has a slot at 255 pins already: checked before anything else, so the
          call changes nothing (same map, counters, pins, admission sketch and step as before
          it; nothing admitted or evicted). Release finished batches and call again.
        - NoRoom (the new IDs do not fit beside the slots in use or pinned): nothing admitted
          or evicted, but the batch was seen (its resident IDs touched, the sketch counted
          it, the step advanced).
        """
        ids = as_int64_ids(ids)
        self._check_step()
        flat = ids.reshape(-1).to(self.device)
        if self.backend == "triton":  # one launch, one copy to the host
            from dynemb.idtransformer import bucket_tables

            out = bucket_tables.transform_one(self, flat.contiguous(), pin)
            out.slots = out.slots.reshape(ids.shape)
            return out
        if flat.numel() > self.capacity:  # only then can it hold too many distinct IDs
            distinct = torch.unique(flat).numel()
            if distinct > self.capacity:
                raise too_many_ids(distinct, self.capacity)
        # 1. Hits get their slot and a touch (last_access = step marks them in use); the k-th
        #    distinct missing ID (in order of first sighting) gets -(k + 2) for now. With pin,
        #    a hit whose slot is at 255 pins refuses the batch here, with nothing changed (the
        #    new IDs would start at 0 pins: only the hits can be full).
        looked = self._lookup(flat, pin)
        new_ids = looked.new_ids
        try:
            # 2. Admission (admit None: all admitted; the kernel needs no flags for that).
            if self.sketch is not None and len(new_ids):
                admit = self.sketch.add(new_ids, looked.new_counts) >= self.admit_threshold
            elif self.backend == "kernel":
                admit = None
            else:
                admit = torch.ones_like(new_ids, dtype=torch.bool)
            # 3. Room (eviction), slots for the admitted, placeholders replaced; with pin, the
            #    kernel also pins the batch's slots (checked in step 1: none is at 255).
            room = self._admit(looked.slots, new_ids, admit, looked.seen, pin)
            self.resident += len(room.admitted_ids) - len(room.evicted_ids)
            if pin and not room.pinned:
                self.pins[room.distinct_slots] += 1
        finally:
            # even a batch refused for want of room was seen: its resident IDs were touched
            self.step += 1
        return TransformResult(
            slots=looked.slots.reshape(ids.shape),
            admitted_ids=room.admitted_ids,
            admitted_slots=room.admitted_slots,
            evicted_ids=room.evicted_ids,
            evicted_slots=room.evicted_slots,
            rejected_ids=new_ids[:0] if admit is None else new_ids[~admit],
            hits=looked.hits,
            distinct_slots=room.distinct_slots,
        )

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each ID (ids' shape; -1: not resident), changing nothing: no admission,
        no touch, no pin, no step."""
        flat = as_int64_ids(ids).reshape(-1).to(self.device)
        if self.space is not None:
            found = self.space.map.find(self.space.index[id(self)], flat)
        else:
            found = self.map.find(flat).to(torch.int64)
        return found.reshape(ids.shape)

    def _check_step(self) -> None:
        if self.step >= (1 << 31) - 1:
            raise OverflowError("the transformer's step counter is at 2^31 - 1 (last_access is int32)")

    @property
    def kernel_map(self) -> KernelSlotMap:
        """The compiled kernel's map and ops (backend "kernel")."""
        if not isinstance(self.map, KernelSlotMap):
            raise RuntimeError(f"this transformer's backend is {self.backend!r}, not the kernel")
        return self.map

    @property
    def evict_min(self) -> int:
        """Slots freed at least when the table is short (policy.evict_fraction of it)."""
        return int(self.policy.evict_fraction * self.capacity)

    def kernel_settings(self) -> list[int]:
        """This table's settings (policy and state) as the kernel's ops take them."""
        if self._policy_settings is None or self._policy_settings[0] is not self.policy:
            # what the policy gives, found once: a trainer rank asks for 26 tables' a step
            p, k = self.policy, self.kernel_map.ops
            ttl = -1 if p.ttl_steps is None else p.ttl_steps
            values = k.settings(
                step=0,
                resident=0,
                kind=k.Kind[p.kind],
                initial_freq=p.initial_freq,
                decay_steps=p.decay_steps,
                ttl=ttl,
                evict_min=self.evict_min,
                map_seed=MAP_SEED,
                coin_seed=COIN_SEED,
            )
            at = k.settings_fields.index
            self._policy_settings = (p, values, at("step"), at("resident"))
        _, values, at_step, at_resident = self._policy_settings
        values = values.copy()
        values[at_step], values[at_resident] = self.step, self.resident
        return values

    def _lookup(self, flat: torch.Tensor, pin: bool) -> Lookup:
        """The batch's first pass; with pin, raises the pins-full error before changing anything
        when a hit's slot is at 255."""
        p = self.policy
        if self.backend == "kernel":
            k = self.kernel_map.ops
            out = k.lookup(self.kernel_map.entries, self.records, flat, self.kernel_settings(), p.log_factor, pin)
            if out.status == k.Status.pins_full:  # the kernel put back what it had touched
                raise RuntimeError(_PINS_FULL)
            return Lookup(out.slots, out.new_ids, out.new_counts, out.seen, out.hits)
        uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        slots = self.map.find(uniq)
        hit = slots >= 0
        s = slots[hit]
        if pin and bool((self.pins[s] == _MAX_PINS).any()):  # before any change
            raise RuntimeError(_PINS_FULL)
        if p.kind != "lru":
            f = self.freq[s]
            if p.kind == "hybrid":
                idle = self.step - self.last_access[s].to(torch.int64)
                f = (f.to(torch.int64) - idle // p.decay_steps).clamp(min=0).to(torch.uint8)
            self.freq[s] = p.bump(f, counts[hit].clamp(max=_MAX_HITS), coin(uniq[hit], self.step))
        self.last_access[s] = self.step
        seen = s.clone()
        # the missing in order of first sighting, as the kernel's single pass meets them
        n = flat.numel()
        first = torch.full_like(uniq, n).scatter_reduce_(0, inverse, torch.arange(n, device=flat.device), "amin")
        missing = torch.nonzero(~hit).squeeze(1)
        missing = missing[torch.argsort(first[missing])]
        kth = torch.empty_like(uniq)  # each missing ID's index among the new
        kth[missing] = torch.arange(len(missing), device=flat.device)
        slots = torch.where(hit, slots, -(kth + 2))[inverse]
        return Lookup(slots, uniq[missing], counts[missing].to(torch.int32), seen, (slots >= 0).sum())

    def _admit(
        self, slots: torch.Tensor, new_ids: torch.Tensor, admit: torch.Tensor | None, seen: torch.Tensor, pin: bool
    ) -> Admission:
        """The batch's second pass; raises NoRoom, or the pins-full error, with nothing changed."""
        p = self.policy
        if self.backend == "kernel":
            k, settings = self.kernel_map.ops, self.kernel_settings()
            out = k.admit(self.kernel_map.entries, self.records, slots, new_ids, admit, seen, settings, pin)
            if out.status == k.Status.no_room:
                need = len(new_ids) if admit is None else int(admit.sum())
                raise _no_room(need, self.capacity - self.resident, out.movable)
            if out.status == k.Status.pins_full:  # lookup with pin refuses such a batch first
                raise RuntimeError(_PINS_FULL)
            return Admission(
                out.admitted_ids, out.admitted_slots, out.evicted_ids, out.evicted_slots, out.distinct_slots, pin
            )
        # transform gives this path flags (None, all admitted, is the kernel's shorthand only)
        assert admit is not None, "the torch backend's admission needs its flags"
        admitted = new_ids[admit]
        evicted_ids, evicted_slots = self._make_room(len(admitted), self.evict_min)
        free = torch.nonzero(self.last_access == FREE).squeeze(1)[: len(admitted)]
        self.slot_id[free] = admitted
        self.map.insert(admitted, free)
        self.last_access[free] = self.step
        self.freq[free] = p.initial_freq
        new_slots = torch.full_like(new_ids, -1)
        new_slots.masked_scatter_(admit, free)  # (no host sync, unlike a boolean index_put)
        if len(new_ids):
            slots.copy_(torch.where(slots < 0, new_slots[(-(slots + 2)).clamp(min=0)], slots))
        return Admission(admitted, free, evicted_ids, evicted_slots, torch.cat([seen, free]), False)

    def _make_room(self, need: int, evict_min: int) -> tuple[torch.Tensor, torch.Tensor]:
        free = self.capacity - self.resident
        if need <= free:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, empty
        # not movable: free slots, slots this batch uses (touched at this step), pinned slots
        movable = (self.last_access != FREE) & (self.last_access != self.step) & (self.pins == 0)
        n_movable = int(movable.sum())
        short = need - free
        if n_movable < short:
            raise _no_room(need, free, n_movable)
        scores = self.policy.scores(self.last_access, self.freq, self.step)
        scores = torch.where(movable, scores, torch.iinfo(torch.int64).max)
        return self._evict(_lowest(scores, min(n_movable, max(short, evict_min))))

    def _evict(self, victims: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        evicted = self.slot_id[victims]
        self.map.erase(evicted, victims)
        self.last_access[victims] = FREE
        return evicted, victims

    def release_error(self, status: int) -> Exception | None:
        """What the kernel's release status means: None (released), or the error to raise."""
        k = self.kernel_map.ops
        if status == k.Status.not_pinned:
            return ValueError(_NOT_PINNED)
        if status == k.Status.slot_out_of_range:  # as the torch path's indexing would refuse it
            return IndexError(f"slot out of range for a table of {self.capacity} slots")
        return None

    def release(self, slots: torch.Tensor, distinct: bool = False) -> None:
        """Unpin the slots of a batch transformed with pin=True.

        Args:
            slots: its slots (each distinct one is released once), or its result's
                distinct_slots with distinct=True.

        Raises:
            ValueError: a slot is not pinned (released twice?).
            IndexError: a slot outside the table.
        """
        held = slots.reshape(-1).to(self.device)
        if not distinct:
            held = torch.unique(held)
            held = held[held >= 0]
        if self.backend == "kernel":
            error = self.release_error(self.kernel_map.ops.release(self.records, held))
            if error is not None:
                raise error
            return
        if self.backend == "triton":  # one copy
            from dynemb.idtransformer import bucket_tables

            error = bucket_tables.release_many([self], held, [held.numel()])[0]
            if error is not None:
                raise error
            return
        if bool((self.pins[held] == 0).any()):
            raise ValueError(_NOT_PINNED)
        self.pins[held] -= 1

    # -- state -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The step, the resident IDs with their slots, every slot's metadata and the sketch, on CPU."""
        slots = torch.nonzero(self.last_access != FREE).squeeze(1)
        state = {
            "capacity": self.capacity,
            "step": self.step,
            "slots": slots.cpu(),
            "ids": self.slot_id[slots].cpu(),
            "last_access": self.last_access.cpu().clone(),
            "freq": self.freq.cpu().clone(),
            "pins": self.pins.cpu().clone(),
        }
        if self.sketch is not None:
            state["sketch"] = self.sketch.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() of a table of the same capacity. On triton, a state of
        another layout (the kernel's, another bucket size) is placed anew: each ID in its
        bucket, those the policy ranks highest first where a bucket overflows (the rest left
        out); pins start at 0 there. Read `slot_id` for where each went.

        Raises:
            ValueError: another capacity, or a state that is inconsistent.
        """
        if state["capacity"] != self.capacity:
            raise ValueError(f"state is of a table of {state['capacity']} slots, this one has {self.capacity}")
        _check_state(state)
        dev = self.device
        slots, ids = state["slots"].to(dev), state["ids"].to(dev)
        if self.sketch is not None:
            self.sketch.load_state_dict(state["sketch"])
        if self.space is not None:
            last, freq = state["last_access"].to(dev), state["freq"].to(dev)
            self.space.load(self, ids, slots, last[slots], freq[slots], int(state["step"]))
            return
        self.step = int(state["step"])
        self.slot_id.zero_()
        self.slot_id[slots] = ids
        self.meta.zero_()
        self.last_access.copy_(state["last_access"].to(dev))
        self.freq.copy_(state["freq"].to(dev))
        self.pins.copy_(state["pins"].to(dev))
        self.resident = len(slots)
        self.map = make_slot_map(self.capacity, self.records, self.backend)
        self.map.insert(ids, slots)


def _check_state(state: dict) -> None:
    """A state the kernel can trust (its keys assume last access <= step, one ID per slot)."""
    capacity, step = int(state["capacity"]), int(state["step"])
    slots, ids, last = state["slots"].cpu(), state["ids"].cpu(), state["last_access"].cpu()
    if step < 0:
        raise ValueError(f"state's step is {step}, below 0")
    if slots.shape != ids.shape or slots.dim() != 1:
        raise ValueError(f"state has {tuple(slots.shape)} slots but {tuple(ids.shape)} ids")
    if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(f"state has slots outside [0, {capacity})")
    if len(torch.unique(slots)) != len(slots) or len(torch.unique(ids)) != len(ids):
        raise ValueError("state holds a slot or an ID twice")
    for key in ("last_access", "freq", "pins"):
        if state[key].shape != (capacity,):
            raise ValueError(f"state's {key} has shape {tuple(state[key].shape)}, not ({capacity},)")
    resident = last[slots] if len(slots) else last[:0]
    if len(slots) and (int(resident.min()) < 0 or int(resident.max()) > step):
        raise ValueError(f"state has a resident ID last accessed outside steps 0..{step}")
    free = torch.ones(capacity, dtype=torch.bool)
    free[slots] = False
    if bool((last[free] != FREE).any()):
        raise ValueError("state has a last access on a slot no ID holds")
