"""PSClient: one object for one or many PS addresses; its methods are the protocol's verbs.

    ps = PSClient(["ps-0:50051", "ps-1:50051"])
    ps.create_table("user", dim=64, state_width=1)
    got = ps.pull("user", ids)            # got.rows (n, 65), got.missing (n,) bool
    ps.push("user", ids, got.rows)
    fut = ps.push_async("user", ids, rows)  # a concurrent.futures.Future

- Ids are sharded over the addresses by XXH64 of the id (stable: the same id always
  goes to the same PS for a given address list), and each shard's part is cut into
  chunks that fit under the message limit; all chunks go out at once.
- UNAVAILABLE is retried with exponential backoff and jitter inside the call's
  deadline; with RetryPolicy.attempt_timeout, so is a try that took longer than that (a
  PS that hangs, paused or cut off, is tried again rather than waited on to the end). Every call is idempotent (push overwrites, delete of a deleted id is a
  no-op, create of the same schema succeeds), so a retry never duplicates a write.
- Row operations (pull, push, delete, import) of one client on one table take effect in
  the order they were called, sync or async: they run one after another on that table's
  lane, so a pull issued after a push always sees it, and a retried push can never land
  after a later one. Different tables use different lanes (`lanes`, by a hash of the
  name), so a trainer's pushes and pulls of many tables are in flight together.
- pull_many / push_many move several tables' rows in one call per PS (a trainer's step is
  then two calls, not two per table); they keep the same order with every other call on
  their tables.
- A PS on this host (a loopback address, or shared_memory=True) gets the rows of pulls and
  pushes through shared memory rather than in the messages (shm.py): same calls, same
  results, 2-2.6x the rows per second (bench/RESULTS.md). Where the PS cannot map our
  memory, rows go as bytes.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server import codec
from dynemb.ps_server.auth import bearer_metadata
from dynemb.ps_server import shm
from dynemb.ps_server.errors import (DeadlineExceeded, InvalidArgument, PSError, SegmentUnusable, Unauthenticated,
                              from_rpc_error)
from dynemb.ps_server.hashing import ROW_HASH_SEED, shard_of, xxh64_ids
from dynemb.ps_server.replicas import SEPARATOR, channel_target, split_hostport
from dynemb.ps_server.schema import Initializer, TableSchema
from dynemb.ps_server.wire import (MESSAGE_OVERHEAD, MalformedMessage, encode_push_many_request, parse_pull_many_response,
                            parse_pull_response, push_request_parts)

log = logging.getLogger("dynemb.ps.client")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int | None = 8  # tries in all, the first included; None: as many as the deadline allows
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    attempt_timeout: float | None = None  # seconds one try may take; None: the call's whole deadline

    def backoffs(self) -> Iterator[float]:
        delay = self.initial_backoff
        tries = 1
        while self.attempts is None or tries < self.attempts:
            tries += 1
            yield delay * random.uniform(0.5, 1.0)  # jitter: clients that failed together retry apart
            delay = min(delay * self.multiplier, self.max_backoff)


@dataclass(frozen=True)
class TableInfo:
    schema: TableSchema
    num_rows: int

    @classmethod
    def from_proto(cls, msg: ps_pb2.TableInfo) -> "TableInfo":
        return cls(TableSchema.from_proto(msg.spec), msg.num_rows)


@dataclass
class PullResult:
    rows: np.ndarray  # (n, dim + state_width), the table's dtype (bf16 as uint16 bits)
    missing: np.ndarray  # (n,) bool: never pushed, returned initialised
    dim: int

    @property
    def embeddings(self) -> np.ndarray:
        return self.rows[:, : self.dim]

    @property
    def state(self) -> np.ndarray:
        return self.rows[:, self.dim :]


class _Lane:
    """One lane's worker thread, the last call submitted to it (`tail`) and the last call on
    several tables that involved it (`barrier`), which calls submitted after it wait for."""

    __slots__ = ("pool", "tail", "barrier")

    def __init__(self, k: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dynemb-ps-lane{k}")
        self.tail: Future | None = None
        self.barrier: Future | None = None


def _after(before: list[Future], fn: Callable, *args):
    """fn(*args) once every future in before is done, whatever their outcome."""
    wait(before)
    return fn(*args)


def _on_loopback(address: str) -> bool:
    """Whether every replica of a shard's address is this host by a loopback name."""
    try:
        hosts = [split_hostport(a.strip())[0] for a in address.split(SEPARATOR) if a.strip()]
    except InvalidArgument:
        return address.startswith("unix:")
    return bool(hosts) and all(h == "localhost" or h == "::1" or h.startswith("127.") for h in hosts)


