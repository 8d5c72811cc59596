"""Triton tables in one pass (device_transform.transform_many over a DeviceTables): every table
call by call as the compiled kernel's table alone gives it (slots, admissions, evictions,
rejections, hits, pins, refusals, state), tables joined mid-stream keep their state, and the
pass's cost does not grow with the tables: the same kernel launches and torch ops for 26 tables
as for 1, and one host copy. Without a GPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from helpers import DeviceWork

from dynemb.idtransformer import device_transform
from dynemb.idtransformer.device_tables import DeviceTables
from dynemb.idtransformer.many import release_many_flat, transform_many
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.transformer import IDTransformer

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.cuda] if CUDA else []

# (capacity, policy, admit threshold) per table: batches too large for the first, TTL,
# admission sketches of two sizes, every policy
CONFIGS = [
    (8, EvictionPolicy("lru", evict_fraction=0.3), 1),
    (40, EvictionPolicy("hybrid", evict_fraction=0.05, log_factor=1.0, decay_steps=3), 2),
    (64, EvictionPolicy("lfu", evict_fraction=1.0, log_factor=1.0, ttl_steps=4), 1),
    (33, EvictionPolicy("hybrid", evict_fraction=0.3, log_factor=0.5, decay_steps=2, ttl_steps=3), 3),
    (1100, EvictionPolicy("lru", evict_fraction=0.01), 1),  # more than one block of rows
]
BASES = [0, 1000, 70, 5000, 9000]


def _tables(backend: str) -> list[IDTransformer]:
    device = DEVICE if backend == "triton" else "cpu"
    return [
        IDTransformer(c, p, a, sketch_width=1 << (8 + k), sketch_depth=2 + k % 3, device=device, backend=backend)
        for k, (c, p, a) in enumerate(CONFIGS)
    ]


def _outcome(fn):
    try:
        return fn()
    except (RuntimeError, ValueError, IndexError) as e:
        return e


def _same_state(k: IDTransformer, t: IDTransformer, where: str) -> None:
    assert torch.equal(k.records, t.records.cpu()), f"{where}: records (ids, last access, freq, pins)"
    assert (k.step, k.resident) == (t.step, t.resident), f"{where}: step/resident"
    if k.sketch is not None:
        assert torch.equal(k.sketch.counts, t.sketch.counts.cpu()), f"{where}: sketch"
    state = t.state_dict()  # the map agrees with the records
    assert torch.equal(t.map.find(state["ids"].to(t.device)).cpu(), state["slots"]), f"{where}: map"


@pytest.mark.slow
def test_tables_in_one_pass_match_the_kernel_table_by_table(seed=0):
    """Five tables, each alone for a few batches (a space of its own), then joined: every batch
    of every table as the kernel's table gives it alone; pins held over batches in flight and
    released in one call; refusals (too many IDs, no room) per table."""
    kernel, triton_tables = _tables("kernel"), _tables("triton")
    gen = torch.Generator().manual_seed(seed)
    held: list = []
    refusals = 0
    for step in range(26):
        sizes = torch.randint(0, 70, (len(CONFIGS),), generator=gen).tolist()
        ids = (torch.rand(sum(sizes), generator=gen) ** 3 * 260).long() - 20  # skewed, repeats, negatives
        pin = step % 4 != 3
        if step < 3:  # each in its own space first, so joining has state to carry
            got = [_outcome(lambda: t.transform(b, pin=pin)) for t, b in zip(triton_tables, torch.split(ids, sizes))]
            results, errors = (
                [r if not isinstance(r, Exception) else None for r in got],
                [r if isinstance(r, Exception) else None for r in got],
            )
            for r, base in zip(results, BASES):
                if r is not None:
                    r.slots = torch.where(r.slots >= 0, r.slots + base, -1)
                    r.admitted_slots, r.evicted_slots = r.admitted_slots + base, r.evicted_slots + base
            whole = None
        else:
            many = transform_many(triton_tables, ids.to(DEVICE), sizes, pin=pin, bases=BASES)
            results, errors, whole = many.results, many.errors, many
            assert len({id(t.space) for t in triton_tables}) == 1, "the tables share one space"
        pinned = []
        for k, (kt, tt, block) in enumerate(zip(kernel, triton_tables, torch.split(ids, sizes))):
            where = f"step {step} table {k}"
            expect = _outcome(lambda: kt.transform(block, pin=pin))
            out, error = results[k], errors[k]
            if isinstance(expect, Exception):
                refusals += 1
                assert out is None and type(error) is type(expect) and str(error) == str(expect), where
            else:
                assert error is None, f"{where}: {error}"
                base = BASES[k]
                assert torch.equal(out.slots.cpu(), torch.where(expect.slots >= 0, expect.slots + base, -1)), where
                for field, shift in (("admitted", base), ("evicted", base)):
                    assert torch.equal(getattr(out, f"{field}_ids").cpu(), getattr(expect, f"{field}_ids")), where
                    got_slots = getattr(out, f"{field}_slots").cpu()
                    assert torch.equal(got_slots, getattr(expect, f"{field}_slots") + shift), where
                assert sorted(out.rejected_ids.tolist()) == sorted(expect.rejected_ids.tolist()), where
                assert int(out.hits) == int(expect.hits), where
                assert sorted(out.distinct_slots.tolist()) == sorted(expect.distinct_slots.tolist()), where
                if pin:
                    pinned.append((k, out.distinct_slots, expect.distinct_slots))
            _same_state(kt, tt, where)
        held.append((pinned, whole if pin and whole is not None and whole.error is None else None))
        if len(held) > 2:  # released two batches later, every table in one call
            done, whole = held.pop(0)
            if whole is not None:
                flat = whole.flat_parts()
                errors = release_many_flat(triton_tables, flat[0]["distinct_slots"], flat[1]["distinct_slots"])
                assert errors == [None] * len(triton_tables)
            else:
                for k, slots, _ in done:
                    triton_tables[k].release(slots, distinct=True)
            for k, _, slots in done:
                kernel[k].release(slots, distinct=True)
    assert refusals, "the stream was meant to bring refusals"
    for k, (kt, tt) in enumerate(zip(kernel, triton_tables)):
        _same_state(kt, tt, f"end, table {k}")


def test_a_release_refused_by_one_table_releases_the_others():
    tables = _tables("triton")[:3]
    got = transform_many(tables, torch.tensor([1, 2, 3, 4, 5], device=DEVICE), [2, 2, 1], pin=True, bases=[0, 0, 0])
    flat, counts, _, _ = got.flat_parts()
    tables[2].release(got.results[2].distinct_slots, distinct=True)  # released early
    errors = release_many_flat(tables, flat["distinct_slots"], counts["distinct_slots"])
    assert errors[:2] == [None, None] and "not pinned (released twice?)" in str(errors[2])
    assert [int(t.pins.sum()) for t in tables] == [0, 0, 0]
    outside = torch.tensor([8, 0, 1], device=DEVICE)  # slot 8 is outside table 0 (8 slots): the first bad one
    errors = release_many_flat(tables, outside, [2, 1, 0])
    assert isinstance(errors[0], IndexError) and "table of 8 slots" in str(errors[0])
    assert isinstance(errors[1], ValueError) and errors[2] is None


@pytest.mark.slow
def test_launches_and_copies_do_not_grow_with_the_tables(monkeypatch):
    """A DLRM step's 26 tables cost what 1 costs: the same Triton launches, the same torch ops,
    one host copy; every table evicting, admitting through its sketch and pinned."""
    counted = DeviceWork(monkeypatch, device_transform)

    def make(n: int) -> list[IDTransformer]:
        policy = EvictionPolicy("hybrid", evict_fraction=0.25, log_factor=1.0)
        return [IDTransformer(16, policy, 2, sketch_width=1 << 8, backend="triton", device=DEVICE) for _ in range(n)]

    def batch(n: int, step: int) -> torch.Tensor:
        # every table: 12 IDs, 8 of them new, each seen twice (admitted at once at threshold 2)
        one = torch.cat([torch.arange(4), 100 + step * 8 + torch.arange(8)]).repeat_interleave(2)
        return one.repeat(n).to(DEVICE)

    figures = {}
    for n in (1, 26):
        tables = make(n)
        for step in range(3):  # fill them, and reach the steady state (full, evicting)
            many = transform_many(tables, batch(n, step), [24] * n, pin=True, bases=[0] * n)
            release_many_flat(tables, many.flat["distinct_slots"], many.counts["distinct_slots"])
        assert all(t.resident == 16 for t in tables)
        ids = batch(n, 3)
        got = {}

        def step() -> None:
            got["many"] = device_transform.transform_many(tables, ids, [24] * n, True, [0] * n)

        figures[n] = counted.count(step)
        many = got["many"]
        assert many.error is None and all(c == 8 for c in many.counts["evicted_ids"]), many.counts
        assert all(c == 8 for c in many.counts["admitted_ids"])
        figures[f"release {n}"] = counted.count(
            lambda: release_many_flat(tables, many.flat["distinct_slots"], many.counts["distinct_slots"])
        )
    launches, ops, copies = figures[1]
    assert copies == 1 and launches > 10 and ops > 50, figures
    assert figures[26] == figures[1], f"1 table: {figures[1]}, 26 tables: {figures[26]} (launches, ops, copies)"
    assert figures["release 26"] == figures["release 1"] and figures["release 1"][2] == 1, figures


def test_a_space_refuses_what_it_cannot_hold():
    t = IDTransformer(4, backend="triton", device=DEVICE)
    with pytest.raises(ValueError, match="listed twice"):
        DeviceTables([t, t])
    with pytest.raises(ValueError, match="at least one table"):
        DeviceTables([])
    with pytest.raises(ValueError, match="triton tables on one device"):
        DeviceTables([t, IDTransformer(4)])
    assert DeviceTables.of([t]) is t.space
