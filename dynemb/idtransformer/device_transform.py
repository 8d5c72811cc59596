"""The triton backend's batched pass: every table of a batch in one pass, with one
device-to-host copy for all of them.

    many = transform_many(tables, ids, sizes, pin=True, bases=row_offsets)   # a ManyResult
    out = transform_one(table, ids, pin=True)                               # one table's

The tables share one DeviceTables (device_tables.py; they join one on their first call), so
each step is one launch (or a few torch ops) for all of them, whatever their number: the lanes
carry their table, and per-table settings (policy, step, free slots, capacity, the map's and
records' places) are rows of one small int64 matrix, copied to the device once a call (from
pinned memory, not waited for). Every step works in tensors of a fixed shape (the batch's
length n, the rows, or bounds the host knows) with the counts that size the outputs kept on the
device, per table; a refusal found on the device (too many IDs, a slot at 255 pins, no room)
zeroes that table's counts and masks, so its steps run and change nothing. At the end one small
int64 matrix (per table: its counts and a status) comes to the host (`to_host`), which slices
the outputs, table after table, and turns a table's status into its error. The host decides
from what it already knows whether a table can need eviction at all (a block of n IDs fits in
its free slots: no scoring) and when to rebuild a table's map.

The map is triton_map.py's hash tables (a find, an erase, an insert: one launch each for all
tables); triton_select.py scans the rows (scores, victims, free rows). The touch and the log
counter's bump stay torch ops beside the find kernel, not in it: the pins check needs the whole
batch's verdict before any slot is touched (a second launch anyway), and policy.bump's float64
exp/log1p are torch's, the same ops the other backends use, where a kernel's libdevice calls
could round differently.

The results equal the other backends' call by call, table by table (the lowest free slots to
the admitted in order of first sighting, victims by lowest score then slot): see
transformer.py. A lane's table: `tab` for the call's index, the matrix's row.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch

from dynemb.idtransformer import triton_select as ts
from dynemb.idtransformer.admission import MAX_COUNT
from dynemb.idtransformer.device_select import compact
from dynemb.idtransformer.device_tables import DeviceTables
from dynemb.idtransformer.many import ManyResult
from dynemb.idtransformer.policy import bump_with
from dynemb.idtransformer.slot_map import coin
from dynemb.idtransformer.triton_map import erase_many, find_many, insert_many

if TYPE_CHECKING:
    from dynemb.idtransformer.transformer import IDTransformer, TransformResult

_FREE = -1
_MAX_PINS = 255
_MAX_HITS = 0xFFFF
# what the one copy holds per table, in order
_FIELDS = (
    "status", "distinct", "seen", "new", "wanted", "admitted", "evicted", "rejected", "movable", "reused", "hits",
    "dropped",
)  # fmt: skip
_OK, _TOO_MANY, _PINS_FULL, _NO_ROOM = range(4)


def to_host(counts: torch.Tensor) -> list[list[int]]:
    """The pass's one device-to-host copy (the tests count its calls through this function)."""
    return counts.cpu().tolist()


