"""RedisStore's compiled row path on a real Redis Cluster: pull, push and delete go node by node
through the compiled module (not redis-py's cluster pipeline), read and write what redis-py's
commands do, and recover from redirects (MOVED, ASK) and dropped connections."""

from __future__ import annotations

import binascii

import numpy as np
import pytest
import redis
from redis.crc import key_slot

from dynemb.ps_server.backends import redis_keys
from dynemb.ps_server.backends.redis_store import RedisStore
from dynemb.ps_server.errors import PSError
from dynemb.ps_server.hashing import bucket_of
from dynemb.ps_server.native import redis_rows
from dynemb.ps_server.schema import TableSchema
from dynemb.testing.local_redis import RedisClusterProcesses

I64 = np.iinfo(np.int64)
AWKWARD_IDS = np.array([0, 1, 256, 1 << 56, -1, -256, I64.min, I64.max, 1 << 32, 0xFF00], dtype=np.int64)
ROW_COMMANDS = {"HMGET", "HSET", "HDEL"}


def unique_ids(rng, n: int) -> np.ndarray:
    ids = np.unique(rng.integers(I64.min, I64.max, n + n // 10 + 16, dtype=np.int64))
    return rng.permutation(ids)[:n]


def random_rows(rng, n: int, schema: TableSchema) -> np.ndarray:
    if schema.dtype == "bf16":  # raw bit patterns
        return rng.integers(0, 1 << 16, (n, schema.width), dtype=np.uint16)
    return rng.standard_normal((n, schema.width)).astype(schema.np_dtype)


def no_row_commands_through_redis_py(store: RedisStore, monkeypatch) -> list:
    """Make every redis-py pipeline fail on a row command (HMGET, HSET, HDEL), so a pull, push or
    delete that does not take the compiled path fails; the row-count script may still pass.
    Returns the list of the other commands that went through redis-py pipelines."""
    seen: list = []
    make = store._pipeline

    def guarded():
        pipe = make()
        queue = pipe.execute_command

        def execute_command(*args, **kw):
            assert args[0] not in ROW_COMMANDS, f"{args[0]} went through redis-py's pipeline"
            seen.append(args[0])
            return queue(*args, **kw)

        pipe.execute_command = execute_command
        return pipe

    monkeypatch.setattr(store, "_pipeline", guarded)
    return seen


def node_calls(cluster: RedisClusterProcesses, command: str) -> list[int]:
    """How often each node ran `command`."""
    out = []
    for node in cluster.nodes:
        c = node.client()
        out.append(int(c.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)))
        c.close()
    return out


@pytest.mark.parametrize("num_buckets", [1, 4096, 1 << 28, (1 << 32) - 1])
def test_slot_nodes_match_redis_py_key_slot(num_buckets):
    """The compiled node lookup hashes each id's bucket key's tag exactly as Redis Cluster does
    (redis-py's key_slot of the whole key), for any bucket count up to 2**32 - 1."""
    mod = redis_rows()
    rng = np.random.default_rng(num_buckets % 1000)
    ids = np.concatenate([AWKWARD_IDS, unique_ids(rng, 3000)])
    slot_node = rng.integers(-1, 7, 16384, dtype=np.int32)  # any map: each slot's own value comes back
    out = np.empty(len(ids), dtype=np.int32)
    for token in ("", "9f3c07a1d2e4"):  # keys of a table of metadata format 1, and 2 on
        prefix = redis_keys.bucket_prefix("ns", "a_table.v-2", token)
        mod.slot_nodes(ids, num_buckets, prefix.rpartition(b"{")[2], slot_node, out)
        keys = [prefix + b"%d}" % b for b in bucket_of(ids, num_buckets).tolist()]
        np.testing.assert_array_equal(out, slot_node[[key_slot(k) for k in keys]])
    with pytest.raises(ValueError, match="16384"):
        mod.slot_nodes(ids, num_buckets, b"t.", slot_node[:100], out)
    with pytest.raises(ValueError, match="num_buckets"):
        mod.slot_nodes(ids, 0, b"t.", slot_node, out)


@pytest.mark.cluster
def test_cluster_rows_take_the_compiled_path_on_every_node(redis_cluster, redis_namespace, monkeypatch):
    s = RedisStore.from_url(redis_cluster.url, namespace=redis_namespace)
    assert s.cluster and s._native is not None
    schema = TableSchema("fast", dim=6, state_width=2)
    s.create_table(schema)
    others = no_row_commands_through_redis_py(s, monkeypatch)
    rng = np.random.default_rng(1)
    ids = np.concatenate([AWKWARD_IDS, unique_ids(rng, 5000)])
    rows = random_rows(rng, len(ids), schema)
    hset_before, hmget_before = node_calls(redis_cluster, "hset"), node_calls(redis_cluster, "hmget")
    assert s.push("fast", ids, rows) == len(ids)
    # at most the row count's script: through redis-py only where a node had not loaded it yet
    # (NOSCRIPT), which depends on what ran before on this worker's cluster
    assert set(others) <= {"EVALSHA"}, others
    asked = np.concatenate([ids, unique_ids(rng, 300)])  # and ids never written
    got, found = s.pull("fast", asked)
    assert found[: len(ids)].all() and not found[len(ids) :].any()
    np.testing.assert_array_equal(got[: len(ids)], rows)
    assert not got[len(ids) :].any()
    # every node served its share of the rows, each with plain HSETs and HMGETs
    assert all(a > b for a, b in zip(node_calls(redis_cluster, "hset"), hset_before))
    assert all(a > b for a, b in zip(node_calls(redis_cluster, "hmget"), hmget_before))
    out = np.full((len(asked), schema.width), 7, dtype=np.float32)
    np.testing.assert_array_equal(s.pull_into("fast", asked, out), np.arange(len(ids), len(asked)))
    np.testing.assert_array_equal(out[: len(ids)], rows)
    assert s.delete("fast", np.concatenate([ids[:1000], ids[:10], asked[-50:]])) == 1000
    assert s.num_rows("fast") == len(ids) - 1000
    monkeypatch.undo()
    s.close()


@pytest.mark.cluster
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cluster_compiled_path_and_redis_py_agree(redis_cluster, redis_namespace, dtype):
    """Rows written by either path read back the same by both, absent and repeated ids included,
    and the row count follows writes and deletes of both."""
    fast = RedisStore.from_url(redis_cluster.url, namespace=redis_namespace, num_buckets=64)
    slow = RedisStore.from_url(redis_cluster.url, namespace=redis_namespace, native_rows=False)
    assert fast._native is not None and slow._native is None
    schema = TableSchema("agree", dim=5, state_width=2, dtype=dtype)
    fast.create_table(schema)
    rng = np.random.default_rng(2)
    ids = np.concatenate([AWKWARD_IDS, unique_ids(rng, 3000)])
    rows = random_rows(rng, len(ids), schema)
    assert fast.push("agree", ids[::2], rows[::2]) == len(ids[::2])
    assert slow.push("agree", ids[1::4], rows[1::4]) == len(ids[1::4])
    # a repeated id in one push: its last row wins on both paths
    twice = np.array([ids[0], ids[0]])
    fast.push("agree", twice, rows[[5, 0]])
    asked = np.concatenate([ids, ids[:50], unique_ids(rng, 100)])
    got_fast, found_fast = fast.pull("agree", asked)
    got_slow, found_slow = slow.pull("agree", asked)
    np.testing.assert_array_equal(found_fast, found_slow)
    np.testing.assert_array_equal(got_fast.view(np.uint16), got_slow.view(np.uint16))  # bit for bit
    written = np.zeros(len(ids), dtype=bool)
    written[::2] = written[1::4] = True
    np.testing.assert_array_equal(found_fast[: len(ids)], written)
    np.testing.assert_array_equal(got_fast[: len(ids)][written].view(np.uint16), rows[written].view(np.uint16))
    assert not got_fast[~found_fast].any()
    assert fast.num_rows("agree") == slow.num_rows("agree") == int(written.sum())
    assert fast.delete("agree", ids[:1000]) == int(written[:1000].sum())
    assert slow.delete("agree", ids[1000:1500]) == int(written[1000:1500].sum())
    assert fast.num_rows("agree") == int(written[1500:].sum())
    _, found = fast.pull("agree", ids)
    np.testing.assert_array_equal(found, written & (np.arange(len(ids)) >= 1500))
    fast.close()
    slow.close()


@pytest.mark.cluster
def test_cluster_dropped_connections_and_error_replies(redis_cluster, redis_namespace):
    s = RedisStore.from_url(redis_cluster.url, namespace=redis_namespace)
    schema = TableSchema("drop", dim=4)
    s.create_table(schema)
    rng = np.random.default_rng(3)
    ids = unique_ids(rng, 2000)
    rows = random_rows(rng, 2000, schema)
    s.push("drop", ids, rows)
    # every node closes its clients' connections (as on a restart or a client timeout): the
    # parts on dead pooled connections are read and written again, nothing fails or is lost
    for node in redis_cluster.nodes:
        c = node.client()
        assert c.client_kill_filter(_type="normal", skipme=True) >= 1
        c.close()
    got, found = s.pull("drop", ids)
    assert found.all() and np.array_equal(got, rows)
    for node in redis_cluster.nodes:
        c = node.client()
        c.client_kill_filter(_type="normal", skipme=True)
        c.close()
    assert s.push("drop", ids[:500], rows[:500] + 1) == 500
    assert s.num_rows("drop") == 2000
    rows[:500] += 1
    # a connection that fails midway through a node's replies is closed (not pooled out of
    # step with its stream) and that node's part is read or written again through redis-py
    recv, failed = s._recv, []

    def flaky(conn, replies, expect_bytes, take=None, slot=0):
        if slot == 1 and len(failed) < 2:
            failed.append((conn, conn._sock))
            raise redis.ConnectionError("dropped midway")
        return recv(conn, replies, expect_bytes, take, slot)

    s._recv = flaky
    got, found = s.pull("drop", ids)
    assert found.all() and np.array_equal(got, rows) and len(failed) == 1
    fresh = unique_ids(rng, 100)
    assert s.push("drop", fresh, rows[:100]) == 100 and len(failed) == 2
    # whether the lost part's rows were new is not known (they may have been written before the
    # connection dropped): they may go uncounted, as with redis-py's own retries, never twice
    assert 2000 <= s.num_rows("drop") <= 2100
    assert all(conn._sock is not sock for conn, sock in failed)  # closed (perhaps opened anew since)
    del s._recv
    got, found = s.pull("drop", np.concatenate([ids, fresh]))
    assert found.all() and np.array_equal(got, np.concatenate([rows, rows[:100]]))
    # an error reply that is no redirect (a bucket key holding a string) raises, naming it
    used = set(bucket_of(np.concatenate([ids, fresh]), 4096).tolist())
    odd = next(i for i in unique_ids(rng, 1000) if int(bucket_of(np.array([i]), 4096)[0]) not in used)
    key = s._meta("drop").key(int(bucket_of(np.array([odd]), 4096)[0]))
    s.client.set(key, b"not a hash")
    with pytest.raises(PSError, match="WRONGTYPE"):
        s.pull("drop", np.append(ids, odd))
    with pytest.raises(PSError, match="WRONGTYPE"):
        s.push("drop", np.append(ids[:10], odd), rows[:11])
    s.client.delete(key)
    # the connections stayed in step: the next calls read what they should
    got, found = s.pull("drop", ids)
    assert found.all() and np.array_equal(got, rows)
    s.close()


def slot_of_key(key: bytes) -> int:
    tag = key[key.index(b"{") + 1 : key.index(b"}")]
    return binascii.crc_hqx(tag, 0) % 16384


def node_id(client: redis.Redis) -> str:
    return client.execute_command("CLUSTER", "MYID").decode()


class SlotMover:
    """Moves slots between the masters of a cluster behind a store's back, as a reshard does."""

    def __init__(self, cluster: RedisClusterProcesses) -> None:
        self.clients = [n.client() for n in cluster.nodes]
        self.nodes = cluster.nodes
        self.ids = [node_id(c) for c in self.clients]

    def owner(self, slot: int) -> int:
        for i, c in enumerate(self.clients):
            if c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0:
                return i
        raise AssertionError(f"slot {slot} holds no key")

    def start(self, slot: int) -> tuple[int, int]:
        """Mark the slot migrating to the next master and move its keys there, but not the slot:
        its old node answers ASK for them. Returns (source, destination)."""
        src = self.owner(slot)
        dst = (src + 1) % len(self.clients)
        self.clients[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[src])
        self.clients[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[dst])
        keys = self.clients[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100000)
        node = self.nodes[dst]
        self.clients[src].execute_command("MIGRATE", node.host, node.port, "", 0, 5000, "KEYS", *keys)
        return src, dst

    def finish(self, slot: int, dst: int) -> None:
        for c in self.clients:  # every node learns the new owner now, not by gossip later
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[dst])

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_rows_follow_moved_and_ask_redirects(redis_binaries, redis_namespace):
    """Slots moved (MOVED: the store's slot map is stale) or caught half moved (ASK) while the
    store reads and writes: every row is read and written where it now lives, the slot map is
    mended, and the row count stays exact."""
    cluster = RedisClusterProcesses(masters=3).start()
    mover = SlotMover(cluster)
    try:
        s = RedisStore.from_url(cluster.url, namespace=redis_namespace, num_buckets=256)
        schema = TableSchema("mv", dim=4)
        s.create_table(schema)
        rng = np.random.default_rng(4)
        ids = unique_ids(rng, 4000)
        rows = random_rows(rng, 4000, schema)
        s.push("mv", ids, rows)
        prefix = s._meta("mv").prefix
        slot = np.array([slot_of_key(prefix + b"%d}" % b) for b in bucket_of(ids, 256).tolist()])
        by_slot = sorted(set(slot.tolist()))
        redirects: list[str] = []
        seen = s._redirected

        def redirected(text: str) -> bool:
            redirects.append(text.split()[0])
            return seen(text)

        s._redirected = redirected

        # MOVED: three slots move for good; the store's map still names their old nodes
        moved = by_slot[:3]
        for sl in moved:
            mover.finish(sl, mover.start(sl)[1])
        version = s._slot_version
        got, found = s.pull("mv", ids)
        assert found.all() and np.array_equal(got, rows)
        assert redirects.count("MOVED") >= 1 and s._slot_version > version
        redirects.clear()
        got, found = s.pull("mv", ids)  # the map was mended: no redirect now
        assert found.all() and np.array_equal(got, rows) and redirects == []

        # MOVED on writes: overwrite, add and delete rows of slots that moved since
        moved = by_slot[3:6]
        for sl in moved:
            mover.finish(sl, mover.start(sl)[1])
        in_moved = np.isin(slot, moved)
        fresh, fresh_rows = unique_ids(rng, 400), random_rows(rng, 400, schema)
        s.push("mv", np.concatenate([ids[in_moved], fresh]), np.concatenate([rows[in_moved] + 1, fresh_rows]))
        assert "MOVED" in redirects
        rows[in_moved] += 1
        assert s.num_rows("mv") == 4400
        moved = by_slot[6:9]
        for sl in moved:
            mover.finish(sl, mover.start(sl)[1])
        gone = np.isin(slot, moved)
        redirects.clear()
        assert s.delete("mv", ids[gone]) == int(gone.sum())
        assert "MOVED" in redirects
        assert s.num_rows("mv") == 4400 - int(gone.sum())

        # ASK: a slot caught half moved, its keys already on the new node
        sl = by_slot[9]
        _, dst = mover.start(sl)
        redirects.clear()
        here = slot == sl
        got, found = s.pull("mv", ids[here])
        assert found.all() and np.array_equal(got, rows[here]) and "ASK" in redirects
        s.push("mv", ids[here], rows[here] * 2)
        rows[here] *= 2
        mover.finish(sl, dst)

        keep = ~gone
        got, found = s.pull("mv", np.concatenate([ids, fresh]))
        np.testing.assert_array_equal(found, np.concatenate([keep, np.ones(400, bool)]))
        np.testing.assert_array_equal(got[: len(ids)][keep], rows[keep])
        np.testing.assert_array_equal(got[len(ids) :], fresh_rows)
        assert s.num_rows("mv") == 4400 - int(gone.sum())
        true_rows = sum(
            c.hlen(k) for c in mover.clients for k in c.scan_iter(match=f"dn:{redis_namespace}:mv:*r:{{*".encode())
        )
        assert true_rows == 4400 - int(gone.sum())
        s.close()
    finally:
        mover.close()
        cluster.close()
