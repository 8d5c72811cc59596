"""The disk store: every table's rows in RocksDB on this machine's disk, a DRAM cache in front.

For rows beyond RAM: a PS whose rows (with their optimizer state) live on local SSD, its memory
near its cache setting rather than the rows' size (docs/ps.md, "The disk backend"). The layout
(disk_layout.py): one key range per table, keys of 12 bytes (table number, id), values the
row's bytes and, where rows expire, their stamp. Settings (disk_config.py): `disk:///dir?
cache_bytes=...&sync=ack|<ms>&compression=none|lz4`.

Every write is a WriteBatch (one per 65,536 rows) through RocksDB's write-ahead log: rows, the
table's row count and its log entries (deletion and change logs, disk_log.py) together, so a
crash leaves them in agreement. A table's writes hold its lock (the count needs to know which ids are new, and a
drop must not let a write land after it), reads hold none. Durability: sync=ack fsyncs the WAL
before a write is acknowledged (outside the lock, so concurrent writers share fsyncs);
sync=<ms> has a thread fsync it every that many ms. Either way every write is in the WAL file
in the OS before it is acknowledged, so kill -9 loses nothing; a power loss loses nothing with
ack, and up to the last <ms> of acknowledged writes otherwise. A restart replays the WAL and
serves at once: no load step.

What stays in memory: each table's record (schema, lifecycle, count, its logs' two cursors) and
the cache (cache_bytes): each table's pool of hot rows (disk_cache.py, write-through, so a pooled
row needs no read of RocksDB at all) and a small block cache; plus RocksDB's index and bloom
filter blocks (~1.5 bytes a row) and its memtables (64 MiB each, up to two per column family).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from dynemb.common.arrays import unique
from dynemb.ps_server import native
from dynemb.ps_server.backends import disk_import, disk_load
from dynemb.ps_server.backends.base import Store, check_same_schema, rows_out
from dynemb.ps_server.backends.disk_cache import PoolBudget, RowPool
from dynemb.ps_server.backends.disk_config import (
    LOGS_CF,
    POOL_SHARE,
    ROWS_CF,
    DiskConfig,
    parse_disk_url,
    rocksdb_options,
)
from dynemb.ps_server.backends.disk_layout import (
    MAX_TABLE_NUMBER,
    cursor_of_key,
    decode_values,
    ids_of_keys,
    key_of_cursor,
    row_keys,
    row_values,
    table_prefix,
    table_range,
)
from dynemb.ps_server.backends.disk_log import CHANGES, DELETIONS, DiskIdLog, DropLog
from dynemb.ps_server.backends.id_log import LOG_MAX_IDS, parse_cursor
from dynemb.ps_server.change_log import Changes, checked_max_ids, no_change_log
from dynemb.ps_server.codec import last_occurrence, rows_for_table
from dynemb.ps_server.errors import BackendUnavailable, InvalidArgument, PSError, TableNotFound
from dynemb.ps_server.lifecycle import STAMP_DTYPE, Cutoff, Deletions, Drops, Lifecycle, SweepSlice, now_stamp
from dynemb.ps_server.schema import TableSchema

log = logging.getLogger("dynemb.ps")

FORMAT = b"dynemb-disk-1"  # the layout's version, checked at open
_FORMAT_KEY = b"format"
_NEXT_KEY = b"next_table"
_TABLE = b"table/"
_COUNT = b"count/"
_SWEEP = b"sweep/"
_DEAD = b"dead/"  # numbers of tables dropped whose rows are still being deleted
# rows a scan step (clear, export) reads at once
_SCAN_ROWS = 65_536
# ids one multi-get or WriteBatch takes: bounds the Python lists of keys and values a call makes
# (~150 B a row) whatever the request's size; a push of more is several batches, one ack
_CHUNK = 65_536
# keys from which a multi-get is split in _GET_PARTS, all but one on reader threads
_SPLIT_GET = 2048
_GET_PARTS = 4


class _DiskTable:
    """One table's record in memory; its rows are in RocksDB."""

    def __init__(self, store: DiskStore, schema: TableSchema, number: int, record: dict, count: int) -> None:
        self.schema = schema
        self.number = number
        self.lock = threading.Lock()
        self.lifecycle = Lifecycle.from_dict(record.get("lifecycle"))
        self.change_log = int(record.get("change_log", 0))
        self.count = count
        self.dropped = False
        self.expired_reads = 0
        db, logs, handle = store._db, store._logs, store._logs_h
        self.pool = RowPool(schema.row_bytes, store._budget)
        self.deletions = DiskIdLog(db, logs, handle, number, DELETIONS, LOG_MAX_IDS)
        self.changes = DiskIdLog(db, logs, handle, number, CHANGES, self.change_log or LOG_MAX_IDS)

    def record(self) -> bytes:
        """What the table's meta key holds."""
        schema = dict(self.schema.to_dict(), expected_rows=self.schema.expected_rows)
        return json.dumps(
            {
                "number": self.number,
                "schema": schema,
                "lifecycle": self.lifecycle.to_dict(),
                "change_log": self.change_log,
            }
        ).encode()

    def count_key(self) -> bytes:
        return _COUNT + table_prefix(self.number)

    def stamp(self) -> int | None:
        """The stamp a row written now carries (None: rows of this table carry none)."""
        return now_stamp() if self.lifecycle.active else None

    def pooled_or_stored(self, store: DiskStore, ids: np.ndarray) -> np.ndarray:
        """Which of ids hold a row: the pooled ones without a read, the rest by one multi-get."""
        found = self.pool.pooled(ids)
        rest = np.flatnonzero(~found)
        if len(rest):
            found[rest] = store._stored(row_keys(self.number, ids[rest]))
        return found


