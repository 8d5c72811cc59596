"""What only the disk store has: its URL's settings, a reopen that finds every table as it was
(rows, counts, logs and settings: no load step), drops purged in the background, one process per
directory. What every store does is tested on it too (every_store in conftest.py, the dict model
in test_embedded_store.py, kill -9 under pushes in test_ps_drain.py)."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from dynemb.ps_server.backends import disk, disk_load, open_store
from dynemb.ps_server.backends.disk import DiskStore
from dynemb.ps_server.backends.disk_config import DEFAULT_CACHE_BYTES, parse_disk_url
from dynemb.ps_server.backends.disk_layout import ids_of_keys, row_keys
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import BackendUnavailable, InvalidArgument
from dynemb.ps_server.lifecycle import Cutoff, Lifecycle
from dynemb.ps_server.schema import TableSchema

SCHEMA = TableSchema("t", 3, 1, "fp32", expected_rows=1000)


def wait_until_purged(store: DiskStore, number: int, rows: int, what: str) -> None:
    """Until table `number`'s rows of ids 0 .. rows - 1 are gone from RocksDB (the purge thread)."""
    wait_until(
        lambda: all(v is None for v in store._rows.get(row_keys(number, np.arange(rows)))),
        timeout=30,
        what=what,
    )


def test_settings_parse_and_bad_ones_are_named_with_their_limits():
    c = parse_disk_url("disk:///var/rows?cache_bytes=64MiB&sync=20&compression=lz4")
    assert (c.path, c.cache_bytes, c.sync_ms, c.compression) == ("/var/rows", 64 << 20, 20, "lz4")
    c = parse_disk_url("disk://rel/dir")
    assert (c.path, c.cache_bytes, c.sync, c.compression) == ("rel/dir", DEFAULT_CACHE_BYTES, "ack", "none")
    for url, words in [
        ("disk://", "needs a directory"),
        ("disk:///d?cache_bytes=12", "1 MiB (1048576) to 1 TiB"),
        ("disk:///d?cache_bytes=lots", "not a size"),
        ("disk:///d?sync=0", "ack or a whole number of ms from 1 to 60000"),
        ("disk:///d?compression=zstd", "not one of none, lz4"),
        ("disk:///d?cache=1", "'cache' is not one of cache_bytes, sync, compression"),
    ]:
        with pytest.raises(InvalidArgument, match=re.escape(words)) as err:
            open_store(url)
        assert "\n" not in str(err.value)


def test_keys_keep_the_ids_signed_order_and_give_them_back():
    ids = np.array([5, -1, 0, -(1 << 63), (1 << 63) - 1, 255], dtype=np.int64)
    keys = row_keys(7, ids)
    assert all(len(k) == 12 and k[:4] == b"\x00\x00\x00\x07" for k in keys)
    assert sorted(keys) == [keys[i] for i in np.argsort(ids)]
    assert np.array_equal(ids_of_keys(keys), ids)


def test_a_reopened_store_has_every_table_as_it_was(tmp_path):
    url = f"disk://{tmp_path}/db?cache_bytes=4MiB"
    store = DiskStore(url)
    store.create_table(SCHEMA)
    store.create_table(TableSchema("gone", 2))
    store.set_change_log("t", 4096)
    rows = np.arange(400, dtype=np.float32).reshape(100, 4)
    store.push("t", np.arange(100), rows)
    store.delete("t", np.array([3, 4, 1000]))
    lifecycle = store.set_lifecycle("t", Lifecycle(ttl_s=3600))
    store.record_sweep("t", {"deleted": 0})
    store.drop_table("gone")
    changes, deletions = store.changes("t"), store.deletions("t")
    store.close()

    store = DiskStore(url)
    try:
        assert store.list_tables() == [SCHEMA] and store.schema("t").expected_rows == 1000
        assert store.num_rows("t") == 98
        got, found = store.pull("t", np.arange(100))
        assert found.sum() == 98 and not found[3] and not found[4]
        assert np.array_equal(got[found], rows[found])
        assert store.lifecycle("t") == lifecycle and store.change_log("t") == 4096
        assert store.last_sweep("t") == {"deleted": 0}
        for before, after in [(changes, store.changes("t")), (deletions, store.deletions("t"))]:
            assert np.array_equal(before.ids, after.ids) and before.cursor == after.cursor
        assert [d.table for d in store.drops().drops] == ["gone"]
        store.push("t", np.array([7]), rows[:1])  # the logs go on from their cursors
        assert store.changes("t", changes.cursor).ids.tolist() == [7]
    finally:
        store.close()


