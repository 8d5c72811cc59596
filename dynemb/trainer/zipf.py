"""Zipf draws over a bounded universe: P(k) proportional to k^-s for k = 1..n.

numpy's `Generator.zipf` draws from the unbounded Zipf law; folding its draws into a universe
(`% n`) is not a Zipf law over the universe: for s = 1.05 and n = 10^5 about half the draws
exceed n and land spread almost evenly over it. scipy's `zipfian` is bounded but draws by
searching its CDF (slow) and is not a dependency here; neither library has a fast bounded
sampler, so this is the rejection-inversion method of Hörmann and Derflinger ("Rejection-
inversion to generate variates from monotone discrete distributions", 1996), vectorised:
every draw inverts the integral of a continuous hat over [0.5, n + 0.5] and is accepted
with probability above 0.9 for any s > 0 and n, so a few rounds finish a batch. Exact for
any s > 0 (s <= 1 included) and n up to 2^53.

    draw = BoundedZipf(s=1.05, n=100_000)
    ids = draw(rng, (26, 512))          # int64 in [1, n]
"""

from __future__ import annotations

import numpy as np


class BoundedZipf:
    """Draws k in [1, n] with P(k) proportional to k^-s; call it with a Generator and a shape.

    Args:
        s: the exponent, > 0.
        n: the universe size, >= 1.
    """

    def __init__(self, s: float, n: int) -> None:
        if not s > 0:
            raise ValueError(f"Zipf exponent must be > 0, got {s}")
        if n < 1:
            raise ValueError(f"Zipf universe must hold at least 1 value, got {n}")
        self.s, self.n = float(s), int(n)
        self._h_x1 = self._integral(1.5) - 1.0  # H(1.5) - h(1)
        self._h_n = self._integral(self.n + 0.5)
        self._squeeze = 2.0 - self._inverse(self._integral(2.5) - 2.0**-self.s)

    def __call__(self, rng: np.random.Generator, shape) -> np.ndarray:
        out = np.empty(int(np.prod(shape)), dtype=np.int64)
        todo = np.arange(out.size)
        while todo.size:
            u = self._h_n + rng.random(todo.size) * (self._h_x1 - self._h_n)
            x = self._inverse(u)
            k = np.clip(np.floor(x + 0.5), 1, self.n)
            ok = (k - x <= self._squeeze) | (u >= self._integral(k + 0.5) - k**-self.s)
            out[todo[ok]] = k[ok].astype(np.int64)
            todo = todo[~ok]
        return out.reshape(shape)

    # H(x) = (x^(1-s) - 1) / (1 - s), log x at s = 1, written with log1p/expm1 so that s near 1
    # loses no precision; _inverse is its inverse.
    def _integral(self, x):
        log_x = np.log(x)
        return _expm1_over((1.0 - self.s) * log_x) * log_x

    def _inverse(self, y):
        t = y * (1.0 - self.s)
        t = np.maximum(t, -1.0)  # rounding may step past the domain's edge by an ulp
        return np.exp(_log1p_over(t) * y)


def _expm1_over(t):
    """expm1(t) / t, 1 at t = 0."""
    t = np.asarray(t, dtype=np.float64)
    small = np.abs(t) < 1e-8
    safe = np.where(small, 1.0, t)
    return np.where(small, 1.0 + t / 2.0, np.expm1(safe) / safe)


def _log1p_over(t):
    """log1p(t) / t, 1 at t = 0."""
    t = np.asarray(t, dtype=np.float64)
    small = np.abs(t) < 1e-8
    safe = np.where(small, 1.0, t)
    return np.where(small, 1.0 - t / 2.0, np.log1p(safe) / safe)
