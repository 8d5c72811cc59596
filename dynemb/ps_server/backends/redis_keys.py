"""The Redis backend's layout: its keys, its tunables, a table's metadata as the parts read it,
and the grouping of a batch's ids by bucket (the parts of RedisStore: redis_tables.py,
redis_rows.py, redis_cluster.py, redis_store.py).

Layout (namespace <ns>, table <t>, bucket number <b>; the braces are literal):

    dn:<ns>:tables                HASH  table name -> JSON {"format", "buckets", "schema",
                                            "created"[, "expected_rows"][, "dropping"]}
    {dn:<ns>:tables}:rows         HASH  table name -> rows stored (kept by every write),
                                        <t>:c -> the table's "created" token (format 2 on)
    {dn:<ns>:tables}:dropped      ZSET  dropped tables' metadata -> when dropped (Redis TIME, seconds)
    {dn:<ns>:tables}:drops        STREAM  the log of drops: entries {"table", "t"} numbered "<n>-0"
    {dn:<ns>:tables}:marker       STRING  a random token, written once the namespace holds tables
                                        (Store.lost_data: a Redis that lost its data has none)
    {dn:<ns>:marker.<n>}          STRING  on Cluster the same token on each master, <n> picked so that
                                        the key falls in one of the master's slots
    dn:<ns>:<t>:<c>:r:{<t>.<b>}   HASH  id as 8 little-endian bytes -> the row's raw bytes, then
                                        its stamp (format 3 on: 4 bytes, lifecycle.py)
    dn:<ns>:<t>:<c>:deleted       STREAM  the table's deletion log: entries {"ids": 8-byte ids, "t"}
    dn:<ns>:<t>:<c>:changed       STREAM  its change log (change_log.py, if kept): entries as above
    dn:<ns>:<t>:<c>:sweep         STRING  the PS holding the table's sweep lease (expires)
    dn:<ns>:<t>:<c>:swept         STRING  JSON: the table's last sweep (sweeper.SweepResult)

e.g. `dn:ctr:users:9f3c07a1d2e4:r:{users.17}`. <c> is the table's "created" token, random
at each create, so a table dropped and created again under its name never shares a bucket key
with the table before it. Tables created by an older version (metadata "format" 1) have keys
without it, `dn:<ns>:<t>:r:{<t>.<b>}`, and keep them; metadata of a newer format is refused.
(An older version knows no format. So that it cannot read a format-2 table at format-1 keys,
format 2 names the bucket count "buckets", where format 1 had "num_buckets": an older PS finds
a format-2 table's metadata unreadable and fails its calls on it, loudly, rather than read or
write other keys. PS processes of older versions should still not serve a namespace in which
this one creates tables.)
A row lives in bucket hashing.bucket_of(id, num_buckets): the high bits of xxh64(id,
ROW_HASH_SEED) scaled to num_buckets, monotonic in that hash, so the client's hash-ordered
chunks of a batch each touch their own run of buckets.
Hashes instead of one key per id: a few thousand keys per table whatever its size, far less
per-key memory in Redis, and one HMGET/HSET per touched bucket per request. The `{<t>.<b>}`
hash tag keeps each bucket on one Cluster node while a table's buckets spread over every node.
`num_buckets` is fixed when a table is created and read back from its metadata, so a PS
started with another default still finds every row. A table that declares the rows it expects
(TableSchema.expected_rows) gets ceil(expected_rows / rows_per_bucket) buckets (at most
MAX_BUCKETS), so that each bucket stays a small listpack in Redis (~1.12x the rows' bytes, not
a hashtable's ~1.35x; redis_config.py raises Redis's listpack limits to match); a table that
declares nothing gets the store's num_buckets. Nothing lists a table's bucket keys all at once:
they are visited in runs of PIPELINE_MAX_IDS, or, for a table of more than SCAN_BUCKETS_ABOVE
buckets in a database of fewer keys than that, found by SCAN (empty buckets are no keys).

The row counts live in a hash whose hash tag is the table hash's whole name, so both sit in
one Cluster slot: a create or drop changes both atomically (a Lua script), and ListTables reads
every table and its count in two commands, whatever the number of tables. Each write changes
the count by what it changed (HSET's new fields, HDEL's and a clear's removed ones). Writes are
plain HSETs and HDELs, pipelined (a Lua script that did both copied every row through Lua:
2.5x a plain HSET's Redis CPU), and the count is changed by the PS right after them, by a script
that checks the table's creation token kept beside the count (a write planned before a drop
changes no count of a table created since, and is reported as TableNotFound on standalone
Redis); a PS killed between the two leaves the count off by that batch (`clear` or a drop
resets it). A table created by an older version has no count: it is counted once (HLEN of each
bucket) when first asked for.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import socket
import string
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
import redis.cluster
import redis.event
from redis.exceptions import RedisClusterException

from dynemb.common.errors import shown
from dynemb.ps_server.backends.redis_config import ListpackLimits
from dynemb.ps_server.backends.redis_durable import ReplicaWaits
from dynemb.ps_server.errors import (
    InvalidArgument,
    PSError,
)
from dynemb.ps_server.hashing import bucket_of  # re-exported: bench/raw_redis.py reads the same buckets
from dynemb.ps_server.lifecycle import STAMP_BYTES, Lifecycle
from dynemb.ps_server.schema import TableSchema

# 3: each row's value ends in its 4-byte stamp (lifecycle.py), and the metadata may hold a
# "lifecycle"; 2: bucket keys carry the table's "created" token; 1 (older versions): they do not.
# Metadata without "expected_rows" (older versions) reads as 0: nothing declared.
META_FORMAT = 3


# A table's deletion log (a stream) keeps about its newest LOG_MAX_IDS ids (32 MiB of Redis
# memory), in entries of at most LOG_IDS_PER_ENTRY.
LOG_MAX_IDS = 1 << 22


LOG_IDS_PER_ENTRY = 4096


# Bucket keys of a table dropped this long ago (seconds) are unlinked by a later create or drop,
# at most this many tables' a call (module doc).
SWEEP_DROPPED_AFTER_S = 300.0


SWEEP_TABLES_PER_CALL = 4


# A table's most buckets: a 10^10-row table at 16 rows a bucket would want 6.25e8; at 2^28 it
# has ~37 rows a bucket, still a listpack (hash-max-listpack-entries 128).
MAX_BUCKETS = 1 << 28


# Tables of more buckets than this, in a database of fewer keys, have their bucket keys found by
# SCAN instead of visited one by one (a mostly empty table of 2^28 buckets: see the module doc).
SCAN_BUCKETS_ABOVE = 1 << 20


SCAN_COUNT = 10000


# One pipeline carries at most this many ids or bytes of rows; bigger batches go as several
# pipelines in a row, so neither side buffers an unbounded reply.
PIPELINE_MAX_IDS = 65536


PIPELINE_MAX_BYTES = 64 << 20


# Buckets a clear or drop removes in one script on standalone Redis (its run blocks Redis for
# about a millisecond a thousand buckets).
CLEAR_KEYS_PER_SCRIPT = 1024


# A write of more bytes than this goes out in parts (runs of buckets), each sent as soon as it
# is made, so that Redis works on one while the PS makes the next; at most this many parts.
WRITE_PART_BYTES = 1 << 20


WRITE_PARTS_MAX = 8


# A thread keeps its reply buffer for its next call up to this size (a 16k-id pull of 512-byte
# rows takes ~8.5 MB); a bigger one is dropped after its call, so idle threads hold little.
REPLY_BUFFER_KEEP_BYTES = 16 << 20


# Export reads at least this many rows per pipeline.
EXPORT_READ_ROWS = 16384


# Metadata read for a schema lookup serves the same thread's row calls on that table within
# this many seconds: the service's schema check and its pull or push share one read.
FRESH_METADATA_S = 0.5


# Parsed metadata of at most this many tables is kept (each about 1 KB).
META_CACHE_TABLES = 2048


# Tries of a create or drop that others' creates and drops of the same name keep undoing.
CREATE_TRIES = 5


# Names per HMGET when looking up many tables' schemas at once.
SCHEMAS_PER_HMGET = 4096


log = logging.getLogger("dynemb.ps")


# How long commands the cluster answers "not now" (TRYAGAIN while a slot moves...) are retried.
PASSING_RETRY_SECONDS = 5.0
# A table whose write failed after it may have been sent (the connection cut midway: its replies,
# which the row count is changed by, never came) is recounted from its buckets at each count read
# (once Redis answers) until the failure is this old: what was in flight has landed by then.
RECOUNT_AFTER_S = 5.0


# The row count of table ARGV[1] in hash KEYS[ROWS] changes by n, if the table has one (a table
# of an older version has none: it is counted when first asked for).
_ADD_COUNT_LUA = (
    "if n ~= 0 and redis.call('HEXISTS', KEYS[ROWS], ARGV[1]) == 1 then "
    "redis.call('HINCRBY', KEYS[ROWS], ARGV[1], n) end"
)

# Cluster, after a pipeline of writes: KEYS[1] the row-count hash; table ARGV[1]'s count changes
# by ARGV[3] if its creation token there (field "<table>:c", "" for a table of metadata format 1)
# is still ARGV[2]: a write planned before a drop changes no count of a table created since. The
# token is beside the count, not read from the metadata, so that while the slot of both moves
# between nodes (its keys one by one) writes are counted without waiting for the move's end.
# Returns 1 if the token matched (the write's table is still there), else 0.
_WRITTEN_ROWS_LUA = (
    "if (redis.call('HGET', KEYS[1], ARGV[1] .. ':c') or '') == ARGV[2] then local n = tonumber(ARGV[3]) "
    + _ADD_COUNT_LUA.replace("ROWS", "1")
    + " return 1 end return 0"
)


_REDIS_ERRORS = (redis.RedisError, RedisClusterException)


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, socket.timeout | redis.TimeoutError)


def meta_key(namespace: str) -> bytes:
    """The key of the namespace's table-metadata hash."""
    return f"dn:{namespace}:tables".encode()


