"""IDTransformer against a small reference model: invariants on random streams, policies on
hand-made ones, pinning, admission, state round-trips."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.transformer import IDTransformer

# the compiled CPU kernel and the torch-ops map must both pass everything; where a GPU is
# present (not in CI: run them on one with `pytest tests/idtransformer/test_idtransformer.py`), the torch
# ops on CUDA too
SIDES = ["kernel", "torch"] + (["cuda"] if torch.cuda.is_available() else [])
BACKENDS = pytest.mark.parametrize("backend", SIDES)


def make(backend: str, **kw) -> IDTransformer:
    """backend: "kernel", "torch" (both on CPU) or "cuda" (the torch ops on the GPU)."""
    if backend == "cuda":
        return IDTransformer(backend="torch", device="cuda", **kw)
    return IDTransformer(backend=backend, **kw)


class Reference:
    """What must hold whatever the policy: who is resident where, and every eviction reported once."""

    def __init__(self) -> None:
        self.where: dict[int, int] = {}

    def check(self, batch: list[int], out, pinned: set[int]) -> None:
        assert out.hits == sum(i in self.where for i in batch), "hits are the sightings of resident IDs"
        used = sorted({s for s in out.slots.tolist() if s >= 0})
        assert sorted(out.distinct_slots.tolist()) == used, "distinct_slots: each slot the batch uses, once"
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
@BACKENDS
def test_invariants_on_random_streams(backend, batches, kind, threshold, ttl):
    t = make(
        backend,
        capacity=16,
        policy=EvictionPolicy(kind, evict_fraction=0.25, ttl_steps=ttl),
        admit_threshold=threshold,
        sketch_width=1 << 12,
    )
    ref, seen = Reference(), {}
    for batch in batches:
        out = t.transform(torch.tensor(batch, dtype=torch.int64))
        ref.check(batch, out, pinned=set())
        for i in batch:
            seen[i] = seen.get(i, 0) + 1
        for i in out.admitted_ids.tolist():
            assert seen[i] >= threshold, "admitted before it was seen threshold times"
        assert len(t) == len(ref.where) <= 16


@BACKENDS
def test_batch_larger_than_the_table_is_refused(backend):
    t = make(backend, capacity=4)
    with pytest.raises(ValueError, match="5 distinct IDs but the table holds 4"):
        t.transform(torch.arange(5))
    out = t.transform(torch.tensor([1, 1, 2, 2, 3, 4, 4]))  # 4 distinct: fine
    assert out.slots.unique().numel() == 4 and (out.slots >= 0).all()


@BACKENDS
def test_lru_evicts_the_longest_idle_in_batches(backend):
    t = make(backend, capacity=4, policy=EvictionPolicy("lru", evict_fraction=0.5))
    for i in (10, 11, 12, 13):
        t.transform(torch.tensor([i]))
    t.transform(torch.tensor([10, 12]))  # 11 and 13 are now the longest idle
    out = t.transform(torch.tensor([20]))
    assert sorted(out.evicted_ids.tolist()) == [11, 13]  # half the table freed at once
    assert len(t) == 3


@BACKENDS
def test_lfu_keeps_the_frequent(backend):
    t = make(backend, capacity=3, policy=EvictionPolicy("lfu", evict_fraction=0.34, log_factor=0, initial_freq=0))
    t.transform(torch.tensor([1, 2, 3]))
    for _ in range(5):
        t.transform(torch.tensor([1, 3]))  # log_factor 0: every hit counts
    t.transform(torch.tensor([2]))
    assert t.transform(torch.tensor([4])).evicted_ids.tolist() == [2]  # most recent, least frequent


@BACKENDS
def test_pinned_and_in_use_slots_survive(backend):
    t = make(backend, capacity=4, policy=EvictionPolicy("lru", evict_fraction=1.0))
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


@BACKENDS
def test_pin_overflow_and_double_release_change_nothing(backend):
    """A pin count stops at 255 and at 0: the call that would pass either is refused whole
    (no slot of it pinned or released), with the same errors on both backends."""
    t = make(backend, capacity=8, policy=EvictionPolicy("lru"))
    t.transform(torch.tensor([1, 2, 3]))
    one = t.transform(torch.tensor([1])).slots
    for _ in range(254):
        t.transform(torch.tensor([1]), pin=True)
    before = t.records.clone()
    last = t.transform(torch.tensor([1, 2]), pin=True)  # slot of 1 at 255 now, 2's at 1
    assert t.pins[one].tolist() == [255] and int(t.pins[last.distinct_slots].sum()) == 256
    records, step = t.records.clone(), t.step
    with pytest.raises(RuntimeError, match="pinned by 255 batches in flight"):
        t.transform(torch.tensor([2, 1, 4]), pin=True)  # 2 and 4 could be pinned, 1 cannot
    # refused before anything changed: 4 not admitted, nothing touched or pinned, same step
    assert torch.equal(t.records, records) and t.step == step
    assert len(t) == 3 and int(t.map.find(torch.tensor([4], device=t.device))) == -1
    assert before.view(torch.uint8)[:, 13].sum() + 2 == records.view(torch.uint8)[:, 13].sum()
    t.release(last.distinct_slots, distinct=True)  # 1 to 254, 2 to 0
    pins = t.pins.clone()
    three = t.map.find(torch.tensor([3], device=t.device))
    for bad in (torch.cat([one, three]), torch.cat([three, one])):  # 3 was never pinned
        with pytest.raises(ValueError, match=r"release of slots that are not pinned \(released twice\?\)"):
            t.release(bad, distinct=True)
        assert torch.equal(t.pins, pins)
    with pytest.raises(ValueError, match="not pinned"):
        t.release(last.slots)  # 2 released twice
    assert torch.equal(t.pins, pins)
    t.release(one)
    assert t.pins[one].tolist() == [253]


@BACKENDS
def test_admission_threshold(backend):
    t = make(backend, capacity=8, admit_threshold=3, sketch_width=1 << 12)
    out = t.transform(torch.tensor([7, 8, 8]))
    assert out.slots.tolist() == [-1, -1, -1] and sorted(out.rejected_ids.tolist()) == [7, 8]
    out = t.transform(torch.tensor([7, 8]))
    assert out.admitted_ids.tolist() == [8] and out.slots[0] == -1 and out.slots[1] >= 0
    assert t.transform(torch.tensor([7])).admitted_ids.tolist() == [7]


@BACKENDS
def test_ids_past_the_ttl_are_evicted_first(backend):
    """An ID idle longer than ttl_steps goes before any live one, however often it was seen."""
    for ttl, evicted in ((2, [1]), (None, [2])):
        t = make(backend, capacity=3, policy=EvictionPolicy("lfu", ttl_steps=ttl, log_factor=1.0))
        for batch in ([1], [1], [2], [3]):  # 1 seen twice (its counter one up), 2 and 3 once
            t.transform(torch.tensor(batch))
        # at step 4, 1 has been idle 3 steps, past a TTL of 2; without one LFU takes 2
        assert t.transform(torch.tensor([4])).evicted_ids.tolist() == evicted, ttl


@BACKENDS
def test_state_round_trip_gives_the_same_output(backend):
    def fresh():
        return make(
            backend,
            capacity=32,
            policy=EvictionPolicy("hybrid", evict_fraction=0.25),
            admit_threshold=2,
            sketch_width=1 << 12,
        )

    gen = torch.Generator().manual_seed(1)
    stream = [torch.randint(0, 60, (20,), generator=gen) for _ in range(30)]
    a = fresh()
    for b in stream[:15]:
        a.transform(b)
    b_ = fresh()
    b_.load_state_dict(a.state_dict())
    for batch in stream[15:]:
        x, y = a.transform(batch), b_.transform(batch)
        assert torch.equal(x.slots, y.slots)
        assert torch.equal(x.evicted_ids.sort().values, y.evicted_ids.sort().values)


def _same(a, b, what):
    b = b.cpu()
    assert torch.equal(a, b), f"{what}: kernel {a.tolist()[:20]} != torch ops {b.tolist()[:20]}"


@settings(max_examples=25, deadline=None)
@pytest.mark.parametrize("other", [pytest.param(o, marks=pytest.mark.slow) if o == "torch" else o for o in SIDES[1:]])
@given(
    seed=st.integers(0, 2**31),
    kind=st.sampled_from(["lru", "lfu", "hybrid"]),
    threshold=st.integers(1, 3),
    ttl=st.none() | st.integers(1, 6),
    fraction=st.sampled_from([0.05, 0.3, 1.0]),
)
def test_kernel_and_torch_backends_agree_call_by_call(other, seed, kind, threshold, ttl, fraction):
    """The compiled CPU kernel and the torch-ops version (the CUDA path) give identical slots,
    admissions, evictions and state on the same stream: skewed ids, repeats, pins, releases,
    TTLs."""
    policy = EvictionPolicy(kind, evict_fraction=fraction, ttl_steps=ttl, log_factor=1.0, decay_steps=3)
    k, t = (
        make(side, capacity=64, policy=policy, admit_threshold=threshold, sketch_width=1 << 10)
        for side in ("kernel", other)
    )
    gen = torch.Generator().manual_seed(seed)
    held = []
    for step in range(40):
        size = int(torch.randint(1, 90, (1,), generator=gen))
        ids = (torch.rand(size, generator=gen) ** 3 * 200).long() - 20  # skewed, some negative
        pin = step % 3 == 0
        outcomes = []
        for side in (k, t):
            try:
                outcomes.append(side.transform(ids, pin=pin))
            except (RuntimeError, ValueError) as e:  # no room (pins hold too much), too many IDs
                outcomes.append(str(e))
        a, b = outcomes
        if isinstance(a, str) or isinstance(b, str):
            assert a == b and ("no room" in a or "distinct IDs" in a)  # both must refuse, alike
            continue
        for field in ("slots", "admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots"):
            _same(getattr(a, field), getattr(b, field), f"step {step} {field}")
        _same(a.rejected_ids.sort().values, b.rejected_ids.sort().values, f"step {step} rejected")
        if pin:
            held.append(a.slots)
        if len(held) > 2:
            s = held.pop(0)
            k.release(s)
            t.release(s)
        _same(k.records, t.records, f"step {step} records (ids, last access, counters, pins)")
    ks, ts = k.state_dict(), t.state_dict()
    for key in ("slots", "ids", "last_access", "freq", "pins"):
        _same(ks[key], ts[key], f"state {key}")


@BACKENDS
def test_a_large_stream_keeps_the_map_consistent(backend):
    """Thousands of admissions and evictions through chains that wrap around the map's end:
    every resident ID is found at its slot, evicted ones are gone."""
    t = make(backend, capacity=500, policy=EvictionPolicy("hybrid", evict_fraction=0.1))
    gen = torch.Generator().manual_seed(7)
    resident: dict[int, int] = {}
    for _ in range(60):
        ids = torch.randint(-(1 << 62), 1 << 62, (300,), generator=gen)
        ids[:100] = torch.randint(0, 400, (100,), generator=gen)  # some come back
        out = t.transform(ids)
        for i in out.evicted_ids.tolist():
            del resident[i]
        resident.update(zip(out.admitted_ids.tolist(), out.admitted_slots.tolist()))
    ids = torch.tensor(list(resident))
    assert t.map.find(ids.to(t.device)).tolist() == list(resident.values())
    gone = torch.randint(1 << 62, (1 << 63) - 1, (1000,), generator=gen)
    assert (t.map.find(gone.to(t.device)) == -1).all()
    assert len(t) == len(resident)


def _aged_state(capacity: int, step: int, gen: torch.Generator) -> dict:
    """A full table at `step`: a fifth of it idle far longer than 65,536 steps (where the
    kernel orders victims by an exact sort), the rest recent; few distinct last-access steps
    and counters, so the cut falls among many ties."""
    last = torch.randint(step - 40, step, (capacity,), generator=gen, dtype=torch.int32)
    old = torch.rand(capacity, generator=gen) < 0.2
    last[old] = torch.randint(0, 3000, (int(old.sum()),), generator=gen, dtype=torch.int32) * 10
    return {
        "capacity": capacity,
        "step": step,
        "slots": torch.arange(capacity),
        "ids": torch.randperm(capacity, generator=gen) * 7919 + 13,
        "last_access": last,
        "freq": torch.randint(4, 8, (capacity,), generator=gen, dtype=torch.uint8),
        "pins": (torch.rand(capacity, generator=gen) < 0.01).to(torch.uint8),
    }


def _both_from(state: dict, policy: EvictionPolicy) -> dict[str, IDTransformer]:
    """A table on the kernel and one on the torch ops, both loaded with `state`."""
    sides = {b: IDTransformer(state["capacity"], policy, backend=b) for b in ("kernel", "torch")}
    for t in sides.values():
        t.load_state_dict(state)
    return sides


def _transform_alike(sides: dict[str, IDTransformer], ids: torch.Tensor, pin: bool, what: str) -> dict:
    """Both sides' results for ids, which must be the same, as must their state after."""
    out = {b: t.transform(ids, pin=pin) for b, t in sides.items()}
    for field in ("slots", "admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots"):
        assert torch.equal(getattr(out["kernel"], field), getattr(out["torch"], field)), f"{what} {field}"
    assert torch.equal(sides["kernel"].records, sides["torch"].records), f"{what} records"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.05, 0.3])
