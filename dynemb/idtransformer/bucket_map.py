"""A set-associative slot map for the CUDA backend: every dynamic table of a rank in one storage
of buckets, and one Triton launch that finds, admits and evicts a whole batch of all tables.

    tables = [TableSpec(4096, EvictionPolicy("lru")), TableSpec(8192, admit_threshold=2)]
    m = BucketSlotMap(tables, bucket_size=128, device="cuda")
    found = m.find_or_insert(ids, sizes, pin=True)   # sizes[t]: table t's IDs, end to end
    found.slots                                      # per ID: its table's slot, -1 if not admitted
    found.admitted, found.evicted                    # Rows(tables, ids, slots): pull / push
    m.release(found.rows)                            # the batch is through backward

The contract (shared/DESIGN.md, "The slot map's contract, per backend"): a (table, ID) pair's
bucket comes from a hash of both, within its table's range of buckets; a slot of table t is
`bucket_in_table * B + way`, so a table of capacity C (a multiple of B) has C // B buckets and
its slots are its rows. A miss takes a free way of its bucket, else the way with the lowest
eviction score (policy.py's formula, expired TTL first) that no batch in flight pins and this
batch does not use; where no way may go, the ID is refused this batch (slot -1, counted), so
no row ever holds two IDs and no resident ID is dropped without being reported as evicted.
Which slot an ID gets differs from the CPU kernel's (which keeps a global order): tests hold
this map to invariants, not to slot parity.

One batch, whatever the number of tables: a fixed sequence of torch ops (the (table, ID) pairs
deduplicated and sorted by bucket in two stable sorts), one launch of `_find_or_insert_kernel`
(one program per touched bucket: it loads its bucket's keys, last access, frequency and pins,
handles its keys in order, writes the bucket back and reserves its places in the admitted and
evicted outputs with one atomic add each), a gather, and one device-to-host copy: the counts.
The programs never share a bucket, so no two of them race for a way; the only atomics are the
counters and the admission sketch's cells.

Per slot: the (table, ID)'s ID (int64), last access step (int32, -1: free), a log frequency
counter (uint8, policy.py's) and a pin count (int32): 17 bytes. One step clock for the map
(each find_or_insert is one step of every table). `policy.evict_fraction` has no meaning here:
a full bucket frees exactly one way per admitted ID.

Admission: one count-min sketch (admission.CountMinSketch, its hashing and storage) for every
table whose threshold is above 1, keyed by `sketch_keys(table, id)` (table 0's key is the ID
itself); the kernel counts a miss's sightings in it with atomic adds and admits the ID when
the estimate reaches its table's threshold. Hits are not counted, as in the other backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dynemb.idtransformer.admission import MAX_COUNT, CountMinSketch, multipliers
from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.policy import _FREQ_SHIFT, DEFAULT_POLICY, MAX_FREQ, POLICIES, EvictionPolicy
from dynemb.idtransformer.slot_map import COIN_SEED, fmix64

MIN_BUCKET, MAX_BUCKET, DEFAULT_BUCKET = 32, 1024, 128
FREE = -1
# seeds of the bucket hash: table t hashes id ^ (BUCKET_SEED + t * TABLE_SALT); odd, below 2^63
BUCKET_SEED = 0x2545F4914F6CDD1D
TABLE_SALT = 0x5851F42D4C957F2D
# constants the kernels share with policy.py, admission.py and slot_map.py (globals a Triton
# function reads must be constexpr)
_SHIFT: tl.constexpr = tl.constexpr(_FREQ_SHIFT)
_MAX_FREQ: tl.constexpr = tl.constexpr(MAX_FREQ)
_MAX_COUNT: tl.constexpr = tl.constexpr(MAX_COUNT)
_COIN_SEED: tl.constexpr = tl.constexpr(COIN_SEED)
_COIN_MULT: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))  # slot_map.coin's, as int64
_FMIX1: tl.constexpr = tl.constexpr(0xFF51AFD7ED558CCD - (1 << 64))  # slot_map.fmix64's multipliers
_FMIX2: tl.constexpr = tl.constexpr(0xC4CEB9FE1A85EC53 - (1 << 64))
_SALT: tl.constexpr = tl.constexpr(TABLE_SALT)
_TOP: tl.constexpr = tl.constexpr((1 << 63) - 1)  # a way that may not go
_EXPIRED: tl.constexpr = tl.constexpr(1 << 62)  # policy.scores: an expired slot scores last - 2^62
assert MAX_FREQ << _FREQ_SHIFT < 1 << 48 and MAX_BUCKET <= 1024  # the kernel's packed eviction order
# the policy's settings per table, columns of one int64 matrix
P_FIRST, P_KIND, P_TTL, P_DECAY, P_INIT_FREQ, P_THRESHOLD = range(6)
N_PARAMS = 6
# the counts copied to the host once a batch, in order; the last two persist across batches
COUNT_FIELDS = ("distinct", "hits", "admitted", "evicted", "rejected", "refused")
C_DISTINCT, C_HITS, C_ADMITTED, C_EVICTED, C_REJECTED, C_REFUSED, C_RELEASE_FAULTS = range(7)
C_RESIDENT = 7  # then one resident count per table


class TableSpec(NamedTuple):
    """One dynamic table of the map: its capacity (a multiple of the bucket size), its eviction
    policy and the sightings an ID needs to be admitted (1: at once)."""

    capacity: int
    policy: EvictionPolicy = DEFAULT_POLICY
    admit_threshold: int = 1


class Rows(NamedTuple):
    """IDs with their tables and their table's slots (int64 each, one per entry)."""

    tables: torch.Tensor
    ids: torch.Tensor
    slots: torch.Tensor


