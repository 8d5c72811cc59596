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
triton tables take one launch and one host copy for them all, whatever their number
(bucket_tables.py); the rest (the torch backend, kernel tables with an
admission threshold) go one by one through transform.

    errors = release_many(tables, [out.distinct_slots for out in out.results])   # when done
"""

from __future__ import annotations

import torch

from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.results import ManyResult
from dynemb.idtransformer.transformer import _PINS_FULL, IDTransformer, _no_room, too_many_ids


def transform_many(
    tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool = False, bases: list[int] | None = None
) -> ManyResult:
    """Transform every table's block of IDs (see the module).

    Args: tables; ids: their blocks end to end, sizes[t] of table t's; pin: pin every slot the
    blocks use; bases: per table, added to the slots handed out (default 0).
    Returns: the ManyResult (slots, per table the result or the error)."""
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
    device = [t.backend == "triton" for t in tables]
    if all(device) and len({t.device for t in tables}) == 1:
        return _device_many(tables, ids, sizes, pin, bases)
    # mixed: the kernel's tables still in one call, the triton ones in one pass, the rest one by
    # one; the results put back in order
    blocks = torch.split(ids, sizes)
    together: dict[int, tuple] = {}
    for pick, run in (
        ([i for i, f in enumerate(fast) if f], _kernel_many),
        ([i for i, d in enumerate(device) if d], _device_many),
    ):
        if not pick:
            continue
        many = run(
            [tables[i] for i in pick],
            torch.cat([blocks[i] for i in pick]),
            [sizes[i] for i in pick],
            pin,
            [bases[i] for i in pick],
        )
        together.update(zip(pick, zip(torch.split(many.slots, [sizes[i] for i in pick]), many.results, many.errors)))
    parts, results, errors = [], [], []
    for i, (t, block, base) in enumerate(zip(tables, blocks, bases)):
        slots, out, error = together[i] if i in together else _one(t, block, pin, base)
        parts.append(slots)
        results.append(out)
        errors.append(error)
    return ManyResult(torch.cat(parts) if parts else ids[:0], results, errors)


def _on_kernel(t: IDTransformer) -> bool:
    return t.backend == "kernel" and t.sketch is None


def _device_many(
    tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool, bases: list[int]
) -> ManyResult:
    from dynemb.idtransformer import bucket_tables

    return bucket_tables.transform_many(tables, ids.to(tables[0].device), sizes, pin, bases)


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


def _kernel_many(
    tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool, bases: list[int]
) -> ManyResult:
    if not tables:
        return ManyResult(ids[:0], [], [])
    k = tables[0].kernel_map.ops
    out = k.transform_many(
        [t.kernel_map.entries for t in tables],
        [t.records for t in tables],
        ids,
        sizes,
        bases,
        [x for t in tables for x in t.kernel_settings()],
        [t.policy.log_factor for t in tables],
        pin,
    )
    info = [k.Info(*row) for row in out.info.tolist()]
    errors: list[Exception | None] = []
    for t, row in zip(tables, info):
        error: Exception | None = None
        if row.status == k.Status.too_many:  # refused before anything was done: no step taken
            error = too_many_ids(row.distinct_ids, t.capacity)
        elif row.status == k.Status.pins_full:  # a slot at 255 pins: refused before anything was done
            error = RuntimeError(_PINS_FULL)
        else:
            t.step += 1  # a batch refused for want of room was still seen
            if row.status == k.Status.no_room:  # nothing admitted
                error = _no_room(row.new_ids, t.capacity - t.resident, row.movable)
            else:
                t.resident += row.admitted - row.evicted
        errors.append(error)
    # a failed table has none of these (its counts are 0), and its result is None
    flat = {f: getattr(out, f) for f in ManyResult.FIELDS}
    per_table = {
        "admitted_ids": "admitted",
        "admitted_slots": "admitted",
        "evicted_ids": "evicted",
        "evicted_slots": "evicted",
        "distinct_slots": "distinct_slots",
    }
    counts = {f: [getattr(row, per_table[f]) for row in info] for f in ManyResult.FIELDS}
    hits = [0 if e is not None else row.hits for row, e in zip(info, errors)]
    return ManyResult(out.slots, None, errors, flat, counts, list(sizes), hits)


def release_many_flat(
    tables: list[IDTransformer], distinct_slots: torch.Tensor, counts: list[int], check: bool = True
) -> list[Exception | None]:
    """release_many with every table's distinct slots in one tensor, table after table
    (counts[t] of table t's, as ManyResult.flat has them): one kernel call (or one triton
    launch), nothing to cut or join. Every table must be on the kernel, or every one on triton.
    check=False (triton only): no host copy, the errors are logged with the next batch's copy
    instead (bucket_tables.release_many)."""
    if tables and all(t.backend == "triton" for t in tables):
        from dynemb.idtransformer import bucket_tables

        return bucket_tables.release_many(tables, distinct_slots, counts, check)
    status = tables[0].kernel_map.ops.release_many([t.records for t in tables], distinct_slots, counts).tolist()
    return [t.release_error(s) for t, s in zip(tables, status)]


def release_many(tables: list[IDTransformer], distinct_slots: list[torch.Tensor]) -> list[Exception | None]:
    """tables[t].release(distinct_slots[t], distinct=True) for every table, those on the kernel
    in one call; each table all or none. Returns each table's error (not pinned: released
    twice?), the other tables released all the same."""
    errors: list[Exception | None] = [None] * len(tables)
    for backend in ("kernel", "triton"):
        fast = [k for k, t in enumerate(tables) if t.backend == backend]
        if fast:
            held = [distinct_slots[k].to(tables[k].device) for k in fast]
            errors_fast = release_many_flat([tables[k] for k in fast], torch.cat(held), [h.shape[0] for h in held])
            for k, error in zip(fast, errors_fast):
                errors[k] = error
    for k, t in enumerate(tables):
        if t.backend not in ("kernel", "triton"):
            try:
                t.release(distinct_slots[k], distinct=True)
            except (ValueError, IndexError) as e:
                errors[k] = e
    return errors
