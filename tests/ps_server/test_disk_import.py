"""An import into an empty disk table, loaded in bulk whatever order its ids come in
(disk_import.py): the same rows and count as any store's import, the bulk path taken only where
it may be, nothing written by a stream that breaks, and the same through a real disk PS."""

from __future__ import annotations

import numpy as np
import pytest

from dynemb.ps_server.backends import disk_import, disk_load
from dynemb.ps_server.backends.disk import DiskStore
from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import TableNotFound
from dynemb.ps_server.schema import TableSchema

SCHEMA = TableSchema("t", 3, 1, "fp32")
ROW_BYTES = SCHEMA.row_bytes


def shuffled_chunks(seed: int = 0, n: int = 6000, size: int = 700) -> list[tuple[np.ndarray, np.ndarray]]:
    """Chunks in no order: hashed ids over the whole int64 range, small integers either side of
    0 (a bucket of their own, split again), ids repeated across chunks, one id a thousand times."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate(
        [
            rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
            np.arange(-n // 2, n // 2, dtype=np.int64),
            np.full(1000, 42, dtype=np.int64),
        ]
    )
    ids = np.concatenate([ids, rng.choice(ids, n // 2)])  # repeats, later rows win
    rng.shuffle(ids)
    rows = rng.random((len(ids), SCHEMA.width), dtype=np.float32)
    return [(ids[s : s + size], rows[s : s + size]) for s in range(0, len(ids), size)]


def last_rows(chunks) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids ascending, each one's last row) of chunks: what an import stores."""
    last: dict[int, np.ndarray] = {}
    for ids, rows in chunks:
        for i, row in zip(ids.tolist(), rows):
            last[i] = row
    ids = np.array(sorted(last), dtype=np.int64)
    return ids, np.stack([last[i] for i in ids.tolist()])


def wal_bytes(store: DiskStore) -> int:
    """Bytes written to RocksDB's write-ahead log since the store opened: an ingest writes none."""
    return store.statistics().get("rocksdb.wal.bytes", 0)


def spilled(store: DiskStore) -> list:
    """What loads left in the store's spill folder."""
    folder = store.path / disk_load.SPILL
    return list(folder.iterdir()) if folder.exists() else []


@pytest.fixture
def store(tmp_path, monkeypatch):
    # 300 records sorted in memory: the test's buckets are grouped, split and split again
    monkeypatch.setattr(disk_import, "SORT_BYTES", 300 * (8 + ROW_BYTES))
    s = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB")
    s.create_table(SCHEMA)
    yield s
    s.close()


def test_a_shuffled_import_is_loaded_in_bulk_as_the_embedded_store_imports_it(store, tmp_path):
    chunks = shuffled_chunks()
    embedded = EmbeddedStore()
    embedded.create_table(SCHEMA)
    n = sum(len(ids) for ids, _ in chunks)
    wal = wal_bytes(store)
    assert store.import_rows("t", iter(chunks), replace=False) == n == embedded.import_rows("t", chunks, False)
    assert wal_bytes(store) - wal < 1000  # rows ingested as table files: none through the log
    ids, rows = last_rows(chunks)
    assert store.num_rows("t") == embedded.num_rows("t") == len(ids)
    exported = list(store.export("t", 4096))
    assert np.array_equal(np.concatenate([i for i, _ in exported]), ids)
    assert np.array_equal(np.concatenate([r for _, r in exported]), rows)
    got, found = store.pull("t", ids)
    want, want_found = embedded.pull("t", ids)
    assert found.all() and want_found.all() and np.array_equal(got, want)
    assert not spilled(store)
    store.close()
    store.__init__(f"disk://{tmp_path}/db?cache_bytes=4MiB")  # kept: the count and rows, on disk
    assert store.num_rows("t") == len(ids) and np.array_equal(store.pull("t", ids)[0], rows)


def test_an_import_into_a_table_with_rows_or_a_change_log_is_pushed(store):
    chunks = shuffled_chunks(seed=1, n=1000)
    ids, rows = last_rows(chunks)
    store.push("t", np.array([7]), np.zeros((1, 4), np.float32))
    store.create_table(TableSchema("logged", 3, 1, "fp32"))
    store.set_change_log("logged", 1 << 16)
    for table, extra in (("t", 0 if 7 in ids else 1), ("logged", 0)):
        wal = wal_bytes(store)
        store.import_rows(table, chunks, replace=False)
        assert wal_bytes(store) - wal > len(ids) * ROW_BYTES  # every row through the log: pushes
        assert store.num_rows(table) == len(ids) + extra
        assert np.array_equal(store.pull(table, ids)[0], rows)
    assert np.array_equal(np.unique(store.changes("logged").ids), ids)  # logged, as pushes are


def test_a_push_while_an_import_spills_makes_it_write_by_pushes_after_it(store):
    chunks = shuffled_chunks(seed=8, n=1000)
    ids, rows = last_rows(chunks)

    def pushed_meanwhile():
        yield chunks[0]
        store.push("t", np.array([ids[0], 1 << 50]), np.full((2, 4), -1, np.float32))
        yield from chunks[1:]

    wal = wal_bytes(store)
    store.import_rows("t", pushed_meanwhile(), replace=False)
    assert wal_bytes(store) - wal > len(ids) * ROW_BYTES  # pushes, not an ingest over the pushed rows
    assert store.num_rows("t") == len(ids) + 1
    assert np.array_equal(store.pull("t", ids)[0], rows) and not spilled(store)


