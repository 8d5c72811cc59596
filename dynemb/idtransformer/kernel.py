"""Build (once per machine and source version, ~30 s, cached by torch) and load the CPU kernel.

The kernel's units, csrc/slot_map.cpp (the slot map and a batch's passes) and csrc/route.cpp
(the sharded exchange's routing), with their headers, compile into one library of torch ops
under `torch.ops.dynemb_idt`, built by torch's own extension builder so that its flags and ABI
match the installed torch. The build's name carries a digest of every source and header, the
flags and torch's version. Set DYNEMB_VERBOSE_BUILD=1 to see the compiler's output.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from dynemb.common.native_build import build_lock, digest, verbose

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3",)
_lock = threading.Lock()
_loaded = False


def files() -> list[Path]:
    """The kernel's sources, then its headers, each in name order."""
    return sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))


def build_name() -> str:
    """The build's name: a digest of every source and header (name and contents), the flags and
    torch's version, so that checkouts of different versions never load each other's build."""
    parts = [f.name.encode() + b"\0" + f.read_bytes() for f in files()]
    return f"dynemb_idt_{digest(*parts, ' '.join(FLAGS).encode(), torch.__version__.encode())}"


def ops():
    """torch.ops.dynemb_idt, built and loaded on first use."""
    global _loaded
    with _lock:
        if not _loaded:
            _build()
            _loaded = True
    return torch.ops.dynemb_idt


def _build() -> None:
    from torch.utils import cpp_extension

    name = build_name()
    build = Path(cpp_extension._get_build_directory(name, verbose=False))
    try:
        with build_lock(build, "the ID transformer's kernel"):
            # built from copies inside the build folder: torch's build.ninja records the
            # sources' paths, so two checkouts of one version (worktrees, copies) building
            # from their own paths would rewrite it and rebuild each other's kernel
            for f in files():
                copy = build / f.name
                if not copy.exists() or copy.read_bytes() != f.read_bytes():
                    copy.write_bytes(f.read_bytes())
            cpp_extension.load(
                name=name,
                sources=[str(build / f.name) for f in files() if f.suffix == ".cpp"],
                build_directory=str(build),
                extra_cflags=list(FLAGS),
                is_python_module=False,
                verbose=verbose(),
            )
    except Exception as e:  # a missing compiler or ninja: say what to install
        raise RuntimeError(
            f"could not build the ID transformer's CPU kernel ({CSRC}): {e}. It needs a C++ "
            f"compiler (g++) and ninja (pip install ninja); set DYNEMB_VERBOSE_BUILD=1 for details"
        ) from e
