"""RedisStore's rows on Redis Cluster: each id's node, and a pipeline per node sent before any
reply is read; redirects while slots move.

On Cluster the compiled module also tells each id's node (its bucket's slot, looked up in
an array of the 16384 slots' nodes rebuilt whenever redis-py's slot map changes); each node gets
its own pipeline (HMGETs, or plain HSETs / HDELs whose replies sum to the count change) on a
connection from that node's pool, every request sent before any reply is read, so the nodes work
at once. A command answered MOVED, ASK, TRYAGAIN or CLUSTERDOWN while slots move, and a node's
part whose connection failed, are sent again through redis-py's commands, which follow the
redirect (a MOVED updates redis-py's slot map first). A write whose connection dropped after it
was sent is written again, and rows it had already added then go uncounted (as with redis-py's
own retries).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import redis.cluster
import redis.event
from redis._parsers.base import BaseParser  # the error classes of error replies, as redis-py raises them
from redis.crc import key_slot

from dynemb.ps_server.backends import redis_keys as layout
from dynemb.ps_server.backends.redis_durable import last_integer, wait_command
from dynemb.ps_server.backends.redis_keys import _REDIS_ERRORS, _TableMeta, _timed_out
from dynemb.ps_server.backends.redis_rows import RedisRows, _hmget_reader, _write_plan
from dynemb.ps_server.errors import (
    PSError,
)
from dynemb.ps_server.hashing import bucket_of  # re-exported: bench/raw_redis.py reads the same buckets


@dataclass(frozen=True)
class _SlotMap:
    """Which node serves each Cluster slot, as redis-py's slot map said at `version`."""

    version: int
    slot_node: np.ndarray  # int32 per slot: an index into pools, or -1 (no node serves it)
    pools: list  # each node's redis-py connection pool
    source: dict  # redis-py's slot map it was built from (replaced on a full refresh)


class _SlotMapWatch:
    """Told by redis-py whenever its slot map changes (a full refresh or a MOVED)."""

    def __init__(self, store: RedisClusterRows) -> None:
        self.store = weakref.ref(store)  # the client (its dispatcher) must not keep the store alive

    def listen(self, event: object) -> None:
        store = self.store()
        if store is not None:
            store._slot_changed()


