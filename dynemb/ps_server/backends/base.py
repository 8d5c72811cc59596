"""The store a PS keeps its rows in. One small API, so backends stay interchangeable.

Every method takes already-validated input (the service checks names, widths and
byte counts first) and raises ps_server.errors types for what the store itself
finds wrong (unknown table, schema clash, store unreachable).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from dynemb.ps_server.change_log import Changes
from dynemb.ps_server.errors import DeadlineExceeded, TableExists, TableNotFound
from dynemb.ps_server.lifecycle import Cutoff, Deletions, Drops, Lifecycle, SweepSlice
from dynemb.ps_server.schema import TableSchema


def rows_out(out: np.ndarray | None, n: int, schema: TableSchema) -> np.ndarray:
    """Where a pull reads n rows to: out, checked, or a new array."""
    if out is None:
        return np.empty((n, schema.width), dtype=schema.np_dtype)
    if out.shape != (n, schema.width) or out.dtype != schema.np_dtype or not out.flags.writeable:
        raise ValueError(
            f"pull into a {out.dtype} array of shape {out.shape}: table {schema.name!r} needs a "
            f"writable {schema.np_dtype} array of shape {(n, schema.width)}"
        )
    return out


def check_same_schema(stored: TableSchema, requested: TableSchema, where: str = "") -> None:
    """Raises TableExists, naming both schemas, unless a table's stored schema is the requested one."""
    if stored != requested:
        raise TableExists(
            f"table {requested.name!r} already exists{where} with another schema: "
            f"stored {stored.to_dict()}, requested {requested.to_dict()}"
        )


def check_time(time_left: Callable[[], float] | None, what: str) -> None:
    """Raise DeadlineExceeded if the caller's time_left() has run out: work nobody waits for stops."""
    if time_left is not None and time_left() <= 0:
        raise DeadlineExceeded(f"{what}: the call's deadline passed before the PS finished; stopped")


