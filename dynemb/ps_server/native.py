"""Build (once per machine and source version, ~2 s) and import the id index's C++ module
(csrc/id_index_module.cpp over csrc/id_index.h).

A plain CPython extension rather than a torch extension: a PS with the embedded store then
starts without importing torch (seconds and ~180 MB per process), and a call costs well
under a microsecond.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import threading
from pathlib import Path
from types import ModuleType

from dynemb.common.native_build import compile_library

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON_HASH = Path(__file__).resolve().parents[1] / "common" / "csrc" / "hash.h"  # shared with the kernel
SOURCE = CSRC / "id_index_module.cpp"
NAME = "_dynemb_id_index"  # the module's PyInit_ name
_lock = threading.Lock()
_module: ModuleType | None = None


def id_index() -> ModuleType:
    """The id-index module, built and imported on first use."""
    global _module
    with _lock:
        if _module is None:
            path = compile_library(
                SOURCE, NAME, "the PS's id index", depends=(CSRC / "id_index.h", COMMON_HASH), python_module=True
            )
            loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
            spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
            if spec is None:
                raise ImportError(f"cannot make an import spec for the id index module at {path}")
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            _module = module
    return _module
