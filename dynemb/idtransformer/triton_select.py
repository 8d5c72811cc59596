"""The k lowest scores on the device, ties to the lowest index (policy order, as
transformer._lowest picks them), k a device scalar: a radix select over the scores' 64 bits
(sign flipped, so they order as unsigned) in eight 8-bit digits, O(capacity), no sort and no
host sync. Each pass counts its digit's histogram per block (tl.histogram) and adds it to the
global one with one atomic per bin and block: scores cluster (LRU's are recent steps, the
unmovable slots all at the top), so one atomic per score would pile onto a few bins. Two
launches per pass; then the scores below the k-th and the first of those equal to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dynemb.idtransformer.triton_map import lsr  # a logical shift right of int64

_SIGN = -(1 << 63)
_BLOCK = 1024
_BINS = 256


@triton.jit
def _histogram_kernel(scores_ptr, state_ptr, hist_ptr, n, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Counts, per 8-bit digit at SHIFT, the scores whose higher digits equal the prefix
    chosen so far (state[1]); the others go to a bin past the 256 that count."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(scores_ptr + offs, mask=live, other=0) ^ (-9223372036854775807 - 1)  # sign flipped
    digit = lsr(key, SHIFT) & 255
    if SHIFT + 8 < 64:
        prefix = tl.load(state_ptr + 1)
        live = live & (lsr(key, SHIFT + 8) == lsr(prefix, SHIFT + 8))
    counts = tl.histogram(tl.where(live, digit, 256).to(tl.int32), 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + bins, counts.to(tl.int64), mask=bins < 256)


@triton.jit
def _pick_kernel(state_ptr, hist_ptr, SHIFT: tl.constexpr):
    """One program: the first bin whose running count reaches state[0] (how many are still to
    take) joins the prefix (state[1]); state[0] drops by the counts below it; the histogram is
    zeroed for the next pass."""
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + bins)
    running = tl.cumsum(hist, 0)
    left = tl.load(state_ptr)
    below = running < left
    b = tl.sum(below.to(tl.int64), 0)
    skipped = tl.sum(tl.where(below, hist, 0), 0)
    tl.store(state_ptr, left - skipped)
    tl.store(state_ptr + 1, tl.load(state_ptr + 1) | (b << SHIFT))
    tl.store(hist_ptr + bins, tl.zeros([256], tl.int64))


def lowest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of the k lowest scores, ties going to the lowest index.

    Args:
        scores: int64, 1-d, contiguous.
        k: 0-dim int64 on scores' device, 0 <= k <= len(scores).

    Returns:
        A bool mask with k entries set.
    """
    n, dev = scores.numel(), scores.device
    state = torch.zeros(2, dtype=torch.int64, device=dev)  # (left to take, the prefix in key space)
    state[0] = k.clamp(min=1)
    hist = torch.zeros(_BINS, dtype=torch.int64, device=dev)
    grid = (max(1, triton.cdiv(n, _BLOCK)),)
    for shift in range(64 - 8, -1, -8):
        _histogram_kernel[grid](scores, state, hist, n, shift, _BLOCK)
        _pick_kernel[(1,)](state, hist, shift)
    cut = state[1] ^ _SIGN  # the k-th lowest score
    at = scores == cut
    take = (scores < cut) | (at & (torch.cumsum(at, 0) <= state[0]))
    return take & (k > 0)
