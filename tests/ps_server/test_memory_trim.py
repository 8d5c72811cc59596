"""The PS hands freed C-heap memory back to the OS (memory_trim.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from dynemb.ps_server.memory_trim import MemoryTrim
from dynemb.ps_server.server import PSServer, ServeConfig

# 200,000 freed blocks of ~1 KiB (malloc's, not Python's small-object arenas) under a live one,
# so glibc cannot give them back by shrinking the heap's top: only a trim returns them
_FREED_UNDER_A_LIVE_BLOCK = textwrap.dedent(
    """
    import os
    from dynemb.ps_server.memory_trim import MemoryTrim

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

    blocks = [bytes(1000) + bytes([i & 255]) for i in range(200_000)]
    live = bytes(2000)
    del blocks
    before = rss_mib()
    MemoryTrim().trim()
    print(before, rss_mib())
    """
)


def test_a_trim_gives_freed_memory_back() -> None:
    assert MemoryTrim().available, "this image's C library is glibc: the PS's trim must work here"
    out = subprocess.run([sys.executable, "-c", _FREED_UNDER_A_LIVE_BLOCK], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert before - after >= 100, f"RSS {before} MiB before the trim, {after} MiB after: the ~200 MiB freed stayed"


def test_a_ps_trims_while_it_serves() -> None:
    server = PSServer(ServeConfig(address="127.0.0.1:0", metrics_port=None, sweep_every_seconds=0)).start()
    try:
        assert any(t.name == "ps-malloc-trim" and t.is_alive() for t in threading.enumerate())
    finally:
        server.stop(grace=0)
    server.memory_trim._thread.join(timeout=10)  # noqa: SLF001 - the thread ends within one wait
    assert not server.memory_trim._thread.is_alive()  # noqa: SLF001