def test_calls_bigger_than_a_batch_go_in_parts_and_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "_CHUNK", 5)  # a multi-get or WriteBatch takes 5 ids
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB")
    try:
        store.create_table(SCHEMA)
        store.set_change_log("t", 4096)
        ids = np.array([9, 3, 3, 12, -4, 7, 0, 9, 21, 5, 6, 8, 30], dtype=np.int64)
        rows = np.arange(len(ids) * 4, dtype=np.float32).reshape(-1, 4)
        assert store.push("t", ids, rows) == 13 and store.num_rows("t") == 11
        got, found = store.pull("t", np.array([9, 3, 1, 30, -4, 2, 21], dtype=np.int64))
        assert found.tolist() == [True, True, False, True, True, False, True]
        assert np.array_equal(got[[0, 1, 3]], rows[[7, 2, 12]])  # a repeated id: its last row
        assert store.changes("t").ids.tolist() == ids.tolist()  # logged once, as pushed
        assert store.delete("t", np.array([3, 9, 1, 12, 0, 5, 6, 8], dtype=np.int64)) == 7
        assert store.num_rows("t") == 4 and store.deletions("t").ids.tolist() == [0, 3, 5, 6, 8, 9, 12]
    finally:
        store.close()


def test_a_dropped_table_is_purged_and_its_name_starts_empty(tmp_path):
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB&sync=100")
    try:
        store.create_table(SCHEMA)
        store.push("t", np.arange(5000), np.ones((5000, 4), np.float32))
        old = store._tables["t"].number
        assert store.drop_table("t") == 5000 and store.drop_table("t") is None
        store.create_table(SCHEMA)
        assert store._tables["t"].number != old  # a number is never reused
        assert store.num_rows("t") == 0 and not store.pull("t", np.arange(5000))[1].any()
        wait_until_purged(store, old, 5000, "the purge of the dropped table's rows")
    finally:
        store.close()


def test_a_drop_waiting_on_a_long_write_leaves_other_tables_free(tmp_path):
    """A drop waits for its table's write in flight (a bulk load holds the lock for a minute at
    10^8 rows), but not holding the store's lock meanwhile: other tables are made and dropped."""
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB&sync=100")
    try:
        store.create_table(SCHEMA)
        store.create_table(TableSchema("other", 3, 1, "fp32"))
        t = store._tables["t"]
        dropped: list[int | None] = []
        with t.lock:  # a long write into t
            dropper = threading.Thread(target=lambda: dropped.append(store.drop_table("t")))
            dropper.start()
            time.sleep(0.2)  # the drop now waits on t's lock
            maker = threading.Thread(
                target=lambda: (store.create_table(TableSchema("u", 3, 1, "fp32")), store.drop_table("other"))
            )
            maker.start()
            maker.join(timeout=10)
            assert not maker.is_alive(), "a drop waiting on one table's write held up the others"
            assert not dropped and "t" in store._tables
        dropper.join(timeout=10)
        assert dropped == [0] and sorted(store._tables) == ["u"]
    finally:
        store.close()


def test_a_purge_cut_short_by_a_restart_is_finished_after_it(tmp_path, monkeypatch):
    url = f"disk://{tmp_path}/db?cache_bytes=4MiB&sync=100"
    with monkeypatch.context() as m:
        m.setattr(DiskStore, "_purge_loop", lambda self: None)  # the PS stops before its purge runs
        store = DiskStore(url)
        store.create_table(SCHEMA)
        store.push("t", np.arange(3000), np.ones((3000, 4), np.float32))
        number = store._tables["t"].number
        store.drop_table("t")
        assert None not in store._rows.get(row_keys(number, np.arange(3000)))  # still on disk
        store.close()
    store = DiskStore(url)
    try:
        assert store.list_tables() == []
        wait_until_purged(store, number, 3000, "the purge of the table dropped before the restart")
    finally:
        store.close()


def test_a_sweep_deletes_what_is_due_and_logs_it(tmp_path):
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB&sync=100")
    try:
        store.create_table(SCHEMA)
        store.set_lifecycle("t", Lifecycle(max_rows=10))
        store.push("t", np.arange(-50, 50), np.ones((100, 4), np.float32))
        stamp = int(store.stamps_slice("t", 0, 1)[2][0])  # one push: one stamp
        cursor, deleted = 0, []
        while True:  # slices of 30 rows: the cursor resumes at the next id, across the sign
            part = store.sweep_slice("t", cursor, Cutoff(stamp, 0), 30)
            deleted.append(part.deleted)
            if not (cursor := part.cursor):
                break
        assert np.concatenate(deleted).tolist() == list(range(-50, 0))
        assert store.num_rows("t") == 50 and store.deletions("t").ids.tolist() == list(range(-50, 0))
    finally:
        store.close()


