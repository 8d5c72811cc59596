"""dynemb/common/arrays.py: the distinct ids of an array, as np.unique gives them, by a sort."""

from __future__ import annotations

import numpy as np
import pytest

from dynemb.common.arrays import unique, unique_counts, unique_first


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 50_000])
def test_the_same_as_np_unique(n):
    rng = np.random.default_rng(n)
    for high in (3, 1 << 62):  # many repeats, then nearly none
        a = rng.integers(-high, high, n, dtype=np.int64)
        np.testing.assert_array_equal(unique(a), np.unique(a))
        for got, want in zip(unique_counts(a), np.unique(a, return_counts=True)):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(unique_first(a), np.unique(a, return_index=True)):
            np.testing.assert_array_equal(got, want)  # the first occurrence of each, as np.unique


def test_a_repeated_id_keeps_its_first_position():
    values, first = unique_first(np.array([5, 3, 5, 3, 9], dtype=np.int64))
    assert values.tolist() == [3, 5, 9] and first.tolist() == [1, 0, 4]
