"""RedisStore's tables: their metadata (created, read, cached, listed), their row counts, and
their drops, clears and the sweep of what drops leave (layout: redis_keys.py).

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
at the next listing, or as the least recently used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dynemb.ps_server.backends import redis_keys as layout
from dynemb.ps_server.backends.base import check_same_schema, check_time
from dynemb.ps_server.backends.redis_keys import (
    _ADD_COUNT_LUA,
    _WRITTEN_ROWS_LUA,
    _raw,
    _TableMeta,
    bucket_count_of,
    buckets_for,
    drops_key,
    log,
    prefix_of,
)
from dynemb.ps_server.backends.redis_logs import RedisLogs
from dynemb.ps_server.errors import (
    Contended,
    InvalidArgument,
    PSError,
    TableNotFound,
)
from dynemb.ps_server.lifecycle import DROP_LOG_ENTRIES, STAMP_BYTES, Lifecycle, now_stamp
from dynemb.ps_server.schema import TableSchema

# Cluster: counts and deletes bucket KEYS[1] atomically, so clear/drop report exactly what they
# removed; the table hash is in another slot: the caller checks it, and changes the count
# (_CLEARED_ROWS_LUA).
_CLEAR_BUCKET_LUA = "local n = redis.call('HLEN', KEYS[1]) if n > 0 then redis.call('UNLINK', KEYS[1]) end return n"


# Standalone Redis: counts and deletes buckets KEYS[3...] at once, only while table ARGV[1]'s
# metadata in the table hash KEYS[1] is still ARGV[2] (else nothing, and -1), its count (in
# KEYS[2]) down by the rows removed in the same script. One script a run of buckets, not one a
# bucket: a drop of a table of 4,096 buckets went at ~13 a second, its time in the client's
# pipeline of 4,096 commands (2026-11-27).
_CLEAR_BUCKETS_LUA = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return -1 end local n = 0 "
    "for i = 3, #KEYS do local k = redis.call('HLEN', KEYS[i]) "
    "if k > 0 then redis.call('UNLINK', KEYS[i]) n = n + k end end "
    "n = -n " + _ADD_COUNT_LUA.replace("ROWS", "2") + " return -n"
)


# Standalone Redis: the fields (8-byte ids) of every bucket KEYS[...], end to end in one string.
_BUCKET_FIELDS_LUA = (
    "local out = {} for i = 1, #KEYS do local f = redis.call('HKEYS', KEYS[i]) "
    "if #f > 0 then out[#out + 1] = table.concat(f) end end return table.concat(out)"
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


# A drop's mark: _MARK_LUA, and the creation token beside the count (KEYS[2]) set to "-", so that
# writes from now on change no count and (on standalone Redis) fail with TableNotFound.
_DROP_MARK_LUA = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then "
    "redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) "
    "if redis.call('HEXISTS', KEYS[2], ARGV[1] .. ':c') == 1 then "
    "redis.call('HSET', KEYS[2], ARGV[1] .. ':c', '-') end "
    "return 1 end return 0"
)


# KEYS[1] the table hash, KEYS[2] the row-count hash, KEYS[3] the dropped set, KEYS[4] the log of
# drops (a stream; all four in one slot): table ARGV[1] and its count removed if its metadata is
# still ARGV[2] (the mark of this drop: another drop may have finished it and a create made a
# new table of that name since), the mark recorded with Redis's time for the sweep, and the drop
# logged (entries numbered "<n>-0" as in redis_logs._LOG_LUA, the newest ARGV[3] or so kept); else nothing.
_DROP_LUA = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end "
    "local t = redis.call('TIME') redis.call('ZADD', KEYS[3], t[1] + t[2] / 1000000, ARGV[2]) "
    "local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1) local n = 1 "
    "if #last > 0 then n = tonumber(string.match(last[1][1], '^(%d+)')) + 1 end "
    "redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], n .. '-0', 'table', ARGV[1], "
    "'t', t[1] .. '.' .. string.format('%06d', tonumber(t[2]))) "
    "redis.call('HDEL', KEYS[2], ARGV[1], ARGV[1] .. ':c') return redis.call('HDEL', KEYS[1], ARGV[1])"
)


# KEYS[1] the dropped set: at most ARGV[2] of its entries older than ARGV[1] seconds (Redis's time).
_DUE_LUA = (
    "local t = redis.call('TIME') "
    "return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t[1] + t[2] / 1000000 - ARGV[1], 'LIMIT', 0, ARGV[2])"
)


class RedisTables(RedisLogs):
    """Tables' metadata, row counts, drops and sweeps (see the module)."""

    def _wrong_size(self, table: str) -> PSError:
        schema = self._meta(table).schema
        return PSError(
            f"table {table!r} in Redis namespace {self.namespace!r} holds rows of the wrong size "
            f"(expected {schema.row_bytes} bytes each): the data does not match its schema"
        )

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
            while len(self._cache) > layout.META_CACHE_TABLES:
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
            fmt = int(d.get("format", 1))
            lifecycle = Lifecycle.from_dict(d.get("lifecycle"))
            change_log = int(d.get("change_log", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise PSError(
                f"metadata of table {table!r} in Redis namespace {self.namespace!r} is unreadable: {exc}"
            ) from None
        token = d["created"] if fmt >= 2 else ""
        return _TableMeta(raw, schema, nb, prefix, token, bool(d.get("dropping")), fmt >= 3, lifecycle, change_log)

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
                self._listpack.ensure(schema.row_bytes + STAMP_BYTES, f"table {schema.name!r}")
        nb = buckets_for(schema.expected_rows, self.rows_per_bucket, self.num_buckets)
        # "created": a token of this creation, so that a table dropped and created again, even with
        # the same schema, has other metadata (a write checks it: see _WRITE_LUA) and other bucket
        # keys (its prefix holds the token: see the module doc). 48 bits: a table created again
        # gets its predecessor's token with odds of 2^-48, and each bucket key is only 13 bytes
        # longer (a 16-byte token took Redis ~1-2 B more a row of 64 B: jemalloc's next class)
        meta = {"format": layout.META_FORMAT, "buckets": nb, "schema": schema.to_dict()}
        if schema.expected_rows:
            meta["expected_rows"] = schema.expected_rows
        token = secrets.token_hex(6)
        raw = json.dumps({**meta, "created": token}, sort_keys=True).encode()
        for _ in range(layout.CREATE_TRIES):
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
        raise Contended(
            f"table {schema.name!r} in Redis namespace {self.namespace!r} was dropped or created by others "
            f"{layout.CREATE_TRIES} times while this PS created it; try again"
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
        if not metas or time.monotonic() - self._fresh.at > layout.FRESH_METADATA_S:
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
            widest = max(metas, key=lambda m: m.value_bytes)
            with self._redis():
                self._listpack.ensure(widest.value_bytes, f"{len(metas)} table(s), e.g. {widest.schema.name!r}")

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
        for lo in range(0, len(tables), layout.SCHEMAS_PER_HMGET):
            pipe.hmget(self._meta_key, tables[lo : lo + layout.SCHEMAS_PER_HMGET])
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
        if self._unsure:
            self._settle_counts(list(self._unsure))
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
        if meta.num_buckets > layout.SCAN_BUCKETS_ABOVE:
            with self._redis():
                keys_there = int(self.client.dbsize())
            if keys_there < meta.num_buckets:
                yield from self._scanned_bucket_keys(meta)
                return
        for lo in range(0, meta.num_buckets, layout.PIPELINE_MAX_IDS):
            yield [meta.key(b) for b in range(lo, min(lo + layout.PIPELINE_MAX_IDS, meta.num_buckets))]

    def _scanned_bucket_keys(self, meta: _TableMeta) -> Iterator[list[bytes]]:
        """The table's bucket keys that exist, by SCAN over every master (see _bucket_key_runs)."""
        prefix = meta.prefix
        # the prefix holds no glob characters (names are [A-Za-z0-9_.-]: common/names.py); keys of other tables
        # that happen to match (none can: the prefix ends in "{<table>.") are filtered anyway
        run: set[bytes] = set()  # SCAN may return a key twice
        with self._redis():
            for key in self.client.scan_iter(match=prefix + b"*", count=layout.SCAN_COUNT):
                key = _raw(key)
                number = key[len(prefix) : -1]
                if key.endswith(b"}") and number.isdigit() and int(number) < meta.num_buckets:
                    run.add(key)
                if len(run) >= layout.PIPELINE_MAX_IDS:
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

    def _settle_counts(self, tables: list[str]) -> None:
        """Recount the tables whose count a write cut off midway may have left wrong (marked by
        RedisStore._count_unsure_if_cut): the rows of such a write land when the link is back,
        uncounted (tests/test_network_faults.py). A table stays marked, and is recounted at each
        count read, until the mark is RECOUNT_AFTER_S old: a write still in flight lands by then."""
        now = time.monotonic()
        for table in tables:
            with self._cache_lock:
                since = self._unsure.get(table)
            if since is None:
                continue
            n: int | None = None
            try:
                meta = self._meta(table)
                with self._redis():
                    before = self.client.hget(self._rows_key, table)
                n = self._recount(meta, replace=True)
            except TableNotFound:
                pass
            with self._cache_lock:
                # settled, unless young or a write was cut off again meanwhile
                if self._unsure.get(table) == since and (n is None or now - since >= layout.RECOUNT_AFTER_S):
                    del self._unsure[table]
            if n is not None:
                log.info(
                    "table %r in Redis namespace %r: a write cut off midway may have left its row count "
                    "wrong; recounted %d rows from its buckets (it said %s)",
                    table,
                    self.namespace,
                    n,
                    int(before) if before is not None else "none",
                )

    def _recount(self, meta: _TableMeta, wrong: bool = False, replace: bool = False) -> int:
        """Count a table without a row count (created by an older version) and keep the count;
        with wrong, replace a kept count that cannot be right (below 0: e.g. on Cluster, rows a
        PS wrote and was killed before counting, deleted since); with replace, replace it quietly
        (_settle_counts).

        Writes while it counts are not in the count: it is exact only if none come then."""
        n = sum(sum(lens) for _, lens in self._bucket_lens(meta))
        with self._redis():
            if self.client.hget(self._meta_key, meta.schema.name) != meta.raw:
                raise self._not_found(meta.schema.name)  # dropped (or re-created) meanwhile
            if replace:
                self.client.hset(self._rows_key, meta.schema.name, n)
            elif wrong:
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
        if table in self._unsure:
            self._settle_counts([table])
        pipe = self._pipeline()
        pipe.hget(self._meta_key, table)
        pipe.hget(self._rows_key, table)
        raw, n = self._run(pipe)
        if raw is None:
            raise self._not_found(table)
        meta = self._parse_meta(table, _raw(raw))
        return int(n) if n is not None and int(n) >= 0 else self._recount(meta, wrong=n is not None)

    def _add_rows(self, meta: _TableMeta, change: int) -> None:
        """Change the count after the writes, if the table is still meta's creation: not the
        count of a table created since. On standalone Redis a write to a table dropped (or
        created again) meanwhile raises TableNotFound (its rows went to the dropped table's keys,
        which the sweep of dropped tables unlinks); on Cluster it stays quiet, as a write there
        cannot tell whether another PS's write was first."""
        args = [meta.schema.name, meta.token, change]
        counted = self._run_scripted(lambda pipe: self._script(pipe, _WRITTEN_ROWS_LUA, [self._rows_key], args))[0]
        if not int(counted) and not self.cluster:
            raise self._gone(meta.schema.name)

    def _delete_buckets(self, meta: _TableMeta, log_rows: bool = False) -> tuple[int, bool]:
        """Clear the table's buckets while its metadata is still meta.raw, pipeline by pipeline.

        A clear or drop that outlives its table (finished by another PS's drop, perhaps created
        again under the name since) stops rather than remove the new table's rows. On standalone
        Redis a script clears a run of CLEAR_KEYS_PER_SCRIPT buckets, checking the metadata
        first; on Cluster (a script a bucket: the buckets span slots) it is read before each
        pipeline and after the last (a pipeline sent meanwhile clears only keys of the dropped
        table's creation token: see the module doc).

        Args:
            meta: the table's metadata.
            log_rows: log each run's ids in the table's deletion log before it is cleared (a
                clear; a drop is logged as a whole, in the log of drops).

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
            if log_rows:
                self._log_bucket_ids(meta, keys)
            if self.cluster:  # the scripts cannot see the table hash (another slot)
                if not unchanged():
                    return removed, False

                def fill(pipe, keys=keys) -> None:
                    for key in keys:
                        self._script(pipe, _CLEAR_BUCKET_LUA, [key], [name])

            else:

                def fill(pipe, keys=keys) -> None:
                    for lo in range(0, len(keys), layout.CLEAR_KEYS_PER_SCRIPT):
                        run = keys[lo : lo + layout.CLEAR_KEYS_PER_SCRIPT]
                        self._script(pipe, _CLEAR_BUCKETS_LUA, [self._meta_key, self._rows_key, *run], [name, meta.raw])

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

    def _log_bucket_ids(self, meta: _TableMeta, keys: list[bytes]) -> None:
        """Log the ids stored in the buckets `keys` as deleted (their fields, no rows): on
        standalone Redis a script per CLEAR_KEYS_PER_SCRIPT buckets returns them end to end,
        on Cluster an HKEYS a bucket."""
        import numpy as np

        if self.cluster:
            pipe = self._pipeline()
            for key in keys:
                pipe.execute_command("HKEYS", key)
            blob = b"".join(_raw(f) for reply in self._run(pipe) for f in reply)
        else:
            step = layout.CLEAR_KEYS_PER_SCRIPT

            def fill(pipe) -> None:
                for lo in range(0, len(keys), step):
                    self._script(pipe, _BUCKET_FIELDS_LUA, keys[lo : lo + step], [])

            blob = b"".join(_raw(r) for r in self._run_scripted(fill))
        if blob:
            self._log_deleted(meta, np.frombuffer(blob, dtype="<i8").astype(np.int64))

    def clear(self, table: str) -> int:
        """See Store.clear; TableNotFound if the table is dropped while it clears. Each run of
        buckets' ids is logged in the deletion log before the run is cleared (a row pushed in
        between is cleared unlogged: a clear racing pushes leaves no promise about them)."""
        n, whole = self._delete_buckets(self._meta(table), log_rows=True)
        if not whole:
            err = self._not_found(table)
            raise TableNotFound(f"{err} (dropped meanwhile, after {n} of its rows were cleared)")
        return n

    def _mark(self, args: list, pipe) -> None:
        self._script(pipe, _MARK_LUA, [self._meta_key], args)

    def _drop_mark(self, args: list, pipe) -> None:
        self._script(pipe, _DROP_MARK_LUA, [self._meta_key, self._rows_key], args)

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
        for _ in range(layout.CREATE_TRIES):
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
            args = [table, meta.raw, mark]
            if self._run_scripted(functools.partial(self._drop_mark, args))[0]:
                meta = self._parse_any_meta(table, mark)
                break
        else:
            raise Contended(
                f"table {table!r} in Redis namespace {self.namespace!r} kept changing while this PS "
                "dropped it; try again"
            )
        with self._redis():
            counted = self.client.hget(self._rows_key, table)
        if meta.token and counted is not None and int(counted) == 0:
            # an empty table: no bucket to visit (a table of 4,096 buckets took ~50 ms). Keys that
            # a write in flight leaves go with the dropped table's sweep, as on any drop.
            n, whole = 0, True
        else:
            n, whole = self._delete_buckets(meta)
        if whole:
            keys = [self._meta_key, self._rows_key, self._dropped_key, drops_key(self.namespace)]
            drop = [table, meta.raw, str(DROP_LOG_ENTRIES)]
            self._run_scripted(lambda pipe: self._script(pipe, _DROP_LUA, keys, drop))
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
            args = [layout.SWEEP_DROPPED_AFTER_S, layout.SWEEP_TABLES_PER_CALL]
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
                    with self._redis():  # its deletion log and sweep keys, kept until now for readers
                        for key in meta.side_keys:
                            self.client.unlink(key)
                with self._redis():
                    self.client.zrem(self._dropped_key, entry)
        except PSError as exc:
            log.warning(
                "Redis namespace %r: sweeping dropped tables' keys failed (tried again later): %s", self.namespace, exc
            )
        return unlinked

    # -- rows that expire (lifecycle.py; the rows' side: redis_rows.py) -------------------

    def lifecycle(self, table: str) -> Lifecycle:
        """See Store.lifecycle."""
        return self._row_meta(table).lifecycle

    def lifecycles(self) -> dict[str, Lifecycle]:
        """See Store.lifecycles: from every table's metadata, read in one command."""
        return {m.schema.name: m.lifecycle for m in self._all_metas()[0] if m.lifecycle.active}

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> Lifecycle:
        """See Store.set_lifecycle: kept in the table's metadata, which every PS reads."""
        lifecycle = lifecycle.checked(table)._replace(since=now_stamp())
        for _ in range(layout.CREATE_TRIES):
            meta = self._meta(table)
            if not meta.stamped:
                raise InvalidArgument(
                    f"table {table!r} in Redis namespace {self.namespace!r} was created by an older dynemb "
                    "(its rows carry no stamps): its rows cannot expire. Export it, drop it, create it again "
                    "and import it to give it stamps"
                )
            d = json.loads(meta.raw)
            if lifecycle.active:
                d["lifecycle"] = lifecycle.to_dict()
            else:
                d.pop("lifecycle", None)
            raw = json.dumps(d, sort_keys=True).encode()
            if self._run_scripted(functools.partial(self._mark, [table, meta.raw, raw]))[0]:
                self._tables_changed += 1  # threads' kept metadata is void
                return lifecycle if lifecycle.active else Lifecycle()
        raise Contended(f"table {table!r} in Redis namespace {self.namespace!r} kept changing; try again")
