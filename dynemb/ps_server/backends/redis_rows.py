"""RedisStore's rows on standalone Redis: pull, push and delete through the compiled row path
or redis-py's pipelines, and export (Redis Cluster's rows: redis_cluster.py).

A write on standalone Redis checks, in its script, that the table's metadata is still the raw
bytes the write read: a write still in flight when its table was dropped (and perhaps created
again under that name) writes nothing and fails with TableNotFound. On Cluster the writes are
plain per-bucket commands (the buckets span slots, so no script sees the metadata): such a
write lands in the dropped table's own bucket keys, which nothing reads any more (a table
created since under the name has another token), and its row count change, made only while
the creation token kept beside the count is still the write's, is left out.

Pull, push and delete take the compiled row path (csrc/redis_rows_module.cpp): one call groups
the ids by bucket and writes the whole pipeline (HMGETs, or the write script's EVALSHA) as Redis
protocol bytes, sent on a pooled connection; the replies are read from its socket into a
per-thread buffer and copied into the rows run by run as they arrive, so no row becomes a Python
object. The commands, keys and scripts are redis-py's path's own, so either reads what the other
wrote.
"""

from __future__ import annotations

import itertools
import operator
import socket
from collections.abc import Callable, Iterator
from typing import NoReturn

import numpy as np
import redis
import redis.cluster
import redis.event

from dynemb.ps_server.backends import redis_keys as layout
from dynemb.ps_server.backends.redis_keys import _ADD_COUNT_LUA, _group_by_bucket, _TableMeta, _timed_out, id_fields
from dynemb.ps_server.backends.redis_tables import RedisTables
from dynemb.ps_server.errors import (
    InvalidArgument,
    PSError,
)

# Standalone Redis: one pipeline's writes and the count change, atomically, if the table's
# metadata is still what the write was planned with (else nothing, and -1: the table was
# dropped, or re-created, since: no orphan bucket keys on standalone Redis).
# KEYS[1] the row-count hash, KEYS[2] the table hash, KEYS[3...] buckets; ARGV[1] the table,
# ARGV[2] its raw metadata, ARGV[3...] how many values each bucket has, then the values (fields,
# or field-row pairs), bucket after bucket. A command takes at most 4000 values (Lua's unpack()
# takes under 8000). Returns the fields added (HSET) or removed (HDEL).
_WRITE_LUA = (
    "if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return -1 end "
    "local nb = #KEYS - 2 local at = nb + 3 local total = 0 "
    "for k = 1, nb do local stop = at + tonumber(ARGV[k + 2]) - 1 "
    "for i = at, stop, 4000 do "
    "total = total + redis.call('CMD', KEYS[k + 2], unpack(ARGV, i, math.min(i + 3999, stop))) end "
    "at = stop + 1 end local n = SIGN total " + _ADD_COUNT_LUA.replace("ROWS", "1") + " return total"
)


_WRITE_SCRIPTS = {
    "HSET": _WRITE_LUA.replace("CMD", "HSET").replace("SIGN", ""),
    "HDEL": _WRITE_LUA.replace("CMD", "HDEL").replace("SIGN", "-"),
}


