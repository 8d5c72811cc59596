"""The table file format of a checkpoint's .index (TensorFlow's copy of LevelDB's SSTable).

Written by hand because the only maintained readers live inside TensorFlow (and LevelDB
bindings read LevelDB's own files, not these): the format is small and stable.

    file    := data block* , metaindex block , index block , footer
    footer  := metaindex handle , index handle , zero padding to 40 bytes , magic (8 bytes LE)
    handle  := varint64 offset , varint64 size
    block   := entry* , restart offsets (uint32 LE each) , restart count (uint32 LE) ,
               then a trailer: compression type (1 byte, 0 = none) , masked CRC-32C (4 bytes LE)
               of the block and its type byte
    entry   := varint32 shared key bytes , varint32 new key bytes , varint32 value bytes ,
               the new key bytes , the value

The index block maps each data block's last key to its handle; the entries of the data
blocks, in order, are the file's (key, value) pairs, sorted by key.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import google_crc32c

from dynemb.tf.errors import TFMigrationError

MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
TRAILER_BYTES = 5
_MASK_DELTA = 0xA282EAD8


def unmask_crc(masked: int) -> int:
    """TensorFlow and LevelDB store CRCs 'masked' (rotated and offset), so a CRC of data that
    embeds CRCs stays well distributed; this undoes it."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def read_varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    """A protobuf varint of buf at pos.

    Args:
        buf: the bytes.
        pos: where the varint starts.
        where: the file and block, for the message.

    Returns:
        (its value, the position after it).

    Raises:
        TFMigrationError: it runs past the end of buf (a corrupt file).
    """
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise TFMigrationError(f"{where}: a varint runs past its block: the file is corrupt")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _handle(buf: bytes, pos: int, where: str) -> tuple[int, int, int]:
    offset, pos = read_varint(buf, pos, where)
    size, pos = read_varint(buf, pos, where)
    return offset, size, pos


def _block(data: bytes, offset: int, size: int, path: str) -> bytes:
    end = offset + size + TRAILER_BYTES
    if offset < 0 or end > len(data):
        raise TFMigrationError(
            f"{path}: a block at bytes [{offset}, {end}) lies past the end of the "
            f"{len(data)}-byte file: the file is truncated or corrupt"
        )
    block = data[offset : offset + size]
    kind = data[offset + size]
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    if google_crc32c.value(data[offset : offset + size + 1]) != unmask_crc(stored):
        raise TFMigrationError(f"{path}: the block at byte {offset} fails its CRC-32C check: the file is corrupt")
    if kind != 0:
        raise TFMigrationError(
            f"{path}: the block at byte {offset} is compressed (type {kind}); only "
            f"uncompressed tables (what TensorFlow writes) are read"
        )
    return block


def _entries(block: bytes, where: str) -> Iterator[tuple[bytes, bytes]]:
    if len(block) < 4:
        raise TFMigrationError(f"{where}: a block of {len(block)} bytes is too short: the file is corrupt")
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * restarts
    if end < 0:
        raise TFMigrationError(f"{where}: a block claims {restarts} restart points: the file is corrupt")
    pos, key = 0, b""
    while pos < end:
        shared, pos = read_varint(block, pos, where)
        fresh, pos = read_varint(block, pos, where)
        size, pos = read_varint(block, pos, where)
        if shared > len(key) or pos + fresh + size > end:
            raise TFMigrationError(f"{where}: an entry runs past its block: the file is corrupt")
        key = key[:shared] + block[pos : pos + fresh]
        pos += fresh
        yield key, block[pos : pos + size]
        pos += size


def read_table(data: bytes, path: str) -> Iterator[tuple[bytes, bytes]]:
    """Every (key, value) of a table file's bytes, in key order; blocks are CRC-checked."""
    if len(data) < FOOTER_BYTES:
        raise TFMigrationError(
            f"{path}: {len(data)} bytes is too short for a checkpoint index "
            f"(a {FOOTER_BYTES}-byte footer at least): the file is truncated"
        )
    footer = data[-FOOTER_BYTES:]
    (magic,) = struct.unpack_from("<Q", footer, FOOTER_BYTES - 8)
    if magic != MAGIC:
        raise TFMigrationError(
            f"{path}: not a TensorFlow checkpoint index (its last 8 bytes are not the "
            f"table magic number): the file is truncated, corrupt or of another kind"
        )
    _, _, pos = _handle(footer, 0, path)  # the metaindex: TensorFlow's bundles keep nothing there
    index_offset, index_size, _ = _handle(footer, pos, path)
    for _, handle in _entries(_block(data, index_offset, index_size, path), path):
        offset, size, _ = _handle(handle, 0, path)
        yield from _entries(_block(data, offset, size, path), path)
