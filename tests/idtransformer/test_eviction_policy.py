"""Eviction scoring on hand-made histories: each policy evicts in its own order."""

from __future__ import annotations

import pytest
import torch

from dynemb.idtransformer.policy import MAX_FREQ, EvictionPolicy


def order(policy: EvictionPolicy, last, freq, step: int) -> list[int]:
    """Slots from first evicted to last."""
    scores = policy.scores(torch.tensor(last), torch.tensor(freq, dtype=torch.uint8), step)
    return torch.argsort(scores, stable=True).tolist()


# slot 0: hot long ago (high freq, idle 900); slot 1: warm and recent; slot 2: cold, recent;
# slot 3: cold, older
LAST = [100, 990, 995, 500]
FREQ = [200, 40, 6, 6]


def test_lru_goes_by_last_access():
    assert order(EvictionPolicy("lru"), LAST, FREQ, 1000) == [0, 3, 1, 2]


def test_lfu_goes_by_frequency_then_recency():
    assert order(EvictionPolicy("lfu"), LAST, FREQ, 1000) == [3, 2, 1, 0]


def test_hybrid_lets_a_once_hot_id_go_cold():
    hybrid = EvictionPolicy("hybrid", decay_steps=4)  # 900 idle steps take slot 0 from 200 to 0
    assert order(hybrid, LAST, FREQ, 1000) == [0, 3, 2, 1]  # LFU keeps it longest (above)
    # shortly after it was hot, the same ID is kept longest
    assert order(hybrid, [100, 110, 115, 105], FREQ, 120)[-1] == 0


def test_ttl_expires_first_whatever_the_policy():
    for kind in ("lru", "lfu", "hybrid"):
        ttl = EvictionPolicy(kind, ttl_steps=400)
        first_two = order(ttl, LAST, FREQ, 1000)[:2]
        assert first_two == [0, 3]  # idle 900 and 500: both expired, the most idle first


def test_log_counter_grows_slower_as_it_grows():
    policy = EvictionPolicy("lfu", log_factor=10.0, initial_freq=5)
    gen = torch.Generator().manual_seed(0)
    freq = torch.full((20000,), 5, dtype=torch.uint8)
    for _ in range(200):
        freq = policy.bump(freq, torch.ones(20000, dtype=torch.int32), torch.rand(20000, generator=gen))
    grown = freq.float().mean().item() - 5
    # with p = 1/(10 c + 1) after c increments, 200 hits give c with 5 c^2 ~ 200: about 6
    assert 4 < grown < 9
    many = policy.bump(torch.full((4,), 5, dtype=torch.uint8), torch.full((4,), 1000), torch.rand(4, generator=gen))
    assert torch.all(many == 6)  # a batch adds at most one point
    top = policy.bump(
        torch.full((4,), MAX_FREQ, dtype=torch.uint8), torch.full((4,), 10**6), torch.rand(4, generator=gen)
    )
    assert torch.all(top == MAX_FREQ)


@pytest.mark.parametrize("bad", [dict(kind="fifo"), dict(evict_fraction=0), dict(ttl_steps=0), dict(decay_steps=0)])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        EvictionPolicy(**bad)