class Store(abc.ABC):
    """The rows of every table on one PS, behind one interface for every backend.

    The methods below are the contract; subclasses document only what they add. `kind` is the
    backend name Stats reports.
    """

    #: what Stats reports as the backend ("embedded", "redis", "redis-cluster")
    kind: str = ""

    @abc.abstractmethod
    def create_table(self, schema: TableSchema) -> bool:
        """Create the table; False if it exists with this very schema.

        schema.expected_rows (not part of the schema's identity) may size the table's layout;
        a table that exists keeps what it was created with. Raises TableExists if it exists
        with another schema.
        """

    @abc.abstractmethod
    def schema(self, table: str) -> TableSchema:
        """The table's schema; raises TableNotFound."""

    def schemas(self, tables: list[str]) -> dict[str, TableSchema]:
        """The schemas of those of tables that exist, by name (a backend may look them up at once)."""
        found = {}
        for table in tables:
            try:
                found[table] = self.schema(table)
            except TableNotFound:
                continue
        return found

    @abc.abstractmethod
    def list_tables(self) -> list[TableSchema]:
        """Every table, sorted by name."""

    @abc.abstractmethod
    def num_rows(self, table: str) -> int:
        """Rows stored in the table; raises TableNotFound."""

    def list_tables_with_rows(self, time_left: Callable[[], float] | None = None) -> list[tuple[TableSchema, int]]:
        """(schema, rows stored) of every table, sorted by name; a table dropped meanwhile is left out.

        Args:
            time_left: seconds the caller still waits; checked between tables.

        Raises:
            DeadlineExceeded: time_left() ran out before every table was counted.
        """
        out = []
        for schema in self.list_tables():
            check_time(time_left, "listing tables")
            try:
                out.append((schema, self.num_rows(schema.name)))
            except TableNotFound:
                continue
        return out

    @abc.abstractmethod
    def drop_table(self, table: str) -> int | None:
        """Remove the table and its rows; returns rows dropped, None if it did not exist."""

    @abc.abstractmethod
    def pull(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found): rows of shape (n, width) in the table's dtype, found a bool mask.

        Rows of ids not found are left for the caller to fill (their content is unspecified).
        out: a writable (n, width) array of the table's dtype to read the rows into (the PS
        passes the reply message's own bytes); rows is then out.
        """

    def pull_into(self, table: str, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """pull() into out; returns the positions of the ids not found (their rows unspecified)."""
        _, found = self.pull(table, ids, out=out)
        return np.flatnonzero(~found)

    @abc.abstractmethod
    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """Write rows (n, width) for ids, overwriting; an id repeated: the last row wins."""

    def import_rows(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]], replace: bool) -> int:
        """Write an import's chunks into the table: cleared first if replace, then each chunk pushed.

        Args:
            table: the table; it exists once the first chunk was taken.
            chunks: (ids, rows) pairs in any order, ids may repeat (the last row wins), read once.
                The first is taken before anything is written: the caller checks it (and creates
                the table) as it is taken, so a refused first chunk changes nothing.
            replace: delete the table's rows first.

        Returns:
            The rows written: every chunk's ids, repeats included.
        """
        written = 0
        for i, (ids, rows) in enumerate(chunks):
            if i == 0 and replace:
                self.clear(table)
            if len(ids):
                written += self.push(table, ids, rows)
        return written

    @abc.abstractmethod
    def delete(self, table: str, ids: np.ndarray) -> int:
        """Delete rows; returns how many of the ids were stored."""

    @abc.abstractmethod
    def export(self, table: str, rows_per_chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (ids, rows) of the table in chunks of at most rows_per_chunk."""

    @abc.abstractmethod
    def clear(self, table: str) -> int:
        """Delete every row but keep the table; returns rows deleted."""

    # -- rows that expire (dynemb/ps_server/lifecycle.py) --------------------------------

    @abc.abstractmethod
    def lifecycle(self, table: str) -> Lifecycle:
        """The table's lifecycle (Lifecycle() if its rows never expire); raises TableNotFound."""

    def lifecycles(self) -> dict[str, Lifecycle]:
        """The lifecycle of every table whose rows expire, by name (a backend may read them all
        at once)."""
        found = {}
        for schema in self.list_tables():
            try:
                lifecycle = self.lifecycle(schema.name)
            except TableNotFound:
                continue
            if lifecycle.active:
                found[schema.name] = lifecycle
        return found

    @abc.abstractmethod
    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> Lifecycle:
        """Set when the table's rows expire, on a live table; returns it as stored (`since` set
        to now). Raises TableNotFound, or InvalidArgument for a lifecycle out of range or a
        table whose rows carry no stamps (made by an older version)."""

    @abc.abstractmethod
    def touch(self, table: str, ids: np.ndarray) -> int:
        """Mark the stored ones of ids as used now (rows resident on a trainer, which the PS does
        not see read); returns how many of them are stored."""

    @abc.abstractmethod
    def sweep_slice(self, table: str, cursor: int, cutoff: Cutoff, max_rows: int) -> SweepSlice:
        """Delete the rows the cutoff makes due among about max_rows rows from cursor (0: the
        first slice of a pass), each logged first in the deletion log. A row written, pulled or
        touched while the slice runs is not deleted."""

    @abc.abstractmethod
    def stamps_slice(self, table: str, cursor: int, max_rows: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(next cursor, 0 at the end; the ids of about max_rows rows from cursor; their stamps,
        stamps from before the lifecycle was set read as its `since`): for the row cap's cutoff."""

    @abc.abstractmethod
    def deletions(self, table: str, after: str = "", limit: int = 65536) -> Deletions:
        """Up to about `limit` ids logged as deleted after cursor `after` ("": from the oldest kept)."""

    @abc.abstractmethod
    def drops(self, after: str = "", limit: int = 1000) -> Drops:
        """Up to `limit` tables dropped after cursor `after` ("": from the oldest kept), each with
        its time: their rows left with them (the deletion logs record the rows that leave a
        table that stays)."""

    # -- the change log (change_log.py): what a publisher reads ------------------------------

    @abc.abstractmethod
    def change_log(self, table: str) -> int:
        """The ids the table's change log keeps; 0: it keeps none. Raises TableNotFound."""

    @abc.abstractmethod
    def set_change_log(self, table: str, max_ids: int) -> int:
        """Keep a change log of the newest max_ids ids pushed (0: keep none; a log kept goes on,
        its cursors valid); returns max_ids. Raises TableNotFound, or InvalidArgument for a size
        out of range."""

    @abc.abstractmethod
    def changes(self, table: str, after: str = "", limit: int = 65536) -> Changes:
        """Up to about `limit` ids logged as pushed after cursor `after` ("": from the oldest
        kept). Raises InvalidArgument if the table keeps no change log."""

    @abc.abstractmethod
    def record_sweep(self, table: str, result: dict) -> None:
        """Keep a sweep's result (sweeper.SweepResult as a dict) for last_sweep(), seen by every
        PS of the store."""

    @abc.abstractmethod
    def last_sweep(self, table: str) -> dict | None:
        """The table's last sweep result recorded (record_sweep), None if none."""

    def expired_reads(self, table: str) -> int:
        """Rows this store's pulls found expired (and counted as absent) since it started."""
        return 0

    def replica_waits(self) -> dict[str, int]:
        """Writes by what waiting for the backend's replicas said (redis_durable.py): "acked",
        "short" (failed: too few had it), "unreplicated" (no replica to wait for); {} for a
        store without replicas."""
        return {}

    def engine_stats(self) -> dict[str, float]:
        """What the store's engine says of itself, for the PS's metrics (metrics.py, _DiskEngine):
        the disk store's cache lookups, bytes on disk, compactions and write stalls; {} for a
        store without such an engine."""
        return {}

    def take_sweep_lease(self, table: str, owner: str, seconds: float) -> bool:
        """Whether `owner` holds (now, or renewed) the right to sweep the table for `seconds`: one
        sweeper per table among every PS of a store. A store of one process always grants it."""
        return True

    def release_sweep_lease(self, table: str, owner: str) -> None:  # noqa: B027 - a store of one process has none
        """Give up `owner`'s lease on the table's sweep, if it still holds it (a PS that stops
        mid-pass), so that another PS may sweep it at once rather than when the lease runs out."""

    def check_config(self) -> None:  # noqa: B027 - not abstract: most stores have no settings to check
        """Check (and where it may, adjust) the backend's settings for the tables there are; the
        PS calls it once at start. Problems are logged, not raised."""

    def published_versions(self) -> dict[str, tuple[int, float]]:
        """{table: (the published version it holds, when it was cut)}: a serving store's (a
        read-only PS); {} for a store that holds none."""
        return {}

    def reload_if_newer(self) -> bool:
        """Load what another process saved since (a read-only PS over files an applier writes);
        whether it did. A store that another process cannot change under it: nothing."""
        return False

    def ping(self) -> None:  # noqa: B027 - not abstract: a store with nothing to check keeps this no-op
        """Raise BackendUnavailable if the store cannot serve requests now."""

    # whether the rows outlive a loss lost_data reports (the embedded store: in this process)
    serves_after_loss = False

    def lost_data(self) -> str:
        """Why the store no longer holds what this process saw it hold, "" while it does (or
        cannot tell). A store that keeps a marker beside its tables writes it here once it holds
        any, and reports it gone or replaced. Called by the PS's backend watch after each ping.

        Raises:
            BackendUnavailable: the store cannot be asked now.
        """
        return ""

    def close(self) -> None:  # noqa: B027 - not abstract: a store with nothing to release keeps this no-op
        """Release connections and memory."""
