"""Durable writes (--redis-durable) and redis+sentinel:// URLs, short of a failover
(test_redis_failover.py kills masters)."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from helpers import pause, wait_until

from dynemb.ps_server.backends import open_store
from dynemb.ps_server.backends.redis_durable import Durability, last_integer, wait_command
from dynemb.ps_server.backends.redis_store import _split_sentinel_url
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import BackendUnavailable, InvalidArgument
from dynemb.ps_server.schema import TableSchema
from dynemb.testing.local_redis import RedisProcess, RedisSentinelProcesses


def test_setting_parses_and_names_its_limits():
    assert Durability.parse("auto").replicas is None
    assert Durability.parse("off").off and Durability.parse("0").off
    assert Durability.parse("2", 500) == Durability(2, 500)
    assert str(Durability.parse("AUTO")) == "auto"
    for bad in ("always", "-1", "17", ""):
        with pytest.raises(InvalidArgument, match=r"'auto', 'off' or a count of replicas 0\.\.16"):
            Durability.parse(bad)
    with pytest.raises(InvalidArgument, match=r"1\.\.600000 ms"):
        Durability.parse("auto", 0)


def test_wait_reply_is_read_after_the_writes():
    replies = bytearray(b":1\r\n:0\r\n-ERR x\r\n:2\r\n")
    assert last_integer(replies, len(replies)) == 2
    assert last_integer(bytearray(b":7\r\n"), 4) == 7
    with pytest.raises(ValueError, match="WAIT's integer reply"):
        last_integer(bytearray(b":1\r\n-ERR no\r\n"), 13)
    assert wait_command(1, 300) == b"*3\r\n$4\r\nWAIT\r\n$1\r\n1\r\n$3\r\n300\r\n"


def test_sentinel_url_parts():
    sentinels, name, master, sentinel = _split_sentinel_url(
        "redis+sentinel://u:p%40ss@10.0.0.1:26379,[::1]:26380/main/2?socket_keepalive=true&sentinel_password=s"
    )
    assert sentinels == [("10.0.0.1", 26379), ("::1", 26380)]
    assert name == "main"
    assert (master["username"], master["password"], master["db"]) == ("u", "p@ss", 2)
    assert sentinel == {"socket_keepalive": True, "password": "s"}
    for bad, why in [
        ("redis+sentinel:///main", "at least one Sentinel"),
        ("redis+sentinel://h:1", "names the master"),
        ("redis+sentinel://h:x/main", "must be host:port"),
        ("redis+sentinel://h:1/main/zero", "must be a number"),
    ]:
        with pytest.raises(InvalidArgument, match=why):
            _split_sentinel_url(bad)


@pytest.fixture(scope="module")
def replicated():
    """A master with one replica in sync."""
    master = RedisProcess(["repl-diskless-sync-delay 0"]).start()
    replica = RedisProcess([f"replicaof {master.host} {master.port}"]).start()
    replica.wait_synced(time.monotonic() + 30)
    client = master.client()  # and the master counts it online (what --redis-durable auto reads)
    wait_until(lambda: client.info("replication").get("slave0", {}).get("state") == "online", timeout=30, what="online")
    client.close()
    yield master, replica
    replica.close()
    master.close()


def test_writes_wait_for_the_replica_and_fail_without_it(replicated):
    master, replica = replicated
    store = open_store(master.url, namespace="durable", durable=Durability(None, 1500))
    try:
        store.create_table(TableSchema("t", 4))
        ids = np.arange(100, dtype=np.int64)
        store.push("t", ids, np.ones((100, 4), np.float32))
        store.delete("t", ids[:5])
        assert store.replica_waits() == {"acked": 2, "short": 0, "unreplicated": 0}
        assert replica.client().hlen(next(iter(replica.client().scan_iter(b"dn:durable:t:*")))) > 0
        assert replica.proc is not None
        pause(replica.proc.pid)  # connected, but it acknowledges nothing
        try:
            start = time.monotonic()
            with pytest.raises(BackendUnavailable, match=r"0 of 1 replicas had the write after 1500 ms"):
                store.push("t", ids, np.ones((100, 4), np.float32))
            assert time.monotonic() - start < 5
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        assert store.replica_waits()["short"] == 1
    finally:
        store.close()


def test_auto_waits_for_no_one_without_replicas_but_a_count_refuses():
    with RedisProcess() as alone:
        auto = open_store(alone.url, durable=Durability(None))
        strict = open_store(alone.url, durable=Durability(1, 100))
        try:
            auto.create_table(TableSchema("t", 4))
            auto.push("t", np.arange(10, dtype=np.int64), np.zeros((10, 4), np.float32))
            assert auto.replica_waits()["unreplicated"] == 1
            with pytest.raises(BackendUnavailable, match=r"0 of 1 replicas .* --redis-durable 1"):
                strict.push("t", np.arange(10, dtype=np.int64), np.zeros((10, 4), np.float32))
        finally:
            auto.close()
            strict.close()


def test_ps_over_sentinel_exports_its_waits(make_ps):
    redis_set = RedisSentinelProcesses(replicas=1, sentinels=1).start()
    try:
        ps = make_ps("--backend", redis_set.url, "--metrics-port", "0")
        with PSClient(ps.address, timeout=30) as client:
            client.create_table("t", 4)
            client.push("t", np.arange(50, dtype=np.int64), np.ones((50, 4), np.float32))
            assert (~client.pull("t", np.arange(50, dtype=np.int64)).missing).all()
        text = ps.metrics_text()
        assert 'dynemb_ps_replica_waits_total{outcome="acked"} 1.0' in text
    finally:
        redis_set.close()


def test_a_socket_timeout_in_the_url_wins_on_every_kind(redis_cluster):
    """`?socket_timeout=` in a cluster or sentinel URL is the store's, as in a redis:// URL (a
    test of a cut link sets it short; the PS's default of 10 s applies where the URL says none)."""
    store = open_store(redis_cluster.url + "?socket_timeout=1.5")
    try:
        node = store.client.get_primaries()[0]
        assert store.client.get_redis_connection(node).connection_pool.connection_kwargs["socket_timeout"] == 1.5
    finally:
        store.close()
    redis_set = RedisSentinelProcesses(replicas=0, sentinels=1).start()
    try:
        store = open_store(redis_set.url + "?socket_timeout=2.5")
        try:
            assert store.client.connection_pool.connection_kwargs["socket_timeout"] == 2.5
        finally:
            store.close()
    finally:
        redis_set.close()
