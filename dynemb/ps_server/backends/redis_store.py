"""The Redis backend: tables in standalone Redis or Redis Cluster, over redis-py + hiredis.

Layout (namespace <ns>, table <t>, bucket number <b>; the braces are literal):

    dn:<ns>:tables                HASH  table name -> JSON {"format", "buckets", "schema",
                                            "created"[, "expected_rows"][, "dropping"]}
    {dn:<ns>:tables}:rows         HASH  table name -> rows stored (kept by every write),
                                        <t>:c -> the table's "created" token (format 2 on)
    {dn:<ns>:tables}:dropped      ZSET  dropped tables' metadata -> when dropped (Redis TIME, seconds)
    dn:<ns>:<t>:<c>:r:{<t>.<b>}   HASH  id as 8 little-endian bytes -> the row's raw bytes

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
the count by what it changed (HSET's new fields, HDEL's and a clear's removed ones). On
standalone Redis the bucket write and the count change are one Lua script, so the count is
exact. On Cluster a table's buckets span slots, so the count is changed by the PS right after
the writes; a PS killed between the two leaves it off by that batch (`clear` or a drop resets
it). A table created by an older version has no count: it is counted once (HLEN of each
bucket) when first asked for.

A write on standalone Redis checks, in its script, that the table's metadata is still the raw
bytes the write read: a write still in flight when its table was dropped (and perhaps created
again under that name) writes nothing and fails with TableNotFound. On Cluster the writes are
plain per-bucket commands (the buckets span slots, so no script sees the metadata): such a
write lands in the dropped table's own bucket keys, which nothing reads any more (a table
created since under the name has another token), and its row count change, made only while
the creation token kept beside the count is still the write's, is left out.
A drop first marks the metadata ("dropping": the table is then gone to every call but a drop,
and writes planned before find other metadata), then clears the buckets, then removes the
metadata; a drop cut short is finished by the next drop or create of that name. Several PS
processes may drop one table at once: a bucket clear, and the metadata's removal, happen only
while the metadata is still the mark, so a drop that another finished first stops (reporting
the rows it removed); a `clear` likewise stops, with TableNotFound, once its table is dropped.
On standalone Redis each bucket's clear script checks the metadata. On Cluster the clear
scripts cannot see it (another slot): it is read before each pipeline of clears, and a pipeline
that arrives after another drop finished and the table was created again and written to clears
only the old table's keys (its token), so the new table keeps every row; the row count is
changed only while the metadata is unchanged (same slot: exact).

Bucket keys a write left after its table's drop (Cluster only) are swept: the drop that removes
the metadata records it, with Redis's time, in `{dn:<ns>:tables}:dropped`, and each later create
or drop in the namespace starts a sweep on a thread of its own (it may visit every bucket of a
big table, so it stays off the call), which unlinks every bucket key of the tables dropped more
than SWEEP_DROPPED_AFTER_S before (at most SWEEP_TABLES_PER_CALL a sweep, each costing about what
its drop did: the same keys, visited the same way) and forgets them. Format-1 tables are only
forgotten, not swept: their keys carry no token, so they may belong to a table created since.
A write sends its pipelines within seconds of reading the metadata (each waits at most the
socket timeout), so a key survives the sweep only if a PS stalled for minutes between planning
a write and sending it (stopped, swapping): at most that batch's rows. A namespace in which no
table is created or dropped again keeps what its last drops left until then.

Every call reads the table's metadata first (one HGET), so PS processes sharing a namespace
see each other's creates and drops (a schema lookup's read serves the same thread's row calls
on the table for FRESH_METADATA_S, unless this store created or dropped a table since: the
service's schema check and its pull or push share one read); parsed metadata is cached by its
raw bytes (a bounded cache: a table dropped through another PS leaves it at its next use here,
at the next listing, or as the least recently used). Requests go as one non-transactional pipeline (a few for very
large batches) from the client's connection pool, so the store is safe to call from many threads.
While Cluster slots move (a master added, a reshard), commands follow ASK and MOVED (redis-py,
helped to reach a master that owns no slot yet), and scripts that meet TRYAGAIN or NOSCRIPT are
sent again (_run_scripted); tests/ps_server/test_cluster_reshard.py moves slots under load.

Pull, push and delete take the compiled row path (csrc/redis_rows_module.cpp): one call groups
the ids by bucket and writes the whole pipeline (HMGETs, or the write script's EVALSHA) as Redis
protocol bytes, sent on a pooled connection; the replies are read from its socket into a
per-thread buffer and copied into the rows run by run as they arrive, so no row becomes a Python
object. The commands, keys and scripts are redis-py's path's own, so either reads what the other
wrote. On Cluster the compiled module also tells each id's node (its bucket's slot, looked up in
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

import bisect
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import operator
import secrets
import socket
import string
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import parse_qsl, unquote, urlencode

import numpy as np
import redis
import redis.cluster
import redis.event
from redis._parsers.base import BaseParser  # the error classes of error replies, as redis-py raises them
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from dynemb.common.errors import shown
from dynemb.ps_server.backends.base import Store, check_same_schema, check_time, rows_out
from dynemb.ps_server.backends.redis_config import MODES as LISTPACK_MODES
from dynemb.ps_server.backends.redis_config import ROWS_PER_BUCKET, ListpackLimits
from dynemb.ps_server.backends.redis_tls import check_tls_files, untrusted_hint
from dynemb.ps_server.codec import rows_for_table
from dynemb.ps_server.errors import (
    BackendUnavailable,
    InvalidArgument,
    PSError,
    ResourceExhausted,
    TableNotFound,
)
from dynemb.ps_server.hashing import bucket_of  # re-exported: bench/raw_redis.py reads the same buckets
from dynemb.ps_server.native import redis_rows
from dynemb.ps_server.schema import TableSchema, check_name

# 2: bucket keys carry the table's "created" token; 1 (older versions): they do not. Metadata
# without "expected_rows" (older versions) reads as 0: nothing declared.
META_FORMAT = 2
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

# The row count of table ARGV[1] in hash KEYS[ROWS] changes by n, if the table has one (a table
# of an older version has none: it is counted when first asked for).
_ADD_COUNT_LUA = (
    "if n ~= 0 and redis.call('HEXISTS', KEYS[ROWS], ARGV[1]) == 1 then "
    "redis.call('HINCRBY', KEYS[ROWS], ARGV[1], n) end"
)
# Counts and deletes bucket KEYS[1] atomically, so clear/drop report exactly what they removed.
# On standalone Redis (KEYS[2] the table hash, KEYS[3] the row-count hash) only while table
# ARGV[1]'s metadata is still ARGV[2] (else nothing, and -1: the table was dropped, perhaps
# created again, since), and its count goes down in the same script. On Cluster (KEYS[1] alone)
# the table hash is in another slot: the caller checks it, and changes the count (_CLEARED_ROWS_LUA).
_CLEAR_BUCKET_LUA = (
    "if #KEYS == 3 and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return -1 end "
    "local n = redis.call('HLEN', KEYS[1]) if n > 0 then redis.call('UNLINK', KEYS[1]) end "
    "if #KEYS == 3 then n = -n " + _ADD_COUNT_LUA.replace("ROWS", "3") + " n = -n end return n"
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
# Cluster, after a pipeline of writes: KEYS[1] the row-count hash; table ARGV[1]'s count changes
# by ARGV[3] if its creation token there (field "<table>:c", "" for a table of metadata format 1)
# is still ARGV[2]: a write planned before a drop changes no count of a table created since. The
# token is beside the count, not read from the metadata, so that while the slot of both moves
# between nodes (its keys one by one) writes are counted without waiting for the move's end.
_WRITTEN_ROWS_LUA = (
    "if (redis.call('HGET', KEYS[1], ARGV[1] .. ':c') or '') == ARGV[2] then local n = tonumber(ARGV[3]) "
    + _ADD_COUNT_LUA.replace("ROWS", "1")
    + " end"
)
# Cluster, after a pipeline of bucket clears: KEYS[1] the table hash, KEYS[2] the row-count hash
# (one slot); table ARGV[1]'s count changes by ARGV[3] if its metadata is still ARGV[2].
_CLEARED_ROWS_LUA = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then local n = tonumber(ARGV[3]) "
    + _ADD_COUNT_LUA.replace("ROWS", "2")
    + " end"
)
# KEYS[1] the table hash, KEYS[2] the row-count hash: table ARGV[1] of metadata ARGV[2], its count
# of 0 and its creation token ARGV[3] (_WRITTEN_ROWS_LUA), or nothing.
_CREATE_LUA = (
    "if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then "
    "redis.call('HSET', KEYS[2], ARGV[1], 0, ARGV[1] .. ':c', ARGV[3]) return 1 end return 0"
)
# KEYS[1] the table hash: table ARGV[1]'s metadata set to ARGV[3] if it is still ARGV[2] (1), else 0.
_MARK_LUA = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then "
    "redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) return 1 end return 0"
)
# KEYS[1] the table hash, KEYS[2] the row-count hash, KEYS[3] the dropped set: table ARGV[1] and
# its count removed if its metadata is still ARGV[2] (the mark of this drop: another drop may
# have finished it and a create made a new table of that name since), and the mark recorded
# with Redis's time for the sweep; else nothing.
_DROP_LUA = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end "
    "local t = redis.call('TIME') redis.call('ZADD', KEYS[3], t[1] + t[2] / 1000000, ARGV[2]) "
    "redis.call('HDEL', KEYS[2], ARGV[1], ARGV[1] .. ':c') return redis.call('HDEL', KEYS[1], ARGV[1])"
)
# KEYS[1] the dropped set: at most ARGV[2] of its entries older than ARGV[1] seconds (Redis's time).
_DUE_LUA = (
    "local t = redis.call('TIME') "
    "return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t[1] + t[2] / 1000000 - ARGV[1], 'LIMIT', 0, ARGV[2])"
)


def meta_key(namespace: str) -> bytes:
    """The key of the namespace's table-metadata hash."""
    return f"dn:{namespace}:tables".encode()


