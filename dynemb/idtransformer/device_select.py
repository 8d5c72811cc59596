"""Selections on the device without a host sync, in fixed-shape tensors: what the triton
backend's batched pass (device_transform.py) needs where a count is known only on the device.

- compact: the masked values, in order, at the front of a tensor of fixed length.
- lowest: a mask of the k lowest scores, ties to the lowest index (policy order, as
  transformer._lowest picks them), k a device scalar: a radix select over the scores' 64 bits
  in four 16-bit digits (a histogram and a prefix sum each), O(capacity) with no sort.
"""

from __future__ import annotations

import torch

_DIGIT = 16
_BINS = 1 << _DIGIT
_SIGN = -(1 << 63)


def compact(values: torch.Tensor, mask: torch.Tensor, size: int) -> torch.Tensor:
    """values[mask] at the front of a tensor of `size` (>= mask.sum()); the rest is undefined.

    Args:
        values: 1-d, as long as mask.
        mask: bool, which values to keep.
        size: the length of the result.
    """
    dest = torch.where(mask, torch.cumsum(mask, 0) - 1, size)  # the dropped go to a spare last place
    out = torch.zeros(size + 1, dtype=values.dtype, device=values.device)
    return out.scatter_(0, dest, values)[:size]


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def lowest(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of the k lowest scores, ties going to the lowest index.

    Args:
        scores: int64, 1-d.
        k: 0-dim int64 on scores' device, 0 <= k <= len(scores).

    Returns:
        A bool mask with k entries set.
    """
    key = scores ^ _SIGN  # order-preserving as unsigned: digits compare in the scores' order
    dev = scores.device
    candidate = torch.ones_like(scores, dtype=torch.bool)
    # (1-element tensors, not 0-dim ones: indexing with a 0-dim tensor may read it on the host)
    left = k.reshape(1).clamp(min=1)  # how many candidates are still to take (k = 0: masked at the end)
    threshold = torch.zeros(1, dtype=torch.int64, device=dev)
    for shift in range(64 - _DIGIT, -1, -_DIGIT):
        digit = _lsr(key, shift) & (_BINS - 1)
        hist = torch.zeros(_BINS, dtype=torch.int64, device=dev).index_add_(0, digit, candidate.to(torch.int64))
        below = torch.cumsum(hist, 0)
        b = torch.searchsorted(below, left)  # the first bin reaching `left`
        left = left - (below.gather(0, b) - hist.gather(0, b))
        threshold = threshold | (b << shift)
        candidate &= digit == b
    cut = threshold ^ _SIGN  # the k-th lowest score
    at = scores == cut
    take = (scores < cut) | (at & (torch.cumsum(at, 0) <= left))
    return take & (k > 0)
