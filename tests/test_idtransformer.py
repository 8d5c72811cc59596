"""IDTransformer against a small reference model: invariants on random streams, policies on
hand-made ones, pinning, admission, state round-trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from idtransformer.policy import EvictionPolicy
from idtransformer.transformer import IDTransformer


class Reference:
    """What must hold whatever the policy: who is resident where, and every eviction reported once."""

    def __init__(self) -> None:
        self.where: dict[int, int] = {}

    def check(self, batch: list[int], out, pinned: set[int]) -> None:
        evicted = out.evicted_ids.tolist()
        assert len(evicted) == len(set(evicted)), "an ID evicted twice in one call"
        for i, s in zip(evicted, out.evicted_slots.tolist()):
            assert self.where.pop(i) == s, "evicted from a slot it did not hold"
            assert s not in pinned, "a pinned slot was evicted"
        for i, s in zip(out.admitted_ids.tolist(), out.admitted_slots.tolist()):
            assert i not in self.where, "admitted an ID that was resident"
            self.where[i] = s
        assert len(set(self.where.values())) == len(self.where), "two resident IDs share a slot"
        for i, s in zip(batch, out.slots.tolist()):
            if s >= 0:
                assert self.where[i] == s, "an ID moved while resident"
            else:
                assert i in out.rejected_ids.tolist()


ID = st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(0, 40)


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(st.lists(ID, min_size=1, max_size=12), min_size=1, max_size=25),
    kind=st.sampled_from(["lru", "lfu", "hybrid"]),
    threshold=st.integers(1, 3),
    ttl=st.none() | st.integers(1, 5),
)
def test_invariants_on_random_streams(batches, kind, threshold, ttl):
    t = IDTransformer(capacity=16, policy=EvictionPolicy(kind, evict_fraction=0.25, ttl_steps=ttl),
                      admit_threshold=threshold, sketch_width=1 << 12)
    ref, seen = Reference(), {}
    for batch in batches:
        out = t.transform(torch.tensor(batch, dtype=torch.int64))
        ref.check(batch, out, pinned=set())
        for i in batch:
            seen[i] = seen.get(i, 0) + 1
        for i in out.admitted_ids.tolist():
            assert seen[i] >= threshold, "admitted before it was seen threshold times"
        assert len(t) == len(ref.where) <= 16


def test_batch_larger_than_the_table_is_refused():
    t = IDTransformer(capacity=4)
    with pytest.raises(ValueError, match="5 distinct IDs but the table holds 4"):
        t.transform(torch.arange(5))
    out = t.transform(torch.tensor([1, 1, 2, 2, 3, 4, 4]))  # 4 distinct: fine
    assert out.slots.unique().numel() == 4 and (out.slots >= 0).all()


def test_lru_evicts_the_longest_idle_in_batches():
    t = IDTransformer(capacity=4, policy=EvictionPolicy("lru", evict_fraction=0.5))
    for i in (10, 11, 12, 13):
        t.transform(torch.tensor([i]))
    t.transform(torch.tensor([10, 12]))  # 11 and 13 are now the longest idle
    out = t.transform(torch.tensor([20]))
    assert sorted(out.evicted_ids.tolist()) == [11, 13]  # half the table freed at once
    assert len(t) == 3


def test_lfu_keeps_the_frequent():
    t = IDTransformer(capacity=3, policy=EvictionPolicy("lfu", evict_fraction=0.34, log_factor=0, initial_freq=0))
    t.transform(torch.tensor([1, 2, 3]))
    for _ in range(5):
        t.transform(torch.tensor([1, 3]))  # log_factor 0: every hit counts
    t.transform(torch.tensor([2]))
    assert t.transform(torch.tensor([4])).evicted_ids.tolist() == [2]  # most recent, least frequent


def test_pinned_and_in_use_slots_survive():
    t = IDTransformer(capacity=4, policy=EvictionPolicy("lru", evict_fraction=1.0))
    held = t.transform(torch.tensor([1, 2]), pin=True)
    t.transform(torch.tensor([3, 4]))
    out = t.transform(torch.tensor([5, 6]))
    assert sorted(out.evicted_ids.tolist()) == [3, 4]  # 1 and 2 are older but pinned
    with pytest.raises(RuntimeError, match="pinned"):
        t.transform(torch.tensor([7, 8, 9]))  # 3 new IDs; 1, 2 pinned: only 5, 6 can move
    t.release(held.slots)
    out = t.transform(torch.tensor([7, 8, 9, 5]))
    assert {1, 2} <= set(out.evicted_ids.tolist())
    with pytest.raises(ValueError, match="not pinned"):
        t.release(held.slots)


def test_admission_threshold():
    t = IDTransformer(capacity=8, admit_threshold=3, sketch_width=1 << 12)
    out = t.transform(torch.tensor([7, 8, 8]))
    assert out.slots.tolist() == [-1, -1, -1] and sorted(out.rejected_ids.tolist()) == [7, 8]
    out = t.transform(torch.tensor([7, 8]))
    assert out.admitted_ids.tolist() == [8] and out.slots[0] == -1 and out.slots[1] >= 0
    assert t.transform(torch.tensor([7])).admitted_ids.tolist() == [7]


def test_ttl_expires_idle_ids():
    t = IDTransformer(capacity=8, policy=EvictionPolicy("lru", ttl_steps=2))
    t.transform(torch.tensor([1, 2]))
    t.transform(torch.tensor([2]))
    t.transform(torch.tensor([3]))
    t.transform(torch.tensor([3]))
    ids, slots = t.expire()  # 1 idle 4 steps, 2 idle 3: both past the TTL
    assert sorted(ids.tolist()) == [1, 2] and len(t) == 1


def test_state_round_trip_gives_the_same_output():
    def make():
        return IDTransformer(capacity=32, policy=EvictionPolicy("hybrid", evict_fraction=0.25),
                             admit_threshold=2, sketch_width=1 << 12)

    gen = torch.Generator().manual_seed(1)
    stream = [torch.randint(0, 60, (20,), generator=gen) for _ in range(30)]
    a = make()
    for b in stream[:15]:
        a.transform(b)
    b_ = make()
    b_.load_state_dict(a.state_dict())
    for batch in stream[15:]:
        x, y = a.transform(batch), b_.transform(batch)
        assert torch.equal(x.slots, y.slots)
        assert torch.equal(x.evicted_ids.sort().values, y.evicted_ids.sort().values)
