"""Which backend runs a table's batched pass, and where each may run.

- "kernel": the compiled CPU kernel (csrc/slot_map.cpp); CPU tensors.
- "torch": bulk torch ops over a sorted map (slot_map.SortedSlotMap); any device.
- "triton": a set-associative map in Triton kernels, every table of a batch in one launch
  (bucket_map.py, bucket_tables.py); CUDA, or CPU tensors under Triton's interpreter
  (TRITON_INTERPRET=1, set before triton is first imported), which is how the tests run it
  without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("kernel", "torch", "triton")
# the triton backend's slots a bucket: HierarchicalKV's size (its own test keeps >= 96.4% of the
# global top keys with 128-slot buckets; shared/DESIGN.md has our Zipf figures)
DEFAULT_BUCKET = 128


def triton_available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(device: torch.device) -> None:
    """Raise ValueError unless the triton backend can run on device (see the module doc)."""
    if not triton_available():
        raise ValueError("backend 'triton' needs the triton package (pip install triton), which is not installed")
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return
    if device.type == "cpu":
        raise ValueError(
            "backend 'triton' runs on CUDA; on CPU tensors only under Triton's interpreter "
            "(TRITON_INTERPRET=1 before triton is imported): use backend 'kernel' on CPU"
        )
    raise ValueError(f"backend 'triton' runs on CUDA, not on {device.type}")