def _params(space: DeviceTables, tables: list[IDTransformer], sizes: list[int], bases: list[int]) -> torch.Tensor:
    """The call's per-table settings (triton_select's columns) and, after them, each space
    table's index in the call (-1 if none): one int64 tensor, copied to the device once."""
    rows = []
    for t, n, base in zip(tables, sizes, bases):
        p = t.policy
        k = space.index[id(t)]
        start, size, first = space.geometry_rows[k]
        sketch_at, bits, depth = space.sketch_rows[k]
        free = t.capacity - t.resident
        row = [0] * ts.PARAMS
        row[ts.MAP_START], row[ts.MAP_SIZE], row[ts.FIRST], row[ts.CAP] = start, size, first, t.capacity
        row[ts.STEP], row[ts.NEED], row[ts.KIND] = t.step, int(n > free), ts.KINDS.index(p.kind)
        row[ts.DECAY], row[ts.TTL] = p.decay_steps, -1 if p.ttl_steps is None else p.ttl_steps
        row[ts.INIT_FREQ], row[ts.EVICT_MIN], row[ts.FREE_NOW] = p.initial_freq, t.evict_min, free
        row[ts.LOG_FACTOR] = struct.unpack("<q", struct.pack("<d", p.log_factor))[0]  # its float64 bits
        row[ts.BASE], row[ts.SIZE] = base, n
        row[ts.SKETCH_START], row[ts.SKETCH_BITS], row[ts.SKETCH_DEPTH] = sketch_at, bits, depth
        row[ts.THRESHOLD] = t.admit_threshold
        rows += row
    rows += [0] * ts.PARAMS  # a row of zeros: the settings of "no table"
    in_call = [-1] * len(space.tables)
    for c, t in enumerate(tables):
        in_call[space.index[id(t)]] = c
    host = torch.tensor(rows + in_call, dtype=torch.int64)
    if space.device.type == "cuda":  # not waited for: the copy back at the end follows it on the stream
        return host.pin_memory().to(space.device, non_blocking=True)
    return host.to(space.device)


class _Lanes:
    """The call's per-table settings (`matrix`, one row per table, contiguous), and per lane
    those of its table."""

    def __init__(self, params: torch.Tensor, tables: int) -> None:
        self.padded = params[: (tables + 1) * ts.PARAMS].view(tables + 1, ts.PARAMS)
        self.matrix = self.padded[:tables]
        self.in_call = params[(tables + 1) * ts.PARAMS :]

    def col(self, c: int) -> torch.Tensor:
        return self.matrix[:, c]

    def at(self, c: int, tab: torch.Tensor) -> torch.Tensor:
        """Column c for each lane of tab (the call's table index; the number of tables for none: 0)."""
        return self.padded[:, c][tab]


class _Segments:
    """Lanes that come table after table (tab: each lane's table, nondecreasing, `tables` for
    lanes of none, which come last), as every lane order of the pass does; sums per table are
    running sums read at each table's last lane. (An index_add_ into so few counters
    serializes its atomics: 1.4 ms of a 262,144-ID batch's 5.9 ms on an H100, 2026-11-28.)"""

    def __init__(self, tab: torch.Tensor, tables: int) -> None:
        # each table's last lane (or an earlier table's; -1: none before it)
        self.last = torch.searchsorted(tab, torch.arange(tables, device=tab.device), right=True) - 1
        self.tables = tables

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """values summed per table (int64, one per table)."""
        if values.numel() == 0:
            return torch.zeros(self.tables, dtype=torch.int64, device=values.device)
        run = torch.cumsum(values.to(torch.int64), 0)
        upto = torch.where(self.last >= 0, run[self.last.clamp(min=0)], 0)
        return torch.diff(upto, prepend=upto.new_zeros(1))


