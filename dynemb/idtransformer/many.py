"""Many tables' batches in one call: what a trainer rank does to all its tables at a step.

    out = transform_many(tables, ids, sizes, pin=True, bases=row_offsets)
    out.slots        # every block's slots in the layout of ids, plus its table's base
    out.results[t]   # table t's TransformResult (slots, admitted and evicted slots + base)
    out.errors[t]    # what table t's transform raised (too many IDs, no room, pins full)

Table t's IDs are the block of `ids` after those of tables 0..t-1 (sizes[t] of them). Each
table's result is what `tables[t].transform(block, pin)` gives, its slots, admitted and
evicted slots moved up by bases[t] (distinct_slots stay the table's own: release takes them).
A table that fails has its error returned, not raised, and results[t] None (its block's slots
undefined); the other tables are transformed all the same: a sharded owner has to answer every
rank whatever happens (sharded.py). The step counter's overflow is raised, before any table
changes.

Tables on the compiled kernel without an admission sketch take one kernel call for them all
(csrc/slot_map.cpp transform_many: lookup and admit, table after table, no Python between);
the rest (the torch backend, an admission threshold) go one by one through transform.

    errors = release_many(tables, [out.distinct_slots for out in out.results])   # when done
"""

from __future__ import annotations

import torch

from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.slot_map import COIN_SEED, MAP_SEED
from dynemb.idtransformer.transformer import (_KIND_CODE, _NOT_PINNED, _PIN_REFUSED, _PINS_FULL, IDTransformer,
                                       TransformResult, _no_room, too_many_ids)

_TOO_MANY = -3  # transform_many's status for a block with more distinct IDs than the table has slots


class ManyResult:
    """slots: every block's slots, in the layout of the IDs; errors: per table, what its
    transform raised, or None. Per table, results[t]: its TransformResult, or None where it
    failed. From the kernel the tables' admitted and evicted IDs and slots and distinct slots
    come as one tensor each, table after table (`flat`, with `counts`: per table, how many of
    each), and the per-table results are cut from them only when first asked for: a caller that
    handles all tables at once (the trainer's row moves, release_many) takes them whole."""

    FIELDS = ("admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots", "distinct_slots")

    def __init__(self, slots: torch.Tensor, results: list[TransformResult | None] | None,
                 errors: list[Exception | None], flat: dict[str, torch.Tensor] | None = None,
                 counts: dict[str, list[int]] | None = None, sizes: list[int] | None = None,
                 hits: list[int] | None = None) -> None:
        self.slots, self.errors = slots, errors
        self._results = results
        self.flat, self.counts = flat, counts
        self.sizes, self.hits = sizes, hits  # with flat: per table, IDs looked up and hits (0 if failed)

    @property
    def results(self) -> list[TransformResult | None]:
        if self._results is None:
            sizes, hits = self.sizes, self.hits
            parts = {f: torch.split(self.flat[f], self.counts[f]) for f in self.FIELDS}
            no_ids = self.slots[:0]
            self._results = [
                None if e is not None else TransformResult(
                    slots, parts["admitted_ids"][k], parts["admitted_slots"][k], parts["evicted_ids"][k],
                    parts["evicted_slots"][k], no_ids, hits[k], parts["distinct_slots"][k])
                for k, (slots, e) in enumerate(zip(torch.split(self.slots, sizes), self.errors))]
        return self._results

    @property
    def error(self) -> Exception | None:
        """The first table's error, if any failed."""
        return next((e for e in self.errors if e is not None), None)


def transform_many(tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool = False,
                   bases: list[int] | None = None) -> ManyResult:
    if len(sizes) != len(tables):
        raise ValueError(f"{len(tables)} tables but {len(sizes)} block sizes")
    ids = as_int64_ids(ids).reshape(-1)
    if sum(sizes) != ids.numel():
        raise ValueError(f"the block sizes add up to {sum(sizes)}, not to the {ids.numel()} IDs")
    bases = bases if bases is not None else [0] * len(tables)
    for t in tables:
        t._check_step()
    fast = [_on_kernel(t) for t in tables]
    if all(fast):
        return _kernel_many(tables, ids.to(tables[0].device) if tables else ids, sizes, pin, bases)
    # some one by one: the kernel's tables still in one call, the results put back in order
    blocks = torch.split(ids, sizes)
    pick = [i for i, f in enumerate(fast) if f]
    many = _kernel_many([tables[i] for i in pick], torch.cat([blocks[i] for i in pick]) if pick else ids[:0],
                        [sizes[i] for i in pick], pin, [bases[i] for i in pick])
    from_kernel = dict(zip(pick, zip(torch.split(many.slots, [sizes[i] for i in pick]), many.results, many.errors)))
    parts, results, errors = [], [], []
    for i, (t, block, base) in enumerate(zip(tables, blocks, bases)):
        slots, out, error = from_kernel[i] if fast[i] else _one(t, block, pin, base)
        parts.append(slots)
        results.append(out)
        errors.append(error)
    return ManyResult(torch.cat(parts) if parts else ids[:0], results, errors)