def test_one_process_per_directory_and_no_foreign_database(tmp_path):
    store = DiskStore(f"disk://{tmp_path}/db")
    try:
        with pytest.raises(BackendUnavailable, match="another process holds its database"):
            DiskStore(f"disk://{tmp_path}/db")
    finally:
        store.close()
    import rocksdict

    other = rocksdict.Rdict(str(tmp_path / "other"), rocksdict.Options(raw_mode=True))
    other[b"k"] = b"v"
    other.close()
    with pytest.raises(InvalidArgument, match="not a dynemb disk store"):
        DiskStore(f"disk://{tmp_path}/other")


def test_a_read_only_ps_refuses_a_disk_backend(tmp_path):
    from dynemb.ps_server.server import _read_only

    with pytest.raises(InvalidArgument, match="serve it without --read-only"):
        _read_only(DiskStore(f"disk://{tmp_path}/db"), "ns")


def test_a_disk_ps_exports_its_caches_bytes_and_compactions(make_ps, tmp_path):
    ps = make_ps("--backend", f"disk://{tmp_path}/ps?cache_bytes=4MiB")
    with PSClient(ps.address) as client:
        client.create_table("t", dim=3, state_width=1)
        client.push("t", np.arange(1000), np.ones((1000, 4), np.float32))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(ps.metrics_text())
        for s in family.samples
        if s.name.startswith("dynemb_ps_disk_")
    }
    lookups = {labels for name, labels in samples if name == "dynemb_ps_disk_cache_lookups_total"}
    assert lookups == {(("cache", c), ("result", r)) for c in ("row", "block") for r in ("hit", "miss")}
    assert samples[("dynemb_ps_disk_bytes", ())] > 1000 * 16  # the rows, in the WAL so far
    for name in ("dynemb_ps_disk_running_compactions", "dynemb_ps_disk_write_stall_seconds_total"):
        assert samples[(name, ())] >= 0
    # the pool of rows: a reopened store reads each row once, then serves it from memory
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB")
    store.create_table(SCHEMA)
    store.push("t", np.arange(1000), np.ones((1000, 4), np.float32))
    store.close()
    store = DiskStore(f"disk://{tmp_path}/db?cache_bytes=4MiB")
    try:
        for _ in range(3):
            store.pull("t", np.arange(1000))
        stats = store.engine_stats()
        assert stats["row_cache_miss"] == 1000 and stats["row_cache_hit"] == 2000
    finally:
        store.close()


class _Killed(BaseException):
    """The PS dying at a point a test picks."""


def test_a_sorted_load_fills_an_empty_table_and_a_cut_short_one_is_recounted(tmp_path, monkeypatch):
    url = f"disk://{tmp_path}/db?cache_bytes=4MiB"
    store = DiskStore(url)
    try:
        store.create_table(SCHEMA)
        ids = np.arange(-500, 500) * 7
        chunks = [(ids[s : s + 300], np.full((len(ids[s : s + 300]), 4), s, np.float32)) for s in range(0, 1000, 300)]
        assert store.load_sorted("t", chunks, rows_per_file=250) == 1000
        assert store.num_rows("t") == 1000 and not list((tmp_path / "db" / disk_load.SPILL).iterdir())
        rows, found = store.pull("t", np.concatenate([ids, [1, 2]]))
        assert found.tolist() == [True] * 1000 + [False, False]
        assert rows[:1000, 0].tolist() == [float(i // 300 * 300) for i in range(1000)]
        store.push("t", ids[:10], np.ones((10, 4), np.float32))  # stored: no new rows
        assert store.num_rows("t") == 1000
        with pytest.raises(InvalidArgument, match="empty table"):
            store.load_sorted("t", chunks)
        store.create_table(TableSchema("u", 3, 1, "fp32"))
        with pytest.raises(InvalidArgument, match="ascending"):
            store.load_sorted("u", [(np.array([3, 2]), np.ones((2, 4), np.float32))])
        # a crash between the marker and the count: the count is rebuilt at open
        store.load_sorted("u", [(np.arange(50), np.ones((50, 4), np.float32))])
        store._db.put(disk_load.marker(store._tables["u"].number), b"")
        store._db.put(disk._COUNT + disk.table_prefix(store._tables["u"].number), (0).to_bytes(8, "little"))
        # an import (ids in any order, repeated) killed between its ingest and its count
        ingest = disk_load._ingest

        def ingest_then_die(*args):
            ingest(*args)
            raise _Killed

        monkeypatch.setattr(disk_load, "_ingest", ingest_then_die)
        store.create_table(TableSchema("v", 3, 1, "fp32"))
        with pytest.raises(_Killed):
            store.import_rows("v", [(np.array([5, -3, 9, 5]), np.ones((4, 4), np.float32))], replace=False)
    finally:
        store.close()
    store = DiskStore(url)
    try:
        assert store.num_rows("u") == 50 and store.num_rows("t") == 1000 and store.num_rows("v") == 3
    finally:
        store.close()
