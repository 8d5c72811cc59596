"""Deterministic initial values for rows that were never pushed.

A pulled-but-missing row must come back the same on every pull and on every PS
(a retried or re-sharded pull must not see new random values), so each value is
a function of (seed, id, column) only: a SplitMix64 mix of those three gives a
uniform 53-bit number, which is scaled (uniform) or paired by Box-Muller (normal).
numpy's generators are stream-based and cannot be keyed by arbitrary ids per
element, hence this small counter-based generator.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

import numpy as np

from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import TableSchema

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


_MASK = (1 << 64) - 1


def _stream_key(seed: int, stream: int) -> int:
    """The key of a (seed, stream), in Python ints (as numpy scalars it cost ~10 us a call)."""
    z = ((seed & _MASK) * int(_GOLDEN) + stream) & _MASK
    z = ((z ^ (z >> 30)) * int(_M1)) & _MASK
    z = ((z ^ (z >> 27)) * int(_M2)) & _MASK
    return z ^ (z >> 31)


def _uniform01(seed: int, ids: np.ndarray, cols: int, stream: int) -> np.ndarray:
    """U[0,1) of shape (len(ids), cols), a pure function of (seed, stream, id, column)."""
    with np.errstate(over="ignore"):
        base = _mix(ids.astype(np.int64).view(np.uint64) ^ np.uint64(_stream_key(seed, stream)))
        col = np.arange(1, cols + 1, dtype=np.uint64) * _GOLDEN
        z = _mix(base[:, None] + col[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore"):
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as the float32 values they stand for."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_table_dtype(values: np.ndarray, schema: TableSchema) -> np.ndarray:
    """Values in a table's storage dtype (bf16: bit patterns, rounded to nearest even)."""
    if schema.dtype == "bf16":
        return float_to_bf16_bits(values.astype(np.float32))
    return values.astype(schema.np_dtype)


# The largest finite value of each dtype (bf16: 0x7F7F).
DTYPE_MAX = {
    "fp32": float(np.finfo(np.float32).max),
    "fp16": float(np.finfo(np.float16).max),
    "bf16": 3.3895313892515355e38,
}
# The largest |z| of a normal draw here: sqrt(-2 ln(1 - u)), u in [0, 1 - 2**-53] (see _uniform01).
NORMAL_MAX_Z = float(np.sqrt(-2.0 * np.log(2.0**-53)))
# Values computed at once (float64 temporaries) by initial_rows: a pull of many wide rows is
# initialised in slices of this size, so its temporaries stay a few tens of MiB.
INIT_CHUNK_VALUES = 1 << 20


def check_initializer_fits(schema: TableSchema) -> None:
    """Whether every value the table's initializer can give is finite in the table's dtype.

    Raises:
        InvalidArgument: one can overflow to inf (every pull of a new row would hold it).
    """
    init, top = schema.initializer, DTYPE_MAX[schema.dtype]
    reach = {  # the largest |value| each part can take
        "zeros": 0.0,
        "constant": abs(init.a),
        "uniform": max(abs(init.a), abs(init.b)),
        "normal": abs(init.a) + NORMAL_MAX_Z * init.b,
    }[init.kind]
    what = f"{init.kind} initializer (a={init.a:g}, b={init.b:g})"
    if not reach <= top:  # also catches a float64 overflow to inf
        raise InvalidArgument(
            f"table {schema.name!r}: the {what} gives values beyond the {schema.dtype} range "
            f"[-{top:g}, {top:g}]: they would be pulled as inf"
            + (f" (a normal draw reaches mean + {NORMAL_MAX_Z:.2f} std)" if init.kind == "normal" else "")
        )
    if not abs(init.state_init) <= top:
        raise InvalidArgument(
            f"table {schema.name!r}: state_init {init.state_init:g} is beyond the {schema.dtype} range "
            f"[-{top:g}, {top:g}]: it would be pulled as inf"
        )


def _initial_values(schema: TableSchema, ids: np.ndarray) -> np.ndarray:
    """The float64 embedding values of initial_rows, shape (len(ids), dim)."""
    init = schema.initializer
    if init.kind == "uniform":
        return init.a + (init.b - init.a) * _uniform01(init.seed, ids, schema.dim, 0)
    if init.kind == "normal":
        u1 = _uniform01(init.seed, ids, schema.dim, 1)
        u2 = _uniform01(init.seed, ids, schema.dim, 2)
        return init.a + init.b * np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)
    return np.full((len(ids), schema.dim), init.a if init.kind == "constant" else 0.0)


def initial_rows(schema: TableSchema, ids: np.ndarray) -> np.ndarray:
    """Rows of shape (len(ids), width) in the table's dtype, as a never-pushed id has them.

    Computed in slices of about INIT_CHUNK_VALUES values: the float64 temporaries of all the
    rows at once were several times the rows' own size (a 64 MiB fp16 pull made 1.3 GB)."""
    n = len(ids)
    out = np.empty((n, schema.width), dtype=schema.np_dtype)
    step = max(1, INIT_CHUNK_VALUES // schema.width)
    for lo in range(0, n, step):
        part = ids[lo : lo + step]
        values = np.empty((len(part), schema.width), dtype=np.float64)
        values[:, : schema.dim] = _initial_values(schema, part)
        values[:, schema.dim :] = schema.initializer.state_init
        out[lo : lo + step] = to_table_dtype(values, schema)
    return out


_KINDS = {"zeros": 0, "constant": 1, "uniform": 2}
_native: ModuleType | Literal[False] | None = None  # None: not tried yet; False: no compiler here


def fill_initial_rows(schema: TableSchema, ids: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
    """out[positions] = initial_rows(schema, ids), in place. fp32 tables with a zeros,
    constant or uniform initializer (what trainers use) take the compiled loop of the PS's id
    index module, bit for bit the same values; the rest take initial_rows."""
    global _native
    init = schema.initializer
    kind = _KINDS.get(init.kind)
    if _native is None:
        try:
            from dynemb.ps_server import native

            _native = native.id_index()
        except (RuntimeError, ImportError, OSError):  # no compiler here: numpy
            _native = False
    if (
        kind is None
        or not _native
        or schema.dtype != "fp32"
        or out.dtype != np.float32
        or not out.flags.c_contiguous
        or out.shape[1:] != (schema.width,)
    ):
        step = max(1, INIT_CHUNK_VALUES // schema.width)  # out[positions] = ... in slices, as initial_rows
        for lo in range(0, len(ids), step):
            out[positions[lo : lo + step]] = initial_rows(schema, ids[lo : lo + step])
        return
    _native.init_rows(
        out,
        schema.width,
        np.ascontiguousarray(positions, dtype=np.int64),
        np.ascontiguousarray(ids, dtype=np.int64),
        kind,
        _stream_key(init.seed, 0),
        float(init.a),
        float(init.b) - float(init.a),
        schema.dim,
        float(init.state_init),
    )
