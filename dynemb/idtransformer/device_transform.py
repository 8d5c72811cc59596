"""The triton backend's batched pass: IDTransformer.transform with one device-to-host copy.

Every step works in tensors of a fixed shape (the batch's length n, or the capacity) with the
counts that size the outputs kept on the device (distinct IDs, hits, new, admitted, evicted,
rejected); a refusal found on the device (too many IDs, a slot at 255 pins, no room) zeroes
the counts and masks of the steps that would change something, so they run and change
nothing. At the end one small int64 tensor (the counts and a status) comes to the host
(`to_host`), which slices the outputs and raises a refusal. The map is triton_map.py's hash
table (a find, an erase, an insert: three kernel launches); the rest are torch ops that do
not wait for the device (sort, cumsum, scatter); triton_select.py picks the victims. The
host decides two things from what it already knows: whether eviction can be needed at all
(a batch of n IDs fits in the free slots: no scoring), and when to rebuild the map.

The touch and the log counter's bump stay torch ops beside the find kernel, not in it: the
pins check needs the whole batch's verdict before any slot is touched (a second launch
anyway), and policy.bump's float64 exp/log1p are torch's, the same ops the other backends
use, where a kernel's libdevice calls could round differently.

The results equal the other backends' call by call (the lowest free slots to the admitted
in order of first sighting, victims by lowest score then index): see transformer.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dynemb.idtransformer.device_select import compact
from dynemb.idtransformer.slot_map import coin
from dynemb.idtransformer.triton_select import lowest

if TYPE_CHECKING:
    from dynemb.idtransformer.transformer import IDTransformer, TransformResult

_FREE = -1
_MAX_PINS = 255
_MAX_HITS = 0xFFFF
_TOP = torch.iinfo(torch.int64).max
# what the one copy holds, in order
_FIELDS = ("status", "distinct", "seen", "new", "wanted", "admitted", "evicted", "rejected", "movable", "reused")
_OK, _TOO_MANY, _PINS_FULL, _NO_ROOM = range(4)


def to_host(counts: torch.Tensor) -> list[int]:
    """The pass's one device-to-host copy (the tests count its calls through this function)."""
    return counts.cpu().tolist()


