"""A set-associative slot map for the CUDA backend: every dynamic table of a rank in one storage
of buckets, and one Triton launch that finds, admits and evicts a whole batch of all tables.

    tables = [TableSpec(4096, EvictionPolicy("lru")), TableSpec(8000, admit_threshold=2)]
    m = BucketSlotMap(tables, bucket_size=128, device="cuda")
    found = m.find_or_insert(ids, sizes, pin=True)   # sizes[t]: table t's IDs, end to end
    found.slots                                      # per ID: its table's slot, -1 if not admitted
    found.admitted, found.evicted                    # Rows(tables, ids, slots): pull / push
    found.per_table[t]                               # table t's counts (one host copy for all)
    m.release(found.rows)                            # the batch is through backward

The contract (shared/DESIGN.md, "The slot map's contract, per backend"): an ID's bucket in
table t comes from a hash of the ID alone, fastranged over t's ceil(C_t / B) buckets (the last
one has the C_t mod B ways left where C_t is not a multiple of B); a slot of table t is
`bucket_in_table * B + way`, so a table's slots are its rows [0, C_t) and its layout depends on
its capacity and B only: a table keeps its slots in any map of the same bucket size. A miss
takes a free way of its bucket, else the way with the lowest eviction score (policy.py's
formula, expired TTL first) that no batch in flight pins and this batch does not use; where no
way may go, the ID is refused this batch (slot -1, counted), so no row ever holds two IDs and no
resident ID is dropped without being reported as evicted. Which slot an ID gets differs from the
CPU kernel's (which keeps a global order): tests hold this map to invariants, not to slot parity.

One batch, whatever the number of tables: a fixed sequence of torch ops (the (table, ID) pairs
deduplicated and sorted by bucket in two stable sorts), one launch of `_find_or_insert_kernel`
(one program per touched bucket: it loads its bucket's keys, last access, frequency and pins,
handles its keys in order, writes the bucket back and reserves its places in the admitted,
evicted and rejected outputs with one atomic add each), a gather, and one device-to-host copy:
the counts, per table. The programs never share a bucket, so no two of them race for a way; the
only atomics are the counters and the admission sketches' cells. The outputs come table after
table (a stable sort by table where more than one table has any).

Per slot: the ID (int64), last access step (int32, -1: free), a log frequency counter (uint8,
policy.py's) and a pin count (int32): 17 bytes. Each table has its own step clock (a batch is a
step of the tables it names) and, where its threshold is above 1, its own count-min sketch
(admission.CountMinSketch's hashing: `sketches[t]` is a CountMinSketch whose counters are a view
of the map's); the kernel counts a miss's sightings in it with atomic adds and admits the ID when
the estimate reaches the threshold. Hits are not counted, as in the other backends.
`policy.evict_fraction` has no meaning here: a full bucket frees one way per admitted ID.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dynemb.idtransformer.admission import MAX_COUNT, CountMinSketch, check_size, multipliers
from dynemb.idtransformer.admission import MAX_DEPTH as _MAX_SKETCH_DEPTH
from dynemb.idtransformer.backend import DEFAULT_BUCKET
from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.policy import _FREQ_SHIFT, DEFAULT_POLICY, MAX_FREQ, POLICIES, EvictionPolicy
from dynemb.idtransformer.slot_map import COIN_SEED, fmix64

MIN_BUCKET, MAX_BUCKET = 32, 1024
FREE = -1
BUCKET_SEED = 0x2545F4914F6CDD1D  # the bucket hash: fmix64(id ^ BUCKET_SEED); odd, below 2^63
# constants the kernels share with policy.py, admission.py and slot_map.py (globals a Triton
# function reads must be constexpr)
_SHIFT: tl.constexpr = tl.constexpr(_FREQ_SHIFT)
_MAX_FREQ: tl.constexpr = tl.constexpr(MAX_FREQ)
_MAX_COUNT: tl.constexpr = tl.constexpr(MAX_COUNT)
_COIN_SEED: tl.constexpr = tl.constexpr(COIN_SEED)
_COIN_MULT: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))  # slot_map.coin's, as int64
_FMIX1: tl.constexpr = tl.constexpr(0xFF51AFD7ED558CCD - (1 << 64))  # slot_map.fmix64's multipliers
_FMIX2: tl.constexpr = tl.constexpr(0xC4CEB9FE1A85EC53 - (1 << 64))
_TOP: tl.constexpr = tl.constexpr((1 << 63) - 1)  # a way that may not go
_EXPIRED: tl.constexpr = tl.constexpr(1 << 62)  # policy.scores: an expired slot scores last - 2^62
assert MAX_FREQ << _FREQ_SHIFT < 1 << 48 and MAX_BUCKET <= 1024  # the kernel's packed eviction order
# each table's settings, columns of one int64 matrix (the kernels index it as t * N_PARAMS + column)
P_FIRST, P_KIND, P_TTL, P_DECAY, P_INIT_FREQ, P_THRESHOLD, P_CAP, P_SKETCH_AT, P_SKETCH_BITS, P_SKETCH_DEPTH = range(10)
N_PARAMS = 10
_NP: tl.constexpr = tl.constexpr(N_PARAMS)
# the counts, one row of N_FIELDS per table: a batch's (zeroed by each), then two that persist
FIELDS = ("distinct", "hits", "admitted", "evicted", "rejected", "refused", "dropped")
F_DISTINCT, F_HITS, F_ADMITTED, F_EVICTED, F_REJECTED, F_REFUSED, F_DROPPED, F_RESIDENT, F_FAULTS = range(9)
N_FIELDS = 9
_NF: tl.constexpr = tl.constexpr(N_FIELDS)
# after the tables' rows, one more: where the next program's outputs go, and the distinct pairs
G_ADMITTED, G_EVICTED, G_REJECTED, G_DISTINCT = range(4)

# the kernels' copies of those columns and fields (a Triton function reads only constexpr globals)
_P_FIRST: tl.constexpr = tl.constexpr(P_FIRST)
_P_KIND: tl.constexpr = tl.constexpr(P_KIND)
_P_TTL: tl.constexpr = tl.constexpr(P_TTL)
_P_DECAY: tl.constexpr = tl.constexpr(P_DECAY)
_P_INIT_FREQ: tl.constexpr = tl.constexpr(P_INIT_FREQ)
_P_THRESHOLD: tl.constexpr = tl.constexpr(P_THRESHOLD)
_P_CAP: tl.constexpr = tl.constexpr(P_CAP)
_P_SKETCH_AT: tl.constexpr = tl.constexpr(P_SKETCH_AT)
_P_SKETCH_BITS: tl.constexpr = tl.constexpr(P_SKETCH_BITS)
_P_SKETCH_DEPTH: tl.constexpr = tl.constexpr(P_SKETCH_DEPTH)
_F_DISTINCT: tl.constexpr = tl.constexpr(F_DISTINCT)
_F_HITS: tl.constexpr = tl.constexpr(F_HITS)
_F_ADMITTED: tl.constexpr = tl.constexpr(F_ADMITTED)
_F_EVICTED: tl.constexpr = tl.constexpr(F_EVICTED)
_F_REJECTED: tl.constexpr = tl.constexpr(F_REJECTED)
_F_REFUSED: tl.constexpr = tl.constexpr(F_REFUSED)
_F_DROPPED: tl.constexpr = tl.constexpr(F_DROPPED)
_F_RESIDENT: tl.constexpr = tl.constexpr(F_RESIDENT)
_F_FAULTS: tl.constexpr = tl.constexpr(F_FAULTS)
_G_ADMITTED: tl.constexpr = tl.constexpr(G_ADMITTED)
_G_EVICTED: tl.constexpr = tl.constexpr(G_EVICTED)
_G_REJECTED: tl.constexpr = tl.constexpr(G_REJECTED)
_G_DISTINCT: tl.constexpr = tl.constexpr(G_DISTINCT)


class TableSpec(NamedTuple):
    """One dynamic table of the map: its capacity (rows; any positive number), its eviction
    policy, the sightings an ID needs to be admitted (1: at once) and, for a threshold above 1,
    the size of its admission sketch."""

    capacity: int
    policy: EvictionPolicy = DEFAULT_POLICY
    admit_threshold: int = 1
    sketch_width: int = 1 << 20
    sketch_depth: int = 4


class Rows(NamedTuple):
    """IDs with their tables and their table's slots (int64 each, one per entry; -1 for a slot
    where there is none)."""

    tables: torch.Tensor
    ids: torch.Tensor
    slots: torch.Tensor


class BatchCounts(NamedTuple):
    """What a batch did, in one table or in all: distinct (table, ID) pairs, sightings of
    resident IDs, IDs admitted, IDs evicted, IDs below their admission threshold, IDs refused
    for want of a way that may go, and the sightings left without a slot (rejected or refused)."""

    distinct: int
    hits: int
    admitted: int
    evicted: int
    rejected: int
    refused: int
    dropped: int


class Found(NamedTuple):
    """A batch's find_or_insert.

    Attributes:
        slots: per ID of the batch (its shape), the slot in its table (plus its base, if given);
            -1 where not admitted.
        rows: per distinct (table, ID) pair, table after table, its row in the storage or -1:
            what release unpins.
        distinct_slots: the same pairs' slots in their table (-1: none; no base: what
            a table's release takes).
        admitted: the pairs given a slot by this batch (their rows to pull or initialise).
        evicted: the pairs that left to make room (their rows to push before reuse).
        rejected: the pairs below their admission threshold (slots -1).
        counts: the batch's counts, all tables together; per_table: each table's.
        faults: per table, the rows released that were not pinned since the map was made.
    """

    slots: torch.Tensor
    rows: torch.Tensor
    distinct_slots: torch.Tensor
    admitted: Rows
    evicted: Rows
    rejected: Rows
    counts: BatchCounts
    per_table: list[BatchCounts]
    faults: list[int]


class Exported(NamedTuple):
    """Every resident (table, ID) with its slot and policy state, each table's step, and each
    table's admission sketch (None where it has none)."""

    tables: torch.Tensor
    ids: torch.Tensor
    slots: torch.Tensor
    last_access: torch.Tensor
    freq: torch.Tensor
    steps: list[int]
    sketches: list[dict | None]


