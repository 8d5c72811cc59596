"""The Redis backend: tables in standalone Redis or Redis Cluster, over redis-py + hiredis.

RedisStore is made of parts a reader can take one at a time, each a class the next one
builds on: redis_keys.py (the layout, the keys, the tunables), redis_tables.py (metadata,
creates, drops, row counts, sweeps), redis_rows.py (rows on standalone Redis, export),
redis_cluster.py (rows on Redis Cluster); this module connects them to Redis (the client,
its errors, pipelines and scripts) and says which row path a call takes.

Requests go as one non-transactional pipeline (a few for very
large batches) from the client's connection pool, so the store is safe to call from many threads.
While Cluster slots move (a master added, a reshard), commands follow ASK and MOVED (redis-py,
helped to reach a master that owns no slot yet), and scripts that meet TRYAGAIN or NOSCRIPT are
sent again (_run_scripted); tests/ps_server/test_cluster_reshard.py moves slots under load.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import numpy as np
import redis
import redis.cluster
import redis.event
import redis.sentinel
from redis._parsers.base import BaseParser  # the error classes of error replies, as redis-py raises them
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from dynemb.common.arrays import unique
from dynemb.common.errors import shown
from dynemb.ps_server.backends import redis_keys as layout
from dynemb.ps_server.backends.base import Store, rows_out
from dynemb.ps_server.backends.redis_cluster import RedisClusterRows, _follow_ask_to_new_masters, _SlotMap
from dynemb.ps_server.backends.redis_config import MODES as LISTPACK_MODES
from dynemb.ps_server.backends.redis_config import ROWS_PER_BUCKET, ListpackLimits
from dynemb.ps_server.backends.redis_durable import Durability, ReplicasShort, ReplicaWaits
from dynemb.ps_server.backends.redis_keys import (
    _REDIS_ERRORS,
    _as_ids,
    _TableMeta,
    dropped_key,
    marker_key,
    meta_key,
    rows_key,
)
from dynemb.ps_server.backends.redis_tls import check_tls_files, untrusted_hint
from dynemb.ps_server.codec import rows_for_table
from dynemb.ps_server.errors import (
    BackendUnavailable,
    InvalidArgument,
    PSError,
    ResourceExhausted,
)
from dynemb.ps_server.lifecycle import STAMP_DTYPE
from dynemb.ps_server.native import redis_rows
from dynemb.ps_server.schema import check_name


def _host_ports(hosts: str, what: str) -> list[tuple[str, int]]:
    """`h1:p1,h2:p2,[::1]:p3` -> [(host, port)...]; InvalidArgument naming `what` for a bad one."""
    nodes = []
    for part in filter(None, hosts.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidArgument(f"{what} {shown(part)} must be host:port")
        nodes.append((unquote(host.strip("[]")), int(port)))
    return nodes


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
    nodes = _host_ports(hosts, "cluster URL node")
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


def _split_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, dict, dict]:
    """`redis+sentinel://[user:pass@]h1:p1,h2:p2/<master name>[/db][?opts]` -> (Sentinels,
    master name, redis-py kwargs for the master, kwargs for the Sentinels).

    The user and password are the master's (and its replicas'); `sentinel_password=` (and
    `sentinel_username=`) in the query are the Sentinels' own, if they ask for one. The other
    options mean what they mean in a redis:// URL (redis-py's parser reads them) and go to both.
    """
    scheme, rest = url.split("://", 1)
    tls = scheme.lower() == "rediss+sentinel"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    nodes = _host_ports(hosts, "sentinel URL node")
    if not nodes:
        raise InvalidArgument(
            "a sentinel URL needs at least one Sentinel host:port, e.g. redis+sentinel://10.0.0.1:26379/mymaster"
        )
    name, _, db = path.strip("/").partition("/")
    if not name:
        raise InvalidArgument(
            "a sentinel URL names the master after the Sentinels, e.g. redis+sentinel://10.0.0.1:26379/mymaster"
        )
    if db and not db.isdigit():
        raise InvalidArgument(f"the database after the master's name must be a number, got {shown(db)}")
    pairs = parse_qsl(query)
    sentinel_kw = {k.removeprefix("sentinel_"): v for k, v in pairs if k in ("sentinel_password", "sentinel_username")}
    pairs = [(k, v) for k, v in pairs if not k.startswith("sentinel_")]
    probe = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}{hosts.split(',')[0]}/{db or 0}"
    kwargs = redis.connection.parse_url(probe + ("?" + urlencode(pairs) if pairs else ""))
    for k in ("host", "port", "connection_class"):
        kwargs.pop(k, None)
    if tls:
        kwargs["ssl"] = True
    shared = {k: v for k, v in kwargs.items() if k not in ("username", "password", "db")}
    return nodes, unquote(name), kwargs, {**shared, **sentinel_kw}


# how long a marker's write waits for its master's replicas at one check (lost_data)
MARKER_WAIT_MS = 1000


class RedisStore(RedisClusterRows, Store):
    """Tables in Redis or Redis Cluster (layout: redis_keys.py). Usually built by from_url()."""

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
        durable: Durability | None = None,
    ) -> None:
        check_name(namespace, "namespace")
        if not isinstance(num_buckets, int) or not 1 <= num_buckets <= layout.MAX_BUCKETS:
            raise InvalidArgument(f"num_buckets must be an integer in [1, {layout.MAX_BUCKETS}], got {num_buckets!r}")
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
        # writes acknowledged once replicas have them (redis_durable.py)
        self._waits = ReplicaWaits(durable or Durability(), self._connected_replicas)
        self._unsure: dict[str, float] = {}  # tables whose row count a cut write may have left wrong: since when
        self._meta_key = meta_key(namespace)
        self._rows_key = rows_key(namespace)
        self._dropped_key = dropped_key(namespace)
        self._marker_key = marker_key(namespace)
        self._markers: dict[bytes, bytes | str | None] | None = None  # the namespace's markers as this store saw them
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
        self.expired_read_counts: dict[str, int] = {}  # rows pulls found expired, by table
        if self.cluster and self._native is not None:
            self._watch_slot_map()

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
        durable: Durability | None = None,
        **kw,
    ) -> RedisStore:
        """redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, redis+sentinel://,
        rediss+sentinel:// (see the module doc).

        Extra keywords go to redis-py (ssl_ca_certs=, ssl_cert_reqs=, max_connections=...);
        `retries` sets how often a request is retried on a dropped connection (default 2).
        native_rows=False reads and writes rows through redis-py's commands instead of the
        compiled row path (the same commands; for comparison and tests). num_buckets: the
        buckets of a new table that declares no expected rows; rows_per_bucket: what a table
        that does is sized for; listpack: "auto" raises Redis's listpack limits as the tables
        need them (redis_config.py), "off" leaves Redis's config alone; durable: how writes wait
        for replicas (redis_durable.py; default "auto").
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
                options = {**kw, "socket_timeout": socket_timeout, **url_kw}  # the URL's own wins, as in redis://
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
            elif scheme in ("redis+sentinel", "rediss+sentinel"):
                sentinels, name, options, sentinel_kw = _split_sentinel_url(url)
                options = {**kw, "socket_timeout": socket_timeout, **options}  # the URL's own wins
                check_tls_files(options)
                sentinel = redis.sentinel.Sentinel(
                    sentinels,
                    sentinel_kwargs={**sentinel_kw, "socket_timeout": min(socket_timeout, 5.0)},
                    retry=retry,
                    **options,
                )
                client = sentinel.master_for(name, retry=retry, **options)
                address = f"{name} via Sentinel {','.join(f'{h}:{p}' for h, p in sentinels)}"
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
            raise InvalidArgument(
                f"bad Redis URL {shown(_without_password(url))}: {exc}; expected {REDIS_URL_FORMS}"
            ) from None
        return cls(
            client,
            namespace=namespace,
            num_buckets=num_buckets,
            address=address,
            password=options.get("password"),
            native_rows=native_rows,
            rows_per_bucket=rows_per_bucket,
            listpack=listpack,
            durable=durable,
        )

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
        deadline = time.monotonic() + layout.PASSING_RETRY_SECONDS
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

    def _error_reply(self, text: str) -> PSError:
        """The PS's error for an error reply read by the compiled row path, as _run raises it."""
        return _translate(BaseParser.parse_error(text), f"Redis at {self.address}", self._password)

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See Store.pull; rows of ids not found are zeros. In a table whose rows expire,
        expired rows count as absent and old stamps are renewed (_expire_read)."""
        ids = _as_ids(ids)
        meta = self._row_meta(table)
        rows = rows_out(out, len(ids), meta.schema)
        found = self._pull_found(meta, ids, rows)
        rows[~found] = 0
        return rows, found

    def pull_into(self, table: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """See Store.pull_into."""
        ids = _as_ids(ids)
        meta = self._row_meta(table)
        rows = rows_out(out, len(ids), meta.schema)
        if self._native is None or (meta.stamped and meta.lifecycle.active):
            return np.flatnonzero(~self._pull_found(meta, ids, rows))
        stamps = np.zeros(len(ids), dtype=STAMP_DTYPE) if meta.stamped else None
        return self._native_pull(meta, ids, rows, stamps)

    def _pull_found(self, meta: _TableMeta, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Rows of ids into rows (those not found unspecified); which were found, expired rows
        counting as absent and old stamps renewed (_expire_read)."""
        stamps = np.zeros(len(ids), dtype=STAMP_DTYPE) if meta.stamped else None
        if self._native is not None:
            found = np.ones(len(ids), dtype=bool)
            found[self._native_pull(meta, ids, rows, stamps)] = False
        else:
            found = self._py_pull(meta, ids, rows, stamps)
        self._expire_read(meta, ids, found, stamps)
        return found

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """See Store.push: each row stamped with now, if the table's rows carry stamps."""
        ids = _as_ids(ids)
        if len(ids) == 0:  # nothing to write: no command at all
            rows_for_table(rows, self.schema(table), 0)
            return 0
        meta = self._row_meta(table)
        schema = meta.schema
        rows = rows_for_table(rows, schema, len(ids))
        if meta.change_log:  # logged before the write (change_log.py)
            self._log_ids(meta.changes_key, ids, meta.change_log)
        with self._count_unsure_if_cut(table):
            if self._native is not None:
                self._native_write(meta, ids, rows)
                return len(ids)
            self._add_rows(meta, self._py_write(meta, "HSET", ids, rows))
        return len(ids)

    def delete(self, table: str, ids: np.ndarray) -> int:
        """See Store.delete: the ids are logged in the table's deletion log first (as asked: a
        reader checks which were stored)."""
        meta = self._row_meta(table)
        ids = _as_ids(ids)
        if len(ids) == 0:
            return 0
        self._log_deleted(meta, unique(ids))
        with self._count_unsure_if_cut(table):
            if self._native is not None:
                return self._native_write(meta, ids, None)
            deleted = self._py_write(meta, "HDEL", ids, None)
            self._add_rows(meta, -deleted)
        return deleted

    @contextlib.contextmanager
    def _count_unsure_if_cut(self, table: str):
        """A write that failed on the way to Redis (BackendUnavailable: a connection cut or timed
        out) may have landed without the replies its row count is changed by: the table is
        recounted from its buckets at a count read once Redis answers (RedisTables._settle_counts).
        A write that too few replicas had (ReplicasShort) is in Redis and counted."""
        try:
            yield
        except ReplicasShort:
            raise
        except BackendUnavailable:
            with self._cache_lock:
                self._unsure.setdefault(table, time.monotonic())
            raise

    def _connected_replicas(self, pool) -> int:
        """The replicas of the master of a connection pool that are online now (INFO
        replication): one still loading its first copy of the data cannot acknowledge writes."""
        with self._redis():
            info = redis.Redis(connection_pool=pool).info("replication")
        slaves = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
        return sum(1 for v in slaves if isinstance(v, dict) and v.get("state") == "online")

    def replica_waits(self) -> dict[str, int]:
        """See Store.replica_waits."""
        return dict(self._waits.counts)

    def expired_reads(self, table: str) -> int:
        """Rows pulls through this store found expired (counted as absent) since it started."""
        with self._cache_lock:
            return self.expired_read_counts.get(table, 0)

    def ping(self) -> None:
        """See Store.ping (a Redis PING)."""
        with self._redis():
            self.client.ping()

    def lost_data(self) -> str:
        """See Store.lost_data: the namespace's marker (redis_keys.marker_key), written once it
        holds a table, and on Cluster one more on each master (a master restarted empty loses its
        slots' rows, the tables' metadata being elsewhere); each read back at every check."""
        with self._redis():
            if self._markers is None:
                if self.client.get(self._marker_key) is None and not self.client.hlen(self._meta_key):
                    return ""  # nothing held yet: nothing to lose
                self._markers = self._write_markers()  # None until its replicas have them: again next time
                return ""
            for key, token in self._markers.items():
                there = self.client.get(key)
                if there != token:
                    break
            else:
                return ""
        now = "is gone" if there is None else "holds another token (written since by a PS that found it gone)"
        return (
            f"Redis at {self.address} lost namespace {self.namespace!r}'s data: its marker {key.decode()}, written "
            f"beside the tables, {now}. It restarted without persistence, or an empty replica was promoted"
        )

    def _write_markers(self) -> dict[bytes, bytes | str | None] | None:
        """Each marker key written unless there (SET NX): what each holds, once the replicas of
        its master have it; None while one has not acknowledged it yet."""
        token = secrets.token_hex(8)
        markers: dict[bytes, bytes | str | None] = {}
        for key in [self._marker_key, *(self._master_marker_keys() if self.cluster else [])]:
            held = self._replicated_marker(key, token)
            if held is None:
                return None
            markers[key] = held
        return markers

    def _replicated_marker(self, key: bytes, token: str) -> bytes | str | None:
        """SET NX of a marker, GET and WAIT on one connection to its master: what it holds, or
        None while an online replica has not acknowledged it. A marker only its master had would
        be missed after a failover that lost nothing acknowledged (the replica lagging behind a
        busy master), and taken for a store that lost its data."""
        node = self._master_of(key)
        replicas = self._connected_replicas(node.connection_pool)
        pipe = node.pipeline(transaction=False)
        pipe.set(key, token, nx=True)
        pipe.get(key)
        if replicas:
            pipe.execute_command("WAIT", replicas, MARKER_WAIT_MS)
        replies = pipe.execute()
        return None if replicas and int(replies[2]) < replicas else replies[1]

    def _master_of(self, key: bytes) -> redis.Redis:
        """A client of the master that holds key (on standalone Redis: the store's own)."""
        if isinstance(self.client, redis.cluster.RedisCluster):
            return self.client.get_node_from_key(key).redis_connection
        return self.client

    def _master_marker_keys(self) -> list[bytes]:
        """A marker key in a slot of each Cluster master (as the slot map says now)."""
        assert isinstance(self.client, redis.cluster.RedisCluster)  # only called on Cluster
        first_slot: dict[str, int] = {}
        for slot, nodes in sorted(self.client.nodes_manager.slots_cache.items()):
            first_slot.setdefault(nodes[0].name, slot)
        base = f"dn:{self.namespace}:marker".encode()
        return [_key_in_slot(base, slot, self.client.keyslot) for slot in first_slot.values()]

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