class RedisRows(RedisTables):
    """Rows on standalone Redis, and export (see the module)."""

    def _write(self, meta: _TableMeta, command: str, part: list, values: list, per_id: int) -> int:
        """HSET or HDEL of each (bucket, start, end) of part with the ids' values[per_id * start :
        per_id * end] (field-row pairs, or fields), as one pipeline; the fields added or removed.
        On standalone Redis one script that changes the row count too; on Cluster a command per
        bucket (a table's buckets span slots), the count changed by the caller afterwards."""
        if self.cluster:

            def fill(pipe) -> None:
                for b, start, end in part:
                    pipe.execute_command(command, meta.key(b), *values[per_id * start : per_id * end])

            return int(sum(self._run_scripted(fill)))
        keys = [self._rows_key, self._meta_key, *(meta.key(b) for b, _, _ in part)]
        args = [meta.schema.name, meta.raw, *(per_id * (end - start) for _, start, end in part)]
        args += values[per_id * part[0][1] : per_id * part[-1][2]]  # the groups are contiguous
        n = int(self._run_scripted(lambda pipe: self._script(pipe, _WRITE_SCRIPTS[command], keys, args))[0])
        if n < 0:
            raise self._gone(meta.schema.name)
        return n

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
        assert isinstance(self.client, redis.Redis)  # on Cluster: _cluster_exchange
        pool = self.client.connection_pool
        for attempt in (0, 1):
            with self._redis():  # none free (max_connections), or Redis unreachable
                conn = pool.get_connection()
            try:
                conn.send_packed_command([request])
                return self._recv(conn, replies, expect_bytes, take)
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

    def _native_pull(self, meta: _TableMeta, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """On standalone Redis (RedisClusterRows has Cluster's): rows of ids into out (a pipeline
        of HMGETs per at most PIPELINE_MAX_IDS ids, built and read by the compiled module); the
        positions of the ids not found."""
        schema = meta.schema
        mod = self._native
        assert mod is not None  # only called when there is one
        n = len(ids)
        step = max(1, min(layout.PIPELINE_MAX_IDS, layout.PIPELINE_MAX_BYTES // schema.row_bytes))
        absent_parts = []
        order = np.empty(min(n, step), dtype=np.int64)
        missing = np.empty(min(n, step), dtype=np.int64)
        for lo in range(0, n, step):
            part = ids[lo : lo + step]
            k = len(part)
            request, commands = mod.pull_request(part, meta.num_buckets, meta.prefix, order[:k])
            state: list = [0, 0, None]  # fields read, ids absent, the first error reply
            take = _hmget_reader(mod, order[:k], out[lo : lo + k], schema.row_bytes, missing, state)
            try:
                self._exchange(request, commands, k * (schema.row_bytes + 16) + commands * 16, take)
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
        """On standalone Redis (RedisClusterRows has Cluster's): HSET of the ids' rows (rows given) or HDEL
        of the ids (None) by the write script, one EVALSHA per at most PIPELINE_MAX_IDS ids
        built by the compiled module; the fields added or removed (the row count changed with
        them)."""
        schema = meta.schema
        mod = self._native
        assert mod is not None  # only called when there is one
        lua = _WRITE_SCRIPTS["HSET" if rows is not None else "HDEL"]
        per_id = schema.row_bytes + 8 if rows is not None else 8
        step = max(1, min(layout.PIPELINE_MAX_IDS, layout.PIPELINE_MAX_BYTES // per_id))
        name = schema.name.encode()
        total = 0
        for lo in range(0, len(ids), step):
            part = ids[lo : lo + step]
            part_rows = None if rows is None else rows[lo : lo + step]
            for attempt in (0, 1):
                request = mod.write_request(
                    part, part_rows, schema.row_bytes, meta.num_buckets, meta.prefix, self._sha(lua).encode(),
                    self._rows_key, self._meta_key, name, meta.raw,
                )  # fmt: skip
                buf, end = self._exchange(request, 1, 64)
                try:
                    result = mod.integer_reply(buf, end)
                except ValueError as exc:
                    raise PSError(f"Redis at {self.address}: {exc}") from None
                if isinstance(result, str) and result.startswith("NOSCRIPT") and not attempt:
                    self._scripts.pop(lua, None)  # Redis lost it (restart, SCRIPT FLUSH): load it again
                    continue
                if isinstance(result, str):
                    raise self._error_reply(result)
                if result < 0:
                    raise self._gone(schema.name)
                total += result
                break
        return total

    def _py_pull(self, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Rows of ids into rows through redis-py's commands (absent ones zeros); which were found."""
        schema = meta.schema
        table = schema.name
        n = len(ids)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return found
        g = _group_by_bucket(ids, meta.num_buckets)
        fields = id_fields(ids[g.order])
        values: list = []  # values[k]: the row of ids[order[k]], or None
        for part in g.pipelines(schema.row_bytes):
            pipe = self._pipeline()
            for b, start, end in part:
                pipe.execute_command("HMGET", meta.key(b), *fields[start:end])
            for reply in self._run(pipe):
                values += reply
        present = list(filter(None, values))  # drops None (and b"", caught by the size checks)
        blob = b"".join(present)
        n_hit = len(present)
        if n_hit == n and len(blob) == n * schema.row_bytes:  # every id found: no mask to build
            rows[g.order] = np.frombuffer(blob, dtype=schema.np_dtype).reshape(n, schema.width)
            found[:] = True
            return found
        hit = np.fromiter(map(operator.is_not, values, itertools.repeat(None)), dtype=bool, count=n)
        if int(hit.sum()) != n_hit or len(blob) != n_hit * schema.row_bytes:
            raise PSError(
                f"table {table!r} in Redis namespace {self.namespace!r} holds rows of the wrong size "
                f"(expected {schema.row_bytes} bytes each): the data does not match its schema"
            )
        where = g.order[hit]
        rows[where] = np.frombuffer(blob, dtype=schema.np_dtype).reshape(n_hit, schema.width)
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
            values[1::2] = rows[g.order].view(f"V{meta.schema.row_bytes}").ravel().tolist()
        changed = 0
        for part in g.pipelines(meta.schema.row_bytes + 8 if rows is not None else 8):
            changed += self._write(meta, command, list(part), values, per_id)
        return int(changed)

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
                if len(fields) != 8 * len(bucket) or len(values) != schema.row_bytes * len(bucket):
                    raise PSError(
                        f"table {table!r} in Redis namespace {self.namespace!r} holds fields or rows of the "
                        f"wrong size (expected 8-byte ids and {schema.row_bytes}-byte rows)"
                    )
                ids_parts.append(np.frombuffer(fields, dtype="<i8").astype(np.int64))
                rows_parts.append(np.frombuffer(values, dtype=schema.np_dtype).reshape(len(bucket), schema.width))
            all_ids, all_rows = np.concatenate(ids_parts), np.concatenate(rows_parts)
            last = following is None
            start = 0
            while len(all_ids) - start >= rows_per_chunk or (last and start < len(all_ids)):
                yield all_ids[start : start + rows_per_chunk], all_rows[start : start + rows_per_chunk]
                start += rows_per_chunk
            ids_left, rows_left = all_ids[start:], all_rows[start:]


def _hmget_reader(
    mod, at: np.ndarray, rows: np.ndarray, row_bytes: int, missing: np.ndarray, state: list
) -> Callable[[bytearray, int, int, int], None]:
    """take() for _recv: each run of HMGET replies, as it arrives, copied by the compiled module
    into rows (the i-th field asked for into rows[at[i]]). state holds [fields read, ids absent
    (their positions in missing), the first error reply]: an error reply is kept, not raised, so
    every reply is read and the connection stays in step; replies read again from the first (a
    retried exchange) start it afresh."""

    def take(buf: bytearray, start: int, stop: int, count: int) -> None:
        if start == 0:
            state[:] = [0, 0, None]
        got = mod.pull_replies(buf, start, stop, count, at, state[0], rows, row_bytes, missing, state[1])
        if isinstance(got, str):
            state[2] = state[2] or got
        else:
            state[1], state[0] = got

    return take
