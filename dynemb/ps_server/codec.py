"""Packing ids, rows and missing-masks to and from the wire's little-endian bytes."""

from __future__ import annotations

import numpy as np

from dynemb.common.arrays import unique_first
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import TableSchema

ID_DTYPE = np.dtype("<i8")


def decode_ids(data: bytes, table: str = "") -> np.ndarray:
    """Ids packed as little-endian int64.

    Args:
        data: the packed bytes.
        table: the table, named in the error.

    Returns:
        The ids, aligned (a view of data where it is aligned).

    Raises:
        InvalidArgument: the length is not a multiple of 8.
    """
    if len(data) % 8:
        where = f" for table {table!r}" if table else ""
        raise InvalidArgument(
            f"ids{where} must be packed int64 (8 bytes each), got {len(data)} bytes, which is not a multiple of 8"
        )
    ids = np.frombuffer(data, dtype=ID_DTYPE)
    # ids read in place from a message (wire.py) may start at any byte; the compiled id
    # index reads aligned int64s, and a copy of the ids is small next to their rows
    return ids if ids.flags.aligned else ids.copy()


def encode_ids(ids) -> bytes:
    """Ids packed as little-endian int64 bytes."""
    return np.ascontiguousarray(ids, dtype=ID_DTYPE).tobytes()


def decode_rows(data: bytes, schema: TableSchema, num_ids: int) -> np.ndarray:
    """Rows packed in the table's dtype, as a (num_ids, width) view of data.

    Raises:
        InvalidArgument: data is not num_ids rows of the schema's size.
    """
    expected = num_ids * schema.row_bytes
    if len(data) != expected:
        raise InvalidArgument(
            f"rows for table {schema.name!r} must be {num_ids} ids x {schema.width} values "
            f"(dim {schema.dim} + state {schema.state_width}) x {schema.np_dtype.itemsize} bytes "
            f"= {expected} bytes, got {len(data)} bytes"
            + (
                f" (that is {len(data) / max(num_ids, 1) / schema.np_dtype.itemsize:g} values per row)"
                if num_ids
                else ""
            )
        )
    return np.frombuffer(data, dtype=schema.np_dtype).reshape(num_ids, schema.width)


def rows_for_table(rows: np.ndarray, schema: TableSchema, n: int) -> np.ndarray:
    """rows as a contiguous (n, width) array of the table's dtype, or InvalidArgument. Stores
    check rows against the table as they find it: it may have been dropped and re-created
    with another schema since the service decoded them (an import stream outlives that)."""
    rows = np.asarray(rows)
    if rows.shape != (n, schema.width):
        raise InvalidArgument(f"rows for table {schema.name!r} must have shape ({n}, {schema.width}), got {rows.shape}")
    # bf16 is raw uint16 bits: a float array cast to it would be silent garbage
    if rows.dtype != schema.np_dtype and (schema.dtype == "bf16" or rows.dtype.kind != "f"):
        raise InvalidArgument(f"rows for {schema.dtype} table {schema.name!r} cannot be {rows.dtype}")
    return np.ascontiguousarray(rows, dtype=schema.np_dtype)


def encode_mask(mask: np.ndarray) -> bytes:
    """A bool mask packed 8 to a byte, first entry in the lowest bit."""
    return np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()


def decode_mask(data: bytes, n: int) -> np.ndarray:
    """The first n entries of a mask packed by encode_mask, as bools."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little", count=n)
    return bits.astype(bool)


def last_occurrence(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct ids, position of each one's last occurrence): a repeated id's last row wins."""
    rev = ids[::-1]
    uniq, first_in_rev = unique_first(rev)
    return uniq, len(ids) - 1 - first_in_rev