def rows_key(namespace: str) -> bytes:
    """The key of the namespace's row-count hash (in the table hash's Cluster slot)."""
    return b"{" + meta_key(namespace) + b"}:rows"


def dropped_key(namespace: str) -> bytes:
    """The key of the namespace's set of dropped tables to sweep (in the table hash's Cluster slot)."""
    return b"{" + meta_key(namespace) + b"}:dropped"


def marker_key(namespace: str) -> bytes:
    """The key of the namespace's marker (in the table hash's Cluster slot): a token a PS writes
    once the namespace holds tables, so that a Redis that lost them is told from a new one."""
    return b"{" + meta_key(namespace) + b"}:marker"


def drops_key(namespace: str) -> bytes:
    """The key of the namespace's log of dropped tables, a stream (in the table hash's Cluster slot)."""
    return b"{" + meta_key(namespace) + b"}:drops"


def bucket_prefix(namespace: str, table: str, token: str = "") -> bytes:
    """What every bucket key of the table starts with; bucket b's key is this + b"<b>}".

    Args:
        token: the table's "created" token (metadata format 2 on); "" for a table of format 1.
    """
    return f"dn:{namespace}:{table}:{token + ':' if token else ''}r:{{{table}.".encode()


def prefix_of(namespace: str, table: str, meta: dict) -> bytes:
    """The bucket key prefix of a table of metadata `meta` (its parsed JSON); ValueError if
    the metadata is of a newer format or its token is not hex (it goes into key names)."""
    fmt = int(meta.get("format", 1))
    if fmt > META_FORMAT:
        raise ValueError(f"metadata format {fmt} is newer than this version's {META_FORMAT}: upgrade dynemb")
    if fmt < 2:
        return bucket_prefix(namespace, table)
    token = meta["created"]
    if not isinstance(token, str) or not token or any(c not in string.hexdigits for c in token):
        raise ValueError(f'"created" must be a hex token, got {shown(token)}')
    return bucket_prefix(namespace, table, token)