def rows_key(namespace: str) -> bytes:
    """The key of the namespace's row-count hash (in the table hash's Cluster slot)."""
    return b"{" + meta_key(namespace) + b"}:rows"


def dropped_key(namespace: str) -> bytes:
    """The key of the namespace's set of dropped tables to sweep (in the table hash's Cluster slot)."""
    return b"{" + meta_key(namespace) + b"}:dropped"


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

    def key(self, bucket: int) -> bytes:
        return b"%s%d}" % (self.prefix, bucket)


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


@dataclass(frozen=True)
class _SlotMap:
    """Which node serves each Cluster slot, as redis-py's slot map said at `version`."""

    version: int
    slot_node: np.ndarray  # int32 per slot: an index into pools, or -1 (no node serves it)
    pools: list  # each node's redis-py connection pool
    source: dict  # redis-py's slot map it was built from (replaced on a full refresh)


class _SlotMapWatch:
    """Told by redis-py whenever its slot map changes (a full refresh or a MOVED)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = weakref.ref(store)  # the client (its dispatcher) must not keep the store alive

    def listen(self, event: object) -> None:
        store = self.store()
        if store is not None:
            store._slot_changed()


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, socket.timeout | redis.TimeoutError)


def _split_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict]:
    """`redis+cluster://[user:pass@]h1:p1,h2:p2[/0][?opts]` -> (startup nodes, redis-py kwargs).

    The options (and user/password) are parsed by redis-py's own URL parser, so the query
    arguments mean what they mean in a redis:// URL.
    """
    scheme, rest = url.split("://", 1)
    tls = scheme.lower() == "rediss+cluster"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    nodes = []
    for part in filter(None, hosts.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidArgument(f"cluster URL node {shown(part)} must be host:port")
        nodes.append((unquote(host.strip("[]")), int(port)))
    if not nodes:
        raise InvalidArgument("a cluster URL needs at least one host:port, e.g. redis+cluster://10.0.0.1:7000")
    if path.strip("/") not in ("", "0"):
        raise InvalidArgument(f"Redis Cluster has only database 0, the URL asks for {shown('/' + path)}")
    # redis-py's parser on a single-host URL with the same userinfo and query
    probe = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}{hosts.split(',')[0]}/"
    pairs = parse_qsl(query)
    if any(k == "db" and v != "0" for k, v in pairs):
        raise InvalidArgument("Redis Cluster has only database 0, the URL asks for another db")
    pairs = [(k, v) for k, v in pairs if k != "db"]
    kwargs = redis.connection.parse_url(probe + ("?" + urlencode(pairs) if pairs else ""))
    for k in ("host", "port", "db", "connection_class"):
        kwargs.pop(k, None)
    if tls:
        kwargs["ssl"] = True
    return nodes, kwargs


class RedisStore(Store):
    """Tables in Redis or Redis Cluster (layout: see the module doc). Usually built by from_url()."""

    kind = "redis"

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        *,
        namespace: str = "dynemb",
        num_buckets: int = 4096,
        address: str = "",
        password: str | None = None,
        native_rows: bool = True,
        rows_per_bucket: int = ROWS_PER_BUCKET,
        listpack: str = "auto",
    ) -> None:
        check_name(namespace, "namespace")
        if not isinstance(num_buckets, int) or not 1 <= num_buckets <= MAX_BUCKETS:
            raise InvalidArgument(f"num_buckets must be an integer in [1, {MAX_BUCKETS}], got {num_buckets!r}")
        if not isinstance(rows_per_bucket, int) or not 1 <= rows_per_bucket <= 1 << 16:
            raise InvalidArgument(f"rows_per_bucket must be an integer in [1, 65536], got {shown(rows_per_bucket)}")
        if listpack not in LISTPACK_MODES:
            raise InvalidArgument(f"listpack must be one of {LISTPACK_MODES}, got {shown(listpack)}")
        self.client = client
        self.cluster = isinstance(client, redis.cluster.RedisCluster)
        self.kind = "redis-cluster" if self.cluster else "redis"
        self.namespace = namespace
        self.num_buckets = num_buckets  # for tables created from now on that declare no expected rows
        self.rows_per_bucket = rows_per_bucket  # for those that do
        self.address = address or "redis"
        # Redis's listpack limits raised as tables need them (redis_config.py); None: left alone
        self._listpack = ListpackLimits(client, self.address, rows_per_bucket) if listpack == "auto" else None
        self._password = password
        self._meta_key = meta_key(namespace)
        self._rows_key = rows_key(namespace)
        self._dropped_key = dropped_key(namespace)
        self._cache: OrderedDict[str, _TableMeta] = OrderedDict()  # least recently used first
        self._cache_lock = threading.Lock()
        self._fresh = threading.local()  # metadata a thread just read, for its next row call
        self._tables_changed = 0  # creates and drops through this store (they void what threads keep)
        self._scripts: dict[str, str] = {}  # Lua source -> its SHA1, loaded on first use
        # the compiled row path (module doc)
        self._native = redis_rows() if native_rows else None
        self._buffers = threading.local()  # each thread's reply buffers, kept between calls
        # on Cluster: which node serves each slot, rebuilt when redis-py's slot map changes
        self._slot_map: _SlotMap | None = None
        self._slot_versions = itertools.count(1)
        self._slot_version = 0
        self._slot_lock = threading.Lock()
        # the sweep of dropped tables' keys (module doc): one thread at a time, stopped by close()
        self._sweeper: threading.Thread | None = None
        self._sweep_lock = threading.Lock()
        self._closing = threading.Event()
        if self.cluster and self._native is not None:
            self._watch_slot_map()

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "dynemb",
        num_buckets: int = 4096,
        socket_timeout: float = 10.0,
        native_rows: bool = True,
        rows_per_bucket: int = ROWS_PER_BUCKET,
        listpack: str = "auto",
        **kw,
    ) -> RedisStore:
        """redis://, rediss://, unix://, redis+cluster://, rediss+cluster:// (see the module doc).

        Extra keywords go to redis-py (ssl_ca_certs=, ssl_cert_reqs=, max_connections=...);
        `retries` sets how often a request is retried on a dropped connection (default 2).
        native_rows=False reads and writes rows through redis-py's commands instead of the
        compiled row path (the same commands; for comparison and tests). num_buckets: the
        buckets of a new table that declares no expected rows; rows_per_bucket: what a table
        that does is sized for; listpack: "auto" raises Redis's listpack limits as the tables
        need them (redis_config.py), "off" leaves Redis's config alone.
        """
        scheme = url.split("://", 1)[0].lower()
        retries = int(kw.pop("retries", 2))
        # short: the PS client retries with its own backoff and deadline
        retry = kw.pop("retry", None) or Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.2), retries)
        kw.setdefault("socket_connect_timeout", min(socket_timeout, 5.0))
        client: redis.Redis | redis.cluster.RedisCluster
        try:
            if scheme in ("redis+cluster", "rediss+cluster"):
                nodes, url_kw = _split_cluster_url(url)
                options = {**kw, **url_kw, "socket_timeout": socket_timeout}
                address = ",".join(f"{h}:{p}" for h, p in nodes)
                check_tls_files(options)  # before connecting: the cluster client connects at once
                try:
                    client = redis.cluster.RedisCluster(
                        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in nodes],
                        retry=retry,
                        **options,
                    )
                except _REDIS_ERRORS as exc:  # it connects at once, to learn the slot map
                    raise _translate(exc, f"Redis Cluster {address}", options.get("password")) from None
                _follow_ask_to_new_masters(client)
            elif scheme in ("redis", "rediss", "unix"):
                standalone = redis.Redis.from_url(url, socket_timeout=socket_timeout, retry=retry, **kw)
                client = standalone
                ckw = standalone.connection_pool.connection_kwargs
                options = ckw
                address = ckw["path"] if "path" in ckw else f"{ckw.get('host', 'localhost')}:{ckw.get('port', 6379)}"
                # building a connection (no I/O) rejects misspelt options now, not at the first request
                standalone.connection_pool.connection_class(**ckw)
                check_tls_files(options)
            else:
                raise InvalidArgument(f"not a Redis URL scheme: {shown(scheme)}")
        except PSError:
            raise
        except TypeError as exc:
            raise InvalidArgument(f"bad Redis option for {scheme}:// backend: {exc}") from None
        except ValueError as exc:
            raise InvalidArgument(f"bad Redis URL: {exc}") from None
        return cls(
            client,
            namespace=namespace,
            num_buckets=num_buckets,
            address=address,
            password=options.get("password"),
            native_rows=native_rows,
            rows_per_bucket=rows_per_bucket,
            listpack=listpack,
        )

    # -- plumbing ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _redis(self):
        """Turn redis-py errors into the PS's (BackendUnavailable, ResourceExhausted, PSError)."""
        try:
            yield
        except _REDIS_ERRORS as exc:
            raise _translate(exc, f"Redis at {self.address}", self._password) from None

    def _pipeline(self):
        return self.client.pipeline(transaction=False)

    def _run(self, pipe) -> list:
        """Execute; a command that failed inside the pipeline is raised as the PS's error."""
        with self._redis():
            results = pipe.execute(raise_on_error=False)
            for r in results:
                if isinstance(r, Exception):
                    raise r
        return results

    def _sha(self, lua: str) -> str:
        sha = self._scripts.get(lua)
        if sha is None:
            with self._redis():
                sha = self._scripts[lua] = _sha_text(self.client.script_load(lua))
        return sha

    def _script(self, pipe, lua: str, keys: list[bytes], args: list) -> None:
        """Queue the script on pipe (EVALSHA: its source is not sent each time)."""
        pipe.execute_command("EVALSHA", self._sha(lua), len(keys), *keys, *args)

    def _run_scripted(self, fill: Callable[[Any], None]) -> list:
        """The commands that fill() queues, as one pipeline; their replies.

        A command the cluster answered with "not now" (TRYAGAIN: a script whose keys a slot
        migration has split; ASK/MOVED chains redis-py gave up on; CLUSTERDOWN) or NOSCRIPT
        (Redis restarted, SCRIPT FLUSH, a node new to the slot) did nothing, so those commands
        alone are sent again, NOSCRIPT ones as EVAL with the source, until PASSING_RETRY_SECONDS
        have gone; the others' replies are kept, so no write or count change happens twice.
        """
        queued = _Queued()
        fill(queued)
        commands = queued.commands
        results: list = [None] * len(commands)
        todo = list(range(len(commands)))
        deadline = time.monotonic() + PASSING_RETRY_SECONDS
        wait = 0.01
        while todo:
            pipe = self._pipeline()
            for i in todo:
                pipe.execute_command(*commands[i])
            with self._redis():
                replies = pipe.execute(raise_on_error=False)
            for i, r in zip(todo, replies):
                results[i] = r
            todo = [i for i, r in zip(todo, replies) if isinstance(r, _NOT_NOW_REPLIES)]
            if not todo or time.monotonic() > deadline:
                break
            if all(isinstance(results[i], redis.exceptions.NoScriptError) for i in todo):
                wait = 0.0  # nothing to wait for: the source goes along this time
            time.sleep(wait)
            wait = min(max(wait, 0.01) * 2, 0.5)
            sources = {sha: lua for lua, sha in self._scripts.items()}
            for i in todo:
                if isinstance(results[i], redis.exceptions.NoScriptError) and commands[i][0] == "EVALSHA":
                    commands[i] = ("EVAL", sources[commands[i][1]], *commands[i][2:])
        for r in results:
            if isinstance(r, Exception):
                with self._redis():
                    raise r
        return results

    def _wrong_size(self, table: str) -> PSError:
        schema = self._meta(table).schema
        return PSError(
            f"table {table!r} in Redis namespace {self.namespace!r} holds rows of the wrong size "
            f"(expected {schema.row_bytes} bytes each): the data does not match its schema"
        )

    def _error_reply(self, text: str) -> PSError:
        """The PS's error for an error reply read by the compiled row path, as _run raises it."""
        return _translate(BaseParser.parse_error(text), f"Redis at {self.address}", self._password)

    def _not_found(self, table: str) -> TableNotFound:
        with self._cache_lock:
            self._cache.pop(table, None)
        return TableNotFound(f"table {table!r} does not exist in Redis namespace {self.namespace!r} ({self.address})")

    def _gone(self, table: str) -> TableNotFound:
        """A write's error when its table was dropped (or re-created) after the write read its metadata."""
        err = self._not_found(table)
        return TableNotFound(f"{err} (dropped or re-created meanwhile: nothing written)")

    def _row_meta(self, table: str) -> _TableMeta:
        """The metadata a row call (pull, push, delete) works with: what this thread's schema
        lookup just read (_take_fresh), else read now."""
        fresh = self._take_fresh(table)
        return fresh if fresh is not None else self._meta(table)

    def _meta(self, table: str, dropping: bool = False) -> _TableMeta:
        with self._redis():
            raw = self.client.hget(self._meta_key, table)
        if raw is None:
            raise self._not_found(table)
        return self._parse_meta(table, _raw(raw), dropping)

    def _parse_meta(self, table: str, raw: bytes, dropping: bool = False) -> _TableMeta:
        """The parsed metadata; TableNotFound for a table being dropped, unless dropping."""
        meta = self._parse_any_meta(table, raw)
        if meta.dropping and not dropping:
            raise self._not_found(table)
        return meta

    def _parse_any_meta(self, table: str, raw: bytes) -> _TableMeta:
        with self._cache_lock:
            have = self._cache.get(table)
            if have is not None and have.raw == raw:
                self._cache.move_to_end(table)
                return have
        meta = self._decode_meta(table, raw)
        with self._cache_lock:
            self._cache[table] = meta
            self._cache.move_to_end(table)
            while len(self._cache) > META_CACHE_TABLES:
                self._cache.popitem(last=False)
        return meta

    def _decode_meta(self, table: str, raw: bytes) -> _TableMeta:
        """Table `table`'s metadata `raw` parsed (not cached); PSError if it is unreadable."""
        try:
            d = json.loads(raw)
            prefix = prefix_of(self.namespace, table, d)  # first: it refuses a newer format by name
            schema = TableSchema.from_dict(d["schema"])
            nb = bucket_count_of(d)
            if d.get("expected_rows"):  # absent in older metadata
                schema = dataclasses.replace(schema, expected_rows=int(d["expected_rows"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise PSError(
                f"metadata of table {table!r} in Redis namespace {self.namespace!r} is unreadable: {exc}"
            ) from None
        token = d["created"] if int(d.get("format", 1)) >= 2 else ""
        return _TableMeta(raw, schema, nb, prefix, token, bool(d.get("dropping")))

    # -- tables ------------------------------------------------------------------------

    def create_table(self, schema: TableSchema) -> bool:
        """See Store.create_table and _create_table."""
        self._tables_changed += 1  # before and after: a thread's metadata kept meanwhile is void too
        try:
            return self._create_table(schema)
        finally:
            self._tables_changed += 1

    def _create_table(self, schema: TableSchema) -> bool:
        """See Store.create_table; the table gets ceil(schema.expected_rows / rows_per_bucket)
        buckets, or this store's num_buckets if it declares none (module doc). Redis's listpack
        limits are raised first where the rows need it (listpack="auto"). A create, like a drop,
        then sweeps the keys of tables dropped long enough ago (module doc)."""
        if self._listpack is not None:
            with self._redis():
                self._listpack.ensure(schema.row_bytes, f"table {schema.name!r}")
        nb = buckets_for(schema.expected_rows, self.rows_per_bucket, self.num_buckets)
        # "created": a token of this creation, so that a table dropped and created again, even with
        # the same schema, has other metadata (a write checks it: see _WRITE_LUA) and other bucket
        # keys (its prefix holds the token: see the module doc). 48 bits: a table created again
        # gets its predecessor's token with odds of 2^-48, and each bucket key is only 13 bytes
        # longer (a 16-byte token took Redis ~1-2 B more a row of 64 B: jemalloc's next class)
        meta = {"format": META_FORMAT, "buckets": nb, "schema": schema.to_dict()}
        if schema.expected_rows:
            meta["expected_rows"] = schema.expected_rows
        token = secrets.token_hex(6)
        raw = json.dumps({**meta, "created": token}, sort_keys=True).encode()
        for _ in range(CREATE_TRIES):
            # HSETNX in the script: of several PS processes creating one table, exactly one wins
            created = self._run_scripted(
                lambda pipe: self._script(
                    pipe, _CREATE_LUA, [self._meta_key, self._rows_key], [schema.name, raw, token]
                )
            )[0]
            if created:
                self._sweep_soon()
                return True
            try:
                have = self._meta(schema.name, dropping=True)
            except TableNotFound:
                continue  # dropped meanwhile
            if not have.dropping:
                check_same_schema(have.schema, schema, f" in Redis namespace {self.namespace!r}")
                return False
            self.drop_table(schema.name)  # a drop under way or cut short: finish it first
        raise PSError(
            f"table {schema.name!r} in Redis namespace {self.namespace!r} was dropped or created by others "
            f"{CREATE_TRIES} times while this PS created it; try again"
        )

    def schema(self, table: str) -> TableSchema:
        """See Store.schema (with the expected_rows it was created with). The metadata read is
        kept for this thread's next row call on the table (_take_fresh)."""
        meta = self._meta(table)
        self._keep_fresh({table: meta})
        return meta.schema

    def _keep_fresh(self, metas: dict[str, _TableMeta]) -> None:
        """Keep metadata just read for the calling thread's next row call on each table: the
        service reads a table's schema to check a request, then pulls or pushes, and one
        metadata read per call is what the module doc promises (the second HGET was ~1 round
        trip and a share of the PS's CPU per call)."""
        self._fresh.metas = metas
        self._fresh.at = time.monotonic()
        self._fresh.tables_changed = self._tables_changed

    def _take_fresh(self, table: str) -> _TableMeta | None:
        """The metadata this thread's last schema lookup read for `table`, if it was within
        FRESH_METADATA_S, else None."""
        metas = getattr(self._fresh, "metas", None)
        if not metas or time.monotonic() - self._fresh.at > FRESH_METADATA_S:
            return None
        if self._fresh.tables_changed != self._tables_changed:  # a create or drop through this store since
            return None
        return metas.get(table)

    def num_buckets_of(self, table: str) -> int:
        """The table's bucket count (fixed when it was created)."""
        return self._meta(table).num_buckets

    def check_config(self) -> None:
        """See Store.check_config: Redis's listpack limits raised for the tables there are
        (listpack="auto"; a refusal is logged once)."""
        if self._listpack is None:
            return
        metas = self._all_metas()[0]
        if metas:
            widest = max(metas, key=lambda m: m.schema.row_bytes)
            with self._redis():
                self._listpack.ensure(widest.schema.row_bytes, f"{len(metas)} table(s), e.g. {widest.schema.name!r}")

    def _all_metas(self) -> tuple[list[_TableMeta], dict[bytes, bytes]]:
        """(every table's metadata sorted by name, the row counts by table name), in one pipeline."""
        pipe = self._pipeline()
        pipe.hgetall(self._meta_key)
        pipe.hgetall(self._rows_key)
        entries, counts = self._run(pipe)
        names = {_raw(name).decode() for name in entries}
        metas = [self._parse_any_meta(_raw(name).decode(), _raw(raw)) for name, raw in entries.items()]
        metas = [m for m in metas if not m.dropping]
        with self._cache_lock:  # tables dropped through another PS leave the cache
            for gone in [t for t in self._cache if t not in names]:
                del self._cache[gone]
        return sorted(metas, key=lambda m: m.schema.name), counts

    def schemas(self, tables: list[str]) -> dict[str, TableSchema]:
        """See Store.schemas: one pipeline of HMGETs, kept for this thread's next row calls on
        those tables (_take_fresh)."""
        if not tables:
            return {}
        pipe = self._pipeline()
        for lo in range(0, len(tables), SCHEMAS_PER_HMGET):
            pipe.hmget(self._meta_key, tables[lo : lo + SCHEMAS_PER_HMGET])
        raws = [raw for reply in self._run(pipe) for raw in reply]
        metas = {}
        for table, raw in zip(tables, raws):
            if raw is None:
                with self._cache_lock:
                    self._cache.pop(table, None)
            elif not (meta := self._parse_any_meta(table, _raw(raw))).dropping:
                metas[table] = meta
        self._keep_fresh(metas)
        return {table: meta.schema for table, meta in metas.items()}

    def list_tables(self) -> list[TableSchema]:
        """See Store.list_tables."""
        return [m.schema for m in self._all_metas()[0]]

    def list_tables_with_rows(self, time_left: Callable[[], float] | None = None) -> list[tuple[TableSchema, int]]:
        """See Store.list_tables_with_rows: two commands, whatever the number of tables (tables
        of an older version with no row count yet are counted bucket by bucket, once)."""
        metas, counts = self._all_metas()
        out = []
        for meta in metas:
            stored = counts.get(meta.schema.name.encode())
            if stored is not None and int(stored) >= 0:
                out.append((meta.schema, int(stored)))
                continue
            check_time(time_left, "listing tables")
            with contextlib.suppress(TableNotFound):  # dropped meanwhile
                out.append((meta.schema, self._recount(meta, wrong=stored is not None)))
        return out

    def _bucket_key_runs(self, meta: _TableMeta) -> Iterator[list[bytes]]:
        """The table's bucket keys, in runs of at most PIPELINE_MAX_IDS: every bucket's in order,
        or, for a table of more than SCAN_BUCKETS_ABOVE buckets in a database of fewer keys
        than it has buckets, those that exist (SCAN: an empty bucket is no key), so a table of
        2^28 mostly empty buckets costs what its rows do. SCAN returns every key there from
        start to end; one created meanwhile may be missed, as a bucket already visited may be
        written again while the buckets are visited in order."""
        if meta.num_buckets > SCAN_BUCKETS_ABOVE:
            with self._redis():
                keys_there = int(self.client.dbsize())
            if keys_there < meta.num_buckets:
                yield from self._scanned_bucket_keys(meta)
                return
        for lo in range(0, meta.num_buckets, PIPELINE_MAX_IDS):
            yield [meta.key(b) for b in range(lo, min(lo + PIPELINE_MAX_IDS, meta.num_buckets))]

    def _scanned_bucket_keys(self, meta: _TableMeta) -> Iterator[list[bytes]]:
        """The table's bucket keys that exist, by SCAN over every master (see _bucket_key_runs)."""
        prefix = meta.prefix
        # the prefix holds no glob characters (names are [A-Za-z0-9_.-]); keys of other tables
        # that happen to match (none can: the prefix ends in "{<table>.") are filtered anyway
        run: set[bytes] = set()  # SCAN may return a key twice
        with self._redis():
            for key in self.client.scan_iter(match=prefix + b"*", count=SCAN_COUNT):
                key = _raw(key)
                number = key[len(prefix) : -1]
                if key.endswith(b"}") and number.isdigit() and int(number) < meta.num_buckets:
                    run.add(key)
                if len(run) >= PIPELINE_MAX_IDS:
                    yield sorted(run)
                    run = set()
        if run:
            yield sorted(run)

    def _each_bucket(self, meta: _TableMeta, command: Callable[[Any, bytes], None]) -> Iterator[tuple[list, list]]:
        """command(pipe, key) for every bucket of the table (_bucket_key_runs), a pipeline per
        run of keys; (the keys, their replies) of each run, as it is done."""
        for keys in self._bucket_key_runs(meta):

            def fill(pipe, keys=keys) -> None:
                for key in keys:
                    command(pipe, key)

            yield keys, self._run_scripted(fill)

    def _bucket_lens(self, meta: _TableMeta) -> Iterator[tuple[list[bytes], list[int]]]:
        """(keys, HLEN of each) per run of the table's bucket keys."""
        for keys, lens in self._each_bucket(meta, lambda pipe, key: pipe.execute_command("HLEN", key)):
            yield keys, [int(n) for n in lens]

    def _recount(self, meta: _TableMeta, wrong: bool = False) -> int:
        """Count a table without a row count (created by an older version) and keep the count;
        with wrong, replace a kept count that cannot be right (below 0: e.g. on Cluster, rows a
        PS wrote and was killed before counting, deleted since).

        Writes while it counts are not in the count: it is exact only if none come then."""
        n = sum(sum(lens) for _, lens in self._bucket_lens(meta))
        with self._redis():
            if self.client.hget(self._meta_key, meta.schema.name) != meta.raw:
                raise self._not_found(meta.schema.name)  # dropped (or re-created) meanwhile
            if wrong:
                log.warning(
                    "table %r in Redis namespace %r: its row count was below 0; recounted %d rows from its "
                    "buckets. This should not happen%s: please report it to the dynemb developers with this "
                    "line, the dynemb version, and which PS processes created, dropped or wrote to the table then",
                    meta.schema.name,
                    self.namespace,
                    n,
                    " (on Cluster, unless a PS was killed between a write and its count change)"
                    if self.cluster
                    else "",
                )
                self.client.hset(self._rows_key, meta.schema.name, n)
            else:
                self.client.hsetnx(self._rows_key, meta.schema.name, n)
            stored = self.client.hget(self._rows_key, meta.schema.name)
        return n if stored is None else int(stored)

    def num_rows(self, table: str) -> int:
        """See Store.num_rows (the table's kept count: one command)."""
        pipe = self._pipeline()
        pipe.hget(self._meta_key, table)
        pipe.hget(self._rows_key, table)
        raw, n = self._run(pipe)
        if raw is None:
            raise self._not_found(table)
        meta = self._parse_meta(table, _raw(raw))
        return int(n) if n is not None and int(n) >= 0 else self._recount(meta, wrong=n is not None)

    def _add_rows(self, meta: _TableMeta, change: int) -> None:
        """On Cluster, change the count after the writes (on standalone their scripts did), if
        the table is still meta's creation: not the count of a table created since."""
        if self.cluster and change:
            args = [meta.schema.name, meta.token, change]
            self._run_scripted(lambda pipe: self._script(pipe, _WRITTEN_ROWS_LUA, [self._rows_key], args))

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

    def _delete_buckets(self, meta: _TableMeta) -> tuple[int, bool]:
        """Clear the table's buckets while its metadata is still meta.raw, pipeline by pipeline.

        A clear or drop that outlives its table (finished by another PS's drop, perhaps created
        again under the name since) stops rather than remove the new table's rows. On standalone
        Redis each bucket's script checks the metadata; on Cluster it is read before each
        pipeline and after the last (a pipeline sent meanwhile clears only keys of the dropped
        table's creation token: see the module doc).

        Returns:
            (rows removed, whether every bucket was cleared: False if it stopped).
        """
        name = meta.schema.name
        removed = 0

        def unchanged() -> bool:
            with self._redis():
                raw = self.client.hget(self._meta_key, name)
            return raw is not None and _raw(raw) == meta.raw

        for keys in self._bucket_key_runs(meta):
            if self.cluster:  # the scripts cannot see the table hash (another slot)
                if not unchanged():
                    return removed, False

                def fill(pipe, keys=keys) -> None:
                    for key in keys:
                        self._script(pipe, _CLEAR_BUCKET_LUA, [key], [name])

            else:

                def fill(pipe, keys=keys) -> None:
                    for key in keys:
                        self._script(pipe, _CLEAR_BUCKET_LUA, [key, self._meta_key, self._rows_key], [name, meta.raw])

            counts = [int(c) for c in self._run_scripted(fill)]
            n = sum(c for c in counts if c > 0)
            removed += n
            if self.cluster and n:

                def count(pipe, n=n) -> None:
                    self._script(pipe, _CLEARED_ROWS_LUA, [self._meta_key, self._rows_key], [name, meta.raw, -n])

                self._run_scripted(count)
            if any(c < 0 for c in counts):  # the metadata changed: every later bucket said so too
                return removed, False
        # on Cluster, a drop finished by another while the last pipeline went is told too (its
        # clears reached only the dropped table's keys, whatever came since)
        return removed, not self.cluster or unchanged()

    def clear(self, table: str) -> int:
        """See Store.clear; TableNotFound if the table is dropped while it clears."""
        n, whole = self._delete_buckets(self._meta(table))
        if not whole:
            err = self._not_found(table)
            raise TableNotFound(f"{err} (dropped meanwhile, after {n} of its rows were cleared)")
        return n

    def _mark(self, args: list, pipe) -> None:
        self._script(pipe, _MARK_LUA, [self._meta_key], args)

    def drop_table(self, table: str) -> int | None:
        """See Store.drop_table and _drop_table."""
        self._tables_changed += 1  # before and after: a thread's metadata kept meanwhile is void too
        try:
            return self._drop_table(table)
        finally:
            self._tables_changed += 1

    def _drop_table(self, table: str) -> int | None:
        """See Store.drop_table: the metadata marked first, then the rows, then the metadata
        removed, so a retried drop (or a create of that name) finishes the job. A drop that
        another PS's drop finishes first stops there (a new table of the name may exist by
        then) and returns the rows it removed itself."""
        for _ in range(CREATE_TRIES):
            try:
                meta = self._meta(table, dropping=True)
            except TableNotFound:
                return None
            if meta.dropping:
                break
            # marked first: a write planned before (even one in flight now) no longer finds the
            # metadata it read and writes nothing, and no new one is planned; so the buckets
            # cleared next stay empty, and no new table of this name inherits rows
            mark = json.dumps({**json.loads(meta.raw), "dropping": True}, sort_keys=True).encode()
            if self._run_scripted(functools.partial(self._mark, [table, meta.raw, mark]))[0]:
                meta = self._parse_any_meta(table, mark)
                break
        else:
            raise PSError(
                f"table {table!r} in Redis namespace {self.namespace!r} kept changing while this PS "
                "dropped it; try again"
            )
        n, whole = self._delete_buckets(meta)
        if whole:
            keys = [self._meta_key, self._rows_key, self._dropped_key]
            self._run_scripted(lambda pipe: self._script(pipe, _DROP_LUA, keys, [table, meta.raw]))
        with self._cache_lock:
            self._cache.pop(table, None)
        self._sweep_soon()
        return n

    def _sweep_soon(self) -> None:
        """Start _sweep_dropped on a thread of its own, unless one is sweeping already: it may
        visit every bucket of a big table, which the create or drop that calls it should not
        wait for (a later create or drop sweeps what this one leaves)."""
        with self._sweep_lock:
            if self._closing.is_set() or (self._sweeper is not None and self._sweeper.is_alive()):
                return
            self._sweeper = threading.Thread(target=self._sweep_dropped, name="dynemb-redis-sweep", daemon=True)
            self._sweeper.start()

    def _sweep_dropped(self) -> int:
        """Unlink every bucket key of the tables dropped more than SWEEP_DROPPED_AFTER_S ago (at
        most SWEEP_TABLES_PER_CALL of them), keys that writes in flight at their drop left on
        Cluster (module doc), and forget those tables. A failure is logged, not raised: the
        create or drop that sweeps has done its own work. Returns the keys unlinked."""
        unlinked = 0
        try:
            args = [SWEEP_DROPPED_AFTER_S, SWEEP_TABLES_PER_CALL]
            due = self._run_scripted(lambda pipe: self._script(pipe, _DUE_LUA, [self._dropped_key], args))[0]
            for entry in map(_raw, due):
                try:
                    name = json.loads(entry)["schema"]["name"]
                    meta: _TableMeta | None = self._decode_meta(name, entry)
                except (ValueError, KeyError, TypeError, PSError) as exc:
                    log.warning("Redis namespace %r: forgetting an unreadable dropped table (%s)", self.namespace, exc)
                    meta = None
                if meta is not None and meta.token:  # format 1: keys without a token, maybe a new table's
                    left = 0
                    for keys in self._bucket_key_runs(meta):
                        if self._closing.is_set():
                            return unlinked

                        def fill(pipe, keys=keys) -> None:
                            for key in keys:
                                pipe.execute_command("UNLINK", key)

                        left += sum(int(n) for n in self._run_scripted(fill))
                    if left:
                        log.info(
                            "Redis namespace %r: unlinked %d bucket key(s) that writes in flight left after "
                            "table %r was dropped",
                            self.namespace,
                            left,
                            name,
                        )
                    unlinked += left
                with self._redis():
                    self.client.zrem(self._dropped_key, entry)
        except PSError as exc:
            log.warning(
                "Redis namespace %r: sweeping dropped tables' keys failed (tried again later): %s", self.namespace, exc
            )
        return unlinked

    # -- the compiled row path (standalone Redis) -----------------------------------------

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
        if len(buf) > REPLY_BUFFER_KEEP_BYTES:
            setattr(self._buffers, name, None)
        return buf, end

    def _native_pull(self, meta: _TableMeta, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows of ids into out (a pipeline of HMGETs per at most PIPELINE_MAX_IDS ids, built and
        read by the compiled module); the positions of the ids not found."""
        if self.cluster:
            return self._cluster_pull(meta, ids, out)
        schema = meta.schema
        mod = self._native
        assert mod is not None  # only called when there is one
        n = len(ids)
        step = max(1, min(PIPELINE_MAX_IDS, PIPELINE_MAX_BYTES // schema.row_bytes))
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
        """HSET of the ids' rows (rows given) or HDEL of the ids (None) by the write script, one
        EVALSHA per at most PIPELINE_MAX_IDS ids built by the compiled module; the fields
        added or removed (the row count changed with them)."""
        if self.cluster:
            return self._cluster_write(meta, ids, rows)
        schema = meta.schema
        mod = self._native
        assert mod is not None  # only called when there is one
        lua = _WRITE_SCRIPTS["HSET" if rows is not None else "HDEL"]
        per_id = schema.row_bytes + 8 if rows is not None else 8
        step = max(1, min(PIPELINE_MAX_IDS, PIPELINE_MAX_BYTES // per_id))
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

    # -- the compiled row path on Redis Cluster -------------------------------------------

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

    def _cluster_pull(self, meta: _TableMeta, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """_native_pull on Cluster: each node's HMGETs built and read by the compiled module,
        all nodes at once (_cluster_exchange); the positions of the ids not found."""
        schema = meta.schema
        mod = self._native
        assert mod is not None
        step = max(1, min(PIPELINE_MAX_IDS, PIPELINE_MAX_BYTES // schema.row_bytes))
        absent_parts = []
        for lo in range(0, len(ids), step):
            chunk = ids[lo : lo + step]
            rows = out[lo : lo + len(chunk)]
            smap, parts, again = self._by_node(meta, chunk)
            sends, states = [], []
            for node, pos in parts:
                k = len(pos)
                order = np.empty(k, dtype=np.int64)
                request, commands = mod.pull_request(chunk[pos], meta.num_buckets, meta.prefix, order)
                missing = np.empty(k, dtype=np.int64)
                state: list = [0, 0, None]  # fields read, ids absent, the first error reply
                # the i-th field asked for is the row of chunk[pos[order[i]]]: rows[pos[order[i]]]
                take = _hmget_reader(mod, pos[order], rows, schema.row_bytes, missing, state)
                sends.append((node, request, commands, k * (schema.row_bytes + 16) + commands * 16, take))
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
                found = self._py_pull(meta, chunk[pos], redone)
                rows[pos] = redone
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
        per_id = schema.row_bytes + 8 if rows is not None else 8
        step = max(1, min(PIPELINE_MAX_IDS, PIPELINE_MAX_BYTES // per_id))
        total = 0
        try:
            for lo in range(0, len(ids), step):
                chunk = ids[lo : lo + step]
                chunk_rows = None if rows is None else rows[lo : lo + step]
                smap, parts, again = self._by_node(meta, chunk)
                sends = []
                for node, pos in parts:
                    part_rows = None if chunk_rows is None else chunk_rows[pos]
                    request, commands = mod.plain_write_request(
                        chunk[pos], part_rows, schema.row_bytes, meta.num_buckets, meta.prefix
                    )
                    sends.append((node, request, commands, 16 * commands + 64, None))
                error = None
                for (_, pos), send, reply in zip(parts, sends, self._cluster_exchange(smap, sends)):
                    if reply is None:
                        again.append(pos)
                        continue
                    try:
                        changed, failed = mod.integer_replies(reply[0], reply[1], send[2])
                    except ValueError as exc:
                        raise PSError(f"Redis at {self.address}: {exc}") from None
                    total += changed
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
        except BaseException:
            with contextlib.suppress(PSError):  # what was written is counted
                self._add_rows(meta, total if rows is not None else -total)
            raise
        self._add_rows(meta, total if rows is not None else -total)
        return total

    # -- rows --------------------------------------------------------------------------

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See Store.pull; rows of ids not found are zeros."""
        if self._native is not None:
            ids = _as_ids(ids)
            meta = self._row_meta(table)
            rows = rows_out(out, len(ids), meta.schema)
            absent = self._native_pull(meta, ids, rows)
            rows[absent] = 0
            found = np.ones(len(ids), dtype=bool)
            found[absent] = False
            return rows, found
        return self._pull(table, ids, out)

    def pull_into(self, table: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """See Store.pull_into."""
        if self._native is None:
            return super().pull_into(table, ids, out)
        ids = _as_ids(ids)
        meta = self._row_meta(table)
        return self._native_pull(meta, ids, rows_out(out, len(ids), meta.schema))

    def _pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        meta = self._row_meta(table)
        ids = _as_ids(ids)
        rows = rows_out(out, len(ids), meta.schema)
        return rows, self._py_pull(meta, ids, rows)

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

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """See Store.push."""
        ids = _as_ids(ids)
        if len(ids) == 0:  # nothing to write: no command at all
            rows_for_table(rows, self.schema(table), 0)
            return 0
        meta = self._row_meta(table)
        schema = meta.schema
        rows = rows_for_table(rows, schema, len(ids))
        if self._native is not None:
            self._native_write(meta, ids, rows)
            return len(ids)
        self._add_rows(meta, self._py_write(meta, "HSET", ids, rows))
        return len(ids)

    def delete(self, table: str, ids: np.ndarray) -> int:
        """See Store.delete."""
        meta = self._row_meta(table)
        ids = _as_ids(ids)
        if len(ids) == 0:
            return 0
        if self._native is not None:
            return self._native_write(meta, ids, None)
        deleted = self._py_write(meta, "HDEL", ids, None)
        self._add_rows(meta, -deleted)
        return deleted

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
        target = max(rows_per_chunk, EXPORT_READ_ROWS)
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

    # -- service -----------------------------------------------------------------------

    def ping(self) -> None:
        """See Store.ping (a Redis PING)."""
        with self._redis():
            self.client.ping()

    def close(self) -> None:
        """See Store.close; errors while closing are ignored. A sweep still running stops at its
        next run of keys (a later create or drop sweeps the rest)."""
        self._closing.set()
        with self._sweep_lock:
            sweeper = self._sweeper
        if sweeper is not None:
            sweeper.join(timeout=10.0)
        with contextlib.suppress(*_REDIS_ERRORS):
            self.client.close()
            if not isinstance(self.client, redis.cluster.RedisCluster):  # i.e. not self.cluster
                self.client.connection_pool.disconnect()


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


class _Queued:
    """Stands in for a pipeline while a fill() function queues its commands (_run_scripted)."""

    def __init__(self) -> None:
        self.commands: list[tuple] = []

    def execute_command(self, *args) -> None:
        self.commands.append(args)


def _raw(value: bytes | str) -> bytes:
    """A reply as the bytes it is: redis-py types replies bytes | str, as it cannot know that
    this store's client does not decode responses (every reply is raw bytes)."""
    if isinstance(value, str):
        raise PSError("the Redis client decodes responses (decode_responses=True); RedisStore needs raw bytes")
    return value


def _sha_text(reply) -> str:
    """SCRIPT LOAD's reply (redis-py decodes it, whatever decode_responses says)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _as_ids(ids: np.ndarray) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1:
        raise InvalidArgument(f"ids must be a 1-D array of int64, got shape {ids.shape}")
    return ids


# redis-py's errors; cluster-client failures (no reachable node, slot not covered) are not RedisError
_REDIS_ERRORS = (redis.RedisError, RedisClusterException)
# error replies of a cluster or server that is failing over or resharding: retrying may help
_PASSING_REPLIES = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.ReadOnlyError)
# replies to a command that did nothing and may do it when sent again soon (_run_scripted);
# ClusterError: redis-py's "TTL exhausted" after following TRYAGAIN, ASK or MOVED too often
_NOT_NOW_REPLIES = (
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ClusterError,
    redis.exceptions.NoScriptError,
)
_AUTH_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)
# what Redis answers to a wrong or missing password, when it reaches us only as text
_AUTH_REPLIES = ("WRONGPASS", "NOAUTH", "invalid username-password", "invalid password", "already authenticated")


def _is_auth_error(exc: BaseException | None) -> bool:
    # the cluster client wraps the node's error in a RedisClusterException, so look down the chain
    while exc is not None:
        if isinstance(exc, _AUTH_ERRORS) or any(r in str(exc) for r in _AUTH_REPLIES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _translate(exc: Exception, where: str, password: str | None) -> PSError:
    """The PS error for a redis-py error, with the password scrubbed from the message."""
    text = str(exc) or type(exc).__name__
    if password:
        text = text.replace(password, "***")
    if len(text) > 500:
        text = text[:500] + "..."
    if _is_auth_error(exc):
        return BackendUnavailable(f"{where} refused authentication (check the user and password in the URL): {text}")
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return BackendUnavailable(f"{where} refused a command for this ACL user (NOPERM): {text}")
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return ResourceExhausted(f"{where} is out of memory (maxmemory reached): {text}")
    if isinstance(exc, redis.ResponseError) and not isinstance(exc, _PASSING_REPLIES):
        return PSError(f"{where} answered with an error: {text}")
    return BackendUnavailable(f"{where} is unavailable: {type(exc).__name__}: {text}{untrusted_hint(text)}")
