"""Rows moved between the client and its PSes: pull, push and delete of one table, and pull_many and push_many,
several tables' rows in one call per PS (a trainer's step is then two calls, not two per table).

A call is cut by shard and under the message limit (sharding.py), its rows placed in shared memory or in the
messages (shared_memory.py), and every piece sent at once (transport.py); a pull's replies land at the caller's
positions. Row sizes come from the schema cache; a table re-created with another schema is caught and described
again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server import codec, shm
from dynemb.ps_server.client.results import PullResult
from dynemb.ps_server.client.schema_cache import SchemaCache
from dynemb.ps_server.client.sharding import Sharding
from dynemb.ps_server.client.shared_memory import Place, pull_request, pulled_rows, push_parts
from dynemb.ps_server.client.transport import Transport
from dynemb.ps_server.errors import InvalidArgument, PSError, SegmentUnusable
from dynemb.ps_server.schema import TableSchema
from dynemb.ps_server.wire import (
    MalformedMessage,
    encode_push_many_request,
    parse_pull_many_response,
    parse_pull_response,
)

ID_BYTES = 8

# The message of each row RPC, made from its pieces' requests: one piece each (Pull, Push), or several of one
# PS's (PullMany, PushMany)
_MESSAGE_OF: dict[str, Callable[[list], object]] = {
    "Pull": lambda requests: requests[0],
    "Push": lambda parts: b"".join(parts[0]),
    "PullMany": lambda requests: ps_pb2.PullManyRequest(pulls=requests),
    "PushMany": encode_push_many_request,
}
# A pull's reply, read in place: the PullReply of each piece it answers
_PULL_REPLIES: dict[str, Callable[[bytes], list]] = {
    "Pull": lambda reply: [parse_pull_response(reply)],
    "PullMany": parse_pull_many_response,
}
# When packing pieces into a message: what a piece takes per id besides its rows (when not in a segment)
_PACKED_ID_BYTES = {"PullMany": ID_BYTES + 1, "PushMany": ID_BYTES}


def as_ids(ids) -> np.ndarray:
    """Ids as a contiguous int64 array.

    Args:
        ids: one-dimensional integers: a sequence, a numpy array or a torch tensor.

    Returns:
        The ids, int64.

    Raises:
        InvalidArgument: not one-dimensional, or not integers.
    """
    if type(ids).__module__.startswith("torch"):  # a tensor; torch is not imported here
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise InvalidArgument(f"ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"ids must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_rows(table: str, ids: np.ndarray, rows, copy: bool = True) -> np.ndarray:
    """A push's rows, checked against its ids.

    Args:
        table: the table pushed to (named in the error).
        ids: the push's ids.
        rows: one row per id.
        copy: copy them (a push not waited for: the caller may reuse its buffer before the
            push runs); else copied only where not C-contiguous (a push waited for).

    Returns:
        The rows, C-contiguous.

    Raises:
        InvalidArgument: rows are not (len(ids), width).
    """
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[0] != len(ids):
        raise InvalidArgument(f"push to {table!r}: rows must be ({len(ids)}, width), got shape {rows.shape}")
    return np.array(rows, copy=True, order="C") if copy else np.ascontiguousarray(rows)


@dataclass
class _Piece:
    """One PS's part of one table's ids in a call, under the message limit."""

    shard: int
    table: str
    schema: TableSchema
    ids: np.ndarray
    dest: slice | np.ndarray | None = None  # a pull's: where its rows go in the result
    rows: np.ndarray | None = None  # a push's


class RowTransfer:
    """Pulls, pushes and deletes rows of a client's tables on its PSes.

    Args:
        transport: the client's connection to its PSes.
        sharding: its address list's sharding.
        pools: each shard's segment pool, or None where rows go as bytes (shared_memory.segment_pools).
        schemas: the client's schema cache.
    """

    def __init__(
        self, transport: Transport, sharding: Sharding, pools: list[shm.SegmentPool | None], schemas: SchemaCache
    ) -> None:
        self.transport = transport
        self.sharding = sharding
        self.pools = pools
        self.schemas = schemas

    def pull(self, table: str, ids: np.ndarray, deadline: float) -> PullResult:
        """One table's rows for ids, in their order.

        Args:
            table: the table.
            ids: int64 ids (as_ids).
            deadline: time.monotonic() seconds.

        Returns:
            The rows, ids never pushed initialised and marked missing.

        Raises:
            PSError: from the PS (TableNotFound...), or the table changed schema during the pull.
        """
        return self._segments_retried(self._pull_once, "Pull", {table: ids}, deadline)[table]

    def pull_many(self, wanted: dict[str, np.ndarray], deadline: float) -> dict[str, PullResult]:
        """Several tables' pulls, in one call per PS where they fit one message: {table: ids} -> {table: result}."""
        return self._segments_retried(self._pull_once, "PullMany", wanted, deadline)

    def push(self, table: str, ids: np.ndarray, rows: np.ndarray, deadline: float) -> int:
        """Write rows (a repeated id's last one wins).

        Args:
            table: the table.
            ids: int64 ids (as_ids).
            rows: one row per id (as_rows).
            deadline: time.monotonic() seconds.

        Returns:
            The rows given.

        Raises:
            InvalidArgument: rows not as wide as the table's.
            PSError: from the PS.
        """
        return self._segments_retried(self._push_once, "Push", {table: (ids, rows)}, deadline)

    def push_many(self, given: dict[str, tuple[np.ndarray, np.ndarray]], deadline: float) -> int:
        """Several tables' pushes, in one call per PS where they fit one message: {table: (ids, rows)}."""
        return self._segments_retried(self._push_once, "PushMany", given, deadline)

    def delete(self, table: str, ids: np.ndarray, deadline: float) -> int:
        """Delete ids' rows; returns how many there were."""
        pieces = self.sharding.split_ids(ids, ID_BYTES)
        calls = [(shard, ps_pb2.DeleteRequest(table=table, ids=i.tobytes())) for shard, _, i in pieces]
        return sum(r.rows_deleted for r in self.transport.fanout("Delete", calls, deadline))

    def _segments_retried(self, once: Callable, rpc: str, by_table: dict, deadline: float):
        """once(...), again if a PS no longer knew a segment (it restarted, or dropped ours as idle): the second try
        attaches new ones, or sends the rows as bytes."""
        try:
            return once(rpc, by_table, deadline)
        except SegmentUnusable:
            return once(rpc, by_table, deadline)
        except InvalidArgument:
            if any(pool is not None for pool in self.pools):
                # through a segment, a table re-created with another schema shows as rows of the wrong size:
                # have the next call describe it again
                for table in by_table:
                    self.schemas.forget(table)
            raise

    def _pull_once(self, rpc: str, wanted: dict[str, np.ndarray], deadline: float) -> dict[str, PullResult]:
        out, pieces = {}, []
        for table, ids in wanted.items():
            schema = self.schemas.get(table)
            out[table] = PullResult(
                np.empty((len(ids), schema.width), dtype=schema.np_dtype), np.zeros(len(ids), dtype=bool), schema.dim
            )
            cut = self.sharding.split_ids(ids, schema.row_bytes + 1)
            pieces += [_Piece(shard, table, schema, i, dest=dest) for shard, dest, i in cut]

        def fill(shard: int, sent: list[tuple[_Piece, Place | None]], reply) -> None:
            try:
                got = _PULL_REPLIES[rpc](reply)
            except MalformedMessage as e:
                raise PSError(f"PS {self.transport.addresses[shard]} sent a reply that does not parse: {e}") from None
            if len(got) != len(sent):
                raise PSError(f"PS {self.transport.addresses[shard]} answered {len(got)} pulls for {len(sent)} asked")
            for (piece, place), one in zip(sent, got):
                self._fill(out[piece.table], piece, one, place)

        self._exchange(rpc, pieces, lambda p, place: pull_request(p.table, p.ids, p.schema, place), deadline, fill)
        return out

    def _fill(self, result: PullResult, piece: _Piece, reply, place: Place | None) -> None:
        """One PullResponse's rows (in it, or in the segment at place) and missing marks into result."""
        n, schema = len(piece.ids), piece.schema
        if place is not None and n and not len(reply.rows):
            result.rows[piece.dest] = pulled_rows(place, n, schema)
        elif len(reply.rows) != n * schema.row_bytes:
            # the table was re-created with another schema since we cached it
            self.schemas.get(piece.table, refresh=True)
            raise PSError(f"table {piece.table!r} changed schema during a pull; pull again")
        else:
            result.rows[piece.dest] = np.frombuffer(reply.rows, dtype=schema.np_dtype).reshape(n, schema.width)
        if reply.num_missing:
            result.missing[piece.dest] = codec.decode_mask(reply.missing, n)

    def _push_once(self, rpc: str, given: dict[str, tuple[np.ndarray, np.ndarray]], deadline: float) -> int:
        pieces, total = [], 0
        for table, (ids, rows) in given.items():
            schema = self.schemas.get(table)
            if rows.shape[1] != schema.width:
                raise InvalidArgument(
                    f"push to {table!r}: rows have {rows.shape[1]} values, the table's rows have "
                    f"{schema.width} (dim {schema.dim} + state {schema.state_width})"
                )
            rows = np.ascontiguousarray(rows, dtype=schema.np_dtype)
            cut = self.sharding.split_rows(ids, rows, schema.row_bytes + ID_BYTES)
            pieces += [_Piece(shard, table, schema, i, rows=r) for shard, i, r in cut]
            total += len(ids)
        self._exchange(rpc, pieces, _push_piece, deadline)
        return total  # every row given was written (a repeated id's last row)

    def _exchange(
        self,
        rpc: str,
        pieces: list[_Piece],
        request: Callable[[_Piece, Place | None], object],
        deadline: float,
        on_reply: Callable | None = None,
    ) -> None:
        """Send every piece at once, its rows in a segment where the PS takes them, else in the message.

        Args:
            rpc: Pull or Push (a message per piece), PullMany or PushMany (a PS's pieces packed into messages of at
                most chunk_bytes).
            pieces: the call's pieces.
            request: a piece's request (or, for a push, its parts), given where its rows go.
            deadline: time.monotonic() seconds.
            on_reply: on_reply(shard, [(piece, place), ...], reply) for each message's reply, while the segments
                are still held.
        """
        with shm.Leases(self.pools, deadline) as leases:
            places = leases.place([(p.shard, len(p.ids) * p.schema.row_bytes) for p in pieces])
            requests = [request(p, place) for p, place in zip(pieces, places)]
            if rpc in _PACKED_ID_BYTES:
                per_id = _PACKED_ID_BYTES[rpc]
                sizes = [
                    len(p.ids) * (per_id if place else p.schema.row_bytes + per_id) for p, place in zip(pieces, places)
                ]
                shared = [len(p.ids) * p.schema.row_bytes if place else 0 for p, place in zip(pieces, places)]
                messages = self.sharding.pack(
                    [(p.shard, size, k) for k, (p, size) in enumerate(zip(pieces, sizes))],
                    shared,
                    [len(p.ids) for p in pieces],
                )
            else:
                messages = [(p.shard, [k]) for k, p in enumerate(pieces)]
            calls = [(shard, _MESSAGE_OF[rpc]([requests[k] for k in ks])) for shard, ks in messages]
            replies = self.transport.fanout(rpc, calls, deadline)
            if on_reply is not None:
                for (shard, ks), reply in zip(messages, replies):
                    on_reply(shard, [(pieces[k], places[k]) for k in ks], reply)


def _push_piece(piece: _Piece, place: Place | None) -> list:
    assert piece.rows is not None  # _push_once gives every piece its rows
    return push_parts(piece.table, piece.ids, piece.rows, place)
