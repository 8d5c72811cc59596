"""Build (once per machine, ~20 s, cached by torch) and load the CPU slot-map kernel.

The kernel (csrc/slot_map.cpp) registers torch ops under `torch.ops.dynemb_idt` (whatever
the build's name, which carries a hash of the source); it is
compiled with torch's own extension builder so its flags and ABI match the installed torch.
Set DYNEMB_VERBOSE_BUILD=1 to see the compiler's output.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from dynemb.common.native_build import build_lock, digest, verbose

SOURCE = Path(__file__).resolve().parent / "csrc" / "slot_map.cpp"
_lock = threading.Lock()
_loaded = False


def ops():
    """torch.ops.dynemb_idt, built and loaded on first use."""
    global _loaded
    with _lock:
        if not _loaded:
            from torch.utils import cpp_extension

            name = f"dynemb_idt_{digest(SOURCE.read_bytes(), torch.__version__.encode())}"
            build = Path(cpp_extension._get_build_directory(name, verbose=False))
            try:
                with build_lock(build, "the ID transformer's kernel"):
                    # built from a copy inside the build folder: torch's build.ninja records the
                    # source's path, so two checkouts of one version (worktrees, copies) building
                    # from their own paths would rewrite it and rebuild each other's kernel
                    source = build / SOURCE.name
                    if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
                        source.write_bytes(SOURCE.read_bytes())
                    cpp_extension.load(
                        name=name,
                        sources=[str(source)],
                        build_directory=str(build),
                        extra_cflags=["-O3"],
                        is_python_module=False,
                        verbose=verbose(),
                    )
            except Exception as e:  # a missing compiler or ninja: say what to install
                raise RuntimeError(
                    f"could not build the ID transformer's CPU kernel ({SOURCE}): {e}. It needs a C++ "
                    f"compiler (g++) and ninja (pip install ninja); set DYNEMB_VERBOSE_BUILD=1 for details"
                ) from e
            _loaded = True
    return torch.ops.dynemb_idt
