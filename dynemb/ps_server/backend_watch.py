"""Health follows the backend: while the store (Redis) cannot be reached the PS reports
NOT_SERVING, so probes and load balancers see it, and SERVING again once the store answers.

A thread pings the store every `interval` seconds; requests keep being taken meanwhile (they
answer UNAVAILABLE while the store is away, which clients retry). Nothing here restarts or
reconnects anything: redis-py reconnects on the next command by itself.

A ping gets PING_TIMEOUT_S to answer before the store counts as away: a Redis cut off by the
network does not refuse, it is silent, and redis-py's own ping would wait out its socket
timeout on each of its tries (~30 s with the PS's defaults). The ping goes on in its thread and
reports the store back when it answers.

After each ping answered, LossWatch asks the store whether it still holds what this PS saw it
hold (Store.lost_data: a marker beside the tables): a Redis restarted without persistence, or
an empty replica promoted, answers pings like any other, and would otherwise be served on
empty, its tables gone and created again by the next trainer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dynemb.ps_server.backends.base import Store
from dynemb.ps_server.errors import PSError

log = logging.getLogger("dynemb.ps")

# how long a ping may take before the store counts as away (a busy Redis answers PING in ms)
PING_TIMEOUT_S = 5.0


class BackendWatch:
    """Pings the store from a thread and reports each change between reachable and not.

    Args:
        store: the store to ping.
        interval: seconds between pings; must be > 0.
        on_change: on_change(up) is called at the first check and at each change.
    """

    def __init__(
        self, store: Store, interval: float, on_change: Callable[[bool], None], loss: LossWatch | None = None
    ) -> None:
        if interval <= 0:
            raise ValueError(f"backend check interval must be > 0 seconds, got {interval}")
        self.store = store
        self.loss = loss
        self.interval = interval
        self.on_change = on_change
        self.up: bool | None = None
        self.reason = ""  # why the store counts as away, while it does
        self.ping_timeout = max(PING_TIMEOUT_S, interval)
        self._ping: _Ping | None = None  # the ping in flight
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-watch", daemon=True)

    def check(self) -> bool:
        """Ping once (or wait on the ping still in flight) for up to ping_timeout; report a
        change of state (logged, and passed to on_change)."""
        with self._lock:
            if self._ping is None:
                self._ping = _Ping(self.store, self.loss)
            ping = self._ping
        if ping.done.wait(self.ping_timeout):
            with self._lock:
                self._ping = None
            up, reason = ping.up, ping.reason
        else:
            up, reason = False, f"it has not answered a ping for {self.ping_timeout:g} s"
        self.reason = reason
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


class LossWatch:
    """Whether the store lost what this PS saw it hold (Store.lost_data), once known for good:
    the PS refuses its store calls from then on (unless the store serves after such a loss) until
    it is restarted, so no table is created anew over the loss.

    Args:
        store: the store.
        on_lost: on_lost(reason), once, when the loss is first found.
    """

    def __init__(self, store: Store, on_lost: Callable[[str], None]) -> None:
        self.store = store
        self.on_lost = on_lost
        self.reason = ""  # why the store counts as having lost its data; "" while it does not
        self._lock = threading.Lock()

    @property
    def refusing(self) -> str:
        """The reason calls are refused for, "" when they are not."""
        return "" if self.store.serves_after_loss else self.reason

    def check(self) -> str:
        """Ask the store (unless a loss is known already); the loss's reason, "" if none. A store
        that cannot be asked now is BackendWatch's to report: "" then."""
        with self._lock:
            if self.reason:
                return self.reason
            try:
                reason = self.store.lost_data()
            except PSError:
                return ""
            except Exception:  # a bug here must not stop the pings that health follows
                log.exception("checking whether backend %s lost its data failed", self.store.kind)
                return ""
            if reason:
                self.reason = reason
                log.error(
                    "backend %s LOST ITS DATA: %s. %s",
                    self.store.kind,
                    reason,
                    "Calls go on (see above)"
                    if self.store.serves_after_loss
                    else "Every call is refused (DATA_LOSS), none creates a table anew: restore the data "
                    "(or accept its loss), then restart this PS",
                )
        if reason:
            self.on_lost(reason)
        return reason


class _Ping:
    """One ping of the store, in a thread of its own: done is set when it answered or failed.
    A ping answered goes on to ask the LossWatch, if given."""

    def __init__(self, store: Store, loss: LossWatch | None = None) -> None:
        self.store = store
        self.loss = loss
        self.up = False
        self.reason = ""
        self.done = threading.Event()
        threading.Thread(target=self._run, name="backend-ping", daemon=True).start()

    def _run(self) -> None:
        try:
            self.store.ping()
            self.up = True
            if self.loss is not None:
                self.loss.check()
        except PSError as exc:
            self.reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - a watcher that dies would leave health stale
            self.reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()