class RedisClusterRows(RedisRows):
    """Rows on Redis Cluster (see the module)."""

    def _native_pull(
        self, meta: _TableMeta, ids: np.ndarray, out: np.ndarray, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """The compiled row path's pull: Cluster's (_cluster_pull) on a cluster."""
        if self.cluster:
            return self._cluster_pull(meta, ids, out, stamps)
        return super()._native_pull(meta, ids, out, stamps)

    def _native_write(self, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray | None) -> int:
        """The compiled row path's write: Cluster's (_cluster_write) on a cluster."""
        return self._cluster_write(meta, ids, rows) if self.cluster else super()._native_write(meta, ids, rows)

    def _watch_slot_map(self) -> None:
        """Have redis-py tell this store when its slot map changes (its event dispatcher, which
        it fires after a full refresh and after a MOVED moved a slot)."""
        assert isinstance(self.client, redis.cluster.RedisCluster)
        dispatcher = getattr(self.client.nodes_manager, "_event_dispatcher", None)
        if dispatcher is None:  # a redis-py without it: a rebuilt map is checked against the cache object
            return
        dispatcher.register_listeners({redis.event.AfterSlotsCacheRefreshEvent: [_SlotMapWatch(self)]})

    def _slots(self) -> _SlotMap:
        """The slot -> node map, rebuilt from redis-py's when that changed since it was built."""
        assert isinstance(self.client, redis.cluster.RedisCluster)
        manager = self.client.nodes_manager
        have = self._slot_map
        if have is not None and have.version == self._slot_version and have.source is manager.slots_cache:
            return have
        with self._slot_lock:
            version = self._slot_version  # read first: a change while it is built makes it stale
            cache = manager.slots_cache  # redis-py replaces the dict on a refresh, changes a slot in place on a MOVED
            owners = cache.copy()
            index: dict[str, int] = {}
            nodes: list[redis.cluster.ClusterNode] = []
            slot_node = np.full(redis.cluster.REDIS_CLUSTER_HASH_SLOTS, -1, dtype=np.int32)
            for slot, serving in owners.items():
                if not serving:
                    continue
                k = index.setdefault(serving[0].name, len(nodes))  # the primary: writes go there, as redis-py's
                if k == len(nodes):
                    nodes.append(serving[0])
                slot_node[slot] = k
            with self._redis():
                pools = [self.client.get_redis_connection(node).connection_pool for node in nodes]
            made = _SlotMap(version, slot_node, pools, cache)
            self._slot_map = made
        return made

    def _slot_changed(self) -> None:
        self._slot_version = next(self._slot_versions)  # next() of a count is atomic: no lost change

    def _by_node(self, meta: _TableMeta, ids: np.ndarray) -> tuple[_SlotMap, list[tuple[int, np.ndarray]], list]:
        """(the slot map, [(node, positions of the ids it serves)...], [positions of ids no node
        serves]) with the node of each id's bucket from the compiled module: no Python per id."""
        mod = self._native
        assert mod is not None
        smap = self._slots()
        node = np.empty(len(ids), dtype=np.int32)
        mod.slot_nodes(ids, meta.num_buckets, meta.prefix.rpartition(b"{")[2], smap.slot_node, node)
        order = np.argsort(node, kind="stable")  # stable: each node's ids stay in batch order
        bounds = np.cumsum(np.bincount(node + 1, minlength=len(smap.pools) + 1)).tolist()
        parts = [(k, order[bounds[k] : bounds[k + 1]]) for k in range(len(smap.pools)) if bounds[k + 1] > bounds[k]]
        return smap, parts, [order[: bounds[0]]] if bounds[0] else []

    def _send_one(self, key: bytes, request: bytes) -> tuple[bytearray, int] | None:
        """See RedisRows._send_one: on Cluster, to the node that serves key's slot."""
        if not self.cluster:
            return super()._send_one(key, request)
        smap = self._slots()
        node = int(smap.slot_node[key_slot(key)])
        if node < 0:
            return None
        return self._cluster_exchange(smap, [(node, request, 1, 64, None)])[0]

    def _redirected(self, text: str) -> bool:
        """Whether an error reply says the key's slot is served elsewhere or on the move (MOVED,
        ASK, TRYAGAIN, CLUSTERDOWN): the command is then sent again through redis-py, which
        follows it. A MOVED updates redis-py's slot map first, as redis-py does on one."""
        word = text.split(" ", 1)[0]
        if word == "MOVED":
            assert isinstance(self.client, redis.cluster.RedisCluster)
            moved = BaseParser.parse_error(text)
            if isinstance(moved, redis.exceptions.MovedError):
                with contextlib.suppress(*_REDIS_ERRORS, ValueError, KeyError):
                    self.client.nodes_manager.move_slot(moved)
            self._slot_changed()
        return word in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")

    def _cluster_exchange(self, smap: _SlotMap, sends: list[tuple]) -> list[tuple[bytearray, int] | None]:
        """Each send (node, request, replies, expect_bytes, take) as _exchange does it, on a
        connection from its node's pool, at most one send per node: every request is sent
        first, then each node's replies are read, so the nodes answer at once. Per send: its
        (buffer, end), each in a buffer of its own, or None where the node's connection failed
        (closed; the caller sends that part again through redis-py, which reconnects or finds
        the slot's new node). A timeout raises; a connection not read to its end is closed."""
        conns: dict[int, Any] = {}
        results: list[tuple[bytearray, int] | None] = [None] * len(sends)
        try:
            for i, (node, request, *_) in enumerate(sends):
                pool = smap.pools[node]
                try:
                    conns[i] = pool.get_connection()
                    conns[i].send_packed_command([request])
                except (redis.ConnectionError, OSError) as exc:
                    if _timed_out(exc):
                        raise
                    conn = conns.pop(i, None)
                    if conn is not None:
                        conn.disconnect()
                        pool.release(conn)
            for i, conn in list(conns.items()):
                _, _, replies, expect_bytes, take = sends[i]
                try:
                    results[i] = self._recv(conn, replies, expect_bytes, take, slot=i)
                except (redis.ConnectionError, OSError) as exc:
                    if _timed_out(exc):
                        raise
                    conn.disconnect()
                del conns[i]
                smap.pools[sends[i][0]].release(conn)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._raise_io(exc)
        finally:
            for i, conn in conns.items():  # out of step with its stream
                conn.disconnect()
                smap.pools[sends[i][0]].release(conn)
        return results

    def _cluster_pull(
        self, meta: _TableMeta, ids: np.ndarray, out: np.ndarray, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """_native_pull on Cluster: each node's HMGETs built and read by the compiled module,
        all nodes at once (_cluster_exchange); the positions of the ids not found."""
        schema = meta.schema
        mod = self._native
        assert mod is not None
        step = max(1, min(layout.PIPELINE_MAX_IDS, layout.PIPELINE_MAX_BYTES // meta.value_bytes))
        absent_parts = []
        for lo in range(0, len(ids), step):
            chunk = ids[lo : lo + step]
            rows = out[lo : lo + len(chunk)]
            chunk_stamps = None if stamps is None else stamps[lo : lo + len(chunk)]
            smap, parts, again = self._by_node(meta, chunk)
            sends, states = [], []
            for node, pos in parts:
                k = len(pos)
                order = np.empty(k, dtype=np.int64)
                request, commands = mod.pull_request(chunk[pos], meta.num_buckets, meta.prefix, order)
                missing = np.empty(k, dtype=np.int64)
                state: list = [0, 0, None]  # fields read, ids absent, the first error reply
                # the i-th field asked for is the row of chunk[pos[order[i]]]: rows[pos[order[i]]]
                take = _hmget_reader(mod, pos[order], rows, schema.row_bytes, missing, state, chunk_stamps)
                sends.append((node, request, commands, k * (meta.value_bytes + 16) + commands * 16, take))
                states.append((pos, missing, state))
            try:
                replies = self._cluster_exchange(smap, sends)
            except OverflowError:
                raise self._wrong_size(schema.name) from None
            except ValueError as exc:
                raise PSError(f"Redis at {self.address}: {exc}") from None
            error = None
            for (pos, missing, state), reply in zip(states, replies):
                if reply is None or (state[2] is not None and self._redirected(state[2])):
                    again.append(pos)  # every row of the part is read again
                elif state[2] is not None:
                    error = error or state[2]
                elif state[0] != len(pos):
                    raise PSError(f"Redis at {self.address}: fewer fields in the HMGET replies than asked for")
                elif state[1]:
                    absent_parts.append(missing[: state[1]] + lo)
            if error is not None:
                raise self._error_reply(error)
            if again:
                pos = np.concatenate(again)
                redone = np.empty((len(pos), schema.width), dtype=schema.np_dtype)
                redone_stamps = None if chunk_stamps is None else np.zeros(len(pos), dtype=chunk_stamps.dtype)
                found = self._py_pull(meta, chunk[pos], redone, redone_stamps)
                rows[pos] = redone
                if chunk_stamps is not None and redone_stamps is not None:
                    chunk_stamps[pos] = redone_stamps
                absent_parts.append(pos[~found] + lo)
        if not absent_parts:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate(absent_parts))

    def _cluster_write(self, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray | None) -> int:
        """_native_write on Cluster: plain HSETs (rows given) or HDELs of each node's buckets,
        built by the compiled module, all nodes at once; the row count is changed after, by the
        fields added or removed (returned). Buckets whose command was redirected, and the parts
        of a node whose connection failed, are written again through redis-py (_write)."""
        schema = meta.schema
        mod = self._native
        assert mod is not None
        command = "HSET" if rows is not None else "HDEL"
        step, suffix = _write_plan(meta, rows is not None)
        total = 0
        try:
            for lo in range(0, len(ids), step):
                chunk = ids[lo : lo + step]
                chunk_rows = None if rows is None else rows[lo : lo + step]
                smap, parts, again = self._by_node(meta, chunk)
                sends, waits = [], []
                for node, pos in parts:
                    part_rows = None if chunk_rows is None else chunk_rows[pos]
                    request, commands = mod.plain_write_request(
                        chunk[pos], part_rows, schema.row_bytes, meta.num_buckets, meta.prefix, suffix
                    )
                    wanted = self._waits.wanted(smap.pools[node])
                    if wanted:  # WAIT last, on the node's same connection (redis_durable.py)
                        request += wait_command(wanted, self._waits.durability.timeout_ms)
                    waits.append(wanted)
                    sends.append((node, request, commands + bool(wanted), 16 * commands + 64, None))
                error = None
                short: list[tuple[Any, int, int]] = []
                replies = self._cluster_exchange(smap, sends)
                for (node, pos), send, reply, wanted in zip(parts, sends, replies, waits):
                    if reply is None:
                        again.append(pos)
                        continue
                    try:
                        changed, failed = mod.integer_replies(reply[0], reply[1], send[2])
                        acked = last_integer(*reply) if wanted else 0
                    except ValueError as exc:
                        raise PSError(f"Redis at {self.address}: {exc}") from None
                    total += changed - acked
                    if wanted:
                        short.append((smap.pools[node], wanted, acked))
                    redirected = []
                    for c, text in failed:
                        if self._redirected(text):
                            redirected.append(c)
                        else:
                            error = error or text
                    if redirected:  # the commands went bucket by bucket, in ascending order
                        b = bucket_of(chunk[pos], meta.num_buckets)
                        again.append(pos[np.isin(b, np.unique(b)[redirected])])
                if again:
                    pos = np.sort(np.concatenate(again))  # in batch order: a repeated id's last row wins
                    total += self._py_write(meta, command, chunk[pos], None if chunk_rows is None else chunk_rows[pos])
                if error is not None:
                    raise self._error_reply(error)
                for pool, wanted, acked in short:
                    self._waits.check(pool, wanted, acked, f"Redis Cluster node {_node_name(pool)}")
        except BaseException:
            with contextlib.suppress(PSError):  # what was written is counted
                self._count_written(meta, total if rows is not None else -total)
            raise
        self._count_written(meta, total if rows is not None else -total)
        return total


def _node_name(pool) -> str:
    """host:port of a node's connection pool, for messages."""
    kw = pool.connection_kwargs
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}"


def _follow_ask_to_new_masters(client: redis.cluster.RedisCluster) -> None:
    """Let the client follow an ASK to a master that owns no slot yet.

    redis-py (8.1) looks an ASK's target up among the nodes it learnt from CLUSTER SLOTS, which
    lists only nodes that own slots; while the first slot moves to a new master the lookup
    finds nothing and the command dies with AttributeError (redis/redis-py#4015). Here a node
    name that is not known becomes a primary at that address (as redis-py does for a MOVED),
    kept until the client next reads the slot map; SCRIPT LOAD then reaches it too.
    """
    manager = client.nodes_manager
    lookup = manager.get_node

    def get_node(host: str | None = None, port: int | None = None, node_name: str | None = None):
        node = lookup(host, port, node_name)
        if node is None and node_name and not (host or port):
            at, _, number = node_name.rpartition(":")
            if at and number.isdigit():
                with manager._lock:
                    node = manager.nodes_cache.setdefault(
                        node_name, redis.cluster.ClusterNode(at, int(number), redis.cluster.PRIMARY)
                    )
        return node

    manager.get_node = get_node  # type: ignore[method-assign]
