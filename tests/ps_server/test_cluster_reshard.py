"""Redis Cluster grows under load: a master is added and slots move to it while clients push
and pull through a real PS, with no failed call and no row lost."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dynemb.ps_server.backends.redis_keys import meta_key, rows_key
from dynemb.ps_server.backends.redis_store import RedisStore
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.client.retry import RetryPolicy
from dynemb.ps_server.schema import TableSchema
from dynemb.testing.local_redis import RedisClusterProcesses

DIM = 8
PREFILL = 20000
BATCH = 512
WORKERS = 4


def rows_of(ids: np.ndarray) -> np.ndarray:
    """Each id's row, a fixed function of the id, so every pull can be checked exactly."""
    base = (ids % 100003).astype(np.float32)[:, None]
    return base + np.arange(DIM, dtype=np.float32)[None, :] / 8


def slots_of(node) -> int:
    c = node.client()
    try:
        me = c.execute_command("CLUSTER", "MYID").decode()
        shards = c.execute_command("CLUSTER", "NODES").decode()
    finally:
        c.close()
    line = next(line for line in shards.splitlines() if line.startswith(me))
    total = 0
    for part in line.split()[8:]:
        if part.startswith("["):  # a slot being migrated or imported
            continue
        lo, _, hi = part.partition("-")
        total += int(hi or lo) - int(lo) + 1
    return total


@pytest.mark.cluster
@pytest.mark.slow
def test_slots_move_to_a_new_master_under_load_without_errors_or_lost_rows(redis_binaries, make_ps):
    cluster = RedisClusterProcesses(masters=3).start()
    try:
        ps_proc = make_ps("--backend", cluster.url, "--namespace", "grow")
        # one try per call: a store error during the move fails the call instead of being retried away
        once = RetryPolicy(attempts=1)
        with PSClient(ps_proc.address, timeout=30, retry=once) as ps:
            ps.create_table("t", dim=DIM)
            prefill = np.arange(PREFILL, dtype=np.int64) * 7919 + 11
            ps.push("t", prefill, rows_of(prefill))

        stop = threading.Event()
        errors: list[str] = []
        calls = [0] * WORKERS
        written: list[list[np.ndarray]] = [[] for _ in range(WORKERS)]

        def work(w: int) -> None:
            rng = np.random.default_rng(w)
            new_id = (1 << 40) + w * (1 << 30)  # each worker adds rows of its own ids
            with PSClient(ps_proc.address, timeout=30, retry=once) as client:
                while not stop.is_set():
                    try:
                        if calls[w] % 2:
                            ids = rng.choice(prefill, BATCH, replace=False)
                            got = client.pull("t", ids)
                            if got.missing.any() or not np.array_equal(got.rows, rows_of(ids)):
                                errors.append(f"worker {w}: a pull of prefilled rows came back wrong or missing")
                        else:
                            fresh = np.arange(new_id, new_id + BATCH // 4, dtype=np.int64)
                            ids = np.concatenate([rng.choice(prefill, BATCH - len(fresh), replace=False), fresh])
                            client.push("t", ids, rows_of(ids))
                            written[w].append(fresh)
                            new_id += len(fresh)
                    except Exception as exc:  # noqa: BLE001  (every failure is a finding)
                        errors.append(f"worker {w}: {type(exc).__name__}: {exc}")
                    calls[w] += 1

        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(WORKERS)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            new = cluster.add_master()
            before = sum(calls)
            t0 = time.monotonic()
            moved = cluster.cli(
                "--cluster", "rebalance", cluster.nodes[0].address, "--cluster-use-empty-masters", "--cluster-yes"
            )
            moving_s = time.monotonic() - t0
            during = sum(calls) - before
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-3000:]
        assert errors == [], f"{len(errors)} failed calls while slots moved, e.g. {errors[:5]}"
        # the load really ran while the slots moved, and they did move
        assert during >= 4 * WORKERS, f"only {during} calls during the {moving_s:.1f} s the slots moved"
        assert slots_of(new) >= 16384 // 4 - 64
        assert new.client().dbsize() > 0

        added = np.concatenate([f for w in written for f in w])
        every = np.concatenate([prefill, added])
        with PSClient(ps_proc.address, timeout=60) as ps:
            got = ps.pull("t", every)
            assert not got.missing.any(), f"{int(got.missing.sum())} of {len(every)} rows lost"
            assert np.array_equal(got.rows, rows_of(every))
            assert ps.list_tables()[0].num_rows == len(every)
    finally:
        cluster.close()


def _node_id(node) -> str:
    c = node.client()
    try:
        return c.execute_command("CLUSTER", "MYID").decode()
    finally:
        c.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_scripts_follow_a_slot_caught_half_migrated(redis_binaries, redis_namespace):
    """The slot of the table metadata and row counts, caught half moved to a master that never
    ran a script: the count script is redirected there (ASK, then NOSCRIPT on that node), and a
    create, whose script needs both keys, gets TRYAGAIN until the move ends."""
    cluster = RedisClusterProcesses(masters=3).start()
    try:
        new = cluster.add_master()
        store = RedisStore.from_url(cluster.url, namespace=redis_namespace)
        schema = TableSchema("t", dim=4)
        store.create_table(schema)
        ids = np.arange(100, dtype=np.int64)
        store.push("t", ids, np.ones((100, 4), np.float32))
        mkey, rkey = meta_key(redis_namespace), rows_key(redis_namespace)
        any_node = cluster.nodes[0].client()
        slot = any_node.cluster("KEYSLOT", mkey)
        assert any_node.cluster("KEYSLOT", rkey) == slot
        src = next(n for n in cluster.nodes[:3] if n.client().cluster("COUNTKEYSINSLOT", slot) > 0)
        src_c, dst_c = src.client(), new.client()
        dst_c.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src))
        src_c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(new))
        src_c.execute_command("MIGRATE", new.host, new.port, "", 0, 5000, "KEYS", rkey)

        # the count lives on the new node now: ASK, and that node has no script loaded
        more = np.arange(100, 150, dtype=np.int64)
        store.push("t", more, np.ones((50, 4), np.float32))
        asking = dst_c.pipeline(transaction=False)  # one connection: ASKING, then the read
        asking.execute_command("ASKING")
        asking.hget(rkey, "t")
        assert asking.execute()[1] == b"150"

        def finish() -> None:
            time.sleep(1.0)
            src_c.execute_command("MIGRATE", new.host, new.port, "", 0, 5000, "KEYS", mkey)
            for c in (dst_c, src_c):
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(new))

        mover = threading.Thread(target=finish)
        mover.start()
        try:
            # the metadata is still on the old node, the count on the new: TRYAGAIN until the move ends
            t0 = time.monotonic()
            assert store.create_table(TableSchema("u", dim=4))
            assert time.monotonic() - t0 >= 0.5
        finally:
            mover.join()
        assert {s.name for s in store.list_tables()} == {"t", "u"}
        assert store.num_rows("t") == 150 and store.num_rows("u") == 0
        store.close()
    finally:
        cluster.close()
