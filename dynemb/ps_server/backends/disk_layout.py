"""How the disk store lays rows and records out in RocksDB, made and read a batch at a time.

A row's key is 12 bytes: its table's number (4 bytes big-endian, never reused) and its id (8
bytes big-endian with the sign bit flipped, so byte order is the ids' signed order). A table is
then one key range: a drop or clear is one range delete, an export or a sweep one ordered scan,
ids ascending. The value is the row's bytes (little-endian, as they travel), then, in a table
whose rows expire, the row's 4-byte stamp (lifecycle.py); a row written before its table's
lifecycle was set has none and counts as stamped at the lifecycle's `since`.

Keys and values of a batch are made by numpy in one operation each (a (n, 12) byte array viewed
as 12-byte voids, listed): no Python per row beyond the list the binding takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynemb.ps_server.lifecycle import STAMP_BYTES, STAMP_DTYPE

TABLE_BYTES = 4
ID_BYTES = 8
KEY_BYTES = TABLE_BYTES + ID_BYTES
_SIGN = np.uint64(1 << 63)
# the most tables one store ever numbers (a number is never reused, drops included)
MAX_TABLE_NUMBER = (1 << 32) - 1


def table_prefix(number: int) -> bytes:
    """The 4 bytes every key of table `number` starts with."""
    return number.to_bytes(TABLE_BYTES, "big")


def table_range(number: int) -> tuple[bytes, bytes]:
    """[first, end) of table `number`'s keys (rows, or its logs in their column family)."""
    return table_prefix(number), table_prefix(number + 1) if number < MAX_TABLE_NUMBER else b"\xff" * (TABLE_BYTES + 1)


def id_bytes(ids: np.ndarray) -> np.ndarray:
    """(n, 8) uint8: each id as 8 big-endian bytes whose order is the ids' signed order."""
    flipped = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64) ^ _SIGN
    return flipped.astype(">u8").view(np.uint8).reshape(-1, ID_BYTES)


def row_keys(number: int, ids: np.ndarray) -> list[bytes]:
    """The keys of ids' rows in table `number`, in the order of ids."""
    keys = np.empty((len(ids), KEY_BYTES), dtype=np.uint8)
    keys[:, :TABLE_BYTES] = np.frombuffer(table_prefix(number), dtype=np.uint8)
    keys[:, TABLE_BYTES:] = id_bytes(ids)
    return keys.view(f"V{KEY_BYTES}").ravel().tolist()


def row_key(number: int, id_: int) -> bytes:
    """The key of one id's row (a scan's starting point)."""
    return table_prefix(number) + ((id_ & ((1 << 64) - 1)) ^ (1 << 63)).to_bytes(ID_BYTES, "big")


def ids_of_keys(keys: list[bytes]) -> np.ndarray:
    """The ids of row keys (any tables'), as int64."""
    if not keys:
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, KEY_BYTES)[:, TABLE_BYTES:]
    return (np.ascontiguousarray(raw).view(">u8").ravel().astype(np.uint64) ^ _SIGN).view(np.int64)


def cursor_of_key(key: bytes) -> int:
    """A scan cursor (never 0: 0 is a pass's start and end) that resumes at this row key."""
    return int.from_bytes(key[TABLE_BYTES:KEY_BYTES], "big") + 1


def key_of_cursor(number: int, cursor: int) -> bytes:
    """The row key a scan cursor resumes at (cursor 0: the table's first key)."""
    if cursor <= 0:
        return table_prefix(number)
    return table_prefix(number) + min(cursor - 1, (1 << 64) - 1).to_bytes(ID_BYTES, "big")


def row_values(rows: np.ndarray, row_bytes: int, stamp: int | None) -> list[bytes]:
    """The values of rows (n, width) of the table's dtype, each ending in `stamp` unless None."""
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), row_bytes)
    if stamp is None:
        return raw.view(f"V{row_bytes}").ravel().tolist()
    out = np.empty((len(rows), row_bytes + STAMP_BYTES), dtype=np.uint8)
    out[:, :row_bytes] = raw
    out[:, row_bytes:] = np.frombuffer(np.array([stamp], dtype=STAMP_DTYPE).tobytes(), dtype=np.uint8)
    return out.view(f"V{row_bytes + STAMP_BYTES}").ravel().tolist()


def decode_values(values: Sequence[bytes | None], row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(found: bool per value, rows: (found, row_bytes) uint8, stamps: uint32 per found row, 0
    where a value carries none) of values read by key (None: no such row)."""
    found = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    present = [v for v in values if v is not None] if not found.all() else values
    buf = np.frombuffer(b"".join(present), dtype=np.uint8)  # type: ignore[arg-type]
    k = len(present)
    if len(buf) == k * row_bytes:  # no stamps (a table whose rows never expire)
        return found, buf.reshape(k, row_bytes), np.zeros(k, dtype=STAMP_DTYPE)
    stamped = row_bytes + STAMP_BYTES
    if len(buf) == k * stamped:
        both = buf.reshape(k, stamped)
        return found, both[:, :row_bytes], np.ascontiguousarray(both[:, row_bytes:]).view(STAMP_DTYPE).ravel()
    # a mix: rows written before and after the table's lifecycle was set
    lengths = np.fromiter(map(len, present), dtype=np.int64, count=k)  # type: ignore[arg-type]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    rows = buf[starts[:, None] + np.arange(row_bytes)]
    stamps = np.zeros(k, dtype=STAMP_DTYPE)
    has = lengths == stamped
    if has.any():
        at = starts[has][:, None] + row_bytes + np.arange(STAMP_BYTES)
        stamps[has] = np.ascontiguousarray(buf[at]).view(STAMP_DTYPE).ravel()
    return found, rows, stamps
