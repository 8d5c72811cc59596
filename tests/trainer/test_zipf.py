"""BoundedZipf: draws over 1..n follow P(k) ~ k^-s exactly (within sampling error), for
exponents below, at and above 1, and stay in range."""

from __future__ import annotations

import numpy as np
import pytest

from dynemb.trainer.zipf import BoundedZipf


@pytest.mark.parametrize("s,n", [(1.05, 10), (0.6, 7), (1.0, 12), (2.5, 6), (1.05, 100_000)])
def test_draws_follow_the_zipf_law_over_the_universe(s, n):
    draws = BoundedZipf(s, n)(np.random.default_rng(3), (400, 1000))
    assert draws.shape == (400, 1000) and draws.dtype == np.int64
    assert draws.min() >= 1 and draws.max() <= n
    weights = np.arange(1, n + 1, dtype=np.float64) ** -s
    p = weights / weights.sum()
    seen = np.bincount(draws.ravel(), minlength=n + 1)[1:] / draws.size
    head = slice(0, min(n, 50))
    # 4 standard errors of each frequency
    assert np.all(np.abs(seen[head] - p[head]) <= 4 * np.sqrt(p[head] * (1 - p[head]) / draws.size) + 1e-4)
    if n >= 1000:  # the tail too: the share beyond the first tenth
        tail = p[n // 10 :].sum()
        assert abs(seen[n // 10 :].sum() - tail) <= 4 * np.sqrt(tail * (1 - tail) / draws.size)


def test_a_universe_of_one_always_draws_it():
    assert (BoundedZipf(1.2, 1)(np.random.default_rng(0), (100,)) == 1).all()


def test_the_same_generator_state_gives_the_same_draws():
    a = BoundedZipf(1.05, 5000)(np.random.default_rng([7, 1]), (3, 64))
    b = BoundedZipf(1.05, 5000)(np.random.default_rng([7, 1]), (3, 64))
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "s,n,message",
    [(0.0, 10, "exponent must be > 0"), (-1.0, 10, "exponent must be > 0"), (1.05, 0, "at least 1 value")],
)
def test_bad_parameters_are_refused(s, n, message):
    with pytest.raises(ValueError, match=message):
        BoundedZipf(s, n)
