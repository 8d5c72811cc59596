"""Redis's listpack limits, checked and raised by the PS so bucket hashes stay compact.

A bucket hash (redis_store.py) whose values are longer than Redis's `hash-max-listpack-value`
(64 bytes by default) or that holds more fields than `hash-max-listpack-entries` (128) is a
hashtable: per row a dict entry and two allocations, ~1.35x the rows' raw bytes (id + row) in
Redis memory. Kept as a listpack the same rows take ~1.12x (bench/RESULTS.md, redis_memory).
With `--redis-listpack auto` (the default) the store raises the two limits, before a table is
created and once at the PS's start for the tables there are, to what the tables need:

- hash-max-listpack-value >= the table's row bytes (rows over MAX_LISTPACK_VALUE are left to
  hashtables: a listpack is rewritten in place on each write, and at such sizes the hashtable's
  per-row overhead is a small share of the row);
- hash-max-listpack-entries >= ENTRIES_PER_BUCKET x the rows a bucket is sized for. A table
  that grows past its declared rows keeps listpack buckets up to 8x that size (a Redis CPU
  price per row that grows with the bucket: ~2.4x hashtable's at 122 rows a bucket); past it a
  bucket is converted to a hashtable once, and costs hashtable memory and CPU from then on.
  At the default 16 rows a bucket this is Redis's own default of 128, so usually only the
  value limit changes.

A setting is only ever raised, on every master of a Cluster. CONFIG SET is not persisted (a
restarted Redis is back to its redis.conf) and does not reach replicas (a replica promoted by a
failover has its own): deploy/k8s/redis*/redis.conf set both too, and each create checks again. Where
CONFIG is refused (an ACL user without +config, a renamed command, a managed Redis) the store
logs one warning naming the settings to put in redis.conf, and goes on: the rows are the same
either way, only their memory differs.
"""

from __future__ import annotations

import logging
import threading

import redis
import redis.cluster

log = logging.getLogger("dynemb.ps")

VALUE = "hash-max-listpack-value"
ENTRIES = "hash-max-listpack-entries"
# hash-max-listpack-entries is kept at least this many times the rows a bucket is sized for.
ENTRIES_PER_BUCKET = 8
# Rows longer than this are left to hashtables (see the module doc).
MAX_LISTPACK_VALUE = 16 << 10
# Redis memory per raw row byte (8-byte id + row) of 512-byte rows, bench/RESULTS.md redis_memory.
LISTPACK_X = 1.12
HASHTABLE_X = 1.35
MODES = ("auto", "off")
# Rows a bucket is sized for when a table declares its expected rows (the store's default;
# PS flag --redis-rows-per-bucket): ~15-30 rows a bucket kept as listpacks cost 1.11-1.13x the
# rows' bytes for ~1.2-1.6x hashtable's Redis CPU per row (bench/RESULTS.md, redis_memory);
# fewer rows a bucket cost more per-key memory.
ROWS_PER_BUCKET = 16


def wanted(row_bytes: int, rows_per_bucket: int) -> dict[str, int]:
    """The limits a table of rows of row_bytes, sized at rows_per_bucket a bucket, needs so its
    buckets stay listpacks; {} if its rows are too long to be worth it (MAX_LISTPACK_VALUE)."""
    if row_bytes > MAX_LISTPACK_VALUE:
        return {}
    return {VALUE: row_bytes, ENTRIES: ENTRIES_PER_BUCKET * rows_per_bucket}


class ListpackLimits:
    """Raises Redis's listpack limits as the tables of one store need them (see the module doc).

    Args:
        client: the store's redis-py client (standalone or Cluster).
        address: how messages name the Redis.
        rows_per_bucket: the rows a bucket is sized for (the store's --redis-rows-per-bucket).
    """

    def __init__(self, client: redis.Redis | redis.cluster.RedisCluster, address: str, rows_per_bucket: int) -> None:
        self.client = client
        self.address = address
        self.rows_per_bucket = rows_per_bucket
        self._lock = threading.Lock()  # one check at a time: one INFO line per change
        self._warned = False

    def ensure(self, row_bytes: int, tables: str) -> None:
        """Raise the limits where below what rows of row_bytes need. Checked each time (two
        CONFIG GETs a master): a Redis restarted since lost what CONFIG SET raised.

        Args:
            row_bytes: the longest values of the tables (a row and its stamp).
            tables: the tables, as the log line names them.

        Raises:
            redis.RedisError: Redis did not answer (refusals of CONFIG are logged, not raised).
        """
        want = wanted(row_bytes, self.rows_per_bucket)
        if not want:
            return
        with self._lock:
            try:
                changed = self._raise(want)
            except redis.ResponseError as exc:  # NOPERM, unknown (renamed) command, a managed Redis's refusal
                self._refused(want, tables, exc)
                return
        if changed:
            log.info(
                "Redis at %s: raised %s so that the buckets of %s (values of %d B: a row and its stamp, ~%d a "
                "bucket) stay listpacks: ~%.2fx the rows' bytes in Redis memory instead of ~%.2fx as hashtables "
                "(CONFIG SET is not persisted: put the settings in redis.conf too)",
                self.address,
                ", ".join(f"{k} {old} -> {new}" for k, (old, new) in sorted(changed.items())),
                tables,
                row_bytes,
                self.rows_per_bucket,
                LISTPACK_X,
                HASHTABLE_X,
            )

    def _nodes(self) -> list:
        """The nodes to configure: None (the one Redis) or every Cluster master."""
        if isinstance(self.client, redis.cluster.RedisCluster):
            return list(self.client.get_primaries())
        return [None]

    def _raise(self, want: dict[str, int]) -> dict[str, tuple[int, int]]:
        """CONFIG GET each limit on each node and CONFIG SET those below; {name: (lowest seen, set)}."""
        changed: dict[str, tuple[int, int]] = {}
        for node in self._nodes():
            extra = {} if node is None else {"target_nodes": node}
            for name, value in want.items():
                have = _int_setting(self.client.config_get(name, **extra), name)
                if have < value:
                    self.client.config_set(name, value, **extra)
                    old = changed.get(name, (have, value))[0]
                    changed[name] = (min(old, have), value)
        return changed

    def _refused(self, want: dict[str, int], tables: str, exc: Exception) -> None:
        if self._warned:
            log.debug("Redis at %s refused CONFIG again: %s", self.address, exc)
            return
        self._warned = True
        log.warning(
            "Redis at %s refused CONFIG (%s), so the PS cannot check its listpack limits: unless redis.conf "
            "sets %s, the buckets of %s are hashtables, ~%.2fx the rows' bytes in Redis memory instead of "
            "~%.2fx (--redis-listpack off silences this)",
            self.address,
            str(exc)[:200],
            " and ".join(f"`{k} {v}` (or more)" for k, v in want.items()),
            tables,
            HASHTABLE_X,
            LISTPACK_X,
        )


def _int_setting(reply, name: str) -> int:
    """A CONFIG GET reply's value of name as an int (0 if absent: an old Redis calls it ziplist)."""
    if isinstance(reply, dict) and len(reply) == 1 and isinstance(next(iter(reply.values())), dict):
        reply = next(iter(reply.values()))  # a Cluster client's {node: reply}
    for key, value in (reply or {}).items():
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key == name:
            return int(value)
    return 0
