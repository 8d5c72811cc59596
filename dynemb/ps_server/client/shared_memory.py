"""The client's side of same-host row transfer (the mechanism is shm.py): which PSes get rows through shared
memory, the calls that attach and detach a segment, and requests whose rows are in a segment.

A PS on this host (a loopback address, or shared_memory=True) gets the rows of pulls and pushes through shared
memory rather than in the messages: same calls, same results, 2-2.6x the rows per second (bench/RESULTS.md).
Where the PS cannot map our memory, rows go as bytes.
"""

from __future__ import annotations

import time

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server import shm
from dynemb.ps_server.addresses import REPLICAS, split_hostport
from dynemb.ps_server.client.transport import Transport
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.wire import push_request_parts

Place = tuple[shm.Segment, int]  # a segment, and the offset of a piece's rows in it


def on_loopback(address: str) -> bool:
    """Whether every replica of a shard's address is this host by a loopback name."""
    try:
        hosts = [split_hostport(a.strip())[0] for a in address.split(REPLICAS) if a.strip()]
    except InvalidArgument:
        return address.startswith("unix:")
    return bool(hosts) and all(h == "localhost" or h == "::1" or h.startswith("127.") for h in hosts)


def segment_pools(transport: Transport, shared_memory: bool | None, keep: int) -> list[shm.SegmentPool | None]:
    """Each shard's pool of segments, or None where its rows go as bytes.

    Args:
        transport: the client's connection to its PSes.
        shared_memory: None: with a PS on a loopback address; True: try every PS (one on this host by another
            address); False: never.
        keep: idle segments a pool keeps for reuse (one per call the client can have in flight).

    Returns:
        One entry per shard.
    """

    def attach(shard: int, path: str, size: int, token: bytes, deadline: float) -> int:
        req = ps_pb2.AttachSegmentRequest(path=path, size=size, token=token)
        # within the call's deadline, and short: a PS that is away gets the rows as bytes, retried as such
        return transport.call(shard, "AttachSegment", req, min(deadline, time.monotonic() + 5.0)).segment

    def detach(shard: int, segment: int):
        # not waited on, not retried: a PS that is away drops the segment itself once idle
        return transport.send_once(shard, "DetachSegment", ps_pb2.DetachSegmentRequest(segment=segment), 5.0)

    def pool(shard: int, address: str) -> shm.SegmentPool:
        return shm.SegmentPool(lambda *a: attach(shard, *a), lambda segment: detach(shard, segment), address, keep=keep)

    return [
        pool(k, a) if shm.available() and (shared_memory or (shared_memory is None and on_loopback(a))) else None
        for k, a in enumerate(transport.addresses)
    ]


def pull_request(table: str, ids: np.ndarray, schema: TableSchema, place: Place | None) -> ps_pb2.PullRequest:
    """A PullRequest whose rows are to come in the reply, or (place) into a segment.

    Args:
        table: the table pulled from.
        ids: its ids.
        schema: the table's schema (sizes the rows).
        place: where in a segment the rows go, or None.

    Returns:
        The request.
    """
    req = ps_pb2.PullRequest(table=table, ids=ids.tobytes())
    if place is not None:
        seg, offset = place
        req.rows_to.segment, req.rows_to.offset, req.rows_to.size = seg.segment, offset, len(ids) * schema.row_bytes
    return req


def push_parts(table: str, ids: np.ndarray, rows: np.ndarray, place: Place | None) -> list:
    """A PushRequest's serialized parts (wire.py), its rows in the message or, at place, copied into a segment.

    Args:
        table: the table pushed to.
        ids: its ids.
        rows: their rows, of the table's dtype.
        place: where in a segment the rows go, or None.

    Returns:
        The parts, to be joined.
    """
    if place is None:
        return push_request_parts(table, ids, rows)
    seg, offset = place
    n, width = rows.shape
    seg.rows(offset, n, width, rows.dtype)[...] = rows
    return push_request_parts(table, ids, None, (seg.segment, offset, rows.nbytes))


def pulled_rows(place: Place, n: int, schema: TableSchema) -> np.ndarray:
    """The n rows a PS wrote into a segment at place for a pull."""
    return place[0].rows(place[1], n, schema.width, schema.np_dtype)
