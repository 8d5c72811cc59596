"""PSClient: one object for one or many PS addresses; its methods are the protocol's verbs.

    ps = PSClient(["ps-0:50051", "ps-1:50051"])
    ps.create_table("user", dim=64, state_width=1)
    got = ps.pull("user", ids)            # got.rows (n, 65), got.missing (n,) bool
    ps.push("user", ids, got.rows)
    fut = ps.push_async("user", ids, rows)  # a concurrent.futures.Future

Each verb delegates to the package's layers: the connection and its retries (transport.py, retry.py), ids
sharded over the addresses and cut into messages (sharding.py), per-table call order (ordering.py), rows through
shared memory with a PS on this host (shared_memory.py), row calls built on these (rows.py) and whole-table
streams (streaming.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server.addresses import ps_addresses
from dynemb.ps_server.change_log import Changes
from dynemb.ps_server.client import streaming
from dynemb.ps_server.client.ordering import TableLanes
from dynemb.ps_server.client.results import PullResult, TableInfo
from dynemb.ps_server.client.retry import CallWatch, RetryPolicy
from dynemb.ps_server.client.rows import RowTransfer, as_ids, as_rows
from dynemb.ps_server.client.schema_cache import SchemaCache
from dynemb.ps_server.client.sharding import Sharding
from dynemb.ps_server.client.shared_memory import segment_pools
from dynemb.ps_server.client.transport import Transport
from dynemb.ps_server.errors import InvalidArgument, Unauthenticated, Unavailable
from dynemb.ps_server.lifecycle import Deletions, Drop, Drops, Lifecycle
from dynemb.ps_server.schema import MAX_EXPECTED_ROWS, Initializer, TableSchema

DEFAULT_RETRY = RetryPolicy()
log = logging.getLogger("dynemb.ps.client")


class PSClient:
    """A client of one or several PSes (one per shard of the ids).

    Args:
        addresses: `host:port` per shard (a list, or one string, comma-separated); `a|b` names replicas of a shard.
        auth_token: the PS's shared token (`--auth-token`), sent on every call.
        tls_ca: the CA that signs the PS's certificate, PEM bytes or a file path; implies TLS.
        tls: force TLS on (system CAs when no tls_ca) or off; None: on when tls_ca or tls_cert is given.
        tls_server_name: the name to check the PS's certificate against, when not the address's host.
        tls_cert, tls_key: a client certificate and its key, for a PS that wants mutual TLS.
        timeout: seconds a call may take, retries included, when the call gives none.
        max_message_bytes: the largest message sent or received.
        chunk_bytes: batches bigger than this go out as several messages at once (at most max_message_bytes).
        retry: how a failed call is tried again within its deadline.
        lanes: threads row operations spread over, by table (a table's calls keep their order).
        shared_memory: rows through shared memory: None: with a PS on a loopback address; True: try every PS;
            False: never.
        watch: told of every row and table call's start, retries and end (retry.CallWatch: what a trainer's
            metrics export), so a call blocked on a PS that is away shows while it waits.

    Raises:
        InvalidArgument: no address, a malformed one (addresses.py: the forms), or a TLS setting that cannot be used.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        auth_token: str | None = None,
        tls_ca: str | bytes | None = None,
        tls: bool | None = None,
        tls_server_name: str | None = None,
        tls_cert: str | bytes | None = None,
        tls_key: str | bytes | None = None,
        timeout: float = 60.0,
        max_message_bytes: int = 64 << 20,
        chunk_bytes: int = 16 << 20,
        retry: RetryPolicy = DEFAULT_RETRY,
        lanes: int = 8,
        shared_memory: bool | None = None,
        watch: CallWatch | None = None,
    ) -> None:
        self.addresses = ps_addresses(addresses)  # a mistyped one refused now, not waited on as a PS that is down
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        # Fewer, bigger messages won on 2 cores once replies were built with one copy (bench/RESULTS.md).
        self.chunk_bytes = min(chunk_bytes, max_message_bytes)
        self.retry = retry
        self._transport = Transport(
            self.addresses,
            retry=retry,
            auth_token=auth_token,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
            max_message_bytes=max_message_bytes,
            watch=watch,
        )
        self._sharding = Sharding(len(self.addresses), self.chunk_bytes, max_message_bytes)
        self._lanes = TableLanes(lanes)
        # one segment kept per call that can be in flight: one per lane, and the lane of *_many calls
        self._pools = segment_pools(self._transport, shared_memory, keep=len(self._lanes) + 1)
        self._schemas = SchemaCache(lambda table: self.describe_table(table).schema)
        self._rows = RowTransfer(self._transport, self._sharding, self._pools, self._schemas)

    @property
    def watch(self) -> CallWatch | None:
        """What is told of every call's start, retries and end (see the constructor); settable."""
        return self._transport.watch

    @watch.setter
    def watch(self, watch: CallWatch | None) -> None:
        self._transport.watch = watch

    @property
    def _stubs(self) -> list:
        """Each shard's stub (tests replace a method of one to watch its calls)."""
        return self._transport.stubs

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def schema(self, table: str, refresh: bool = False) -> TableSchema:
        """The table's schema: as this client last saw it, or (refresh) as the PSes describe it now."""
        return self._schemas.get(table, refresh)

    def _remember(self, schema: TableSchema) -> None:
        self._schemas.remember(schema)

    # -- tables -----------------------------------------------------------------

    def create_table(
        self,
        name: str,
        dim: int,
        state_width: int = 0,
        dtype: str = "fp32",
        initializer: Initializer | None = None,
        timeout: float | None = None,
        expected_rows: int = 0,
        lifecycle: Lifecycle | None = None,
        change_log: int = 0,
    ) -> TableInfo:
        """Create the table on every PS; succeeds if it already exists with this schema.

        Args:
            name: the table's name (letters, digits, `_.-`, the first not `.` or `-`: see
                dynemb/common/names.py).
            dim: embedding values per row.
            state_width: optimizer-state values per row, after the embedding.
            dtype: "fp32", "fp16" or "bf16".
            initializer: how rows never pushed are filled [default: zeros].
            timeout: seconds for the whole call, retries included [default: the client's].
            expected_rows: rows the table is expected to hold, over all PSes (each is asked for
                its share); the stores size their layout by it (Redis: compact hashes). Not part
                of the schema: a table that exists keeps what it was created with [default 0:
                the stores' default].
            lifecycle: when its rows expire (TTL, row cap over all PSes): set if the table is
                created now; a table that exists keeps its own (set_lifecycle changes it).
            change_log: ids each PS's change log of the table keeps (set_change_log), if the
                table is created now [default 0: none].

        Returns:
            The schema and the rows the table holds (summed over the PSes).

        Raises:
            InvalidArgument: a bad name, width, dtype or initializer, named.
            TableExists: the table exists with another schema.
        """
        schema = TableSchema(name, dim, state_width, dtype, initializer or Initializer(), expected_rows)
        return self.create_table_from_schema(schema, timeout, lifecycle, change_log)

    def create_table_from_schema(
        self,
        schema: TableSchema,
        timeout: float | None = None,
        lifecycle: Lifecycle | None = None,
        change_log: int = 0,
    ) -> TableInfo:
        """create_table, from a TableSchema (its expected_rows over all PSes: each is asked for its share)."""
        # ids spread evenly over the PSes: each is asked for its share, the shares summing to the whole
        shards = len(self._transport.addresses)
        each, extra = divmod(schema.expected_rows, shards)
        requests = []
        for shard in range(shards):
            spec = schema.to_proto()
            spec.expected_rows = each + (shard < extra)
            if lifecycle is not None and lifecycle.active:
                spec.lifecycle.CopyFrom(self._share(lifecycle, shard).to_proto())
            spec.change_log = change_log
            requests.append((shard, ps_pb2.CreateTableRequest(spec=spec)))
        replies = self._transport.fanout("CreateTable", requests, self._deadline(timeout))
        self._remember(schema)
        lifecycles = [Lifecycle.from_proto(r.table.spec.lifecycle) for r in replies]
        lifecycle = lifecycles[0]._replace(max_rows=sum(lc.max_rows for lc in lifecycles))
        logs = max(r.table.spec.change_log for r in replies)
        return TableInfo(schema, sum(r.table.num_rows for r in replies), lifecycle, change_log=logs)

    def describe_table(self, name: str, timeout: float | None = None) -> TableInfo:
        """The table's schema (expected_rows summed over the PSes), rows and max_rows summed over
        the PSes, its lifecycle and the latest of its sweeps."""
        req = ps_pb2.DescribeTableRequest(table=name)
        replies = self._transport.to_every_shard("DescribeTable", req, self._deadline(timeout))
        infos = [TableInfo.from_proto(r) for r in replies]
        info = infos[0]
        self._remember(info.schema)
        expected = min(MAX_EXPECTED_ROWS, sum(i.schema.expected_rows for i in infos))
        sweeps = [i.last_sweep for i in infos if i.last_sweep is not None]
        return TableInfo(
            dataclasses.replace(info.schema, expected_rows=expected),
            sum(i.num_rows for i in infos),
            info.lifecycle._replace(max_rows=sum(i.lifecycle.max_rows for i in infos)),
            max(sweeps, default=None),
            sum(i.expired_reads for i in infos),
            max(i.change_log for i in infos),
        )

    def _share(self, lifecycle: Lifecycle, shard: int) -> Lifecycle:
        """The lifecycle a shard is asked for: its share of max_rows (ids spread evenly)."""
        each, extra = divmod(lifecycle.max_rows, len(self._transport.addresses))
        return lifecycle._replace(max_rows=each + (shard < extra) if lifecycle.max_rows else 0)

    def set_lifecycle(self, name: str, lifecycle: Lifecycle, timeout: float | None = None) -> TableInfo:
        """Set when the table's rows expire, on every PS (each gets its share of max_rows).

        Args:
            name: the table.
            lifecycle: ttl_s, max_rows (over all PSes), touch_every_s; Lifecycle(): never expire.
            timeout: seconds for the whole call [default: the client's].

        Returns:
            The table's info after (describe_table).

        Raises:
            TableNotFound; InvalidArgument for a setting out of range (named with its limit) or a
            table created by an older version on Redis (its rows carry no stamps).
        """
        calls = [
            (shard, ps_pb2.SetLifecycleRequest(table=name, lifecycle=self._share(lifecycle, shard).to_proto()))
            for shard in range(len(self._transport.addresses))
        ]
        self._transport.fanout("SetLifecycle", calls, self._deadline(timeout))
        return self.describe_table(name, timeout)

    def set_change_log(self, name: str, max_ids: int, timeout: float | None = None) -> TableInfo:
        """Keep (or stop keeping) the table's change log on every PS: the ids pushed, which
        read_changes returns (what a publisher reads: docs/publish.md).

        Args:
            name: the table.
            max_ids: the newest ids each PS's log keeps (4096 to 2^30; change_log.DEFAULT_MAX_IDS
                is 2^24); 0: keep none. A log kept goes on, its cursors valid.
            timeout: seconds for the whole call [default: the client's].

        Returns:
            The table's info after (describe_table).

        Raises:
            TableNotFound; InvalidArgument for a size out of range (named with its limits).
        """
        calls = [
            (shard, ps_pb2.SetChangeLogRequest(table=name, max_ids=max_ids))
            for shard in range(len(self._transport.addresses))
        ]
        self._transport.fanout("SetChangeLog", calls, self._deadline(timeout))
        return self.describe_table(name, timeout)

    def read_changes(self, table: str, after: str = "", limit: int = 65536, timeout: float | None = None) -> Changes:
        """Ids pushed to the table after cursor `after`, oldest first (from its change log).

        Args:
            table: the table (it must keep a change log: set_change_log).
            after: a cursor from an earlier result; "": from the oldest each PS keeps; "$": the
                end now (no ids, the cursor to read from later).
            limit: about the most ids per PS.

        Returns:
            Changes: ids (an id pushed several times comes as often), times, the cursor to read
            on from, and gap (ids logged after `after` are gone: a PS trimmed its log past it, or
            the table was made again; read the whole table instead).

        Raises:
            InvalidArgument: the table keeps no change log, or a cursor not from this table.
        """
        ids, times, cursor, gap = self._read_log("ReadChanges", ps_pb2.ReadChangesRequest, table, after, limit, timeout)
        return Changes(ids, times, cursor, gap)

    def _read_log(self, method: str, request: type, table: str, after: str, limit: int, timeout: float | None):
        """(ids, times, cursor, gap) of a table's log on every PS: ReadChanges or ReadDeletions."""
        cursors = self._cursors(after, "log")
        calls = [(shard, request(table=table, after=c, limit=limit)) for shard, c in enumerate(cursors)]
        replies = self._transport.fanout(method, calls, self._deadline(timeout))
        return (
            np.concatenate([np.frombuffer(r.ids, "<i8").astype(np.int64) for r in replies]),
            np.concatenate([np.frombuffer(r.times, "<f8").astype(np.float64) for r in replies]),
            ",".join(r.cursor for r in replies),
            any(r.gap for r in replies),
        )

    def _cursors(self, after: str, log: str) -> list[str]:
        """Each PS's part of a log cursor (joined by commas; "" and "$" stand for every PS's)."""
        shards = len(self._transport.addresses)
        cursors = after.split(",") if after and after != "$" else [after] * shards
        if len(cursors) != shards:
            raise InvalidArgument(f"{log} cursor {after[:80]!r} is for {len(cursors)} PSes, not {shards}")
        return cursors

    def touch(self, table: str, ids, timeout: float | None = None) -> tuple[int, int]:
        """Mark rows in use now that the PS does not see used (rows resident on a trainer), so
        that they do not expire.

        Returns:
            (how many of the ids are stored, the seconds within which to touch them again: 0 if
            the table's rows do not expire).
        """
        ids = as_ids(ids)
        pieces = self._sharding.split_ids(ids, 8)
        calls = [(shard, ps_pb2.TouchRequest(table=table, ids=i.tobytes())) for shard, _, i in pieces]
        if not calls:  # no ids: each PS still says whether the table's rows expire
            calls = [(shard, ps_pb2.TouchRequest(table=table)) for shard in range(len(self._transport.addresses))]
        replies = self._transport.fanout("Touch", calls, self._deadline(timeout))
        every = min((r.touch_every_s for r in replies), default=0)
        return sum(r.rows_stored for r in replies), every

    def read_drops(self, after: str = "", limit: int = 1000, timeout: float | None = None) -> Drops:
        """Tables dropped after cursor `after`, by time (every row of each left with it; a drop
        of a table on several PSes with stores of their own shows once for each).

        Returns:
            Drops: the tables and when, the cursor to read on from, and gap (a PS trimmed its
            log past `after`).
        """
        cursors = self._cursors(after, "drop log")
        calls = [(shard, ps_pb2.ReadDropsRequest(after=c, limit=limit)) for shard, c in enumerate(cursors)]
        replies = self._transport.fanout("ReadDrops", calls, self._deadline(timeout))
        merged = sorted((Drop(d.table, d.time) for r in replies for d in r.drops), key=lambda d: d.time)
        return Drops(merged, ",".join(r.cursor for r in replies), any(r.gap for r in replies))

    def read_deletions(
        self, table: str, after: str = "", limit: int = 65536, timeout: float | None = None
    ) -> Deletions:
        """Ids that left the table (expired, deleted) after cursor `after`, oldest first.

        Args:
            table: the table.
            after: a cursor from an earlier result ("": from the oldest each PS keeps).
            limit: about the most ids per PS.

        Returns:
            Deletions: ids, times, the cursor to read on from, and gap (a PS trimmed its log past
            `after`: some deletions are no longer there). An id stored again since is stored.
        """
        ids, times, cursor, gap = self._read_log(
            "ReadDeletions", ps_pb2.ReadDeletionsRequest, table, after, limit, timeout
        )
        return Deletions(ids, times, cursor, gap)

    def list_tables(self, timeout: float | None = None) -> list[TableInfo]:
        """Every table, by name, its rows summed over the PSes."""
        replies = self._transport.to_every_shard("ListTables", ps_pb2.ListTablesRequest(), self._deadline(timeout))
        merged: dict[str, TableInfo] = {}
        for reply in replies:
            for t in reply.tables:
                info = TableInfo.from_proto(t)
                prev = merged.get(info.schema.name)
                if prev is not None:
                    expected = min(MAX_EXPECTED_ROWS, info.schema.expected_rows + prev.schema.expected_rows)
                    schema = dataclasses.replace(info.schema, expected_rows=expected)
                    info = TableInfo(schema, info.num_rows + prev.num_rows)
                merged[info.schema.name] = info
        return [merged[k] for k in sorted(merged)]

    def drop_table(self, name: str, missing_ok: bool = False, timeout: float | None = None) -> int:
        """Drop the table on every PS; returns the rows dropped."""
        req = ps_pb2.DropTableRequest(table=name, missing_ok=missing_ok)
        replies = self._transport.to_every_shard("DropTable", req, self._deadline(timeout))
        self._schemas.forget(name)
        return sum(r.rows_dropped for r in replies)

    # -- rows: a table's calls take effect in call order (ordering.py) -----------

    def pull(self, table: str, ids, timeout: float | None = None) -> PullResult:
        """The table's rows for ids, in their order.

        Args:
            table: the table's name.
            ids: int64 IDs (any array-like); they are sharded over the PSes and chunked.
            timeout: seconds for the whole call, retries included [default: the client's].

        Returns:
            rows (n, dim + state_width), with `embeddings`, `state` and `missing` (ids never
            pushed, whose rows come initialised).

        Raises:
            TableNotFound, InvalidArgument, DeadlineExceeded, Unavailable (ps_server/errors.py).
        """
        return self.pull_async(table, ids, timeout).result()

    def push(self, table: str, ids, rows, timeout: float | None = None) -> int:
        """Write one row per id (a repeated id's last row wins).

        Args:
            table: the table's name.
            ids: int64 IDs, n of them.
            rows: (n, dim + state_width) values, converted to the table's dtype.
            timeout: seconds for the whole call, retries included [default: the client's].

        Returns:
            The rows given (all are written once the call returns).

        Raises:
            TableNotFound, InvalidArgument, DeadlineExceeded, Unavailable (ps_server/errors.py).
        """
        return self._submit_push(table, ids, rows, timeout, copy=False).result()  # waited for: no copy

    def delete(self, table: str, ids, timeout: float | None = None) -> int:
        """Delete ids' rows; returns how many there were."""
        return self.delete_async(table, ids, timeout).result()

    def pull_async(self, table: str, ids, timeout: float | None = None) -> Future[PullResult]:
        """pull() without waiting: a Future of its PullResult."""
        ids = as_ids(ids)
        return self._lanes.submit(table, self._rows.pull, table, ids, self._deadline(timeout))

    def push_async(self, table: str, ids, rows, timeout: float | None = None) -> Future[int]:
        """push() without waiting: a Future of the rows written."""
        return self._submit_push(table, ids, rows, timeout, copy=True)  # the caller may reuse its buffer

    def _submit_push(self, table: str, ids, rows, timeout: float | None, copy: bool) -> Future[int]:
        ids = as_ids(ids)
        rows = as_rows(table, ids, rows, copy)
        return self._lanes.submit(table, self._rows.push, table, ids, rows, self._deadline(timeout))

    def delete_async(self, table: str, ids, timeout: float | None = None) -> Future[int]:
        """delete() without waiting: a Future of the rows deleted."""
        ids = as_ids(ids)
        return self._lanes.submit(table, self._rows.delete, table, ids, self._deadline(timeout))

    def pull_many(self, ids_by_table: Mapping[str, object], timeout: float | None = None) -> dict[str, PullResult]:
        """Several tables' pulls in one call per PS: {table: ids} -> {table: PullResult}."""
        return self.pull_many_async(ids_by_table, timeout).result()

    def push_many(self, rows_by_table: Mapping[str, tuple[object, object]], timeout: float | None = None) -> int:
        """Several tables' pushes in one call per PS: {table: (ids, rows)}; rows written."""
        return self._submit_push_many(rows_by_table, timeout, copy=False).result()  # waited for: no copy

    def pull_many_async(
        self, ids_by_table: Mapping[str, object], timeout: float | None = None
    ) -> Future[dict[str, PullResult]]:
        """pull_many() without waiting: a Future of {table: PullResult}."""
        wanted = {table: as_ids(ids) for table, ids in ids_by_table.items()}
        return self._lanes.submit_many(wanted, self._rows.pull_many, wanted, self._deadline(timeout))

    def push_many_async(
        self, rows_by_table: Mapping[str, tuple[object, object]], timeout: float | None = None
    ) -> Future[int]:
        """push_many() without waiting: a Future of the rows written."""
        return self._submit_push_many(rows_by_table, timeout, copy=True)  # the caller may reuse its buffers

    def push_then_pull_many_async(
        self,
        rows_by_table: Mapping[str, tuple[object, object]],
        ids_by_table: Mapping[str, object],
        timeout: float | None = None,
    ) -> tuple[Future[int], Future[dict[str, PullResult]]]:
        """push_many_async, then pull_many_async, in one hand-off to the lanes' thread: the pull runs
        once the push is done (whatever its outcome), as the two calls made in that order would.
        A trainer's step moves its rows so: a hand-off less saves ~0.2 ms of its CPU a step on 2
        cores (bench/RESULTS.md). The rows are not copied: leave them unchanged until the push's
        future is done.

        Returns:
            The push's future (rows written) and the pull's ({table: PullResult}).
        """
        given = {}
        for table, (ids, rows) in rows_by_table.items():
            ids = as_ids(ids)
            given[table] = (ids, as_rows(table, ids, rows, copy=False))
        wanted = {table: as_ids(ids) for table, ids in ids_by_table.items()}
        deadline = self._deadline(timeout)
        pushed: Future[int] = Future()
        pulled: Future[dict[str, PullResult]] = Future()

        def push_then_pull() -> None:
            _outcome_into(pushed, self._rows.push_many, given, deadline)
            _outcome_into(pulled, self._rows.pull_many, wanted, deadline)

        self._lanes.submit_many([*given, *wanted], push_then_pull)
        return pushed, pulled

    def _submit_push_many(
        self, rows_by_table: Mapping[str, tuple[object, object]], timeout: float | None, copy: bool
    ) -> Future[int]:
        given = {}
        for table, (ids, rows) in rows_by_table.items():
            ids = as_ids(ids)
            given[table] = (ids, as_rows(table, ids, rows, copy))
        return self._lanes.submit_many(given, self._rows.push_many, given, self._deadline(timeout))

    # -- whole tables -----------------------------------------------------------

    def export(
        self, table: str, rows_per_chunk: int = 0, timeout: float | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (ids, rows) of the table, PS by PS, in chunks."""
        schema = self.schema(table, refresh=True)
        yield from streaming.export_rows(self._transport, schema, rows_per_chunk, timeout, self.timeout)

    def import_rows(
        self,
        schema: TableSchema,
        chunks: Iterable[tuple[np.ndarray, np.ndarray]],
        replace: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Create the table where absent and write every (ids, rows) chunk, each id to its PS.

        With replace=True each PS first deletes the table's rows. Returns rows written.
        """
        return self._lanes.submit(schema.name, self._import, schema, chunks, replace, timeout).result()

    def _import(self, schema: TableSchema, chunks, replace: bool, timeout: float | None) -> int:
        # Create the table (or find it with this schema) on every PS first: a clash of schemas or a row too big
        # for a message is refused before a chunk of the source is read, whatever the timing of the streams'
        # first replies.
        self.create_table_from_schema(schema, timeout)
        written = streaming.import_rows(self._transport, self._sharding, schema, chunks, replace, timeout, self.timeout)
        self._remember(schema)
        return written

    # -- service ----------------------------------------------------------------

    def stats(self, timeout: float | None = None) -> list[ps_pb2.StatsResponse]:
        """Each PS's StatsResponse, in address order."""
        return self._transport.to_every_shard("Stats", ps_pb2.StatsRequest(), self._deadline(timeout))

    def health(self, timeout: float = 5.0, service: str = "") -> list[str]:
        """Each PS's health status name (SERVING, NOT_SERVING...) or the error reaching it.

        Args:
            timeout: seconds to wait for each PS.
            service: the health service asked about: "" (the PS can serve: follows its store),
                "liveness" (the process is alive).
        """
        return self._transport.health(timeout, service)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every PS answers health checks with SERVING; says once in the log that it waits.

        Raises:
            Unauthenticated: a PS refuses this client's health checks (waiting will not help).
            Unavailable: not every PS was SERVING within timeout seconds.
        """
        deadline = time.monotonic() + timeout
        waiting = False
        while True:
            status = self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            if all(s == "SERVING" for s in status):
                return
            refused = [f"{a}: {s}" for a, s in zip(self.addresses, status) if s.startswith("UNAUTHENTICATED")]
            if refused:  # waiting will not bring the token: say so now
                raise Unauthenticated(f"PS refuses this client's health checks: {'; '.join(refused)}")
            not_ready = "; ".join(f"{a}: {s}" for a, s in zip(self.addresses, status) if s != "SERVING")
            if time.monotonic() > deadline:
                raise Unavailable(f"PS not ready after {timeout:g} s: {not_ready}")
            if not waiting:  # a PS still starting is normal; one mistyped or down should not wait in silence
                log.warning("waiting up to %.0f s for the PS to be ready: %s", timeout, not_ready)
                waiting = True
            time.sleep(0.1)

    def close(self) -> None:
        """Finish the calls submitted, detach shared memory and close the channels."""
        self._lanes.close()
        for pool in self._pools:
            if pool is not None:
                pool.close()
        self._transport.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _outcome_into(future: Future, fn, *args) -> None:
    """fn(*args)'s result or exception into future."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
        future.set_exception(e)
