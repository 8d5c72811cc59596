"""What counts as an ID: any int64, negative ones included (hashes of raw values are signed
int64); the map keeps no reserved value (its empty marker is on the slot, not the id).

Narrower integer tensors (TorchRec KJTs may carry int32) are widened; uint64 IDs are taken bit
for bit as int64, a one-to-one mapping (those >= 2^63 become negative), so no two IDs share a
slot. Anything else (floats, bool, complex) is refused: rounding would silently merge IDs.
"""

from __future__ import annotations

import torch

_WIDENED = (torch.int8, torch.uint8, torch.int16, torch.int32)
_REINTERPRETED = tuple(getattr(torch, name) for name in ("uint64",) if hasattr(torch, name))


def as_int64_ids(ids: torch.Tensor) -> torch.Tensor:
    """ids as int64 (see the module doc): returned as is, widened, or reinterpreted bit for bit.

    Raises:
        TypeError: ids is not a tensor, or not of an integer dtype.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch tensor of integers, got {type(ids).__name__}")
    if ids.dtype == torch.int64:
        return ids
    if ids.dtype in _WIDENED:
        return ids.to(torch.int64)
    if ids.dtype in _REINTERPRETED:
        return ids.contiguous().view(torch.int64)
    raise TypeError(
        f"ids must be an integer tensor (int64; int8-int32 are widened, uint64 is taken bit for bit), "
        f"got {ids.dtype}: a non-integer id would have to be rounded, merging distinct IDs"
    )
