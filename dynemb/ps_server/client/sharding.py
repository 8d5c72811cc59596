"""Which PS owns which id, and a batch cut into messages that each fit under the message limit.

Ids are sharded over the addresses by XXH64 of the id (hashing.shard_of): stable, the same id always goes to the
same PS for a given address list. Each shard's part is cut into pieces of at most chunk_bytes, all sent at once;
each piece says where its ids came from, so replies land at the caller's positions. Pieces of several tables for
one PS can be packed into shared messages (pull_many, push_many).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dynemb.ps_server import codec
from dynemb.ps_server.entries import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_IDS
from dynemb.ps_server.hashing import ROW_HASH_SEED, shard_of, xxh64_ids
from dynemb.ps_server.wire import MESSAGE_OVERHEAD


class Sharding:
    """Ids to shards, and batches to messages, for one address list.

    Args:
        num_shards: how many PS addresses.
        chunk_bytes: the most bytes one message may carry; bigger batches go as several.
        segment_bytes: the most bytes of rows one message's pieces may have in shared memory (a PS
            refuses a request of more rows than its --max-request-mb) [default: 4 x chunk_bytes].
    """

    def __init__(self, num_shards: int, chunk_bytes: int, segment_bytes: int | None = None) -> None:
        self.num_shards = num_shards
        self.chunk_bytes = chunk_bytes
        self.segment_bytes = 4 * chunk_bytes if segment_bytes is None else segment_bytes

    def ids_per_message(self, per_id_bytes: int) -> int:
        """How many ids of per_id_bytes each (with their rows) one message carries; at least one, at
        most a PS's default --max-request-ids."""
        return max(1, min((self.chunk_bytes - MESSAGE_OVERHEAD) // per_id_bytes, DEFAULT_MAX_IDS))

    def owners(self, ids: np.ndarray) -> np.ndarray:
        """Each id's shard: an int array shaped as ids."""
        return shard_of(ids, self.num_shards)

    def split(self, ids: np.ndarray, per_id_bytes: int) -> tuple[np.ndarray | None, list[tuple[int, slice]]]:
        """Ids grouped by shard and cut into pieces that each fit one message.

        Within a shard, ids are ordered by their row hash before cutting, so each piece maps to its own run of the
        Redis backend's buckets (see hashing.bucket_of). A shard's ids are cut in equal parts, not full ones and a
        runt.

        Args:
            ids: int64 ids.
            per_id_bytes: what an id and its row take in a message.

        Returns:
            (order, pieces): ids[order] is grouped by shard (order is None when ids need no reordering); each
            (shard, slice) piece is a slice of ids[order].
        """
        per_msg = self.ids_per_message(per_id_bytes)
        n = self.num_shards
        if n == 1 and len(ids) <= per_msg:
            return None, [(0, slice(0, len(ids)))]
        row_hash = xxh64_ids(ids, ROW_HASH_SEED)
        if n == 1:
            order, bounds = np.argsort(row_hash, kind="stable"), [0, len(ids)]
        else:
            owner = self.owners(ids)
            order = np.lexsort((row_hash, owner))
            bounds = np.searchsorted(owner[order], np.arange(n + 1)).tolist()
        pieces = []
        for shard in range(n):
            size = bounds[shard + 1] - bounds[shard]
            parts = -(-size // per_msg)
            for k in range(parts):
                lo, hi = bounds[shard] + size * k // parts, bounds[shard] + size * (k + 1) // parts
                pieces.append((shard, slice(lo, hi)))
        return order, pieces

    def split_ids(self, ids: np.ndarray, per_id_bytes: int) -> list[tuple[int, slice | np.ndarray, np.ndarray]]:
        """Ids cut by shard and under the message limit, each piece with where its ids are in the batch.

        Args:
            ids: int64 ids.
            per_id_bytes: what an id and its row take in a message.

        Returns:
            (shard, dest, piece_ids) pieces, none for no ids: ids[dest] == piece_ids.
        """
        if len(ids) == 0:
            return []
        order, pieces = self.split(ids, per_id_bytes)
        grouped = ids if order is None else ids[order]
        return [(shard, sl if order is None else order[sl], grouped[sl]) for shard, sl in pieces]

    def split_rows(
        self, ids: np.ndarray, rows: np.ndarray, per_id_bytes: int
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """A push's ids and rows cut by shard and under the message limit.

        Pieces travel concurrently: an id repeated across two of them could land in either order, so when the batch
        is cut in several, only each id's last row is kept (what one PS would keep).

        Args:
            ids: int64 ids.
            rows: their rows, one per id.
            per_id_bytes: what an id and its row take in a message.

        Returns:
            (shard, piece_ids, piece_rows) pieces, none for no ids.
        """
        if len(ids) == 0:
            return []
        order, pieces = self.split(ids, per_id_bytes)
        if len(pieces) > 1:
            uniq, last = codec.last_occurrence(ids)
            if len(uniq) < len(ids):
                ids, rows = ids[last], rows[last]
                order, pieces = self.split(ids, per_id_bytes)
        if order is not None:
            ids, rows = ids[order], rows[order]
        return [(shard, ids[sl], rows[sl]) for shard, sl in pieces]

    def pack(
        self,
        pieces: list[tuple[int, int, object]],
        in_segments: list[int] | None = None,
        ids_in: list[int] | None = None,
    ) -> list[tuple[int, list]]:
        """Pieces packed into messages of at most chunk_bytes each (and at most segment_bytes of rows
        in shared memory, DEFAULT_MAX_IDS ids and DEFAULT_MAX_ENTRIES pieces: a PS's default limits),
        a shard's pieces in their order.

        Args:
            pieces: (shard, bytes, item); a piece already fits one message alone (`split` cut it so).
            in_segments: each piece's bytes of rows in shared memory (not in the message) [default: none].
            ids_in: each piece's ids [default: not counted].

        Returns:
            (shard, [item, ...]) messages, in the order their first piece came.
        """
        messages: list[tuple[int, list]] = []
        open_msg: dict[int, tuple[int, int, int, list]] = {}
        for k, (shard, nbytes, item) in enumerate(pieces):
            shared = in_segments[k] if in_segments is not None else 0
            ids = ids_in[k] if ids_in is not None else 0
            size, rows, n, items = open_msg.get(shard, (MESSAGE_OVERHEAD, 0, 0, None))
            if (
                items is None
                or size + nbytes > self.chunk_bytes
                or (rows and rows + shared > self.segment_bytes)
                or n + ids > DEFAULT_MAX_IDS
                or len(items) >= DEFAULT_MAX_ENTRIES
            ):
                items = []
                messages.append((shard, items))
                size, rows, n = MESSAGE_OVERHEAD, 0, 0
            items.append(item)
            open_msg[shard] = (size + nbytes, rows + shared, n + ids, items)
        return messages

    def stream_pieces(self, ids: np.ndarray, per_id_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """A chunk of a stream (import) cut by shard and under the message limit, keeping the chunk's order.

        Args:
            ids: int64 ids.
            per_id_bytes: what an id and its row take in a message.

        Returns:
            (shard, positions in ids) pieces, shard by shard.
        """
        per_msg = self.ids_per_message(per_id_bytes)
        owner = self.owners(ids) if self.num_shards > 1 else None
        for shard in range(self.num_shards):
            pos = np.arange(len(ids)) if owner is None else np.flatnonzero(owner == shard)
            for start in range(0, len(pos), per_msg):
                yield shard, pos[start : start + per_msg]