@pytest.mark.parametrize("kind", ["lru", "hybrid"])
def test_kernel_matches_the_torch_ops_on_a_large_aged_table(kind, fraction):
    """A table of several hundred thousand slots with ties at the cut and long-idle victims: the
    kernel's victims (under a sampled bound, or by its exact selection when a step frees 30% of
    the table) and state equal the torch ops'."""
    capacity = 3 * (1 << 16) + 1234
    policy = EvictionPolicy(kind, evict_fraction=fraction, decay_steps=3)
    gen = torch.Generator().manual_seed(11)
    state = _aged_state(capacity, 200_000, gen)
    sides = _both_from(state, policy)
    for step in range(6):
        ids = torch.cat(
            [
                torch.randint(-(1 << 62), 1 << 62, (25_000,), generator=gen),
                state["ids"][torch.randint(0, capacity, (25_000,), generator=gen)],
            ]
        )
        out = _transform_alike(sides, ids, step == 1, f"step {step}")
        if step == 0:  # the table starts full
            assert len(out["torch"].evicted_ids) >= int(fraction * capacity)


@pytest.mark.parametrize("size", ["small", pytest.param("large", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["random", "oldest-where-sampled"])
@pytest.mark.parametrize("kind", ["lru", "lfu", "hybrid", "hybrid+ttl"])
def test_victims_under_a_sampled_bound_match_the_torch_ops(kind, layout, size):
    """The kernel selects victims among the keys under a bound taken from a sample of slots:
    a trainer-sized table (thousands of slots, a step's few hundred victims; a sample of 128)
    and a large one (hundreds of thousands, a sample of 8192, where the bound spares computing
    every key). The victims equal the torch ops' exact ones, also where the slots the sample
    looks at hold the oldest keys, so the bound keeps too few and the kernel falls back to all
    the keys (small) or to its exact selection (large)."""
    capacity, sample, new = (4000, 128, 300) if size == "small" else (3 * (1 << 16) + 1234, 8192, 6000)
    step = 200_000
    policy = EvictionPolicy(
        kind.split("+")[0], evict_fraction=0.02, decay_steps=3, ttl_steps=20 if kind.endswith("+ttl") else None
    )
    gen = torch.Generator().manual_seed(5)
    state = _aged_state(capacity, step, gen)
    state["pins"].zero_()
    if layout == "oldest-where-sampled":  # the kernel's sample: every (capacity / sample)-th slot
        sampled = torch.arange(sample) * capacity // sample
        state["last_access"][:] = step - 1 - torch.randint(0, 5, (capacity,), generator=gen, dtype=torch.int32)
        state["last_access"][sampled] = torch.arange(sample, dtype=torch.int32)  # far older than the rest
    sides = _both_from(state, policy)
    for i in range(4):
        ids = torch.randint(-(1 << 62), 1 << 62, (new,), generator=gen)  # the first batch: all new, so
        if i:  # no slot is in use and the sample lands where the layout put the oldest
            ids = torch.cat([ids, state["ids"][torch.randint(0, capacity, (new * 2 // 3,), generator=gen)]])
        out = _transform_alike(sides, ids, i == 1, f"batch {i}")
        assert len(out["torch"].evicted_ids) >= new // 3  # it did evict, a few percent of the table
        if i == 0 and layout == "oldest-where-sampled" and kind != "lfu":  # the oldest went first (LFU: the least used)
            oldest, evicted = set(sampled.tolist()), set(out["kernel"].evicted_slots.tolist())
            assert oldest <= evicted if len(oldest) <= len(evicted) else evicted <= oldest


@BACKENDS
def test_a_state_that_breaks_the_tables_rules_is_refused(backend):
    """load_state_dict names what is wrong (a last access after the state's step once crashed
    the kernel's victim selection: its keys assume none)."""
    gen = torch.Generator().manual_seed(2)
    good = _aged_state(100, 200_000, gen)
    t = make(backend, capacity=100)
    t.load_state_dict(good)  # as made
    bad = [
        ("last_access", lambda s: s["last_access"].__setitem__(3, 200_001), "outside steps 0..200000"),
        ("ids", lambda s: s["ids"].__setitem__(1, int(s["ids"][0])), "a slot or an ID twice"),
        ("slots", lambda s: s["slots"].__setitem__(0, 100), "slots outside [0, 100)"),
        ("freq", lambda s: s.__setitem__("freq", s["freq"][:50]), "freq has shape (50,)"),
    ]
    for _what, spoil, message in bad:
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in good.items()}
        spoil(state)
        with pytest.raises(ValueError, match=re.escape(message)):
            t.load_state_dict(state)
    free = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in good.items()}
    free["slots"], free["ids"] = free["slots"][1:], free["ids"][1:]  # slot 0 free, yet accessed
    with pytest.raises(ValueError, match="a slot no ID holds"):
        t.load_state_dict(free)


def _same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _same_state(x, y, f"{what}: {key}")
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: {key} changed"
        else:
            assert x == y, f"{what}: {key} changed ({x} -> {y})"


def _saturate(t: IDTransformer, i: int) -> list:
    """Pin the slot of resident ID i up to 255 through pinned transforms of [i] alone."""
    held = []
    while int(t.pins[t.map.find(torch.tensor([i], device=t.device))]) < 255:
        held.append(t.transform(torch.tensor([i]), pin=True))
    return held


@pytest.mark.parametrize("threshold", [1, 2])
@BACKENDS
def test_a_batch_refused_for_pins_changes_nothing(backend, threshold):
    """A pinned transform that would take a slot past 255 pins is refused before anything is
    admitted, evicted, touched, counted or stepped: state_dict() is as before the call, and the
    same batch goes through once a batch in flight is released, its evictions reported."""
    t = make(
        backend,
        capacity=4,
        policy=EvictionPolicy("hybrid", evict_fraction=0.5),
        admit_threshold=threshold,
        sketch_width=1 << 12,
    )
    for _ in range(threshold):
        t.transform(torch.tensor([1, 2, 3, 4]))
    assert len(t) == 4
    held = _saturate(t, 1)
    for _ in range(threshold - 1):
        t.transform(torch.tensor([5, 6]))  # seen, below the threshold: not admitted yet
    before = t.state_dict()
    batch = torch.tensor([2, 5, 1, 6, 5])  # 2 resident, 5 and 6 new (room: evict), 1 at 255
    for _ in range(2):
        with pytest.raises(RuntimeError, match="pinned by 255 batches in flight"):
            t.transform(batch, pin=True)
        _same_state(before, t.state_dict(), "a refused batch")
        assert len(t) == 4
    t.transform(torch.tensor([3]))  # the table goes on as usual meanwhile
    t.release(held.pop().slots)
    out = t.transform(batch, pin=True)
    assert sorted(out.admitted_ids.tolist()) == [5, 6]
    assert len(out.evicted_ids) >= 2 and not {1, 2} & set(out.evicted_ids.tolist())
    assert (out.slots >= 0).all() and len(t) == 4 - len(out.evicted_ids) + 2
    assert int(t.pins[t.map.find(torch.tensor([1], device=t.device))]) == 255


_OP = st.one_of(
    st.tuples(st.just("batch"), st.lists(st.integers(0, 12), min_size=1, max_size=6), st.booleans()),
    st.tuples(st.just("saturate"), st.integers(0, 12)),
    st.tuples(st.just("release"), st.integers(0, 300)),
)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(_OP, min_size=1, max_size=30),
    kind=st.sampled_from(["lru", "lfu", "hybrid"]),
    threshold=st.integers(1, 2),
)
@BACKENDS
def test_no_eviction_is_lost_across_pin_refusals(backend, ops, kind, threshold):
    """Random batches, with slots pinned up to 255 and batches released: an ID that leaves the
    map is reported evicted exactly once (the reference follows only the reports and must
    match the transformer's residents after every call), a batch is refused for pins exactly
    when one of its resident IDs is at 255, and then state_dict() is unchanged."""
    t = make(
        backend,
        capacity=6,
        policy=EvictionPolicy(kind, evict_fraction=0.34),
        admit_threshold=threshold,
        sketch_width=1 << 12,
    )
    ref, held = Reference(), []

    def pins_of(i: int) -> int:
        return int(t.pins[ref.where[i]]) if i in ref.where else 0

    def call(batch: list[int], pin: bool) -> None:
        before = t.state_dict()
        full = pin and any(pins_of(i) == 255 for i in set(batch))
        pinned = set(torch.nonzero(t.pins).flatten().tolist())
        try:
            out = t.transform(torch.tensor(batch), pin=pin)
        except RuntimeError as e:
            if "pinned by 255" in str(e):
                assert full, "refused for pins with no slot at 255"
                _same_state(before, t.state_dict(), "a batch refused for pins")
                return
            assert "no room" in str(e) and not full, str(e)
            return
        assert not full, "a slot took a 256th pin"
        ref.check(batch, out, pinned)
        if pin:
            held.append(out)

    for op in ops:
        if op[0] == "batch":
            call(op[1], op[2])
        elif op[0] == "saturate":
            i = op[1]
            call([i], False)
            while i in ref.where and pins_of(i) < 255:  # hits only: the check below follows
                held.append(t.transform(torch.tensor([i]), pin=True))
        elif held:
            t.release(held.pop(op[1] % len(held)).distinct_slots, distinct=True)
        state = t.state_dict()
        assert dict(zip(state["ids"].tolist(), state["slots"].tolist())) == ref.where, (
            "the map and the reported admissions/evictions disagree: an ID left unreported"
        )
    while held:
        t.release(held.pop().distinct_slots, distinct=True)
    assert int(t.pins.sum()) == 0
