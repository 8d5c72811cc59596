"""Health follows the backend: while the store (Redis) cannot be reached the PS reports
NOT_SERVING, so probes and load balancers see it, and SERVING again once the store answers.

A thread pings the store every `interval` seconds; requests keep being taken meanwhile (they
answer UNAVAILABLE while the store is away, which clients retry). Nothing here restarts or
reconnects anything: redis-py reconnects on the next command by itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dynemb.ps_server.backends.base import Store
from dynemb.ps_server.errors import PSError

log = logging.getLogger("dynemb.ps")


class BackendWatch:
    """Pings the store from a thread and reports each change between reachable and not.

    Args:
        store: the store to ping.
        interval: seconds between pings; must be > 0.
        on_change: on_change(up) is called at the first check and at each change.
    """

    def __init__(self, store: Store, interval: float, on_change: Callable[[bool], None]) -> None:
        if interval <= 0:
            raise ValueError(f"backend check interval must be > 0 seconds, got {interval}")
        self.store = store
        self.interval = interval
        self.on_change = on_change
        self.up: bool | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-watch", daemon=True)

    def check(self) -> bool:
        """Ping once; report a change of state (logged, and passed to on_change)."""
        try:
            self.store.ping()
            up, reason = True, ""
        except PSError as exc:
            up, reason = False, str(exc)
        except Exception as exc:  # noqa: BLE001 - a watcher that dies would leave health stale
            up, reason = False, f"{type(exc).__name__}: {exc}"
        if up != self.up:
            if up:
                log.info("backend %s reachable: SERVING", self.store.kind)
            else:
                log.warning("backend %s unreachable: NOT_SERVING until it is back (%s)", self.store.kind, reason)
            self.up = up
            self.on_change(up)
        return up

    def start(self) -> BackendWatch:
        """Start the pinging thread; returns self."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def stop(self) -> None:
        """Stop the thread and wait for it (at most interval + 15 seconds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 15)
