"""Published tables in Redis, for serving: the layout that `dynemb table apply` writes
(dynemb/publish/apply.py) and that a read-only PS and dynemb.publish.Lookup read.

Layout (namespace <ns>, table <t>, bucket <b>; braces literal):

    dn:<ns>:serving                      SET   the names of the tables published here
    dn:<ns>:serving:{<t>}                HASH  the table's head (ServingHead's fields)
    dn:<ns>:serving:<t>:<tag>:{<t>.<b>}  HASH  id (8 bytes LE) -> the row's values in the
                                               version's dtype (int8: then its float32 scale);
                                               id + "~" -> the row a delta being applied
                                               brings ("": a tombstone)

A full version is written under a new tag (`v<number>`), then the head switches to it, and the
old tag's keys are unlinked. A delta is applied in place, in three steps that never show a
reader a mix of two versions:
1. its rows and tombstones go to the pending fields (id~), which readers ignore;
2. the head says the version is v and the pending fields are visible: readers prefer a row's
   pending field to its own;
3. each row is written to its own field and its pending field removed (in that order, so a
   reader sees v's row either way); then the head says no field is pending.

The head's `gen` goes up at each of these switches. A reader reads it before and after its
rows, and reads again when it changed: within one gen no write changes what a reader of that
gen sees, so rows read within one gen are all of one version. An applier killed midway leaves
the head saying where it was (pending, visible): a restart finishes that version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from dynemb.ps_server.backends.redis_keys import _raw, id_fields
from dynemb.ps_server.errors import Contended, TableNotFound
from dynemb.ps_server.hashing import bucket_of

# Rows a bucket of a published table is sized for when a full version is applied (and room for
# this much more, for the deltas after it).
ROWS_PER_BUCKET = 16
GROWTH = 1.25
# Ids per pipeline of a pull or a write.
PIPELINE_IDS = 16384
# Reads of a pull retried while the head keeps switching under it.
READ_TRIES = 20
PENDING = b"~"
# Bytes of an int8 row's scale, after its values.
SCALE_BYTES = 4
STORED = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8}


@dataclass(frozen=True)
class ServingHead:
    """Where a published table stands in Redis.

    Attributes:
        version: the version readers read (0: none yet).
        base: the full version it builds on.
        tag: the key tag of its rows ("v<base>").
        buckets: the buckets of the tag's rows.
        dim: the embedding width.
        dtype: the stored values' dtype (fp32, fp16, bf16, int8).
        gen: goes up at every switch readers must notice.
        pending: the delta being applied (0: none).
        visible: its pending fields are read (step 2 of the module's).
        writing_tag: a full version's tag being written (its keys are garbage if it is not
            switched to: a restart unlinks them).
        writing_buckets: that tag's buckets.
        time: when the version readers read was cut (Unix seconds).
        rows: the rows of the version readers read (once applied whole: while a delta's
            pending fields are shown, the version's before).
        counted: the delta whose rows were counted (counted_rows) before step 3 began.
        counted_rows: the rows that delta leaves.
        digest: the sha256 of the manifest of the version readers read ("": applied by an
            older dynemb): which version of that number it is.
    """

    version: int = 0
    base: int = 0
    tag: str = ""
    buckets: int = 0
    dim: int = 0
    dtype: str = "fp32"
    gen: int = 0
    pending: int = 0
    visible: int = 0
    writing_tag: str = ""
    writing_buckets: int = 0
    time: float = 0.0
    rows: int = 0
    counted: int = 0
    counted_rows: int = 0
    digest: str = ""

    @classmethod
    def from_reply(cls, reply: dict) -> ServingHead:
        d = {_raw(k).decode(): _raw(v).decode() for k, v in reply.items()}
        kinds = {f: type(v) for f, v in asdict(cls()).items()}
        return cls(**{f: kinds[f](d[f]) for f in kinds if f in d})

    @property
    def row_bytes(self) -> int:
        """Bytes of a stored row."""
        return self.dim * np.dtype(STORED[self.dtype]).itemsize + (SCALE_BYTES if self.dtype == "int8" else 0)

    @property
    def read_dtype(self) -> str:
        """The dtype rows are read in (int8 rows are read dequantized, as fp32)."""
        return "fp32" if self.dtype == "int8" else self.dtype


def tables_key(namespace: str) -> bytes:
    return f"dn:{namespace}:serving".encode()


def head_key(namespace: str, table: str) -> bytes:
    return f"dn:{namespace}:serving:{{{table}}}".encode()


def bucket_key(namespace: str, table: str, tag: str, bucket: int) -> bytes:
    return f"dn:{namespace}:serving:{table}:{tag}:{{{table}.{bucket}}}".encode()


def encode_rows(values: np.ndarray, scales: np.ndarray | None) -> list[bytes]:
    """Each row's stored value: its values' bytes (then its scale, for int8)."""
    values = np.ascontiguousarray(values)
    raw = values.view(np.uint8).reshape(len(values), -1)
    if scales is not None:
        raw = np.concatenate([raw, np.ascontiguousarray(scales, "<f4").view(np.uint8).reshape(-1, SCALE_BYTES)], 1)
    return np.ascontiguousarray(raw).view(f"V{raw.shape[1]}").ravel().tolist() if len(raw) else []


def decode_rows(values: list[bytes], head: ServingHead, out: np.ndarray) -> None:
    """Stored values (all of head.row_bytes) into out (n, dim) of head.read_dtype."""
    if not values:
        return
    raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), head.row_bytes)
    if head.dtype == "int8":
        q = raw[:, : head.dim].view(np.int8).astype(np.float32)
        scales = raw[:, head.dim :].copy().view("<f4")
        out[:] = q * scales
    else:
        out[:] = raw.view(STORED[head.dtype])


class ServingRedis:
    """Published tables in one Redis namespace (see the module): reads for serving, and the
    writes an applier makes. Uses a RedisStore's client and error handling.

    Args:
        store: a RedisStore of the Redis (standalone or Cluster) to use.
        namespace: the key namespace of the published tables.
    """

    def __init__(self, store, namespace: str) -> None:
        self.store = store
        self.namespace = namespace
        self.cluster = store.kind == "redis-cluster"
        self._heads: dict[str, ServingHead] = {}

    # -- reading ------------------------------------------------------------------------

    def tables(self) -> list[str]:
        """The names of the tables published here, sorted."""
        with self.store._redis():
            names = self.store.client.smembers(tables_key(self.namespace))
        return sorted(_raw(n).decode() for n in names)

    def head(self, table: str) -> ServingHead:
        """The table's head now; TableNotFound if nothing of it was published here."""
        with self.store._redis():
            reply = self.store.client.hgetall(head_key(self.namespace, table))
        if not reply:
            raise TableNotFound(f"table {table!r} is not published in Redis namespace {self.namespace!r}")
        head = ServingHead.from_reply(reply)
        if not head.version:
            raise TableNotFound(f"table {table!r} in Redis namespace {self.namespace!r} has no version applied yet")
        self._heads[table] = head
        return head

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """(rows, found, version): the rows of ids (n, dim) in the head's read dtype, all of one
        version; rows of ids not found are zeros."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        head = self._heads.get(table) or self.head(table)
        for _ in range(READ_TRIES):
            values, before, after = self._read(table, head, ids)
            if before.gen == head.gen == after:
                rows = out if out is not None else np.empty((len(ids), head.dim), STORED[head.read_dtype])
                rows[:] = 0
                found = np.array([v is not None for v in values], dtype=bool)
                got = np.empty((int(found.sum()), head.dim), rows.dtype)
                decode_rows([v for v in values if v is not None], head, got)
                rows[found] = got
                return rows, found, head.version
            head = self._heads[table] = before if before.gen == after else self.head(table)
        raise Contended(f"table {table!r}: its published version kept switching during {READ_TRIES} reads; try again")

    def _read(self, table: str, head: ServingHead, ids: np.ndarray) -> tuple[list, ServingHead, int]:
        """(each id's stored value or None, the head before, its gen after) read under `head`."""
        hkey = head_key(self.namespace, table)
        buckets = bucket_of(ids, head.buckets) if head.buckets else np.zeros(len(ids), np.intp)
        fields = id_fields(ids)
        commands = []
        for b, where in _runs(buckets, np.argsort(buckets, kind="stable")):
            names = [fields[i] for i in where]
            if head.visible:
                names = [n for f in names for n in (f + PENDING, f)]
            commands.append((bucket_key(self.namespace, table, head.tag, b), names, where))
        values: list = [None] * len(ids)

        def take(replies: list, parts) -> None:
            for (_, _, where), got in zip(parts, replies):
                if head.visible:  # the pending field first; "" is a tombstone
                    got = [p if p is not None else v for p, v in zip(got[::2], got[1::2])]
                    got = [None if v == b"" else v for v in got]
                for i, v in zip(where.tolist(), got):
                    values[i] = v

        with self.store._redis():
            if self.cluster:  # a pipeline's commands to several nodes run in no set order
                before = ServingHead.from_reply(self.store.client.hgetall(hkey))
                for lo in range(0, len(commands), 256):
                    pipe = self.store.client.pipeline(transaction=False)
                    for key, names, _ in commands[lo : lo + 256]:
                        pipe.hmget(key, names)
                    take(self.store._run(pipe), commands[lo : lo + 256])
                after = int(self.store.client.hget(hkey, "gen") or 0)
            else:  # one connection runs its pipelines in order: the head, the rows, the head again
                per = max(1, PIPELINE_IDS // max(1, len(ids) // max(1, len(commands))))
                parts = [commands[lo : lo + per] for lo in range(0, len(commands), per)] or [[]]
                for k, part in enumerate(parts):
                    pipe = self.store.client.pipeline(transaction=False)
                    if k == 0:
                        pipe.hgetall(hkey)
                    for key, names, _ in part:
                        pipe.hmget(key, names)
                    if k == len(parts) - 1:
                        pipe.hget(hkey, "gen")
                    replies = self.store._run(pipe)
                    if k == 0:
                        before = ServingHead.from_reply(replies.pop(0))
                    if k == len(parts) - 1:
                        after = int(replies.pop() or 0)
                    take(replies, part)
        return values, before, after

    # -- writing (an applier's; dynemb/publish/apply.py) -----------------------------------

    def raw_head(self, table: str) -> ServingHead:
        """The table's head, ServingHead() if none."""
        with self.store._redis():
            reply = self.store.client.hgetall(head_key(self.namespace, table))
        return ServingHead.from_reply(reply) if reply else ServingHead()

    def set_head(self, table: str, bump: bool, **fields) -> None:
        """Set fields of the table's head at once (one script), gen + 1 if bump."""
        args = [x for k, v in fields.items() for x in (k, str(v))]
        lua = "redis.call('HSET', KEYS[1], unpack(ARGV)) "
        if bump:
            lua += "redis.call('HINCRBY', KEYS[1], 'gen', 1)"
        with self.store._redis():
            self.store.client.eval(lua, 1, head_key(self.namespace, table), *args)
            self.store.client.sadd(tables_key(self.namespace), table)

    def write(self, table: str, tag: str, buckets: int, ids: np.ndarray, values: list, pending: bool) -> int:
        """Write rows (stored values; None: a tombstone, pending only) under ids to tag's buckets,
        as pending fields or their own. Returns the rows new to the table (own fields only)."""
        return self._per_bucket(table, tag, buckets, ids, values, "write" if not pending else "pending")

    def count(self, table: str, tag: str, buckets: int, ids: np.ndarray, values: list) -> int:
        """How many rows writing these (None: a tombstone) to their own fields would add: rows new
        to the table, less the tombstones of rows it has (ids given once each). Reads only."""
        return self._per_bucket(table, tag, buckets, ids, values, "count")

    def compact(self, table: str, tag: str, buckets: int, ids: np.ndarray, values: list) -> None:
        """Step 3: each id's row (None: a tombstone) to its own field, then its pending field removed."""
        self._per_bucket(table, tag, buckets, ids, values, "compact")

    def _per_bucket(self, table: str, tag: str, buckets: int, ids: np.ndarray, values: list, how: str) -> int:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        b = bucket_of(ids, buckets)
        order = np.argsort(b, kind="stable")  # stable: a repeated id's last row wins
        fields = id_fields(ids)
        runs = list(_runs(b, order))  # all ids sorted by bucket first: one command a bucket
        added = 0
        at = 0
        while at < len(runs):
            pipe = self.store.client.pipeline(transaction=False)
            counted = []  # whether each HMGET's ids are tombstones
            n = 0
            while at < len(runs) and (n == 0 or n + len(runs[at][1]) <= PIPELINE_IDS):
                bucket, where = runs[at]
                at += 1
                n += len(where)
                key = bucket_key(self.namespace, table, tag, bucket)
                if how == "count":  # what the table has of them now
                    pipe.hmget(key, [fields[i] for i in where])
                    counted.append([values[i] is None for i in where])
                    continue
                if how == "pending":
                    pipe.hset(key, mapping={fields[i] + PENDING: values[i] or b"" for i in where})
                    continue
                rows = {fields[i]: values[i] for i in where if values[i] is not None}
                gone = [fields[i] for i in where if values[i] is None]
                if rows:
                    pipe.hset(key, mapping=rows)
                if how == "compact":
                    pipe.hdel(key, *gone, *[fields[i] + PENDING for i in where])
            replies = self.store._run(pipe)
            if how == "write":
                added += sum(int(r) for r in replies)
            elif how == "count":  # +1 a row new to the table, -1 a tombstone of one it has
                for had, tombstones in zip(replies, counted):
                    added += sum(-t if h is not None else 1 - t for h, t in zip(had, tombstones))
        return added

    def unlink_tag(self, table: str, tag: str, buckets: int) -> None:
        """Remove every key of a tag (an old full version's, or one half written)."""
        for lo in range(0, buckets, 1024):
            keys = [bucket_key(self.namespace, table, tag, b) for b in range(lo, min(buckets, lo + 1024))]
            with self.store._redis():
                if self.cluster:
                    pipe = self.store.client.pipeline(transaction=False)
                    for k in keys:
                        pipe.unlink(k)
                    self.store._run(pipe)
                else:
                    self.store.client.unlink(*keys)

    def drop(self, table: str) -> None:
        """Remove a published table: its rows and head."""
        head = self.raw_head(table)
        for tag, n in ((head.tag, head.buckets), (head.writing_tag, head.writing_buckets)):
            if tag:
                self.unlink_tag(table, tag, n)
        with self.store._redis():
            self.store.client.delete(head_key(self.namespace, table))
            self.store.client.srem(tables_key(self.namespace), table)

    def describe(self, table: str) -> dict:
        """The head as a dict (for `dynemb table apply` and tests)."""
        return json.loads(json.dumps(asdict(self.raw_head(table))))


def _runs(buckets: np.ndarray, order: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(bucket, positions) of each run of one bucket in order."""
    sorted_b = buckets[order]
    cuts = np.flatnonzero(np.diff(sorted_b)) + 1
    for where in np.split(order, cuts):
        if len(where):
            yield int(buckets[where[0]]), where