def _starts(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive running sums: where each table's part of a table-after-table output starts."""
    return torch.cumsum(counts, 0) - counts


def transform_many(
    tables: list[IDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool, bases: list[int]
) -> ManyResult:
    """Every table's block of ids (sizes[t] of table t's, end to end) in one pass; see
    many.transform_many for the result. The tables join one DeviceTables if they have none."""
    space = DeviceTables.of(tables)
    for t in tables:
        t.triton_map.rebuild_if_needed()
    T, n, dev = len(tables), ids.numel(), space.device
    lanes = _Lanes(_params(space, tables, sizes, bases), T)
    records = space.records
    spare = space.spare_row()
    slot_id, last = records[:, 0], records.view(torch.int32)[:, 2]
    freq, pins = records.view(torch.uint8)[:, 12], records.view(torch.uint8)[:, 13]
    arange = torch.arange(n, device=dev)
    in_ids = torch.repeat_interleave(torch.arange(T, device=dev), lanes.col(ts.SIZE), output_size=n)
    cap_t = lanes.col(ts.CAP)

    # 1. the distinct (table, ID) pairs, by table then ID, at the front of n-long tensors
    by_id = torch.sort(ids, stable=True).indices
    order = by_id[torch.sort(in_ids[by_id], stable=True).indices]
    ordered, otab = ids[order], in_ids[order]
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = (ordered[1:] != ordered[:-1]) | (otab[1:] != otab[:-1])
    group = torch.cumsum(first, 0) - 1
    n_distinct = first.sum()
    inverse = torch.empty_like(group).scatter_(0, order, group)
    uniq = torch.zeros_like(ids).scatter_(0, group, ordered)
    tab = torch.full_like(ids, T).scatter_(0, group, otab)  # T: no table (past the distinct)
    counts = torch.zeros_like(ids).index_add_(0, group, torch.ones_like(ids))
    first_seen = torch.full_like(ids, n).scatter_reduce_(0, group, order, "amin")
    valid = arange < n_distinct
    by_tab = _Segments(tab, T)
    distinct_t = by_tab.sum(valid)

    # 2. find; with pin, a hit's slot at 255 pins refuses its table before anything changes
    slots = find_many(space.entries, records, lanes.matrix, uniq, tab, n_distinct)
    hit = slots >= 0
    row = lanes.at(ts.FIRST, tab) + slots
    too_many_t = distinct_t > cap_t
    full_t = torch.zeros_like(too_many_t)
    if pin:
        full_t = by_tab.sum(hit & (pins[torch.where(hit, row, spare)] == _MAX_PINS)) > 0
    looked_t = ~too_many_t & ~full_t
    looked = torch.cat([looked_t, looked_t.new_zeros(1)])
    touch = torch.where(hit & looked[tab], row, spare)
    step = lanes.at(ts.STEP, tab)
    if any(t.policy.kind != "lru" for t in tables):  # the log counter, bumped once per batch (policy.bump)
        f = freq[touch]
        kind = lanes.at(ts.KIND, tab)
        idle = step - last[touch].to(torch.int64)
        decayed = (f.to(torch.int64) - idle // lanes.at(ts.DECAY, tab).clamp(min=1)).clamp(min=0).to(torch.uint8)
        f = torch.where(kind == ts.KINDS.index("hybrid"), decayed, f)
        bumped = bump_with(
            f,
            counts.clamp(max=_MAX_HITS),
            coin(uniq, step),
            lanes.at(ts.INIT_FREQ, tab),
            lanes.at(ts.LOG_FACTOR, tab).view(torch.float64),
        )
        freq[touch] = torch.where(kind == ts.KINDS.index("lru"), f, bumped)
    last[touch] = step.to(torch.int32)
    hits_t = by_tab.sum(counts * hit)
    seen_t = by_tab.sum(hit)

    # 3. the missing pairs in order of first sighting (table after table: the blocks are in
    #    table order); a placeholder -(k + 2) for the k-th
    missing = valid & ~hit
    n_new = missing.sum()
    by_sighting = torch.sort(torch.where(missing, first_seen, n), stable=True).indices
    kth = torch.empty_like(ids).scatter_(0, by_sighting, arange)
    new = arange < n_new
    new_ids, new_counts = uniq[by_sighting], counts[by_sighting]
    new_tab = torch.where(new, tab[by_sighting], T)
    by_new_tab = _Segments(new_tab, T)
    new_t = by_new_tab.sum(new)
    placed = torch.where(hit, slots, -(kth + 2))[inverse]

    # 4. admission (a refused table counts nothing in its sketch)
    admit = new & looked[new_tab]
    if any(t.sketch is not None for t in tables):
        depth = max(t.sketch.depth for t in tables if t.sketch is not None)
        admit &= _sketch_admits(space, lanes, depth, new_ids, new_tab, torch.where(admit, new_counts, 0))
    wanted_t = by_new_tab.sum(admit)

    # 5. room: only a table given more IDs than it has free slots can need it (known on the host)
    free_t = lanes.col(ts.FREE_NOW)
    zero_t = torch.zeros(T, dtype=torch.int64, device=dev)
    evict_t, movable_t, no_room_t = zero_t, zero_t, zero_t.bool()
    evicted_rows = ids[:0]
    need = [n_t > t.capacity - t.resident for t, n_t in zip(tables, sizes)]
    scan = ts.RowScan(records, space.block_table, space.first_block, lanes.in_call, lanes.matrix)
    if any(need):
        scores, movable_t = scan.scores()
        short = wanted_t - free_t
        no_room_t = (short > 0) & (movable_t < short)
        evict_t = torch.where(
            (short > 0) & ~no_room_t, torch.minimum(movable_t, short.clamp(min=lanes.col(ts.EVICT_MIN))), 0
        )
        # at most min(capacity, max(its IDs, evict_min)) a table: known on the host
        bound = sum(min(t.capacity, max(n_t, t.evict_min)) for t, n_t, x in zip(tables, sizes, need) if x)
        n_evict = evict_t.sum()
        evicted_rows = scan.victims(scores, evict_t, _starts(evict_t), bound, space.free_count)
        evicted_rows = torch.where(torch.arange(bound, device=dev) < n_evict, evicted_rows, spare)
        evicted_tab = torch.searchsorted(torch.cumsum(evict_t, 0), torch.arange(bound, device=dev), right=True)
        erase_many(space.entries, records, lanes.matrix, evicted_rows, evicted_tab, n_evict)
        last.index_fill_(0, evicted_rows, _FREE)  # (a scalar set by index_put_ copies it from the host: a sync)
        evicted_ids = slot_id[evicted_rows]
        evicted_slots = evicted_rows - lanes.at(ts.FIRST, evicted_tab)
    else:
        evicted_ids = evicted_slots = evicted_tab = ids[:0]
    ok_t = looked_t & ~no_room_t
    admit_t = torch.where(ok_t, wanted_t, 0)
    ok = torch.cat([ok_t, ok_t.new_zeros(1)])
    admit &= ok[new_tab]

    # 6. the admitted take their table's lowest free slots, in order
    n_admit = admit_t.sum()
    width = min(n, sum(t.capacity for t in tables))
    admitted_ids = compact(new_ids, admit, n)[:width]
    admitted_tab = compact(new_tab, admit, n)[:width]
    free_rows = scan.free_rows(space.free_count, admit_t, _starts(admit_t), width)
    upto_width = torch.arange(width, device=dev)
    into = torch.where(upto_width < n_admit, free_rows, spare)
    slot_id[into] = admitted_ids
    last[into] = lanes.at(ts.STEP, admitted_tab).to(torch.int32)
    freq[into] = lanes.at(ts.INIT_FREQ, admitted_tab).to(torch.uint8)
    reused_t = torch.zeros(T, dtype=torch.int64, device=dev)
    insert_many(space.entries, records, lanes.matrix, into, admitted_tab, n_admit, reused_t)
    admitted_slots = into - lanes.at(ts.FIRST, admitted_tab)
    rank = (torch.cumsum(admit, 0) - 1).clamp(0, max(width - 1, 0))
    new_slots = torch.where(admit, admitted_slots[rank], -1) if width else torch.full_like(new_ids, -1)
    placed = torch.where(placed < 0, new_slots[(-(placed + 2)).clamp(min=0)], placed)
    used = hit & ok[tab]
    if pin:
        pins[torch.where(used, row, spare)] += 1
        pins[into] += 1
    rejected = new & ~admit
    rejected_t = by_new_tab.sum(rejected)
    rejected_ids = compact(new_ids, rejected, n)

    # every slot a table's batch uses, once: its resident ones seen, then its admitted
    seen_ok_t = torch.where(ok_t, seen_t, 0)
    into_distinct = _starts(seen_ok_t + admit_t)
    at = tab.clamp(max=T - 1)  # (lanes of no table are masked off below)
    seen_rank = torch.cumsum(used, 0) - 1 - _starts(seen_ok_t)[at]
    dest = torch.where(used, into_distinct[at] + seen_rank, n + width)
    distinct = torch.zeros(n + width + 1, dtype=torch.int64, device=dev).scatter_(0, dest, slots)
    at = admitted_tab.clamp(max=T - 1)
    adm_dest = into_distinct[at] + seen_ok_t[at] + (upto_width - _starts(admit_t)[at])
    distinct.scatter_(0, torch.where(upto_width < n_admit, adm_dest, n + width), admitted_slots)

    # the caller's slots: every table's plus its base
    base = lanes.at(ts.BASE, in_ids)
    out_slots = torch.where(placed >= 0, placed + base, placed)
    dropped_t = _Segments(in_ids, T).sum(placed < 0)  # IDs of the batch given no slot (not admitted)

    # 7. the one copy, then per table the refusals and the outputs' sizes
    status = torch.where(too_many_t, _TOO_MANY, torch.where(full_t, _PINS_FULL, torch.where(no_room_t, _NO_ROOM, _OK)))
    summary = torch.stack(
        [status, distinct_t, seen_ok_t, new_t, wanted_t, admit_t, evict_t, rejected_t, movable_t, reused_t,
         torch.where(ok_t, hits_t, 0), dropped_t],
        dim=1,
    )  # fmt: skip
    info = [dict(zip(_FIELDS, r)) for r in to_host(summary)]
    return _finish(tables, info, sizes, out_slots, admitted_ids, admitted_slots, admitted_tab, lanes,
                   evicted_ids, evicted_slots, evicted_tab, distinct, rejected_ids)  # fmt: skip


def _sketch_admits(
    space: DeviceTables, lanes: _Lanes, rows: int, ids: torch.Tensor, tab: torch.Tensor, sighted: torch.Tensor
) -> torch.Tensor:
    """Count `sighted` sightings of each id in its table's sketch (of at most `rows` rows; a
    table without one: the dummy counter) and say whether its estimate reaches the table's
    threshold (always, without a sketch): CountMinSketch.add, for every table's sketch at once."""
    depth = lanes.at(ts.SKETCH_DEPTH, tab)
    bits = torch.where(depth > 0, lanes.at(ts.SKETCH_BITS, tab), 1)
    r = torch.arange(rows, device=ids.device).unsqueeze(1)
    product = ids.unsqueeze(0) * space.sketch_multipliers[:rows].unsqueeze(1)  # wraps mod 2^64
    width = torch.ones_like(bits) << bits
    column = (product >> (64 - bits)) & (width - 1)
    cells = torch.where(r < depth, lanes.at(ts.SKETCH_START, tab) + r * width + column, space.sketch.numel() - 1)
    counters = space.sketch
    counters.index_add_(0, cells.reshape(-1), sighted.to(torch.int32).repeat(rows))
    counters.clamp_(max=MAX_COUNT)
    estimate = torch.where(r < depth, counters[cells], MAX_COUNT).amin(dim=0)
    return (depth == 0) | (estimate >= lanes.at(ts.THRESHOLD, tab))


def _finish(
    tables: list[IDTransformer],
    info: list[dict[str, int]],
    sizes: list[int],
    slots: torch.Tensor,
    admitted_ids: torch.Tensor,
    admitted_slots: torch.Tensor,
    admitted_tab: torch.Tensor,
    lanes: _Lanes,
    evicted_ids: torch.Tensor,
    evicted_slots: torch.Tensor,
    evicted_tab: torch.Tensor,
    distinct: torch.Tensor,
    rejected_ids: torch.Tensor,
) -> ManyResult:
    """The host's part after the copy: each table's error, step, residents and tombstones, and
    the outputs cut to their sizes (the admitted and evicted slots plus their table's base)."""
    from dynemb.idtransformer import transformer as tf

    errors: list[Exception | None] = []
    for t, c in zip(tables, info):
        error: Exception | None = None
        if c["status"] == _TOO_MANY:  # refused before anything was done: no step taken
            error = tf.too_many_ids(c["distinct"], t.capacity)
        elif c["status"] == _PINS_FULL:
            error = RuntimeError(tf._PINS_FULL)
        else:
            if c["status"] == _NO_ROOM:  # even a batch refused for want of room was seen
                error = tf._no_room(c["wanted"], t.capacity - t.resident, c["movable"])
            t.step += 1
            t.resident += c["admitted"] - c["evicted"]
            t.triton_map.tombs += c["evicted"] - c["reused"]
        errors.append(error)
    a = sum(c["admitted"] for c in info)
    e = sum(c["evicted"] for c in info)
    d = sum(c["seen"] + c["admitted"] for c in info)
    r = sum(c["rejected"] for c in info)
    base_adm = lanes.at(ts.BASE, admitted_tab[:a])
    base_ev = lanes.at(ts.BASE, evicted_tab[:e])
    flat = {
        "admitted_ids": admitted_ids[:a],
        "admitted_slots": admitted_slots[:a] + base_adm,
        "evicted_ids": evicted_ids[:e],
        "evicted_slots": evicted_slots[:e] + base_ev,
        "distinct_slots": distinct[:d],
        "rejected_ids": rejected_ids[:r],
    }
    counts = {
        "admitted_ids": [c["admitted"] for c in info],
        "admitted_slots": [c["admitted"] for c in info],
        "evicted_ids": [c["evicted"] for c in info],
        "evicted_slots": [c["evicted"] for c in info],
        "distinct_slots": [c["seen"] + c["admitted"] for c in info],
        "rejected_ids": [c["rejected"] for c in info],
    }
    hits = [c["hits"] for c in info]
    dropped = [c["dropped"] for c in info]
    return ManyResult(slots, None, errors, flat, counts, list(sizes), hits, dropped)


def transform_one(t: IDTransformer, flat: torch.Tensor, pin: bool) -> TransformResult:
    """One batch through table t (flat: its IDs, 1-d int64 on t's device); see
    IDTransformer.transform for the results and refusals."""
    many = transform_many([t], flat, [flat.numel()], pin, [0])
    if many.errors[0] is not None:
        raise many.errors[0]
    out = many.results[0]
    assert out is not None
    return out


def release_many(
    tables: list[IDTransformer], distinct_slots: torch.Tensor, counts: list[int]
) -> list[Exception | None]:
    """Unpin every table's distinct slots (table after table, counts[t] of table t's, the table's
    own slots), each table all or none, with one host copy for all: per table, its error (the
    first bad slot decides, as IDTransformer.release's checks), the others released all the same."""
    from dynemb.idtransformer import transformer as tf

    space = DeviceTables.of(tables)
    T, n, dev = len(tables), distinct_slots.numel(), space.device
    lanes = _Lanes(_params(space, tables, counts, [0] * T), T)
    if n == 0:
        return [None] * T
    tab = torch.repeat_interleave(torch.arange(T, device=dev), lanes.col(ts.SIZE), output_size=n)
    slots = distinct_slots.to(dev)
    cap = lanes.at(ts.CAP, tab)
    outside = (slots < 0) | (slots >= cap)
    row = torch.where(outside, space.spare_row(), lanes.at(ts.FIRST, tab) + slots)
    pins = space.records.view(torch.uint8)[:, 13]
    unpinned = ~outside & (pins[row] == 0)
    at = torch.arange(n, device=dev)
    first = torch.full((2, T), n, dtype=torch.int64, device=dev)
    first[0].scatter_reduce_(0, tab, torch.where(outside, at, n), "amin")
    first[1].scatter_reduce_(0, tab, torch.where(unpinned, at, n), "amin")
    bad = (first < n).any(0)
    keep = ~bad[tab]
    pins[torch.where(keep, row, space.spare_row())] -= keep.to(torch.uint8)
    errors: list[Exception | None] = []
    for t, (out, unp) in zip(tables, zip(*to_host(first))):
        if out < unp:
            errors.append(IndexError(f"slot out of range for a table of {t.capacity} slots"))
        elif unp < n:
            errors.append(ValueError(tf._NOT_PINNED))
        else:
            errors.append(None)
    return errors
