"""Build (once per machine and source version, ~30 s, cached by torch) and load the CPU kernel.

The kernel's units, csrc/slot_map.cpp (the slot map and a batch's passes) and csrc/route.cpp
(the sharded exchange's routing), with their headers, compile into one library of torch ops
under `torch.ops.dynemb_idt`, built by torch's own extension builder so that its flags and ABI
match the installed torch. The build's name carries a digest of every source and header, the
flags and torch's version. Set DYNEMB_VERBOSE_BUILD=1 to see the compiler's output.

What Python and the kernel share is defined in the C++ once and read from the extension here:
ops() has the status codes and policy kinds (IntEnums), the settings' order, transform_many's
info columns, and gives each op's named returns (its schema's) as a named tuple.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch

from dynemb.common.native_build import build_lock, digest, verbose

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON_CSRC = Path(__file__).resolve().parents[1] / "common" / "csrc"  # hash.h, shared with the PS's id index
FLAGS = ("-O3",)  # no OpenMP: the kernel runs on the calling thread (bench/RESULTS.md says why)
_lock = threading.Lock()
_ops: KernelOps | None = None


def files() -> list[Path]:
    """The kernel's sources, then its headers (its own, then the shared ones), each in name order;
    they are copied into one build folder, so every include is by bare name."""
    return sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")) + sorted(COMMON_CSRC.glob("*.h"))


def build_name() -> str:
    """The build's name: a digest of every source and header (name and contents), the flags and
    torch's version, so that checkouts of different versions never load each other's build."""
    parts = [f.name.encode() + b"\0" + f.read_bytes() for f in files()]
    return f"dynemb_idt_{digest(*parts, ' '.join(FLAGS).encode(), torch.__version__.encode())}"


class KernelOps:
    """torch.ops.dynemb_idt and the names its C++ defines (its `names` op): Status and Kind
    (IntEnums of the status codes and policy kinds), Info (a named tuple of one row of
    transform_many's info) and `settings` (a table's settings in the ops' order). An op whose
    schema names its returns gives them as a named tuple of those names."""

    def __init__(self, namespace) -> None:
        self._namespace = namespace
        names = namespace.names
        self.Status: Any = _enum("Status", names("status"))
        self.Kind: Any = _enum("Kind", names("kind"))
        self.Info: Any = _record("Info", names("info"))
        self.settings_fields = tuple(names("settings"))

    def __getattr__(self, name: str) -> Any:
        op = getattr(self._namespace, name)
        returns = [r.name for r in op.default._schema.returns]
        call = op
        if len(returns) > 1 and all(returns):
            record = _record(f"{name}_returns", returns)

            def call(*args):
                return record(*op(*args))

        setattr(self, name, call)  # found once
        return call

    def settings(self, **values: int) -> list[int]:
        """A table's settings, given by name (settings_fields, all of them), in the ops' order."""
        if values.keys() != set(self.settings_fields):
            raise ValueError(f"the kernel's settings are {self.settings_fields}, not {tuple(values)}")
        return [int(values[field]) for field in self.settings_fields]


def _enum(name: str, names: list[str]) -> Any:
    """An IntEnum of the names, each coded by its position, as the C++ enum codes them."""
    return IntEnum(name, [(n, code) for code, n in enumerate(names)])


def _record(name: str, fields: list[str]) -> Any:
    """A named tuple type of these fields."""
    return namedtuple(name, fields)


def ops() -> KernelOps:
    """The kernel's ops, built and loaded on first use."""
    global _ops
    with _lock:
        if _ops is None:
            _build()
            _ops = KernelOps(torch.ops.dynemb_idt)
    return _ops


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
