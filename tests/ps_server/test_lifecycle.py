"""Rows that expire (dynemb/ps_server/lifecycle.py, sweeper.py), on every store: the embedded
one, standalone Redis (compiled and redis-py row paths) and Redis Cluster.

The stores' clock is lifecycle.time, replaced here by one the test moves.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dynemb.ps_server import lifecycle as lifecycle_mod
from dynemb.ps_server.backends import redis_keys
from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.backends.redis_store import RedisStore
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.sweeper import sweep_table

T0 = 1_800_000_000.0
DIM = 4


class Clock:
    """Stands in for the time module in lifecycle.py."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock(T0)
    monkeypatch.setattr(lifecycle_mod, "time", c)
    return c


@pytest.fixture
def store(every_store):
    return every_store


def rows_of(ids: np.ndarray, value: float = 1.0) -> np.ndarray:
    return np.repeat((ids.astype(np.float32) * value)[:, None], DIM, axis=1)


def make_table(store, name: str = "t", expected: int = 1000) -> str:
    store.create_table(TableSchema(name, DIM, 0, "fp32", expected_rows=expected))
    return name


def test_ttl_deletes_rows_neither_written_nor_read(store, clock):
    t = make_table(store)
    store.set_lifecycle(t, Lifecycle(ttl_s=100))
    ids = np.arange(1, 201, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    clock.now = T0 + 60  # older than the touch interval (25 s): a pull renews the stamps it reads
    rows, found = store.pull(t, ids[:20])
    assert found.all() and np.array_equal(rows, rows_of(ids[:20]))
    store.push(t, ids[20:40], rows_of(ids[20:40], 2.0))
    clock.now = T0 + 130  # ids[40:] last used at T0: expired; ids[:40] used at T0 + 60
    result = sweep_table(store, t, now=clock.now, slice_rows=16)
    assert result.deleted == 160 and result.scanned == 200
    assert store.num_rows(t) == 40
    rows, found = store.pull(t, ids)
    assert found[:40].all() and not found[40:].any()
    assert np.array_equal(rows[20:40], rows_of(ids[20:40], 2.0))
    log = store.deletions(t)
    assert sorted(log.ids.tolist()) == ids[40:].tolist() and not log.gap
    assert (log.times > 0).all()


def test_expired_row_is_absent_before_the_sweep(store, clock):
    t = make_table(store)
    store.set_lifecycle(t, Lifecycle(ttl_s=100))
    ids = np.arange(10, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    clock.now = T0 + 150
    _, found = store.pull(t, ids)
    assert not found.any()  # served as never pushed, and counted
    assert store.expired_reads(t) == 10
    store.push(t, ids[:3], rows_of(ids[:3], 3.0))  # the trainer's row for it: a new row
    clock.now = T0 + 160
    sweep_table(store, t, now=clock.now)
    rows, found = store.pull(t, ids)
    assert found.tolist() == [True] * 3 + [False] * 7
    assert np.array_equal(rows[:3], rows_of(ids[:3], 3.0))


def test_touch_keeps_resident_rows(store, clock):
    t = make_table(store)
    store.set_lifecycle(t, Lifecycle(ttl_s=100))
    ids = np.arange(50, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    clock.now = T0 + 80
    assert store.touch(t, np.concatenate([ids[:10], [10_000]])) == 10  # one not stored
    clock.now = T0 + 170
    sweep_table(store, t, now=clock.now)
    assert store.num_rows(t) == 10
    assert store.pull(t, ids[:10])[1].all()


def test_a_ttl_set_on_a_live_table_counts_from_when_it_was_set(store, clock):
    t = make_table(store)
    ids = np.arange(30, dtype=np.int64)
    store.push(t, ids, rows_of(ids))  # no lifecycle yet
    clock.now = T0 + 1000
    set_to = store.set_lifecycle(t, Lifecycle(ttl_s=100))
    assert set_to.since == T0 + 1000 and store.lifecycle(t) == set_to
    clock.now = T0 + 1050
    assert store.pull(t, ids[:5])[1].all()  # not expired: stamps count from `since`
    assert sweep_table(store, t, now=clock.now).deleted == 0
    clock.now = T0 + 1120  # the TTL counts from `since` for the rows not used since
    assert sweep_table(store, t, now=clock.now).deleted == 25  # the 5 read at T0 + 1050 stay
    assert store.num_rows(t) == 5
    store.set_lifecycle(t, Lifecycle())  # never expire again
    assert not store.lifecycle(t).active
    clock.now = T0 + 9000
    assert store.pull(t, ids[:5])[1].all()


def test_row_cap_deletes_the_least_recently_used(store, clock):
    t = make_table(store)
    store.set_lifecycle(t, Lifecycle(max_rows=60, touch_every_s=10))  # keep_s: 30 s
    for k in range(10):  # 10 rows at each of T0, T0 + 1, ... T0 + 9
        clock.now = T0 + k
        ids = np.arange(10 * k, 10 * k + 10, dtype=np.int64)
        store.push(t, ids, rows_of(ids))
    clock.now = T0 + 100
    result = sweep_table(store, t, now=clock.now, slice_rows=32)
    assert result.deleted == 40 and result.rows_over_cap == 0
    assert store.num_rows(t) == 60
    assert store.pull(t, np.arange(40, 100))[1].all()
    assert not store.pull(t, np.arange(40))[1].any()


def test_row_cap_spares_rows_in_use(store, clock):
    t = make_table(store)
    store.set_lifecycle(t, Lifecycle(max_rows=10, touch_every_s=10))
    ids = np.arange(30, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    clock.now = T0 + 20  # every row younger than keep_s (30 s): none may go
    result = sweep_table(store, t, now=clock.now)
    assert result.deleted == 0 and result.rows_over_cap == 20
    assert store.num_rows(t) == 30


def test_row_cap_deletes_down_to_it_within_one_second_lowest_ids_first(store, clock):
    """1,000 rows pushed in one call (one stamp) to a table capped at 500: the sweep deletes
    500 of them, the lowest ids (ties of a stamp broken by id), never the whole second."""
    t = make_table(store, expected=2000)
    store.set_lifecycle(t, Lifecycle(max_rows=500, touch_every_s=1))  # keep_s: 3 s
    ids = np.random.default_rng(1).permutation(np.arange(-500, 500, dtype=np.int64))
    store.push(t, ids, rows_of(ids))
    clock.now = T0 + 10
    result = sweep_table(store, t, now=clock.now, slice_rows=64)
    assert result.deleted == 500 and result.rows_over_cap == 0
    assert store.num_rows(t) == 500
    assert store.pull(t, np.arange(0, 500))[1].all()
    assert not store.pull(t, np.arange(-500, 0))[1].any()


def test_row_cap_cuts_inside_the_boundary_second_by_id(store, clock):
    """Rows over three seconds, the cap falling inside the middle one: the older second goes
    whole, the middle one from its lowest ids up to exactly the cap."""
    t = make_table(store, expected=2000)
    store.set_lifecycle(t, Lifecycle(max_rows=250, touch_every_s=1))
    for k in range(3):  # ids 0-99 at T0, 100-199 at T0 + 1, 200-299 at T0 + 2, pushed backwards
        clock.now = T0 + k
        ids = np.arange(100 * k + 99, 100 * k - 1, -1, dtype=np.int64)
        store.push(t, ids, rows_of(ids))
    clock.now = T0 + 10
    result = sweep_table(store, t, now=clock.now, slice_rows=16)
    assert result.deleted == 50 and store.num_rows(t) == 250
    assert not store.pull(t, np.arange(0, 50))[1].any()
    assert store.pull(t, np.arange(50, 300))[1].all()


@pytest.mark.parametrize("native_rows", [True, False])
def test_row_cap_counts_rows_not_the_kept_count(redis_url, redis_namespace, clock, native_rows):
    """A PS killed between a write and its count change leaves the kept count low (docs/ps.md):
    the cap goes by the rows there are, so the table ends at its cap, not over it for good."""
    import redis as redis_py

    store = RedisStore.from_url(redis_url, namespace=redis_namespace, native_rows=native_rows)
    try:
        t = make_table(store, expected=2000)
        store.set_lifecycle(t, Lifecycle(max_rows=500, touch_every_s=1))
        for k in range(10):  # 100 rows at each of T0 ... T0 + 9
            clock.now = T0 + k
            ids = np.arange(100 * k, 100 * k + 100, dtype=np.int64)
            store.push(t, ids, rows_of(ids))
        with redis_py.Redis.from_url(redis_url) as r:
            r.hincrby(store._rows_key, t, -300)  # 300 rows written, their count change lost
        assert store.num_rows(t) == 700
        clock.now = T0 + 20
        result = sweep_table(store, t, now=clock.now, slice_rows=64)
        assert result.deleted == 500 and result.rows_over_cap == 0
        assert int(store.pull(t, np.arange(1000))[1].sum()) == 500
    finally:
        store.close()


def test_a_pass_stopped_midway_deletes_nothing_and_is_not_recorded(store, clock, monkeypatch):
    """A PS stopping while its sweeper counts a capped table's rows: a count of part of the
    table deletes nothing, and the pass is not recorded, so the next PS's pass is due at once;
    its lease is given up, so that another PS (on Redis) takes the pass up now, not when the
    lease runs out."""
    import time

    from dynemb.ps_server.sweeper import Sweeper

    clock.now = time.time() - 100  # the sweeper goes by the real clock: rows 100 s old
    t = make_table(store, expected=4000)
    store.set_lifecycle(t, Lifecycle(max_rows=1000, touch_every_s=1))
    ids = np.arange(3000, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    sweeper = Sweeper(store, every_s=3600, slice_rows=64, duty=1.0)
    read_stamps = store.stamps_slice

    def stop_while_counting(*args):
        sweeper._stop.set()  # as Sweeper.stop() does, without a thread to join
        return read_stamps(*args)

    monkeypatch.setattr(store, "stamps_slice", stop_while_counting)
    assert sweeper.sweep_due() == []
    assert store.num_rows(t) == 3000 and store.last_sweep(t) is None
    assert store.take_sweep_lease(t, "another PS", 60)


def test_delete_and_clear_are_logged_and_the_cursor_reads_on(store, clock):
    t = make_table(store)
    ids = np.arange(20, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    assert store.delete(t, ids[:5]) == 5
    first = store.deletions(t)
    assert set(first.ids.tolist()) == set(range(5))
    assert store.deletions(t, first.cursor).ids.size == 0
    store.delete(t, ids[5:8])
    after = store.deletions(t, first.cursor)
    assert sorted(after.ids.tolist()) == [5, 6, 7] and not after.gap
    with pytest.raises(InvalidArgument, match="cursor"):
        store.deletions(t, "not a cursor")


def test_lifecycle_out_of_range_is_refused_with_its_limit(store):
    t = make_table(store)
    with pytest.raises(InvalidArgument, match="ttl 1 s is out of range"):
        store.set_lifecycle(t, Lifecycle(ttl_s=1))
    with pytest.raises(InvalidArgument, match="at most every ttl / 2 = 50 s"):
        store.set_lifecycle(t, Lifecycle(ttl_s=100, touch_every_s=60))
    with pytest.raises(InvalidArgument, match="max_rows"):
        store.set_lifecycle(t, Lifecycle(max_rows=1 << 60))
    assert not store.lifecycle(t).active


def test_rows_written_or_read_while_a_sweep_runs_stay(store, clock):
    """A cap sweep over rows all due, in slices, while another thread pushes some of them and
    pulls others (renewing their stamps): each row pushed is there afterwards, with its last
    row, and each row a pull returned as found is there too."""
    t = make_table(store, expected=4000)
    store.set_lifecycle(t, Lifecycle(max_rows=1, touch_every_s=5))  # keep_s 15 s
    ids = np.arange(3000, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    clock.now = T0 + 100
    rng = np.random.default_rng(0)
    pushed: set[int] = set()
    pulled: set[int] = set()
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            batch = rng.choice(ids, 20, replace=False)
            store.push(t, batch[:10], rows_of(batch[:10], 5.0))
            pushed.update(batch[:10].tolist())
            _, found = store.pull(t, batch[10:])
            pulled.update(batch[10:][found].tolist())

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        result = sweep_table(store, t, now=clock.now, slice_rows=64)
    finally:
        stop.set()
        worker.join()
    assert result.deleted > 0
    kept = pushed | pulled
    assert kept, "the traffic thread did nothing while the sweep ran"
    want = np.array(sorted(kept), dtype=np.int64)
    rows, found = store.pull(t, want)
    assert found.all(), f"{int((~found).sum())} rows used during the sweep were deleted"
    was_pushed = np.isin(want, list(pushed))
    assert np.array_equal(rows[was_pushed], rows_of(want[was_pushed], 5.0))
    assert store.num_rows(t) == len(store.pull(t, ids)[1].nonzero()[0])


def test_redis_deletion_log_is_bounded_and_says_when_trimmed(redis_url, redis_namespace, monkeypatch):
    monkeypatch.setattr(redis_keys, "LOG_MAX_IDS", 20)
    monkeypatch.setattr(redis_keys, "LOG_IDS_PER_ENTRY", 2)
    store = RedisStore.from_url(redis_url, namespace=redis_namespace)
    try:
        t = make_table(store)
        start = store.deletions(t)
        assert start.ids.size == 0 and not start.gap
        store.push(t, np.arange(1, 2, dtype=np.int64), rows_of(np.arange(1, 2)))
        store.delete(t, np.array([1], dtype=np.int64))
        first = store.deletions(t)
        for k in range(300):  # 600 ids: trimmed to about 20, whole stream nodes (100 entries) at a time
            store.delete(t, np.array([2 * k + 100, 2 * k + 101], dtype=np.int64))
        late = store.deletions(t, first.cursor, limit=1 << 20)
        assert late.gap
        assert 0 < late.ids.size < 600
        assert not store.deletions(t, late.cursor).gap
    finally:
        store.close()


def test_embedded_deletion_log_is_bounded_and_saved(tmp_path, clock):
    store = EmbeddedStore(str(tmp_path))
    t = make_table(store)
    store.set_lifecycle(t, Lifecycle(ttl_s=100))
    store._tables[t].log.max_ids = 50
    ids = np.arange(200, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    for k in range(10):
        store.delete(t, ids[10 * k : 10 * k + 10])
    log = store.deletions(t)
    assert log.gap is False and log.ids.tolist() == list(range(50, 100))
    assert store.deletions(t, "10").gap
    clock.now = T0 + 50
    store.touch(t, ids[100:110])
    store.close()
    again = EmbeddedStore(str(tmp_path))
    assert again.lifecycle(t) == store.lifecycle(t)
    assert again.deletions(t).ids.tolist() == list(range(50, 100))
    clock.now = T0 + 120  # the stamps came back too: the touched rows stay
    assert sweep_table(again, t, now=clock.now).deleted == 90
    assert again.num_rows(t) == 10
    again.close()


def test_a_table_of_an_older_version_refuses_a_lifecycle(redis_url, redis_namespace, monkeypatch):
    monkeypatch.setattr(redis_keys, "META_FORMAT", 2)
    store = RedisStore.from_url(redis_url, namespace=redis_namespace)
    try:
        t = make_table(store)
        ids = np.arange(5, dtype=np.int64)
        store.push(t, ids, rows_of(ids))
        monkeypatch.setattr(redis_keys, "META_FORMAT", 3)
        assert store.pull(t, ids)[1].all()  # its rows, without stamps, still read
        with pytest.raises(InvalidArgument, match="older dynemb"):
            store.set_lifecycle(t, Lifecycle(ttl_s=100))
    finally:
        store.close()


def test_dropped_tables_are_logged(store):
    start = store.drops()
    for name in ("d1", "d2", "d1"):
        make_table(store, name)
        store.push(name, np.arange(3, dtype=np.int64), rows_of(np.arange(3)))
        assert store.drop_table(name) == 3
    assert store.drop_table("d1") is None  # no table: nothing logged
    got = store.drops(start.cursor)
    assert [d.table for d in got.drops] == ["d1", "d2", "d1"] and not got.gap
    assert all(d.time > 0 for d in got.drops)
    assert store.drops(got.cursor).drops == []
    assert [d.table for d in store.drops(start.cursor, limit=2).drops] == ["d1", "d2"]
    with pytest.raises(InvalidArgument, match="cursor"):
        store.drops("x")


def test_the_embedded_log_of_drops_is_saved(tmp_path):
    store = EmbeddedStore(str(tmp_path))
    make_table(store, "gone")
    store.drop_table("gone")
    make_table(store, "kept")
    store.close()
    again = EmbeddedStore(str(tmp_path))
    assert [d.table for d in again.drops().drops] == ["gone"] and again.drops().cursor == "1"
    again.drop_table("kept")
    assert [d.table for d in again.drops("1").drops] == ["kept"]
    again.close()


def test_redis_log_of_drops_is_bounded_and_says_when_trimmed(redis_url, redis_namespace, monkeypatch):
    from dynemb.ps_server.backends import redis_tables

    monkeypatch.setattr(redis_tables, "DROP_LOG_ENTRIES", 10)
    store = RedisStore.from_url(redis_url, namespace=redis_namespace)
    try:
        make_table(store, "first")
        store.drop_table("first")
        first = store.drops()
        for k in range(250):  # trimmed to about 10, whole stream nodes (100 entries) at a time
            make_table(store, f"d{k}")
            store.drop_table(f"d{k}")
        late = store.drops(first.cursor, limit=1000)
        assert late.gap and 0 < len(late.drops) < 250
        assert late.drops[-1].table == "d249" and late.cursor == "251"
        assert not store.drops(late.cursor).gap
    finally:
        store.close()


def test_a_clear_logs_every_row_it_deletes(store):
    t = make_table(store)
    ids = np.arange(100, 400, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    start = store.deletions(t).cursor
    assert store.clear(t) == 300
    assert sorted(store.deletions(t, start).ids.tolist()) == ids.tolist()


def test_two_sweepers_over_one_store_make_one_pass_an_interval(own_redis_url, redis_namespace):
    """Whether a pass is due goes by the store's record of the last one, by any PS: two PSes'
    sweepers over one Redis make one pass a pass interval between them, and a check of tables
    without a lifecycle reads no table one by one."""
    import redis as redis_py

    from dynemb.ps_server.sweeper import Sweeper

    redis_url = own_redis_url
    stores = [RedisStore.from_url(redis_url, namespace=redis_namespace) for _ in range(2)]
    try:
        for k in range(5):
            make_table(stores[0], f"plain{k}")
        r = redis_py.Redis.from_url(redis_url)
        r.config_resetstat()
        sweepers = [Sweeper(s, every_s=3600) for s in stores]
        assert sweepers[0].sweep_due() == []
        calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
        assert calls.get("cmdstat_hget", 0) == 0 and calls.get("cmdstat_hgetall") == 2, calls
        t = make_table(stores[0])
        stores[0].set_lifecycle(t, Lifecycle(ttl_s=100))
        first = sweepers[0].sweep_due()
        assert [p.table for p in first] == [t]
        r.delete(stores[0]._meta(t).lease_key)  # as if the first PS's lease ran out
        for _ in range(3):  # within the interval: neither sweeps again, whoever takes the lease
            assert sweepers[1].sweep_due() == [] and sweepers[0].sweep_due() == []
        assert stores[1].last_sweep(t)["finished"] == first[0].finished
        r.close()
    finally:
        for s in stores:
            s.close()


def test_a_read_of_the_log_takes_about_limit_ids_however_they_were_logged(store):
    t = make_table(store)
    ids = np.arange(50, dtype=np.int64)
    store.push(t, ids, rows_of(ids))
    for i in ids:  # 50 entries of one id
        store.delete(t, np.array([i]))
    got, cursor = [], ""
    while True:
        part = store.deletions(t, cursor, limit=10)
        if not len(part.ids):
            break
        assert len(part.ids) == 10
        got += part.ids.tolist()
        cursor = part.cursor
    assert got == ids.tolist()


def test_a_drop_of_an_empty_table_visits_no_bucket(own_redis_url):
    import redis as redis_py

    redis_url = own_redis_url
    store = RedisStore.from_url(redis_url, namespace="t")
    r = redis_py.Redis.from_url(redis_url)
    try:
        store.create_table(TableSchema("empty", DIM))  # declares nothing: 4,096 buckets
        r.config_resetstat()
        assert store.drop_table("empty") == 0
        calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
        assert calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0) <= 3, calls
        assert [d.table for d in store.drops().drops][-1] == "empty"
        store.create_table(TableSchema("full", DIM))
        store.push("full", np.arange(10, dtype=np.int64), rows_of(np.arange(10)))
        assert store.drop_table("full") == 10  # a table with rows has its buckets cleared
    finally:
        r.close()
        store.close()
