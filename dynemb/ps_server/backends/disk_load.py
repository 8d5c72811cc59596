"""The disk store's bulk load: an empty table filled from RocksDB table files written here and
ingested whole (DiskStore.load_sorted, and an import into an empty table, disk_import.py), and the
recount that keeps a table's row count exact when a load is cut short.

An ingest skips the WAL, the memtables and compaction (the files are disjoint and go to the last
level): at 10^8 rows of 68 B it loaded 1.09-1.52M rows/s here against 0.1-0.4M by pushes. It is
all or none, but the count is written after it: a marker written and synced first makes the next
open count the table's rows by a scan (recount) if the count never came.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dynemb.ps_server.backends.disk_layout import row_keys, row_values, table_prefix
from dynemb.ps_server.codec import rows_for_table
from dynemb.ps_server.errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from dynemb.ps_server.backends.disk import DiskStore, _DiskTable

LOADING = b"loading/"  # + a table's number: a load began and its count is not yet written
SPILL = "spill"  # the folder, in the database's, where loads write their files (one folder each)
_OLD_SPILL = "load_sorted"  # where an older version wrote them


def marker(number: int) -> bytes:
    """The key that says table `number`'s load may be cut short."""
    return LOADING + table_prefix(number)


def spill_folder(store: DiskStore) -> Path:
    """A new folder of its own for one load's files, beside the database (the files are moved
    into it by the ingest: same file system)."""
    parent = store.path / SPILL
    parent.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="load-", dir=parent))


def remove_spills(path: Path) -> None:
    """Remove the files of loads a stopped PS left (called at open, before any load can start)."""
    for name in (SPILL, _OLD_SPILL):
        shutil.rmtree(path / name, ignore_errors=True)


def load_sorted(
    store: DiskStore, t: _DiskTable, chunks: Iterable[tuple[np.ndarray, np.ndarray]], rows_per_file: int
) -> int:
    """See DiskStore.load_sorted; t is the table, its lock not held."""
    folder = spill_folder(store)
    try:
        total = fill_empty(store, t, chunks, folder, rows_per_file)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if total is None:
        raise InvalidArgument(
            f"table {t.schema.name!r}: load_sorted fills an empty table that keeps no change log "
            f"(it has {t.count} rows, change log {t.change_log})"
        )
    return total


def fillable(t: _DiskTable) -> bool:
    """Whether t may be filled in bulk (under its lock): no rows, and no change log (the rows
    would go unlogged)."""
    return not t.count and not t.change_log


def fill_empty(
    store: DiskStore, t: _DiskTable, chunks: Iterable[tuple[np.ndarray, np.ndarray]], folder: Path, rows_per_file: int
) -> int | None:
    """Fill table t, if it is empty and keeps no change log (its rows would go unlogged), from
    table files written in folder and ingested whole; rows of a table whose rows expire are
    stamped now.

    Holds t's lock from the check through the ingest, the files' writing included (simplest: no
    push can land between the check and the ingest unseen; a push or drop of t waits for it).

    Args:
        store: the disk store.
        t: the table, its lock not held.
        chunks: (ids, rows) pairs, ids ascending strictly across all of them; not read at all
            when the table is not empty.
        folder: where the table files go (the caller removes it).
        rows_per_file: rows a table file holds.

    Returns:
        The rows loaded, or None when t has rows or keeps a change log (nothing done).

    Raises:
        InvalidArgument: ids do not ascend, or rows do not fit the table (nothing loaded).
        BackendUnavailable: RocksDB failed the ingest (the count is taken again by a scan).
    """
    with t.lock:
        store._live(t)
        if not fillable(t):
            return None
        batch = store._batch()
        batch.put(marker(t.number), b"")
        store._write(batch)
        store._durable()
        try:
            files, total = write_files(store, t, chunks, folder, rows_per_file)
        except BaseException:
            with contextlib.suppress(BackendUnavailable):  # nothing was ingested; else a recount at open
                batch = store._batch()
                batch.delete(marker(t.number))
                store._write(batch)
            raise
        if files:
            _ingest(store, t, files)
        batch = store._batch()
        batch.put(t.count_key(), total.to_bytes(8, "little", signed=True))
        batch.delete(marker(t.number))
        store._write(batch)
        t.count = total
    store._durable()
    return total


def _ingest(store: DiskStore, t: _DiskTable, files: list[str]) -> None:
    """Under t.lock: ingest files into the rows' column family, all or none."""
    options = store._rd.IngestExternalFileOptions()
    options.set_move_files(True)
    try:
        store._rows.ingest_external_file(files, options)
    except Exception as exc:  # the files may or may not be in: count what is there
        with contextlib.suppress(BackendUnavailable):
            t.count = recount(store, t.number, t.count_key())
        raise BackendUnavailable(
            f"disk backend {store.path}: ingesting table {t.schema.name!r}'s files failed ({str(exc)[:300]})"
        ) from None


def write_files(
    store: DiskStore, t: _DiskTable, chunks: Iterable[tuple[np.ndarray, np.ndarray]], folder: Path, rows_per_file: int
) -> tuple[list[str], int]:
    """Write the rows of chunks (ids ascending strictly) into table files in folder.

    Returns:
        (the files' paths, rows written).

    Raises:
        InvalidArgument: ids do not ascend strictly, or rows do not fit the table.
    """
    files: list[str] = []
    writer, in_file, total, last = None, 0, 0, None
    stamp = t.stamp()
    for ids, rows in chunks:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids) and ((last is not None and ids[0] <= last) or (np.diff(ids) <= 0).any()):
            raise InvalidArgument(f"table {t.schema.name!r}: load_sorted needs ids ascending strictly")
        rows = rows_for_table(rows, t.schema, len(ids))
        for key, value in zip(row_keys(t.number, ids), row_values(rows, t.schema.row_bytes, stamp)):
            if writer is None:
                writer = store._rd.SstFileWriter(store._rows_options)
                files.append(str(folder / f"{len(files):06d}.sst"))
                writer.open(files[-1])
            writer[key] = value
            in_file += 1
            if in_file == rows_per_file:
                writer.finish()
                writer, in_file = None, 0
        total += len(ids)
        last = int(ids[-1]) if len(ids) else last
    if writer is not None:
        writer.finish()
    return files, total


def recount(store: DiskStore, number: int, count_key: bytes) -> int:
    """Count table `number`'s rows by a scan, store the count at count_key and clear its marker
    (a load cut short: its files were ingested all or none)."""
    ro = store._scan_options(number)
    count = sum(1 for _ in store._rows.keys(from_key=table_prefix(number), read_opt=ro))
    batch = store._batch()
    batch.put(count_key, count.to_bytes(8, "little", signed=True))
    batch.delete(marker(number))
    store._write(batch)
    store._durable()
    return count