def test_a_replace_import_onto_a_full_table_clears_it_then_loads_in_bulk(store):
    store.push("t", np.arange(500), np.ones((500, 4), np.float32))
    chunks = shuffled_chunks(seed=2)
    ids, rows = last_rows(chunks)
    wal = wal_bytes(store)
    store.import_rows("t", chunks, replace=True)
    # the clear's deletions go through the log (~40 B a row), the imported rows do not
    assert wal_bytes(store) - wal < 500 * 100 < len(ids) * ROW_BYTES
    assert store.num_rows("t") == len(ids)
    gone = np.setdiff1d(np.arange(500), ids)
    assert not store.pull("t", gone)[1].any()
    assert np.array_equal(store.pull("t", ids)[0], rows)
    assert np.array_equal(np.sort(store.deletions("t").ids), np.arange(500))  # the clear is logged


def test_a_stream_that_breaks_writes_nothing_and_leaves_no_spill(store, tmp_path):
    chunks = shuffled_chunks(seed=3, n=2000)

    def breaking():
        yield from chunks[:4]
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        store.import_rows("t", breaking(), replace=False)
    assert store.num_rows("t") == 0 and not store.pull("t", chunks[0][0])[1].any()
    assert not spilled(store)
    # a PS killed while it spilled: its folder is removed at the next open
    (store.path / disk_load.SPILL / "load-killed").mkdir(parents=True)
    (store.path / disk_load.SPILL / "load-killed" / "0000").write_bytes(b"x" * 100)
    store.close()
    store.__init__(f"disk://{tmp_path}/db?cache_bytes=4MiB")
    assert not spilled(store) and store.num_rows("t") == 0


def test_an_import_whose_table_is_dropped_and_made_again_meanwhile_writes_nothing(store):
    chunks = shuffled_chunks(seed=7, n=500)

    def dropping():
        yield chunks[0]
        store.drop_table("t")
        store.create_table(TableSchema("t", 4, 0, "fp32"))
        yield from chunks[1:]

    with pytest.raises(TableNotFound, match="dropped"):
        store.import_rows("t", dropping(), replace=False)
    assert store.num_rows("t") == 0 and not spilled(store)


def test_an_import_sorts_no_more_rows_at_once_than_its_memory_holds(tmp_path, monkeypatch):
    chunks = shuffled_chunks(seed=6, n=3000)
    ids, rows = last_rows(chunks)
    (tmp_path / "spill").mkdir()
    sort = disk_import.ImportSort(tmp_path / "spill", SCHEMA, 300 * (8 + ROW_BYTES))
    at_once = []
    last_of = sort._last_of
    monkeypatch.setattr(sort, "_last_of", lambda group: at_once.append(sum(b.rows for b in group)) or last_of(group))
    for chunk in chunks:
        sort.add(*chunk)
    out = list(sort.sorted_chunks())
    assert np.array_equal(np.concatenate([i for i, _ in out]), ids)
    assert np.array_equal(np.concatenate([r for _, r in out]), rows)
    # the small integers' bucket (6,000 ids) was split, id 42's thousand rows taken as its last
    assert sort.max_rows == 300 and 0 < max(at_once) <= 300 and sum(at_once) < sort.rows
    assert not [p for p in (tmp_path / "spill").rglob("*") if p.is_file()]  # each file deleted once read


def test_every_store_imports_chunks_as_its_pushes_would(every_store):
    chunks = shuffled_chunks(seed=4, n=500, size=300)
    ids, rows = last_rows(chunks)
    every_store.create_table(SCHEMA)
    every_store.push("t", np.array([1 << 40]), np.ones((1, 4), np.float32))
    taken = []

    def tracked():
        for chunk in chunks:
            # the first chunk is taken before anything is written: the table still has its row
            taken.append(every_store.num_rows("t"))
            yield chunk

    assert every_store.import_rows("t", tracked(), replace=True) == sum(len(i) for i, _ in chunks)
    assert taken[0] == 1 and every_store.num_rows("t") == len(ids)
    got, found = every_store.pull("t", np.concatenate([ids, [1 << 40]]))
    assert found.tolist() == [True] * len(ids) + [False] and np.array_equal(got[:-1], rows)


def test_a_disk_ps_imports_shuffled_chunks_in_bulk(make_ps, tmp_path):
    ps = make_ps("--backend", f"disk://{tmp_path}/ps?cache_bytes=8MiB")
    chunks = shuffled_chunks(seed=5, n=20_000, size=4096)
    ids, rows = last_rows(chunks)
    with PSClient(ps.address, timeout=60) as client:
        assert client.import_rows(SCHEMA, chunks) == sum(len(i) for i, _ in chunks)
        pulled = client.pull("t", ids)
        assert not pulled.missing.any() and np.array_equal(pulled.rows, rows)
        assert [(i.schema.name, i.num_rows) for i in client.list_tables()] == [("t", len(ids))]
    assert f"{len(ids)} distinct" in ps.log() and 'op="import"' in ps.metrics_text()
