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
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from dynemb.common.arrays import unique_counts
from dynemb.ps_server.backends.base import Store
from dynemb.ps_server.errors import PSError, TableNotFound
from dynemb.ps_server.lifecycle import Cutoff, now_stamp

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
        before: the stamp rows older than were deleted (0: none were due); rows of that stamp
            itself may have been too, the lowest ids first (the cap's Cutoff).
        rows_over_cap: rows still over the cap after the pass (all younger than keep_s).
        oldest: the oldest stamp among the rows kept (0: none kept, or no pass made).
        complete: False for a pass stopped midway (the PS stopping): not a pass to record, as
            the next one is due at once.
    """

    table: str
    finished: float
    seconds: float
    scanned: int
    deleted: int
    before: int
    rows_over_cap: int
    oldest: int = 0
    complete: bool = True


class CapCount(NamedTuple):
    """What a count of a capped table's rows found.

    Attributes:
        rows: the rows read, one by one (the kept count may be off: see lifecycle.py).
        cutoff: the cutoff that deletes exactly the rows over the cap (Cutoff(): none are over).
        oldest: the oldest stamp read (0: no rows).
    """

    rows: int
    cutoff: Cutoff
    oldest: int


class _Stopped(Exception):
    """The sweeper was told to stop between two slices."""


class _Pace(NamedTuple):
    """How a pass goes from slice to slice (see sweep_table's arguments)."""

    slice_rows: int
    duty: float
    should_stop: Callable[[], bool]
    on_slice: Callable[[], None]

    def after_slice(self, began: float) -> None:
        """Between two slices (the first began at time.monotonic() `began`): raise _Stopped if
        told to stop, else renew the lease and pause for the duty."""
        if self.should_stop():
            raise _Stopped
        self.on_slice()
        if self.duty < 1.0:
            time.sleep((time.monotonic() - began) * (1.0 - self.duty) / self.duty)


def _stamp_slices(store: Store, table: str, pace: _Pace) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, stamps) of the table's rows, slice by slice, paced (_Pace.after_slice)."""
    cursor = 0
    while True:
        began = time.monotonic()
        cursor, ids, stamps = store.stamps_slice(table, cursor, pace.slice_rows)
        yield ids, stamps
        if cursor == 0:
            return
        pace.after_slice(began)


def _rows_by_stamp(store: Store, table: str, pace: _Pace) -> Counter[int]:
    """How many rows of the table carry each stamp (counted per second, so that memory stays
    small whatever the table's size)."""
    counts: Counter[int] = Counter()
    for _, stamps in _stamp_slices(store, table, pace):
        values, n = unique_counts(stamps)
        counts.update(dict(zip(values.tolist(), n.tolist())))
    return counts


def _kth_lowest_id(store: Store, table: str, stamp: int, k: int, pace: _Pace) -> int | None:
    """The k-th lowest id among the rows stamped `stamp` (the highest there is, if fewer are
    now; None if none are), keeping at most about 2k ids."""
    lowest = np.zeros(0, np.int64)
    for ids, stamps in _stamp_slices(store, table, pace):
        lowest = np.concatenate([lowest, ids[stamps == stamp]])
        if len(lowest) > 2 * k:
            lowest = np.partition(lowest, k - 1)[:k]
    if not len(lowest):
        return None
    return int(np.partition(lowest, k - 1)[k - 1]) if len(lowest) >= k else int(lowest.max())


def cap_count(store: Store, table: str, max_rows: int, pace: _Pace) -> CapCount:
    """Count the table's rows and find the cutoff that deletes exactly those over max_rows, the
    oldest stamps first and, within the stamp the cap falls in, the lowest ids first (a second
    pass reads that stamp's ids). Raises _Stopped if stopped midway: nothing may be deleted by
    a count of part of the table."""
    counts = _rows_by_stamp(store, table, pace)
    rows = sum(counts.values())
    oldest = min(counts, default=0)
    excess = rows - max_rows
    if excess <= 0:
        return CapCount(rows, Cutoff(), oldest)
    older = 0  # rows stamped below `stamp`
    for stamp in sorted(counts):
        if older + counts[stamp] >= excess:
            break
        older += counts[stamp]
    k = excess - older  # the rows of `stamp` to delete, 1 to all of them
    kth = None if k == counts[stamp] else _kth_lowest_id(store, table, stamp, k, pace)
    if kth is None or kth == np.iinfo(np.int64).max:  # the whole second is over the cap
        return CapCount(rows, Cutoff(stamp + 1), oldest)
    return CapCount(rows, Cutoff(stamp, kth + 1), oldest)


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
        should_stop: checked between slices; True ends the pass early (complete=False).
        on_slice: called between slices (the sweeper renews its lease there).

    Raises:
        TableNotFound: the table was dropped.
    """
    started = time.time()
    now = started if now is None else now
    pace = _Pace(slice_rows, duty, should_stop, on_slice)
    lifecycle = store.lifecycle(table)
    before = lifecycle.expired_before(now)
    if before and lifecycle.since >= before:
        before = 0  # stamps count from `since`: nothing is older than the TTL yet
    cutoff = Cutoff(before)
    counted = None
    if lifecycle.max_rows:
        try:
            counted = cap_count(store, table, lifecycle.max_rows, pace)
        except _Stopped:
            finished = time.time()
            return SweepResult(table, finished, finished - started, 0, 0, 0, 0, complete=False)
        keep = Cutoff(now_stamp(now) - lifecycle.keep_s)
        cutoff = max(cutoff, min(keep, counted.cutoff))
    scanned = deleted = oldest = 0
    complete = True
    if counted is not None and cutoff == Cutoff():  # nothing due: the count found what a pass would
        scanned, oldest = counted.rows, counted.oldest
    elif lifecycle.active:  # a pass with nothing due still finds the oldest row
        cursor = 0
        try:
            while True:
                began = time.monotonic()
                part = store.sweep_slice(table, cursor, cutoff, slice_rows)
                cursor = part.cursor
                scanned += part.scanned
                deleted += len(part.deleted)
                if part.oldest:
                    oldest = min(oldest, part.oldest) if oldest else part.oldest
                if cursor == 0:
                    break
                pace.after_slice(began)
        except _Stopped:
            complete = False
    over = max(0, counted.rows - deleted - lifecycle.max_rows) if counted is not None else 0
    finished = time.time()
    return SweepResult(table, finished, finished - started, scanned, deleted, cutoff.stamp, over, oldest, complete)


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
            if not result.complete:  # the PS is stopping: the next PS's pass is due at once
                log.info("sweeper: the pass over table %r was stopped midway; not recorded", table)
                try:  # and another PS may take it up now, not once the lease runs out
                    self.store.release_sweep_lease(table, self.owner)
                except PSError as exc:
                    log.warning("sweeper: could not give up the lease on table %r: %s", table, exc)
                break
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
