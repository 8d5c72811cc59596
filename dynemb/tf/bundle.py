"""A reader of TensorFlow tensor bundles: TF1 Saver (V2) checkpoints, TF2 checkpoints and a
SavedModel's variables/ all store their tensors this way.

    <prefix>.index                   a table (sstable.py) of key → BundleEntryProto
                                     (dynemb/protos/tf_bundle.proto); the empty key → the header
    <prefix>.data-00000-of-00002     the tensors' raw bytes, little-endian, row-major
    <prefix>.data-00001-of-00002

Written by hand because nothing outside TensorFlow reads this format and TensorFlow is a
2 GB dependency we must not need for a migration. Every tensor read is checked against the
CRC-32C its entry records; a truncated data file, a corrupt byte, an unknown dtype or a
missing slice is a TFMigrationError that names the file and tensor.

A partitioned variable (tf.compat.v1.fixed_size_partitioner) is one entry with the full
shape and a list of slices; each slice is its own entry under a key that encodes (name,
slice) with TensorFlow's OrderedCode (below). read_rows() assembles the slices.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import google_crc32c
import numpy as np
from google.protobuf.message import DecodeError

from dynemb.protos import tf_bundle_pb2 as pb
from dynemb.tf.errors import TFMigrationError
from dynemb.tf.sstable import read_table, read_varint, unmask_crc

# The dtypes a tensor can be read as, by TensorFlow's Python names (tf.float32, ...), which numpy
# shares but for bfloat16, kept as its 16 bits (uint16). Stored little-endian.
_READABLE = "float32 float64 float16 bfloat16 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool".split()
_ENUM_NAMES = {"float32": "DT_FLOAT", "float64": "DT_DOUBLE", "float16": "DT_HALF"}  # the rest: DT_ + NAME
# TensorFlow DataType → (name, numpy storage)
DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DataType.Value(_ENUM_NAMES.get(name, "DT_" + name.upper())): (
        name,
        np.dtype("uint16" if name == "bfloat16" else name).newbyteorder("<"),
    )
    for name in _READABLE
}
STRING = pb.DT_STRING
HEADER_KEY = b""


def dtype_name(dtype: int) -> str:
    """A TensorFlow DataType's name (float32, string, ...), or dtype#N for a number TensorFlow does not know."""
    if dtype in DTYPES:
        return DTYPES[dtype][0]
    if dtype == STRING:
        return "string"
    return pb.DataType.Name(dtype).removeprefix("DT_").lower() if dtype in pb.DataType.values() else f"dtype#{dtype}"


# -- OrderedCode, TensorFlow's order-preserving encoding of slice keys --------------------


def _increasing(value: int) -> bytes:
    body = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(body)]) + body


def _ordered_string(raw: bytes) -> bytes:
    """Escape 0x00 and 0xff, then terminate with 0x00 0x01 (so shorter strings sort first)."""
    out = bytearray()
    for c in raw:
        out += b"\x00\xff" if c == 0 else b"\xff\x00" if c == 0xFF else bytes([c])
    return bytes(out) + b"\x00\x01"


_HEADER_BITS = {
    1: (0x80, 0),
    2: (0xC0, 0),
    3: (0xE0, 0),
    4: (0xF0, 0),
    5: (0xF8, 0),
    6: (0xFC, 0),
    7: (0xFE, 0),
    8: (0xFF, 0),
    9: (0xFF, 0x80),
    10: (0xFF, 0xC0),
}


def _signed_increasing(value: int) -> bytes:
    magnitude = ~value if value < 0 else value
    length = magnitude.bit_length() // 7 + 1  # 7 bits of payload per byte, header bits aside
    body = bytearray(value.to_bytes(10, "big", signed=True)[10 - length :])
    body[0] ^= _HEADER_BITS[length][0]
    if length > 1:
        body[1] ^= _HEADER_BITS[length][1]
    return bytes(body)


def slice_key(name: str, extents: list[tuple[int, int]]) -> bytes:
    """The .index key of one slice of `name`: (start, length) per dimension, length -1 = all."""
    key = _increasing(0) + _ordered_string(name.encode()) + _increasing(len(extents))
    for start, length in extents:
        key += _signed_increasing(start) + _signed_increasing(length)
    return key


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the index lists it: name, TensorFlow dtype name, shape, and slices if partitioned."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    slices: int = 0  # partitioned: how many slices


def _extents(slice_proto: pb.TensorSliceProto, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(e.start, e.length if e.HasField("length") else -1) for e in slice_proto.extent] + [(0, -1)] * (
        len(shape) - len(slice_proto.extent)
    )


