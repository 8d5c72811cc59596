"""The ParameterServer gRPC service: validates each request, calls the store, reports.

Every handler runs inside `_call`, which turns PSError into its gRPC status with the
message intact, turns anything unexpected into INTERNAL (logged with its traceback),
and records the request in the metrics. Requests arrive as bytes and are decoded here,
so bytes that are no valid message get INVALID_ARGUMENT too. No request can take the
server down, and a request that fails validation changes nothing stored.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from dynemb.common.version import __version__
from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server import codec
from dynemb.ps_server.backend_watch import LossWatch
from dynemb.ps_server.backends.base import Store
from dynemb.ps_server.burst_log import BurstLog
from dynemb.ps_server.change_log import checked_max_ids
from dynemb.ps_server.entries import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_IDS,
    ID_BYTES,
    PulledTable,
    RowEntries,
    TooManyEntries,
    copy_ranges,
    parse_row_entries,
    pull_many_reply,
    pull_many_reply_size,
    push_many_reply,
)
from dynemb.ps_server.errors import (
    Abandoned,
    BackendUnavailable,
    DataLoss,
    InvalidArgument,
    PSError,
    ReadOnly,
    ResourceExhausted,
    ShuttingDown,
    TableNotFound,
)
from dynemb.ps_server.initializer import check_initializer_fits, fill_initial_rows
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.metrics import PSMetrics
from dynemb.ps_server.schema import TableSchema, check_name
from dynemb.ps_server.shm import SegmentTable
from dynemb.ps_server.wire import (
    MESSAGE_OVERHEAD,
    MalformedMessage,
    ReplyPlan,
    build_pull_response,
    parse_push_request,
)

log = logging.getLogger("dynemb.ps")

# The widest rows (dim + state_width values) a table may have unless --max-row-width says otherwise:
# room for a dim of 4096 with two optimizer states per value (Adam), and a 64 MiB message still
# carries a thousand fp32 rows of it.
DEFAULT_MAX_ROW_WIDTH = 16384
# The calls a read-only PS refuses.
WRITES = frozenset(
    {"CreateTable", "DropTable", "Push", "PushMany", "Delete", "Import", "SetLifecycle", "SetChangeLog", "Touch"}
)
# The calls that never reach the store: answered while it is away.
WITHOUT_STORE = frozenset({"AttachSegment", "DetachSegment"})
# Ids a ReadDeletions or ReadChanges reply carries when the request names no limit.
DELETIONS_PER_READ = 65536
# Room left in a message for everything but the packed ids and rows.
DEFAULT_EXPORT_CHUNK_BYTES = 4 << 20
# A status message travels in metadata, which the client takes up to 16 KiB of: a longer one
# arrives as RESOURCE_EXHAUSTED "received metadata size exceeds hard limit", the real error lost.
MAX_DETAILS_CHARS = 4000


def _details(text: str) -> str:
    """An error message cut to fit the client's metadata limit (what it quotes is capped by
    shown() already; this catches a message built from anything else, like an unexpected
    exception's)."""
    if len(text) <= MAX_DETAILS_CHARS:
        return text
    return f"{text[:MAX_DETAILS_CHARS]}... (cut from {len(text)} characters)"


def _serialize(message_type):
    def serialize(message) -> bytes:
        return message if isinstance(message, bytes) else message_type.SerializeToString(message)

    return serialize


def _undecodable(method: str, request_type, data: bytes) -> InvalidArgument:
    return InvalidArgument(
        f"{method}: the request ({len(data)} bytes) is not a valid {request_type.DESCRIPTOR.full_name} message "
        f"(corrupt bytes, or a client built from another dynemb/protos/ps.proto)"
    )


_IN_PLACE = {"Push": parse_push_request}
# the batch requests, read as columns (entries.py): (segment ref's field, rows' field) of an entry
_ENTRIES = {"PullMany": (3, 0), "PushMany": (4, 3)}


def _decoding(servicer: ParameterServerService, name: str, handler, request_type, streaming: bool):
    """`handler` taking the request as bytes: grpc's own decoding step would answer bytes that
    are no valid message with INTERNAL "Exception deserializing request!"."""
    if streaming:

        def decoded(chunks):
            for data in chunks:
                try:
                    yield request_type.FromString(data)
                except DecodeError:
                    raise _undecodable(name, request_type, data) from None  # inside the handler's _call

        return lambda chunks, context: handler(decoded(chunks), context)

    # the row-carrying requests are read in place (wire.py): no copy of their rows
    parse = _IN_PLACE.get(name, request_type.FromString)
    if name in _ENTRIES:
        ref_field, rows_field = _ENTRIES[name]

        def parse(data):  # entries past the limit are counted, never read
            return parse_row_entries(data, ref_field, rows_field, servicer.max_request_entries)

    def handle(data, context):
        try:
            request = parse(data)
        except (DecodeError, MalformedMessage):
            with servicer._call(name, context):  # answered and counted like any refused request
                raise _undecodable(name, request_type, data) from None
        except TooManyEntries as exc:
            with servicer._call(name, context):
                raise ResourceExhausted(
                    f"{name} of {exc.count} entries is over this PS's limit of {servicer.max_request_entries} "
                    f"entries per request (--max-request-entries); send them in several"
                ) from None
        return handler(request, context)

    return handle


def _admitted(servicer: ParameterServerService, name: str, handler, server_streaming: bool):
    """`handler` counted in the service's calls in flight, or refused with UNAVAILABLE once the
    service drains (ParameterServerService.drain): a call is either served whole or refused
    with a status clients retry, never cut off by the server's shutdown."""

    def refuse(context) -> None:
        with servicer._call(name, context):
            raise ShuttingDown(
                f"{name} refused: this PS is shutting down (SIGTERM); retry here once it is back, or on a replica"
            )

    if server_streaming:

        def handle_stream(request, context):
            if not servicer._enter():
                refuse(context)

            def stream():
                try:
                    yield from handler(request, context)
                finally:
                    servicer._leave()

            return stream()

        return handle_stream

    def handle(request, context):
        if not servicer._enter():
            refuse(context)
        try:
            return handler(request, context)
        finally:
            servicer._leave()

    return handle


