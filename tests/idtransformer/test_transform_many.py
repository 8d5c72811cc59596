"""transform_many (all of a rank's tables in one call) and release_many against each table's own
transform and release, call by call: the same slots, admissions, evictions, hits, pins,
errors and state, on streams that evict, pin, refuse for want of room, overflow a pin count
and bring batches too large."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.idtransformer.many import ManyResult, release_many, release_many_flat, transform_many
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.transformer import IDTransformer

BASES = [0, 1000, 70, 5000]


def _tables(kinds: list[str], fraction: float, mixed: bool) -> list[IDTransformer]:
    """Four tables, one of 8 slots (batches often too large for it); with mixed, one on the
    torch ops and one with an admission threshold (those go one by one, the rest in one call)."""
    out = []
    for k, (kind, capacity) in enumerate(zip(kinds, [8, 40, 64, 33])):
        policy = EvictionPolicy(
            kind, evict_fraction=fraction, log_factor=1.0, decay_steps=3, ttl_steps=4 if k == 3 else None
        )
        backend = "torch" if mixed and k == 1 else "kernel"
        threshold = 2 if mixed and k == 2 else 1
        out.append(IDTransformer(capacity, policy, threshold, sketch_width=1 << 10, backend=backend))
    # table 2 starts with IDs 0..3 resident and pinned 254 times: a pin count about to overflow
    near_full = out[2].state_dict()
    near_full["slots"], near_full["ids"] = torch.arange(4), torch.arange(4)
    near_full["last_access"][:4] = 0
    near_full["freq"][:4] = 5
    near_full["pins"][:4] = 254
    out[2].load_state_dict(near_full)
    return out


def _outcome(fn):
    try:
        return fn()
    except (RuntimeError, ValueError) as e:
        return e


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    kinds=st.lists(st.sampled_from(["lru", "lfu", "hybrid"]), min_size=4, max_size=4),
    fraction=st.sampled_from([0.05, 0.3, 1.0]),
    mixed=st.booleans(),
)
def test_many_tables_in_one_call_match_each_table_alone(seed, kinds, fraction, mixed):
    many, alone = _tables(kinds, fraction, mixed), _tables(kinds, fraction, mixed)
    gen = torch.Generator().manual_seed(seed)
    held: list[list] = []  # per step, per table: (many's distinct slots, alone's) of pinned batches
    errors = 0
    for step in range(40):
        sizes = torch.randint(0, 60, (len(many),), generator=gen).tolist()
        ids = (torch.rand(sum(sizes), generator=gen) ** 3 * 150).long() - 20  # skewed, some negative
        pin = bool(torch.rand(1, generator=gen) < 0.6)
        got = transform_many(many, ids, sizes, pin=pin, bases=BASES)
        blocks = torch.split(ids, sizes)
        pinned = []
        for k, (m, a, block) in enumerate(zip(many, alone, blocks)):
            expect = _outcome(lambda: a.transform(block, pin=pin))
            out, error = got.results[k], got.errors[k]
            where = f"step {step} table {k}"
            if isinstance(expect, Exception):
                errors += 1
                assert out is None and type(error) is type(expect) and str(error) == str(expect), where
            else:
                assert error is None, f"{where}: {error}"
                base = BASES[k]
                shifted = torch.where(expect.slots >= 0, expect.slots + base, -1)
                assert torch.equal(out.slots, shifted), where
                assert torch.equal(got.slots[sum(sizes[:k]) : sum(sizes[: k + 1])], shifted), where
                assert torch.equal(out.admitted_ids, expect.admitted_ids), where
                assert torch.equal(out.admitted_slots, expect.admitted_slots + base), where
                assert torch.equal(out.evicted_ids, expect.evicted_ids), where
                assert torch.equal(out.evicted_slots, expect.evicted_slots + base), where
                assert torch.equal(out.rejected_ids.sort().values, expect.rejected_ids.sort().values), where
                assert int(out.hits) == int(expect.hits), where
                assert torch.equal(out.distinct_slots, expect.distinct_slots), where
                if pin:
                    pinned.append((m, out.distinct_slots, a, expect.distinct_slots))
            assert torch.equal(m.records, a.records), f"{where}: records (ids, last access, counters, pins)"
            assert (m.step, m.resident) == (a.step, a.resident), where
        if got.flat is not None:  # all on the kernel: every table's tensors whole, table after table
            assert not mixed
            ok = [r for r in got.results if r is not None]
            for field in ManyResult.FIELDS:
                want = torch.cat([getattr(r, field) for r in ok]) if ok else torch.zeros(0, dtype=torch.int64)
                assert torch.equal(got.flat[field], want), f"step {step} {field}"
                assert [n for n, e in zip(got.counts[field], got.errors) if e is None] == [
                    getattr(r, field).numel() for r in ok
                ]
                assert all(n == 0 for n, e in zip(got.counts[field], got.errors) if e is not None)
            assert got.sizes == sizes
            assert got.hits == [0 if r is None else int(r.hits) for r in got.results]
        held.append((pinned, got if got.error is None and got.flat is not None and pin else None))
        # release most batches two steps later; every fifth stays pinned, so pins pile up
        if len(held) > 2 and step % 5:  # many's tables released in one call, alone's one by one
            done, whole = held.pop(0)
            if whole is not None and step % 2:  # the batch's distinct slots as one tensor
                assert release_many_flat(many, whole.flat["distinct_slots"], whole.counts["distinct_slots"]) == [
                    None
                ] * len(many)
            else:
                assert release_many([m for m, *_ in done], [s for _, s, _, _ in done]) == [None] * len(done)
            for _, _, a, a_slots in done:
                a.release(a_slots, distinct=True)
    assert errors > 0  # the streams do reach the refusals


def test_errors_are_per_table_and_the_others_go_on():
    """A table refusing a batch (too many IDs, pins at 255) does not stop the others; what it
    says names the problem; the step counter's overflow is raised before any table changes."""
    small, full_pins, fine = IDTransformer(4), IDTransformer(16), IDTransformer(16)
    for _ in range(255):
        full_pins.transform(torch.tensor([7]), pin=True)
    ids = torch.cat([torch.arange(10), torch.tensor([7, 8]), torch.tensor([1, 2, 3])])
    pinned_state = full_pins.state_dict()
    got = transform_many([small, full_pins, fine], ids, [10, 2, 3], pin=True, bases=[0, 16, 32])
    assert "batch has 10 distinct IDs but the table holds 4" in str(got.errors[0]) and small.step == 0
    assert "pinned by 255 batches in flight" in str(got.errors[1])
    after = full_pins.state_dict()  # refused before anything changed: 8 not admitted, no step
    assert len(full_pins) == 1 and after.keys() == pinned_state.keys()
    assert all(
        torch.equal(after[k], v) if isinstance(v, torch.Tensor) else after[k] == v for k, v in pinned_state.items()
    )
    assert got.errors[2] is None and got.results[2].slots.tolist() == [32, 33, 34]
    assert got.error is got.errors[0]
    fine.step = (1 << 31) - 1
    before = small.records.clone()
    with pytest.raises(OverflowError):
        transform_many([small, fine], torch.arange(3), [1, 2])
    assert torch.equal(small.records, before) and small.step == 0
    with pytest.raises(ValueError, match="add up to 3, not to the 4"):
        transform_many([small, fine], torch.arange(4), [1, 2])


