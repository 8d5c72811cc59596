"""Helpers shared by test modules (a test module imports from here, never from another test module)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
               interval: float = 0.02) -> T:
    """Call `condition` until it returns something true, and return that; fail the test when it
    has not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(interval)
    return value


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (a process group's transport loop and workers)."""
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


def leave_process_groups() -> None:
    """End a torchrun worker's distributed part with no gloo thread left running: destroy the
    groups, then collect the cyclic garbage that still holds them (a model, a failed job's
    frames), so that their destructors join their threads while the interpreter is whole. A
    gloo thread that finishes a collective's work during interpreter shutdown takes the GIL and
    aborts the process ("terminate called without an active exception")."""
    import gc

    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()
    left = gloo_threads()
    assert not left, f"gloo threads outlive the process groups: {left}"
