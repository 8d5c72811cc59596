"""The embedded store: every table in this process's memory, on numpy arrays.

The default backend, for a single PS or for tests and demos: no Redis to run. Each
table is an IdIndex (id → row number, compiled from dynemb/ps_server/csrc/id_index.h) and
one 2-D array of rows that grows by doubling; deleted rows' numbers are reused. A lock
per table keeps concurrent gRPC handlers apart.

Without a directory nothing is written to disk: a restarted PS starts empty. With one
(`embedded:///dir`), `close()` (the PS's drain on SIGTERM) saves every table and a new
store loads them, so a graceful restart keeps every row; a crash loses what changed since
the last save. Use the Redis backend where every write must be durable at once.

A save is one generation, all tables of one moment, switched to as a whole:

    dir/MANIFEST.json                 {"format": 2, "generation": N}: the generation to load
    dir/gen-0000000N/<table>.safetensors   ids, rows, and the schema in the metadata
    dir/gen-0000000N/tables.json      each file's name, size and sha256, written last

The files and tables.json are fsynced, then the directory, then MANIFEST.json is replaced
by rename (and the directory fsynced again): a save cut short (kill -9, power loss) leaves
the previous MANIFEST.json and its generation as they were. The previous generation is
kept beside the new one; at start, a file of the newest generation that is missing, torn or
corrupt (size or sha256 not what tables.json says) is named in the log and the previous
generation loads instead. A directory of the older layout (`dir/<table>.safetensors`, no
MANIFEST.json) still loads; the first save after it moves to generations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dynemb.common.arrays import unique
from dynemb.common.names import inside
from dynemb.ps_server import native
from dynemb.ps_server.backends.base import Store, check_same_schema, rows_out
from dynemb.ps_server.backends.id_index import IdIndex
from dynemb.ps_server.backends.id_log import END, LOG_MAX_IDS, IdLog, parse_cursor
from dynemb.ps_server.change_log import Changes, checked_max_ids, no_change_log
from dynemb.ps_server.codec import rows_for_table
from dynemb.ps_server.errors import PSError, TableNotFound
from dynemb.ps_server.lifecycle import (
    DROP_LOG_ENTRIES,
    STAMP_DTYPE,
    Cutoff,
    Deletions,
    Drop,
    Drops,
    Lifecycle,
    SweepSlice,
    now_stamp,
)
from dynemb.ps_server.schema import TableSchema


class _Table:
    def __init__(self, schema: TableSchema) -> None:
        self.schema = schema
        self.lock = threading.Lock()
        self.index = IdIndex()
        self.rows = np.zeros((16, schema.width), dtype=schema.np_dtype)
        self.used = 0  # row numbers [0, used) were handed out at least once
        self.free: list[np.ndarray] = []  # row numbers freed by deletes
        self.lifecycle = Lifecycle()
        # Kept only while the lifecycle is active (before it, every row counts as stamped at its
        # `since`): each row number's stamp, its id and whether it holds one (any int64 is an id:
        # no id can mark a free row), which a sweep walks.
        self.stamps: np.ndarray | None = None
        self.row_ids: np.ndarray | None = None
        self.row_live: np.ndarray | None = None
        self.log = IdLog()
        self.changes = IdLog()  # the change log (change_log.py), kept while change_log
        self.change_log = 0
        self.published = 0  # the published version it holds, in a serving store (dynemb/publish/apply.py)
        self.published_time = 0.0  # when that version was cut
        self.published_digest = ""  # its manifest's sha256: which version of that number it is
        self.expired_reads = 0  # rows a pull found expired, not yet swept

    def start_stamps(self) -> None:
        """Stamps (0: before `since`) and ids by row number, for a table whose rows now expire."""
        self.stamps = np.zeros(len(self.rows), dtype=STAMP_DTYPE)
        self.row_ids = np.zeros(len(self.rows), dtype=np.int64)
        self.row_live = np.zeros(len(self.rows), dtype=bool)
        ids, where = self.index.items()
        self.row_ids[where] = ids
        self.row_live[where] = True

    def stamp(self, ids: np.ndarray, where: np.ndarray | None = None) -> None:
        """Stamp the rows of ids (stored; where: their row numbers, if known) as used now."""
        if self.stamps is None or self.row_ids is None or self.row_live is None:
            return
        if where is None:
            where = self.index.lookup(ids)
        present = where >= 0
        self.stamps[where[present]] = now_stamp()
        self.row_ids[where[present]] = ids[present]
        self.row_live[where[present]] = True

    def forget(self, ids: np.ndarray) -> np.ndarray:
        """Remove ids from the table; the ids that were stored, each once, logged as deleted."""
        where = self.index.lookup(ids)
        gone = unique(ids[where >= 0])
        self.log.append(gone)  # logged before they go (docs/ps.md, "Rows that expire")
        freed = self.index.remove(gone)
        if len(freed):
            self.free.append(freed)
            if self.row_live is not None:
                self.row_live[freed] = False
        return gone

    def allocate(self, n: int) -> np.ndarray:
        if not self.free and self.used + n <= len(self.rows):  # the usual case, without the lists
            self.used += n
            return np.arange(self.used - n, self.used, dtype=np.int64)
        got = []
        while n and self.free:
            block = self.free.pop()
            take, rest = block[:n], block[n:]
            if len(rest):
                self.free.append(rest)
            got.append(take)
            n -= len(take)
        if n:
            self.reserve(n)
            got.append(np.arange(self.used, self.used + n, dtype=np.int64))
            self.used += n
        return np.concatenate(got) if got else np.zeros(0, dtype=np.int64)

    def reserve(self, n: int) -> None:
        """Room for rows [used, used + n): the rows array grows by doubling."""
        if self.used + n > len(self.rows):
            cap = len(self.rows)
            while cap < self.used + n:
                cap *= 2
            grown = np.zeros((cap, self.schema.width), dtype=self.rows.dtype)
            grown[: self.used] = self.rows[: self.used]
            self.rows = grown
            if self.stamps is not None and self.row_ids is not None and self.row_live is not None:
                self.stamps = np.concatenate([self.stamps, np.zeros(cap - len(self.stamps), STAMP_DTYPE)])
                self.row_ids = np.concatenate([self.row_ids, np.zeros(cap - len(self.row_ids), np.int64)])
                self.row_live = np.concatenate([self.row_live, np.zeros(cap - len(self.row_live), bool)])


log = logging.getLogger("dynemb.ps")
SNAPSHOT_SUFFIX = ".safetensors"
MANIFEST = "MANIFEST.json"
TABLES_FILE = "tables.json"
SAVE_FORMAT = 2
# Tests only: the save stops for good after writing this many table files (a kill -9 lands mid-save).
STALL_ENV = "DYNEMB_TEST_SAVE_STALL_AFTER"


class SnapshotError(PSError):
    """A saved generation that cannot be loaded (a file missing, torn or corrupt)."""


def _gen_dir(directory: Path, generation: int) -> Path:
    return directory / f"gen-{generation:08d}"


def _generations(directory: Path) -> list[int]:
    """Numbers of the generation directories there, complete or not, ascending."""
    found = []
    for path in directory.glob("gen-*"):
        suffix = path.name[4:]
        if suffix.isdigit() and path.is_dir():
            found.append(int(suffix))
    return sorted(found)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, value: dict) -> None:
    """value as path, atomically: written to a temporary name, fsynced, renamed, directory fsynced."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _read_table_file(path: Path) -> tuple[TableSchema, np.ndarray, np.ndarray, dict, dict[str, np.ndarray]]:
    """(schema, ids, rows, metadata, the other tensors: stamps, the deletion log) of one saved
    table; SnapshotError naming the file if it is unreadable."""
    from safetensors import safe_open  # only with a directory

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata()
            schema = TableSchema.from_dict(json.loads(meta["schema"]))
            ids, rows = f.get_tensor("ids"), f.get_tensor("rows")
            extra = {k: f.get_tensor(k) for k in f.keys() if k not in ("ids", "rows")}
    except Exception as exc:  # safetensors raises its own error types for torn headers and data
        raise SnapshotError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if ids.ndim != 1 or rows.shape != (len(ids), schema.width):
        raise SnapshotError(f"{path}: ids {ids.shape} and rows {rows.shape} do not match table {schema.name!r}")
    if "stamps" in extra and extra["stamps"].shape != ids.shape:
        raise SnapshotError(f"{path}: stamps {extra['stamps'].shape} do not match ids {ids.shape}")
    for what, prefix in (("deletion", "deleted"), ("change", "changed")):
        if extra.get(f"{prefix}_ids", np.zeros(0)).shape != extra.get(f"{prefix}_times", np.zeros(0)).shape:
            raise SnapshotError(f"{path}: the {what} log's ids and times do not match")
    return schema, ids, rows, meta, extra


