"""A version's row dtypes: fp32 bit for bit, fp16 and bf16 rounded to nearest, int8 within
half a step of each row's own scale."""

from __future__ import annotations

import numpy as np
import pytest

from dynemb.ps_server.initializer import float_to_bf16_bits
from dynemb.publish.quantize import DTYPES, STORED, Quantized, dequantize, quantize


def rows(seed: int, n: int = 200, dim: int = 16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, dim)) * rng.uniform(1e-3, 10, (n, 1))).astype(np.float32)
    x[0] = 0  # a row of zeros
    x[1, :] = 3.5  # a row of one value
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_is_stored_as_it_says_and_comes_back_close(dtype):
    x = rows(1)
    q = quantize(x, dtype)
    assert q.values.dtype == STORED[dtype] and q.values.shape == x.shape
    assert (q.scales is not None) == (dtype == "int8")
    back = dequantize(q, dtype)
    assert back.dtype == np.float32 and back.shape == x.shape
    err = np.abs(back - x)
    if dtype == "fp32":
        assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    elif dtype == "fp16":
        assert (err <= np.abs(x) * 2.0**-11 + 2.0**-25).all()
    elif dtype == "bf16":
        assert (err <= np.abs(x) * 2.0**-8).all()
    else:
        assert q.scales is not None
        assert (err <= q.scales[:, None] / 2 + 1e-6 * np.abs(x)).all()
        assert q.scales[0] == 0 and not back[0].any()
        assert np.allclose(back[1], 3.5, rtol=0, atol=q.scales[1] / 2)


def test_bf16_tables_rows_pass_through_bf16_unchanged_and_fp32_bit_patterns_widen():
    x = rows(2)
    bits = float_to_bf16_bits(x)
    assert np.array_equal(quantize(bits, "bf16").values, bits)  # a bf16 table published as bf16: exact
    assert np.array_equal(quantize(bits, "fp32").values, dequantize(Quantized(bits, None), "bf16"))


def test_int8_uses_the_whole_range_per_row():
    x = rows(3)
    q = quantize(x, "int8")
    assert (np.abs(q.values[2:]).max(axis=1) == 127).all()


def test_bad_input_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="one of fp32, fp16, bf16, int8, not 'fp8'"):
        quantize(rows(4), "fp8")
    with pytest.raises(ValueError, match=r"must be \(n, dim\)"):
        quantize(np.zeros(3, np.float32), "fp32")
    x = rows(4)
    x[5, 2] = np.nan
    with pytest.raises(ValueError, match="int8 rows must be finite"):
        quantize(x, "int8")
    with pytest.raises(ValueError, match="need their scales"):
        dequantize(Quantized(np.zeros((1, 2), np.int8), None), "int8")
