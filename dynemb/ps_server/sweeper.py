"""The sweeper: deletes a table's expired rows in bounded slices (dynemb/ps_server/lifecycle.py).

One PS thread sweeps every table whose rows expire, one pass each per `every_s`; of all PS
processes over one store, only the holder of a table's sweep lease sweeps it (a PS that dies
loses its lease when it runs out). A pass is slices of about `slice_rows` rows, each its own
short step on the store, with a pause after each that keeps the sweep to a share of the time
(`duty`), so that pulls and pushes go on in between: a slice reads its rows in this process,
which the PS's request threads share (bench/expiry_bench.py measures what pulls see).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from dynemb.common.arrays import unique_counts
from dynemb.ps_server.backends.base import Store
from dynemb.ps_server.errors import PSError, TableNotFound
from dynemb.ps_server.lifecycle import now_stamp

log = logging.getLogger("dynemb.ps")

SLICE_ROWS = 1024
MAX_PASS_EVERY_S = 3600.0
# Seconds after start before the first check of the tables (then every every_s / 4).
FIRST_CHECK_S = 1.0
# The share of the time a pass sweeps: after a slice of d seconds it pauses d * (1 - DUTY) / DUTY.
DUTY = 0.25


class SweepResult(NamedTuple):
    """One pass over one table.

    Attributes:
        table: the table.
        finished: when the pass ended (Unix seconds).
        seconds: how long it took.
        scanned: rows looked at.
        deleted: rows deleted (expired by the TTL or over the cap).
        before: the stamp rows older than were deleted (0: none were due).
        rows_over_cap: rows still over the cap after the pass (all younger than keep_s).
        oldest: the oldest stamp among the rows kept (0: none kept, or no pass made).
    """

    table: str
    finished: float
    seconds: float
    scanned: int
    deleted: int
    before: int
    rows_over_cap: int
    oldest: int = 0


def cap_cutoff(store: Store, table: str, excess: int, slice_rows: int, should_stop: Callable[[], bool]) -> int:
    """The stamp below which about `excess` rows of the table lie (a pass over its stamps,
    counted per second, so that memory stays small whatever the table's size)."""
    counts: Counter[int] = Counter()
    cursor = 0
    while True:
        cursor, stamps = store.stamps_slice(table, cursor, slice_rows)
        values, n = unique_counts(stamps)
        counts.update(dict(zip(values.tolist(), n.tolist())))
        if cursor == 0 or should_stop():
            break
    total = 0
    for stamp in sorted(counts):
        total += counts[stamp]
        if total >= excess:
            return stamp + 1
    return max(counts, default=-1) + 1


def sweep_table(
    store: Store,
    table: str,
    *,
    now: float | None = None,
    slice_rows: int = SLICE_ROWS,
    duty: float = 1.0,
    should_stop: Callable[[], bool] = lambda: False,
    on_slice: Callable[[], None] = lambda: None,
) -> SweepResult:
    """One pass over the table: delete what its TTL expired and what is over its cap.

    Args:
        store: the store.
        table: the table.
        now: the time the pass is for (default: now).
        slice_rows: rows a slice looks at.
        duty: the share of the pass's time spent in slices (1.0: no pauses).
        should_stop: checked between slices; True ends the pass early.
        on_slice: called between slices (the sweeper renews its lease there).

    Raises:
        TableNotFound: the table was dropped.
    """
    started = time.time()
    now = started if now is None else now
    lifecycle = store.lifecycle(table)
    before = lifecycle.expired_before(now)
    if before and lifecycle.since >= before:
        before = 0  # stamps count from `since`: nothing is older than the TTL yet
    excess = 0
    if lifecycle.max_rows:
        excess = store.num_rows(table) - lifecycle.max_rows
        if excess > 0:
            keep_before = now_stamp(now) - lifecycle.keep_s
            before = max(before, min(keep_before, cap_cutoff(store, table, excess, slice_rows, should_stop)))
    scanned = deleted = oldest = 0
    if lifecycle.active:  # a pass with nothing due still finds the oldest row
        cursor = 0
        while True:
            began = time.monotonic()
            part = store.sweep_slice(table, cursor, before, slice_rows)
            cursor = part.cursor
            scanned += part.scanned
            deleted += len(part.deleted)
            if part.oldest:
                oldest = min(oldest, part.oldest) if oldest else part.oldest
            if cursor == 0 or should_stop():
                break
            on_slice()
            if duty < 1.0:
                time.sleep((time.monotonic() - began) * (1.0 - duty) / duty)
    over = max(0, store.num_rows(table) - lifecycle.max_rows) if lifecycle.max_rows else 0
    finished = time.time()
    return SweepResult(table, finished, finished - started, scanned, deleted, before, over, oldest)


class Sweeper:
    """A PS's thread that sweeps every table whose rows expire (see the module doc).

    Args:
        store: the store.
        every_s: seconds between passes over a table.
        slice_rows: rows per slice.
        duty: the share of a pass's time spent in slices (the rest pauses between them).
        on_result: told each pass's result (metrics, describe).
    """

    def __init__(
        self,
        store: Store,
        every_s: float = 60.0,
        slice_rows: int = SLICE_ROWS,
        duty: float = DUTY,
        on_result: Callable[[SweepResult], None] = lambda r: None,
    ) -> None:
        self.store = store
        self.every_s = every_s
        self.slice_rows = slice_rows
        self.duty = duty
        self.on_result = on_result
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dynemb-sweeper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def pass_every(self, ttl_s: int) -> float:
        """Seconds between passes over a table: every_s, or ttl / 8 if longer (rows then live at
        most 1/8 past their TTL), but at least hourly."""
        return max(self.every_s, min(ttl_s / 8, MAX_PASS_EVERY_S))

    def _loop(self) -> None:
        wait = min(self.every_s, FIRST_CHECK_S)
        while not self._stop.wait(wait):
            try:
                self.sweep_due()
            except Exception:  # noqa: BLE001 - whatever the store raised: logged, the next check tries again
                log.exception("sweeper: a check of the tables failed; trying again in %.0f s", self.every_s / 4)
            wait = self.every_s / 4

    def sweep_due(self) -> list[SweepResult]:
        """One pass over each table whose rows expire and whose last pass (by any PS of the
        store: its record) is a pass interval old, if this PS holds or takes its lease."""
        done: list[SweepResult] = []
        try:
            lifecycles = self.store.lifecycles()  # on Redis: two commands, whatever the tables
        except PSError as exc:
            log.warning("sweeper: cannot list tables: %s", exc)
            return done
        lease_s = max(10.0, 3 * self.every_s)
        for table, lifecycle in sorted(lifecycles.items()):
            if self._stop.is_set():
                break
            try:
                last = self.store.last_sweep(table)
                if last is not None and time.time() - float(last["finished"]) < self.pass_every(lifecycle.ttl_s):
                    continue
                if not self.store.take_sweep_lease(table, self.owner, lease_s):
                    continue
                result = sweep_table(
                    self.store,
                    table,
                    slice_rows=self.slice_rows,
                    duty=self.duty,
                    should_stop=self._stop.is_set,
                    on_slice=functools.partial(self._renew, table, lease_s),
                )
            except TableNotFound:
                continue
            except PSError as exc:
                log.warning("sweeper: table %r: %s", table, exc)
                continue
            try:  # for every PS of the store: when the next pass is due, and DescribeTable
                self.store.record_sweep(table, result._asdict())
            except PSError as exc:
                log.warning("sweeper: could not record the pass over table %r: %s", table, exc)
            self.on_result(result)
            done.append(result)
            if result.deleted:
                log.info(
                    "swept table %r: %d rows deleted of %d in %.2f s",
                    *(table, result.deleted, result.scanned, result.seconds),
                )
        return done

    def _renew(self, table: str, lease_s: float) -> None:
        if not self.store.take_sweep_lease(table, self.owner, lease_s):
            raise PSError(f"table {table!r}: the sweep lease passed to another PS mid-sweep; stopped")
