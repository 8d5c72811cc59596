"""The triton backend: IDTransformers whose state lives in one BucketSlotMap (bucket_map.py),
so that a batch of all of a rank's tables is one launch and one host copy.

    space = BucketTables.of(tables)               # joins them (copying their rows) unless they share one
    many = transform_many(tables, ids, sizes, pin=True, bases=row_offsets)   # a ManyResult
    errors = release_many(tables, distinct_slots, counts)

A table's `slot_id`, `last_access`, `freq` and `pins` are views of its rows in the space's
map, and its admission sketch's counters a view of the map's, so the single-table API
(state_dict, the row store's checks) reads them as before. A table belongs to one space at a
time; joining another copies its rows there, where they keep their slots (a table's layout
depends on its capacity and the bucket size only), and the old space keeps a stale copy no one
uses. Every table of a space has the same bucket size.

The contract is the map's, not the CPU kernel's: an ID that finds no way in its bucket is
refused for the batch (slot -1, counted as dropped) rather than the batch refused, so no call
here raises TooManyIDs, NoRoom or a full pin count; evict_fraction has no meaning.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from dynemb.idtransformer import bucket_map
from dynemb.idtransformer.bucket_map import F_FAULTS, F_RESIDENT, BucketSlotMap, TableSpec
from dynemb.idtransformer.results import ManyResult

if TYPE_CHECKING:
    from dynemb.idtransformer.results import TransformResult
    from dynemb.idtransformer.transformer import IDTransformer

log = logging.getLogger("dynemb.idtransformer")
_NOT_PINNED = "release of slots that are not pinned (released twice?)"


class BucketTables:
    """One BucketSlotMap for triton tables (see the module doc).

    Args:
        tables: IDTransformers on the triton backend, on one device, each once, all of one
            bucket size; in this order in the map.
    """

    def __init__(self, tables: list[IDTransformer]) -> None:
        if not tables:
            raise ValueError("BucketTables needs at least one table")
        if len({id(t) for t in tables}) != len(tables):
            raise ValueError("a table is listed twice")
        if len({t.device for t in tables}) != 1 or any(t.backend != "triton" for t in tables):
            raise ValueError("BucketTables holds triton tables on one device")
        sizes = {t.bucket_size for t in tables}
        if len(sizes) != 1:
            raise ValueError(f"tables of one batch need one bucket size, not {sorted(sizes)}")
        self.tables = list(tables)
        self.device = tables[0].device
        specs = [
            TableSpec(
                t.capacity,
                t.policy,
                t.admit_threshold,
                t.sketch.width if t.sketch else 1 << 20,
                t.sketch.depth if t.sketch else 4,
            )
            for t in tables
        ]
        self.map = BucketSlotMap(specs, bucket_size=sizes.pop(), device=self.device)
        self.index = {id(t): k for k, t in enumerate(tables)}
        # per table, the release faults already reported (raised by a checked release, or logged)
        self.faults_seen = [0] * len(tables)
        for k, t in enumerate(tables):
            self._move_in(k, t)

    @staticmethod
    def of(tables: list[IDTransformer]) -> BucketTables:
        """The space all the tables are in, in this order (others of it may be left out), or a
        new one that they join."""
        space = tables[0].space if tables else None
        if isinstance(space, BucketTables) and all(t.space is space for t in tables):
            at = [space.index[id(t)] for t in tables]
            if at == sorted(at) and len(set(at)) == len(at):
                return space
        return BucketTables(tables)

    def _move_in(self, k: int, t: IDTransformer) -> None:
        """Copy t's rows, step, residents and sketch here (if it has any yet) and make its views
        point here."""
        m, rows = self.map, self.map.region(k)
        old = t.space
        if old is not None:
            m.keys[rows].copy_(t.slot_id)
            m.last_access[rows].copy_(t.last_access)
            m.freq[rows].copy_(t.freq)
            m.pins[rows].copy_(t.pins)
            m.steps[k] = t.step
            m._counts[k, F_RESIDENT] = t.resident
        sketch = m.sketches[k]
        if t.sketch is not None and sketch is not None:
            sketch.counts.copy_(t.sketch.counts)
            t.sketch.counts = sketch.counts
        t.space = self
        t.slot_id, t.last_access, t.freq, t.pins = m.keys[rows], m.last_access[rows], m.freq[rows], m.pins[rows]

    def load(
        self,
        t: IDTransformer,
        ids: torch.Tensor,
        slots: torch.Tensor,
        last: torch.Tensor,
        freq: torch.Tensor,
        step: int,
    ) -> int:
        """Table t holds these IDs, at these slots where they fit this layout, else placed
        anew (BucketSlotMap.load_table); returns how many it holds."""
        placed = self.map.load_table(self.index[id(t)], ids, last, freq, step, slots)
        t.step, t.resident = step, placed
        return placed


def transform_many(
    tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool, bases: list[int]
) -> ManyResult:
    """Every table's block of ids (sizes[t] of table t's, end to end) in one launch; see
    many.transform_many for the result (no table's error: IDs that do not fit are dropped,
    slot -1). The tables join one BucketTables if they have none."""
    space = BucketTables.of(tables)
    m, n_map = space.map, len(space.tables)
    at = [space.index[id(t)] for t in tables]
    map_sizes, map_bases, in_call = [0] * n_map, [0] * n_map, [False] * n_map
    for k, n, base in zip(at, sizes, bases):
        map_sizes[k], map_bases[k], in_call[k] = n, base, True
    for t in tables:
        m.steps[space.index[id(t)]] = t.step  # (a load_state_dict may have set it)
    found = m.find_or_insert(ids.to(space.device), map_sizes, pin, map_bases, in_call)
    _log_new_faults(space, found.faults)
    for t, k in zip(tables, at):
        t.step = m.steps[k]
        t.resident += found.per_table[k].admitted - found.per_table[k].evicted
    mine = [found.per_table[k] for k in at]
    admitted, evicted, rejected = found.admitted, found.evicted, found.rejected
    flat = {
        "admitted_ids": admitted.ids,
        "admitted_slots": admitted.slots,
        "evicted_ids": evicted.ids,
        "evicted_slots": evicted.slots,
        "distinct_slots": found.distinct_slots,
        "rejected_ids": rejected.ids,
    }
    counts = {
        "admitted_ids": [c.admitted for c in mine],
        "admitted_slots": [c.admitted for c in mine],
        "evicted_ids": [c.evicted for c in mine],
        "evicted_slots": [c.evicted for c in mine],
        "distinct_slots": [c.distinct for c in mine],
        "rejected_ids": [c.rejected for c in mine],
    }
    errors: list[Exception | None] = [None] * len(tables)
    hits = [c.hits for c in mine]
    dropped = [c.dropped for c in mine]
    return ManyResult(found.slots, None, errors, flat, counts, list(sizes), hits, dropped)


def _log_new_faults(space: BucketTables, faults: list[int]) -> None:
    """Log the release faults that unchecked releases made since the last batch (a caller that
    releases a batch twice, or slots it was not given)."""
    for k, (total, seen) in enumerate(zip(faults, space.faults_seen)):
        if total > seen:
            log.error(
                "%d slots of table %d (capacity %d) were released but not pinned (released twice?)",
                total - seen,
                k,
                space.tables[k].capacity,
            )
            space.faults_seen[k] = total


def transform_one(t: IDTransformer, flat: torch.Tensor, pin: bool) -> TransformResult:
    """One batch through table t (flat: its IDs, 1-d int64 on t's device)."""
    out = transform_many([t], flat, [flat.numel()], pin, [0]).results[0]
    assert out is not None
    return out


def release_many(
    tables: list[IDTransformer], distinct_slots: torch.Tensor, counts: list[int], check: bool = True
) -> list[Exception | None]:
    """Unpin every table's distinct slots (table after table, counts[t] of table t's, the
    table's own slots; -1 entries, a batch's IDs that got no slot, skipped).

    Args:
        check: find each table's error now, with one host copy for all: IndexError for a slot
            outside it (its slots are then left pinned), ValueError for a slot that was not
            pinned (released twice?; the table's others are released). Without it, no copy:
            slots outside their table are skipped, and the faults are counted on the device
            and logged with the next batch's copy (what a training step does: one copy a step).

    Returns:
        Per table, its error or None.
    """
    space = BucketTables.of(tables)
    m, n = space.map, distinct_slots.numel()
    if n == 0:
        return [None] * len(tables)
    host = m._to_device([space.index[id(t)] for t in tables] + list(counts))  # one copy to the device
    tab = torch.repeat_interleave(host[: len(tables)], host[len(tables) :], output_size=n)
    slots = distinct_slots.to(space.device, torch.int64)
    outside = slots >= m._capacity[tab]
    bad = torch.zeros(len(m.tables), dtype=torch.int64, device=space.device).index_add_(0, tab, outside.to(torch.int64))
    live = (slots >= 0) & (bad[tab] == 0)
    rows = torch.where(live, m._first_row[tab] + slots, -1)
    faults = m._counts[:, F_FAULTS]
    before = faults.clone() if check else None
    m.release(rows)
    if before is None:
        return [None] * len(tables)
    got = bucket_map.to_host(torch.stack([bad, faults[: len(m.tables)] - before[: len(m.tables)]]))  # the one copy
    outside_n, faults_n = got[: len(m.tables)], got[len(m.tables) :]
    space.faults_seen = [seen + new for seen, new in zip(space.faults_seen, faults_n)]
    errors: list[Exception | None] = []
    for t in tables:
        k = space.index[id(t)]
        if outside_n[k]:
            errors.append(IndexError(f"slot out of range for a table of {t.capacity} slots"))
        elif faults_n[k]:
            errors.append(ValueError(_NOT_PINNED))
        else:
            errors.append(None)
    return errors
