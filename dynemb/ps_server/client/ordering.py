"""Per-table call order for a client's row operations, sync or async.

Row operations (pull, push, delete, import) of one client on one table take effect in the order they were called:
they run one after another on that table's lane, so a pull issued after a push always sees it, and a retried push
can never land after a later one. Different tables use different lanes (by a CRC-32 of the name), so a trainer's
pushes and pulls of many tables are in flight together. A call on several tables (pull_many, push_many) runs after
the calls made before it on each of its tables' lanes and before those made after.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait


class _Lane:
    """One lane's worker thread, the last call submitted to it (`tail`) and the last call on several tables that
    involved it (`barrier`), which calls submitted after it wait for."""

    __slots__ = ("pool", "tail", "barrier")

    def __init__(self, k: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dynemb-ps-lane{k}")
        self.tail: Future | None = None
        self.barrier: Future | None = None


def _after(before: list[Future], fn: Callable, *args):
    """fn(*args) once every future in before is done, whatever their outcome."""
    wait(before)
    return fn(*args)


class TableLanes:
    """Runs calls on tables in call order per table, different tables' calls side by side.

    Args:
        lanes: how many lanes (worker threads) single-table calls spread over, by table name.
    """

    def __init__(self, lanes: int) -> None:
        self._lanes = [_Lane(k) for k in range(max(1, lanes))]
        # calls on several tables run here, in call order, each between the calls on its tables' lanes (submit_many)
        self._many = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynemb-ps-many")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lanes)

    def _lane_of(self, table: str) -> _Lane:
        return self._lanes[zlib.crc32(table.encode()) % len(self._lanes)]

    def submit(self, table: str, fn: Callable, *args) -> Future:
        """fn(*args) on the table's lane: after the calls submitted before on it, before those submitted after.

        Args:
            table: the table the call is on.
            fn: the call.

        Returns:
            The call's future.
        """
        lane = self._lane_of(table)
        with self._lock:
            barrier = lane.barrier
            if barrier is not None and barrier.done():
                barrier = lane.barrier = None
            lane.tail = lane.pool.submit(_after, [barrier], fn, *args) if barrier else lane.pool.submit(fn, *args)
            return lane.tail

    def submit_many(self, tables: Iterable[str], fn: Callable, *args) -> Future:
        """fn(*args) after every call already submitted on these tables and before any submitted after.

        It waits for the last call on each lane involved, and later calls on those lanes wait for it (their
        barrier). Every wait is on something submitted earlier, so nothing can wait on itself. A trainer that only
        makes *_many calls finds every lane idle: fn runs with one hand-off (gates on every lane cost ~0.4 ms a
        call, bench/RESULTS.md).

        Args:
            tables: the tables the call is on.
            fn: the call.

        Returns:
            The call's future.
        """
        lanes = {id(lane): lane for lane in map(self._lane_of, tables)}.values()
        with self._lock:
            before = [lane.tail for lane in lanes if lane.tail is not None and not lane.tail.done()]
            fut = self._many.submit(_after, before, fn, *args) if before else self._many.submit(fn, *args)
            for lane in lanes:
                lane.barrier = fut
            return fut

    def close(self) -> None:
        """Wait for every call submitted, then stop the lanes' threads."""
        self._many.shutdown(wait=True)
        for lane in self._lanes:
            lane.pool.shutdown(wait=True)