class _Queued:
    """Stands in for a pipeline while a fill() function queues its commands (_run_scripted)."""

    def __init__(self) -> None:
        self.commands: list[tuple] = []

    def execute_command(self, *args) -> None:
        self.commands.append(args)


def _sha_text(reply) -> str:
    """SCRIPT LOAD's reply (redis-py decodes it, whatever decode_responses says)."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


# redis-py's errors; cluster-client failures (no reachable node, slot not covered) are not RedisError


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


def _key_in_slot(base: bytes, slot: int, keyslot: Callable[[bytes], int]) -> bytes:
    """`{base.N}` for the first N that puts it in this Cluster slot (of 16384: ~16k tries, in C)."""
    for n in range(1 << 20):
        key = b"{%s.%d}" % (base, n)
        if keyslot(key) == slot:
            return key
    raise PSError(f"no key {base.decode()}.N for Cluster slot {slot} in 2^20 tries")


REDIS_URL_FORMS = (
    "redis://[user:password@]host:port[/db], rediss:// (TLS), unix:///path/to/socket, "
    "redis+cluster://host:port[,host:port...] or redis+sentinel://host:port[,host:port...]/master-name"
)


def _without_password(url: str) -> str:
    """The URL with the password of its user part replaced by ***, for messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, hosts = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hosts}"
