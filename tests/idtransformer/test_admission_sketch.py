"""The count-min sketch that gates admission: never undercounts, ages, bounded, state round-trips."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.idtransformer.admission import CountMinSketch

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(INT64, min_size=1, max_size=60), min_size=1, max_size=10))
def test_never_undercounts(batches):
    sketch = CountMinSketch(width=64, depth=3)  # tiny: collisions are common, undercounts must not be
    seen = Counter()
    for batch in batches:
        ids = torch.tensor(batch, dtype=torch.int64)
        uniq, counts = torch.unique(ids, return_counts=True)
        after = sketch.add(uniq, counts)
        seen.update(batch)
        for i, est in zip(uniq.tolist(), after.tolist()):
            assert est >= seen[i]
    probe = torch.tensor(list(seen), dtype=torch.int64)
    assert all(e >= seen[i] for i, e in zip(probe.tolist(), sketch.estimate(probe).tolist()))


def test_exact_when_wide_and_spread():
    sketch = CountMinSketch(width=1 << 16, depth=4)
    ids = torch.arange(-500, 500, dtype=torch.int64) * 7919
    for k in range(3):
        sketch.add(ids[: 300 * (k + 1)])
    est = sketch.estimate(ids)
    want = torch.cat([torch.full((300,), 3), torch.full((300,), 2), torch.full((300,), 1), torch.zeros(100)]).int()
    assert torch.equal(est, want)


def test_halve_ages_counts_and_memory_is_fixed():
    sketch = CountMinSketch(width=1 << 12, depth=4)
    ids = torch.tensor([1, 2, 3], dtype=torch.int64)
    sketch.add(ids, torch.tensor([8, 5, 1]))
    before = sketch.nbytes
    sketch.add(torch.randint(-(1 << 62), 1 << 62, (100_000,)))  # many more ids: no growth
    assert sketch.nbytes == before == 4 * (1 << 12) * 4
    sketch2 = CountMinSketch(width=1 << 12, depth=4)
    sketch2.add(ids, torch.tensor([8, 5, 1]))
    sketch2.halve()
    assert sketch2.estimate(ids).tolist() == [4, 2, 0]


def test_state_round_trip_and_shape_check():
    a = CountMinSketch(width=1 << 10, depth=2)
    a.add(torch.tensor([5, 6, 5]))
    b = CountMinSketch(width=1 << 10, depth=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.estimate(torch.tensor([5, 6, 7])), torch.tensor([2, 1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="2x1024"):
        CountMinSketch(width=1 << 11, depth=2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="power of two"):
        CountMinSketch(width=1000)
