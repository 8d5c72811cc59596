"""Whole tables in and out as gRPC streams: import writes (ids, rows) chunks, each id to its PS, through one
stream per PS at once; export reads each PS's rows in chunks, PS by PS.

A stream that fails as a unary call is retried (UNAVAILABLE: a PS restarting) is opened again, after the same
backoffs, until the stream's deadline, or the client's timeout where it has none, where that is safe:
- an export, before the stream gave its first chunk (transport.py); later, a new stream would give its rows again
  (the protocol has no resume point), so the error says to export again;
- an import, while the stream has taken at most _RESENT_CHUNKS chunks, which are kept and sent again first: an
  import writes rows by value (with replace=True the new stream clears the table again), so rows written twice
  are the same rows. Later the chunks it took are gone (the source is read once, not held), so the error says so;
  running the import again is safe for the same reason.
A table of any size is imported without holding it in memory: each stream is fed through a small queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

import grpc
import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server import codec
from dynemb.ps_server.client.retry import Attempts
from dynemb.ps_server.client.rows import ID_BYTES, as_ids
from dynemb.ps_server.client.sharding import Sharding
from dynemb.ps_server.client.transport import Transport
from dynemb.ps_server.errors import PSError
from dynemb.ps_server.schema import TableSchema

_QUEUED_CHUNKS = 4  # per stream: chunks read from the source ahead of what the PS has taken
_RESENT_CHUNKS = 4  # per stream: chunks it took that are kept to send again if it must be reopened
_END = object()  # the source's end, queued after its last chunk


def export_rows(
    transport: Transport, schema: TableSchema, rows_per_chunk: int, timeout: float | None, retry_seconds: float = 0.0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every (ids, rows) of a table, PS by PS, in chunks.

    Args:
        transport: the client's connection to its PSes.
        schema: the table's schema (sizes the rows).
        rows_per_chunk: rows per chunk; 0: the PS's choice.
        timeout: seconds for each PS's stream; None or 0: none.
        retry_seconds: how long a stream without a timeout is opened again while it fails before its first chunk.

    Returns:
        An iterator of (ids, rows) chunks.

    Raises:
        PSError: a stream failed.
    """
    request = ps_pb2.ExportRequest(table=schema.name, rows_per_chunk=rows_per_chunk)
    for shard in range(len(transport.addresses)):
        for chunk in transport.stream_from(shard, "Export", request, timeout, retry_seconds):
            ids = codec.decode_ids(chunk.ids)
            if len(ids):
                yield ids, codec.decode_rows(chunk.rows, schema, len(ids))