def add_to_server(servicer: ParameterServerService, server: grpc.Server) -> None:
    """Register the service like the generated add_..._to_server, except that requests are
    decoded by the handler (see _decoding) and a handler may return an already serialized
    reply (bytes), as Pull does."""
    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {}
    for method in service.methods:
        request_type = getattr(ps_pb2, method.input_type.name)
        response_type = getattr(ps_pb2, method.output_type.name)
        handler = _admitted(
            servicer,
            method.name,
            _decoding(servicer, method.name, getattr(servicer, method.name), request_type, method.client_streaming),
            method.server_streaming,
        )
        handlers[method.name] = factories[(method.client_streaming, method.server_streaming)](
            handler, request_deserializer=None, response_serializer=_serialize(response_type)
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class _StoreTimer:
    """`with`: the time inside goes to a backend-latency histogram (a class, not a generator
    context manager: it is cheaper). Row calls sum their store time in a _Tally instead."""

    __slots__ = ("histogram", "start")

    def __init__(self, histogram) -> None:
        self.histogram = histogram

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.histogram.observe(time.perf_counter() - self.start)


class _Tally:
    """What a row call's entries would report one by one, summed and reported once when the
    call ends: a PullMany of 26 tables made ~100 metric updates (prometheus_client checks and
    locks on each), ~15% of its time. Rows stay per table (their label); store time per
    operation and payload bytes go per call."""

    __slots__ = ("seconds", "bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.bytes_in = self.bytes_out = 0

    def store_time(self, op: str, start: float) -> None:
        self.seconds[op] = self.seconds.get(op, 0.0) + (time.perf_counter() - start)

    def report(self, m: PSMetrics, method: str) -> None:
        for op, seconds in self.seconds.items():
            m.child(m.backend_latency, op).observe(seconds)
        if self.bytes_in:
            m.child(m.bytes, method, "in").inc(self.bytes_in)
        if self.bytes_out:
            m.child(m.bytes, method, "out").inc(self.bytes_out)


class ParameterServerService(ps_pb2_grpc.ParameterServerServicer):
    """The ParameterServer RPCs of ps.proto over one store; each handler is the RPC of its name.

    Args:
        store: where the rows are.
        metrics: where each request is recorded.
        max_message_bytes: the gRPC message limit: larger tables and replies are refused.
        segments: shared-memory segments attached to this PS; None takes none.
        max_row_width: the most values (dim + state_width) a row of a table created here may have.
        max_request_bytes: the most bytes of rows one pull or push may ask for or carry, in its
            messages or through shared memory [default: max_message_bytes].
        max_request_entries: the most entries (tables' pulls or pushes) one PullMany or PushMany may have.
        max_request_ids: the most ids one request may carry, over all its entries.
        read_only: refuse every call that writes (ReadOnly), and pull ids not stored as zeros,
            not initialised (a PS serving published tables).
        store_away: why the store counts as away now ("" while it answers: BackendWatch);
            calls that reach the store are refused with that reason meanwhile, at once,
            rather than each waiting out the store's socket timeouts.
        loss: whether the store lost its data (backend_watch.LossWatch): calls that reach the
            store are refused with DATA_LOSS from then on; a table not found asks it at once.
    """

    def __init__(
        self,
        store: Store,
        metrics: PSMetrics,
        max_message_bytes: int,
        segments: SegmentTable | None = None,
        max_row_width: int = DEFAULT_MAX_ROW_WIDTH,
        max_request_bytes: int | None = None,
        max_request_entries: int = DEFAULT_MAX_ENTRIES,
        max_request_ids: int = DEFAULT_MAX_IDS,
        read_only: bool = False,
        store_away: Callable[[], str] = str,
        loss: LossWatch | None = None,
    ) -> None:
        self.store = store
        self.loss = loss
        self.read_only = read_only
        self.store_away = store_away
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.max_row_width = max_row_width
        self.max_request_bytes = max_message_bytes if max_request_bytes is None else max_request_bytes
        self.max_request_entries = max_request_entries
        self.max_request_ids = max_request_ids
        self.segments = segments if segments is not None else SegmentTable(0, 0.0)  # 0 bytes: none taken
        self.started = time.time()
        # a checkpoint's exports, a restore's imports: one log line a burst, not one a table
        self.exported, self.imported = BurstLog("exported"), BurstLog("imported")
        self._in_flight = 0  # calls admitted (see _admitted) and not yet done
        self._idle = threading.Condition()
        self.draining = False

    # -- drain ------------------------------------------------------------------

    def _enter(self) -> bool:
        """Count a call in; False once draining (the call is refused)."""
        with self._idle:
            if self.draining:
                return False
            self._in_flight += 1
            return True

    def _leave(self) -> None:
        with self._idle:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.notify_all()

    def drain(self, timeout: float) -> int:
        """Refuse every new call with UNAVAILABLE from now on, and wait up to timeout seconds
        for those in flight to finish.

        Returns:
            How many calls are still in flight (0: all finished).
        """
        with self._idle:
            self.draining = True
            self._idle.wait_for(lambda: not self._in_flight, timeout)
            return self._in_flight

    # -- plumbing ---------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, method: str, context: grpc.ServicerContext):
        m = self.metrics
        m.inflight.inc()
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if self.read_only and method in WRITES:
                raise ReadOnly(f"{method}: this PS serves published tables read only; write to the training PS")
            if method not in WITHOUT_STORE and (away := self.store_away()):
                raise BackendUnavailable(away)
            if method not in WITHOUT_STORE and (lost := self._lost(check=False)):
                raise DataLoss(lost)
            yield
        except PSError as exc:
            code = exc.code
            if isinstance(exc, TableNotFound) and (lost := self._lost(check=True)):
                # the table may be gone with the store's data: said as such, not as a caller's slip
                code, exc = DataLoss.code, DataLoss(f"{lost}; {exc}")
            context.abort(code, _details(str(exc)))
        except GeneratorExit:  # a reply stream (Export) the client stopped reading
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.RpcError:
            # Only a request stream (Import) raises this: the client cancelled or its deadline
            # passed mid-stream. No one is left to answer and it is no fault of the PS, so no
            # INTERNAL; grpc knows its own error and ends the call quietly.
            code = grpc.StatusCode.DEADLINE_EXCEEDED if context.time_remaining() <= 0 else grpc.StatusCode.CANCELLED
            log.info("%s: the client went away mid-stream (%s)", method, code.name)
            raise
        except Exception as exc:  # a bug or an unexpected store failure: report, keep serving
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", method)
            context.abort(code, _details(f"{method} failed inside the PS: {type(exc).__name__}: {exc}"))
        finally:
            m.inflight.dec()
            m.child(m.latency, method).observe(time.perf_counter() - start)
            m.child(m.requests, method, code.name).inc()
            if code != grpc.StatusCode.OK:
                m.child(m.errors, method, code.name).inc()

    def _lost(self, check: bool) -> str:
        """Why calls are refused for a loss of the store's data, "" if they are not; check: ask the
        store now (a table not found) rather than wait for the backend watch's next look."""
        if self.loss is None:
            return ""
        if check:
            self.loss.check()
        return self.loss.refusing

    @staticmethod
    def _still_wanted(context: grpc.ServicerContext, what: str) -> None:
        """A write whose caller has given up is not applied: the client has sent it again, maybe
        to another replica, and may have sent newer rows for the same ids since; applying the
        old one now would put stale rows back. gRPC itself drops a request whose deadline passed
        before its handler started (all workers busy, the PS paused); this covers the time the
        handler spent on it since (decoding a big batch, a slow store). The deadline is read off
        the clock as well: is_active() turns false only once grpc's own thread has seen the call
        end, which lags on a busy PS. A write already in the store's hands when the deadline
        passes still lands: see the README's note on replicas."""
        if context.time_remaining() <= 0 or not context.is_active():
            raise Abandoned(f"{what} not written: the client gave up on it (deadline passed or cancelled)")

    def _backend(self, op: str) -> _StoreTimer:
        return _StoreTimer(self.metrics.child(self.metrics.backend_latency, op))

    def _fitting(self, schema: TableSchema) -> TableSchema:
        """The schema, if this PS may create it: rows no wider than --max-row-width, one row (with
        its id) fitting in a message (a table whose rows cannot travel could be created but never
        pulled, pushed or exported), and an initializer whose values are finite in its dtype."""
        if schema.width > self.max_row_width:
            raise InvalidArgument(
                f"table {schema.name!r}: rows of {schema.width} values (dim {schema.dim} + state {schema.state_width}) "
                f"are wider than this PS's limit of {self.max_row_width} (--max-row-width)"
            )
        check_initializer_fits(schema)
        if schema.row_bytes + 8 + MESSAGE_OVERHEAD > self.max_message_bytes:
            raise InvalidArgument(
                f"table {schema.name!r}: a row is {schema.row_bytes} bytes, more than fits in this PS's "
                f"{self.max_message_bytes}-byte messages (--max-message-mb); use a smaller dim or a larger limit"
            )
        return schema

    def _schema(self, table: str, tally: _Tally | None = None) -> TableSchema:
        check_name(table)
        start = time.perf_counter()
        try:
            return self.store.schema(table)
        except TableNotFound:
            self.metrics.forget_table(table)  # dropped, maybe through another PS on the same Redis
            raise
        finally:
            if tally is None:
                self.metrics.child(self.metrics.backend_latency, "schema").observe(time.perf_counter() - start)
            else:
                tally.store_time("schema", start)

    def _schemas(self, tables: list[str], tally: _Tally) -> dict[str, TableSchema]:
        """The schema of each table a PullMany / PushMany names, in one store call (its entries
        may name one table many times); TableNotFound for the first that does not exist."""
        names = list(dict.fromkeys(tables))
        for name in names:
            check_name(name)
        start = time.perf_counter()
        try:
            found = self.store.schemas(names)
        finally:
            tally.store_time("schema", start)
        for name in names:
            if name not in found:
                found[name] = self._schema(name, tally)  # the store's own TableNotFound (or created since)
        return found

    def _info(self, schema: TableSchema) -> ps_pb2.TableInfo:
        """The table's schema, row count, lifecycle and last sweep."""
        with self._backend("num_rows"):
            n = self.store.num_rows(schema.name)
            lifecycle = self.store.lifecycle(schema.name)
            swept = self.store.last_sweep(schema.name) if lifecycle.active else None
            change_log = self.store.change_log(schema.name)
        info = ps_pb2.TableInfo(spec=schema.to_proto(), num_rows=n, expired_reads=self.store.expired_reads(schema.name))
        info.spec.change_log = change_log
        if lifecycle.active:
            info.spec.lifecycle.CopyFrom(lifecycle.to_proto())
        if swept:
            fields = ("finished", "seconds", "scanned", "deleted", "rows_over_cap")
            info.last_sweep.CopyFrom(ps_pb2.LastSweep(**{k: swept[k] for k in fields}))
        return info

    def _count(self, method: str, table: str, rows: int, nbytes_in: int, nbytes_out: int) -> None:
        m = self.metrics
        m.child(m.rows, method, m.table_label(table)).inc(rows)
        if nbytes_in:
            m.child(m.bytes, method, "in").inc(nbytes_in)
        if nbytes_out:
            m.child(m.bytes, method, "out").inc(nbytes_out)

    # -- tables -----------------------------------------------------------------

    def CreateTable(self, request, context):
        """Create a table unless it exists with the same schema."""
        with self._call("CreateTable", context):
            if not request.HasField("spec"):
                raise InvalidArgument("CreateTable needs a spec (name, dim, state_width, dtype)")
            schema = self._fitting(TableSchema.from_proto(request.spec))
            lifecycle = Lifecycle.from_proto(request.spec.lifecycle).checked(schema.name)
            change_log = checked_max_ids(schema.name, min(request.spec.change_log, 1 << 62))
            with self._backend("create_table"):
                created = self.store.create_table(schema)
                if created and lifecycle.active:
                    lifecycle = self.store.set_lifecycle(schema.name, lifecycle)
                if created and change_log:
                    self.store.set_change_log(schema.name, change_log)
            if created:
                log.info("created table %s%s", schema.to_dict(), f", {lifecycle.to_dict()}" if lifecycle.active else "")
            return ps_pb2.CreateTableResponse(table=self._info(schema), created=created)

    def SetLifecycle(self, request, context):
        """Set when a table's rows expire (TTL, row cap); the table's info after."""
        with self._call("SetLifecycle", context):
            schema = self._schema(request.table)
            lifecycle = Lifecycle.from_proto(request.lifecycle)
            with self._backend("set_lifecycle"):
                lifecycle = self.store.set_lifecycle(schema.name, lifecycle)
            log.info("table %s: lifecycle %s", schema.name, lifecycle.to_dict() or "none (rows never expire)")
            return self._info(schema)

    def Touch(self, request, context):
        """Mark rows resident on a trainer as used now."""
        with self._call("Touch", context):
            schema = self._schema(request.table)
            ids = self._ids(request.ids, "touch", schema.name)
            self._still_wanted(context, "touch")
            with self._backend("touch"):
                stored = self.store.touch(schema.name, ids)
                lifecycle = self.store.lifecycle(schema.name)
            self._count("Touch", schema.name, len(ids), len(request.ids), 0)
            every = lifecycle.touch_interval_s if lifecycle.active else 0
            return ps_pb2.TouchResponse(rows_stored=stored, touch_every_s=every)

    def ReadDrops(self, request, context):
        """A stretch of the store's log of dropped tables."""
        with self._call("ReadDrops", context):
            with self._backend("drops"):
                got = self.store.drops(request.after, min(request.limit or 1000, 10_000))
            return ps_pb2.ReadDropsResponse(
                drops=[ps_pb2.DroppedTable(table=d.table, time=d.time) for d in got.drops],
                cursor=got.cursor,
                gap=got.gap,
            )

    def SetChangeLog(self, request, context):
        """Keep (or stop keeping) a table's change log; the table's info after."""
        with self._call("SetChangeLog", context):
            schema = self._schema(request.table)
            max_ids = checked_max_ids(schema.name, min(request.max_ids, 1 << 62))
            with self._backend("set_change_log"):
                self.store.set_change_log(schema.name, max_ids)
            log.info("table %s: change log %s", schema.name, f"of {max_ids} ids" if max_ids else "off")
            return self._info(schema)

    def ReadChanges(self, request, context):
        """A stretch of a table's change log."""
        return self._read_log("ReadChanges", request, context, self.store.changes, ps_pb2.ReadChangesResponse)

    def ReadDeletions(self, request, context):
        """A stretch of a table's deletion log."""
        return self._read_log("ReadDeletions", request, context, self.store.deletions, ps_pb2.ReadDeletionsResponse)

    def _read_log(self, method: str, request, context, read, reply: type):
        """A stretch of a table's log of ids (`read`: Store.changes or Store.deletions)."""
        with self._call(method, context):
            schema = self._schema(request.table)
            limit = min(request.limit or DELETIONS_PER_READ, self.max_message_bytes // 16)
            with self._backend(read.__name__):
                got = read(schema.name, request.after, max(1, limit))
            return reply(
                ids=got.ids.astype("<i8").tobytes(),
                times=got.times.astype("<f8").tobytes(),
                cursor=got.cursor,
                gap=got.gap,
            )

    def DescribeTable(self, request, context):
        """The table's schema and row count."""
        with self._call("DescribeTable", context):
            return self._info(self._schema(request.table))

    def ListTables(self, request, context):
        """Every table's schema and row count."""
        with self._call("ListTables", context):
            return ps_pb2.ListTablesResponse(tables=self._all_tables(context))

    def _all_tables(self, context: grpc.ServicerContext) -> list[ps_pb2.TableInfo]:
        """Every table with its row count, within the call's deadline (DeadlineExceeded past it);
        label values of tables no longer there (dropped through another PS) are removed."""
        time_left = context.time_remaining if context.time_remaining() is not None else None
        with self._backend("list_tables"):
            tables = self.store.list_tables_with_rows(time_left)
        for gone in self.metrics.labelled_tables() - {s.name for s, _ in tables}:
            self.metrics.forget_table(gone)
        return [ps_pb2.TableInfo(spec=s.to_proto(), num_rows=n) for s, n in tables]  # lifecycles: DescribeTable

    def DropTable(self, request, context):
        """Drop a table and its rows (TableNotFound unless missing_ok)."""
        with self._call("DropTable", context):
            check_name(request.table)
            with self._backend("drop_table"):
                dropped = self.store.drop_table(request.table)
            self.metrics.forget_table(request.table)
            if dropped is None:
                if request.missing_ok:
                    return ps_pb2.DropTableResponse(dropped=False)
                raise TableNotFound(f"table {request.table!r} does not exist, nothing to drop")
            log.info("dropped table %s (%d rows)", request.table, dropped)
            return ps_pb2.DropTableResponse(dropped=True, rows_dropped=dropped)

    # -- rows -------------------------------------------------------------------

    @contextlib.contextmanager
    def _tallied(self, method: str) -> Iterator[_Tally]:
        """A _Tally for a row call's entries, reported under `method` when the call ends, failed or not."""
        tally = _Tally()
        try:
            yield tally
        finally:
            tally.report(self.metrics, method)

    def Pull(self, request, context):
        """Rows of ids, those never pushed initialised, into the reply or a segment."""
        with self._call("Pull", context), self._tallied("Pull") as tally:
            plan = self._pull_plan(request, tally)
            self._check_reply_size("pull", [plan])
            return build_pull_response(self._reply_plan(*plan, tally))

    def PullMany(self, request: RowEntries, context):
        """Pull from several tables; every entry is checked before any is read. One store call
        per table, whatever the entries (entries.py): the cost is linear in entries and ids."""
        with self._call("PullMany", context), self._tallied("Pull") as tally:
            schemas, counts, row_bytes = self._check_entries("pull of several tables", request, tally)
            in_message = ~request.has_ref
            self._check_pull_many_reply(request, counts, row_bytes, in_message)
            into = self._entry_segments(request, schemas, counts)
            ids = request.joined_ids.view(np.int64)
            missing = np.zeros(len(ids), dtype=bool)
            tally.bytes_in += ids.nbytes
            pulled = [
                self._pull_entries(schemas[t], ids, counts, entries, into, missing, tally)
                for t, entries in _entries_by_table(request)
            ]
            return pull_many_reply(counts, request.table, in_message, missing, row_bytes, pulled)

    def _check_entries(
        self, what: str, request: RowEntries, tally: _Tally
    ) -> tuple[list[TableSchema], np.ndarray, np.ndarray]:
        """Every entry of a PullMany or PushMany checked, before any is read or written: its table's
        name and schema (every name first: a bad one is refused as such wherever it stands), its
        ids packed int64, and the request's ids and rows within this PS's limits.

        Returns:
            (each name's schema, each entry's id count, each name's row bytes).
        """
        known = self._schemas(request.names, tally)
        schemas = [known[name] for name in request.names]
        counts = np.bitwise_and(request.ids_len, ID_BYTES - 1)  # one array for the check and the counts
        if counts.any():
            e = np.flatnonzero(counts)[0]  # its error, as a Pull's
            ids = _entry_bytes(request.joined_ids, request.ids_len, e)
            codec.decode_ids(ids, schemas[request.table[e]].name)
        np.right_shift(request.ids_len, 3, out=counts)  # // ID_BYTES
        total = int(counts.sum())
        self._check_ids(what, total)
        if len(schemas) == 1:
            per_table = np.array([total])
        else:
            per_table = np.bincount(request.table, weights=counts, minlength=len(schemas)).astype(np.int64)
        self._check_request_rows(what, [(s, int(n)) for s, n in zip(schemas, per_table) if n])
        return schemas, counts, np.array([s.row_bytes for s in schemas], dtype=np.int64)

    def _check_pull_many_reply(
        self, request: RowEntries, counts: np.ndarray, row_bytes: np.ndarray, in_message: np.ndarray
    ) -> None:
        """Refuse a PullMany whose reply could be over the message limit (rows in a segment take no room);
        row_bytes: each table's."""
        reply_bytes = MESSAGE_OVERHEAD + pull_many_reply_size(counts, request.table, in_message, row_bytes)
        if reply_bytes <= self.max_message_bytes:
            return
        row_bytes = row_bytes[request.table]
        names = [request.names[t] for t in dict.fromkeys(request.table[in_message].tolist())]
        tables = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        most = (self.max_message_bytes - MESSAGE_OVERHEAD) // (int(row_bytes[in_message].max()) + 1)
        raise ResourceExhausted(
            f"pull of several tables of {int(counts[in_message].sum())} rows from table {tables} in "
            f"{len(request)} entries needs a {reply_bytes}-byte reply, over this PS's max message size of "
            f"{self.max_message_bytes} bytes; pull at most {most} ids per request"
        )

    def _entry_segments(
        self, request: RowEntries, schemas: list[TableSchema], counts: np.ndarray
    ) -> dict[int, np.ndarray]:
        """{entry: its rows in a segment} for the entries that name one (each checked here)."""
        into = {}
        for e in np.flatnonzero(request.has_ref).tolist():
            segment, offset, size = request.refs[e].tolist()
            into[e] = self._segment_rows(segment, offset, size, schemas[request.table[e]], int(counts[e]))
        return into

    def _pull_entries(
        self,
        schema: TableSchema,
        ids: np.ndarray,
        counts: np.ndarray,
        entries: np.ndarray,
        into: dict[int, np.ndarray],
        missing: np.ndarray,
        tally: _Tally,
    ) -> PulledTable:
        """One table's entries of a PullMany in one store call: their rows, into its segment where
        the table's only entry has one; the ids missing marked in `missing`."""
        every = len(entries) == len(counts)  # the table's are all ids: no gather
        where = None if every else _id_positions(counts, entries)
        table_ids = ids if where is None else ids[where]
        own = into.get(int(entries[0])) if len(entries) == 1 else None
        rows = own if own is not None else np.empty((len(table_ids), schema.width), dtype=schema.np_dtype)
        positions = self._pull_into(schema, table_ids, rows, tally)
        missing[positions if where is None else where[positions]] = True
        if own is None and into:
            n = counts[entries]
            first = np.cumsum(n) - n
            for k in np.flatnonzero(np.isin(entries, list(into))).tolist():
                e = int(entries[k])
                into[e][...] = rows[first[k] : first[k] + counts[e]]
        return PulledTable(rows, entries)

    def _check_ids(self, what: str, n: int) -> None:
        """Refuse a request of more ids than --max-request-ids."""
        if n > self.max_request_ids:
            raise ResourceExhausted(
                f"{what} of {n} ids is over this PS's limit of {self.max_request_ids} ids per request "
                f"(--max-request-ids); send them in several"
            )

    def _ids(self, data: bytes, what: str, table: str) -> np.ndarray:
        """A request's ids (codec.decode_ids), within --max-request-ids."""
        self._check_ids(what, len(data) // ID_BYTES)
        return codec.decode_ids(data, table)

    def _pull_plan(
        self, request, tally: _Tally, known: dict[str, TableSchema] | None = None
    ) -> tuple[TableSchema, np.ndarray, int, np.ndarray | None]:
        """(schema, ids, request bytes, where the rows go: a segment's rows or None for the reply).
        known: schemas already looked up for this call, by table."""
        schema = known[request.table] if known is not None else self._schema(request.table, tally)
        ids = self._ids(request.ids, "pull", schema.name)
        into = None
        if request.HasField("rows_to"):
            ref = request.rows_to
            into = self._segment_rows(ref.segment, ref.offset, ref.size, schema, len(ids))
        return schema, ids, len(request.ids), into

    def _segment_rows(self, segment: int, offset: int, size: int, schema: TableSchema, n: int) -> np.ndarray:
        """The (n, width) rows at offset in an attached segment (shm.py)."""
        if size != n * schema.row_bytes:
            raise InvalidArgument(
                f"rows of {n} ids of table {schema.name!r} take {n * schema.row_bytes} bytes (rows of {schema.width} "
                f"{schema.dtype} values), the segment has {size} for them: the client has another schema of the table "
                f"(re-created since?)"
            )
        raw = self.segments.rows(segment, offset, size)
        return raw.view(schema.np_dtype).reshape(n, schema.width)

    def _check_request_rows(self, what: str, entries: list[tuple[TableSchema, int]]) -> None:
        """Refuse a pull or push whose rows, (schema, rows) per entry, total over max_request_bytes,
        in the message or through shared memory: what one request makes the PS read, write or
        initialise is checked before any of it is done."""
        total = sum(n * schema.row_bytes for schema, n in entries)
        if total <= self.max_request_bytes:
            return
        names = list(dict.fromkeys(schema.name for schema, _ in entries))  # a PullMany may name thousands
        tables = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        row_bytes = max(schema.row_bytes for schema, _ in entries)
        raise ResourceExhausted(
            f"{what} of {sum(n for _, n in entries)} rows of table {tables} is {total} bytes of rows, over this "
            f"PS's limit of {self.max_request_bytes} bytes per request (--max-request-mb); send at most "
            f"{max(1, self.max_request_bytes // row_bytes)} rows of {row_bytes} bytes per request"
        )

    def _check_reply_size(self, what: str, plans: list) -> None:
        self._check_request_rows(what, [(s, len(ids)) for s, ids, _, _ in plans])
        inline = [(s, ids) for s, ids, _, into in plans if into is None]  # rows through a segment take no room
        if not inline:
            return
        plans = inline
        reply_bytes = MESSAGE_OVERHEAD + sum(len(ids) * s.row_bytes + (len(ids) + 7) // 8 + 16 for s, ids in plans)
        if reply_bytes > self.max_message_bytes:
            n = sum(len(ids) for _, ids in plans)
            row_bytes = max(s.row_bytes for s, _ in plans)
            names = list(dict.fromkeys(s.name for s, _ in plans))  # a PullMany may name thousands
            tables = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ResourceExhausted(
                f"{what} of {n} rows from table {tables} needs a "
                f"{reply_bytes}-byte reply, over this PS's max message size of {self.max_message_bytes} bytes; "
                f"pull at most {(self.max_message_bytes - MESSAGE_OVERHEAD) // (row_bytes + 1)} ids per request"
            )

    def _reply_plan(
        self, schema: TableSchema, ids: np.ndarray, nbytes_in: int, into: np.ndarray | None, tally: _Tally
    ) -> ReplyPlan:
        """The reply to a pull of ids, its rows to be read straight into the message (wire.py)
        or into the client's segment."""

        def fill(rows: np.ndarray) -> tuple[bytes, int]:
            return self._pull_rows(schema, ids, nbytes_in, rows, tally)

        return ReplyPlan(len(ids), schema.width, schema.np_dtype, fill, into)

    def _pull_rows(
        self, schema: TableSchema, ids: np.ndarray, nbytes_in: int, out: np.ndarray, tally: _Tally
    ) -> tuple[bytes, int]:
        """Rows of ids into out, the missing ones initialised; (missing bitmap, how many missing)."""
        tally.bytes_in += nbytes_in if len(ids) else 0
        positions = self._pull_into(schema, ids, out, tally)
        if not len(positions):
            return b"", 0
        missing = np.zeros(len(ids), dtype=bool)
        missing[positions] = True
        return codec.encode_mask(missing), len(positions)

    def _pull_into(self, schema: TableSchema, ids: np.ndarray, out: np.ndarray, tally: _Tally) -> np.ndarray:
        """Rows of ids into out, the missing ones initialised (zeros on a read-only PS); their positions."""
        if not len(ids):  # an entry with no ids costs no store call
            return np.zeros(0, dtype=np.int64)
        start = time.perf_counter()
        positions = self.store.pull_into(schema.name, ids, out)
        tally.store_time("pull", start)
        m = self.metrics
        label = m.table_label(schema.name)
        m.child(m.rows, "Pull", label).inc(len(ids))
        tally.bytes_out += out.nbytes
        if not len(positions):
            return positions
        if self.read_only:  # a serving store has no initializer: what it lacks is missing
            out[positions] = 0
        else:
            fill_initial_rows(schema, ids[positions], out, positions)
        m.child(m.missing_rows, label).inc(len(positions))
        return positions

    def Push(self, request, context):
        """Write rows from the message or a segment (not if the caller gave up first)."""
        with self._call("Push", context), self._tallied("Push") as tally:
            plan = self._push_plan(request, tally)
            self._check_request_rows("push", [(plan[0], len(plan[1]))])
            self._still_wanted(context, "push")
            return ps_pb2.PushResponse(rows_written=self._push_rows(*plan, tally))

    def PushMany(self, request: RowEntries, context):
        """Push to several tables; every entry is checked before any is written. One store call
        per table, whatever the entries (entries.py)."""
        with self._call("PushMany", context), self._tallied("Push") as tally:
            schemas, counts, row_bytes = self._check_entries("push to several tables", request, tally)
            self._check_push_rows(request, schemas, counts, _per_entry(row_bytes, request))
            into = self._entry_segments(request, schemas, counts)
            ids = request.joined_ids.view(np.int64)
            tables = [(schemas[t], entries) for t, entries in _entries_by_table(request)]
            rows = [self._push_many_rows(schema, request, counts, entries, into) for schema, entries in tables]
            self._still_wanted(context, "push")
            for (schema, entries), table_rows in zip(tables, rows):
                table_ids = ids if len(entries) == len(counts) else ids[_id_positions(counts, entries)]
                self._push_rows(schema, table_ids, table_rows, tally)
            return push_many_reply(counts)  # every row given is written (a repeated id's last)

    def _check_push_rows(
        self, request: RowEntries, schemas: list[TableSchema], counts: np.ndarray, row_bytes: np.ndarray
    ) -> None:
        """Each push's rows: in the message, as many bytes as its ids' rows, or in a segment, not both."""
        both = np.flatnonzero(request.has_ref & (request.rows_len > 0))
        if len(both):
            name = schemas[request.table[both[0]]].name
            raise InvalidArgument(f"push to {name!r} carries rows both in the message and in a segment (rows_from)")
        wrong = np.flatnonzero(~request.has_ref & (request.rows_len != counts * row_bytes))
        if len(wrong):
            e = wrong[0]  # its error, as a Push's
            rows = _entry_bytes(request.joined_rows, request.rows_len, e)
            codec.decode_rows(rows, schemas[request.table[e]], int(counts[e]))

    def _push_many_rows(
        self, schema: TableSchema, request: RowEntries, counts: np.ndarray, entries: np.ndarray, into: dict
    ) -> np.ndarray:
        """One table's rows of a PushMany, its entries' in their order: from the message or segments."""
        if len(entries) == len(counts) and not into:  # every entry's rows, all in the message
            return request.joined_rows.view(schema.np_dtype).reshape(-1, schema.width)
        n = counts[entries]
        first = np.cumsum(n) - n
        rows = np.empty((int(n.sum()), schema.width), dtype=schema.np_dtype)
        inline = ~request.has_ref[entries]
        joined_at = np.cumsum(request.rows_len) - request.rows_len  # each entry's rows in joined_rows
        copy_ranges(
            rows,
            first[inline] * schema.row_bytes,
            request.joined_rows,
            joined_at[entries[inline]],
            request.rows_len[entries[inline]],
        )
        for k in np.flatnonzero(~inline).tolist():
            rows[first[k] : first[k] + n[k]] = into[int(entries[k])]
        return rows

    def _push_plan(
        self, request, tally: _Tally, known: dict[str, TableSchema] | None = None
    ) -> tuple[TableSchema, np.ndarray, np.ndarray]:
        """(schema, ids, rows) of a PushRequest read by wire.parse_push_request (known: as in _pull_plan)."""
        schema = known[request.table] if known is not None else self._schema(request.table, tally)
        ids = self._ids(request.ids, "push", schema.name)
        if request.rows_from is None:
            return schema, ids, codec.decode_rows(request.rows, schema, len(ids))
        if len(request.rows):
            raise InvalidArgument(
                f"push to {schema.name!r} carries rows both in the message and in a segment (rows_from)"
            )
        segment, offset, size = request.rows_from
        return schema, ids, self._segment_rows(segment, offset, size, schema, len(ids))

    def _push_rows(self, schema: TableSchema, ids: np.ndarray, rows: np.ndarray, tally: _Tally) -> int:
        if not len(ids):  # an entry with no ids costs no store call
            return 0
        start = time.perf_counter()
        written = self.store.push(schema.name, ids, rows)
        tally.store_time("push", start)
        m = self.metrics
        m.child(m.rows, "Push", m.table_label(schema.name)).inc(written)
        tally.bytes_in += ids.nbytes + rows.nbytes
        return written

    def Delete(self, request, context):
        """Delete ids' rows; replies how many were stored."""
        with self._call("Delete", context):
            schema = self._schema(request.table)
            ids = self._ids(request.ids, "delete", schema.name)
            self._still_wanted(context, "delete")
            with self._backend("delete"):
                deleted = self.store.delete(schema.name, ids)
            self._count("Delete", schema.name, deleted, len(request.ids), 0)
            return ps_pb2.DeleteResponse(rows_deleted=deleted)

    # -- whole tables -----------------------------------------------------------

    def Export(self, request, context) -> Iterator[ps_pb2.RowChunk]:
        """Stream every row of a table in chunks; the first chunk carries the schema."""
        with self._call("Export", context):
            schema = self._schema(request.table)
            fit = max(1, (self.max_message_bytes - MESSAGE_OVERHEAD) // (schema.row_bytes + 8))
            default = max(1, DEFAULT_EXPORT_CHUNK_BYTES // (schema.row_bytes + 8))
            per_chunk = min(request.rows_per_chunk or default, fit)
            first: ps_pb2.RowChunk | None = ps_pb2.RowChunk(spec=schema.to_proto())
            total = 0
            with self._backend("export"):
                chunks = self.store.export(schema.name, per_chunk)
            for ids, rows in chunks:
                if first is not None:
                    chunk, first = first, None
                else:
                    chunk = ps_pb2.RowChunk()
                chunk.ids = codec.encode_ids(ids)
                chunk.rows = np.ascontiguousarray(rows).tobytes()
                total += len(ids)
                self._count("Export", schema.name, len(ids), 0, len(chunk.ids) + len(chunk.rows))
                yield chunk
            if first is not None:  # an empty table still tells its schema
                yield first
            self.exported.add(schema.name, total)

    def Import(self, request_iterator, context):
        """Write a stream of chunks into a table, creating it (and clearing it first if asked),
        through the store's import_rows (the disk store loads an empty table in bulk).

        The first chunk must carry the schema; nothing is created or cleared before it checks out.
        """
        with self._call("Import", context):
            requests = iter(request_iterator)
            first = next(requests, None)
            if first is None:
                raise InvalidArgument("import stream was empty: send at least one chunk with the table's spec")
            if not first.HasField("spec"):
                raise InvalidArgument("the first chunk of an import must carry the table's spec")
            schema = self._fitting(TableSchema.from_proto(first.spec))
            feeding = [0.0]
            start = time.perf_counter()
            written = self.store.import_rows(
                schema.name, self._import_chunks(schema, first, requests, feeding), first.replace
            )
            # the store's time only: the stream's waits and checks are not the backend's
            import_time = time.perf_counter() - start - feeding[0]
            self.metrics.child(self.metrics.backend_latency, "import").observe(max(import_time, 0.0))
            self.imported.add(schema.name, written)
            return ps_pb2.ImportResponse(table=self._info(schema), rows_written=written)

    def _import_chunks(
        self, schema: TableSchema, first, requests: Iterator, feeding: list[float]
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The (ids, rows) of an Import's chunks, each checked as the store takes it.

        Args:
            schema: the table's schema, from the first chunk (checked).
            first: the first chunk; the table is created once its ids and rows check out, so a
                refused import creates and clears nothing.
            requests: the chunks after it.
            feeding: [seconds]; the time spent here (reading the stream, checking, creating the
                table: its own backend op) is added to it.

        Returns:
            An iterator of (ids, rows); each chunk is counted (rows, bytes) once the store asks
            for the next.

        Raises:
            InvalidArgument: a chunk's ids or rows are malformed, or a later chunk carries another spec.
        """
        chunk = first
        while chunk is not None:
            start = time.perf_counter()
            if chunk is not first and chunk.HasField("spec") and TableSchema.from_proto(chunk.spec) != schema:
                raise InvalidArgument(f"import into {schema.name!r}: a later chunk carries another spec")
            ids = self._ids(chunk.ids, "import chunk", schema.name)
            rows = codec.decode_rows(chunk.rows, schema, len(ids))
            if chunk is first:
                with self._backend("create_table"):
                    self.store.create_table(schema)
            feeding[0] += time.perf_counter() - start
            yield ids, rows
            start = time.perf_counter()
            self._count("Import", schema.name, len(ids), len(chunk.ids) + len(chunk.rows), 0)
            chunk = next(requests, None)
            feeding[0] += time.perf_counter() - start

    # -- same-host row transfer (shm.py) ----------------------------------------

    def AttachSegment(self, request, context):
        """Map a client's shared-memory segment; replies its id."""
        with self._call("AttachSegment", context):
            return ps_pb2.AttachSegmentResponse(segment=self.segments.attach(request.path, request.size, request.token))

    def DetachSegment(self, request, context):
        """Forget a segment; replies whether it was attached."""
        with self._call("DetachSegment", context):
            return ps_pb2.DetachSegmentResponse(detached=self.segments.detach(request.segment))

    # -- stats ------------------------------------------------------------------

    def Stats(self, request, context):
        """Backend, version, uptime, every table, and per-method request counts."""
        with self._call("Stats", context):
            tables = self._all_tables(context)
            methods = []
            for metric in self.metrics.requests.collect():
                per: dict[str, list[int]] = {}
                for s in metric.samples:
                    if not s.name.endswith("_total"):
                        continue
                    entry = per.setdefault(s.labels["method"], [0, 0])
                    entry[0] += int(s.value)
                    if s.labels["code"] != "OK":
                        entry[1] += int(s.value)
            rows = {k: int(v) for k, v in self.metrics.retired_rows.items()}  # per method, over all tables
            for metric in self.metrics.rows.collect():
                for s in metric.samples:
                    if s.name.endswith("_total"):
                        rows[s.labels["method"]] = rows.get(s.labels["method"], 0) + int(s.value)
            for name in sorted(per):
                methods.append(
                    ps_pb2.MethodStats(method=name, requests=per[name][0], errors=per[name][1], rows=rows.get(name, 0))
                )
            return ps_pb2.StatsResponse(
                backend=self.store.kind,
                version=__version__,
                uptime_seconds=time.time() - self.started,
                tables=tables,
                methods=methods,
            )


def _entry_bytes(joined: np.ndarray, lengths: np.ndarray, entry) -> bytes:
    """Entry `entry`'s part of joined, its entries' bytes of these lengths (one refused entry's, for its error)."""
    at = int(lengths[:entry].sum())
    return joined[at : at + int(lengths[entry])].tobytes()


def _entries_by_table(request: RowEntries) -> Iterator[tuple[int, np.ndarray]]:
    """(table index, its entries ascending) for each table a PullMany or PushMany names."""
    if len(request.names) == 1:
        yield 0, np.arange(len(request), dtype=np.int64)
        return
    order = np.argsort(request.table, kind="stable")
    bounds = np.searchsorted(request.table[order], np.arange(len(request.names) + 1))
    for t in range(len(request.names)):
        yield t, order[bounds[t] : bounds[t + 1]]


def _per_entry(per_table: np.ndarray, request: RowEntries) -> np.ndarray:
    """Each entry's value of its table (a read-only view, not a gather, for one table)."""
    if len(per_table) == 1:
        return np.broadcast_to(per_table[0], len(request))
    return per_table[request.table]


def _id_positions(counts: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """Where the ids of these entries lie among all entries' ids (in entry order), joined."""
    firsts = np.cumsum(counts) - counts
    n = counts[entries]
    if len(entries) == len(counts):  # every entry: every id, in order
        return np.arange(int(counts.sum()), dtype=np.int64)
    shift = np.repeat(firsts[entries] - (np.cumsum(n) - n), n)
    return np.arange(int(n.sum()), dtype=np.int64) + shift