class BatchCounts(NamedTuple):
    """What a batch did: distinct (table, ID) pairs, sightings of resident IDs, IDs admitted,
    IDs evicted, IDs below their admission threshold, IDs refused for want of a way that may go;
    and the release faults (slots released that were not pinned) since the map was made."""

    distinct: int
    hits: int
    admitted: int
    evicted: int
    rejected: int
    refused: int
    release_faults: int


class Found(NamedTuple):
    """A batch's find_or_insert.

    Attributes:
        slots: per ID of the batch (its shape), the slot in its table; -1 where not admitted.
        rows: per distinct (table, ID) pair, its row in the storage or -1: what release unpins.
        admitted: the pairs given a slot by this batch (their rows to pull or initialise).
        evicted: the pairs that left to make room (their rows to push before reuse).
        counts: the batch's counts (the one host copy).
    """

    slots: torch.Tensor
    rows: torch.Tensor
    admitted: Rows
    evicted: Rows
    counts: BatchCounts


class Exported(NamedTuple):
    """Every resident (table, ID) with its slot and policy state, the step, and the sketch."""

    tables: torch.Tensor
    ids: torch.Tensor
    slots: torch.Tensor
    last_access: torch.Tensor
    freq: torch.Tensor
    step: int
    sketch: dict | None


def to_host(counts: torch.Tensor) -> list[int]:
    """The batch's one device-to-host copy (tests count its calls through this function)."""
    return counts.cpu().tolist()


