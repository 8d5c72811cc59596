"""Embedding rows in a published version's dtype, and back (issue 33, "Publishing for serving").

A version carries embedding values only (no optimizer state), in the table's dtype or smaller:

    fp32    4 bytes a value, as trained (an fp32 table's rows bit for bit)
    fp16    2 bytes a value, round to nearest even; beyond fp16's range, +-inf
    bf16    2 bytes a value, round to nearest even (stored as uint16 bit patterns, as tables are)
    int8    1 byte a value and one float32 scale a row: q = round(x / s), s = max|x| / 127,
            so every value is within s / 2 of the row's original (a row of zeros: s = 0)

    q = quantize(rows, "int8")          # Quantized(values, scales)
    x = dequantize(q, "int8")           # float32 rows
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dynemb.ps_server.initializer import bf16_bits_to_float, float_to_bf16_bits

DTYPES = ("fp32", "fp16", "bf16", "int8")
# the numpy dtype each is stored as (bf16: its bit patterns)
STORED = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8}


class Quantized(NamedTuple):
    """Rows in a published dtype.

    Attributes:
        values: (n, dim), STORED[dtype].
        scales: (n,) float32 for int8 (a row's value is values * scale), else None.
    """

    values: np.ndarray
    scales: np.ndarray | None


def check_dtype(dtype: str) -> str:
    """dtype, if it is one a version can carry; ValueError naming the choices if not."""
    if dtype not in DTYPES:
        raise ValueError(f"a published dtype is one of {', '.join(DTYPES)}, not {dtype!r}")
    return dtype


def quantize(rows: np.ndarray, dtype: str) -> Quantized:
    """Rows (n, dim) of float32 values (or bf16 bit patterns as uint16, a bf16 table's own) in
    a published dtype (see the module)."""
    check_dtype(dtype)
    if rows.ndim != 2:
        raise ValueError(f"rows must be (n, dim), got shape {rows.shape}")
    x = as_float32(rows)
    if dtype == "fp32":
        return Quantized(np.ascontiguousarray(x), None)
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return Quantized(x.astype(np.float16), None)
    if dtype == "bf16":
        return Quantized(float_to_bf16_bits(x), None)
    if not np.isfinite(x).all():
        raise ValueError("int8 rows must be finite: a row holds NaN or inf")
    peak = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(len(x), dtype=np.float32)
    scales = (peak / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)
    return Quantized(q, scales)


def dequantize(q: Quantized, dtype: str) -> np.ndarray:
    """The float32 rows a Quantized of dtype stands for."""
    check_dtype(dtype)
    if dtype == "int8":
        if q.scales is None:
            raise ValueError("int8 rows need their scales")
        return q.values.astype(np.float32) * q.scales[:, None]
    if dtype == "bf16":
        return bf16_bits_to_float(q.values)
    return q.values.astype(np.float32)


def as_float32(rows: np.ndarray) -> np.ndarray:
    """A table's rows as float32: bf16 bit patterns (uint16) widened, other floats cast."""
    if rows.dtype == np.uint16:
        return bf16_bits_to_float(rows)
    return np.asarray(rows, dtype=np.float32)
