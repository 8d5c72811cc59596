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
