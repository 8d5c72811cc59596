"""Build (once per machine, ~20 s, cached by torch) and load the CPU slot-map kernel.

The kernel (csrc/slot_map.cpp) registers torch ops under `torch.ops.dynemb_idt` (whatever
the build's name, which carries a hash of the source); it is
compiled with torch's own extension builder so its flags and ABI match the installed torch.
Set DYNEMB_VERBOSE_BUILD=1 to see the compiler's output.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "slot_map.cpp"
_lock = threading.Lock()
_loaded = False


def ops():
    """torch.ops.dynemb_idt, built and loaded on first use."""
    global _loaded
    with _lock:
        if not _loaded:
            from torch.utils import cpp_extension

            # one build folder per source version: checkouts of different versions on one
            # machine (branches, worktrees, upgrades) never load each other's build
            digest = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
            try:
                cpp_extension.load(
                    name=f"dynemb_idt_{digest}",
                    sources=[str(SOURCE)],
                    extra_cflags=["-O3"],
                    is_python_module=False,
                    verbose=os.environ.get("DYNEMB_VERBOSE_BUILD") == "1",
                )
            except Exception as e:  # a missing compiler or ninja: say what to install
                raise RuntimeError(
                    f"could not build the ID transformer's CPU kernel ({SOURCE}): {e}. It needs a C++ "
                    f"compiler (g++) and ninja (pip install ninja); set DYNEMB_VERBOSE_BUILD=1 for details"
                ) from e
            _loaded = True
    return torch.ops.dynemb_idt
