"""The parameter server as the trainer sees it: create a table, pull rows, push rows.

- RemoteRowStore: the gRPC PS (one or many addresses) through ps_server.client.PSClient.
- LocalRowStore: the embedded store inside the trainer's own process (no gRPC in the way),
  rows of never-pushed IDs initialised exactly as the PS does. In a job of several ranks each
  rank has one of its own (per_rank) holding the rows of the IDs it owns (owner_of): only an
  ID's owner moves its rows (the sharded ID transformer), so the ranks never need each
  other's, and a step's pulls and pushes cost no process hop, no gRPC and no copy between
  processes.
Both return float32 rows of width dim + optimizer-state width. The *_many_async verbs move
several tables' rows at once and return futures: the remote store makes one call per PS (in
order with every other call on those tables); the local one runs them at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch.distributed as dist

from dynemb.ps_server.backends.base import rows_out
from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.client import CallWatch, PSClient, RetryPolicy
from dynemb.ps_server.initializer import fill_initial_rows
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import TableSchema

if TYPE_CHECKING:
    from dynemb.ps_server.sweeper import Sweeper

EMBEDDED = ("embedded", "embedded://")  # what open_store takes for the embedded store, beside None


class RowStore:
    """Where the trainer's tables keep their rows; the methods below are the contract.

    Rows are (n, dim + optimizer-state width), those of never-pushed ids initialised as the PS
    does.
    """

    # True: each rank of the job has a store of its own, holding the rows of the IDs that rank
    # owns; False: one PS that every rank shares
    per_rank = False

    def create_table(self, schema: TableSchema) -> None:
        """Create the table; nothing to do if it exists with this schema."""
        raise NotImplementedError

    def tables(self) -> dict[str, tuple[TableSchema, int]]:
        """{name: (schema, rows)} of every table the store holds."""
        raise NotImplementedError

    def drop_table(self, table: str) -> None:
        """Drop the table and its rows; nothing to do if there is none."""
        raise NotImplementedError

    @property
    def where(self) -> str:
        """Where the rows are, as messages name it ("the PS host:port", "the embedded store")."""
        raise NotImplementedError

    def lifecycle(self, table: str) -> Lifecycle:
        """When the table's rows expire (Lifecycle(): never); max_rows over the whole store."""
        raise NotImplementedError

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> None:
        """Set when the table's rows expire (dynemb/ps_server/lifecycle.py)."""
        raise NotImplementedError

    def touch(self, table: str, ids: np.ndarray) -> tuple[int, int]:
        """Mark the rows of ids in use now (resident on this rank): (how many are stored, the
        seconds within which to touch them again; 0 if the table's rows do not expire)."""
        raise NotImplementedError

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The rows of ids, in their order."""
        raise NotImplementedError

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Write one row per id (a repeated id's last row wins)."""
        raise NotImplementedError

    def export(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (ids, rows) the table holds, in chunks."""
        raise NotImplementedError

    def replace(self, schema: TableSchema, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """The table (created where absent) holds exactly the rows of `chunks` afterwards."""
        raise NotImplementedError

    def load(self, schema: TableSchema, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Write every row of `chunks` into the table (created where absent), its other rows
        kept: what several ranks do to fill one table together. Returns the rows written."""
        self.create_table(schema)
        n = 0
        for ids, rows in chunks:
            self.push(schema.name, ids, rows)
            n += len(ids)
        return n

    def push_many_async(self, rows_by_table: dict[str, tuple[np.ndarray, np.ndarray]]) -> Future:
        """Several tables' pushes at once (the remote store: one call per PS)."""

        def push_all() -> None:
            for table, (ids, rows) in rows_by_table.items():
                self.push(table, ids, rows)

        return _done(push_all)

    def pull_many_async(self, ids_by_table: dict[str, np.ndarray]) -> Future:
        """{table: rows} of several tables' pulls at once."""
        return _done(lambda: {t: self.pull(t, ids) for t, ids in ids_by_table.items()})

    def push_then_pull_many_async(
        self, rows_by_table: dict[str, tuple[np.ndarray, np.ndarray]], ids_by_table: dict[str, np.ndarray]
    ) -> tuple[Future | None, Future | None]:
        """push_many_async(rows_by_table), then pull_many_async(ids_by_table): a step's row moves.
        The pull sees the push. Each future is None where it has no tables; the rows are read
        while the push runs: leave them unchanged until its future is done."""
        push = self.push_many_async(rows_by_table) if rows_by_table else None
        pull = self.pull_many_async(ids_by_table) if ids_by_table else None
        return push, pull

    def watch_calls(self, watch: CallWatch) -> None:
        """Tell `watch` of the store's calls from now on: their retries, failures and waits (a
        trainer's metrics export them). A store in this process makes no calls to watch."""

    def close(self) -> None:
        """Release the store (connections, memory)."""
        pass


def _done(fn, *args) -> Future:
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - handed to the caller through the future
        f.set_exception(e)
    return f


def _then(inner: Future, fn) -> Future:
    """A future of fn(inner's result), or of inner's exception."""
    fut: Future = Future()

    def finish(f: Future) -> None:
        if f.exception() is not None:
            fut.set_exception(f.exception())
        else:
            fut.set_result(fn(f.result()))

    inner.add_done_callback(finish)
    return fut


class LocalRowStore(RowStore):
    """The embedded store inside this process: no gRPC between the trainer and its rows.

    Args:
        store: the store to use; None makes an empty in-memory one.
        per_rank: whether each rank has one of its own (see RowStore).
    """

    def __init__(self, store: EmbeddedStore | None = None, per_rank: bool = False) -> None:
        self.store = store or EmbeddedStore()
        self.per_rank = per_rank
        self._sweeper: Sweeper | None = None

    def create_table(self, schema: TableSchema) -> None:
        """See RowStore.create_table."""
        self.store.create_table(schema)

    def tables(self) -> dict[str, tuple[TableSchema, int]]:
        """See RowStore.tables."""
        return {t.name: (t, self.store.num_rows(t.name)) for t in self.store.list_tables()}

    def drop_table(self, table: str) -> None:
        """See RowStore.drop_table."""
        self.store.drop_table(table)

    @property
    def where(self) -> str:
        """See RowStore.where."""
        return "the embedded store"

    def lifecycle(self, table: str) -> Lifecycle:
        """See RowStore.lifecycle."""
        return self.store.lifecycle(table)

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> None:
        """See RowStore.set_lifecycle; a sweeper thread of this process then deletes what is due
        (the PS's own, when the rows are on a PS)."""
        self.store.set_lifecycle(table, lifecycle)
        if lifecycle.active and self._sweeper is None:
            from dynemb.ps_server.sweeper import Sweeper

            self._sweeper = Sweeper(self.store)
            self._sweeper.start()

    def touch(self, table: str, ids: np.ndarray) -> tuple[int, int]:
        """See RowStore.touch."""
        stored = self.store.touch(table, ids)
        lifecycle = self.store.lifecycle(table)
        return stored, lifecycle.touch_interval_s if lifecycle.active else 0

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        """See RowStore.pull."""
        schema = self.store.schema(table)
        rows = rows_out(None, len(ids), schema)
        missing = self.store.pull_into(table, ids, rows)
        if len(missing):
            fill_initial_rows(schema, ids[missing], rows, missing)
        return rows

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """See RowStore.push; rows are converted to float32."""
        self.store.push(table, ids, np.ascontiguousarray(rows, dtype=np.float32))

    def export(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """See RowStore.export (chunks of 65536 rows)."""
        return self.store.export(table, 1 << 16)

    def replace(self, schema: TableSchema, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """See RowStore.replace."""
        self.store.create_table(schema)
        self.store.clear(schema.name)
        for ids, rows in chunks:
            self.push(schema.name, ids, rows)

    def close(self) -> None:
        """Close the embedded store (which saves it if it has a directory)."""
        if self._sweeper is not None:
            self._sweeper.stop()
        self.store.close()


class RemoteRowStore(RowStore):
    """The PS over gRPC, through a PSClient; waits until the PSes are ready, for as long as one
    of its calls would retry them (the client's timeout).

    Args:
        addresses: the PSes' addresses, comma-separated (one per shard; the forms: ps_server/addresses.py).
        **client_args: passed to PSClient.

    Raises:
        InvalidArgument: a malformed address, at once.
        Unavailable: a PS not ready within the client's timeout.
    """

    def __init__(self, addresses: str, **client_args) -> None:
        self.client = PSClient(addresses, **client_args)
        try:
            self.client.wait_ready(self.client.timeout)
        except BaseException:
            self.client.close()
            raise

    def create_table(self, schema: TableSchema) -> None:
        """See RowStore.create_table."""
        self.client.create_table_from_schema(schema)

    def tables(self) -> dict[str, tuple[TableSchema, int]]:
        """See RowStore.tables."""
        return {i.schema.name: (i.schema, i.num_rows) for i in self.client.list_tables()}

    def drop_table(self, table: str) -> None:
        """See RowStore.drop_table."""
        self.client.drop_table(table, missing_ok=True)

    @property
    def where(self) -> str:
        """See RowStore.where."""
        return "the PS " + ",".join(self.client.addresses)

    def lifecycle(self, table: str) -> Lifecycle:
        """See RowStore.lifecycle."""
        return self.client.describe_table(table).lifecycle

    def set_lifecycle(self, table: str, lifecycle: Lifecycle) -> None:
        """See RowStore.set_lifecycle: on every PS (each its share of max_rows)."""
        self.client.set_lifecycle(table, lifecycle)

    def touch(self, table: str, ids: np.ndarray) -> tuple[int, int]:
        """See RowStore.touch."""
        return self.client.touch(table, ids)

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        """See RowStore.pull."""
        return self.client.pull(table, ids).rows

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """See RowStore.push; rows are converted to float32."""
        self.client.push(table, ids, np.ascontiguousarray(rows, dtype=np.float32))

    def export(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """See RowStore.export."""
        return self.client.export(table)

    def replace(self, schema: TableSchema, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """See RowStore.replace: one import with replace=True."""
        self.client.import_rows(schema, chunks, replace=True)

    def load(self, schema: TableSchema, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """See RowStore.load: one streaming import, nothing cleared."""
        return self.client.import_rows(schema, chunks, replace=False)

    def push_many_async(self, rows_by_table: dict[str, tuple[np.ndarray, np.ndarray]]) -> Future:
        """See RowStore.push_many_async: one call per PS; the future's result is the rows written."""
        return self.client.push_many_async(_float32_rows(rows_by_table))

    def pull_many_async(self, ids_by_table: dict[str, np.ndarray]) -> Future:
        """See RowStore.pull_many_async: one call per PS."""
        return _then(self.client.pull_many_async(ids_by_table), _rows_of)

    def push_then_pull_many_async(
        self, rows_by_table: dict[str, tuple[np.ndarray, np.ndarray]], ids_by_table: dict[str, np.ndarray]
    ) -> tuple[Future | None, Future | None]:
        """See RowStore.push_then_pull_many_async: both calls in one hand-off to the client's thread
        (PSClient.push_then_pull_many_async), the rows not copied."""
        if not rows_by_table or not ids_by_table:
            return super().push_then_pull_many_async(rows_by_table, ids_by_table)
        pushed, pulled = self.client.push_then_pull_many_async(_float32_rows(rows_by_table), ids_by_table)
        return pushed, _then(pulled, _rows_of)

    def watch_calls(self, watch: CallWatch) -> None:
        """See RowStore.watch_calls: every call of the PS client."""
        self.client.watch = watch

    def close(self) -> None:
        """Close the PS client."""
        self.client.close()


def open_store(
    where: str | None,
    *,
    timeout: float = 600.0,
    attempt_timeout: float = 30.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> RowStore:
    """Where a job's rows live.

    Args:
        where: None, "embedded" or "embedded://": the embedded store in this process (under
            torchrun one per rank, holding the rows of the IDs that rank owns); else the PS
            addresses, "host:port" comma-separated ('a|b': replicas of one shard), checked at once.
        timeout: how long opening waits for the PSes to be ready, and one PS call keeps retrying
            a PS that is down or hangs (every call is idempotent, so it is simply tried again).
        attempt_timeout: how long one try may take before it is abandoned and retried.
        tls_ca, tls_cert, tls_key: PEM files for a TLS PS (the auth token comes from
            DYNEMB_PS_AUTH_TOKEN).
    """
    if where is None or where.strip() in EMBEDDED:
        return LocalRowStore(per_rank=dist.get_world_size() > 1)
    return RemoteRowStore(
        where,
        timeout=timeout,
        # tries at most 2 s apart: a PS back is used within about that (each try that finds it
        # away fails at once, so trying often costs nothing)
        retry=RetryPolicy(attempts=None, max_backoff=2.0, attempt_timeout=attempt_timeout),
        auth_token=os.environ.get("DYNEMB_PS_AUTH_TOKEN") or None,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
    )


def _float32_rows(rows_by_table: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{table: (ids, rows)} with the rows as the PS's float32, contiguous (copied only if not already)."""
    return {t: (ids, np.ascontiguousarray(rows, dtype=np.float32)) for t, (ids, rows) in rows_by_table.items()}


def _rows_of(got: dict) -> dict[str, np.ndarray]:
    """{table: rows} of a pull_many's {table: PullResult}."""
    return {t: r.rows for t, r in got.items()}
