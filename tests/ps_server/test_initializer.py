"""dynemb/ps_server/initializer.py: rows never pushed, as a function of (seed, id, column); bf16 bits.

Hashing, the generated code and the id index have their own files (test_hashing.py,
test_protos.py, test_id_index.py); initial rows through real PS processes: test_ps_initializers.py."""

from __future__ import annotations

import numpy as np

from dynemb.ps_server.initializer import bf16_bits_to_float, float_to_bf16_bits, initial_rows
from dynemb.ps_server.schema import Initializer, TableSchema


def test_initial_rows_are_a_function_of_seed_and_id():
    ids = np.array([3, 1, 2, 3], dtype=np.int64)
    for kind, a, b in (("uniform", -0.5, 0.5), ("normal", 1.0, 0.1)):
        s = TableSchema("t", 16, 2, "fp32", Initializer(kind, a, b, seed=9, state_init=0.25))
        rows = initial_rows(s, ids)
        assert np.array_equal(rows[0], rows[3]) and not np.array_equal(rows[0], rows[1])
        assert np.array_equal(rows, initial_rows(s, ids))
        assert np.all(rows[:, 16:] == 0.25)
        other = initial_rows(TableSchema("t", 16, 2, "fp32", Initializer(kind, a, b, seed=10)), ids)
        assert not np.array_equal(rows[:, :16], other[:, :16])
    big = initial_rows(TableSchema("t", 64, 0, "fp32", Initializer("uniform", -0.5, 0.5)), np.arange(5000))
    assert -0.5 <= big.min() and big.max() < 0.5 and abs(big.mean()) < 0.01
    normal = initial_rows(TableSchema("t", 64, 0, "fp32", Initializer("normal", 1.0, 0.1)), np.arange(5000))
    assert abs(normal.mean() - 1.0) < 0.01 and abs(normal.std() - 0.1) < 0.01


def test_bf16_round_trip_and_rounding():
    x = np.array([0.0, 1.0, -2.5, 3.140625, 1e-3, 65504.0], dtype=np.float32)
    bits = float_to_bf16_bits(x)
    back = bf16_bits_to_float(bits)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2**-8)
    assert float_to_bf16_bits(np.array([1.0], np.float32))[0] == 0x3F80


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dynemb.ps_server import initializer  # noqa: E402
from dynemb.ps_server.initializer import fill_initial_rows  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["zeros", "constant", "uniform", "normal"]),
    a=st.floats(-1e6, 1e6),
    b=st.floats(-1e6, 1e6),
    seed=st.integers(0, (1 << 64) - 1),
    dim=st.integers(1, 40),
    state=st.integers(0, 3),
    dtype=st.sampled_from(["fp32", "fp16", "bf16"]),
    n=st.integers(0, 50),
    shift=st.integers(0, 3),
    data=st.data(),
)
def test_filling_in_place_gives_initial_rows_bit_for_bit(kind, a, b, seed, dim, state, dtype, n, shift, data):
    """The compiled loop (fp32: zeros, constant, uniform) and numpy agree on every bit, at any
    byte offset (rows inside a message start anywhere)."""
    if kind == "uniform":
        a, b = min(a, b), max(a, b) + 1.0  # what the schema accepts
    b = abs(b) if kind == "normal" else b
    s = TableSchema("t", dim, state, dtype, Initializer(kind, a, b, seed=seed, state_init=0.5))
    ids = np.array(data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=n, max_size=n)), dtype=np.int64)
    rows = n + 3
    raw = np.zeros(rows * s.row_bytes + shift, np.uint8)
    out = np.frombuffer(raw.data, dtype=s.np_dtype, count=rows * s.width, offset=shift).reshape(rows, s.width)
    positions = np.array(data.draw(st.permutations(range(rows)))[:n], dtype=np.int64)
    before = out.copy()
    with np.errstate(over="ignore"):
        fill_initial_rows(s, ids, out, positions)
    want = before.copy()
    with np.errstate(over="ignore"):  # |a| up to 1e6 overflows fp16 to inf, in both
        want[positions] = initial_rows(s, ids)
    assert out.tobytes() == want.tobytes()


def test_the_compiled_loop_is_the_one_used_for_trainer_tables():
    s = TableSchema("t", 16, 1, "fp32", Initializer("uniform", -0.1, 0.1, seed=3))
    out = np.zeros((4, 17), np.float32)
    fill_initial_rows(s, np.arange(4), out, np.arange(4))
    assert initializer._native, "the id index module did not build: fp32 initial rows fell back to numpy"
    assert np.array_equal(out, initial_rows(s, np.arange(4)))
