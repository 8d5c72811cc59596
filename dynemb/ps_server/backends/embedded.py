"""The embedded store: every table in this process's memory, on numpy arrays.

The default backend, for a single PS or for tests and demos: no Redis to run. Each
table is an IdIndex (id → row number, compiled from dynemb/ps_server/csrc/id_index.h) and
one 2-D array of rows that grows by doubling; deleted rows' numbers are reused. A lock
per table keeps concurrent gRPC handlers apart.

Without a directory nothing is written to disk: a restarted PS starts empty. With one
(`embedded:///dir`), `close()` (the PS's drain on SIGTERM) saves each table to
`dir/<table>.safetensors` (ids, rows, and the schema in the metadata) and a new store
loads them, so a graceful restart keeps every row; a crash loses what changed since
the last save. Use the Redis backend where every write must be durable at once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dynemb.ps_server import native
from dynemb.ps_server.backends.base import Store, check_same_schema, rows_out
from dynemb.ps_server.backends.id_index import IdIndex
from dynemb.ps_server.codec import rows_for_table
from dynemb.ps_server.errors import TableNotFound
from dynemb.ps_server.schema import TableSchema


class _Table:
    def __init__(self, schema: TableSchema) -> None:
        self.schema = schema
        self.lock = threading.Lock()
        self.index = IdIndex()
        self.rows = np.zeros((16, schema.width), dtype=schema.np_dtype)
        self.used = 0  # row numbers [0, used) were handed out at least once
        self.free: list[np.ndarray] = []  # row numbers freed by deletes

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


log = logging.getLogger("dynemb.ps")
SNAPSHOT_SUFFIX = ".safetensors"


class EmbeddedStore(Store):
    """Every table in this process's memory (see the module doc).

    Args:
        directory: where tables are loaded from at start and saved to by close();
            None keeps nothing on disk.
    """

    kind = "embedded"

    def __init__(self, directory: str | None = None) -> None:
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        self.directory = Path(directory) if directory else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load(self.directory)

    def _load(self, directory: Path) -> None:
        from safetensors import safe_open  # only with a directory
        from safetensors.numpy import load_file

        for path in sorted(directory.glob(f"*{SNAPSHOT_SUFFIX}")):
            with safe_open(str(path), framework="numpy") as f:
                schema = TableSchema.from_dict(json.loads(f.metadata()["schema"]))
            tensors = load_file(str(path))
            self.create_table(schema)
            if len(tensors["ids"]):
                self.push(schema.name, tensors["ids"], tensors["rows"])
            log.info("loaded table %s (%d rows) from %s", schema.name, len(tensors["ids"]), path)

    def save(self) -> None:
        """Write every table to the directory (each file replaced atomically)."""
        if self.directory is None:
            return
        from safetensors.numpy import save_file

        for name in list(self._tables):
            t = self._tables.get(name)
            if t is None:
                continue
            with t.lock:
                ids, where = t.index.items()
                rows = t.rows[where]
            order = np.argsort(ids)
            tmp = self.directory / f".{name}{SNAPSHOT_SUFFIX}.tmp"
            save_file(
                {"ids": ids[order], "rows": np.ascontiguousarray(rows[order])},
                str(tmp),
                metadata={"schema": json.dumps(t.schema.to_dict())},
            )
            os.replace(tmp, self.directory / f"{name}{SNAPSHOT_SUFFIX}")
        # a dropped table must not come back at the next start
        for path in self.directory.glob(f"*{SNAPSHOT_SUFFIX}"):
            if path.name[: -len(SNAPSHOT_SUFFIX)] not in self._tables:
                path.unlink()
        log.info("saved %d tables to %s", len(self._tables), self.directory)

    def close(self) -> None:
        """Save every table to the directory, if there is one (see save)."""
        self.save()

    def _table(self, name: str) -> _Table:
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFound(f"table {name!r} does not exist on this PS (embedded store)") from None

    def create_table(self, schema: TableSchema) -> bool:
        """See Store.create_table."""
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
        """See Store.drop_table."""
        with self._lock:
            t = self._tables.pop(table, None)
        return None if t is None else len(t.index)

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See Store.pull; rows of ids not found are left as they were in out."""
        rows = rows_out(out, len(ids), self.schema(table))
        found = np.ones(len(ids), dtype=bool)
        found[self.pull_into(table, ids, rows)] = False
        return rows, found

    def pull_into(self, table: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """See Store.pull_into: one compiled call per batch."""
        t = self._table(table)
        with t.lock:
            # one compiled call: lookup, and the present rows copied with the ones further down
            # prefetched (~4x numpy's fancy indexing for a big table's scattered rows)
            return t.index.pull_rows(ids, t.rows, rows_out(out, len(ids), t.schema))

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """See Store.push."""
        t = self._table(table)
        if len(ids) == 0:
            return 0
        rows = rows_for_table(rows, t.schema, len(ids))
        with t.lock:
            if not t.free:  # no deleted rows to reuse (a trainer's store never deletes): one C call
                t.reserve(len(ids))
                t.used += t.index.push_rows(ids, t.rows, rows, t.used)
                return len(ids)
            where = t.index.lookup_or_insert(ids, t.allocate, t.free.append)
            # written in order, so a repeated id's last row is the one that stays
            native.id_index().scatter(t.rows, t.schema.row_bytes, where, rows, np.arange(len(ids)))
        return len(ids)

    def delete(self, table: str, ids: np.ndarray) -> int:
        """See Store.delete; the freed row numbers are reused by later pushes."""
        t = self._table(table)
        with t.lock:
            freed = t.index.remove(ids)
            if len(freed):
                t.free.append(freed)
        return len(freed)

    def clear(self, table: str) -> int:
        """See Store.clear; the table's rows array shrinks back to its initial size."""
        t = self._table(table)
        with t.lock:
            n = len(t.index)
            t.index.clear()
            t.rows = np.zeros((16, t.schema.width), dtype=t.schema.np_dtype)
            t.used = 0
            t.free = []
        return n

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