class EmbeddedStore(Store):
    """Every table in this process's memory (see the module doc).

    Args:
        directory: where tables are loaded from at start and saved to by close();
            None keeps nothing on disk.

    Raises:
        SnapshotError: the directory has saved tables but no generation of them loads
            (the message names each file that failed).
    """

    kind = "embedded"
    serves_after_loss = True  # its rows are in this process: a save writes its files again

    def __init__(self, directory: str | None = None) -> None:
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        # tables dropped: (number, name, time), the newest DROP_LOG_ENTRIES; saved with the tables
        self._drops: deque[tuple[int, str, float]] = deque(maxlen=DROP_LOG_ENTRIES)
        self._drops_end = 0
        self._last_sweeps: dict[str, dict] = {}  # table -> its last sweep's result (record_sweep)
        self.directory = Path(directory) if directory else None
        self.generation = 0  # the generation loaded or last saved (0: none, or the older layout)
        self.read_only = False  # never saved (a PS serving files an applier writes: reload_if_newer)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load(self.directory)

    # -- loading ---------------------------------------------------------------------

    def _load(self, directory: Path) -> None:
        """The newest generation that loads whole; a failed newer one is logged, file named."""
        candidates: list[int] = []  # generation numbers, newest first; 0: the older layout
        manifest = directory / MANIFEST
        if manifest.exists():
            try:
                current = int(json.loads(manifest.read_text())["generation"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SnapshotError(f"{manifest}: unreadable ({exc}); move it away to load older generations") from None
            candidates = [current] + [g for g in reversed(_generations(directory)) if g < current]
        if any(directory.glob(f"*{SNAPSHOT_SUFFIX}")):
            candidates.append(0)
        failed: list[str] = []
        for generation in candidates:
            try:
                tables = self._read_generation(directory, generation)
            except SnapshotError as exc:
                log.error("saved tables of generation %d not loaded: %s", generation, exc)
                failed.append(str(exc))
                continue
            self._tables = tables
            self.generation = generation
            self._load_drops(directory, generation)
            where = _gen_dir(directory, generation) if generation else directory
            rows = sum(len(t.index) for t in tables.values())
            if failed:
                log.error(
                    "loaded generation %d instead (%s: %d tables, %d rows), an older save: %s",
                    generation,
                    where,
                    len(tables),
                    rows,
                    "; ".join(failed),
                )
            else:
                log.info("loaded %d tables (%d rows) from %s", len(tables), rows, where)
            return
        if failed:
            raise SnapshotError(
                f"no saved generation of tables in {directory} loads: {'; '.join(failed)}. Move the directory "
                f"away to start empty"
            )

    def _load_drops(self, directory: Path, generation: int) -> None:
        """The log of dropped tables as the generation saved it (none in the older layout)."""
        if not generation:
            return
        try:
            listing = json.loads((_gen_dir(directory, generation) / TABLES_FILE).read_text())
            drops = [(int(seq), str(name), float(when)) for seq, name, when in listing.get("drops", [])]
            end = int(listing.get("drops_end", 0))
        except (OSError, ValueError, TypeError) as exc:
            log.error(
                "the log of dropped tables of generation %d is unreadable (%s): starting it empty", generation, exc
            )
            return
        self._drops.extend(drops)
        self._drops_end = max(end, drops[-1][0] + 1 if drops else 0)

    def _read_generation(self, directory: Path, generation: int) -> dict[str, _Table]:
        """Every table of one generation, checked against its tables.json (0: the older layout)."""
        if generation == 0:
            paths = sorted(directory.glob(f"*{SNAPSHOT_SUFFIX}"))
        else:
            gen = _gen_dir(directory, generation)
            try:
                listing = json.loads((gen / TABLES_FILE).read_text())
                entries = listing["tables"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SnapshotError(f"{gen / TABLES_FILE}: missing or unreadable ({exc})") from None
            paths = []
            for e in entries:
                try:
                    name, want_bytes, want_sha = e["file"], int(e["bytes"]), e["sha256"]
                except (KeyError, TypeError, ValueError) as exc:
                    raise SnapshotError(f"{gen / TABLES_FILE}: an entry is unreadable ({exc!r})") from None
                path = inside(gen, name, what=f"{gen / TABLES_FILE}: file name", error=SnapshotError)
                size = path.stat().st_size if path.exists() else None
                if size != want_bytes:
                    state = "missing" if size is None else f"{size} bytes"
                    raise SnapshotError(f"{path}: {state}, {TABLES_FILE} says {want_bytes} bytes (torn or truncated)")
                if _sha256(path) != want_sha:
                    raise SnapshotError(f"{path}: sha256 is not the one {TABLES_FILE} lists (corrupt)")
                paths.append(path)
        staging = EmbeddedStore()
        for path in paths:
            schema, ids, rows, meta, extra = _read_table_file(path)
            staging.create_table(schema)
            t = staging._tables[schema.name]
            try:
                t.lifecycle = Lifecycle.from_dict(json.loads(meta.get("lifecycle", "{}")))
            except (ValueError, TypeError) as exc:
                raise SnapshotError(f"{path}: lifecycle unreadable ({exc})") from None
            if t.lifecycle.active:
                t.start_stamps()
            if len(ids):
                staging.push(schema.name, ids, rows)
                if t.stamps is not None and "stamps" in extra:
                    t.stamps[t.index.lookup(ids)] = extra["stamps"]
            try:
                if "deleted_ids" in extra or "deleted_end" in meta:
                    deleted = extra.get("deleted_ids", np.zeros(0, np.int64))
                    # saves before runs and an end were kept: one run, starting at deleted_first
                    end = int(meta.get("deleted_end", int(meta.get("deleted_first", "0")) + len(deleted)))
                    t.log.restore(deleted, extra.get("deleted_times", np.zeros(0)), extra.get("deleted_runs"), end)
                t.published = int(meta.get("published", "0"))
                t.published_time = float(meta.get("published_time", "0"))
                t.published_digest = str(meta.get("published_digest", ""))
                if "changes" in meta:  # after the rows' pushes above, which it does not log
                    changes = json.loads(meta["changes"])
                    t.change_log = checked_max_ids(schema.name, int(changes["max_ids"]))
                    t.changes.max_ids = t.change_log or LOG_MAX_IDS
                    t.changes.restore(
                        extra.get("changed_ids", np.zeros(0, np.int64)),
                        extra.get("changed_times", np.zeros(0)),
                        extra.get("changed_runs"),
                        int(changes["end"]),
                    )
            except (ValueError, TypeError, KeyError, PSError) as exc:
                raise SnapshotError(f"{path}: its logs or published version are unreadable ({exc})") from None
        return staging._tables

    # -- saving ----------------------------------------------------------------------

    def save(self) -> None:
        """Write every table as a new generation and switch to it (see the module doc)."""
        if self.directory is None or self.read_only:
            return
        from safetensors.numpy import save_file

        directory = self.directory
        previous = self.generation
        generation = max([previous, *_generations(directory)]) + 1
        gen = _gen_dir(directory, generation)
        shutil.rmtree(gen, ignore_errors=True)
        gen.mkdir(parents=True)  # the folder too, if it was deleted under this process (lost_data)
        stall_after = int(os.environ.get(STALL_ENV, "-1"))
        entries = []
        for name in sorted(self._tables):
            t = self._tables.get(name)
            if t is None:
                continue
            with t.lock:
                ids, where = t.index.items()
                rows = t.rows[where]
                stamps = None if t.stamps is None else t.stamps[where]
                lifecycle = t.lifecycle
            deleted_ids, deleted_times, deleted_runs, deleted_end = t.log.snapshot()
            changes, change_log = t.changes, t.change_log
            order = np.argsort(ids)
            tensors = {"ids": ids[order], "rows": np.ascontiguousarray(rows[order])}
            if stamps is not None:
                tensors["stamps"] = stamps[order]
            if len(deleted_ids):
                tensors["deleted_ids"], tensors["deleted_times"] = deleted_ids, deleted_times
                tensors["deleted_runs"] = deleted_runs
            metadata = {
                "schema": json.dumps(t.schema.to_dict()),
                "lifecycle": json.dumps(lifecycle.to_dict()),
                # deleted_first: what an older dynemb reads (it keeps one run)
                "deleted_first": str(int(deleted_runs[0, 0]) if len(deleted_runs) else deleted_end),
                "deleted_end": str(deleted_end),
            }
            if t.published:
                metadata["published"] = str(t.published)
                metadata["published_time"] = repr(t.published_time)
                metadata["published_digest"] = t.published_digest
            if change_log or changes.end:  # its count goes on after a restart, on or off
                changed_ids, changed_times, changed_runs, changed_end = changes.snapshot()
                if len(changed_ids):
                    tensors["changed_ids"], tensors["changed_times"] = changed_ids, changed_times
                    tensors["changed_runs"] = changed_runs
                metadata["changes"] = json.dumps({"max_ids": change_log, "end": changed_end})
            path = gen / f"{name}{SNAPSHOT_SUFFIX}"
            save_file(tensors, str(path), metadata=metadata)
            _fsync(path)
            entries.append({"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path), "rows": len(ids)})
            if len(entries) == stall_after:
                log.warning("save stalled after %d table files (%s, tests only)", len(entries), STALL_ENV)
                while True:
                    time.sleep(60)
        with self._lock:
            drops = [list(d) for d in self._drops]
            drops_end = self._drops_end
        _write_json(
            gen / TABLES_FILE, {"generation": generation, "tables": entries, "drops": drops, "drops_end": drops_end}
        )
        _fsync(directory)
        # the switch: until this rename lands, a restart loads the previous generation
        _write_json(directory / MANIFEST, {"format": SAVE_FORMAT, "generation": generation})
        self.generation = generation
        # keep the previous generation (the fallback if this one is found torn), nothing older
        for g in _generations(directory):
            if g not in (generation, previous):
                shutil.rmtree(_gen_dir(directory, g), ignore_errors=True)
        if previous:  # the older layout stays only as the fallback of a first save
            for path in directory.glob(f"*{SNAPSHOT_SUFFIX}"):
                path.unlink()
        log.info("saved %d tables to %s", len(entries), gen)

    def set_published(self, table: str, number: int, cut: float, digest: str = "") -> None:
        """Record that the table holds published version `number`, cut at `cut`, whose manifest's
        sha256 is `digest` (saved with it)."""
        t = self._table(table)
        t.published, t.published_time, t.published_digest = number, cut, digest

    def published_versions(self) -> dict[str, tuple[int, float]]:
        """{table: (published version, when it was cut)} of the tables that hold one."""
        return {name: (t.published, t.published_time) for name, t in list(self._tables.items()) if t.published}

    def published_version(self, table: str) -> int:
        """The published version the table holds (a serving store's: dynemb/publish/apply.py); 0: none."""
        return self._table(table).published

    def published_digest(self, table: str) -> str:
        """The sha256 of the manifest of the published version the table holds ("": none kept)."""
        return self._table(table).published_digest

    def reload_if_newer(self) -> bool:
        """Load the directory's current generation if it is not the one loaded (an applier saved
        a newer one), and switch every table to it at once; returns whether it did."""
        if self.directory is None:
            return False
        try:
            current = int(json.loads((self.directory / MANIFEST).read_text())["generation"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if current == self.generation:
            return False
        tables = self._read_generation(self.directory, current)
        self._tables, self.generation = tables, current  # a pull in flight keeps the table it has
        log.info("loaded generation %d (%d tables) from %s", current, len(tables), self.directory)
        return True

    def lost_data(self) -> str:
        """See Store.lost_data: the directory's MANIFEST.json, once a generation was loaded or
        saved, deleted (by hand, or with the folder) while this process runs."""
        if self.directory is None or not self.generation or (self.directory / MANIFEST).exists():
            return ""
        return (
            f"the embedded store's saved files in {self.directory} are gone ({MANIFEST} of generation "
            f"{self.generation} deleted); the rows are still in this process and are saved again at its "
            f"shutdown: stop it with SIGTERM, never kill -9"
        )

    def close(self) -> None:
        """Save every table to the directory, if there is one (see save)."""
        self.save()

    def _table(self, name: str) -> _Table:
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFound(f"table {name!r} does not exist on this PS (embedded store)") from None

    def create_table(self, schema: TableSchema) -> bool:
        """See Store.create_table. expected_rows sizes nothing here (a table's arrays grow by
        doubling); it is kept with the schema while the store runs, not in its saved files."""
        with self._lock:
            have = self._tables.get(schema.name)
            if have is None:
                self._tables[schema.name] = _Table(schema)
                return True
        check_same_schema(have.schema, schema)
        return False

    def schema(self, table: str) -> TableSchema:
        """See Store.schema."""
        return self._table(table).schema

    def list_tables(self) -> list[TableSchema]:
        """See Store.list_tables."""
        return [self._tables[name].schema for name in sorted(self._tables)]

    def num_rows(self, table: str) -> int:
        """See Store.num_rows."""
        return len(self._table(table).index)

    def drop_table(self, table: str) -> int | None:
        """See Store.drop_table; the drop is logged (drops())."""
        with self._lock:
            t = self._tables.pop(table, None)
            if t is not None:
                self._drops.append((self._drops_end, table, time.time()))
                self._drops_end += 1
                self._last_sweeps.pop(table, None)  # a table created again under the name has none
        return None if t is None else len(t.index)

    def drops(self, after: str = "", limit: int = 1000) -> Drops:
        """See Store.drops: cursors count the drops logged before them."""
        at = parse_cursor(after, "the log of dropped tables")
        with self._lock:
            kept = list(self._drops)
            end = self._drops_end
        if at == END:
            return Drops([], str(end), False)
        first = kept[0][0] if kept else end
        gap = at is not None and not first <= at <= end
        start = first if at is None else max(at, first)
        got = [Drop(name, when) for seq, name, when in kept if seq >= start][: max(1, limit)]
        return Drops(got, str(min(end, start + len(got))), gap)

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See Store.pull; rows of ids not found are left as they were in out."""
        rows = rows_out(out, len(ids), self.schema(table))
        found = np.ones(len(ids), dtype=bool)
        found[self.pull_into(table, ids, rows)] = False
        return rows, found

    def pull_into(self, table: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """See Store.pull_into: one compiled call per batch. In a table whose rows expire,
        expired rows count as absent and the rest are stamped as used."""
        t = self._table(table)
        with t.lock:
            # one compiled call: lookup, and the present rows copied with the ones further down
            # prefetched (~4x numpy's fancy indexing for a big table's scattered rows)
            missing = t.index.pull_rows(ids, t.rows, rows_out(out, len(ids), t.schema))
            if t.stamps is None:
                return missing
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            where = t.index.lookup(ids)
            at = np.flatnonzero(where >= 0)
            stamps = np.maximum(t.stamps[where[at]], t.lifecycle.since)
            old = stamps < t.lifecycle.expired_before()
            expired = at[old]
            t.stamps[where[at[~old]]] = now_stamp()  # expired ones stay so, for the sweep
            if len(expired):
                t.expired_reads += len(expired)
                missing = np.sort(np.concatenate([missing, expired]))
            return missing

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """See Store.push."""
        t = self._table(table)
        if len(ids) == 0:
            return 0
        rows = rows_for_table(rows, t.schema, len(ids))
        with t.lock:
            if t.change_log:  # logged before the write (change_log.py)
                t.changes.append(ids)
            if not t.free:  # no deleted rows to reuse (a trainer's store never deletes): one C call
                t.reserve(len(ids))
                t.used += t.index.push_rows(ids, t.rows, rows, t.used)
                t.stamp(np.ascontiguousarray(ids, dtype=np.int64))
                return len(ids)
            where = t.index.lookup_or_insert(ids, t.allocate, t.free.append)
            # written in order, so a repeated id's last row is the one that stays
            native.id_index().scatter(t.rows, t.schema.row_bytes, where, rows, np.arange(len(ids)))
            t.stamp(np.ascontiguousarray(ids, dtype=np.int64), where)
        return len(ids)

    def delete(self, table: str, ids: np.ndarray) -> int:
        """See Store.delete; the freed row numbers are reused by later pushes."""
        t = self._table(table)
        with t.lock:
            return len(t.forget(np.ascontiguousarray(ids, dtype=np.int64)))

    def clear(self, table: str) -> int:
        """See Store.clear; the table's rows array shrinks back to its initial size."""
        t = self._table(table)
        with t.lock:
            ids, _ = t.index.items()
            t.log.append(np.sort(ids))
            n = len(t.index)
            t.index.clear()
            t.rows = np.zeros((16, t.schema.width), dtype=t.schema.np_dtype)
            t.used = 0
            t.free = []
            if t.stamps is not None:
                t.start_stamps()
        return n

    # -- rows that expire ------------------------------------------------------------

    def lifecycle(self, table: str) -> Lifecycle:
        """See Store.lifecycle."""
        return self._table(table).lifecycle

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> Lifecycle:
        """See Store.set_lifecycle."""
        t = self._table(table)
        lifecycle = lifecycle.checked(table)._replace(since=now_stamp())
        with t.lock:
            t.lifecycle = lifecycle
            if not lifecycle.active:
                t.stamps = t.row_ids = t.row_live = None
            elif t.stamps is None:
                t.start_stamps()
        return lifecycle

    def touch(self, table: str, ids: np.ndarray) -> int:
        """See Store.touch."""
        t = self._table(table)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        with t.lock:
            where = t.index.lookup(ids)
            t.stamp(ids, where)
        return int((where >= 0).sum())

    def sweep_slice(self, table: str, cursor: int, cutoff: Cutoff, max_rows: int) -> SweepSlice:
        """See Store.sweep_slice: the cursor is a row number; one slice under the table's lock."""
        t = self._table(table)
        with t.lock:
            if t.stamps is None or t.row_ids is None or t.row_live is None:
                return SweepSlice(0, 0, np.zeros(0, np.int64))
            stop = min(t.used, cursor + max_rows)
            row_ids = t.row_ids[cursor:stop].copy()
            live = t.row_live[cursor:stop].copy()  # forget() below frees rows of this view
            stamps = np.maximum(t.stamps[cursor:stop], t.lifecycle.since)
            old = live & cutoff.due(stamps, row_ids)
            deleted = t.forget(row_ids[old]) if old.any() else np.zeros(0, np.int64)
            kept = stamps[live & ~old]
            oldest = int(kept.min()) if len(kept) else 0
            return SweepSlice(stop if stop < t.used else 0, int(live.sum()), deleted, oldest)

    def stamps_slice(self, table: str, cursor: int, max_rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        """See Store.stamps_slice."""
        t = self._table(table)
        with t.lock:
            if t.stamps is None or t.row_ids is None or t.row_live is None:
                return 0, np.zeros(0, np.int64), np.zeros(0, STAMP_DTYPE)
            stop = min(t.used, cursor + max_rows)
            row_ids = t.row_ids[cursor:stop]
            live = t.row_live[cursor:stop]
            stamps = np.maximum(t.stamps[cursor:stop][live], t.lifecycle.since).astype(STAMP_DTYPE)
            return (stop if stop < t.used else 0), row_ids[live].copy(), stamps

    def deletions(self, table: str, after: str = "", limit: int = 65536) -> Deletions:
        """See Store.deletions: cursors count the ids logged before them."""
        t = self._table(table)
        return t.log.read(parse_cursor(after, f"table {table!r}"), max(1, limit))

    def change_log(self, table: str) -> int:
        """See Store.change_log."""
        return self._table(table).change_log

    def set_change_log(self, table: str, max_ids: int) -> int:
        """See Store.set_change_log: a log kept goes on (its cursors stay), resized."""
        t = self._table(table)
        max_ids = checked_max_ids(table, max_ids)
        with t.lock:
            if t.change_log and not max_ids:  # readers across the time it is off: a gap
                t.changes.skip()
            t.change_log = max_ids
            if max_ids:
                t.changes.max_ids = max_ids
        return max_ids

    def changes(self, table: str, after: str = "", limit: int = 65536) -> Changes:
        """See Store.changes: cursors count the ids logged before them."""
        t = self._table(table)
        at = parse_cursor(after, f"table {table!r}", "change log")
        if not t.change_log:
            raise no_change_log(table)
        return Changes(*t.changes.read(at, max(1, limit)))

    def record_sweep(self, table: str, result: dict) -> None:
        """See Store.record_sweep (kept while the store runs)."""
        self._last_sweeps[table] = result

    def last_sweep(self, table: str) -> dict | None:
        """See Store.last_sweep."""
        return self._last_sweeps.get(table)

    def expired_reads(self, table: str) -> int:
        """Pulls of rows found expired (counted as absent) since the store started."""
        return self._table(table).expired_reads

    def export(self, table: str, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """See Store.export: ids ascending; rows changed during the export are read as they are then."""
        t = self._table(table)
        with t.lock:
            ids, _ = t.index.items()
        ids.sort()
        for start in range(0, len(ids), rows_per_chunk):
            chunk = ids[start : start + rows_per_chunk]
            # Look the chunk up again under the lock: rows pushed or deleted since the
            # listing are exported as they are now, never as another id's row.
            with t.lock:
                where = t.index.lookup(chunk)
                present = where >= 0
                rows = t.rows[where[present]]
            yield chunk[present], rows

    def nbytes(self) -> int:
        """Bytes held by every table's rows and id index."""
        return sum(t.rows.nbytes + t.index.nbytes() for t in self._tables.values())