def sketch_keys(tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The admission sketch's key of each (table, id): id + table * TABLE_SALT (wrapping), so
    that one sketch tells the tables apart and table 0's keys are its IDs."""
    return ids + tables.to(torch.int64) * TABLE_SALT


def bucket_of(
    tables: torch.Tensor, ids: torch.Tensor, first_bucket: torch.Tensor, buckets: torch.Tensor
) -> torch.Tensor:
    """The storage bucket of each (table, id): its table's first bucket plus fastrange of the
    top 32 bits of fmix64(id ^ seed_t) over the table's buckets (seed_t = BUCKET_SEED + t *
    TABLE_SALT). first_bucket, buckets: per table, int64."""
    t = tables.to(torch.int64)
    h = fmix64(ids ^ (BUCKET_SEED + t * TABLE_SALT))
    top = (h >> 32) & 0xFFFFFFFF
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
    log_factor_ptr,
    sketch_ptr,
    mult_ptr,
    urow_ptr,
    uslot_ptr,
    arank_ptr,
    erank_ptr,
    gone_ptr,
    admitted_ptr,
    evicted_ptr,
    counts_ptr,
    step,
    sketch_width,
    sketch_shift,
    out_len,
    B: tl.constexpr,
    DEPTH: tl.constexpr,
    PIN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per touched bucket (see the module doc). Per distinct pair i it writes its
    row and slot (-1: none), and its rank among the program's admitted and evicted pairs (-1:
    not one); admitted_ptr / evicted_ptr: three int64 rows of out_len (table, id, slot)."""
    program = tl.program_id(0)
    n_distinct = tl.load(counts_ptr + 0)
    start = tl.load(bstart_ptr + program)
    end = tl.minimum(tl.load(bstart_ptr + program + 1), n_distinct)
    active = start < end  # programs past the touched buckets do nothing
    at = tl.minimum(start, out_len - 1)  # (a place to read for them too)
    t = tl.load(utab_ptr + at)
    g = tl.load(ubucket_ptr + at)
    first = tl.load(params_ptr + t * 6 + 0)
    kind = tl.load(params_ptr + t * 6 + 1)
    ttl = tl.load(params_ptr + t * 6 + 2)
    decay = tl.load(params_ptr + t * 6 + 3)
    init_freq = tl.load(params_ptr + t * 6 + 4)
    threshold = tl.load(params_ptr + t * 6 + 5)
    log_factor = tl.load(log_factor_ptr + t)

    lanes = tl.arange(0, B)
    rows = g * B + lanes
    # a block mask from a comparison (the interpreter makes `scalar & block` of bools int64)
    mine = lanes < tl.where(active, B, 0)
    keys = tl.load(keys_ptr + rows, mask=mine, other=0)
    last = tl.load(last_ptr + rows, mask=mine, other=-1)
    freq = tl.load(freq_ptr + rows, mask=mine, other=0)
    pins = tl.load(pins_ptr + rows, mask=mine, other=0)
    occupied = last != -1
    # Each way's place in the eviction order, packed in one int64 so that one min finds the
    # victim: class (free 0, expired 1, live 2) << 58 | value << 10 | way, where value is the
    # policy's score (< 2^48) or an expired way's last access; a way pinned by a batch in flight
    # or used by this one (touched at this step) may not go (_TOP).
    score = _score(last, freq, step, kind, ttl, decay)
    expired = score < 0
    cls = tl.where(occupied, tl.where(expired, 1, 2), 0).to(tl.int64)
    value = tl.where(occupied, tl.where(expired, last.to(tl.int64), score), 0)
    order = (cls << 58) | (value << 10) | lanes
    order = tl.where(occupied & ((pins > 0) | (last == step)), _TOP, order)
    step64 = step.to(tl.int64)

    hits = start * 0
    n_admitted = start * 0
    n_evicted = start * 0
    n_rejected = start * 0
    n_refused = start * 0
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
        if way < B:  # a hit: touch (and pin) its way
            row = g * B + way
            if kind != 0:  # the log counter: decayed by idle time (hybrid), bumped (lfu, hybrid)
                f = tl.load(freq_ptr + row).to(tl.int64)
                if kind == 2:
                    f = tl.maximum(f - (step64 - tl.load(last_ptr + row).to(tl.int64)) // decay, 0)
                # policy.bump_with, drawn as slot_map.coin(key, step) draws: fmix64 of both
                r = key * _COIN_MULT ^ ((step64 << 32) ^ _COIN_SEED)
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
            tl.store(last_ptr + row, step)
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
            # admission: the miss's sightings counted in the sketch (threshold > 1 only)
            estimate = sightings * 0 + _TOP
            if threshold > 1:
                mixed = key + t * _SALT  # sketch_keys(t, key)
                for d in tl.static_range(DEPTH):
                    column = ((mixed * tl.load(mult_ptr + d)) >> sketch_shift) & (sketch_width - 1)
                    cell = sketch_ptr + d * sketch_width + column
                    after = tl.atomic_add(cell, sightings.to(tl.int32)).to(tl.int64) + sightings
                    tl.atomic_min(cell, _MAX_COUNT, mask=after > _MAX_COUNT)  # saturate as the sketch does
                    estimate = tl.minimum(estimate, tl.minimum(after, _MAX_COUNT))
            # the first way in eviction order (free, expired, lowest score, lowest way)
            pick = tl.min(order, axis=0)
            if estimate < threshold:
                n_rejected += 1
            elif pick == _TOP:  # every way pinned or used by this batch: refused this batch
                n_refused += 1
            else:
                way = pick & (B - 1)
                row = g * B + way
                if (pick >> 58) > 0:  # the way held a pair: evicted
                    tl.store(gone_ptr + i, tl.load(keys_ptr + row))
                    tl.store(erank_ptr + i, n_evicted.to(tl.int32))
                    n_evicted += 1
                tl.store(keys_ptr + row, key)
                tl.store(last_ptr + row, step)
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

    # one atomic per counter a program: its places in the outputs, and the batch's sums
    a_at = tl.atomic_add(counts_ptr + 2, n_admitted, mask=active)
    e_at = tl.atomic_add(counts_ptr + 3, n_evicted, mask=active)
    tl.atomic_add(counts_ptr + 1, hits, mask=active)
    tl.atomic_add(counts_ptr + 4, n_rejected, mask=active)
    tl.atomic_add(counts_ptr + 5, n_refused, mask=active)
    tl.atomic_add(counts_ptr + 7 + t, n_admitted - n_evicted, mask=active)
    # the program's admitted and evicted pairs to their places, a chunk at a time
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


@triton.jit
def _release_kernel(pins_ptr, rows_ptr, n, counts_ptr, BLOCK: tl.constexpr):
    """Unpin rows (-1: none); a row that was not pinned keeps 0 pins and counts a fault."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + at, mask=at < n, other=-1)
    live = row >= 0
    before = tl.atomic_add(pins_ptr + row, -1, mask=live)
    fault = live & (before <= 0)
    tl.atomic_add(pins_ptr + row, 1, mask=fault)  # put back: never below 0 pins
    faults = tl.sum(fault.to(tl.int64), axis=0)
    tl.atomic_add(counts_ptr + 6, faults, mask=faults > 0)


