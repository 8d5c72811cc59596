"""Build (once per machine and source version, ~2 s) and import the PS's C++ modules: the id
index (csrc/id_index_module.cpp over csrc/id_index.h) and the Redis store's row path
(csrc/redis_rows_module.cpp).

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
_modules: dict[str, ModuleType] = {}


def _load(source: Path, name: str, what: str, depends: tuple[Path, ...]) -> ModuleType:
    with _lock:
        if name not in _modules:
            path = compile_library(source, name, what, depends=depends, python_module=True)
            loader = importlib.machinery.ExtensionFileLoader(name, str(path))
            spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
            if spec is None:
                raise ImportError(f"cannot make an import spec for {what} at {path}")
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            _modules[name] = module
    return _modules[name]


def id_index() -> ModuleType:
    """The id-index module, built and imported on first use."""
    return _load(SOURCE, NAME, "the PS's id index", (CSRC / "id_index.h", COMMON_HASH))


def redis_rows() -> ModuleType:
    """The Redis store's row-path module, built and imported on first use."""
    return _load(CSRC / "redis_rows_module.cpp", "_dynemb_redis_rows", "the Redis store's row path", (COMMON_HASH,))