def _pull_request(table: str, ids: np.ndarray, schema: TableSchema,
                  place: tuple[shm.Segment, int] | None) -> ps_pb2.PullRequest:
    """A PullRequest; its rows to come in the reply, or into the segment at place."""
    req = ps_pb2.PullRequest(table=table, ids=ids.tobytes())
    if place is not None:
        seg, offset = place
        req.rows_to.segment, req.rows_to.offset, req.rows_to.size = seg.segment, offset, len(ids) * schema.row_bytes
    return req


def _push_parts(table: str, ids: np.ndarray, rows: np.ndarray, place: tuple[shm.Segment, int] | None) -> list:
    """A PushRequest's parts: rows in the message, or copied into the segment at place."""
    if place is None:
        return push_request_parts(table, ids, rows)
    seg, offset = place
    seg.rows(offset, *rows.shape, rows.dtype)[...] = rows
    return push_request_parts(table, ids, None, (seg.segment, offset, rows.nbytes))


def _pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes, read from the file when given a path."""
    if isinstance(value, str):
        try:
            with open(value, "rb") as f:
                return f.read()
        except OSError as exc:
            raise InvalidArgument(f"cannot read TLS file {value}: {exc.strerror}") from None
    return value


class PSClient:
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
        retry: RetryPolicy = RetryPolicy(),
        lanes: int = 8,
        shared_memory: bool | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise InvalidArgument("PSClient needs at least one PS address (host:port)")
        self.addresses = list(addresses)
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        # Batches bigger than this go out as several messages at once. Fewer, bigger
        # messages won on 2 cores once replies were built with one copy (bench/RESULTS.md).
        self.chunk_bytes = min(chunk_bytes, max_message_bytes)
        self.retry = retry
        self._metadata = bearer_metadata(auth_token)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if bool(tls_cert) != bool(tls_key):
            raise InvalidArgument("a client certificate (tls_cert) needs its private key (tls_key), and the other way round")
        use_tls = tls if tls is not None else (tls_ca is not None or tls_cert is not None)
        self._tls_hint = creds = None
        if use_tls:
            self._tls_hint = ("over TLS: check that the PS's certificate is signed by the CA given (tls_ca) and names "
                              "the address used, and whether the PS wants a client certificate (mutual TLS: "
                              + ("is this one signed by the CA it trusts?)" if tls_cert else "give tls_cert and tls_key)"))
            creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=_pem(tls_key),
                                                 certificate_chain=_pem(tls_cert))
        self._channels = [self._channel(a, creds, options, tls_server_name) for a in self.addresses]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in self._channels]
        # Push goes out pre-serialized and Pull's reply is read in place (dynemb/ps_server/wire.py):
        # the same RPCs, without protobuf's copies of the rows.
        for stub, channel in zip(self._stubs, self._channels):
            stub.Pull = channel.unary_unary(
                "/dynemb.ps.v1.ParameterServer/Pull",
                request_serializer=ps_pb2.PullRequest.SerializeToString,
                response_deserializer=None,
            )
            stub.PullMany = channel.unary_unary(
                "/dynemb.ps.v1.ParameterServer/PullMany",
                request_serializer=ps_pb2.PullManyRequest.SerializeToString,
                response_deserializer=None,
            )
            stub.Push = channel.unary_unary(
                "/dynemb.ps.v1.ParameterServer/Push",
                request_serializer=bytes,
                response_deserializer=ps_pb2.PushResponse.FromString,
            )
            stub.PushMany = channel.unary_unary(
                "/dynemb.ps.v1.ParameterServer/PushMany",
                request_serializer=bytes,
                response_deserializer=ps_pb2.PushManyResponse.FromString,
            )
        self._schemas: dict[str, TableSchema] = {}
        self._schemas_lock = threading.Lock()
        # One lane per table (by hash): a table's row operations run in call order (see the
        # module docstring); different tables' overlap.
        self._lanes = [_Lane(k) for k in range(max(1, lanes))]
        # Calls on several tables at once (pull_many, push_many) run here, in call order, each
        # after the calls made before it on its tables' lanes and before those made after
        # (see _on_lanes).
        self._many_lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynemb-ps-many")
        self._order_lock = threading.Lock()
        # Same-host row transfer (shm.py): None where rows go as bytes. Auto (None): with a PS
        # on a loopback address; True: try every PS (one on this host by another address).
        self._pools = [
            shm.SegmentPool(self._attacher(k), self._detacher(k), a, keep=len(self._lanes) + 1)
            if shm.available() and (shared_memory or (shared_memory is None and _on_loopback(a))) else None
            for k, a in enumerate(self.addresses)
        ]

    # -- plumbing ---------------------------------------------------------------

    @staticmethod
    def _channel(address: str, creds, options: list, tls_server_name: str | None) -> grpc.Channel:
        """One shard's channel; `a|b` (replicas, see replicas.py) fails over between them."""
        target, authority = channel_target(address)
        if authority is not None and creds is not None and not tls_server_name:
            options = [*options, ("grpc.ssl_target_name_override", authority)]
        if creds is not None:
            return grpc.secure_channel(target, creds, options=options)
        return grpc.insecure_channel(target, options=options)

    def _error(self, err: grpc.RpcError, shard: int) -> PSError:
        exc = from_rpc_error(err, self.addresses[shard])
        # a failed TLS handshake reaches gRPC's Python side as a bare "socket closed"
        if self._tls_hint and err.code() == grpc.StatusCode.UNAVAILABLE:
            exc.args = (f"{exc.args[0]}; {self._tls_hint}",)
        return exc

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def _attempt_timeout(self, deadline: float) -> float:
        remaining = max(deadline - time.monotonic(), 0.001)
        return remaining if self.retry.attempt_timeout is None else min(remaining, self.retry.attempt_timeout)

    def _call(self, shard: int, method: str, request, deadline: float, first: Future | None = None):
        """One unary RPC to one PS, retried on UNAVAILABLE (and on a try that ran past
        retry.attempt_timeout) within the deadline.

        `first` is an attempt already sent (a grpc future), whose outcome counts as try one.
        """
        rpc = getattr(self._stubs[shard], method)
        backoffs = self.retry.backoffs()
        retried = False
        while True:
            try:
                if first is not None:
                    attempt, first = first, None
                    return attempt.result()
                if deadline - time.monotonic() <= 0:
                    raise DeadlineExceeded(
                        f"DEADLINE_EXCEEDED: {method} to PS {self.addresses[shard]} did not succeed in time"
                    )
                return rpc(request, timeout=self._attempt_timeout(deadline), metadata=self._metadata)
            except grpc.RpcError as err:
                code = err.code()
                retry = code in RETRYABLE or (
                    code == grpc.StatusCode.DEADLINE_EXCEEDED and self.retry.attempt_timeout is not None
                    and time.monotonic() < deadline)  # the try's own limit, not the call's
                if retry:
                    delay = next(backoffs, None)
                    if delay is not None and time.monotonic() + delay < deadline:
                        if not retried:  # once per call: an outage is one line per call, not per try
                            retried = True
                            log.warning("%s to PS %s: %s; retrying for up to %.0f s", method,
                                        self.addresses[shard], code.name, deadline - time.monotonic())
                        time.sleep(delay)
                        continue
                raise self._error(err, shard) from None

    def _fanout(self, method: str, calls: list[tuple[int, object]], deadline: float) -> list:
        """Send every (shard, request) at once; return the responses in order."""
        if len(calls) == 1:
            shard, req = calls[0]
            return [self._call(shard, method, req, deadline)]
        sent = []
        for shard, req in calls:
            rpc = getattr(self._stubs[shard], method)
            sent.append(rpc.future(req, timeout=self._attempt_timeout(deadline), metadata=self._metadata))
        return [self._call(shard, method, req, deadline, first=f) for (shard, req), f in zip(calls, sent)]

    def _split(self, ids: np.ndarray, per_id_bytes: int) -> tuple[np.ndarray | None, list[tuple[int, slice]]]:
        """(order, pieces): ids[order] grouped by shard, cut into (shard, slice) pieces that
        each fit one message. order is None when no reordering is needed.

        Within a shard, ids are ordered by their row hash before cutting, so each piece
        maps to its own run of the Redis backend's buckets (see hashing.bucket_of)."""
        per_msg = max(1, (self.chunk_bytes - MESSAGE_OVERHEAD) // per_id_bytes)
        n = len(self.addresses)
        if n == 1 and len(ids) <= per_msg:
            return None, [(0, slice(0, len(ids)))]
        row_hash = xxh64_ids(ids, ROW_HASH_SEED)
        if n == 1:
            order, bounds = np.argsort(row_hash, kind="stable"), [0, len(ids)]
        else:
            owner = shard_of(ids, n)
            order = np.lexsort((row_hash, owner))
            bounds = np.searchsorted(owner[order], np.arange(n + 1)).tolist()
        pieces = []
        for shard in range(n):
            size = bounds[shard + 1] - bounds[shard]
            parts = -(-size // per_msg)
            for k in range(parts):  # equal parts rather than full ones and a runt
                lo, hi = bounds[shard] + size * k // parts, bounds[shard] + size * (k + 1) // parts
                pieces.append((shard, slice(lo, hi)))
        return order, pieces

    def _attacher(self, shard: int):
        def attach(path: str, size: int, token: bytes, deadline: float) -> int:
            req = ps_pb2.AttachSegmentRequest(path=path, size=size, token=token)
            # within the call's deadline, and short: a PS that is away gets the rows as bytes,
            # retried as such
            return self._call(shard, "AttachSegment", req, min(deadline, time.monotonic() + 5.0)).segment
        return attach

    def _detacher(self, shard: int):
        def detach(segment: int):
            # not waited on, not retried: a PS that is away drops the segment itself once idle
            return self._stubs[shard].DetachSegment.future(ps_pb2.DetachSegmentRequest(segment=segment), timeout=5.0,
                                                           metadata=self._metadata)
        return detach

    def _lane_of(self, table: str) -> "_Lane":
        return self._lanes[zlib.crc32(table.encode()) % len(self._lanes)]

    def _on_lane(self, table: str, fn: Callable, *args) -> Future:
        """fn on the table's lane, after the last call on several tables that involved it."""
        lane = self._lane_of(table)
        with self._order_lock:
            barrier = lane.barrier
            if barrier is not None and barrier.done():
                barrier = lane.barrier = None
            lane.tail = lane.pool.submit(_after, [barrier], fn, *args) if barrier else lane.pool.submit(fn, *args)
            return lane.tail

    def _on_lanes(self, tables: Iterable[str], fn: Callable, *args) -> Future:
        """Run fn after every call already made on these tables and before any made after: it
        waits for the last call on each lane involved, and later calls on those lanes wait for
        it (their barrier). Every wait is on something submitted earlier, so nothing can wait
        on itself. A trainer that only makes *_many calls finds every lane idle: fn runs with
        one hand-off (gates on every lane cost ~0.4 ms a call, bench/RESULTS.md)."""
        lanes = {id(lane): lane for lane in map(self._lane_of, tables)}.values()
        with self._order_lock:
            before = [lane.tail for lane in lanes if lane.tail is not None and not lane.tail.done()]
            fut = self._many_lane.submit(_after, before, fn, *args) if before else self._many_lane.submit(fn, *args)
            for lane in lanes:
                lane.barrier = fut
            return fut

    @staticmethod
    def _ids(ids) -> np.ndarray:
        if type(ids).__module__.startswith("torch"):  # a tensor; torch is not imported here
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise InvalidArgument(f"ids must be one-dimensional, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgument(f"ids must be integers, got dtype {arr.dtype}")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def schema(self, table: str, refresh: bool = False) -> TableSchema:
        with self._schemas_lock:
            have = self._schemas.get(table)
        if have is None or refresh:
            have = self.describe_table(table).schema
        return have

    def _remember(self, schema: TableSchema) -> None:
        with self._schemas_lock:
            self._schemas[schema.name] = schema

    # -- tables -----------------------------------------------------------------

    def create_table(
        self,
        name: str,
        dim: int,
        state_width: int = 0,
        dtype: str = "fp32",
        initializer: Initializer | None = None,
        timeout: float | None = None,
    ) -> TableInfo:
        """Create the table on every PS; succeeds if it already exists with this schema."""
        schema = TableSchema(name, dim, state_width, dtype, initializer or Initializer())
        return self.create_table_from_schema(schema, timeout)

    def create_table_from_schema(self, schema: TableSchema, timeout: float | None = None) -> TableInfo:
        req = ps_pb2.CreateTableRequest(spec=schema.to_proto())
        replies = self._fanout("CreateTable", [(s, req) for s in range(len(self.addresses))], self._deadline(timeout))
        self._remember(schema)
        return TableInfo(schema, sum(r.table.num_rows for r in replies))

    def describe_table(self, name: str, timeout: float | None = None) -> TableInfo:
        req = ps_pb2.DescribeTableRequest(table=name)
        replies = self._fanout("DescribeTable", [(s, req) for s in range(len(self.addresses))], self._deadline(timeout))
        info = TableInfo.from_proto(replies[0])
        self._remember(info.schema)
        return TableInfo(info.schema, sum(r.num_rows for r in replies))

    def list_tables(self, timeout: float | None = None) -> list[TableInfo]:
        replies = self._fanout(
            "ListTables", [(s, ps_pb2.ListTablesRequest()) for s in range(len(self.addresses))], self._deadline(timeout)
        )
        merged: dict[str, TableInfo] = {}
        for reply in replies:
            for t in reply.tables:
                info = TableInfo.from_proto(t)
                prev = merged.get(info.schema.name)
                merged[info.schema.name] = TableInfo(info.schema, info.num_rows + (prev.num_rows if prev else 0))
        return [merged[k] for k in sorted(merged)]

    def drop_table(self, name: str, missing_ok: bool = False, timeout: float | None = None) -> int:
        """Drop the table on every PS; returns the rows dropped."""
        req = ps_pb2.DropTableRequest(table=name, missing_ok=missing_ok)
        replies = self._fanout("DropTable", [(s, req) for s in range(len(self.addresses))], self._deadline(timeout))
        with self._schemas_lock:
            self._schemas.pop(name, None)
        return sum(r.rows_dropped for r in replies)

    # -- rows -------------------------------------------------------------------

    def pull(self, table: str, ids, timeout: float | None = None) -> PullResult:
        return self.pull_async(table, ids, timeout).result()

    def push(self, table: str, ids, rows, timeout: float | None = None) -> int:
        return self.push_async(table, ids, rows, timeout).result()

    def delete(self, table: str, ids, timeout: float | None = None) -> int:
        return self.delete_async(table, ids, timeout).result()

    def pull_async(self, table: str, ids, timeout: float | None = None) -> "Future[PullResult]":
        ids = self._ids(ids)
        return self._on_lane(table, self._pull, table, ids, self._deadline(timeout))

    def push_async(self, table: str, ids, rows, timeout: float | None = None) -> "Future[int]":
        ids = self._ids(ids)
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[0] != len(ids):
            raise InvalidArgument(f"push to {table!r}: rows must be ({len(ids)}, width), got shape {rows.shape}")
        # Copy now: the caller may reuse its buffer before the push runs.
        rows = np.array(rows, copy=True, order="C")
        return self._on_lane(table, self._push, table, ids, rows, self._deadline(timeout))

    def delete_async(self, table: str, ids, timeout: float | None = None) -> "Future[int]":
        ids = self._ids(ids)
        return self._on_lane(table, self._delete, table, ids, self._deadline(timeout))

    def pull_many(self, ids_by_table: Mapping[str, object], timeout: float | None = None) -> dict[str, PullResult]:
        """Several tables' pulls in one call per PS: {table: ids} -> {table: PullResult}."""
        return self.pull_many_async(ids_by_table, timeout).result()

    def push_many(self, rows_by_table: Mapping[str, tuple[object, object]], timeout: float | None = None) -> int:
        """Several tables' pushes in one call per PS: {table: (ids, rows)}; rows written."""
        return self.push_many_async(rows_by_table, timeout).result()

    def pull_many_async(self, ids_by_table: Mapping[str, object],
                        timeout: float | None = None) -> "Future[dict[str, PullResult]]":
        wanted = {table: self._ids(ids) for table, ids in ids_by_table.items()}
        return self._on_lanes(wanted, self._pull_many, wanted, self._deadline(timeout))

    def push_many_async(self, rows_by_table: Mapping[str, tuple[object, object]],
                        timeout: float | None = None) -> "Future[int]":
        given = {}
        for table, (ids, rows) in rows_by_table.items():
            ids, rows = self._ids(ids), np.asarray(rows)
            if rows.ndim != 2 or rows.shape[0] != len(ids):
                raise InvalidArgument(f"push to {table!r}: rows must be ({len(ids)}, width), got shape {rows.shape}")
            given[table] = (ids, np.array(rows, copy=True, order="C"))  # the caller may reuse its buffer
        return self._on_lanes(given, self._push_many, given, self._deadline(timeout))

    def _packed(self, pieces: list[tuple[int, int, object]]) -> list[tuple[int, list]]:
        """(shard, bytes, item) pieces → (shard, [item, ...]) messages of at most chunk_bytes
        each (a piece already fits one message alone: _split cut it so)."""
        messages: list[tuple[int, list]] = []
        open_msg: dict[int, tuple[int, list]] = {}
        for shard, nbytes, item in pieces:
            size, items = open_msg.get(shard, (MESSAGE_OVERHEAD, None))
            if items is None or size + nbytes > self.chunk_bytes:
                items = []
                messages.append((shard, items))
                size = MESSAGE_OVERHEAD
            items.append(item)
            open_msg[shard] = (size + nbytes, items)
        return messages

    def _pull_many(self, wanted: dict[str, np.ndarray], deadline: float) -> dict[str, PullResult]:
        return self._segments_retried(self._pull_many_once, list(wanted), wanted, deadline)

    def _pull_many_once(self, wanted: dict[str, np.ndarray], deadline: float) -> dict[str, PullResult]:
        out, cuts = {}, []
        for table, ids in wanted.items():
            out[table], schema, cut = self._pull_pieces(table, ids)
            cuts += [(shard, table, schema, dest, i) for shard, dest, i in cut]
        with shm.Leases(self._pools, deadline) as leases:
            places = leases.place([(shard, len(i) * schema.row_bytes) for shard, _, schema, _, i in cuts])
            pieces = [(shard, len(i) * (9 if place else schema.row_bytes + 9), (table, schema, dest, i, place))
                      for (shard, table, schema, dest, i), place in zip(cuts, places)]
            messages = self._packed(pieces)
            calls = [(shard, ps_pb2.PullManyRequest(pulls=[_pull_request(t, i, sc, place) for t, sc, _, i, place in items]))
                     for shard, items in messages]
            for (shard, items), reply in zip(messages, self._fanout("PullMany", calls, deadline)):
                got_all = self._parsed(parse_pull_many_response, reply, shard)
                if len(got_all) != len(items):
                    raise PSError(f"PS {self.addresses[shard]} answered {len(got_all)} pulls for {len(items)} asked")
                for (table, schema, dest, ids, place), got in zip(items, got_all):
                    self._fill(out[table], table, schema, dest, len(ids), got, place)
        return out

    def _push_many(self, given: dict[str, tuple[np.ndarray, np.ndarray]], deadline: float) -> int:
        return self._segments_retried(self._push_many_once, list(given), given, deadline)

    def _push_many_once(self, given: dict[str, tuple[np.ndarray, np.ndarray]], deadline: float) -> int:
        cuts, total = [], 0
        for table, (ids, rows) in given.items():
            schema, cut = self._push_pieces(table, ids, rows)
            total += len(ids)
            cuts += [(shard, table, schema, i, r) for shard, i, r in cut]
        with shm.Leases(self._pools, deadline) as leases:
            places = leases.place([(shard, r.nbytes) for shard, _, _, _, r in cuts])
            pieces = [(shard, len(i) * (8 if place else schema.row_bytes + 8), _push_parts(table, i, r, place))
                      for (shard, table, schema, i, r), place in zip(cuts, places)]
            messages = self._packed(pieces)
            calls = [(shard, encode_push_many_request(items)) for shard, items in messages]
            self._fanout("PushMany", calls, deadline)
        return total  # every row given was written (a repeated id's last row)

    def _segments_retried(self, once: Callable, tables: list[str], *args):
        """once(*args), again if the PS no longer knew a segment (it restarted, or dropped ours
        as idle): the second try attaches new ones, or sends the rows as bytes."""
        try:
            return once(*args)
        except SegmentUnusable:
            return once(*args)
        except InvalidArgument:
            if any(pool is not None for pool in self._pools):
                # through a segment, a table re-created with another schema shows as rows of
                # the wrong size: have the next call describe it again
                for table in tables:
                    with self._schemas_lock:
                        self._schemas.pop(table, None)
            raise

    def _pull(self, table: str, ids: np.ndarray, deadline: float) -> PullResult:
        return self._segments_retried(self._pull_once, [table], table, ids, deadline)

    def _pull_once(self, table: str, ids: np.ndarray, deadline: float) -> PullResult:
        result, schema, cut = self._pull_pieces(table, ids)
        with shm.Leases(self._pools, deadline) as leases:
            places = leases.place([(shard, len(i) * schema.row_bytes) for shard, _, i in cut])
            calls = [(shard, _pull_request(table, i, schema, place)) for (shard, _, i), place in zip(cut, places)]
            for (shard, dest, i), place, reply in zip(cut, places, self._fanout("Pull", calls, deadline)):
                self._fill(result, table, schema, dest, len(i), self._parsed(parse_pull_response, reply, shard), place)
        return result

    def _parsed(self, parse, reply: bytes, shard: int):
        try:
            return parse(reply)
        except MalformedMessage as e:
            raise PSError(f"PS {self.addresses[shard]} sent a reply that does not parse: {e}") from None

    def _pull_pieces(self, table: str, ids: np.ndarray) -> tuple[PullResult, TableSchema, list]:
        """(an empty result, schema, [(shard, where in the result, ids)]): the pull cut by shard
        and under the message limit."""
        schema = self.schema(table)
        result = PullResult(np.empty((len(ids), schema.width), dtype=schema.np_dtype),
                            np.zeros(len(ids), dtype=bool), schema.dim)
        if len(ids) == 0:
            return result, schema, []
        order, pieces = self._split(ids, schema.row_bytes + 1)
        grouped = ids if order is None else ids[order]
        # dest: straight to the caller's positions
        return result, schema, [(shard, sl if order is None else order[sl], grouped[sl]) for shard, sl in pieces]

    def _fill(self, result: PullResult, table: str, schema: TableSchema, dest, n: int, reply,
              place: tuple[shm.Segment, int] | None = None) -> None:
        """One PullResponse's n rows (in it, or in the segment at place) and missing marks into
        result at dest."""
        if place is not None and n and not len(reply.rows):
            result.rows[dest] = place[0].rows(place[1], n, schema.width, schema.np_dtype)
        elif len(reply.rows) != n * schema.row_bytes:
            # The table was re-created with another schema since we cached it.
            self.schema(table, refresh=True)
            raise PSError(f"table {table!r} changed schema during a pull; pull again")
        else:
            result.rows[dest] = np.frombuffer(reply.rows, dtype=schema.np_dtype).reshape(n, schema.width)
        if reply.num_missing:
            result.missing[dest] = codec.decode_mask(reply.missing, n)

    def _push(self, table: str, ids: np.ndarray, rows: np.ndarray, deadline: float) -> int:
        return self._segments_retried(self._push_once, [table], table, ids, rows, deadline)

    def _push_once(self, table: str, ids: np.ndarray, rows: np.ndarray, deadline: float) -> int:
        _, cut = self._push_pieces(table, ids, rows)
        with shm.Leases(self._pools, deadline) as leases:
            places = leases.place([(shard, r.nbytes) for shard, _, r in cut])
            calls = [(shard, b"".join(_push_parts(table, i, r, place))) for (shard, i, r), place in zip(cut, places)]
            self._fanout("Push", calls, deadline)
        return len(ids)  # every row given was written (a repeated id's last row)

    def _push_pieces(self, table: str, ids: np.ndarray, rows: np.ndarray) -> tuple[TableSchema, list]:
        """(schema, [(shard, ids, rows)]): the push cut by shard and under the message limit."""
        schema = self.schema(table)
        if rows.shape[1] != schema.width:
            raise InvalidArgument(
                f"push to {table!r}: rows have {rows.shape[1]} values, the table's rows have "
                f"{schema.width} (dim {schema.dim} + state {schema.state_width})"
            )
        if len(ids) == 0:
            return schema, []
        order, pieces = self._split(ids, schema.row_bytes + 8)
        if len(pieces) > 1:
            # Pieces travel concurrently: an id repeated across two of them could land in
            # either order, so keep only each id's last row (what one PS would keep).
            uniq, last = codec.last_occurrence(ids)
            if len(uniq) < len(ids):
                ids, rows = ids[last], rows[last]
                order, pieces = self._split(ids, schema.row_bytes + 8)
        if order is not None:
            ids, rows = ids[order], rows[order]
        rows = np.ascontiguousarray(rows, dtype=schema.np_dtype)
        return schema, [(shard, ids[sl], rows[sl]) for shard, sl in pieces]

    def _delete(self, table: str, ids: np.ndarray, deadline: float) -> int:
        if len(ids) == 0:
            return 0
        order, pieces = self._split(ids, 8)
        if order is not None:
            ids = ids[order]
        calls = [(shard, ps_pb2.DeleteRequest(table=table, ids=ids[sl].tobytes())) for shard, sl in pieces]
        return sum(r.rows_deleted for r in self._fanout("Delete", calls, deadline))

    # -- whole tables -----------------------------------------------------------

    def export(self, table: str, rows_per_chunk: int = 0, timeout: float | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (ids, rows) of the table, PS by PS, in chunks."""
        schema = self.schema(table, refresh=True)
        for shard, stub in enumerate(self._stubs):
            req = ps_pb2.ExportRequest(table=table, rows_per_chunk=rows_per_chunk)
            try:
                for chunk in stub.Export(req, timeout=timeout or None, metadata=self._metadata):
                    ids = codec.decode_ids(chunk.ids)
                    if len(ids):
                        yield ids, codec.decode_rows(chunk.rows, schema, len(ids))
            except grpc.RpcError as err:
                raise self._error(err, shard) from None

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
        return self._on_lane(schema.name, self._import, schema, chunks, replace, timeout).result()

    def _import(self, schema, chunks, replace, timeout) -> int:
        per_msg = max(1, (self.chunk_bytes - MESSAGE_OVERHEAD) // (schema.row_bytes + 8))
        n = len(self.addresses)
        # Create the table (or find it with this schema) on every PS first: a clash of
        # schemas or a row too big for a message is refused before a chunk of the source is
        # read, whatever the timing of the streams' first replies.
        self.create_table_from_schema(schema, timeout)
        # One stream per PS, fed through a small queue each, so a table of any size is
        # imported without holding it in memory. Streams are not retried: an iterator
        # cannot be replayed (re-run the import; with replace=True it is idempotent).
        queues = [queue.Queue(maxsize=4) for _ in range(n)]
        done = object()

        def stream(q):
            yield ps_pb2.RowChunk(spec=schema.to_proto(), replace=replace)
            while (chunk := q.get()) is not done:
                yield chunk

        calls = [
            stub.Import.future(stream(q), timeout=timeout or None, metadata=self._metadata)
            for stub, q in zip(self._stubs, queues)
        ]

        def put(shard: int, item) -> None:
            while True:  # a stream that failed stops reading: don't wait on it forever
                try:
                    queues[shard].put(item, timeout=0.1)
                    return
                except queue.Full:
                    if calls[shard].done():
                        return

        try:
            for ids, rows in chunks:
                if any(call.done() for call in calls):  # a stream ended before its last chunk: it failed
                    break
                ids = self._ids(ids)
                rows = np.ascontiguousarray(rows, dtype=schema.np_dtype).reshape(len(ids), schema.width)
                owner = shard_of(ids, n)
                for shard in range(n):
                    pos = np.flatnonzero(owner == shard) if n > 1 else np.arange(len(ids))
                    for start in range(0, len(pos), per_msg):
                        p = pos[start : start + per_msg]
                        put(shard, ps_pb2.RowChunk(ids=codec.encode_ids(ids[p]), rows=rows[p].tobytes()))
        finally:
            for shard in range(n):
                put(shard, done)
        written = 0
        for shard, call in enumerate(calls):
            try:
                written += call.result().rows_written
            except grpc.RpcError as err:
                raise self._error(err, shard) from None
        self._remember(schema)
        return written

    # -- service ----------------------------------------------------------------

    def stats(self, timeout: float | None = None) -> list[ps_pb2.StatsResponse]:
        return self._fanout(
            "Stats", [(s, ps_pb2.StatsRequest()) for s in range(len(self.addresses))], self._deadline(timeout)
        )

    def health(self, timeout: float = 5.0) -> list[str]:
        """Each PS's health status name (SERVING, NOT_SERVING...) or the error reaching it."""
        out = []
        for address, channel in zip(self.addresses, self._channels):
            try:
                # with the token: a PS run with --auth-health wants it on health checks too
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout,
                                                                  metadata=self._metadata)
                out.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.RpcError as err:
                out.append(f"{err.code().name}: {err.details()} ({address})")
        return out

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every PS answers health checks with SERVING."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            if all(s == "SERVING" for s in status):
                return
            refused = [f"{a}: {s}" for a, s in zip(self.addresses, status) if s.startswith("UNAUTHENTICATED")]
            if refused:  # waiting will not bring the token: say so now
                raise Unauthenticated(f"PS refuses this client's health checks: {'; '.join(refused)}")
            if time.monotonic() > deadline:
                raise PSError(f"PS not ready after {timeout}s: {dict(zip(self.addresses, status))}")
            time.sleep(0.1)

    def close(self) -> None:
        self._many_lane.shutdown(wait=True)
        for lane in self._lanes:
            lane.pool.shutdown(wait=True)
        for pool in self._pools:
            if pool is not None:
                pool.close()
        for c in self._channels:
            c.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