def transform(t: IDTransformer, flat: torch.Tensor, pin: bool) -> TransformResult:
    """One batch through table t (flat: its IDs, 1-d int64 on t's device); see
    IDTransformer.transform for the results and refusals. Updates t.step and t.resident."""
    from dynemb.idtransformer import transformer as tf

    n, cap, step, p, dev = flat.numel(), t.capacity, t.step, t.policy, flat.device
    if n == 0:
        t.step += 1
        none, zero = flat[:0].clone(), torch.zeros((), dtype=torch.int64, device=dev)
        return tf.TransformResult(none, none, none, none, none, none, zero, none)
    m = t.triton_map
    m.rebuild_if_needed()
    last, freq, pins, slot_id = t.ext_views()  # each with a spare row at `cap`: masked writes go there
    arange = torch.arange(n, device=dev)

    # 1. the distinct IDs, ascending, at the front of n-long tensors
    ordered, order = torch.sort(flat, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = ordered[1:] != ordered[:-1]
    group = torch.cumsum(first, 0) - 1
    distinct = first.sum()
    inverse = torch.empty_like(group).scatter_(0, order, group)
    uniq = torch.zeros_like(flat).scatter_(0, group, ordered)
    counts = torch.zeros_like(flat).index_add_(0, group, torch.ones_like(flat))
    first_seen = torch.full_like(flat, n).scatter_reduce_(0, group, order, "amin")
    valid = arange < distinct

    # 2. find; with pin, a hit's slot at 255 pins refuses the batch before anything changes
    slots = m.find_upto(uniq, distinct)
    hit = slots >= 0
    too_many = distinct > cap
    pins_full = (hit & (pins[torch.where(hit, slots, cap)] == _MAX_PINS)).any() if pin else too_many & False
    looked = ~too_many & ~pins_full
    touch = torch.where(hit & looked, slots, cap)
    if p.kind != "lru":  # the log counter, bumped once per batch (policy.bump)
        f = freq[touch]
        if p.kind == "hybrid":
            idle = step - last[touch].to(torch.int64)
            f = (f.to(torch.int64) - idle // p.decay_steps).clamp(min=0).to(torch.uint8)
        freq[touch] = p.bump(f, counts.clamp(max=_MAX_HITS), coin(uniq, step))
    last.index_fill_(0, touch, step)  # a scalar set by index_put_ copies it from the host: a sync
    hits = (counts * hit).sum()
    n_seen = hit.sum()
    seen = compact(slots, hit, n)

    # 3. the missing IDs in order of first sighting; a placeholder -(k + 2) for the k-th
    missing = valid & ~hit
    n_new = missing.sum()
    by_sighting = torch.sort(torch.where(missing, first_seen, n), stable=True).indices
    kth = torch.empty_like(flat).scatter_(0, by_sighting, arange)
    new_ids, new_counts = uniq[by_sighting], counts[by_sighting]
    new = arange < n_new
    placed = torch.where(hit, slots, -(kth + 2))[inverse]

    # 4. admission (a refused batch counts nothing in the sketch)
    admit = new & looked
    if t.sketch is not None:
        sighted = torch.where(admit, new_counts, 0).to(torch.int32)
        admit &= t.sketch.add(new_ids, sighted) >= t.admit_threshold
    n_wanted = admit.sum()

    # 5. room: only a batch of more IDs than free slots can need it (known on the host)
    free_now = cap - t.resident
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    n_evict, n_movable, no_room = zero, zero, zero.bool()
    evicted_slots = evicted_ids = flat[:0]
    if n > free_now:
        live = last[:cap]
        movable = (live != _FREE) & (live != step) & (pins[:cap] == 0)
        n_movable = movable.sum()
        short = n_wanted - free_now
        no_room = (short > 0) & (n_movable < short)
        n_evict = torch.where((short > 0) & ~no_room, torch.minimum(n_movable, short.clamp(min=t.evict_min)), 0)
        scores = torch.where(movable, p.scores(live, freq[:cap], step), _TOP)
        victim = lowest(scores, n_evict)
        evicted_slots = compact(torch.arange(cap, device=dev), victim, cap)
        evicted_ids = slot_id[evicted_slots]
        m.erase_upto(evicted_slots, n_evict)
        live.masked_fill_(victim, _FREE)
    ok = looked & ~no_room
    n_admit = torch.where(ok, n_wanted, 0)
    admit &= ok

    # 6. the admitted take the lowest free slots, in order
    width = min(n, cap)
    free_slots = compact(torch.arange(cap, device=dev), last[:cap] == _FREE, cap)[:width]
    admitted_ids = compact(new_ids, admit, n)[:width]
    into = torch.where(torch.arange(width, device=dev) < n_admit, free_slots, cap)
    slot_id[into] = admitted_ids
    last.index_fill_(0, into, step)
    freq.index_fill_(0, into, p.initial_freq)
    reused = torch.zeros(1, dtype=torch.int64, device=dev)
    m.insert_upto(free_slots, n_admit, reused)
    rank = (torch.cumsum(admit, 0) - 1).clamp(0, width - 1)
    new_slots = torch.where(admit, free_slots[rank], -1)
    placed = torch.where(placed < 0, new_slots[(-(placed + 2)).clamp(min=0)], placed)
    if pin:
        pins[torch.where(hit & ok, slots, cap)] += 1
        pins[into] += 1
    rejected = new & ~admit
    n_rejected = rejected.sum()
    rejected_ids = compact(new_ids, rejected, n)

    # 7. the one copy, then the refusals and the outputs' sizes
    status = torch.where(too_many, _TOO_MANY, torch.where(pins_full, _PINS_FULL, torch.where(no_room, _NO_ROOM, _OK)))
    summary = torch.stack(
        [status, distinct, n_seen, n_new, n_wanted, n_admit, n_evict, n_rejected, n_movable, reused[0]]
    )
    c = dict(zip(_FIELDS, to_host(summary)))
    if c["status"] == _TOO_MANY:
        raise tf.too_many_ids(c["distinct"], cap)
    if c["status"] == _PINS_FULL:
        raise RuntimeError(tf._PINS_FULL)
    t.step += 1  # even a batch refused for want of room was seen
    if c["status"] == _NO_ROOM:
        raise tf._no_room(c["wanted"], free_now, c["movable"])
    a, e = c["admitted"], c["evicted"]
    t.resident += a - e
    m.tombs += e - c["reused"]
    return tf.TransformResult(
        slots=placed,
        admitted_ids=admitted_ids[:a],
        admitted_slots=free_slots[:a],
        evicted_ids=evicted_ids[:e],
        evicted_slots=evicted_slots[:e],
        rejected_ids=rejected_ids[: c["rejected"]],
        hits=hits,
        distinct_slots=torch.cat([seen[: c["seen"]], free_slots[:a]]),
    )
