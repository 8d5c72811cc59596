"""Whole tables in and out as gRPC streams: import writes (ids, rows) chunks, each id to its PS, through one
stream per PS at once; export reads each PS's rows in chunks, PS by PS.

Streams are not retried: an iterator cannot be replayed (re-run an import; with replace=True it is idempotent).
A table of any size is imported without holding it in memory: each stream is fed through a small queue.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server import codec
from dynemb.ps_server.client.rows import ID_BYTES, as_ids
from dynemb.ps_server.client.sharding import Sharding
from dynemb.ps_server.client.transport import Transport
from dynemb.ps_server.schema import TableSchema

_QUEUED_CHUNKS = 4  # per stream: chunks read from the source ahead of what the PS has taken


def export_rows(
    transport: Transport, schema: TableSchema, rows_per_chunk: int, timeout: float | None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every (ids, rows) of a table, PS by PS, in chunks.

    Args:
        transport: the client's connection to its PSes.
        schema: the table's schema (sizes the rows).
        rows_per_chunk: rows per chunk; 0: the PS's choice.
        timeout: seconds for each PS's stream; None or 0: none.

    Returns:
        An iterator of (ids, rows) chunks.

    Raises:
        PSError: a stream failed.
    """
    request = ps_pb2.ExportRequest(table=schema.name, rows_per_chunk=rows_per_chunk)
    for shard in range(len(transport.addresses)):
        for chunk in transport.stream_from(shard, "Export", request, timeout):
            ids = codec.decode_ids(chunk.ids)
            if len(ids):
                yield ids, codec.decode_rows(chunk.rows, schema, len(ids))


def import_rows(
    transport: Transport,
    sharding: Sharding,
    schema: TableSchema,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    replace: bool,
    timeout: float | None,
) -> int:
    """Write every (ids, rows) chunk into an existing table, each id to its PS, one stream per PS.

    Args:
        transport: the client's connection to its PSes.
        sharding: its address list's sharding.
        schema: the table's schema; every PS must have the table with it already.
        chunks: (ids, rows) pairs, read once, as the streams take them.
        replace: each PS first deletes the table's rows.
        timeout: seconds for the streams; None or 0: none.

    Returns:
        The rows written.

    Raises:
        PSError: a stream failed (reading of chunks stops at the first one that did).
    """
    per_id_bytes = schema.row_bytes + ID_BYTES
    queues: list[queue.Queue] = [queue.Queue(maxsize=_QUEUED_CHUNKS) for _ in transport.addresses]
    done = object()

    def stream(q: queue.Queue):
        yield ps_pb2.RowChunk(spec=schema.to_proto(), replace=replace)
        while (chunk := q.get()) is not done:
            yield chunk

    calls = [transport.stream_to(shard, "Import", stream(q), timeout) for shard, q in enumerate(queues)]

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
            ids = as_ids(ids)
            rows = np.ascontiguousarray(rows, dtype=schema.np_dtype).reshape(len(ids), schema.width)
            for shard, pos in sharding.stream_pieces(ids, per_id_bytes):
                put(shard, ps_pb2.RowChunk(ids=codec.encode_ids(ids[pos]), rows=rows[pos].tobytes()))
    finally:
        for shard in range(len(queues)):
            put(shard, done)
    return sum(transport.result(shard, call).rows_written for shard, call in enumerate(calls))