def bucket_count_of(meta: dict) -> int:
    """The bucket count of a table of metadata `meta` (its parsed JSON): "buckets" from format 2
    on, "num_buckets" before (renamed so that older versions cannot read format-2 tables)."""
    return int(meta["buckets"] if int(meta.get("format", 1)) >= 2 else meta["num_buckets"])


def bucket_keys(prefix: bytes, start: int, stop: int) -> list[bytes]:
    """The key names of buckets start..stop-1 of a table of bucket key prefix `prefix`
    (prefix_of), in order (exactly one `{...}` hash tag each). A table may have up to
    MAX_BUCKETS buckets: ask for a run of them at a time."""
    return [b"%s%d}" % (prefix, b) for b in range(start, stop)]


def buckets_for(expected_rows: int, rows_per_bucket: int, default: int) -> int:
    """The bucket count of a new table: ceil(expected_rows / rows_per_bucket) in [1, MAX_BUCKETS],
    or default when the table declares no expected rows (0)."""
    if expected_rows <= 0:
        return default
    return max(1, min(MAX_BUCKETS, -(-expected_rows // rows_per_bucket)))


def id_fields(ids: np.ndarray) -> list[bytes]:
    """Each id as its 8 little-endian bytes. A 'V8' view keeps trailing NUL bytes ('S8' would drop them)."""
    return np.ascontiguousarray(ids, dtype="<i8").view("V8").tolist()


@dataclass(frozen=True)
class _TableMeta:
    """A table's parsed metadata: small (no per-bucket state), as a PS may see thousands of tables."""

    raw: bytes  # as stored; the cache key
    schema: TableSchema
    num_buckets: int
    prefix: bytes  # of its bucket keys
    token: str  # the creation token in its bucket keys; "" for a table of metadata format 1
    dropping: bool = False  # a drop has begun: no longer a table to anything but a drop
    stamped: bool = False  # each value ends in its row's stamp (format 3 on)
    lifecycle: Lifecycle = Lifecycle()
    change_log: int = 0  # ids its change log keeps (0: none)

    def key(self, bucket: int) -> bytes:
        return b"%s%d}" % (self.prefix, bucket)

    @property
    def value_bytes(self) -> int:
        """Bytes of a stored value: the row, and its stamp if the table has them."""
        return self.schema.row_bytes + (STAMP_BYTES if self.stamped else 0)

    @property
    def log_key(self) -> bytes:
        """The key of the table's deletion log (a stream), beside its buckets."""
        return self.prefix.rsplit(b"r:{", 1)[0] + b"deleted"

    @property
    def changes_key(self) -> bytes:
        """The key of the table's change log (a stream, change_log.py), beside its buckets."""
        return self.prefix.rsplit(b"r:{", 1)[0] + b"changed"

    @property
    def lease_key(self) -> bytes:
        """The key of the table's sweep lease (lifecycle.py, sweeper.py)."""
        return self.prefix.rsplit(b"r:{", 1)[0] + b"sweep"

    @property
    def swept_key(self) -> bytes:
        """The key of the table's last sweep's result."""
        return self.prefix.rsplit(b"r:{", 1)[0] + b"swept"

    @property
    def side_keys(self) -> list[bytes]:
        """The table's keys besides its buckets (its deletion and change logs, sweep lease, last sweep)."""
        return [self.log_key, self.changes_key, self.lease_key, self.swept_key]


@dataclass(frozen=True)
class _Groups:
    """A batch's ids sorted by bucket: ids order[starts[g]:ends[g]] all live in bucket buckets[g]."""

    order: np.ndarray
    buckets: list[int]
    starts: list[int]
    ends: list[int]

    def pipelines(self, per_id_bytes: int) -> Iterator[zip]:
        """(bucket, start, end) of each group, in runs small enough for one pipeline each
        (a bucket is never split across pipelines)."""
        limit = max(1, min(PIPELINE_MAX_IDS, PIPELINE_MAX_BYTES // max(per_id_bytes, 1)))
        g, n_groups = 0, len(self.starts)
        while g < n_groups:
            # the groups that end within `limit` ids of this one's start (ends ascend)
            stop = max(g + 1, bisect.bisect_right(self.ends, self.starts[g] + limit, lo=g))
            yield zip(self.buckets[g:stop], self.starts[g:stop], self.ends[g:stop])
            g = stop


def _group_by_bucket(ids: np.ndarray, num_buckets: int) -> _Groups:
    b = bucket_of(ids, num_buckets)
    # stable: a repeated id keeps its order inside its bucket's HSET, so its last row wins
    order = np.argsort(b, kind="stable")
    sb = b[order]
    starts = np.flatnonzero(np.concatenate(([True], sb[1:] != sb[:-1]))) if len(sb) else np.zeros(0, np.intp)
    ends = np.append(starts[1:], len(sb))
    return _Groups(order, sb[starts].tolist(), starts.tolist(), ends.tolist())


def _raw(value: bytes | str) -> bytes:
    """A reply as the bytes it is: redis-py types replies bytes | str, as it cannot know that
    this store's client does not decode responses (every reply is raw bytes)."""
    if isinstance(value, str):
        raise PSError("the Redis client decodes responses (decode_responses=True); RedisStore needs raw bytes")
    return value


def _as_ids(ids: np.ndarray) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1:
        raise InvalidArgument(f"ids must be a 1-D array of int64, got shape {ids.shape}")
    return ids


class StoreParts:
    """What the parts of RedisStore share: the store's state (set by RedisStore.__init__) and
    the plumbing it defines (its client's pipelines, scripts and errors), declared here so that
    each part reads on its own (and type-checks). The parts build on it in a line: RedisLogs,
    RedisTables, RedisRows, RedisClusterRows, RedisStore."""

    if TYPE_CHECKING:
        client: redis.Redis | redis.cluster.RedisCluster
        cluster: bool
        kind: str
        namespace: str
        num_buckets: int
        rows_per_bucket: int
        address: str
        _listpack: ListpackLimits | None
        _password: str | None
        _waits: ReplicaWaits
        _unsure: dict[str, float]
        _meta_key: bytes
        _rows_key: bytes
        _dropped_key: bytes
        _cache: OrderedDict[str, _TableMeta]
        _cache_lock: threading.Lock
        _fresh: threading.local
        _tables_changed: int
        _scripts: dict[str, str]
        _native: Any
        _buffers: threading.local
        _slot_map: Any
        _slot_versions: Iterator[int]
        _slot_version: int
        _slot_lock: threading.Lock
        _sweeper: threading.Thread | None
        _sweep_lock: threading.Lock
        _closing: threading.Event
        expired_read_counts: dict[str, int]

        def _redis(self) -> contextlib.AbstractContextManager[None]: ...
        def _pipeline(self) -> Any: ...
        def _run(self, pipe: Any) -> list: ...
        def _sha(self, lua: str) -> str: ...
        def _script(self, pipe: Any, lua: str, keys: list[bytes], args: list) -> None: ...
        def _run_scripted(self, fill: Callable[[Any], None]) -> list: ...
        def _error_reply(self, text: str) -> PSError: ...
        def _meta(self, table: str, dropping: bool = False) -> _TableMeta: ...
        def _row_meta(self, table: str) -> _TableMeta: ...
        def _mark(self, args: list, pipe: Any) -> None: ...
        def _add_rows(self, meta: _TableMeta, change: int) -> None: ...
        def _log_deleted(self, meta: _TableMeta, ids: np.ndarray) -> None: ...
        def _log_ids(self, key: bytes, ids: np.ndarray, max_ids: int) -> None: ...
        def _wrong_size(self, table: str) -> PSError: ...
