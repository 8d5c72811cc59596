"""ResidentToucher (dynemb/tables/touch.py): a rank's resident rows reach the store's touch()."""

from __future__ import annotations

import numpy as np

from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import TableSchema
from dynemb.tables.row_store import LocalRowStore
from dynemb.tables.touch import FAILED_RETRY_S, UNSET_RECHECK_S, ResidentToucher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recording(LocalRowStore):
    def __init__(self) -> None:
        super().__init__(EmbeddedStore())
        self.calls: list[tuple[str, list[int]]] = []
        self.fail = False

    def touch(self, table: str, ids: np.ndarray) -> tuple[int, int]:
        self.calls.append((table, ids.tolist()))
        if self.fail:
            raise ConnectionError("PS away")
        return super().touch(table, ids)


def settle(toucher: ResidentToucher) -> None:
    if toucher._pending is not None:
        toucher._pending.result()


def test_resident_rows_are_touched_every_half_interval_of_tables_that_expire():
    store = Recording()
    for name in ("exp", "keep"):
        store.create_table(TableSchema(name, 2))
        store.push(name, np.arange(10), np.zeros((10, 2), np.float32))
    store.set_lifecycle("exp", Lifecycle(ttl_s=40))  # touch interval 10 s
    resident = {"exp": lambda: np.array([1, 2, 3]), "keep": lambda: np.array([4, 5])}
    clock = Clock()
    toucher = ResidentToucher(store, resident, clock)
    toucher.maybe()  # first: each table asked, with no IDs, whether its rows expire
    settle(toucher)
    assert store.calls == [("exp", []), ("keep", [])]
    toucher.maybe()  # "exp" expires: its resident IDs go at once
    settle(toucher)
    assert store.calls[2:] == [("exp", [1, 2, 3])] and toucher.touched["exp"] == 3
    clock.now += 4.9  # within half the interval: nothing
    toucher.maybe()
    settle(toucher)
    assert len(store.calls) == 3
    clock.now += 0.2
    toucher.maybe()
    settle(toucher)
    assert store.calls[3:] == [("exp", [1, 2, 3])]
    clock.now += UNSET_RECHECK_S  # the table that does not expire is asked again
    toucher.maybe()
    settle(toucher)
    assert ("keep", []) in store.calls[4:] and ("keep", [4, 5]) not in store.calls
    toucher.close()


def test_a_failed_touch_is_tried_again_and_training_goes_on():
    store = Recording()
    store.create_table(TableSchema("exp", 2))
    store.set_lifecycle("exp", Lifecycle(ttl_s=40))
    clock = Clock()
    toucher = ResidentToucher(store, {"exp": lambda: np.array([7])}, clock)
    store.fail = True
    toucher.maybe()  # raises nothing
    settle(toucher)
    store.fail = False
    clock.now += FAILED_RETRY_S - 0.1
    toucher.maybe()
    settle(toucher)
    assert len(store.calls) == 1
    clock.now += 0.2
    toucher.maybe()
    settle(toucher)
    assert len(store.calls) == 2
    toucher.close()
