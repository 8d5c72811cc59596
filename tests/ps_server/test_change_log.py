"""A table's change log (dynemb/ps_server/change_log.py) on every store: the embedded one,
standalone Redis (compiled and redis-py row paths) and Redis Cluster; and through a PS."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import dynemb

from dynemb.ps_server import change_log
from dynemb.ps_server.backends import redis_keys
from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.backends.redis_store import RedisStore
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import TableSchema

DIM = 4


@pytest.fixture
def store(every_store):
    return every_store


def rows_of(ids: np.ndarray, value: float = 1.0) -> np.ndarray:
    return np.repeat((ids.astype(np.float32) * value)[:, None], DIM, axis=1)


def read_all(store, table: str, after: str) -> tuple[list[int], str, bool]:
    ids, gap = [], False
    while True:
        got = store.changes(table, after, limit=7)
        gap |= got.gap
        ids += got.ids.tolist()
        if got.cursor == after:
            return ids, after, gap
        after = got.cursor


def test_pushes_are_logged_once_the_log_is_on(store):
    t = "ch"
    store.create_table(TableSchema(t, DIM))
    assert store.change_log(t) == 0
    with pytest.raises(InvalidArgument, match="keeps no change log"):
        store.changes(t)
    store.push(t, np.arange(5, dtype=np.int64), rows_of(np.arange(5)))  # before: not logged
    with pytest.raises(InvalidArgument, match="out of range"):
        store.set_change_log(t, 10)
    assert store.set_change_log(t, 1 << 12) == 1 << 12
    assert store.change_log(t) == 1 << 12
    start = store.changes(t, "$")
    assert start.ids.size == 0 and not start.gap
    store.push(t, np.array([3, 9, 3], dtype=np.int64), rows_of(np.array([3, 9, 3])))
    store.delete(t, np.array([1], dtype=np.int64))  # deletions have their own log
    store.push(t, np.arange(20, 40, dtype=np.int64), rows_of(np.arange(20, 40)))
    ids, end, gap = read_all(store, t, start.cursor)
    assert ids == [3, 9, 3, *range(20, 40)] and not gap
    assert store.changes(t, end).ids.size == 0
    assert store.changes(t, "$").cursor == end
    assert store.changes(t).ids.tolist() == ids  # "": from the oldest kept
    # the log turned off and on again goes on, and a reader across the time it was off (when
    # id 50 was pushed, unlogged) is told of a gap
    store.set_change_log(t, 0)
    assert store.change_log(t) == 0
    store.push(t, np.array([50], dtype=np.int64), rows_of(np.array([50])))
    store.set_change_log(t, 1 << 12)
    assert store.changes(t, end).gap  # before anything is logged again, too
    store.push(t, np.array([60], dtype=np.int64), rows_of(np.array([60])))
    ids, again, gap = read_all(store, t, end)
    assert ids == [60] and gap
    assert not store.changes(t, again).gap
    # a table made again has a new log: an old cursor reads as a gap, then from the new start
    store.drop_table(t)
    store.create_table(TableSchema(t, DIM))
    store.set_change_log(t, 1 << 12)
    store.push(t, np.array([7], dtype=np.int64), rows_of(np.array([7])))
    got = store.changes(t, end)
    assert got.gap and got.ids.size == 0
    assert store.changes(t, got.cursor).ids.size == 0
    assert store.changes(t, "0").ids.tolist() == [7]
    with pytest.raises(InvalidArgument, match="change log cursor 'x1'"):
        store.changes(t, "x1")


def test_redis_change_log_is_bounded_and_says_when_trimmed(redis_url, redis_namespace, monkeypatch):
    monkeypatch.setattr(redis_keys, "LOG_IDS_PER_ENTRY", 2)
    store = RedisStore.from_url(redis_url, namespace=redis_namespace)
    try:
        store.create_table(TableSchema("ch", DIM))
        store.set_change_log("ch", 1 << 12)
        first = store.changes("ch", "$")
        for k in range(3000):  # 6000 ids: trimmed to about 4096, whole stream nodes at a time
            store.push("ch", np.array([2 * k, 2 * k + 1], dtype=np.int64), rows_of(np.array([2 * k, 2 * k + 1])))
        late = store.changes("ch", first.cursor, limit=1 << 20)
        assert late.gap and 4000 <= late.ids.size < 6000
        assert late.ids[-1] == 5999 and late.cursor == "6000"
        assert not store.changes("ch", late.cursor).gap
    finally:
        store.close()


def test_embedded_change_log_is_bounded_and_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(change_log, "MIN_MAX_IDS", 10)
    store = EmbeddedStore(str(tmp_path))
    store.create_table(TableSchema("ch", DIM))
    store.set_change_log("ch", 50)
    for k in range(10):
        ids = np.arange(10 * k, 10 * k + 10, dtype=np.int64)
        store.push("ch", ids, rows_of(ids))
    log = store.changes("ch")
    assert not log.gap and log.ids.tolist() == list(range(50, 100))
    assert store.changes("ch", "10").gap
    store.close()
    again = EmbeddedStore(str(tmp_path))
    assert again.change_log("ch") == 50
    assert again.changes("ch").ids.tolist() == list(range(50, 100))  # the rows loaded are not logged
    assert again.changes("ch", "$").cursor == "100"
    again.set_change_log("ch", 0)  # a count skipped, saved with the log
    again.set_change_log("ch", 50)
    again.push("ch", np.array([5], dtype=np.int64), rows_of(np.array([5])))
    assert again.changes("ch", "100").gap
    assert again.changes("ch", "101").ids.tolist() == [5]
    again.close()
    third = EmbeddedStore(str(tmp_path))
    assert third.changes("ch", "100").gap and third.changes("ch", "101").ids.tolist() == [5]
    assert third.changes("ch", "$").cursor == "102"
    third.close()


def test_the_change_log_through_a_ps(make_ps):
    """Two PSes, the table's ids sharded over them: the client's cursor carries one for each."""
    first, second = make_ps(), make_ps()
    with PSClient([first.address, second.address], timeout=30) as client:
        info = client.create_table("ch", dim=DIM, change_log=1 << 16)
        assert info.change_log == 1 << 16
        assert client.describe_table("ch").change_log == 1 << 16
        with pytest.raises(InvalidArgument, match="4096 to"):
            client.set_change_log("ch", 1)
        start = client.read_changes("ch", "$")
        assert start.cursor == "0,0"
        ids = np.arange(1000, dtype=np.int64)
        client.push("ch", ids, rows_of(ids))
        got = client.read_changes("ch", start.cursor)
        assert sorted(got.ids.tolist()) == ids.tolist() and not got.gap
        assert client.read_changes("ch", got.cursor).ids.size == 0
        assert client.set_change_log("ch", 0).change_log == 0
        with pytest.raises(InvalidArgument, match="keeps no change log"):
            client.read_changes("ch", got.cursor)


def test_the_cli_turns_a_change_log_on_and_off(embedded_ps):
    import json

    def cli(*args: str) -> str:
        return dynemb(*args, "--ps", embedded_ps.address, check=True).stdout

    with PSClient(embedded_ps.address, timeout=30) as client:
        client.create_table("cli_ch", dim=DIM)
    on = cli("ps", "changes", "cli_ch", "--on")
    assert on == "cli_ch: a change log of the newest 16,777,216 ids pushed, on each PS\n"
    assert json.loads(cli("ps", "describe", "cli_ch"))["change_log"] == 1 << 24
    assert cli("ps", "changes", "cli_ch", "--max-ids", "5000").startswith("cli_ch: a change log of the newest 5,000")
    assert cli("ps", "changes", "cli_ch", "--off") == "cli_ch: no change log\n"
