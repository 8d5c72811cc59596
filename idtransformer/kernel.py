"""Build (once per machine, ~20 s, cached by torch) and load the CPU slot-map kernel.

The kernel (csrc/slot_map.cpp) registers torch ops under `torch.ops.dynemb_idt` (whatever
the build's name, which carries a hash of the source); it is
compiled with torch's own extension builder so its flags and ABI match the installed torch.
Set DYNEMB_VERBOSE_BUILD=1 to see the compiler's output.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import warnings
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
            name = f"dynemb_idt_{digest}"
            build = Path(cpp_extension._get_build_directory(name, verbose=False))
            try:
                with _build_lock(build):
                    cpp_extension.load(
                        name=name,
                        sources=[str(SOURCE)],
                        build_directory=str(build),
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


class _build_lock:
    """An flock on <build>/dynemb.flock around torch's build.

    torch's own guard is a plain `lock` file that a waiting process polls for forever; a build
    that was killed (machine restart, OOM, Ctrl-C at the wrong moment) leaves it behind and
    every later import hangs. An flock dies with its holder, so while we hold it no other
    dynemb process is building here and a leftover `lock` can only be stale: remove it.
    """

    def __init__(self, build: Path) -> None:
        self.build = build

    def __enter__(self):
        self.build.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.build / "dynemb.flock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        stale = self.build / "lock"
        if stale.exists():
            warnings.warn(f"removing {stale}, left by a build of the ID transformer's kernel that was cut off")
            stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
