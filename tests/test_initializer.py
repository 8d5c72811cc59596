"""ps_server/initializer.py: rows never pushed, as a function of (seed, id, column); bf16 bits.

Hashing, the generated code and the id index have their own files (test_hashing.py,
test_protos.py, test_id_index.py); initial rows through real PS processes: test_ps_initializers.py."""

from __future__ import annotations

import numpy as np

from ps_server.initializer import bf16_bits_to_float, float_to_bf16_bits, initial_rows
from ps_server.schema import Initializer, TableSchema


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
