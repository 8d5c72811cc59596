"""RedisStore's rows on standalone Redis: pull, push and delete through the compiled row path
or redis-py's pipelines, and export (Redis Cluster's rows: redis_cluster.py).

Writes are plain HSETs and HDELs, one per bucket; the table's row count is changed after them by
a small script that checks the table's creation token (_add_rows): a write still in flight when
its table was dropped (and perhaps created again under that name) lands in the dropped table's
own bucket keys, which nothing reads any more (a table created since has another token), and on
standalone Redis fails with TableNotFound. On Cluster the same write stays quiet (it cannot tell
whether another PS's write was first).

Pull, push and delete take the compiled row path (csrc/redis_rows_module.cpp): one call groups
the ids by bucket and writes the whole pipeline (HMGETs, HSETs or HDELs) as Redis protocol
bytes, sent on a pooled connection; a big write goes in parts, runs of buckets, each sent as
soon as it is made so that Redis works on one while the next is made. The replies are read from
the socket into a per-thread buffer and copied into the rows run by run as they arrive, so no
row becomes a Python object. The commands and keys are redis-py's path's own, so either reads
what the other wrote.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import socket
from collections.abc import Callable, Iterator
from typing import NoReturn

import numpy as np
import redis
import redis.cluster
import redis.event

from dynemb.common.arrays import unique
from dynemb.ps_server.backends import redis_keys as layout
from dynemb.ps_server.backends.redis_durable import last_integer, wait_command
from dynemb.ps_server.backends.redis_keys import (
    _WRITTEN_ROWS_LUA,
    _as_ids,
    _group_by_bucket,
    _raw,
    _TableMeta,
    _timed_out,
    id_fields,
)
from dynemb.ps_server.backends.redis_tables import RedisTables
from dynemb.ps_server.errors import (
    BackendUnavailable,
    InvalidArgument,
    PSError,
)
from dynemb.ps_server.hashing import bucket_of
from dynemb.ps_server.lifecycle import STAMP_DTYPE, Cutoff, SweepSlice, now_stamp, stamp_bytes

# KEYS[1] a bucket; ARGV[1] a cutoff's stamp, ARGV[2] the table's lifecycle `since`, ARGV[3...]
# fields the sweep found due: those whose stamp (at least `since`) is still at most ARGV[1] are
# deleted; returns them. A row written, pulled or touched since the sweep read it has a newer
# stamp (now, past any cutoff: that is at least keep_s old) and stays. The ids of the cutoff's own
# second that are due were chosen by the sweep (Cutoff.due): Lua's numbers cannot hold int64 ids.
_EXPIRE_LUA = (
    "local last = tonumber(ARGV[1]) local since = tonumber(ARGV[2]) local out = {} "
    "for i = 3, #ARGV do local v = redis.call('HGET', KEYS[1], ARGV[i]) "
    "if v and #v >= 4 then local s = struct.unpack('<I4', v, #v - 3) if s < since then s = since end "
    "if s <= last then redis.call('HDEL', KEYS[1], ARGV[i]) out[#out + 1] = ARGV[i] end end end "
    "return out"
)


# KEYS[1] a bucket; ARGV[1] a stamp, ARGV[2] the 4 bytes of now's, ARGV[3...] fields: each stored
# field stamped below ARGV[1] gets the new stamp (its row unchanged); returns the fields absent.
_TOUCH_LUA = (
    "local before = tonumber(ARGV[1]) local absent = {} "
    "for i = 3, #ARGV do local v = redis.call('HGET', KEYS[1], ARGV[i]) "
    "if not v then absent[#absent + 1] = ARGV[i] "
    "elseif #v >= 4 and struct.unpack('<I4', v, #v - 3) < before then "
    "redis.call('HSET', KEYS[1], ARGV[i], string.sub(v, 1, -5) .. ARGV[2]) end end "
    "return absent"
)


class RedisRows(RedisTables):
    """Rows on standalone Redis, and export (see the module)."""

    def _pool(self) -> redis.ConnectionPool:
        """Standalone Redis's connection pool (on Cluster each node has its own: _SlotMap)."""
        assert isinstance(self.client, redis.Redis)
        return self.client.connection_pool

    def _write(self, meta: _TableMeta, command: str, part: list, values: list, per_id: int) -> int:
        """HSET or HDEL of each (bucket, start, end) of part with the ids' values[per_id * start :
        per_id * end] (field-row pairs, or fields), a command per bucket in one pipeline; the
        fields added or removed (the caller changes the row count by them)."""

        wanted = 0 if self.cluster else self._waits.wanted(self._pool())

        def fill(pipe) -> None:
            for b, start, end in part:
                pipe.execute_command(command, meta.key(b), *values[per_id * start : per_id * end])
            if wanted:  # one pipeline, one connection: WAIT covers its writes (redis_durable.py)
                pipe.execute_command("WAIT", wanted, self._waits.durability.timeout_ms)

        replies = self._run_scripted(fill)
        if wanted:
            self._waits.check(self._pool(), wanted, int(replies.pop()), f"Redis at {self.address}")
        return int(sum(replies))

    def _exchange(
        self,
        request: bytes,
        replies: int,
        expect_bytes: int,
        take: Callable[[bytearray, int, int, int], None] | None = None,
    ) -> tuple[bytearray, int]:
        """Send request (`replies` commands, already in the Redis protocol) on a pooled
        connection and read their replies whole: (buffer, end of the replies in it). The socket
        is read here, not by redis-py's parser, so no reply becomes Python objects; a
        connection that fails or times out midway is closed (its stream is out of step), and
        the exchange is tried once more on a fresh one, as redis-py retries a command.

        take(buf, start, end, count), if given, is handed each run of whole replies as it
        arrives (buf[start:end], count of them), so they are read while Redis still answers
        the rest; on a retry it sees them again from the first."""
        buf, end, _ = self._exchange_parts(iter([(request, replies)]), lambda _: expect_bytes, take)
        return buf, end

    def _exchange_parts(
        self,
        parts: Iterator[tuple[bytes, int]],
        expect_bytes: Callable[[int], int],
        take: Callable[[bytearray, int, int, int], None] | None = None,
    ) -> tuple[bytearray, int, int]:
        """_exchange of requests that parts yields (each with its count of commands), each sent
        as soon as it is made, so Redis works on one while the next is made; then every reply
        read: (buffer, end of the replies in it, replies). expect_bytes(replies) sizes the
        buffer. A retry sends the parts made so far again, then makes the rest."""
        assert isinstance(self.client, redis.Redis)  # on Cluster: _cluster_exchange
        pool = self._pool()
        sent: list[tuple[bytes, int]] = []
        for attempt in (0, 1):
            with self._redis():  # none free (max_connections), or Redis unreachable
                conn = pool.get_connection()
            try:
                for request, _ in sent:
                    conn.send_packed_command([request])
                for request, commands in parts:  # on a retry, where the first try left off
                    sent.append((request, commands))
                    conn.send_packed_command([request])
                replies = sum(commands for _, commands in sent)
                buf, end = self._recv(conn, replies, expect_bytes(replies), take)
                return buf, end, replies
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                conn.disconnect()
                if attempt or _timed_out(exc):
                    self._raise_io(exc)
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        raise AssertionError("unreachable")

    def _raise_io(self, exc: BaseException) -> NoReturn:
        """Raise a failed exchange's socket error as the PS's error (as redis-py's would be)."""
        with self._redis():
            if isinstance(exc, socket.timeout):
                raise redis.TimeoutError(f"timed out reading from Redis at {self.address}") from None
            if isinstance(exc, OSError):
                raise redis.ConnectionError(f"{type(exc).__name__}: {exc}") from None
            raise exc

    def _recv(
        self,
        conn,
        replies: int,
        expect_bytes: int,
        take: Callable[[bytearray, int, int, int], None] | None = None,
        slot: int = 0,
    ) -> tuple[bytearray, int]:
        """Read `replies` whole replies from conn's socket into this thread's reply buffer
        number `slot` (one per connection read at once); (buffer, end of the replies)."""
        mod = self._native
        assert mod is not None  # only called when there is one
        name = "buf" if slot == 0 else f"buf{slot}"
        buf = getattr(self._buffers, name, None)
        if buf is None or len(buf) < expect_bytes:
            buf = bytearray(max(expect_bytes, 1 << 16))
            setattr(self._buffers, name, buf)
        sock = conn._sock
        assert sock is not None  # connected by send_packed_command
        view = memoryview(buf)
        end = pos = done = 0
        while done < replies:
            if end == len(buf):  # a reply bigger than foreseen: a bigger buffer, with what came
                bigger = bytearray(2 * len(buf))
                bigger[:end] = view
                buf = bigger
                setattr(self._buffers, name, buf)
                view = memoryview(buf)
            got = sock.recv_into(view[end:])
            if not got:
                raise redis.ConnectionError(f"Redis at {self.address} closed the connection mid-reply")
            end += got
            start = pos
            pos, complete = mod.scan(buf, pos, end, replies - done)
            done += complete
            if take is not None and complete:
                take(buf, start, pos, complete)
        if len(buf) > layout.REPLY_BUFFER_KEEP_BYTES:
            setattr(self._buffers, name, None)
        return buf, end

    def _native_pull(
        self, meta: _TableMeta, ids: np.ndarray, out: np.ndarray, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """On standalone Redis (RedisClusterRows has Cluster's): rows of ids into out (a pipeline
        of HMGETs per at most PIPELINE_MAX_IDS ids, built and read by the compiled module), and
        their stamps into stamps (a uint32 per id; needed for a table whose values carry them);
        the positions of the ids not found."""
        schema = meta.schema
        mod = self._native
        assert mod is not None  # only called when there is one
        n = len(ids)
        step = max(1, min(layout.PIPELINE_MAX_IDS, layout.PIPELINE_MAX_BYTES // meta.value_bytes))
        absent_parts = []
        order = np.empty(min(n, step), dtype=np.int64)
        missing = np.empty(min(n, step), dtype=np.int64)
        for lo in range(0, n, step):
            part = ids[lo : lo + step]
            k = len(part)
            request, commands = mod.pull_request(part, meta.num_buckets, meta.prefix, order[:k])
            state: list = [0, 0, None]  # fields read, ids absent, the first error reply
            part_stamps = None if stamps is None else stamps[lo : lo + k]
            take = _hmget_reader(mod, order[:k], out[lo : lo + k], schema.row_bytes, missing, state, part_stamps)
            try:
                self._exchange(request, commands, k * (meta.value_bytes + 16) + commands * 16, take)
            except OverflowError:
                raise self._wrong_size(schema.name) from None
            except ValueError as exc:
                raise PSError(f"Redis at {self.address}: {exc}") from None
            if state[2] is not None:
                raise self._error_reply(state[2])
            if state[0] != k:
                raise PSError(f"Redis at {self.address}: fewer fields in the HMGET replies than asked for")
            if state[1]:
                absent_parts.append(missing[: state[1]] + lo)
        if not absent_parts:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate(absent_parts))

    def _native_write(self, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray | None) -> int:
        """On standalone Redis (RedisClusterRows has Cluster's): plain HSETs of the ids' rows (rows
        given, each with its stamp) or HDELs of the ids (None), one per bucket, in pipelines of at
        most PIPELINE_MAX_IDS ids built by the compiled module (a big one in parts: _write_parts);
        then the row count is changed by the fields added or removed (returned)."""
        mod = self._native
        assert mod is not None  # only called when there is one
        step, suffix = _write_plan(meta, rows is not None)
        pool = self._pool()
        total = 0
        try:
            for lo in range(0, len(ids), step):
                part_rows = None if rows is None else rows[lo : lo + step]
                parts = _write_parts(mod, meta, ids[lo : lo + step], part_rows, suffix)
                wanted = self._waits.wanted(pool)
                if wanted:  # WAIT last, on the same connection (redis_durable.py)
                    parts = itertools.chain(parts, [(wait_command(wanted, self._waits.durability.timeout_ms), 1)])
                buf, end, commands = self._exchange_parts(parts, lambda n: 16 * n + 64)
                try:
                    changed, failed = mod.integer_replies(buf, end, commands)
                    acked = last_integer(buf, end) if wanted else 0
                except ValueError as exc:
                    raise PSError(f"Redis at {self.address}: {exc}") from None
                total += changed - acked
                if failed:
                    self._read_only_reply(failed[0][1])
                    raise self._error_reply(failed[0][1])
                if wanted:
                    self._waits.check(pool, wanted, acked, f"Redis at {self.address}")
        except BaseException:
            with contextlib.suppress(PSError):  # what was written is counted
                self._count_written(meta, total if rows is not None else -total)
            raise
        self._count_written(meta, total if rows is not None else -total)
        return total

    def _read_only_reply(self, text: str) -> None:
        """On standalone Redis, a READONLY reply to a write says the Redis this store writes to
        is a replica now (Sentinel failed it over): its connections are closed, so the next ones
        ask Sentinel for the master (redis-py does the same on its own path)."""
        if text.startswith("READONLY") and not self.cluster:
            self._pool().disconnect()

    def _count_written(self, meta: _TableMeta, change: int) -> None:
        """_add_rows on the compiled path: the count script's EVALSHA sent as protocol bytes
        (through redis-py's pipeline it cost the PS 5-10 times the script's round trip; on
        Cluster redis-py also asks the node for the script's keys first, COMMAND GETKEYS).
        Where the script did not run (not loaded: Redis restarted, SCRIPT FLUSH; the slot
        moved; no connection), it goes the redis-py way, which loads it and follows the slot."""
        sha, name = self._sha(_WRITTEN_ROWS_LUA).encode(), meta.schema.name.encode()
        request = _command(b"EVALSHA", sha, b"1", self._rows_key, name, meta.token.encode(), b"%d" % change)
        assert self._native is not None  # only called on the compiled path
        got = self._send_one(self._rows_key, request)
        reply = None if got is None else self._native.integer_reply(*got)
        if reply is None or (isinstance(reply, str) and (reply.startswith("NOSCRIPT") or self._redirected(reply))):
            self._add_rows(meta, change)  # the script did not run
            return
        if isinstance(reply, str):
            raise self._error_reply(reply)
        if not reply and not self.cluster:
            raise self._gone(meta.schema.name)

    def _meta(self, table: str, dropping: bool = False) -> _TableMeta:
        """See RedisTables._meta: on the compiled path the HGET goes as protocol bytes on its own
        connection (the metadata is read on every call: through redis-py that cost the PS ~13%
        of its time under ps_load on Cluster); redis-py's way where that fails."""
        if self._native is None:
            return super()._meta(table, dropping)
        got = self._send_one(self._meta_key, _command(b"HGET", self._meta_key, table.encode()))
        if got is None or got[0][:1] != b"$":  # not sent there, or an error reply (a redirect too)
            return super()._meta(table, dropping)
        buf, end = got
        head = buf.index(b"\r\n")
        size = int(buf[1:head])
        if size < 0:
            raise self._not_found(table)
        return self._parse_meta(table, bytes(buf[head + 2 : head + 2 + size]), dropping)

    def _send_one(self, key: bytes, request: bytes) -> tuple[bytearray, int] | None:
        """The reply (buffer, end) of one command about key, sent on the compiled path's own
        connection; None where it could not be sent there (redis-py's way then: on Cluster)."""
        return self._exchange(request, 1, 64)

    def _redirected(self, text: str) -> bool:
        """Whether an error reply says the command went to the wrong node (never on standalone)."""
        return False

    def _py_pull(
        self, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows of ids into rows through redis-py's commands (absent ones zeros), and their stamps
        into stamps (if the table has them and it is given); which were found."""
        schema = meta.schema
        table = schema.name
        n = len(ids)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return found
        g = _group_by_bucket(ids, meta.num_buckets)
        fields = id_fields(ids[g.order])
        values: list = []  # values[k]: the row of ids[order[k]], or None
        for part in g.pipelines(meta.value_bytes):
            pipe = self._pipeline()
            for b, start, end in part:
                pipe.execute_command("HMGET", meta.key(b), *fields[start:end])
            for reply in self._run(pipe):
                values += reply
        present = list(filter(None, values))  # drops None (and b"", caught by the size checks)
        blob = b"".join(present)
        n_hit = len(present)
        if n_hit == n and len(blob) == n * meta.value_bytes:  # every id found: no mask to build
            rows[g.order], got = _split_values(blob, meta, n)
            if stamps is not None and got is not None:
                stamps[g.order] = got
            found[:] = True
            return found
        hit = np.fromiter(map(operator.is_not, values, itertools.repeat(None)), dtype=bool, count=n)
        if int(hit.sum()) != n_hit or len(blob) != n_hit * meta.value_bytes:
            raise PSError(
                f"table {table!r} in Redis namespace {self.namespace!r} holds rows of the wrong size "
                f"(expected {schema.row_bytes} bytes each): the data does not match its schema"
            )
        where = g.order[hit]
        rows[where], got = _split_values(blob, meta, n_hit)
        if stamps is not None and got is not None:
            stamps[where] = got
        rows[g.order[~hit]] = 0
        found[where] = True
        return found

    def _py_write(self, meta: _TableMeta, command: str, ids: np.ndarray, rows: np.ndarray | None) -> int:
        """HSET of the ids' rows or HDEL of the ids through redis-py's commands (_write); the
        fields added or removed (on Cluster the caller changes the row count by them)."""
        g = _group_by_bucket(ids, meta.num_buckets)
        fields = id_fields(ids[g.order])
        values: list = fields
        per_id = 1
        if rows is not None:  # field, value, field, value... in bucket order: one HSET per bucket
            values, per_id = [None] * (2 * len(ids)), 2
            values[0::2] = fields
            row_values = rows[g.order].view(f"V{meta.schema.row_bytes}").ravel().tolist()
            if meta.stamped:
                stamp = stamp_bytes()
                row_values = [bytes(v) + stamp for v in row_values]
            values[1::2] = row_values
        changed = 0
        for part in g.pipelines(meta.value_bytes + 8 if rows is not None else 8):
            changed += self._write(meta, command, list(part), values, per_id)
        if self.cluster and not self._waits.durability.off:
            self._confirm_replicated(meta, ids)
        return int(changed)

    def _confirm_replicated(self, meta: _TableMeta, ids: np.ndarray) -> None:
        """On Cluster, after writes through redis-py's pipeline (whose connections are its own):
        on each master of the ids' buckets, a marker key that expires at once is set and WAIT
        sent on the same connection; the marker is written after those writes, so a replica that
        has it has them (redis_durable.py). A bucket whose slot is on the move fails the write.

        Raises:
            BackendUnavailable: too few replicas had the writes, or a slot moved meanwhile.
        """
        assert isinstance(self.client, redis.cluster.RedisCluster)
        markers: dict[str, tuple] = {}
        for b in np.unique(bucket_of(ids, meta.num_buckets)).tolist():
            key = meta.key(b) + b":w"
            with self._redis():
                node = self.client.get_node_from_key(key)
            markers.setdefault(node.name, (node, key))
        timeout = self._waits.durability.timeout_ms
        for node, key in markers.values():
            with self._redis():
                client = self.client.get_redis_connection(node)
            wanted = self._waits.wanted(client.connection_pool)
            if not wanted:
                continue
            pipe = client.pipeline(transaction=False)
            pipe.set(key, b"1", px=10)
            pipe.execute_command("WAIT", wanted, timeout)
            try:
                with self._redis():
                    _, acked = pipe.execute()
            except BackendUnavailable:
                raise
            except PSError as exc:  # MOVED or ASK: the slot is moving
                raise BackendUnavailable(
                    f"Redis Cluster node {node.name}: cannot confirm replicas have the rows: {exc}"
                ) from None
            self._waits.check(client.connection_pool, wanted, int(acked), f"Redis Cluster node {node.name}")

    def export(self, table: str, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """See Store.export: bucket by bucket, ids in no particular order."""
        if rows_per_chunk < 1:
            raise InvalidArgument(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
        meta = self._meta(table)  # here, so an unknown table raises at the call, not at the first chunk
        return self._export(table, meta, rows_per_chunk)

    def _export(self, table: str, meta: _TableMeta, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        schema = meta.schema
        # Whole buckets are read (HGETALL: one consistent snapshot of each), as many per
        # pipeline as hold about one chunk (at least EXPORT_READ_ROWS rows, so small chunks
        # still cost few round trips), then cut into chunks. The buckets are counted a run of
        # keys at a time (_bucket_lens), so a table of many buckets is never listed whole.
        target = max(rows_per_chunk, layout.EXPORT_READ_ROWS)
        nonempty = ((key, n) for keys, lens in self._bucket_lens(meta) for key, n in zip(keys, lens) if n)
        ids_left = np.zeros(0, dtype=np.int64)
        rows_left = np.zeros((0, schema.width), dtype=schema.np_dtype)
        following = next(nonempty, None)
        while following is not None:
            group: list[bytes] = []
            size = 0
            while following is not None and (not group or size + following[1] <= target):
                group.append(following[0])
                size += following[1]
                following = next(nonempty, None)
            pipe = self._pipeline()
            for key in group:
                pipe.execute_command("HGETALL", key)
            ids_parts, rows_parts = [ids_left], [rows_left]
            for bucket in self._run(pipe):
                if not bucket:  # emptied since it was counted
                    continue
                fields, values = b"".join(bucket.keys()), b"".join(bucket.values())
                if len(fields) != 8 * len(bucket) or len(values) != meta.value_bytes * len(bucket):
                    raise PSError(
                        f"table {table!r} in Redis namespace {self.namespace!r} holds fields or rows of the "
                        f"wrong size (expected 8-byte ids and {schema.row_bytes}-byte rows)"
                    )
                ids_parts.append(np.frombuffer(fields, dtype="<i8").astype(np.int64))
                rows_parts.append(_split_values(values, meta, len(bucket))[0])
            all_ids, all_rows = np.concatenate(ids_parts), np.concatenate(rows_parts)
            last = following is None
            start = 0
            while len(all_ids) - start >= rows_per_chunk or (last and start < len(all_ids)):
                yield all_ids[start : start + rows_per_chunk], all_rows[start : start + rows_per_chunk]
                start += rows_per_chunk
            ids_left, rows_left = all_ids[start:], all_rows[start:]

    # -- rows that expire (lifecycle.py) --------------------------------------------------

    def _expire_read(self, meta: _TableMeta, ids: np.ndarray, found: np.ndarray, stamps: np.ndarray | None) -> None:
        """After a pull of a table whose rows expire: rows found expired count as absent (found
        cleared), and the rest whose stamps are old get new ones, atomically per bucket; a row
        that a sweep deleted between the read and the new stamp counts as absent too."""
        lifecycle = meta.lifecycle
        if stamps is None or not lifecycle.active:
            return
        expired = found & (np.maximum(stamps, lifecycle.since) < lifecycle.expired_before())
        stale = found & ~expired & (stamps < lifecycle.refresh_before())
        if stale.any():
            gone = self._touch(meta, ids[stale], lifecycle.refresh_before())
            if len(gone):
                expired |= found & np.isin(ids, gone)
        if expired.any():
            found &= ~expired
            self._count_expired_reads(meta.schema.name, int(expired.sum()))

    def _count_expired_reads(self, table: str, n: int) -> None:
        with self._cache_lock:
            self.expired_read_counts[table] = self.expired_read_counts.get(table, 0) + n

    def _touch(self, meta: _TableMeta, ids: np.ndarray, before: int) -> np.ndarray:
        """Give the stored ones of ids stamped below `before` a stamp of now (_TOUCH_LUA, a script
        per bucket); the ids absent."""
        ids = unique(np.ascontiguousarray(ids, dtype=np.int64))
        g = _group_by_bucket(ids, meta.num_buckets)
        fields = id_fields(ids[g.order])
        stamp = stamp_bytes()
        absent: list[bytes] = []
        for part in g.pipelines(8):

            def fill(pipe, part=tuple(part)) -> None:
                for b, start, end in part:
                    self._script(pipe, _TOUCH_LUA, [meta.key(b)], [before, stamp, *fields[start:end]])

            for reply in self._run_scripted(fill):
                absent += map(_raw, reply)
        return np.frombuffer(b"".join(absent), dtype="<i8").astype(np.int64)

    def touch(self, table: str, ids: np.ndarray) -> int:
        """See Store.touch: stamps older than the table's touch interval are renewed."""
        meta = self._row_meta(table)
        ids = unique(_as_ids(ids))
        if not meta.stamped or not len(ids):
            return 0
        return len(ids) - len(self._touch(meta, ids, meta.lifecycle.refresh_before() or now_stamp() + 1))

    def _slice_buckets(self, meta: _TableMeta, cursor: int, max_rows: int) -> tuple[int, int]:
        """(first bucket, bucket after the last) of a slice of about max_rows rows from cursor."""
        with self._redis():
            n = self.client.hget(self._rows_key, meta.schema.name)
        rows = max(1, int(n) if n is not None else meta.num_buckets)
        per_slice = max(1, min(layout.PIPELINE_MAX_IDS // 4, max_rows * meta.num_buckets // rows))
        start = min(max(0, cursor), meta.num_buckets)
        return start, min(meta.num_buckets, start + per_slice)

    def _read_buckets(self, meta: _TableMeta, start: int, stop: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(bucket, ids, stamps) of each non-empty bucket in [start, stop) (HGETALL of each). On
        standalone Redis the compiled module reads the replies: no Python object per row, and
        the GIL free meanwhile, for the PS's request threads (the sweeper runs beside them)."""
        if self._native is not None and not self.cluster:
            return self._native_read_buckets(meta, start, stop)
        pipe = self._pipeline()
        for b in range(start, stop):
            pipe.execute_command("HGETALL", meta.key(b))
        out = []
        for b, bucket in zip(range(start, stop), self._run(pipe)):
            if not bucket:
                continue
            fields, values = b"".join(bucket.keys()), b"".join(bucket.values())
            if len(fields) != 8 * len(bucket) or len(values) != meta.value_bytes * len(bucket):
                raise self._wrong_size(meta.schema.name)
            _, stamps = _split_values(values, meta, len(bucket))
            assert stamps is not None
            out.append((b, np.frombuffer(fields, dtype="<i8").astype(np.int64), stamps))
        return out

    def _native_read_buckets(self, meta: _TableMeta, start: int, stop: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """_read_buckets through the compiled module (standalone Redis)."""
        mod = self._native
        assert mod is not None
        keys = [meta.key(b) for b in range(start, stop)]
        request = b"".join(b"*2\r\n$7\r\nHGETALL\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)
        buf, end = self._exchange(request, len(keys), 64 * len(keys))
        room = end // (meta.value_bytes + 18) + 1  # each pair takes at least that many reply bytes
        ids = np.empty(room, dtype=np.int64)
        stamps = np.empty(room, dtype=STAMP_DTYPE)
        buckets = np.empty(room, dtype=np.int64)
        try:
            got = mod.bucket_stamps(buf, end, len(keys), meta.value_bytes, ids, stamps, buckets)
        except ValueError as exc:
            if "wrong size" in str(exc) or "8 bytes" in str(exc):
                raise self._wrong_size(meta.schema.name) from None
            raise PSError(f"Redis at {self.address}: {exc}") from None
        if isinstance(got, str):
            raise self._error_reply(got)
        ids, stamps, buckets = ids[:got], stamps[:got], buckets[:got]
        cuts = np.flatnonzero(np.diff(buckets)) + 1
        return [
            (start + int(b[0]), i, s)
            for b, i, s in zip(np.split(buckets, cuts), np.split(ids, cuts), np.split(stamps, cuts))
            if len(b)
        ]

    def sweep_slice(self, table: str, cursor: int, cutoff: Cutoff, max_rows: int) -> SweepSlice:
        """See Store.sweep_slice: the cursor is a bucket number. The slice's buckets are read
        whole (HGETALL); the rows due are logged, then deleted by a script per bucket that checks
        each one's stamp again (_EXPIRE_LUA)."""
        meta = self._meta(table)
        if not meta.stamped:
            return SweepSlice(0, 0, np.zeros(0, np.int64))
        start, stop = self._slice_buckets(meta, cursor, max_rows)
        since = meta.lifecycle.since
        due, scanned, oldest = [], 0, 0
        for b, ids, stamps in self._read_buckets(meta, start, stop):
            scanned += len(ids)
            stamps = np.maximum(stamps, since)
            old = cutoff.due(stamps, ids)
            if old.any():
                due.append((b, ids[old]))
            if not old.all():
                kept = int(stamps[~old].min())
                oldest = min(oldest, kept) if oldest else kept
        deleted: list[bytes] = []
        if due:
            self._log_deleted(meta, np.concatenate([ids for _, ids in due]))

            def fill(pipe) -> None:
                for b, ids in due:
                    self._script(pipe, _EXPIRE_LUA, [meta.key(b)], [cutoff.stamp, since, *id_fields(ids)])

            for reply in self._run_scripted(fill):
                deleted += map(_raw, reply)
            if deleted:
                self._add_rows(meta, -len(deleted))
        gone = np.frombuffer(b"".join(deleted), dtype="<i8").astype(np.int64)
        return SweepSlice(stop if stop < meta.num_buckets else 0, scanned, gone, oldest)

    def stamps_slice(self, table: str, cursor: int, max_rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        """See Store.stamps_slice (the cursor a bucket number)."""
        meta = self._meta(table)
        if not meta.stamped:
            return 0, np.zeros(0, np.int64), np.zeros(0, STAMP_DTYPE)
        start, stop = self._slice_buckets(meta, cursor, max_rows)
        read = self._read_buckets(meta, start, stop)
        ids = np.concatenate([i for _, i, _ in read]) if read else np.zeros(0, np.int64)
        stamps = np.concatenate([s for _, _, s in read]) if read else np.zeros(0, STAMP_DTYPE)
        since = meta.lifecycle.since
        return (stop if stop < meta.num_buckets else 0), ids, np.maximum(stamps, since).astype(STAMP_DTYPE)


def _write_parts(
    mod, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray | None, suffix: bytes
) -> Iterator[tuple[bytes, int]]:
    """A write's request (plain_write_request) in parts of about WRITE_PART_BYTES, each a run of
    the table's buckets (so no bucket gets two commands), made one at a time as they are asked
    for: Redis works on a part while the next is made. A repeated id stays in its bucket's
    part, in its order, so its last row still wins."""
    row_bytes, per_id = meta.schema.row_bytes, 8 + (0 if rows is None else meta.value_bytes)
    parts = min(layout.WRITE_PARTS_MAX, len(ids) * per_id // layout.WRITE_PART_BYTES)
    if parts <= 1:
        yield mod.plain_write_request(ids, rows, row_bytes, meta.num_buckets, meta.prefix, suffix)
        return
    rows = None if rows is None else np.ascontiguousarray(rows)
    which = bucket_of(ids, meta.num_buckets) * parts // meta.num_buckets
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(parts + 1))
    for k in range(parts):
        at = order[bounds[k] : bounds[k + 1]]
        if len(at) and rows is None:
            yield mod.plain_write_request(ids[at], None, row_bytes, meta.num_buckets, meta.prefix, suffix)
        elif len(at):  # the part's rows read where they are (rows_at), not copied out first
            yield mod.plain_write_request(ids[at], rows, row_bytes, meta.num_buckets, meta.prefix, suffix, at)


def _command(*args: bytes) -> bytes:
    """One Redis command as protocol bytes (a few small arguments; the row path's pipelines are
    the compiled module's)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _write_plan(meta: _TableMeta, with_rows: bool) -> tuple[int, bytes]:
    """(ids a pipeline of a write carries at most, what follows each row: its stamp, or nothing)."""
    per_id = meta.value_bytes + 8 if with_rows else 8
    step = max(1, min(layout.PIPELINE_MAX_IDS, layout.PIPELINE_MAX_BYTES // per_id))
    return step, stamp_bytes() if meta.stamped and with_rows else b""


def _split_values(blob: bytes, meta: _TableMeta, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows, stamps or None) of n stored values of the table, back to back in blob."""
    schema = meta.schema
    if not meta.stamped:
        return np.frombuffer(blob, dtype=schema.np_dtype).reshape(n, schema.width), None
    raw = np.frombuffer(blob, dtype=np.uint8).reshape(n, meta.value_bytes)
    rows = np.ascontiguousarray(raw[:, : schema.row_bytes]).view(schema.np_dtype).reshape(n, schema.width)
    return rows, np.ascontiguousarray(raw[:, schema.row_bytes :]).view(STAMP_DTYPE).ravel()


def _hmget_reader(
    mod,
    at: np.ndarray,
    rows: np.ndarray,
    row_bytes: int,
    missing: np.ndarray,
    state: list,
    stamps: np.ndarray | None = None,
) -> Callable[[bytearray, int, int, int], None]:
    """take() for _recv: each run of HMGET replies, as it arrives, copied by the compiled module
    into rows (the i-th field asked for into rows[at[i]]). state holds [fields read, ids absent
    (their positions in missing), the first error reply]: an error reply is kept, not raised, so
    every reply is read and the connection stays in step; replies read again from the first (a
    retried exchange) start it afresh."""

    def take(buf: bytearray, start: int, stop: int, count: int) -> None:
        if start == 0:
            state[:] = [0, 0, None]
        got = mod.pull_replies(buf, start, stop, count, at, state[0], rows, row_bytes, missing, state[1], stamps)
        if isinstance(got, str):
            state[2] = state[2] or got
        else:
            state[1], state[0] = got

    return take
