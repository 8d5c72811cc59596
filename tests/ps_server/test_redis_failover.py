"""A Redis master dies and its replica takes over: no row the PS acknowledged is lost.

Real processes: a Redis Cluster of 3 masters with a replica each, or a standalone master with a
replica watched by Sentinel; a `dynemb ps serve` over it; a client pushing as a trainer does
(retrying for its whole deadline). Each run:

1. pushes batch after batch from a thread, recording each batch the PS acknowledged;
2. stops (SIGSTOP) the replica of one master, so it falls behind as a slow or cut-off replica
   would, and pushes one more batch: Redis acknowledges it at once; with durable writes the PS
   does not (WAIT finds no replica that has it), and the client retries;
3. kills that master (kill -9) and lets the replica go on: Cluster (or Sentinel) promotes it;
4. pushes go on through the failover; then every acknowledged row is pulled and compared.

With `--redis-durable auto` every acknowledged row is there, bit for bit, and no error reached
the client. With `--redis-durable off` the same run loses the rows of step 2 that the dead master
held: the protection is what keeps them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import numpy as np
import pytest
import redis
from helpers import pause, wait_until

from dynemb.ps_server.client import PSClient
from dynemb.ps_server.client.retry import RetryPolicy
from dynemb.testing.local_redis import RedisClusterProcesses, RedisSentinelProcesses

DIM = 8
BATCH = 256
# the batch pushed while a replica is stopped: more bytes than the sockets between master and
# replica buffer (a few MB on loopback), so that the master still holds some when it dies
LAG_BATCH = 300_000
TABLE = "failover"
# as a trainer's client: retried for its whole deadline (dynemb/tables/row_store.py), shorter waits
RETRY = RetryPolicy(attempts=None, initial_backoff=0.05, max_backoff=0.5, attempt_timeout=10.0)


def rows_of(ids: np.ndarray) -> np.ndarray:
    """Each id's row, a function of the id alone, so any row can be checked bit for bit."""
    return (ids[:, None].astype(np.float64) * 1e-3 + np.arange(DIM)).astype(np.float32)


class Pusher(threading.Thread):
    """Pushes batches of new ids until stopped; records the batches acknowledged and the errors."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.client = PSClient(address, timeout=60.0, retry=RETRY)
        self.acked: list[np.ndarray] = []
        self.errors: list[str] = []
        self.next_id = 0
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def push_batch(self, client: PSClient | None = None, size: int = BATCH) -> None:
        with self.lock:
            ids = np.arange(self.next_id, self.next_id + size, dtype=np.int64)
            self.next_id += size
        try:
            (client or self.client).push(TABLE, ids, rows_of(ids))
        except Exception as exc:  # noqa: BLE001 - every error is what the test counts
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        with self.lock:
            self.acked.append(ids)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.push_batch()
            time.sleep(0.01)

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=90)
        assert not self.is_alive(), "the pusher hung"


def failover_run(make_ps, url: str, durable: str, stop_replica, kill_master, promoted) -> tuple[int, int, list[str]]:
    """Steps 1-4 of the module doc; (acknowledged rows, of them missing or different, errors).
    A step that fails names itself, with the end of the PS's log."""
    ps = make_ps("--backend", url, "--redis-durable", durable, "--redis-durable-timeout-ms", "300")
    pusher = Pusher(ps.address)
    lagging_client = PSClient(ps.address, timeout=60.0, retry=RETRY)
    try:
        with PSClient(ps.address, timeout=60.0, retry=RETRY) as admin:
            admin.create_table(TABLE, DIM)
            pusher.start()
            wait_until(lambda: len(pusher.acked) >= 10, timeout=30, what="pushes before the fault")
            stop_replica()
            # one batch while the replica is stopped, on its own client: with durable writes it waits
            lagging = threading.Thread(target=pusher.push_batch, args=(lagging_client, LAG_BATCH))
            acked_before = len(pusher.acked)
            lagging.start()
            # until Redis acknowledged it (durable writes off) or a first try surely ended
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and not any(len(a) == LAG_BATCH for a in pusher.acked[acked_before:]):
                time.sleep(0.05)
            kill_master()
            promoted()
            at_promotion = len(pusher.acked)
            wait_until(lambda: len(pusher.acked) >= at_promotion + 10, timeout=60, what="pushes after the failover")
            pusher.finish()
            lagging.join(timeout=90)
            assert not lagging.is_alive(), "the push made while the replica was stopped never returned"
            ids = np.concatenate(pusher.acked)
            pulled = admin.pull(TABLE, ids)
    except AssertionError as exc:
        errors = f"{len(pusher.errors)} errors, the first: {pusher.errors[:2]}"
        raise AssertionError(f"{exc}\n{errors}\nthe PS's log ends:\n{ps.log()[-6000:]}") from None
    finally:
        pusher.stop_event.set()  # a failed run leaves no thread pushing into the next tests
        pusher.join(timeout=90)
        lagging_client.close()
        pusher.client.close()
    found = ~pulled.missing
    bad = int(pulled.missing.sum() + (~(pulled.rows[found] == rows_of(ids[found])).all(axis=1)).sum())
    return len(ids), bad, pusher.errors


def check_failover(make_ps, url: str, durable: str, master, replica, promoted) -> None:
    """failover_run with master and its replica (RedisProcess), promoted() waiting for the
    promotion; every acknowledged row there with durable writes, some lost without."""
    assert master.proc is not None and replica.proc is not None

    def stop_replica() -> None:
        # the replica has every write so far (the table's creation included: that is not waited
        # for), so what the failover can lose is what comes while it is stopped
        client = master.client(socket_timeout=10)
        for i in range(100):  # WAIT waits for its connection's last write: one to a key it serves
            with contextlib.suppress(redis.exceptions.MovedError):
                client.set(f"failover-test:{i}", 1)
                break
        assert client.execute_command("WAIT", 1, 5000) == 1, "the replica did not catch up"
        client.close()
        pause(replica.proc.pid)

    def kill_master() -> None:
        master.proc.send_signal(signal.SIGKILL)
        replica.proc.send_signal(signal.SIGCONT)

    acked, bad, errors = failover_run(make_ps, url, durable, stop_replica, kill_master, promoted)
    assert acked >= 20 * BATCH
    assert errors == [], errors[:3]
    if durable == "auto":
        assert bad == 0, f"{bad} of {acked} acknowledged rows lost or changed by the failover"
    else:  # the reverse check: without durable writes the same run loses what the replica never got
        assert bad > 0, "no acknowledged row was lost without durable writes: the run did not test the protection"


@pytest.mark.parametrize("durable", ["auto", "off"])
def test_cluster_failover_loses_no_acknowledged_row(make_ps, durable):
    cluster = RedisClusterProcesses(3, replicas=1, node_timeout_ms=1000).start()
    try:
        master = cluster.nodes[0]
        replica = cluster.replica_of(master)
        check_failover(make_ps, cluster.url, durable, master, replica, lambda: cluster.wait_promoted(replica, 60))
    finally:
        cluster.close()


@pytest.mark.parametrize("durable", ["auto", "off"])
def test_sentinel_failover_loses_no_acknowledged_row(make_ps, durable):
    redis_set = RedisSentinelProcesses(replicas=1, sentinels=1).start()
    try:
        master, replica = redis_set.nodes
        check_failover(make_ps, redis_set.url, durable, master, replica, lambda: redis_set.wait_promoted(master, 60))
    finally:
        redis_set.close()
