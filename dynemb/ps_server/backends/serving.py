"""The store of a read-only PS (`dynemb ps serve --read-only`) over published tables in Redis
(serving_redis.py): pulls of rows all of one version, and nothing written.

A table's schema is its published rows': dim values of the version's dtype (int8 versions read
as fp32), no optimizer state. Every call that would write (and a few that make no sense for a
serving store: exports, the logs) is refused with ReadOnly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dynemb.ps_server.backends.base import Store, rows_out
from dynemb.ps_server.backends.serving_redis import ServingRedis
from dynemb.ps_server.change_log import Changes
from dynemb.ps_server.errors import ReadOnly, TableNotFound
from dynemb.ps_server.lifecycle import Cutoff, Deletions, Drops, Lifecycle, SweepSlice
from dynemb.ps_server.schema import TableSchema


class ServingStore(Store):
    """Published tables, read only (see the module).

    Args:
        serving: the published tables' Redis namespace.
    """

    kind = "serving"

    def __init__(self, serving: ServingRedis) -> None:
        self.serving = serving
        self.kind = f"serving-{serving.store.kind}"

    def _refuse(self, what: str) -> ReadOnly:
        return ReadOnly(
            f"{what}: this PS serves published tables read only (Redis namespace {self.serving.namespace!r}); "
            "write to the training PS and publish"
        )

    def create_table(self, schema: TableSchema) -> bool:
        raise self._refuse(f"create table {schema.name!r}")

    def schema(self, table: str) -> TableSchema:
        """See Store.schema: the published rows' (dim, the version's dtype; int8 read as fp32)."""
        head = self.serving.head(table)
        return TableSchema(table, head.dim, 0, head.read_dtype)

    def list_tables(self) -> list[TableSchema]:
        return list(self.schemas(self.serving.tables()).values())

    def num_rows(self, table: str) -> int:
        """See Store.num_rows: the rows of the version readers read."""
        return self.serving.head(table).rows

    def drop_table(self, table: str) -> int | None:
        raise self._refuse(f"drop table {table!r}")

    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See Store.pull: the rows of one version; rows of ids not found are zeros."""
        rows = rows_out(out, len(ids), self.schema(table))
        _, found, _ = self.serving.pull(table, ids, rows)
        return rows, found

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        raise self._refuse(f"push to table {table!r}")

    def delete(self, table: str, ids: np.ndarray) -> int:
        raise self._refuse(f"delete from table {table!r}")

    def export(self, table: str, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        raise self._refuse(f"export table {table!r} (read the published versions instead)")

    def clear(self, table: str) -> int:
        raise self._refuse(f"clear table {table!r}")

    def lifecycle(self, table: str) -> Lifecycle:
        self.serving.head(table)  # TableNotFound for a table not published
        return Lifecycle()

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> Lifecycle:
        raise self._refuse(f"set the lifecycle of table {table!r}")

    def touch(self, table: str, ids: np.ndarray) -> int:
        raise self._refuse(f"touch rows of table {table!r}")

    def sweep_slice(self, table: str, cursor: int, cutoff: Cutoff, max_rows: int) -> SweepSlice:
        return SweepSlice(0, 0, np.zeros(0, np.int64))

    def stamps_slice(self, table: str, cursor: int, max_rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        return 0, np.zeros(0, np.int64), np.zeros(0, np.uint32)

    def deletions(self, table: str, after: str = "", limit: int = 65536) -> Deletions:
        raise self._refuse(f"read the deletion log of table {table!r} (its tombstones are in the versions)")

    def drops(self, after: str = "", limit: int = 1000) -> Drops:
        raise self._refuse("read the log of dropped tables")

    def change_log(self, table: str) -> int:
        self.serving.head(table)
        return 0

    def set_change_log(self, table: str, max_ids: int) -> int:
        raise self._refuse(f"set the change log of table {table!r}")

    def changes(self, table: str, after: str = "", limit: int = 65536) -> Changes:
        raise self._refuse(f"read the change log of table {table!r}")

    def record_sweep(self, table: str, result: dict) -> None:
        return None

    def last_sweep(self, table: str) -> dict | None:
        return None

    def published_versions(self) -> dict[str, tuple[int, float]]:
        """{table: (the version served, when it was cut)} of every table published here."""
        out = {}
        for table in self.serving.tables():
            head = self.serving.raw_head(table)
            if head.version:
                out[table] = (head.version, head.time)
        return out

    def ping(self) -> None:
        """See Store.ping: the Redis answers."""
        self.serving.store.ping()

    def close(self) -> None:
        self.serving.store.close()


__all__ = ["ServingStore", "TableNotFound"]
