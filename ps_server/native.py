"""Build (once per machine and source version, ~2 s) and load csrc/id_index.cpp with ctypes.

A plain shared library rather than a torch extension: a PS with the embedded store then
starts without importing torch (seconds and ~180 MB per process), and a call costs about
a microsecond. ctypes releases the GIL for the length of each call.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from dynemb.native_build import compile_library

SOURCE = Path(__file__).resolve().parent / "csrc" / "id_index.cpp"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_P, _I64, _U64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int
_SIGNATURES = {  # name: (restype, argtypes), as declared in csrc/id_index.cpp
    "idx_new": (_P, [_I64, _U64]),
    "idx_free": (None, [_P]),
    "idx_size": (_I64, [_P]),
    "idx_capacity": (_I64, [_P]),
    "idx_nbytes": (_I64, [_P]),
    "idx_lookup": (_I64, [_P, _P, _I64, _P, _P]),
    "idx_insert": (_INT, [_P, _P, _P, _I64, _P, _P]),
    "idx_remove": (_I64, [_P, _P, _I64, _P]),
    "idx_items": (_I64, [_P, _P, _P, _I64]),
    "idx_clear": (None, [_P]),
}


def lib() -> ctypes.CDLL:
    """The id-index library, built and loaded on first use."""
    global _lib
    with _lock:
        if _lib is None:
            path = compile_library(SOURCE, "dynemb_id_index", "the PS's id index")
            loaded = ctypes.CDLL(str(path))
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib = loaded
    return _lib
