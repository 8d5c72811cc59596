"""The baseline for bench/ps_bench.py: raw redis-py + hiredis reading and writing the PS's rows.

The same work the PS does per batch, with nothing around it: hash the ids to their
buckets, one pipeline of HMGET (pull) or HSET (push) per batch with one command per
touched bucket, and the replies decoded into one numpy array. No gRPC, no PS
process, no metadata read, no validation. It reads the very hashes the PS wrote.
"""

from __future__ import annotations

import json
import socket

import numpy as np
import redis

from dynemb.ps_server.backends.redis_keys import bucket_count_of, bucket_keys, meta_key, prefix_of
from dynemb.ps_server.hashing import bucket_of
from dynemb.ps_server.schema import TableSchema


class RawRedisRows:
    def __init__(self, url: str, namespace: str, schema: TableSchema) -> None:
        self.r = redis.Redis.from_url(url)
        meta = json.loads(self.r.hget(meta_key(namespace), schema.name))
        self.num_buckets = bucket_count_of(meta)
        self.keys = bucket_keys(prefix_of(namespace, schema.name, meta), 0, self.num_buckets)
        self.schema = schema

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
        rows = np.empty((len(ids), s.width), dtype=s.np_dtype)
        rows[order] = np.frombuffer(b"".join(values), dtype=s.np_dtype).reshape(len(ids), s.width)
        return rows

    def push(self, ids: np.ndarray, rows: np.ndarray) -> None:
        s = self.schema
        order, buckets, starts, ends, fields = self._grouped(ids)
        values = np.ascontiguousarray(rows[order], dtype=s.np_dtype).view(f"V{s.row_bytes}").ravel().tolist()
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
    sends for a batch (its HMGET pipeline for a pull, its write script's EVALSHA for a push),
    built before the clock starts, sent on one plain socket, and the replies read until they
    are complete, never decoded. The PS over Redis can at best match it.
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
        from dynemb.ps_server.backends.redis_rows import _WRITE_SCRIPTS

        sha = self.store._sha(_WRITE_SCRIPTS["HSET"]).encode()
        s, m = self.schema, self.meta
        rows = np.ascontiguousarray(rows, dtype=s.np_dtype)
        key, name = self.store._rows_key, s.name.encode()
        request = self.mod.write_request(
            ids, rows, s.row_bytes, m.num_buckets, m.prefix, sha, key, self.store._meta_key, name, m.raw
        )
        return request, 1

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