def test_a_release_refused_by_one_table_releases_the_others():
    tables = [IDTransformer(8), IDTransformer(8, backend="torch"), IDTransformer(8)]
    got = transform_many(tables, torch.tensor([1, 2, 3, 4, 5]), [2, 2, 1], pin=True)
    held = [out.distinct_slots for out in got.results]
    tables[2].release(held[2], distinct=True)  # released early: the batch's release finds it unpinned
    errors = release_many(tables, held)
    assert errors[:2] == [None, None] and "not pinned (released twice?)" in str(errors[2])
    assert [int(t.pins.sum()) for t in tables] == [0, 0, 0]
    errors = release_many(tables, held)
    assert all("not pinned" in str(e) for e in errors)


@pytest.mark.parametrize("order", ["whole_then_items", "items_then_whole", "per_table"])
def test_share_results_release_whole_or_per_table(one_process_group, order):
    """transform_blocks' ShareResults: the per-table results, made when first looked at, and one
    release of all tables at once agree on what is pinned; a second release is refused either way."""
    from dynemb.idtransformer.sharded import ShardedIDTransformer, ShareResults, release_tables, transform_blocks

    tables = [ShardedIDTransformer(16) for _ in range(3)]
    ids, sizes = torch.tensor([1, 2, 2, 3, 4, 5, 5, 5, 6]), [4, 4, 1]
    slots, results = transform_blocks(tables, ids, sizes, pin=True)
    assert isinstance(results, ShareResults) and results.whole and len(results) == 3
    assert [int(t.local.pins.sum()) for t in tables] == [3, 2, 1]  # distinct IDs of each block
    if order == "items_then_whole":
        assert [r.slots.tolist() for r in results] == [slots[:4].tolist(), slots[4:8].tolist(), slots[8:].tolist()]
    if order == "per_table":
        tables[0].release(results[0])  # by hand: the batch's release then goes per table and refuses
        with pytest.raises(ValueError, match="not transformed with pin=True"):
            release_tables(tables, results)
        assert [int(t.local.pins.sum()) for t in tables] == [0, 2, 1]
        return
    release_tables(tables, results)
    assert [int(t.local.pins.sum()) for t in tables] == [0, 0, 0]
    assert all(r.pinned is None for r in results)  # made before or after, they say released
    assert results[1].owned.admitted_ids.tolist() == [4, 5]
    with pytest.raises(ValueError, match="not transformed with pin=True"):
        release_tables(tables, results)
    assert [int(t.local.pins.sum()) for t in tables] == [0, 0, 0]
