"""Compaction on the device without a host sync, into a fixed-shape tensor: what the dynamic
tables need where a count is known only on the device (dynemb/tables/dynamic.py: the IDs a
batch left out of their bags).
"""

from __future__ import annotations

import torch


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