class _ImportStream:
    """One PS's Import stream, fed through a small queue of its own, reopened where that is safe (see the module's
    docstring).

    Each opening's request iterator sends the spec, then the chunks taken so far (kept while there are at most
    _RESENT_CHUNKS), then what it takes from the queue. A chunk is taken and the opening checked to be the current
    one under one lock, so an iterator of an opening that failed, which gRPC's thread may still be running, never
    takes a chunk the next opening would then lack.
    """

    def __init__(
        self, transport: Transport, shard: int, first: ps_pb2.RowChunk, timeout: float | None, retry_seconds: float
    ) -> None:
        self.transport, self.shard, self.first = transport, shard, first
        self.deadline = time.monotonic() + timeout if timeout else None
        self.retry_seconds = retry_seconds
        self._lock = threading.Condition()
        self._queued: deque = deque()  # chunks, then _END, not taken yet
        self._taken: list[ps_pb2.RowChunk] | None = []  # None once more were taken than are kept
        self._rows_taken = 0
        self._source_ended = False
        self._opening = 0
        self._tries: Attempts | None = None
        self._final = False  # failed, not to be reopened
        self.call = self._open()

    def _open(self) -> grpc.Future:
        with self._lock:
            self._opening += 1
            opening = self._opening
            self._lock.notify_all()  # an earlier opening's iterator, waiting on the queue, ends
        left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.001)
        return self.transport.stream_to(self.shard, "Import", self._requests(opening), left)

    def _requests(self, opening: int) -> Iterator[ps_pb2.RowChunk]:
        yield self.first
        sent = 0  # of the chunks taken, those this opening has sent
        while True:
            with self._lock:
                while True:
                    if opening != self._opening:
                        return
                    if self._taken is not None and sent < len(self._taken):
                        chunk = self._taken[sent]
                        sent += 1
                        break
                    if self._source_ended:
                        return
                    if self._queued:
                        chunk = self._queued.popleft()
                        self._lock.notify_all()  # room in the queue
                        if chunk is _END:
                            self._source_ended = True
                            return
                        self._rows_taken += len(chunk.ids) // ID_BYTES
                        if self._taken is not None:
                            self._taken.append(chunk)
                            sent = len(self._taken)
                            if sent > _RESENT_CHUNKS:
                                self._taken = None
                        break
                    self._lock.wait(0.1)
            yield chunk

    def failed(self) -> bool:
        """Whether the stream failed for good; one that failed and may be reopened is reopened (after a backoff)."""
        if not self._final and self.call.done() and self.call.exception() is not None:
            self._final = not self._reopened(self.call.exception())
        return self._final

    def _reopened(self, err) -> bool:
        with self._lock:
            kept = self._taken is not None
        if not kept or not isinstance(err, grpc.RpcError):
            return False
        if self._tries is None:
            retry_until = self.deadline if self.deadline is not None else time.monotonic() + self.retry_seconds
            self._tries = self.transport.retry.start(retry_until)
        doing = "opening it again, the chunks it took sent again"
        if not self.transport.back_off(self._tries, err, "Import stream to", self.shard, doing):
            return False
        self.call = self._open()
        return True

    def put(self, item) -> bool:
        """Queue a chunk (or _END) for the stream; False when the stream failed for good (not queued)."""
        while True:  # a stream that failed stops reading: don't wait on it forever
            with self._lock:
                if len(self._queued) < _QUEUED_CHUNKS:
                    self._queued.append(item)
                    self._lock.notify_all()
                    return True
                self._lock.wait(0.1)
            if self.failed():
                return False

    def result(self) -> ps_pb2.ImportResponse:
        """The PS's answer once the source ended, the stream reopened while it may be.

        Raises:
            PSError: the stream failed for good; where it was not reopened, the error says why.
        """
        while True:
            try:
                return self.call.result()
            except grpc.RpcError as err:
                if not self.failed():
                    continue  # reopened
                raise self._error(err) from None

    def _error(self, err: grpc.RpcError) -> PSError:
        exc = self.transport.error(err, self.shard)
        with self._lock:
            kept, rows = self._taken is not None, self._rows_taken
        if not kept and err.code() == grpc.StatusCode.UNAVAILABLE:
            exc.args = (
                f"{exc.args[0]}; the Import stream had taken {rows} rows, more than the client keeps to send again, "
                f"so it was not opened again; the import writes rows by value (with replace=True it clears the "
                f"table first): run it again",
            )
        elif self._tries is not None:
            exc.args = (f"{exc.args[0]}; the Import stream opened {self._tries.tries()} times",)
        return exc


def import_rows(
    transport: Transport,
    sharding: Sharding,
    schema: TableSchema,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    replace: bool,
    timeout: float | None,
    retry_seconds: float = 0.0,
) -> int:
    """Write every (ids, rows) chunk into an existing table, each id to its PS, one stream per PS.

    Args:
        transport: the client's connection to its PSes.
        sharding: its address list's sharding.
        schema: the table's schema; every PS must have the table with it already.
        chunks: (ids, rows) pairs, read once, as the streams take them.
        replace: each PS first deletes the table's rows.
        timeout: seconds for the streams; None or 0: none.
        retry_seconds: how long a stream without a timeout is reopened while it may be.

    Returns:
        The rows written.

    Raises:
        PSError: a stream failed (reading of chunks stops at the first one that did).
    """
    per_id_bytes = schema.row_bytes + ID_BYTES
    first = ps_pb2.RowChunk(spec=schema.to_proto(), replace=replace)
    shards = range(len(transport.addresses))
    streams = [_ImportStream(transport, shard, first, timeout, retry_seconds) for shard in shards]
    try:
        for ids, rows in chunks:
            if any(stream.failed() for stream in streams):  # a stream ended before its last chunk: it failed
                break
            ids = as_ids(ids)
            rows = np.ascontiguousarray(rows, dtype=schema.np_dtype).reshape(len(ids), schema.width)
            for shard, pos in sharding.stream_pieces(ids, per_id_bytes):
                streams[shard].put(ps_pb2.RowChunk(ids=codec.encode_ids(ids[pos]), rows=rows[pos].tobytes()))
    finally:
        for stream in streams:
            stream.put(_END)
    return sum(stream.result().rows_written for stream in streams)