def _on_kernel(t: IDTransformer) -> bool:
    return t.backend == "kernel" and t.sketch is None


def _one(t: IDTransformer, block: torch.Tensor, pin: bool, base: int):
    """(slots + base, result, error) of one table's transform."""
    try:
        out = t.transform(block, pin=pin)
    except (ValueError, RuntimeError) as e:
        return torch.full_like(block, -2), None, e
    if base:
        out.slots = torch.where(out.slots >= 0, out.slots + base, out.slots)
        out.admitted_slots = out.admitted_slots + base
        out.evicted_slots = out.evicted_slots + base
    return out.slots, out, None


def _policy_params(t: IDTransformer) -> tuple:
    """The kernel's per-table constants, in transform_many's params order from kInitialFreq on
    (the arguments transformer._lookup and _admit give lookup and admit)."""
    p = t.policy
    return (p.initial_freq, p.decay_steps if p.kind == "hybrid" else 0, _KIND_CODE[p.kind],
            -1 if p.ttl_steps is None else p.ttl_steps, p.decay_steps, int(p.evict_fraction * t.capacity))


def _kernel_many(tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool,
                 bases: list[int]) -> ManyResult:
    if not tables:
        return ManyResult(ids[:0], [], [])
    params: list[int] = []
    for t, n, base in zip(tables, sizes, bases):
        params += (n, t.step, t.resident, base, *_policy_params(t))
    log_factors = [-1.0 if t.policy.kind == "lru" else t.policy.log_factor for t in tables]
    slots, admitted, admitted_slots, evicted, evicted_slots, distinct, info = tables[0].map.ops.transform_many(
        [t.map.entries for t in tables], [t.records for t in tables], ids, params, log_factors, pin,
        MAP_SEED, COIN_SEED)
    info = info.tolist()  # per table: status, hits, admitted, evicted, distinct, extra
    errors: list[Exception | None] = []
    for t, (status, _, n_admitted, n_evicted, _, extra) in zip(tables, info):
        error = None
        if status == _TOO_MANY:  # refused before anything was done: no step taken
            error = too_many_ids(extra, t.capacity)
        elif status == _PIN_REFUSED:  # a slot at 255 pins: refused before anything was done
            error = RuntimeError(_PINS_FULL)
        else:
            t.step += 1  # a batch refused for want of room was still seen
            if status >= 0:  # no room, nothing admitted
                error = _no_room(extra, t.capacity - t.resident, status)
            else:
                t.resident += n_admitted - n_evicted
        errors.append(error)
    # a failed table has none of these (its counts are 0), and its result is None
    columns = list(zip(*info))
    flat = dict(zip(ManyResult.FIELDS, (admitted, admitted_slots, evicted, evicted_slots, distinct)))
    counts = dict(zip(ManyResult.FIELDS, (columns[2], columns[2], columns[3], columns[3], columns[4])))
    hits = [0 if e is not None else h for h, e in zip(columns[1], errors)]
    return ManyResult(slots, None, errors, flat, counts, list(sizes), hits)


def release_many_flat(tables: list[IDTransformer], distinct_slots: torch.Tensor,
                      counts: list[int]) -> list[Exception | None]:
    """release_many with every table's distinct slots in one tensor, table after table
    (counts[t] of table t's, as ManyResult.flat has them): one kernel call, nothing to cut or
    join. Every table must be on the kernel."""
    status = tables[0].map.ops.pin_many([t.records for t in tables], distinct_slots, counts, -1).tolist()
    return [t._pin_error(s, ValueError(_NOT_PINNED)) for t, s in zip(tables, status)]


def release_many(tables: list[IDTransformer], distinct_slots: list[torch.Tensor]) -> list[Exception | None]:
    """tables[t].release(distinct_slots[t], distinct=True) for every table, those on the kernel
    in one call; each table all or none. Returns each table's error (not pinned: released
    twice?), the other tables released all the same."""
    errors: list[Exception | None] = [None] * len(tables)
    fast = [k for k, t in enumerate(tables) if t.backend == "kernel"]
    if fast:
        held = [distinct_slots[k] for k in fast]
        status = tables[fast[0]].map.ops.pin_many([tables[k].records for k in fast], torch.cat(held),
                                                  [h.shape[0] for h in held], -1).tolist()
        for k, s in zip(fast, status):
            errors[k] = tables[k]._pin_error(s, ValueError(_NOT_PINNED))
    for k, t in enumerate(tables):
        if t.backend != "kernel":
            try:
                t.release(distinct_slots[k], distinct=True)
            except (ValueError, IndexError) as e:
                errors[k] = e
    return errors
