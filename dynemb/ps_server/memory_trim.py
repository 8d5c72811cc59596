"""Give the C heap's freed memory back to the OS now and then (glibc's malloc_trim).

glibc keeps memory freed by a request's buffers (gRPC messages, numpy arrays, RocksDB's blocks)
in its arenas, one per thread that allocated it, and returns only what lies at an arena's top.
A PS answers from many threads, so its resident memory drifts up by what its busiest moments
freed and stays there: a disk PS over 2*10^6 rows held 239-257 MiB after the disk bench's pulls
and pushes, 144-154 MiB with a trim every 2 s (bench/RESULTS.md, disk_bench). malloc_trim(0)
hands back every free page of every arena; no library wraps it (it is glibc's alone), hence
ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# seconds between trims: a trim walks the arenas' free lists and returns their pages (16 ms for
# 200 MiB freed in 1 KiB blocks, measured here), so one every few seconds costs a PS nothing seen
TRIM_SECONDS = 5.0


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class MemoryTrim:
    """A daemon thread that calls malloc_trim(0) every `seconds` until stopped.

    Args:
        seconds: between two trims.
    """

    def __init__(self, seconds: float = TRIM_SECONDS) -> None:
        self.seconds = seconds
        self._trim = _malloc_trim()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        """Whether this C library can trim (glibc)."""
        return self._trim is not None

    def trim(self) -> bool:
        """Trim once; whether any memory went back to the OS."""
        return bool(self._trim(0)) if self._trim is not None else False

    def start(self) -> MemoryTrim:
        """Start trimming in the background (nothing where the C library cannot)."""
        if self._trim is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ps-malloc-trim", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (it ends within one wait)."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.seconds):
            self.trim()
