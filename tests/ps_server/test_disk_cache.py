"""The disk store's pool of hot rows (disk_cache.py): CLOCK eviction within its budget, a write
seen by the next pull, every way a row leaves (delete, clear, drop, expiry) reaching the pool,
exact row counts whether the ids were pooled or not, and a read outrun by a write never admitted.
The disk store as a whole is tested in test_disk_store.py and with every store (conftest.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dynemb.ps_server import lifecycle as lifecycle_module
from dynemb.ps_server.backends.disk import DiskStore
from dynemb.ps_server.backends.disk_cache import SLOT_OVERHEAD, PoolBudget, RowPool
from dynemb.ps_server.lifecycle import Cutoff, Lifecycle, now_stamp
from dynemb.ps_server.schema import TableSchema

SCHEMA = TableSchema("t", 3, 1, "fp32")  # 16-byte rows
RB = SCHEMA.row_bytes


def rows_of(ids: np.ndarray, salt: float = 0.0) -> np.ndarray:
    """Rows that name their id (and a salt, to tell two writes apart)."""
    return (ids[:, None] * 10.0 + np.arange(4) + salt).astype(np.float32)


def as_bytes(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)


@pytest.fixture
def store(tmp_path):
    s = DiskStore(f"disk://{tmp_path}/db?cache_bytes=1MiB&sync=100")
    s.create_table(SCHEMA)
    yield s
    s.close()


def pooled(store: DiskStore, ids) -> np.ndarray:
    return store._tables["t"].pool.pooled(np.asarray(ids, dtype=np.int64))


def test_clock_keeps_rows_in_use_and_stays_within_its_budget():
    budget = PoolBudget(100 * (RB + SLOT_OVERHEAD))
    pool = RowPool(RB, budget)
    first = np.arange(100, dtype=np.int64)
    pool.admit(first, as_bytes(rows_of(first)), np.zeros(100, np.uint32), pool.version)
    assert len(pool) == 100 and pool.capacity == 100
    used = np.arange(0, 100, 10, dtype=np.int64)
    out = np.zeros((10, RB), np.uint8)
    at, _, _ = pool.gather(used, out)
    assert len(at) == 10 and np.array_equal(out, as_bytes(rows_of(used)))
    more = np.arange(1000, 1050, dtype=np.int64)
    pool.admit(more, as_bytes(rows_of(more)), np.zeros(50, np.uint32), pool.version)
    assert pool.capacity == 100 and len(pool) == 100  # evicted within itself: no more memory
    assert pool.pooled(used).all() and pool.pooled(more).all()  # the rows in use stayed
    assert pool.pooled(first).sum() == 50
    assert budget.used <= budget.max_bytes
    # every pooled id's slot holds its own row
    ids, slots = pool.index.items()
    assert np.array_equal(pool.ids[slots], ids)
    assert np.array_equal(pool.rows[slots], as_bytes(rows_of(ids)))


def test_tables_share_the_budget_and_a_drop_gives_its_share_back():
    budget = PoolBudget(3000 * (RB + SLOT_OVERHEAD))
    a, b = RowPool(RB, budget), RowPool(RB, budget)
    ids = np.arange(5000, dtype=np.int64)
    a.admit(ids, as_bytes(rows_of(ids)), np.zeros(5000, np.uint32), a.version)
    b.admit(ids, as_bytes(rows_of(ids)), np.zeros(5000, np.uint32), b.version)
    assert (a.capacity + b.capacity) * (RB + SLOT_OVERHEAD) <= budget.max_bytes
    assert len(a) == a.capacity and len(b) == b.capacity
    a.close()
    assert len(a) == 0 and budget.used == b.capacity * (RB + SLOT_OVERHEAD)


def test_a_read_outrun_by_a_write_or_a_clear_is_not_admitted():
    pool = RowPool(RB, PoolBudget(1 << 20))
    ids = np.arange(10, dtype=np.int64)
    before = pool.version  # a pull notes the version, then reads RocksDB without a lock
    pool.write(ids[:5], as_bytes(rows_of(ids[:5], salt=0.5)), 0)  # a push lands meanwhile
    pool.admit(ids, as_bytes(rows_of(ids)), np.zeros(10, np.uint32), before)  # the old rows come back
    out = np.zeros((10, RB), np.uint8)
    at, _, _ = pool.gather(ids, out)
    assert at.tolist() == list(range(10))
    assert np.array_equal(out[:5], as_bytes(rows_of(ids[:5], salt=0.5)))  # not overwritten by the read
    assert np.array_equal(out[5:], as_bytes(rows_of(ids[5:])))  # the rest admitted
    before = pool.version
    pool.clear()
    pool.admit(ids, as_bytes(rows_of(ids)), np.zeros(10, np.uint32), before)
    assert len(pool) == 0  # read before the clear: which rows are current is unknown


def test_a_pull_after_a_push_sees_the_pushed_rows(store):
    ids = np.arange(-100, 100, dtype=np.int64)
    store.push("t", ids, rows_of(ids))
    assert pooled(store, ids).all()  # write-through: pushed rows are pooled
    store.push("t", ids[::2], rows_of(ids[::2], salt=0.5))
    rows, found = store.pull("t", ids)
    assert found.all()
    expect = rows_of(ids)
    expect[::2] = rows_of(ids[::2], salt=0.5)
    assert np.array_equal(rows, expect)


def test_counts_are_exact_whether_ids_are_pooled_or_not(tmp_path):
    url = f"disk://{tmp_path}/db?cache_bytes=1MiB"
    store = DiskStore(url)
    store.create_table(SCHEMA)
    ids = np.arange(30_000, dtype=np.int64)  # more than the pool holds (~12k rows of 16 B)
    store.push("t", ids, rows_of(ids))
    assert store.num_rows("t") == 30_000 and 0 < len(store._tables["t"].pool) < 30_000
    store.push("t", np.arange(20_000, 40_000), rows_of(np.arange(20_000, 40_000)))  # half stored
    assert store.num_rows("t") == 40_000
    store.close()
    store = DiskStore(url)  # an empty pool: every id checked on disk
    try:
        store.push("t", np.arange(35_000, 45_000), rows_of(np.arange(35_000, 45_000)))
        assert store.num_rows("t") == 45_000
        rows, found = store.pull("t", np.arange(-5, 45_005))
        assert found.sum() == 45_000 and np.array_equal(rows[found], rows_of(np.arange(45_000)))
        assert store.delete("t", np.arange(0, 50_000, 2)) == 22_500 and store.num_rows("t") == 22_500
        assert store.touch("t", np.arange(45_000)) == 22_500
    finally:
        store.close()


def test_a_delete_clear_or_drop_takes_rows_out_of_the_pool(store):
    ids = np.arange(1000, dtype=np.int64)
    store.push("t", ids, rows_of(ids))
    store.pull("t", ids)
    assert store.delete("t", ids[:100]) == 100
    assert not pooled(store, ids[:100]).any()
    rows, found = store.pull("t", ids)
    assert not found[:100].any() and found[100:].all()
    assert store.clear("t") == 900
    assert not store.pull("t", ids)[1].any() and len(store._tables["t"].pool) == 0
    store.push("t", ids, rows_of(ids))
    store.drop_table("t")
    store.create_table(SCHEMA)
    assert not store.pull("t", ids)[1].any() and store.num_rows("t") == 0
    assert store._budget.used == store._tables["t"].pool.capacity * (RB + SLOT_OVERHEAD)


def test_pooled_rows_expire_and_a_sweep_takes_them_out(store, monkeypatch):
    store.set_lifecycle("t", Lifecycle(ttl_s=60))
    ids = np.arange(100, dtype=np.int64)
    store.push("t", ids, rows_of(ids))
    assert store.pull("t", ids)[1].all() and pooled(store, ids).all()
    later = now_stamp() + 120
    monkeypatch.setattr(lifecycle_module, "now_stamp", lambda now=None: later)  # the TTL has passed
    rows, found = store.pull("t", ids)
    assert not found.any() and store.expired_reads("t") == 100  # a pooled row's stamp counts too
    part = store.sweep_slice("t", 0, Cutoff(later - 60), 1000)
    assert sorted(part.deleted.tolist()) == ids.tolist() and store.num_rows("t") == 0
    assert not pooled(store, ids).any()
    monkeypatch.undo()
    assert not store.pull("t", ids)[1].any()


def test_a_stale_pooled_row_is_stamped_again_on_disk_and_in_the_pool(store):
    store.set_lifecycle("t", Lifecycle(ttl_s=3600, touch_every_s=60))
    ids = np.arange(10, dtype=np.int64)
    store.push("t", ids, rows_of(ids))
    t = store._tables["t"]
    t.lifecycle = t.lifecycle._replace(since=0)  # the lifecycle set long ago
    slots = t.pool.index.lookup(ids)
    t.pool.stamps[slots] -= 600  # as if pushed ten minutes ago
    rows, found = store.pull("t", ids)
    assert found.all() and np.array_equal(rows, rows_of(ids))
    assert (t.pool.stamps[slots] >= now_stamp() - 5).all()
    _, stamped, stamps = store.stamps_slice("t", 0, 100)
    assert sorted(stamped.tolist()) == ids.tolist() and (stamps >= now_stamp() - 5).all()


def test_random_pushes_pulls_and_deletes_through_a_small_pool_agree_with_a_dict(tmp_path):
    schema = TableSchema("t", 96, 4, "fp32")  # 400-byte rows: ~2,000 fit in the pool of 1 MiB
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=1MiB&sync=100")
    store.create_table(schema)
    rng = np.random.default_rng(7)
    model: dict[int, np.ndarray] = {}
    try:
        for step in range(60):
            ids = rng.integers(0, 20_000, int(rng.integers(1, 3000)))
            op = step % 3
            if op == 0:
                rows = rng.standard_normal((len(ids), 100)).astype(np.float32)
                store.push("t", ids, rows)
                for i, r in zip(ids.tolist(), rows):
                    model[i] = r
            elif op == 1:
                got, found = store.pull("t", ids)
                assert found.tolist() == [i in model for i in ids.tolist()]
                for i, r, f in zip(ids.tolist(), got, found):
                    if f:
                        assert np.array_equal(r, model[i])
            else:
                gone = store.delete("t", ids[: len(ids) // 4])
                assert gone == len({i for i in ids[: len(ids) // 4].tolist() if model.pop(i, None) is not None})
            assert store.num_rows("t") == len(model)
        pool = store._tables["t"].pool
        assert 0 < len(pool) < len(model) and pool.capacity * pool.slot_bytes <= store._budget.max_bytes
    finally:
        store.close()


def test_a_row_seen_new_is_never_seen_old_again_while_pushes_run(tmp_path):
    """A pusher writes generation g of every row, one push each; pullers must never see a row
    go back a generation (the pool serving an old row after RocksDB served the new one)."""
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=1MiB&sync=100")
    store.create_table(SCHEMA)
    ids = np.arange(20_000, dtype=np.int64)  # more than the pool holds: reads, admissions, evictions
    store.push("t", ids, np.zeros((len(ids), 4), np.float32))
    stop = threading.Event()
    errors: list[str] = []

    def push() -> None:
        for g in range(1, 400):
            if stop.is_set():
                return
            store.push("t", ids, np.full((len(ids), 4), g, np.float32))
        stop.set()

    def pull(seed: int) -> None:
        rng = np.random.default_rng(seed)
        seen = np.zeros(len(ids), np.float32)
        while not stop.is_set() and not errors:
            some = np.unique(rng.integers(0, len(ids), 4000))
            rows, found = store.pull("t", some)
            back = rows[:, 0] < seen[some]
            if not found.all() or back.any():
                errors.append(
                    f"id {some[np.argmax(back)]}: generation {rows[np.argmax(back), 0]} after {seen[some][back][:1]}"
                )
            seen[some] = rows[:, 0]

    threads = [threading.Thread(target=push)] + [threading.Thread(target=pull, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    time.sleep(4)
    stop.set()
    for th in threads:
        th.join()
    store.close()
    assert not errors, errors[0]


def test_a_pull_into_a_strided_array_gets_the_same_rows(store):
    ids = np.arange(100, dtype=np.int64)
    store.push("t", ids, rows_of(ids))
    wide = np.zeros((100, 8), np.float32)
    out = wide[:, ::2]  # not contiguous: the rows go there by numpy, not the compiled copy
    missing = store.pull_into("t", np.concatenate([ids[:50], [10**6], ids[50:99]]), out)
    assert missing.tolist() == [50] and np.array_equal(out[:50], rows_of(ids[:50]))
    assert np.array_equal(out[51:], rows_of(ids[50:99])) and not out[50].any()
