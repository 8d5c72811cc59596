"""The baseline for bench/ps_bench.py: raw redis-py + hiredis reading and writing the PS's rows.

The same work the PS does per batch, with nothing around it: hash the ids to their
buckets, one pipeline of HMGET (pull) or HSET (push) per batch with one command per
touched bucket, and the replies decoded into one numpy array. No gRPC, no PS
process, no metadata read, no validation. It reads the very hashes the PS wrote, and writes
the values the PS would: each row and its 4-byte stamp (a table of metadata format 3 on).
"""

from __future__ import annotations

import json
import socket

import numpy as np
import redis

from dynemb.ps_server.backends.redis_keys import bucket_count_of, bucket_keys, meta_key, prefix_of
from dynemb.ps_server.hashing import bucket_of
from dynemb.ps_server.lifecycle import STAMP_BYTES, stamp_bytes
from dynemb.ps_server.schema import TableSchema


class RawRedisRows:
    def __init__(self, url: str, namespace: str, schema: TableSchema) -> None:
        self.r = redis.Redis.from_url(url)
        meta = json.loads(self.r.hget(meta_key(namespace), schema.name))
        self.num_buckets = bucket_count_of(meta)
        self.keys = bucket_keys(prefix_of(namespace, schema.name, meta), 0, self.num_buckets)
        self.schema = schema
        self.stamp = STAMP_BYTES if int(meta.get("format", 1)) >= 3 else 0

    def _grouped(self, ids: np.ndarray):
        b = bucket_of(ids, self.num_buckets)
        order = np.argsort(b, kind="stable")
        sb = b[order]
        starts = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
        ends = np.r_[starts[1:], len(sb)]
        fields = ids[order].astype("<i8").view("V8").tolist()
        return order, sb[starts].tolist(), starts.tolist(), ends.tolist(), fields

    def pull(self, ids: np.ndarray) -> np.ndarray:
        s = self.schema
        order, buckets, starts, ends, fields = self._grouped(ids)
        pipe = self.r.pipeline(transaction=False)
        for b, lo, hi in zip(buckets, starts, ends):
            pipe.execute_command("HMGET", self.keys[b], *fields[lo:hi])
        values = [v for reply in pipe.execute() for v in reply]
        raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(ids), s.row_bytes + self.stamp)
        rows = np.empty((len(ids), s.width), dtype=s.np_dtype)
        rows[order] = np.ascontiguousarray(raw[:, : s.row_bytes]).view(s.np_dtype)
        return rows

    def push(self, ids: np.ndarray, rows: np.ndarray) -> None:
        s = self.schema
        order, buckets, starts, ends, fields = self._grouped(ids)
        raw = np.empty((len(ids), s.row_bytes + self.stamp), dtype=np.uint8)
        raw[:, : s.row_bytes] = np.ascontiguousarray(rows[order], dtype=s.np_dtype).view(np.uint8).reshape(len(ids), -1)
        raw[:, s.row_bytes :] = np.frombuffer(stamp_bytes(), dtype=np.uint8)[: self.stamp]
        values = raw.view(f"V{raw.shape[1]}").ravel().tolist()
        pipe = self.r.pipeline(transaction=False)
        for b, lo, hi in zip(buckets, starts, ends):
            args = [None] * (2 * (hi - lo))
            args[0::2], args[1::2] = fields[lo:hi], values[lo:hi]
            pipe.execute_command("HSET", self.keys[b], *args)
        pipe.execute()

    def close(self) -> None:
        self.r.close()


class RedisLimit:
    """What Redis serves to a client that does no work of its own: the very requests the PS
    sends for a batch (its HMGET pipeline for a pull, its pipeline of HSETs of the rows and
    their stamps for a push; not the small count script after it), built before the clock
    starts, sent on one plain socket, and the replies read until they are complete, never
    decoded. The PS over Redis can at best match it.
    """

    def __init__(self, url: str, namespace: str, schema: TableSchema) -> None:
        from dynemb.ps_server.backends.redis_store import RedisStore
        from dynemb.ps_server.native import redis_rows

        self.mod = redis_rows()
        self.store = RedisStore.from_url(url, namespace=namespace)  # to read the table and load the script
        self.meta = self.store._meta(schema.name)
        self.schema = schema
        kw = self.store.client.connection_pool.connection_kwargs
        self.sock = socket.create_connection((kw.get("host", "localhost"), kw.get("port", 6379)))
        self.buf = bytearray(64 << 20)

    def pull_request(self, ids: np.ndarray) -> tuple[bytes, int]:
        order = np.empty(len(ids), dtype=np.int64)
        return self.mod.pull_request(ids, self.meta.num_buckets, self.meta.prefix, order)

    def push_request(self, ids: np.ndarray, rows: np.ndarray) -> tuple[bytes, int]:
        s, m = self.schema, self.meta
        rows = np.ascontiguousarray(rows, dtype=s.np_dtype)
        suffix = stamp_bytes() if m.stamped else b""
        return self.mod.plain_write_request(ids, rows, s.row_bytes, m.num_buckets, m.prefix, suffix)

    def exchange(self, prepared: tuple[bytes, int]) -> None:
        """Send one prepared request, read its replies whole."""
        request, replies = prepared
        self.sock.sendall(request)
        view = memoryview(self.buf)
        end = pos = done = 0
        while done < replies:
            got = self.sock.recv_into(view[end:])
            if not got:
                raise ConnectionError("Redis closed the connection")
            end += got
            pos, complete = self.mod.scan(self.buf, pos, end, replies - done)
            done += complete

    def close(self) -> None:
        self.sock.close()
        self.store.close()
