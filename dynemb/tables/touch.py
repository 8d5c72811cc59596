"""Rows resident on this rank are in use: the PS hears so every touch interval.

A PS table whose rows expire (dynemb/ps_server/lifecycle.py) deletes rows no trainer has
written or read for its TTL. A row resident on a device is trained on every step but the PS
sees it only when it is pulled and when it is pushed back; without a word from the trainer a
hot row resident for longer than the TTL would be deleted from the PS (and serving told so).
So each rank sends the IDs it holds of each such table, every touch interval (which the PS
says in its reply), from a thread of its own: the training loop only copies the IDs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

log = logging.getLogger("dynemb.tables")

# Seconds before asking again about a table whose rows do not expire (its lifecycle may change).
UNSET_RECHECK_S = 60.0
# Seconds before trying again after a failed touch.
FAILED_RETRY_S = 10.0


class ResidentToucher:
    """Touches, on the store, the rows resident here of each table whose rows expire.

    Args:
        store: the rows' store (dynemb.tables.row_store.RowStore: its touch()).
        resident: each PS table's name -> a function giving the IDs resident on this rank now
            (called on the thread that calls maybe(), which owns the tables).
        clock: seconds, monotonic (tests move it).
    """

    def __init__(
        self,
        store,
        resident: dict[str, Callable[[], np.ndarray]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.resident = resident
        self.clock = clock
        self.due = dict.fromkeys(resident, 0.0)
        self.every = dict.fromkeys(resident, 0)  # 0: unknown, or the table's rows do not expire
        self.touched = dict.fromkeys(resident, 0)  # rows touched, over the run
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynemb-touch")
        self._pending: Future | None = None

    def maybe(self) -> None:
        """Send the touches that are due (a cheap check when none is); never raises."""
        if self._pending is not None and not self._pending.done():
            return
        now = self.clock()
        due = [t for t, at in self.due.items() if now >= at]
        if not due:
            return
        # the IDs are read here, on the thread that owns the tables; only tables known to
        # expire send them (the others send none, to learn whether they do)
        sends = {t: self.resident[t]() if self.every[t] else np.zeros(0, np.int64) for t in due}
        self._pending = self._pool.submit(self._send, sends, now)

    def _send(self, sends: dict[str, np.ndarray], now: float) -> None:
        for table, ids in sends.items():
            try:
                stored, every = self.store.touch(table, ids)
            except Exception as exc:  # noqa: BLE001 - a touch is advice; training goes on
                log.warning("could not touch %d resident rows of PS table %s (trying again): %s", len(ids), table, exc)
                self.due[table] = now + FAILED_RETRY_S
                continue
            self.touched[table] += stored
            known = self.every[table]
            self.every[table] = every
            # half an interval apart, so a row in use is never older than the PS's keep_s allows;
            # a table just found to expire sends its IDs at once
            self.due[table] = now if every and not known else now + (every / 2 if every else UNSET_RECHECK_S)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