@triton.jit
def _scores_kernel(last_ptr, freq_ptr, out_ptr, tab_ptr, params_ptr, n, step, BLOCK: tl.constexpr):
    """Every row's eviction score under its table's policy (free rows: their formula's value)."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    t = tl.load(tab_ptr + at, mask=inside, other=0)
    kind = tl.load(params_ptr + t * 6 + 1, mask=inside, other=0)
    ttl = tl.load(params_ptr + t * 6 + 2, mask=inside, other=-1)
    decay = tl.load(params_ptr + t * 6 + 3, mask=inside, other=1)
    last = tl.load(last_ptr + at, mask=inside, other=0)
    freq = tl.load(freq_ptr + at, mask=inside, other=0)
    tl.store(out_ptr + at, _score(last, freq, step, kind, ttl, decay), mask=inside)


_BLOCK = 256
_CHUNK = 64


class BucketSlotMap:
    """Slots of every dynamic table of a rank in one set-associative storage (see the module).

    Args:
        tables: each table's capacity, policy and admission threshold.
        bucket_size: ways a bucket (B), a power of two in [32, 1024]; every capacity a multiple.
        sketch_width, sketch_depth: the admission sketch's size (made only where a table has a
            threshold above 1).
        device: where the storage lives (CUDA; CPU only under TRITON_INTERPRET=1).

    Raises:
        ValueError: no tables, a bucket size out of range, a capacity not a multiple of it, an
            admission threshold below 1.
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        bucket_size: int = DEFAULT_BUCKET,
        sketch_width: int = 1 << 20,
        sketch_depth: int = 4,
        device: torch.device | str = "cuda",
    ) -> None:
        if not tables:
            raise ValueError("a bucket slot map needs at least one table")
        b = bucket_size
        if not MIN_BUCKET <= b <= MAX_BUCKET or b & (b - 1):
            raise ValueError(f"bucket_size must be a power of two in [{MIN_BUCKET}, {MAX_BUCKET}], got {b}")
        for k, spec in enumerate(tables):
            if spec.capacity < b or spec.capacity % b:
                down, up = spec.capacity // b * b, -(-spec.capacity // b) * b
                raise ValueError(
                    f"table {k}: capacity {spec.capacity} is not a positive multiple of the bucket size {b} "
                    f"(use {up}" + (f" or {down})" if down else ")")
                )
            if spec.admit_threshold < 1:
                raise ValueError(f"table {k}: admit_threshold must be >= 1, got {spec.admit_threshold}")
        self.device = dev = torch.device(device)
        self.tables = list(tables)
        self.bucket_size = b
        caps = [s.capacity for s in tables]
        self.first_rows = [sum(caps[:k]) for k in range(len(caps))]
        self.rows = sum(caps)
        if self.rows >= 1 << 31:
            raise ValueError(f"{self.rows:,} slots in all: a map holds fewer than 2^31")
        self.step = 0
        self.keys = torch.zeros(self.rows, dtype=torch.int64, device=dev)
        self.last_access = torch.full((self.rows,), FREE, dtype=torch.int32, device=dev)
        self.freq = torch.zeros(self.rows, dtype=torch.uint8, device=dev)
        self.pins = torch.zeros(self.rows, dtype=torch.int32, device=dev)
        self._first_row = torch.tensor(self.first_rows, dtype=torch.int64, device=dev)
        self._first_bucket = self._first_row // b
        self._buckets = torch.tensor([c // b for c in caps], dtype=torch.int64, device=dev)
        self._capacity = torch.tensor(caps, dtype=torch.int64, device=dev)
        params = []
        for spec, first in zip(tables, self.first_rows):
            p = spec.policy
            ttl = -1 if p.ttl_steps is None else p.ttl_steps
            params.append([first, POLICIES.index(p.kind), ttl, p.decay_steps, p.initial_freq, spec.admit_threshold])
        self._params = torch.tensor(params, dtype=torch.int64, device=dev)
        self._log_factor = torch.tensor([s.policy.log_factor for s in tables], dtype=torch.float64, device=dev)
        needs_sketch = any(s.admit_threshold > 1 for s in tables)
        self.sketch = CountMinSketch(sketch_width, sketch_depth, dev) if needs_sketch else None
        # the sketch's multipliers (admission.py's) and shift: the kernel hashes as _cells does
        depth = self.sketch.depth if self.sketch else 1
        self._mult = multipliers(depth, dev)
        self._sketch_dummy = torch.zeros(1, dtype=torch.int32, device=dev)
        # per-batch counts, then the release faults and each table's residents (both persist)
        self._counts = torch.zeros(C_RESIDENT + len(tables), dtype=torch.int64, device=dev)
        self._row_table = torch.repeat_interleave(
            torch.arange(len(tables), device=dev), torch.tensor(caps, device=dev), output_size=self.rows
        )

    # -- the batch -----------------------------------------------------------------------

    def find_or_insert(self, ids: torch.Tensor, sizes: Sequence[int], pin: bool = False) -> Found:
        """Slots for a batch of every table's IDs, admitting and evicting within buckets.

        Args:
            ids: the batch's IDs (any integer dtype, see ids.py), table after table.
            sizes: how many of them each table has (one per table, summing to ids' length).
            pin: every slot the batch uses gets a pin, held until release(found.rows).

        Returns:
            The slots per ID, the rows to release, the admitted and evicted pairs and the counts.

        Raises:
            ValueError: sizes of another length than the tables, or another sum than the IDs.
            OverflowError: the step clock at 2^31 - 1 (last access is int32).
        """
        flat = as_int64_ids(ids).reshape(-1).to(self.device)
        n, n_tables = flat.numel(), len(self.tables)
        if len(sizes) != n_tables or sum(sizes) != n or min(sizes) < 0:
            raise ValueError(f"sizes {list(sizes)} must give each of the {n_tables} tables' IDs, {n} in all")
        if self.step >= (1 << 31) - 1:
            raise OverflowError("the map's step clock is at 2^31 - 1 (last access is int32)")
        dev = self.device
        if n == 0:
            empty = flat[:0]
            none = Rows(empty, empty, empty)
            self.step += 1
            return Found(flat.reshape(ids.shape), empty, none, none, BatchCounts(0, 0, 0, 0, 0, 0, self._faults()))
        # 1. the distinct (table, ID) pairs sorted by bucket (then ID), at the front of n-long
        #    tensors: two stable sorts; a bucket belongs to one table, so (bucket, ID) is the pair
        tab = torch.repeat_interleave(
            torch.arange(n_tables, device=dev), torch.tensor(list(sizes), device=dev), output_size=n
        )
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
        counts[:C_RELEASE_FAULTS].zero_()
        counts[C_DISTINCT : C_DISTINCT + 1].copy_(group[-1:] + 1)
        # 3. the launch
        urow = torch.full((n,), -1, dtype=torch.int64, device=dev)
        uslot = torch.full((n,), -1, dtype=torch.int64, device=dev)
        arank = torch.empty(n, dtype=torch.int32, device=dev)
        erank = torch.empty(n, dtype=torch.int32, device=dev)
        gone = torch.empty(n, dtype=torch.int64, device=dev)
        admitted = torch.empty(3, n, dtype=torch.int64, device=dev)
        evicted = torch.empty(3, n, dtype=torch.int64, device=dev)
        sketch = self.sketch.counts if self.sketch is not None else self._sketch_dummy
        width = self.sketch.width if self.sketch is not None else 1
        _find_or_insert_kernel[(grid,)](
            self.keys, self.last_access, self.freq, self.pins,
            uniq, utab, ubucket, ucount, bstart, self._params, self._log_factor, sketch, self._mult,
            urow, uslot, arank, erank, gone, admitted, evicted, counts,
            self.step, width, 64 - (width.bit_length() - 1), n,
            B=self.bucket_size, DEPTH=self.sketch.depth if self.sketch is not None else 0, PIN=pin, CHUNK=_CHUNK,
        )  # fmt: skip
        slots = uslot[inverse]
        self.step += 1
        # 4. the one copy
        c = to_host(counts[:C_RESIDENT])
        got = BatchCounts(*c[:C_RESIDENT])
        a, e = got.admitted, got.evicted
        return Found(
            slots.reshape(ids.shape),
            urow[: got.distinct],
            Rows(admitted[0, :a], admitted[1, :a], admitted[2, :a]),
            Rows(evicted[0, :e], evicted[1, :e], evicted[2, :e]),
            got,
        )

    def release(self, rows: torch.Tensor, check: bool = False) -> None:
        """Unpin the rows of a batch found with pin=True (its Found.rows; -1 entries skipped).
        A row that was not pinned stays at 0 pins and counts a release fault, which the next
        batch's counts carry (no host copy here).

        Args:
            check: copy the faults to the host now and raise if this call made any.

        Raises:
            ValueError: with check, a row released that was not pinned (released twice?).
        """
        n = rows.numel()
        before = self._faults() if check else 0
        if n:
            held = rows.reshape(-1).to(self.device, torch.int64).contiguous()
            _release_kernel[(triton.cdiv(n, _BLOCK),)](self.pins, held, n, self._counts, BLOCK=_BLOCK)
        if check and self._faults() != before:
            raise ValueError(f"{self._faults() - before} rows released that were not pinned (released twice?)")

    def _faults(self) -> int:
        return int(self._counts[C_RELEASE_FAULTS])

    # -- state -----------------------------------------------------------------------------

    def resident(self) -> list[int]:
        """Resident IDs per table (one host copy)."""
        return to_host(self._counts[C_RESIDENT:])

    def scores(self) -> torch.Tensor:
        """Every row's eviction score under its table's policy at the current step (int64;
        free rows' values mean nothing): what the kernel compares."""
        out = torch.empty(self.rows, dtype=torch.int64, device=self.device)
        _scores_kernel[(triton.cdiv(self.rows, _BLOCK),)](
            self.last_access, self.freq, out, self._row_table, self._params, self.rows, self.step, BLOCK=_BLOCK
        )
        return out

    def export(self) -> Exported:
        """Every resident (table, ID) with its slot, last access and frequency (on the map's
        device), the step and the sketch's state. Pins are not kept: a restored map starts with
        no batch in flight."""
        rows = torch.nonzero(self.last_access != FREE).squeeze(1)
        tables = self._row_table[rows]
        return Exported(
            tables,
            self.keys[rows],
            rows - self._first_row[tables],
            self.last_access[rows].clone(),
            self.freq[rows].clone(),
            self.step,
            None if self.sketch is None else self.sketch.state_dict(),
        )

    def restore(self, state: Exported) -> None:
        """Make the map hold exactly an export's pairs, each at its slot (its row keeps its
        values), with their policy state, the step and the sketch; pins all 0.

        Raises:
            ValueError: a table or slot outside this map, a slot outside the bucket its pair
                hashes to here (another bucket size or table layout), a slot or pair twice, a
                last access outside 0..step, or a sketch of another size. Nothing changed then.
        """
        dev = self.device
        tables, ids, slots = (x.to(dev, torch.int64) for x in (state.tables, state.ids, state.slots))
        last, freq = state.last_access.to(dev, torch.int32), state.freq.to(dev, torch.uint8)
        n = ids.numel()
        if not all(x.shape == (n,) for x in (tables, slots, last, freq)):
            raise ValueError("export's tables, ids, slots, last_access and freq differ in length")
        if n and (int(tables.min()) < 0 or int(tables.max()) >= len(self.tables)):
            raise ValueError(f"export has tables outside 0..{len(self.tables) - 1}")
        if n and bool(((slots < 0) | (slots >= self._capacity[tables])).any()):
            raise ValueError("export has slots outside their table's capacity")
        rows = self._first_row[tables] + slots
        if n and bool((rows // self.bucket_size != bucket_of(tables, ids, self._first_bucket, self._buckets)).any()):
            raise ValueError(
                "export has slots outside the buckets their IDs hash to in this map (another bucket size "
                "or table layout): re-place them with find_or_insert and pull their rows"
            )
        if torch.unique(rows).numel() != n:
            raise ValueError("export holds a slot twice")
        # a pair's bucket is its table's, so (bucket, ID) names the pair
        if n and torch.unique(torch.stack([rows // self.bucket_size, ids], 1), dim=0).shape[0] != n:
            raise ValueError("export holds a (table, ID) pair twice")
        if n and (int(last.min()) < 0 or int(last.max()) > state.step):
            raise ValueError(f"export has a last access outside steps 0..{state.step}")
        if (state.sketch is None) != (self.sketch is None):
            raise ValueError("export's admission sketch and this map's do not match (one has none)")
        if self.sketch is not None and state.sketch is not None:
            self.sketch.load_state_dict(state.sketch)
        self.keys.zero_()
        self.last_access.fill_(FREE)
        self.freq.zero_()
        self.pins.zero_()
        self.keys[rows], self.last_access[rows], self.freq[rows] = ids, last, freq
        self.step = int(state.step)
        self._counts[C_RESIDENT:] = torch.bincount(tables, minlength=len(self.tables))

    @property
    def nbytes(self) -> int:
        """Bytes of per-slot state (the admission sketch apart)."""
        return self.rows * (8 + 4 + 1 + 4)