class DiskStore(Store):
    """Every table in one RocksDB directory (see the module doc).

    Args:
        config: the settings, or a `disk://` URL (disk_config.parse_disk_url).

    Raises:
        InvalidArgument: a bad URL or setting (named), or a directory another program's database
            or another layout version holds.
        BackendUnavailable: the directory cannot be opened (another PS holds it, or a disk error).
    """

    kind = "disk"

    def __init__(self, config: DiskConfig | str) -> None:
        import rocksdict as rd

        self.config = parse_disk_url(config) if isinstance(config, str) else config
        self.path = Path(self.config.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendUnavailable(f"disk backend {self.path}: cannot make the directory ({exc})") from None
        self._options, families, self._caches = rocksdb_options(self.config)
        self._rows_options = families[ROWS_CF]  # load_sorted's files are written with them
        self._budget = PoolBudget(int(self.config.cache_bytes * POOL_SHARE))
        self._dropped_lookups = [0, 0]  # pool hits and misses of tables dropped since the store opened
        try:
            # Any: rocksdict's stubs type keys and values as any of str/int/float/bytes (raw mode: bytes)
            self._db: Any = rd.Rdict(str(self.path), self._options, column_families=families)
        except Exception as exc:  # rocksdict raises a plain Exception with RocksDB's status text
            text = str(exc)
            if "lock" in text.lower():
                raise BackendUnavailable(
                    f"disk backend {self.path}: another process holds its database (RocksDB's LOCK): "
                    "one PS per directory"
                ) from None
            raise BackendUnavailable(f"disk backend {self.path}: RocksDB cannot open it ({text[:300]})") from None
        disk_load.remove_spills(self.path)  # of loads cut short: RocksDB's LOCK keeps any other PS out
        self._rows: Any = self._db.get_column_family(ROWS_CF)
        self._rows_h: Any = self._db.get_column_family_handle(ROWS_CF)
        self._logs: Any = self._db.get_column_family(LOGS_CF)
        self._logs_h: Any = self._db.get_column_family_handle(LOGS_CF)
        self._wo = rd.WriteOptions()  # the WAL sync is separate (_durable): concurrent writers share it
        self._rd = rd
        self._scatter = native.id_index().scatter
        self._reader = ThreadPoolExecutor(_GET_PARTS - 1, thread_name_prefix="disk-read")
        self._lock = threading.Lock()  # creates and drops; taken after a table's lock, never before
        self._closed = False
        self._check_format()
        stored_next = self._db.get(_NEXT_KEY)
        self._next = int.from_bytes(stored_next, "little") if stored_next else 1
        self._tables: dict[str, _DiskTable] = {}
        self._load_tables()
        self._drop_log = DropLog(self._db)
        self._stopping = threading.Event()
        self._purge_wake = threading.Event()
        self._purge_thread = threading.Thread(target=self._purge_loop, name="disk-purge", daemon=True)
        self._purge_thread.start()
        self._sync_thread: threading.Thread | None = None
        if self.config.sync_ms:
            self._sync_thread = threading.Thread(target=self._sync_loop, name="disk-wal-sync", daemon=True)
            self._sync_thread.start()
        rows = sum(t.count for t in self._tables.values())
        log.info(
            "disk store %s: %d tables (%d rows), cache %d MiB, sync %s, compression %s",
            self.path,
            len(self._tables),
            rows,
            self.config.cache_bytes >> 20,
            self.config.sync,
            self.config.compression,
        )

    # -- opening and durability ---------------------------------------------------------------

    def _check_format(self) -> None:
        stored = self._db.get(_FORMAT_KEY)
        if stored is None:
            if any(True for _ in islice(self._db.keys(), 1)):
                self._db.close()
                raise InvalidArgument(f"disk backend {self.path}: holds a database that is not a dynemb disk store")
            self._db.put(_FORMAT_KEY, FORMAT)
        elif stored != FORMAT:
            self._db.close()
            raise InvalidArgument(
                f"disk backend {self.path}: layout {stored[:40]!r} is not {FORMAT.decode()} "
                "(written by another version)"
            )

    def _load_tables(self) -> None:
        for key, value in self._db.items(from_key=_TABLE):
            if not key.startswith(_TABLE):
                break
            record = json.loads(value)
            d = record["schema"]
            schema = TableSchema.from_dict(d)
            if d.get("expected_rows"):
                schema = dataclasses.replace(schema, expected_rows=int(d["expected_rows"]))
            number = int(record["number"])
            stored = self._db.get(_COUNT + table_prefix(number))
            count = int.from_bytes(stored, "little", signed=True) if stored else 0
            if self._db.get(disk_load.marker(number)) is not None:
                count = disk_load.recount(self, number, _COUNT + table_prefix(number))
                log.warning(
                    "disk store %s: table %r's load was cut short; %d rows counted", self.path, schema.name, count
                )
            self._tables[schema.name] = _DiskTable(self, schema, number, record, count)

    def _write(self, batch) -> None:
        """Apply batch (not yet synced: see _durable); BackendUnavailable naming RocksDB's error."""
        if self._closed:
            raise BackendUnavailable(f"disk backend {self.path}: the store is closed")
        try:
            self._db.write(batch, self._wo)
        except Exception as exc:  # disk full, I/O error: RocksDB's status text
            raise BackendUnavailable(f"disk backend {self.path}: write failed ({str(exc)[:300]})") from None

    def _durable(self) -> None:
        """Return once what was written so far survives a power loss (sync=ack); with sync=<ms>
        the sync thread does it."""
        if not self.config.sync_ms:
            try:
                self._db.flush_wal(True)
            except Exception as exc:
                raise BackendUnavailable(f"disk backend {self.path}: WAL sync failed ({str(exc)[:300]})") from None

    def _sync_loop(self) -> None:
        while not self._stopping.wait(self.config.sync_ms / 1000):
            try:
                self._db.flush_wal(True)
            except Exception:  # noqa: BLE001 - logged; the next tick tries again
                log.exception("disk store %s: WAL sync failed", self.path)

    def _batch(self):
        return self._rd.WriteBatch(raw_mode=True)

    def _table(self, name: str) -> _DiskTable:
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFound(f"table {name!r} does not exist on this PS (disk store {self.path})") from None

    def _live(self, t: _DiskTable) -> _DiskTable:
        """t, for a write under its lock: TableNotFound if it was dropped meanwhile."""
        if t.dropped:
            raise TableNotFound(f"table {t.schema.name!r} was dropped on this PS (disk store {self.path})")
        return t

    # -- tables -------------------------------------------------------------------------------

    def create_table(self, schema: TableSchema) -> bool:
        """See Store.create_table; expected_rows is kept with the table (RocksDB needs no sizing)."""
        with self._lock:
            have = self._tables.get(schema.name)
            if have is None:
                if self._next > MAX_TABLE_NUMBER:
                    raise InvalidArgument(
                        f"disk backend {self.path}: {MAX_TABLE_NUMBER} tables were made here, the most"
                    )
                t = _DiskTable(self, schema, self._next, {}, 0)
                batch = self._batch()
                batch.put(_TABLE + schema.name.encode(), t.record())
                batch.put(t.count_key(), (0).to_bytes(8, "little"))
                batch.put(_NEXT_KEY, (self._next + 1).to_bytes(8, "little"))
                self._write(batch)
                self._next += 1
                self._tables[schema.name] = t
        if have is None:
            self._durable()
            return True
        check_same_schema(have.schema, schema)
        return False

    def schema(self, table: str) -> TableSchema:
        """See Store.schema."""
        return self._table(table).schema

    def list_tables(self) -> list[TableSchema]:
        """See Store.list_tables."""
        tables = dict(self._tables)
        return [tables[name].schema for name in sorted(tables)]

    def num_rows(self, table: str) -> int:
        """See Store.num_rows: the count every write keeps in its batch."""
        return self._table(table).count

    def drop_table(self, table: str) -> int | None:
        """See Store.drop_table: the table's number marked dead, its rows and logs deleted by the
        purge thread by point deletes, a step at a time; the drop is logged (drops()).

        The table's lock is taken before the store's (a write in flight, a bulk load's minute
        included, ends first), so creates and drops of other tables go on meanwhile."""
        while True:
            with self._lock:
                t = self._tables.get(table)
            if t is None:
                return None
            with t.lock, self._lock:
                if self._tables.get(table) is not t:
                    continue  # dropped meanwhile (and maybe made again: that one is dropped next)
                del self._tables[table]
                t.dropped = True
                t.pool.close()
                self._dropped_lookups[0] += t.pool.hits
                self._dropped_lookups[1] += t.pool.misses
                batch = self._batch()
                for key in (_TABLE + table.encode(), t.count_key(), _SWEEP + table.encode()):
                    batch.delete(key)
                for kind in (DELETIONS, CHANGES):
                    batch.delete(b"logend/" + table_prefix(t.number) + kind)
                # its rows and logs are deleted by the purge thread: no key of its number is read again
                batch.put(_DEAD + table_prefix(t.number), b"")
                self._drop_log.append(batch, table, time.time())
                self._write(batch)
            break
        self._durable()
        self._purge_wake.set()
        return t.count

    def drops(self, after: str = "", limit: int = 1000) -> Drops:
        """See Store.drops: cursors count the drops logged before them."""
        return self._drop_log.read(parse_cursor(after, "the log of dropped tables"), max(1, limit))

    # -- rows ---------------------------------------------------------------------------------

    def _get(self, keys: list[bytes]) -> list:
        """The values of keys (None: absent): one multi-get, or _GET_PARTS at once for many keys."""
        try:
            if len(keys) < _SPLIT_GET:
                return self._rows.get(keys)
            # the binding lets go of the GIL: the parts' block reads overlap
            step = -(-len(keys) // _GET_PARTS)
            rest = [self._reader.submit(self._rows.get, keys[s : s + step]) for s in range(step, len(keys), step)]
            got = self._rows.get(keys[:step])
            for part in rest:
                got += part.result()
            return got
        except Exception as exc:
            raise BackendUnavailable(f"disk backend {self.path}: read failed ({str(exc)[:300]})") from None

    def _stored(self, keys: list[bytes]) -> np.ndarray:
        """Which of keys hold a row (one multi-get)."""
        return np.fromiter((v is not None for v in self._get(keys)), dtype=bool, count=len(keys))

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See Store.pull; rows of ids not found are left as they were in out."""
        rows = rows_out(out, len(ids), self.schema(table))
        found = np.ones(len(ids), dtype=bool)
        found[self.pull_into(table, ids, rows)] = False
        return rows, found

    def pull_into(self, table: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """See Store.pull_into: pooled rows from memory, the rest by a multi-get per _CHUNK ids.
        In a table whose rows expire, expired rows count as absent, and rows whose stamp is older
        than the touch interval are stamped again."""
        t = self._table(table)
        out = rows_out(out, len(ids), t.schema)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        missing = [
            s + self._pull_chunk(t, ids[s : s + _CHUNK], out[s : s + _CHUNK]) for s in range(0, len(ids), _CHUNK)
        ]
        return np.concatenate(missing) if missing else np.zeros(0, dtype=np.int64)

    def _read_rows(self, t: _DiskTable, ids: np.ndarray, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored rows of ids into buf at their positions: the pooled ones copied in one
        compiled call, the rest read by one multi-get of their distinct ids and admitted.

        Args:
            t: the table.
            ids: int64, contiguous (may repeat).
            buf: len(ids) rows of the table's row bytes (any dtype); rows of ids not found are
                left as they were.

        Returns:
            (found: bool per id, stamps: uint32 per id, 0 where a row carries none or is absent).
        """
        rb = t.schema.row_bytes
        n = len(ids)
        found = np.zeros(n, dtype=bool)
        stamps = np.zeros(n, dtype=STAMP_DTYPE)
        hit_at, hit_stamps, since = t.pool.gather(ids, buf)
        found[hit_at] = True
        stamps[hit_at] = hit_stamps
        miss_at = np.flatnonzero(~found)
        if not len(miss_at):
            return found, stamps
        # a Zipf batch repeats its ids: each is read once
        wanted, inverse = np.unique(ids[miss_at], return_inverse=True)
        got, raw, got_stamps = decode_values(self._get(row_keys(t.number, wanted)), rb)
        if not got.any():
            return found, stamps
        raw = np.ascontiguousarray(raw)
        t.pool.admit(wanted[got], raw, got_stamps, since)
        row_of = np.cumsum(got) - 1  # a wanted id's row in raw
        sel = got[inverse]
        at = miss_at[sel]
        take = row_of[inverse[sel]]
        self._scatter(buf, rb, at, raw, take)
        found[at] = True
        stamps[at] = got_stamps[take]
        return found, stamps

    def _pull_chunk(self, t: _DiskTable, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """pull_into for one chunk of ids; the positions of those not found."""
        lifecycle = t.lifecycle
        if not lifecycle.active and out.flags.c_contiguous:  # every row found served as it is: into out
            found, _ = self._read_rows(t, ids, out)
            return np.flatnonzero(~found)
        buf = np.empty((len(ids), t.schema.row_bytes), dtype=np.uint8)
        found, stamps = self._read_rows(t, ids, buf)
        at = np.flatnonzero(found)
        raw, stamps = buf[at], stamps[at]
        if len(at):
            stamps = np.maximum(stamps, lifecycle.since)
            expired = stamps < lifecycle.expired_before()
            stale = ~expired & (stamps < lifecycle.refresh_before())
            if stale.any():
                # A row a sweep may delete is stale: read again under the lock, stamped, and
                # taken as it is then (deleted by a sweep in between: absent; pushed: the new row)
                where = np.flatnonzero(stale)
                still, now_rows = self._restamp(t, ids[at[where]])
                raw[where[still]] = now_rows
                gone = np.zeros(len(at), dtype=bool)
                gone[where[~still]] = True
                found[at[gone]] = False
                expired |= gone
            if expired.any():
                t.expired_reads += int((expired & ~stale).sum())
                found[at[expired]] = False
                at, raw = at[~expired], raw[~expired]
        if len(at) == len(ids):
            out[:] = raw.view(t.schema.np_dtype).reshape(out.shape)
        elif len(at):
            out[at] = raw.view(t.schema.np_dtype).reshape(len(at), -1)
        return np.flatnonzero(~found)

    def _restamp(self, t: _DiskTable, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stamp the stored ones of ids as used now (their rows read under the lock, so a write
        meanwhile is kept); returns (which of ids are stored, their rows' bytes)."""
        rb = t.schema.row_bytes
        with t.lock:
            buf = np.empty((len(ids), rb), dtype=np.uint8)
            found, _ = self._read_rows(t, ids, buf)
            raw = buf[found]
            if t.dropped or not found.any():
                return found, raw
            batch = self._batch()
            kept = ids[found]
            stamp = now_stamp()
            for key, value in zip(row_keys(t.number, kept), row_values(raw, rb, stamp)):
                batch.put(key, value, self._rows_h)
            self._write(batch)
            distinct, first = np.unique(kept, return_index=True)
            t.pool.write(distinct, raw[first], stamp)
        return found, raw

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """See Store.push: the distinct ids (a repeated one's last row), in key order, read first
        (the count needs the new ones; bloom filters answer most new ids without a read), then
        written in a WriteBatch per _CHUNK (a PS killed between two has written some of an
        unacknowledged push, which its client sends again). Key order: each memtable insert
        starts where the last ended (profiled: random-order inserts were ~30% of a push's time
        in skip-list walks)."""
        t = self._table(table)
        n = len(ids)
        if n == 0:
            return 0
        rows = rows_for_table(rows, t.schema, n)
        pushed = ids = np.ascontiguousarray(ids, dtype=np.int64)
        uniq, last = last_occurrence(ids)
        if len(uniq) < n or not np.array_equal(uniq, ids):
            ids, rows = uniq, rows[last]
        with t.lock:
            self._live(t)
            for start in range(0, len(ids), _CHUNK):
                batch = self._batch()
                if t.change_log and start == 0:  # logged with the first part, before any row
                    t.changes.append(batch, pushed)  # as pushed, repeats and all (as every store logs them)
                part = slice(start, start + _CHUNK)
                keys = row_keys(t.number, ids[part])
                stamp = t.stamp()
                values = row_values(rows[part], t.schema.row_bytes, stamp)
                t.pool.hold(ids[part])
                try:
                    new = len(keys) - int(t.pooled_or_stored(self, ids[part]).sum())
                    h = self._rows_h
                    for key, value in zip(keys, values):
                        batch.put(key, value, h)
                    batch.put(t.count_key(), (t.count + new).to_bytes(8, "little", signed=True))
                    self._write(batch)
                    t.count += new
                except BaseException:
                    t.pool.forget(ids[part])  # RocksDB may or may not hold the new rows: it answers
                    raise
                raw = np.ascontiguousarray(rows[part]).view(np.uint8).reshape(len(keys), t.schema.row_bytes)
                t.pool.write(ids[part], raw, stamp or 0)
        self._durable()
        return n

    def _remove(self, t: _DiskTable, ids: np.ndarray) -> np.ndarray:
        """Under t.lock: delete the stored ones of ids (distinct), logged; returns them."""
        keys = row_keys(t.number, ids)
        t.pool.hold(ids)
        try:
            stored = t.pooled_or_stored(self, ids)
            gone = ids[stored]
            if len(gone):
                batch = self._batch()
                t.deletions.append(batch, gone)  # in the batch that deletes them
                h = self._rows_h
                for key in (k for k, s in zip(keys, stored.tolist()) if s):
                    batch.delete(key, h)
                batch.put(t.count_key(), (t.count - len(gone)).to_bytes(8, "little", signed=True))
                self._write(batch)
                t.count -= len(gone)
        finally:
            t.pool.forget(ids)
        return gone

    def load_sorted(
        self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]], rows_per_file: int = 1 << 22
    ) -> int:
        """Fill an empty table from RocksDB table files ingested whole (disk_load.py): for a first
        load of many rows. A table that keeps a change log refuses it (the rows would go unlogged);
        rows of a table whose rows expire are stamped now.

        Args:
            table: an existing, empty table.
            chunks: (ids, rows) pairs, ids ascending strictly across all of them.
            rows_per_file: rows a table file holds.

        Returns:
            How many rows were loaded.

        Raises:
            InvalidArgument: the table has rows or keeps a change log, or ids do not ascend.
        """
        return disk_load.load_sorted(self, self._table(table), chunks, rows_per_file)

    def import_rows(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]], replace: bool) -> int:
        """See Store.import_rows: into a table that is empty (once cleared, if replace) and keeps no
        change log, loaded in bulk whatever order the ids come in (disk_import.py: sorted on this
        disk, then table files ingested whole); otherwise pushed. In bulk nothing is visible until
        the last chunk came, then every row at once; a stream that breaks mid-way writes nothing
        (the client's _ImportStream opens it again and sends every chunk from the first, or, past
        the chunks it keeps, says to run the import again)."""
        return disk_import.import_rows(self, table, chunks, replace)

    def delete(self, table: str, ids: np.ndarray) -> int:
        """See Store.delete."""
        ids = unique(np.ascontiguousarray(ids, dtype=np.int64))
        t = self._table(table)
        gone = 0
        with t.lock:
            self._live(t)
            for start in range(0, len(ids), _CHUNK):
                gone += len(self._remove(t, ids[start : start + _CHUNK]))
        self._durable()
        return gone

    def _scan_options(self, number: int) -> Any:
        """Read options for a scan of table `number`'s keys: bounded by its range, and around the
        cache (a scan would evict the hot rows)."""
        ro = self._rd.ReadOptions()
        ro.set_iterate_upper_bound(table_range(number)[1])
        ro.fill_cache(False)  # type: ignore[call-arg]  # the stub lacks the flag the binding takes
        return ro

    def _scan(self, t: _DiskTable, start: bytes, max_rows: int) -> tuple[list[bytes], list[bytes], bytes | None]:
        """(keys, values, the key after them or None) of up to max_rows rows of t from key start,
        in key order, read around the cache (a scan would evict the hot rows)."""
        ro = self._scan_options(t.number)
        got = list(islice(self._rows.items(from_key=start, read_opt=ro), max_rows + 1))
        after = got.pop()[0] if len(got) > max_rows else None
        keys = [k for k, _ in got]
        values = [v for _, v in got]
        return keys, values, after

    def clear(self, table: str) -> int:
        """See Store.clear: in steps of _SCAN_ROWS rows, each logged as deleted and deleted in one
        batch with the count, then the table's pool emptied."""
        t = self._table(table)
        with t.lock:
            self._live(t)
            n = t.count
            start: bytes | None = table_prefix(t.number)
            while start is not None:
                keys, _, start = self._scan(t, start, _SCAN_ROWS)
                if keys:
                    batch = self._batch()
                    t.deletions.append(batch, ids_of_keys(keys))
                    for key in keys:
                        batch.delete(key, self._rows_h)
                    t.count = max(0, t.count - len(keys))
                    batch.put(t.count_key(), t.count.to_bytes(8, "little", signed=True))
                    self._write(batch)
            if t.count:  # a count off by a write cut short in an older version: what is there is none
                batch = self._batch()
                batch.put(t.count_key(), (0).to_bytes(8, "little"))
                self._write(batch)
                t.count = 0
            t.pool.clear()
        self._durable()
        return n

    def _purge_loop(self) -> None:
        """Delete the rows and logs of dropped tables (their numbers under _DEAD), a step at a time."""
        while not self._stopping.is_set():
            dead = [k for k, _ in islice(self._db.items(from_key=_DEAD), 1000) if k.startswith(_DEAD)]
            if not dead:
                self._purge_wake.wait(60)
                self._purge_wake.clear()
                continue
            for key in dead:
                number = int.from_bytes(key[len(_DEAD) :], "big")
                for family, handle in ((self._rows, self._rows_h), (self._logs, self._logs_h)):
                    while not self._stopping.is_set():
                        ro = self._scan_options(number)
                        keys = list(islice(family.keys(from_key=table_prefix(number), read_opt=ro), _SCAN_ROWS))
                        if not keys:
                            break
                        batch = self._batch()
                        for k in keys:
                            batch.delete(k, handle)
                        self._write(batch)
                if self._stopping.is_set():
                    return
                self._db.delete(key)

    def export(self, table: str, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """See Store.export: ids ascending; each chunk a fresh scan from where the last stopped,
        so rows changed during the export are read as they are then."""
        t = self._table(table)
        start: bytes | None = table_prefix(t.number)
        while start is not None:
            keys, values, start = self._scan(t, start, rows_per_chunk)
            if not keys:
                return
            _, raw, _ = decode_values(values, t.schema.row_bytes)
            yield (
                ids_of_keys(keys),
                np.ascontiguousarray(raw).view(t.schema.np_dtype).reshape(len(keys), t.schema.width),
            )

    # -- rows that expire ---------------------------------------------------------------------

    def lifecycle(self, table: str) -> Lifecycle:
        """See Store.lifecycle."""
        return self._table(table).lifecycle

    def _save_record(self, t: _DiskTable, batch=None) -> None:
        batch = batch or self._batch()
        batch.put(_TABLE + t.schema.name.encode(), t.record())
        self._write(batch)

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> Lifecycle:
        """See Store.set_lifecycle: rows written before it carry no stamp and count as stamped at its `since`."""
        lifecycle = lifecycle.checked(table)._replace(since=now_stamp())
        t = self._table(table)
        with t.lock:
            self._live(t)
            t.lifecycle = lifecycle
            self._save_record(t)
        self._durable()
        return lifecycle

    def touch(self, table: str, ids: np.ndarray) -> int:
        """See Store.touch."""
        t = self._table(table)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not t.lifecycle.active:
            return int(t.pooled_or_stored(self, ids).sum())
        return int(self._restamp(t, ids)[0].sum())

    def _stamped_slice(self, t: _DiskTable, cursor: int, max_rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(next cursor or 0, ids, stamps with `since` applied) of up to max_rows rows from cursor."""
        keys, values, after = self._scan(t, key_of_cursor(t.number, cursor), max_rows)
        _, _, stamps = decode_values(values, t.schema.row_bytes)
        stamps = np.maximum(stamps, t.lifecycle.since).astype(STAMP_DTYPE)
        return (cursor_of_key(after) if after else 0), ids_of_keys(keys), stamps

    def sweep_slice(self, table: str, cursor: int, cutoff: Cutoff, max_rows: int) -> SweepSlice:
        """See Store.sweep_slice: the cursor is the next row's id (offset by one); the slice holds
        the table's lock, so a write or touch meanwhile waits and is kept."""
        t = self._table(table)
        with t.lock:
            if t.dropped or not t.lifecycle.active:
                return SweepSlice(0, 0, np.zeros(0, np.int64))
            after, ids, stamps = self._stamped_slice(t, cursor, max_rows)
            due = cutoff.due(stamps, ids)
            deleted = self._remove(t, ids[due]) if due.any() else np.zeros(0, np.int64)
            kept = stamps[~due]
            return SweepSlice(after, len(ids), deleted, int(kept.min()) if len(kept) else 0)

    def stamps_slice(self, table: str, cursor: int, max_rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        """See Store.stamps_slice."""
        t = self._table(table)
        if not t.lifecycle.active:
            return 0, np.zeros(0, np.int64), np.zeros(0, STAMP_DTYPE)
        return self._stamped_slice(t, cursor, max_rows)

    def deletions(self, table: str, after: str = "", limit: int = 65536) -> Deletions:
        """See Store.deletions: cursors count the ids logged before them."""
        t = self._table(table)
        return t.deletions.read(parse_cursor(after, f"table {table!r}"), max(1, limit))

    def expired_reads(self, table: str) -> int:
        """Pulls of rows found expired (counted as absent) since the store opened."""
        return self._table(table).expired_reads

    def record_sweep(self, table: str, result: dict) -> None:
        """See Store.record_sweep (kept in the database)."""
        self._db.put(_SWEEP + table.encode(), json.dumps(result).encode())

    def last_sweep(self, table: str) -> dict | None:
        """See Store.last_sweep."""
        stored = self._db.get(_SWEEP + table.encode())
        return json.loads(stored) if stored else None

    # -- the change log -----------------------------------------------------------------------

    def change_log(self, table: str) -> int:
        """See Store.change_log."""
        return self._table(table).change_log

    def set_change_log(self, table: str, max_ids: int) -> int:
        """See Store.set_change_log: a log kept goes on (its cursors stay), resized."""
        max_ids = checked_max_ids(table, max_ids)
        t = self._table(table)
        with t.lock:
            self._live(t)
            batch = self._batch()
            if t.change_log and not max_ids:  # readers across the time it is off: a gap
                t.changes.skip(batch)
            t.change_log = max_ids
            if max_ids:
                t.changes.max_ids = max_ids
            self._save_record(t, batch)
        self._durable()
        return max_ids

    def changes(self, table: str, after: str = "", limit: int = 65536) -> Changes:
        """See Store.changes: cursors count the ids logged before them."""
        t = self._table(table)
        at = parse_cursor(after, f"table {table!r}", "change log")
        if not t.change_log:
            raise no_change_log(table)
        return Changes(*t.changes.read(at, max(1, limit)))

    # -- the store ----------------------------------------------------------------------------

    def ping(self) -> None:
        """See Store.ping: the store is open."""
        if self._closed:
            raise BackendUnavailable(f"disk backend {self.path}: the store is closed")

    def lost_data(self) -> str:
        """See Store.lost_data: the database's CURRENT file deleted under this process (the
        directory removed by hand)."""
        if self._closed or (self.path / "CURRENT").exists():
            return ""
        return f"the disk store's database in {self.path} is gone (its CURRENT file was deleted) while this PS runs"

    def statistics(self) -> dict[str, int]:
        """RocksDB's ticker counts (name -> COUNT: block reads, cache hits and misses, bloom
        filter checks...), for benches and metrics."""
        counts: dict[str, int] = {}
        for line in (self._options.get_statistics() or "").splitlines():
            name, sep, rest = line.partition(" COUNT : ")
            if sep and rest.strip().isdigit():
                counts[name.strip()] = int(rest)
        return counts

    def engine_stats(self) -> dict[str, float]:
        """See Store.engine_stats: RocksDB's counts since the store opened, and its state now."""
        if self._closed:
            return {}
        counts = self.statistics()
        rows = self._rows
        tables = list(self._tables.values())
        return {
            # the "row" cache: the tables' pools of hot rows (disk_cache.py)
            "row_cache_hit": self._dropped_lookups[0] + sum(t.pool.hits for t in tables),
            "row_cache_miss": self._dropped_lookups[1] + sum(t.pool.misses for t in tables),
            "block_cache_hit": counts.get("rocksdb.block.cache.hit", 0),
            "block_cache_miss": counts.get("rocksdb.block.cache.miss", 0),
            "disk_bytes": self.disk_bytes(),
            "pending_compaction_bytes": rows.property_int_value("rocksdb.estimate-pending-compaction-bytes") or 0,
            "running_compactions": self._db.property_int_value("rocksdb.num-running-compactions") or 0,
            "compaction_read_bytes": counts.get("rocksdb.compact.read.bytes", 0),
            "compaction_write_bytes": counts.get("rocksdb.compact.write.bytes", 0),
            "write_stall_seconds": counts.get("rocksdb.stall.micros", 0) / 1e6,
        }

    def disk_bytes(self) -> int:
        """Bytes of the database's files (tables, WAL, manifests) on disk."""
        total = 0
        for entry in os.scandir(self.path):
            with contextlib.suppress(FileNotFoundError):  # a file compaction deleted meanwhile
                total += entry.stat().st_size if entry.is_file() else 0
        return total

    def compact(self) -> None:
        """Flush the memtables and compact every column family (benches: the settled size)."""
        for family in (self._db, self._rows, self._logs):
            family.flush()
        self._rows.compact_range(None, None)

    def close(self) -> None:
        """Sync the WAL and close the database (idempotent)."""
        if self._closed:
            return
        self._stopping.set()
        self._purge_wake.set()
        for thread in (self._sync_thread, self._purge_thread):
            if thread is not None:
                thread.join(timeout=30)
        try:
            self._db.flush_wal(True)
        except PSError:
            raise
        except Exception:  # noqa: BLE001 - closing anyway
            log.exception("disk store %s: WAL sync at close failed", self.path)
        self._closed = True
        self._reader.shutdown()
        # every object that holds a column family keeps RocksDB open (and its LOCK held): let go of all
        self._tables = {}
        del self._rows, self._logs, self._rows_h, self._logs_h, self._drop_log
        self._db.close()