def to_host(counts: torch.Tensor) -> list[int]:
    """The batch's one device-to-host copy (tests count its calls through this function)."""
    return counts.cpu().view(-1).tolist()


def bucket_of(
    tables: torch.Tensor, ids: torch.Tensor, first_bucket: torch.Tensor, buckets: torch.Tensor
) -> torch.Tensor:
    """The storage bucket of each (table, id): its table's first bucket plus fastrange of the
    top 32 bits of fmix64(id ^ BUCKET_SEED) over the table's buckets. first_bucket, buckets:
    per table, int64."""
    t = tables.to(torch.int64)
    top = (fmix64(ids ^ BUCKET_SEED) >> 32) & 0xFFFFFFFF
    return first_bucket[t] + ((top * buckets[t]) >> 32)


@triton.jit
def _score(last, freq, step, kind, ttl, decay):
    """policy.EvictionPolicy.scores for a table's settings (kind: POLICIES' index; ttl -1:
    none), lanewise: lowest goes first. tests/idtransformer/test_bucket_map.py holds the two
    equal."""
    last = last.to(tl.int64)
    idle = step - last
    f = freq.to(tl.int64)
    decayed = tl.maximum(f - idle // decay, 0)
    f = tl.where(kind == 2, decayed, f)
    score = tl.where(kind == 0, last, (f << _SHIFT) + last)
    expired = (ttl >= 0) & (idle > ttl)
    return tl.where(expired, last - _EXPIRED, score)


@triton.jit
def _find_or_insert_kernel(
    keys_ptr,
    last_ptr,
    freq_ptr,
    pins_ptr,
    uniq_ptr,
    utab_ptr,
    ubucket_ptr,
    ucount_ptr,
    bstart_ptr,
    params_ptr,
    steps_ptr,
    log_factor_ptr,
    sketch_ptr,
    mult_ptr,
    urow_ptr,
    uslot_ptr,
    arank_ptr,
    erank_ptr,
    rrank_ptr,
    gone_ptr,
    admitted_ptr,
    evicted_ptr,
    rejected_ptr,
    counts_ptr,
    n_tables,
    out_len,
    B: tl.constexpr,
    DEPTH: tl.constexpr,
    PIN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per touched bucket (see the module doc). Per distinct pair i it writes its
    row and slot (-1: none), and its rank among the program's admitted, evicted and rejected
    pairs (-1: not one); admitted_ptr / evicted_ptr: three int64 rows of out_len (table, id,
    slot); rejected_ptr: two (table, id)."""
    program = tl.program_id(0)
    totals = counts_ptr + n_tables * _NF  # the row after the tables'
    n_distinct = tl.load(totals + _G_DISTINCT)
    start = tl.load(bstart_ptr + program)
    end = tl.minimum(tl.load(bstart_ptr + program + 1), n_distinct)
    active = start < end  # programs past the touched buckets do nothing
    at = tl.minimum(start, out_len - 1)  # (a place to read for them too)
    t = tl.load(utab_ptr + at)
    g = tl.load(ubucket_ptr + at)
    settings = params_ptr + t * _NP
    first = tl.load(settings + _P_FIRST)
    kind = tl.load(settings + _P_KIND)
    ttl = tl.load(settings + _P_TTL)
    decay = tl.load(settings + _P_DECAY)
    init_freq = tl.load(settings + _P_INIT_FREQ)
    threshold = tl.load(settings + _P_THRESHOLD)
    cap = tl.load(settings + _P_CAP)
    sketch_at = tl.load(settings + _P_SKETCH_AT)
    sketch_bits = tl.load(settings + _P_SKETCH_BITS)
    sketch_depth = tl.load(settings + _P_SKETCH_DEPTH)
    step = tl.load(steps_ptr + t)
    log_factor = tl.load(log_factor_ptr + t)

    lanes = tl.arange(0, B)
    rows = g * B + lanes
    # the bucket's ways: B, or what the table's capacity leaves for its last bucket; a block
    # mask from a comparison (the interpreter makes `scalar & block` of bools int64)
    ways = tl.minimum(cap - (g * B - first), B)
    mine = lanes < tl.where(active, ways, 0)
    keys = tl.load(keys_ptr + rows, mask=mine, other=0)
    last = tl.load(last_ptr + rows, mask=mine, other=-1)
    freq = tl.load(freq_ptr + rows, mask=mine, other=0)
    pins = tl.load(pins_ptr + rows, mask=mine, other=0)
    occupied = last != -1
    # Each way's place in the eviction order, packed in one int64 so that one min finds the
    # victim: class (free 0, expired 1, live 2) << 58 | value << 10 | way, where value is the
    # policy's score (< 2^48) or an expired way's last access; a way past the table's rows, or
    # pinned by a batch in flight, or used by this one (touched at this step) may not go (_TOP).
    score = _score(last, freq, step, kind, ttl, decay)
    expired = score < 0
    cls = tl.where(occupied, tl.where(expired, 1, 2), 0).to(tl.int64)
    value = tl.where(occupied, tl.where(expired, last.to(tl.int64), score), 0)
    order = (cls << 58) | (value << 10) | lanes
    order = tl.where(occupied & ((pins > 0) | (last == step)), _TOP, order)
    order = tl.where(mine, order, _TOP)
    step32 = step.to(tl.int32)
    sketch_width = (start * 0 + 1) << sketch_bits

    hits = start * 0
    n_admitted = start * 0
    n_evicted = start * 0
    n_rejected = start * 0
    n_refused = start * 0
    n_dropped = start * 0
    # branches, not selects over every case: LRU skips the log counter, a table without a
    # threshold the sketch (on a GPU, work saved; in the interpreter, where a reduction costs
    # milliseconds, a test's time)
    # Two passes: the hits first, so that a miss never evicts a way that a later key of this
    # batch would have hit (it is touched, and so kept, before any miss looks for a victim).
    for i in range(start, end):
        key = tl.load(uniq_ptr + i)
        sightings = tl.load(ucount_ptr + i)
        way = tl.min(tl.where(occupied & (keys == key), lanes, B), axis=0)
        tl.store(arank_ptr + i, -1)
        tl.store(erank_ptr + i, -1)
        tl.store(rrank_ptr + i, -1)
        if way < B:  # a hit: touch (and pin) its way
            row = g * B + way
            if kind != 0:  # the log counter: decayed by idle time (hybrid), bumped (lfu, hybrid)
                f = tl.load(freq_ptr + row).to(tl.int64)
                if kind == 2:
                    f = tl.maximum(f - (step - tl.load(last_ptr + row).to(tl.int64)) // decay, 0)
                # EvictionPolicy.bump, drawn as slot_map.coin(key, step) draws: fmix64 of both
                r = key * _COIN_MULT ^ ((step << 32) ^ _COIN_SEED)
                r = r ^ (r.to(tl.uint64, bitcast=True) >> 33).to(tl.int64, bitcast=True)
                r = r * _FMIX1
                r = r ^ (r.to(tl.uint64, bitcast=True) >> 33).to(tl.int64, bitcast=True)
                r = r * _FMIX2
                r = r ^ (r.to(tl.uint64, bitcast=True) >> 33).to(tl.int64, bitcast=True)
                draw = (r.to(tl.uint64, bitcast=True) >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2^-53
                prob = 1.0 / (tl.maximum(f - init_freq, 0).to(tl.float64) * log_factor + 1.0)
                q = tl.maximum(1.0 - prob, 1e-300)  # (log of 0 where prob is 1: p_batch is 1 either way)
                p_batch = tl.where(sightings == 1, prob, 1.0 - tl.exp(sightings.to(tl.float64) * tl.log(q)))
                f = tl.where((draw < p_batch) & (f < _MAX_FREQ), f + 1, f)
                tl.store(freq_ptr + row, f.to(tl.uint8))
            tl.store(last_ptr + row, step32)
            if PIN:
                tl.store(pins_ptr + row, tl.load(pins_ptr + row) + 1)
            order = tl.where(lanes == way, _TOP, order)
            tl.store(urow_ptr + i, row)
            tl.store(uslot_ptr + i, row - first)
            hits += sightings
    for i in range(start, end):
        if tl.load(urow_ptr + i) < 0:  # a miss (urow starts at -1)
            key = tl.load(uniq_ptr + i)
            sightings = tl.load(ucount_ptr + i)
            # admission: the miss's sightings counted in its table's sketch (threshold > 1 only)
            estimate = sightings * 0 + _TOP
            if threshold > 1:
                for d in tl.static_range(DEPTH):
                    if d < sketch_depth:  # CountMinSketch._cells: the product's top bits
                        column = ((key * tl.load(mult_ptr + d)) >> (64 - sketch_bits)) & (sketch_width - 1)
                        cell = sketch_ptr + sketch_at + d * sketch_width + column
                        after = tl.atomic_add(cell, sightings.to(tl.int32)).to(tl.int64) + sightings
                        tl.atomic_min(cell, _MAX_COUNT, mask=after > _MAX_COUNT)  # saturate as the sketch does
                        estimate = tl.minimum(estimate, tl.minimum(after, _MAX_COUNT))
            # the first way in eviction order (free, expired, lowest score, lowest way)
            pick = tl.min(order, axis=0)
            if estimate < threshold:
                tl.store(rrank_ptr + i, n_rejected.to(tl.int32))
                n_rejected += 1
                n_dropped += sightings
            elif pick == _TOP:  # every way pinned or used by this batch: refused this batch
                n_refused += 1
                n_dropped += sightings
            else:
                way = pick & (B - 1)
                row = g * B + way
                if (pick >> 58) > 0:  # the way held a pair: evicted
                    tl.store(gone_ptr + i, tl.load(keys_ptr + row))
                    tl.store(erank_ptr + i, n_evicted.to(tl.int32))
                    n_evicted += 1
                tl.store(keys_ptr + row, key)
                tl.store(last_ptr + row, step32)
                tl.store(freq_ptr + row, init_freq.to(tl.uint8))
                if PIN:  # (a victim has no pins)
                    tl.store(pins_ptr + row, 1)
                keys = tl.where(lanes == way, key, keys)
                occupied = occupied | (lanes == way)
                order = tl.where(lanes == way, _TOP, order)
                tl.store(urow_ptr + i, row)
                tl.store(uslot_ptr + i, row - first)
                tl.store(arank_ptr + i, n_admitted.to(tl.int32))
                n_admitted += 1

    # one atomic per counter a program: its places in the outputs, and its table's sums
    a_at = tl.atomic_add(totals + _G_ADMITTED, n_admitted, mask=active)
    e_at = tl.atomic_add(totals + _G_EVICTED, n_evicted, mask=active)
    r_at = tl.atomic_add(totals + _G_REJECTED, n_rejected, mask=active)
    mine_t = counts_ptr + t * _NF
    tl.atomic_add(mine_t + _F_DISTINCT, end - start, mask=active)
    tl.atomic_add(mine_t + _F_HITS, hits, mask=active)
    tl.atomic_add(mine_t + _F_ADMITTED, n_admitted, mask=active)
    tl.atomic_add(mine_t + _F_EVICTED, n_evicted, mask=active)
    tl.atomic_add(mine_t + _F_REJECTED, n_rejected, mask=active)
    tl.atomic_add(mine_t + _F_REFUSED, n_refused, mask=active)
    tl.atomic_add(mine_t + _F_DROPPED, n_dropped, mask=active)
    tl.atomic_add(mine_t + _F_RESIDENT, n_admitted - n_evicted, mask=active)
    # the program's admitted, evicted and rejected pairs to their places, a chunk at a time
    chunk = tl.arange(0, CHUNK)
    for c in range(start, end, CHUNK):
        at_i = c + chunk
        inside = at_i < end
        slot = tl.load(uslot_ptr + at_i, mask=inside, other=0)
        a_rank = tl.load(arank_ptr + at_i, mask=inside, other=-1)
        came = a_rank >= 0
        put = a_at + a_rank
        tl.store(admitted_ptr + put, t + chunk * 0, mask=came)
        tl.store(admitted_ptr + out_len + put, tl.load(uniq_ptr + at_i, mask=came, other=0), mask=came)
        tl.store(admitted_ptr + 2 * out_len + put, slot, mask=came)
        e_rank = tl.load(erank_ptr + at_i, mask=inside, other=-1)
        went = e_rank >= 0
        put = e_at + e_rank
        tl.store(evicted_ptr + put, t + chunk * 0, mask=went)
        tl.store(evicted_ptr + out_len + put, tl.load(gone_ptr + at_i, mask=went, other=0), mask=went)
        tl.store(evicted_ptr + 2 * out_len + put, slot, mask=went)
        r_rank = tl.load(rrank_ptr + at_i, mask=inside, other=-1)
        below = r_rank >= 0
        put = r_at + r_rank
        tl.store(rejected_ptr + put, t + chunk * 0, mask=below)
        tl.store(rejected_ptr + out_len + put, tl.load(uniq_ptr + at_i, mask=below, other=0), mask=below)


@triton.jit
def _release_kernel(pins_ptr, rows_ptr, row_table_ptr, n, counts_ptr, BLOCK: tl.constexpr):
    """Unpin rows (-1: none); a row that was not pinned keeps 0 pins and counts a fault in its
    table's row of the counts."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + at, mask=at < n, other=-1)
    live = row >= 0
    before = tl.atomic_add(pins_ptr + row, -1, mask=live)
    fault = live & (before <= 0)
    tl.atomic_add(pins_ptr + row, 1, mask=fault)  # put back: never below 0 pins
    t = tl.load(row_table_ptr + row, mask=fault, other=0)
    tl.atomic_add(counts_ptr + t * _NF + _F_FAULTS, 1, mask=fault)


@triton.jit
def _scores_kernel(last_ptr, freq_ptr, out_ptr, tab_ptr, params_ptr, steps_ptr, n, BLOCK: tl.constexpr):
    """Every row's eviction score under its table's policy (free rows: their formula's value)."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    t = tl.load(tab_ptr + at, mask=inside, other=0)
    kind = tl.load(params_ptr + t * _NP + _P_KIND, mask=inside, other=0)
    ttl = tl.load(params_ptr + t * _NP + _P_TTL, mask=inside, other=-1)
    decay = tl.load(params_ptr + t * _NP + _P_DECAY, mask=inside, other=1)
    step = tl.load(steps_ptr + t, mask=inside, other=0)
    last = tl.load(last_ptr + at, mask=inside, other=0)
    freq = tl.load(freq_ptr + at, mask=inside, other=0)
    tl.store(out_ptr + at, _score(last, freq, step, kind, ttl, decay), mask=inside)


_BLOCK = 256
_CHUNK = 64


class BucketSlotMap:
    """Slots of every dynamic table of a rank in one set-associative storage (see the module).

    Args:
        tables: each table's capacity, policy, admission threshold and sketch size.
        bucket_size: ways a bucket (B), a power of two in [32, 1024].
        device: where the storage lives (CUDA; CPU only under TRITON_INTERPRET=1).

    Raises:
        ValueError: no tables, a bucket size out of range, a capacity below 1, an admission
            threshold below 1, a sketch of a bad size, 2^31 rows or more in all.
    """

    def __init__(
        self, tables: Sequence[TableSpec], bucket_size: int = DEFAULT_BUCKET, device: torch.device | str = "cuda"
    ) -> None:
        if not tables:
            raise ValueError("a bucket slot map needs at least one table")
        b = bucket_size
        if not MIN_BUCKET <= b <= MAX_BUCKET or b & (b - 1):
            raise ValueError(f"bucket_size must be a power of two in [{MIN_BUCKET}, {MAX_BUCKET}], got {b}")
        for k, spec in enumerate(tables):
            if spec.capacity < 1:
                raise ValueError(f"table {k}: capacity must be >= 1, got {spec.capacity}")
            if spec.admit_threshold < 1:
                raise ValueError(f"table {k}: admit_threshold must be >= 1, got {spec.admit_threshold}")
        self.device = dev = torch.device(device)
        self.tables = list(tables)
        self.bucket_size = b
        caps = [s.capacity for s in tables]
        regions = [-(-c // b) * b for c in caps]  # whole buckets; the last one's extra ways unused
        self.first_rows = [sum(regions[:k]) for k in range(len(caps))]
        self.rows = sum(regions)
        if self.rows >= 1 << 31:
            raise ValueError(f"{self.rows:,} rows in all: a map holds fewer than 2^31")
        self.steps = [0] * len(tables)
        self.keys = torch.zeros(self.rows, dtype=torch.int64, device=dev)
        self.last_access = torch.full((self.rows,), FREE, dtype=torch.int32, device=dev)
        self.freq = torch.zeros(self.rows, dtype=torch.uint8, device=dev)
        self.pins = torch.zeros(self.rows, dtype=torch.int32, device=dev)
        self._first_row = torch.tensor(self.first_rows, dtype=torch.int64, device=dev)
        self._first_bucket = self._first_row // b
        self._buckets = torch.tensor([r // b for r in regions], dtype=torch.int64, device=dev)
        self._capacity = torch.tensor(caps, dtype=torch.int64, device=dev)
        # admission sketches, one region each of one tensor (a dummy counter last)
        self.sketches: list[CountMinSketch | None] = []
        places, at = [], 0
        for spec in tables:
            if spec.admit_threshold > 1:
                check_size(spec.sketch_width, spec.sketch_depth)
                places.append((at, spec.sketch_width.bit_length() - 1, spec.sketch_depth))
                at += spec.sketch_width * spec.sketch_depth
            else:
                places.append((0, 0, 0))
        self._sketch = torch.zeros(at + 1, dtype=torch.int32, device=dev)
        for spec, (start, _, depth) in zip(tables, places):
            if depth == 0:
                self.sketches.append(None)
                continue
            counts = self._sketch[start : start + depth * spec.sketch_width].view(depth, spec.sketch_width)
            self.sketches.append(CountMinSketch(spec.sketch_width, depth, dev, counts))
        params = []
        for spec, first, (start, bits, depth) in zip(tables, self.first_rows, places):
            p = spec.policy
            ttl = -1 if p.ttl_steps is None else p.ttl_steps
            kind = POLICIES.index(p.kind)
            admission = [spec.admit_threshold, spec.capacity, start, bits, depth]
            params.append([first, kind, ttl, p.decay_steps, p.initial_freq, *admission])
        self._params = torch.tensor(params, dtype=torch.int64, device=dev)
        self._depth = max(p[P_SKETCH_DEPTH] for p in params)
        self._log_factor = torch.tensor([s.policy.log_factor for s in tables], dtype=torch.float64, device=dev)
        self._mult = multipliers(_MAX_SKETCH_DEPTH, dev)
        # per table a batch's counts and two that persist, then the outputs' places
        self._counts = torch.zeros(len(tables) + 1, N_FIELDS, dtype=torch.int64, device=dev)
        self._row_table = torch.repeat_interleave(
            torch.arange(len(tables), device=dev), torch.tensor(regions, device=dev), output_size=self.rows
        )

    def region(self, t: int) -> slice:
        """Table t's rows in the storage: its slots [0, capacity) are these rows in order."""
        first = self.first_rows[t]
        return slice(first, first + self.tables[t].capacity)

    # -- the batch -----------------------------------------------------------------------

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """Host ints as one int64 tensor here: on CUDA through pinned memory, not waited for
        (the one copy back at the end follows it on the stream)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def find_or_insert(
        self,
        ids: torch.Tensor,
        sizes: Sequence[int],
        pin: bool = False,
        bases: Sequence[int] | None = None,
        in_call: Sequence[bool] | None = None,
    ) -> Found:
        """Slots for a batch of every table's IDs, admitting and evicting within buckets.

        Args:
            ids: the batch's IDs (any integer dtype, see ids.py), table after table.
            sizes: how many of them each table has (one per table, summing to ids' length).
            pin: every slot the batch uses gets a pin, held until release(found.rows).
            bases: per table, added to the slots this call gives out (default 0): a table's
                place among others' rows, as a sharded trainer wants them.
            in_call: per table, whether the batch is one of its steps (default: every table's).

        Returns:
            The slots per ID, the rows to release, the admitted, evicted and rejected pairs and
            the counts.

        Raises:
            ValueError: sizes of another length than the tables, or another sum than the IDs.
            OverflowError: a table's step clock at 2^31 - 1 (last access is int32).
        """
        flat = as_int64_ids(ids).reshape(-1).to(self.device)
        n, n_tables = flat.numel(), len(self.tables)
        sizes, dev = list(sizes), self.device
        if len(sizes) != n_tables or sum(sizes) != n or min(sizes) < 0:
            raise ValueError(f"sizes {sizes} must give each of the {n_tables} tables' IDs, {n} in all")
        stepping = [True] * n_tables if in_call is None else list(in_call)
        if len(stepping) != n_tables or any(not s and z for s, z in zip(stepping, sizes)):
            raise ValueError("in_call must name each table, and every table given IDs")
        if any(self.steps[k] >= (1 << 31) - 1 for k in range(n_tables) if stepping[k]):
            raise OverflowError("a table's step clock is at 2^31 - 1 (last access is int32)")
        base = [0] * n_tables if bases is None else list(bases)
        host = self._to_device(sizes + self.steps + base)  # one copy to the device
        sizes_d, steps_d, base_d = host[:n_tables], host[n_tables : 2 * n_tables], host[2 * n_tables :]
        for k in range(n_tables):
            self.steps[k] += stepping[k]
        if n == 0:
            empty = flat[:0]
            none = Rows(empty, empty, empty)
            zero = BatchCounts(0, 0, 0, 0, 0, 0, 0)
            return Found(flat.reshape(ids.shape), empty, empty, none, none, none, zero, [zero] * n_tables, [])
        # 1. the distinct (table, ID) pairs sorted by bucket (then ID), at the front of n-long
        #    tensors: two stable sorts; a bucket belongs to one table, so (bucket, ID) is the pair
        tab = torch.repeat_interleave(torch.arange(n_tables, device=dev), sizes_d, output_size=n)
        bucket = bucket_of(tab, flat, self._first_bucket, self._buckets)
        by_id = torch.sort(flat).indices
        order = by_id[torch.sort(bucket[by_id], stable=True).indices]
        s_ids, s_bucket = flat[order], bucket[order]
        first = torch.ones(n, dtype=torch.bool, device=dev)
        first[1:] = (s_ids[1:] != s_ids[:-1]) | (s_bucket[1:] != s_bucket[:-1])
        group = torch.cumsum(first, 0) - 1
        inverse = torch.empty_like(group).scatter_(0, order, group)
        uniq = torch.zeros_like(flat).scatter_(0, group, s_ids)
        ubucket = torch.zeros_like(flat).scatter_(0, group, s_bucket)
        utab = torch.zeros_like(flat).scatter_(0, group, tab[order])
        ucount = torch.zeros_like(flat).index_add_(0, group, torch.ones_like(flat))
        # 2. where each touched bucket's pairs start: program p takes the p-th bucket
        new_bucket = first.clone()
        new_bucket[1:] &= s_bucket[1:] != s_bucket[:-1]
        grid = min(n, self.rows // self.bucket_size)
        rank = torch.cumsum(new_bucket, 0) - 1
        bstart = torch.full((grid + 2,), n, dtype=torch.int64, device=dev)
        bstart.scatter_(0, torch.where(new_bucket, rank, grid + 1), group)  # (not read past grid)
        counts = self._counts
        counts[:, :F_RESIDENT].zero_()
        counts[n_tables, G_DISTINCT : G_DISTINCT + 1].copy_(group[-1:] + 1)
        # 3. the launch
        urow = torch.full((n,), -1, dtype=torch.int64, device=dev)
        uslot = torch.full((n,), -1, dtype=torch.int64, device=dev)
        ranks = torch.empty(3, n, dtype=torch.int32, device=dev)
        gone = torch.empty(n, dtype=torch.int64, device=dev)
        admitted = torch.empty(3, n, dtype=torch.int64, device=dev)
        evicted = torch.empty(3, n, dtype=torch.int64, device=dev)
        rejected = torch.empty(2, n, dtype=torch.int64, device=dev)
        _find_or_insert_kernel[(grid,)](
            self.keys, self.last_access, self.freq, self.pins,
            uniq, utab, ubucket, ucount, bstart, self._params, steps_d, self._log_factor, self._sketch, self._mult,
            urow, uslot, ranks[0], ranks[1], ranks[2], gone, admitted, evicted, rejected, counts,
            n_tables, n,
            B=self.bucket_size, DEPTH=self._depth, PIN=pin, CHUNK=_CHUNK,
        )  # fmt: skip
        based = uslot + base_d[utab]
        slots = torch.where(uslot >= 0, based, -1)
        # 4. the one copy
        c = to_host(counts)
        per_table = [BatchCounts(*c[k * N_FIELDS : k * N_FIELDS + len(FIELDS)]) for k in range(n_tables)]
        total = BatchCounts(*(sum(x) for x in zip(*per_table)))
        a, e, r = total.admitted, total.evicted, total.rejected

        def by_table(out: torch.Tensor, count: int) -> torch.Tensor:
            # the programs' order is the scheduler's; one sort, however many tables (a table's
            # pairs are in no particular order)
            out = out[:, :count]
            return out[:, torch.sort(out[0], stable=True).indices] if count else out

        adm, ev, rej = by_table(admitted, a), by_table(evicted, e), by_table(rejected, r)
        if bases is not None:
            adm = torch.cat([adm[:2], (adm[2] + base_d[adm[0]]).unsqueeze(0)])
            ev = torch.cat([ev[:2], (ev[2] + base_d[ev[0]]).unsqueeze(0)])
        d = total.distinct
        return Found(
            slots[inverse].reshape(ids.shape),
            urow[:d],
            uslot[:d],
            Rows(adm[0], adm[1], adm[2]),
            Rows(ev[0], ev[1], ev[2]),
            Rows(rej[0], rej[1], torch.full_like(rej[0], -1)),
            total,
            per_table,
            [c[k * N_FIELDS + F_FAULTS] for k in range(n_tables)],
        )

    def find(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        """Table t's slot of each ID (-1: not resident), touching nothing: what evaluation
        reads. Torch ops over each ID's bucket, a chunk of IDs at a time (a chunk's bucket
        rows are chunk x B keys)."""
        flat = as_int64_ids(ids).reshape(-1).to(self.device)
        out = torch.full_like(flat, -1)
        b, first = self.bucket_size, self.first_rows[t]
        lanes = torch.arange(b, device=self.device)
        step = max(1, (1 << 22) // b)
        for at in range(0, flat.numel(), step):
            part = flat[at : at + step]
            bucket = bucket_of(torch.full_like(part, t), part, self._first_bucket, self._buckets)
            rows = (bucket * b).unsqueeze(1) + lanes
            inside = rows - first < self.tables[t].capacity
            rows = torch.where(inside, rows, 0)
            match = inside & (self.keys[rows] == part.unsqueeze(1)) & (self.last_access[rows] != FREE)
            way = torch.where(match, lanes, b).amin(1)
            out[at : at + step] = torch.where(way < b, bucket * b + way - first, -1)
        return out.reshape(ids.shape)

    def release(self, rows: torch.Tensor, check: bool = False) -> None:
        """Unpin the rows of a batch found with pin=True (its Found.rows; -1 entries skipped).
        A row that was not pinned stays at 0 pins and counts a fault for its table, which the
        next batch's copy carries (`faults`): no host copy here.

        Args:
            check: copy the faults to the host now and raise if this call made any.

        Raises:
            ValueError: with check, a row released that was not pinned (released twice?).
        """
        n = rows.numel()
        before = self._counts[:, F_FAULTS].clone() if check else None
        if n:
            held = rows.reshape(-1).to(self.device, torch.int64).contiguous()
            _release_kernel[(triton.cdiv(n, _BLOCK),)](self.pins, held, self._row_table, n, self._counts, BLOCK=_BLOCK)
        if before is not None and (bad := sum(to_host(self._counts[:, F_FAULTS] - before))):
            raise ValueError(f"{bad} rows released that were not pinned (released twice?)")

    # -- state -----------------------------------------------------------------------------

    def resident(self) -> list[int]:
        """Resident IDs per table (one host copy)."""
        return to_host(self._counts[: len(self.tables), F_RESIDENT])

    def scores(self) -> torch.Tensor:
        """Every row's eviction score under its table's policy at its table's step (int64;
        free rows' values mean nothing): what the kernel compares."""
        out = torch.empty(self.rows, dtype=torch.int64, device=self.device)
        steps = self._to_device(self.steps)
        _scores_kernel[(triton.cdiv(self.rows, _BLOCK),)](
            self.last_access, self.freq, out, self._row_table, self._params, steps, self.rows, BLOCK=_BLOCK
        )
        return out

    def export(self) -> Exported:
        """Every resident (table, ID) with its slot, last access and frequency (on the map's
        device), the steps and the sketches. Pins are not kept: a restored map starts with no
        batch in flight."""
        rows = torch.nonzero(self.last_access != FREE).squeeze(1)
        tables = self._row_table[rows]
        return Exported(
            tables,
            self.keys[rows],
            rows - self._first_row[tables],
            self.last_access[rows].clone(),
            self.freq[rows].clone(),
            list(self.steps),
            [None if s is None else s.state_dict() for s in self.sketches],
        )

    def restore(self, state: Exported) -> None:
        """Make the map hold exactly an export's pairs, each at its slot (its row keeps its
        values), with their policy state, the steps and the sketches; pins all 0.

        Raises:
            ValueError: a table or slot outside this map, a slot outside the bucket its ID
                hashes to here (another bucket size or capacity), a slot or pair twice, a last
                access outside 0..step, or sketches of another size. Nothing changed then.
        """
        dev = self.device
        tables, ids, slots = (x.to(dev, torch.int64) for x in (state.tables, state.ids, state.slots))
        last, freq = state.last_access.to(dev, torch.int32), state.freq.to(dev, torch.uint8)
        n = ids.numel()
        if not all(x.shape == (n,) for x in (tables, slots, last, freq)):
            raise ValueError("export's tables, ids, slots, last_access and freq differ in length")
        if len(state.steps) != len(self.tables) or len(state.sketches) != len(self.tables):
            raise ValueError(f"export is of {len(state.steps)} tables, this map has {len(self.tables)}")
        if n and (int(tables.min()) < 0 or int(tables.max()) >= len(self.tables)):
            raise ValueError(f"export has tables outside 0..{len(self.tables) - 1}")
        if n and bool(((slots < 0) | (slots >= self._capacity[tables])).any()):
            raise ValueError("export has slots outside their table's capacity")
        rows = self._first_row[tables] + slots
        if n and bool((rows // self.bucket_size != bucket_of(tables, ids, self._first_bucket, self._buckets)).any()):
            raise ValueError(
                "export has slots outside the buckets their IDs hash to in this map (another bucket size "
                "or capacity): load each table with load_table, which places its IDs anew"
            )
        if torch.unique(rows).numel() != n:
            raise ValueError("export holds a slot twice")
        # a pair's bucket is its table's, so (bucket, ID) names the pair
        if n and torch.unique(torch.stack([rows // self.bucket_size, ids], 1), dim=0).shape[0] != n:
            raise ValueError("export holds a (table, ID) pair twice")
        steps = torch.tensor(state.steps, dtype=torch.int64, device=dev)
        if n and bool(((last < 0) | (last.to(torch.int64) > steps[tables])).any()):
            raise ValueError("export has a last access outside steps 0..its table's step")
        for k, (mine, theirs) in enumerate(zip(self.sketches, state.sketches)):
            if (mine is None) != (theirs is None):
                raise ValueError(f"table {k}: export's admission sketch and this map's do not match (one has none)")
            size = None if theirs is None else (theirs["width"], theirs["depth"])
            if mine is not None and size != (mine.width, mine.depth):
                assert theirs is not None
                raise ValueError(f"table {k}: export's sketch is {theirs['depth']}x{theirs['width']}")
        for mine, theirs in zip(self.sketches, state.sketches):
            if mine is not None and theirs is not None:
                mine.load_state_dict(theirs)
        self.keys.zero_()
        self.last_access.fill_(FREE)
        self.freq.zero_()
        self.pins.zero_()
        self.keys[rows], self.last_access[rows], self.freq[rows] = ids, last, freq
        self.steps = list(state.steps)
        self._counts[: len(self.tables), F_RESIDENT] = torch.bincount(tables, minlength=len(self.tables))

    def load_table(
        self,
        t: int,
        ids: torch.Tensor,
        last_access: torch.Tensor,
        freq: torch.Tensor,
        step: int,
        slots: torch.Tensor | None = None,
    ) -> int:
        """Make table t hold these IDs (distinct) with their last access (<= step) and
        frequency, at this step; pins 0. Where `slots` are given and each lies in the bucket
        its ID hashes to here (a state of this layout), each ID goes to its slot; else each is
        placed anew in its bucket, and where a bucket gets more IDs than it has ways, those its
        policy would keep longest stay (the rest are left out: their rows stay on the PS). What
        a checkpoint of another layout or world size restores through.

        Returns:
            The IDs placed.
        """
        dev, b = self.device, self.bucket_size
        ids = ids.to(dev, torch.int64)
        last, freq = last_access.to(dev, torch.int32), freq.to(dev, torch.uint8)
        first, capacity = self.first_rows[t], self.tables[t].capacity
        region = slice(first, first + int(self._buckets[t]) * b)
        bucket = bucket_of(torch.full_like(ids, t), ids, self._first_bucket, self._buckets)
        row = order = None
        if slots is not None and ids.numel():
            slots = slots.to(dev, torch.int64)
            exact = bool(((slots >= 0) & (slots < capacity) & ((first + slots) // b == bucket)).all())
            if exact and torch.unique(slots).numel() == slots.numel():
                row, order = first + slots, torch.arange(ids.numel(), device=dev)
        if row is None and ids.numel():
            keep_first = torch.sort(-self.tables[t].policy.scores(last, freq, step), stable=True).indices
            order = keep_first[torch.sort(bucket[keep_first], stable=True).indices]
            s_bucket = bucket[order]
            starts = torch.ones_like(s_bucket, dtype=torch.bool)
            starts[1:] = s_bucket[1:] != s_bucket[:-1]
            at = torch.arange(len(order), device=dev)
            way = at - torch.cummax(torch.where(starts, at, 0), 0).values
            row = s_bucket * b + way
            keep = (row - first < capacity) & (way < b)
            row, order = row[keep], order[keep]
        self.keys[region] = 0
        self.last_access[region] = FREE
        self.freq[region] = 0
        self.pins[region] = 0
        self.steps[t] = step
        placed = 0
        if row is not None and order is not None:
            self.keys[row], self.last_access[row], self.freq[row] = ids[order], last[order], freq[order]
            placed = int(row.numel())
        self._counts[t, F_RESIDENT] = placed
        return placed

    @property
    def nbytes(self) -> int:
        """Bytes of per-slot state (the admission sketches apart)."""
        return self.rows * (8 + 4 + 1 + 4)
