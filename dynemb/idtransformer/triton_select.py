"""The row scans of the triton backend's pass over many tables (device_transform.py): each
table's eviction scores and movable rows, its k lowest scores (the victims), and its lowest
free rows (for the admitted), every table at once, k and the counts on the device.

The tables' records tile one allocation in regions of whole blocks (device_tables.py), so a
program's block belongs to one table: `block_table` says which, and the program reads that
table's row of `params` (in the order of the call's tables; the space's tables that are not in
the call are skipped: `in_call` maps a space index to the call's, -1 for none). Rows past a
table's capacity (its region's padding) are never scored and never free.

Victims: a radix select over the scores' 64 bits (sign flipped, so they order as unsigned) in
eight 8-bit digits, per table, O(rows), no sort and no host sync. Each pass counts its digit's
histogram per block (tl.histogram) and adds it to its table's with one atomic per bin and block:
scores cluster (LRU's are recent steps, the unmovable rows all at the top), so one atomic per
score would pile onto a few bins. Two launches per pass; then a tally per block and the victims
written in row order (ties to the lowest row, as transformer._lowest picks them) at their
table's place in the output. The free rows are written the same way, block by block, a block
scanned only when its table still wants rows from it: `free_count` keeps each block's free rows
(the victims add theirs, the admitted take theirs), so the blocks before it are known without
reading them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynemb.idtransformer.triton_map import lsr  # a logical shift right of int64

ROWS_PER_BLOCK = 1024  # a table's region is a whole number of these (device_tables.py)
_SIGN = -(1 << 63)
_BINS = 256
_TOP = (1 << 63) - 1
_FREQ_SHIFT = 40  # as policy._FREQ_SHIFT

# the columns of the per-table params (int64, one row per table of the call); the first three
# are the map's geometry (triton_map), the rest the pass's (device_transform.py fills them)
(MAP_START, MAP_SIZE, FIRST, CAP, STEP, NEED, KIND, DECAY, TTL, INIT_FREQ, LOG_FACTOR, EVICT_MIN, FREE_NOW) = range(13)
(BASE, SIZE, SKETCH_START, SKETCH_BITS, SKETCH_DEPTH, THRESHOLD) = range(13, 19)
PARAMS = 19
KINDS = ("lru", "lfu", "hybrid")


@triton.jit
def _spread(flag, like):
    """A program's scalar flag as a lane mask shaped like `like` (the interpreter refuses a
    scalar bool & a tensor of them)."""
    return (like * 0 + flag.to(tl.int64)) > 0


@triton.jit
def _block_of(block_table, in_call, policy, NP: tl.constexpr):
    """(the call's index of this program's table (-1: not in the call), its first row, capacity)."""
    c = tl.load(in_call + tl.load(block_table + tl.program_id(0)))
    row0 = tl.load(policy + NP * tl.maximum(c, 0) + 2)
    cap = tl.load(policy + NP * tl.maximum(c, 0) + 3)
    return c, row0, cap


@triton.jit
def _score_kernel(
    meta32, meta8, block_table, in_call, policy, scores_ptr, movable_ptr, NP: tl.constexpr, BLOCK: tl.constexpr
):
    """Each row's eviction score (policy.EvictionPolicy.scores), the top one where the row is not
    movable (free, used at this step, pinned, padding); written only for the tables that may need
    room (the others' are never read); adds each table's movable rows to movable_ptr[table]."""
    c, row0, cap = _block_of(block_table, in_call, policy, NP)
    p = policy + NP * tl.maximum(c, 0)
    step, need, kind = tl.load(p + 4), tl.load(p + 5), tl.load(p + 6)
    decay, ttl = tl.load(p + 7), tl.load(p + 8)
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    on = _spread((c >= 0) & (need > 0), row)  # only such blocks' scores are read (the select skips the rest)
    real = (row - row0 < cap) & on
    last = tl.load(meta32 + 4 * row + 2, mask=real, other=-1).to(tl.int64)
    freq = tl.load(meta8 + 16 * row + 12, mask=real, other=0).to(tl.int64)
    pins = tl.load(meta8 + 16 * row + 13, mask=real, other=1)
    movable = real & (last != -1) & (last != step) & (pins == 0)
    idle = step - last
    decayed = tl.maximum(freq - idle // decay, 0)
    f = tl.where(kind == 2, decayed, freq)
    score = tl.where(kind == 0, last, (f << 40) + last)
    score = tl.where((ttl >= 1) & (idle > ttl), last - 4611686018427387904, score)  # (2^62)
    tl.store(scores_ptr + row, tl.where(movable, score, 9223372036854775807), mask=on)
    tl.atomic_add(movable_ptr + tl.maximum(c, 0), tl.sum(movable.to(tl.int64), 0), mask=c >= 0)


@triton.jit
def _histogram_kernel(
    scores_ptr, block_table, in_call, k_ptr, state_ptr, hist_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr
):
    """Counts, per 8-bit digit at SHIFT, the scores of the table's rows whose higher digits
    equal the prefix chosen so far (state[table, 1]); the others go to a bin past the 256 that
    count. A table with nothing to take is skipped."""
    c = tl.load(in_call + tl.load(block_table + tl.program_id(0)))
    cc = tl.maximum(c, 0)
    active = (c >= 0) & (tl.load(k_ptr + cc) > 0)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = _spread(active, offs)
    key = tl.load(scores_ptr + offs, mask=live, other=0) ^ (-9223372036854775807 - 1)  # sign flipped
    digit = lsr(key, SHIFT) & 255
    if SHIFT + 8 < 64:
        prefix = tl.load(state_ptr + 2 * cc + 1)
        live = live & (lsr(key, SHIFT + 8) == lsr(prefix, SHIFT + 8))
    counts = tl.histogram(tl.where(live, digit, 256).to(tl.int32), 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + 256 * cc + bins, counts.to(tl.int64), mask=(bins < 256) & _spread(active, bins))


@triton.jit
def _pick_kernel(state_ptr, hist_ptr, SHIFT: tl.constexpr):
    """One program per table: the first bin whose running count reaches state[t, 0] (how many
    are still to take) joins the prefix (state[t, 1]); state[t, 0] drops by the counts below
    it; the histogram is zeroed for the next pass."""
    t = tl.program_id(0)
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + 256 * t + bins)
    running = tl.cumsum(hist, 0)
    left = tl.load(state_ptr + 2 * t)
    below = running < left
    b = tl.sum(below.to(tl.int64), 0)
    skipped = tl.sum(tl.where(below, hist, 0), 0)
    tl.store(state_ptr + 2 * t, left - skipped)
    tl.store(state_ptr + 2 * t + 1, tl.load(state_ptr + 2 * t + 1) | (b << SHIFT))
    tl.store(hist_ptr + 256 * t + bins, tl.zeros([256], tl.int64))


@triton.jit
def _cut(scores_ptr, block_table, in_call, k_ptr, state_ptr, BLOCK: tl.constexpr):
    """This block's scores, and which are below its table's k-th lowest (the cut) or at it."""
    c = tl.load(in_call + tl.load(block_table + tl.program_id(0)))
    cc = tl.maximum(c, 0)
    active = (c >= 0) & (tl.load(k_ptr + cc) > 0)
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = _spread(active, row)
    score = tl.load(scores_ptr + row, mask=live, other=0)
    cut = tl.load(state_ptr + 2 * cc + 1) ^ (-9223372036854775807 - 1)
    return cc, row, live & (score < cut), live & (score == cut)


@triton.jit
def _tally_kernel(scores_ptr, block_table, in_call, k_ptr, state_ptr, below_ptr, at_ptr, BLOCK: tl.constexpr):
    """Per block: how many of its scores are below its table's cut, and how many at it."""
    _, _, below, at = _cut(scores_ptr, block_table, in_call, k_ptr, state_ptr, BLOCK)
    tl.store(below_ptr + tl.program_id(0), tl.sum(below.to(tl.int64), 0))
    tl.store(at_ptr + tl.program_id(0), tl.sum(at.to(tl.int64), 0))


@triton.jit
def _victims_kernel(
    scores_ptr, block_table, in_call, k_ptr, state_ptr, at_before, out_at, out_ptr, free_count, BLOCK: tl.constexpr
):
    """Every row below the cut and the first state[t, 0] of those at it (at_before: the table's
    rows at the cut in the blocks before this one) to out_ptr from out_at[block] on, in row
    order; the block's free count grows by as many."""
    cc, row, below, at = _cut(scores_ptr, block_table, in_call, k_ptr, state_ptr, BLOCK)
    at_rank = tl.load(at_before + tl.program_id(0)) + tl.cumsum(at.to(tl.int64), 0) - 1
    take = below | (at & (at_rank < tl.load(state_ptr + 2 * cc)))
    rank = tl.cumsum(take.to(tl.int64), 0) - 1
    tl.store(out_ptr + tl.load(out_at + tl.program_id(0)) + rank, row, mask=take)
    tl.atomic_add(free_count + tl.program_id(0), tl.sum(take.to(tl.int32), 0))


@triton.jit
def _free_kernel(
    meta32, block_table, in_call, policy, free_count, free_before, want_ptr, out_base, out_ptr,
    NP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The table's lowest free rows, as many as want_ptr[table], to out_ptr from out_base[table]
    on, in row order; a block is read only if its table wants some of its free rows
    (free_before: the table's free rows in the blocks before it). Its free count drops by those taken."""
    c, row0, cap = _block_of(block_table, in_call, policy, NP)
    cc = tl.maximum(c, 0)
    before = tl.load(free_before + tl.program_id(0))
    want = tl.load(want_ptr + cc)
    active = (c >= 0) & (before < want) & (tl.load(free_count + tl.program_id(0)) > 0)
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    real = _spread(active, row) & (row - row0 < cap)
    free = real & (tl.load(meta32 + 4 * row + 2, mask=real, other=0) == -1)
    rank = before + tl.cumsum(free.to(tl.int64), 0) - 1
    take = free & (rank < want)
    tl.store(out_ptr + tl.load(out_base + cc) + rank, row, mask=take)
    tl.atomic_add(free_count + tl.program_id(0), -tl.sum(take.to(tl.int32), 0))


def _before_in_table(per_block: torch.Tensor, first_block: torch.Tensor) -> torch.Tensor:
    """Per block, the sum of per_block over the blocks of its table before it (first_block:
    per block, its table's first block)."""
    running = torch.cumsum(per_block, 0) - per_block
    return running - running[first_block]


class RowScan:
    """The row scans over one DeviceTables' records for one call's tables (see the module doc).

    Args:
        records: the (rows + 1, 2) int64 records (the last row the spare).
        block_table: per block of rows, its table's index in the space (int64).
        first_block: per block, the first block of its table (int64).
        in_call: per table of the space, its index among the call's tables, -1 if none (int64).
        params: (tables of the call, PARAMS) int64, contiguous.
    """

    def __init__(
        self,
        records: torch.Tensor,
        block_table: torch.Tensor,
        first_block: torch.Tensor,
        in_call: torch.Tensor,
        params: torch.Tensor,
    ) -> None:
        self.meta32 = records.view(torch.int32)
        self.meta8 = records.view(torch.uint8)
        self.block_table, self.first_block, self.in_call, self.params = block_table, first_block, in_call, params
        self.blocks = block_table.numel()
        self.rows = self.blocks * ROWS_PER_BLOCK

    def scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's eviction score, the top one where not movable; each call table's movable rows)."""
        dev = self.params.device
        scores = torch.empty(self.rows, dtype=torch.int64, device=dev)
        movable = torch.zeros(self.params.shape[0], dtype=torch.int64, device=dev)
        _score_kernel[(self.blocks,)](
            self.meta32, self.meta8, self.block_table, self.in_call, self.params, scores, movable, PARAMS,
            ROWS_PER_BLOCK,
        )  # fmt: skip
        return scores, movable

    def victims(
        self, scores: torch.Tensor, k: torch.Tensor, out_base: torch.Tensor, size: int, free_count: torch.Tensor
    ) -> torch.Tensor:
        """Each call table's k[t] lowest-scoring rows (ties to the lowest row), in row order, at
        out_base[t] on of a tensor of `size` (the rest undefined); adds them to free_count."""
        dev, tables = scores.device, k.numel()
        state = torch.zeros(tables, 2, dtype=torch.int64, device=dev)  # (left to take, prefix in key space)
        state[:, 0] = k.clamp(min=1)
        hist = torch.zeros(tables, _BINS, dtype=torch.int64, device=dev)
        grid = (self.blocks,)
        for shift in range(64 - 8, -1, -8):
            _histogram_kernel[grid](scores, self.block_table, self.in_call, k, state, hist, shift, ROWS_PER_BLOCK)
            _pick_kernel[(tables,)](state, hist, shift)
        below = torch.empty(self.blocks, dtype=torch.int64, device=dev)
        at = torch.empty_like(below)
        _tally_kernel[grid](scores, self.block_table, self.in_call, k, state, below, at, ROWS_PER_BLOCK)
        at_before = _before_in_table(at, self.first_block)
        table = self.in_call[self.block_table].clamp(min=0)
        taken_at = torch.minimum((state[table, 0] - at_before).clamp(min=0), at)
        out_at = out_base[table] + _before_in_table(below + taken_at, self.first_block)
        out = torch.empty(size + 1, dtype=torch.int64, device=dev)
        _victims_kernel[grid](
            scores, self.block_table, self.in_call, k, state, at_before, out_at, out, free_count, ROWS_PER_BLOCK
        )
        return out[:size]

    def free_rows(
        self, free_count: torch.Tensor, want: torch.Tensor, out_base: torch.Tensor, size: int
    ) -> torch.Tensor:
        """Each call table's want[t] lowest free rows, in row order, at out_base[t] on of a
        tensor of `size` (the rest undefined); takes them from free_count (they are to be filled)."""
        free_before = _before_in_table(free_count.to(torch.int64), self.first_block)
        out = torch.empty(size + 1, dtype=torch.int64, device=free_count.device)
        _free_kernel[(self.blocks,)](
            self.meta32, self.block_table, self.in_call, self.params, free_count, free_before, want, out_base, out,
            PARAMS, ROWS_PER_BLOCK,
        )  # fmt: skip
        return out[:size]


def lowest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of the k lowest scores of one table, ties going to the lowest index (the radix
    select on its own, for its tests).

    Args:
        scores: int64, 1-d.
        k: 0-dim int64 on scores' device, 0 <= k <= len(scores).
    """
    n, dev = scores.numel(), scores.device
    blocks = max(1, triton.cdiv(n, ROWS_PER_BLOCK))
    padded = torch.full((blocks * ROWS_PER_BLOCK,), _TOP, dtype=torch.int64, device=dev)
    padded[:n] = scores
    zeros = torch.zeros(blocks, dtype=torch.int64, device=dev)
    params = torch.zeros(1, PARAMS, dtype=torch.int64, device=dev)
    scan = RowScan(torch.zeros(1, 2, dtype=torch.int64, device=dev), zeros, zeros, zeros[:1], params)
    free_count = torch.zeros(blocks, dtype=torch.int32, device=dev)
    rows = scan.victims(padded, k.reshape(1), zeros[:1], n, free_count)
    mask = torch.zeros(n + 1, dtype=torch.bool, device=dev)
    mask[torch.where(torch.arange(n, device=dev) < k, rows, n)] = True
    return mask[:n]