class Bundle:
    """The tensors of one checkpoint prefix (the path without .index / .data-*)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = str(prefix)
        self.index_path = self.prefix + ".index"
        try:
            with open(self.index_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise TFMigrationError(
                f"{self.index_path}: no such file (a checkpoint prefix P has P.index and P.data-00000-of-0000N)"
            ) from None
        self.entries: dict[str, pb.BundleEntryProto] = {}
        self._slice_entries: dict[bytes, pb.BundleEntryProto] = {}
        header = None
        for key, value in read_table(data, self.index_path):
            try:
                if key == HEADER_KEY:
                    header = pb.BundleHeaderProto.FromString(value)
                    continue
                entry = pb.BundleEntryProto.FromString(value)
            except DecodeError:
                raise TFMigrationError(
                    f"{self.index_path}: the entry of key {key!r} does not parse: the index is corrupt"
                ) from None
            if key[:1] == b"\x00":
                self._slice_entries[key] = entry
            else:
                self.entries[key.decode("utf-8", errors="replace")] = entry
        if header is None:
            raise TFMigrationError(f"{self.index_path}: no bundle header (the entry with the empty key)")
        if header.endianness != pb.BundleHeaderProto.LITTLE:
            raise TFMigrationError(f"{self.index_path}: a big-endian checkpoint; only little-endian ones are read")
        self.num_shards = max(1, header.num_shards)
        self._data: dict[int, np.ndarray] = {}

    # -- listing ------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor's name, sorted."""
        return sorted(self.entries)

    def entry(self, name: str) -> pb.BundleEntryProto:
        """The index entry of a tensor; raises TFMigrationError if there is none."""
        try:
            return self.entries[name]
        except KeyError:
            raise TFMigrationError(f"{self.prefix}: no tensor named {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        """The TensorInfo of a tensor; raises TFMigrationError if there is none."""
        e = self.entry(name)
        return TensorInfo(name, dtype_name(e.dtype), tuple(d.size for d in e.shape.dim), len(e.slices))

    # -- bytes --------------------------------------------------------------------

    def data_path(self, shard: int) -> str:
        """The path of data shard number shard (P.data-SSSSS-of-NNNNN for prefix P)."""
        return f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

    def _file(self, shard: int, name: str) -> np.ndarray:
        if shard not in self._data:
            if not 0 <= shard < self.num_shards:
                raise TFMigrationError(
                    f"{self.index_path}: tensor {name!r} is in data shard {shard}, but the "
                    f"header says there are {self.num_shards}"
                )
            path = self.data_path(shard)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise TFMigrationError(f"{path}: no such file (tensor {name!r} is stored there)") from None
            self._data[shard] = np.memmap(path, mode="r", dtype=np.uint8) if size else np.zeros(0, np.uint8)
        return self._data[shard]

    def _raw(self, entry: pb.BundleEntryProto, name: str) -> np.ndarray:
        data = self._file(entry.shard_id, name)
        end = entry.offset + entry.size
        if entry.offset < 0 or end > len(data):
            raise TFMigrationError(
                f"{self.data_path(entry.shard_id)}: {len(data)} bytes, but tensor {name!r} "
                f"is at bytes [{entry.offset}, {end}): the file is truncated"
            )
        return data[entry.offset : end]

    def _pieces(self, name: str) -> Sequence[tuple[pb.BundleEntryProto, list[tuple[int, int]] | None]]:
        """(entry, extents) of each stored piece: the tensor itself, or each of its slices."""
        e = self.entry(name)
        if not e.slices:
            return [(e, None)]
        shape = tuple(d.size for d in e.shape.dim)
        pieces = []
        for sl in e.slices:
            ext = _extents(sl, shape)
            key = slice_key(name, ext)
            if key not in self._slice_entries:
                raise TFMigrationError(
                    f"{self.index_path}: slice {ext} of partitioned tensor {name!r} is listed "
                    f"but has no entry: the index is corrupt"
                )
            pieces.append((self._slice_entries[key], ext))
        stored = sum(math.prod(self._piece_shape(shape, ext)) for _, ext in pieces)
        if stored != math.prod(shape):
            raise TFMigrationError(
                f"{self.index_path}: the slices of {name!r} hold {stored} values, its shape "
                f"{list(shape)} has {math.prod(shape)}"
            )
        return pieces

    @staticmethod
    def _piece_shape(shape, ext) -> tuple[int, ...]:
        return tuple(n if length < 0 else length for n, (_, length) in zip(shape, ext))

    def _numeric(self, name: str) -> tuple[str, np.dtype, tuple[int, ...]]:
        e = self.entry(name)
        if e.dtype not in DTYPES:
            raise TFMigrationError(
                f"{self.prefix}: tensor {name!r} has dtype {dtype_name(e.dtype)} "
                f"(TensorFlow DataType {e.dtype}), which dynemb cannot read as numbers"
            )
        tag, np_dtype = DTYPES[e.dtype]
        return tag, np_dtype, tuple(d.size for d in e.shape.dim)

    def _check_piece_size(self, entry, shape, np_dtype, name: str) -> None:
        want = math.prod(shape) * np_dtype.itemsize
        if entry.size != want:
            raise TFMigrationError(
                f"{self.index_path}: tensor {name!r} has {entry.size} bytes, its shape "
                f"{list(shape)} of {np_dtype} needs {want}: the index is corrupt"
            )

    # -- checks -------------------------------------------------------------------

    def verify(self, name: str) -> None:
        """Check the CRC-32C of every stored byte of the tensor (all its slices)."""
        for entry, _ in self._pieces(name):
            raw = self._raw(entry, name)
            if self.entry(name).dtype == STRING:
                crc = self._strings(raw, self._count(name), name)[1]
            else:
                crc = 0
                for lo in range(0, len(raw), 64 << 20):
                    crc = google_crc32c.extend(crc, raw[lo : lo + (64 << 20)])
            if crc != unmask_crc(entry.crc32c):
                raise TFMigrationError(
                    f"{self.data_path(entry.shard_id)}: tensor {name!r} (bytes [{entry.offset}, "
                    f"{entry.offset + entry.size})) has CRC-32C {crc:#010x}, the index records "
                    f"{unmask_crc(entry.crc32c):#010x}: the data file is corrupt"
                )

    def _count(self, name: str) -> int:
        return math.prod(d.size for d in self.entry(name).shape.dim)

    # -- values -------------------------------------------------------------------

    def read(self, name: str) -> np.ndarray:
        """The whole tensor (strings: an object array of bytes)."""
        e = self.entry(name)
        shape = tuple(d.size for d in e.shape.dim)
        if e.dtype == STRING:
            if e.slices:
                raise TFMigrationError(f"{self.prefix}: partitioned string tensor {name!r} is not supported")
            values, _ = self._strings(self._raw(e, name), math.prod(shape), name)
            return np.array(values, dtype=object).reshape(shape)
        if not shape:
            _, np_dtype, _ = self._numeric(name)
            self._check_piece_size(e, (), np_dtype, name)
            return np.frombuffer(self._raw(e, name).tobytes(), dtype=np_dtype).reshape(())
        return self.read_rows(name, 0, shape[0])

    def read_rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) along the first dimension, slices assembled (a copy, host order)."""
        if self.entry(name).dtype == STRING and self.entry(name).shape.dim:
            return self.read(name)[lo:hi]
        _, np_dtype, shape = self._numeric(name)
        if not shape:
            raise TFMigrationError(f"{self.prefix}: tensor {name!r} is a scalar; it has no rows")
        lo, hi = max(0, lo), min(hi, shape[0])
        out = np.empty((max(0, hi - lo), *shape[1:]), dtype=np_dtype)
        for entry, ext in self._pieces(name):
            piece_shape = shape if ext is None else self._piece_shape(shape, ext)
            self._check_piece_size(entry, piece_shape, np_dtype, name)
            start = 0 if ext is None else ext[0][0]
            a, b = max(lo, start), min(hi, start + piece_shape[0])
            if a >= b:
                continue
            row_bytes = math.prod(piece_shape[1:]) * np_dtype.itemsize
            raw = self._raw(entry, name)[(a - start) * row_bytes : (b - start) * row_bytes]
            rows = np.frombuffer(raw, dtype=np_dtype).reshape((b - a, *piece_shape[1:]))
            region = (slice(a - lo, b - lo),) + tuple(
                slice(None) if ext is None or length < 0 else slice(s, s + length)
                for s, length in (ext[1:] if ext is not None else [(0, -1)] * (len(shape) - 1))
            )
            out[region] = rows
        return out

    def _strings(self, raw: np.ndarray, count: int, name: str) -> tuple[list[bytes], int]:
        """Decode a string tensor: varint64 lengths, a masked CRC of the lengths, the bytes.
        Returns (values, the CRC-32C TensorFlow computes over them)."""
        buf = raw.tobytes()
        where = f"{self.prefix}: string tensor {name!r}"
        pos, lengths, crc = 0, [], 0
        for _ in range(count):
            n, pos = read_varint(buf, pos, where)
            lengths.append(n)
            # TensorFlow checksums each length as uint32 (uint64 beyond that), not as its varint
            crc = google_crc32c.extend(crc, struct.pack("<I", n) if n <= 0xFFFFFFFF else struct.pack("<Q", n))
        if pos + 4 > len(buf):
            raise TFMigrationError(f"{where}: truncated")
        crc = google_crc32c.extend(crc, buf[pos : pos + 4])
        pos += 4
        values = []
        for n in lengths:
            values.append(buf[pos : pos + n])
            crc = google_crc32c.extend(crc, buf[pos : pos + n])
            pos += n
        if pos > len(buf):
            raise TFMigrationError(f"{where}: its strings run past its {len(buf)} bytes: the file is corrupt")
        return values, crc
