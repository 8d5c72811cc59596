"""Admission counting: how often has an ID been seen, in bounded memory.

An ID gets a slot only after it was seen `threshold` times. Keeping a dict of
every ID ever seen grows without bound in an unbounded ID space, so counts live in a
count-min sketch: `depth` rows of `width` counters, each ID hashed to one counter per row;
its estimate is the minimum over the rows. The estimate never undercounts; it overcounts
only when other IDs collide in every row, which `width` makes rare. `halve()` ages every
counter, so IDs seen long ago must be seen again to be admitted.

torch.Tensor in, torch.Tensor out, on the sketch's device (CPU or CUDA); no host round-trips.
"""

from __future__ import annotations

import torch

# Odd 64-bit multipliers, one per sketch row (multiply-shift hashing: the top bits of
# id * a are near-uniform for odd a). Written as signed int64, as torch stores them.
_MULTIPLIERS = (
    0x9E3779B97F4A7C15,
    0xBF58476D1CE4E5B9,
    0x94D049BB133111EB,
    0xD6E8FEB86659FD93,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5,
)
MAX_COUNT = (1 << 31) - 1  # counters saturate here
MAX_DEPTH = len(_MULTIPLIERS)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def multipliers(depth: int, device: torch.device | str) -> torch.Tensor:
    """The hash multipliers of a sketch's first `depth` rows (int64, as torch stores them)."""
    return torch.tensor([_signed(a) for a in _MULTIPLIERS[:depth]], dtype=torch.int64, device=device)


def check_size(width: int, depth: int) -> None:
    """Raise ValueError unless width is a power of two >= 2 and depth in [1, MAX_DEPTH]."""
    if width < 2 or width & (width - 1):
        raise ValueError(f"sketch width must be a power of two >= 2, got {width}")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"sketch depth must be in [1, {MAX_DEPTH}], got {depth}")


class CountMinSketch:
    """Sightings per ID, estimated in depth x width int32 counters (see the module doc).

    Args:
        width: counters per row, a power of two >= 2.
        depth: rows, each with its own hash, 1 to 8.
        device: where the counters live.
        counts: the (depth, width) int32 counters to count in, e.g. a view of an allocation
            many sketches share (bucket_map.py); default: zeros of their own.
    """

    def __init__(
        self,
        width: int = 1 << 20,
        depth: int = 4,
        device: torch.device | str = "cpu",
        counts: torch.Tensor | None = None,
    ) -> None:
        check_size(width, depth)
        self.width, self.depth = width, depth
        self.device = torch.device(device)
        if counts is None:
            counts = torch.zeros(depth, width, dtype=torch.int32, device=self.device)
        elif counts.shape != (depth, width) or counts.dtype != torch.int32:
            got = f"{tuple(counts.shape)} {counts.dtype}"
            raise ValueError(f"sketch counters must be ({depth}, {width}) int32, got {got}")
        self.counts = counts
        self._shift = 64 - (width.bit_length() - 1)
        self._mult = multipliers(depth, self.device)
        # flat index offset of each row, so one index_add_ serves every row
        self._row_base = torch.arange(depth, dtype=torch.int64, device=self.device) * width

    def _cells(self, ids: torch.Tensor) -> torch.Tensor:
        """(depth, n) flat counter indices. The arithmetic shift drags the sign bit along,
        the mask keeps only the product's top log2(width) bits."""
        product = ids.to(self.device, torch.int64).unsqueeze(0) * self._mult.unsqueeze(1)  # wraps mod 2^64
        column = (product >> self._shift) & (self.width - 1)
        return column + self._row_base.unsqueeze(1)

    def add(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Count `counts` (default 1 each) sightings of each id; return each id's estimate after."""
        cells = self._cells(ids)
        if counts is None:
            counts = torch.ones(ids.shape[0], dtype=torch.int32, device=self.device)
        flat = self.counts.view(-1)
        flat.index_add_(0, cells.reshape(-1), counts.to(self.device, torch.int32).repeat(self.depth))
        flat.clamp_(max=MAX_COUNT)
        return flat[cells].amin(dim=0)

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's estimated count (never below its true count), without counting it."""
        return self.counts.view(-1)[self._cells(ids)].amin(dim=0)

    def halve(self) -> None:
        """Age every count: an ID's old sightings weigh half as much."""
        self.counts >>= 1

    @property
    def nbytes(self) -> int:
        """Bytes the counters take."""
        return self.counts.numel() * self.counts.element_size()

    def state_dict(self) -> dict:
        """The sketch's size and a copy of its counters."""
        return {"width": self.width, "depth": self.depth, "counts": self.counts.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters of state_dict(); raises ValueError for another size."""
        if (state["width"], state["depth"]) != (self.width, self.depth):
            raise ValueError(
                f"sketch state is {state['depth']}x{state['width']}, this sketch is {self.depth}x{self.width}"
            )
        self.counts.copy_(state["counts"].to(self.device))
