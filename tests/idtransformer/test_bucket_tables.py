"""The triton backend (bucket_tables.py over bucket_map.py) through IDTransformer, transform_many,
release_many and the sharded transform, held to invariants rather than to the kernel's slots
(shared/DESIGN.md, "The slot map's contract"): each resident ID has one slot and no slot two IDs,
what a call reports (slots, admitted, evicted, rejected, hits, dropped) agrees with the state it
leaves; pinned slots never go; tables keep their slots when they join others; state round trips
and a state of another layout is placed anew; one launch and one host copy a call for 1 table as
for 26. Without a GPU the kernels run under Triton's interpreter (conftest.py turns it on), so
the sizes stay small; with one, `pytest -m cuda` runs these there."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import REPO, TESTS, DeviceWork

from dynemb.idtransformer import bucket_map
from dynemb.idtransformer.many import release_many, transform_many
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.transformer import IDTransformer

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.cuda] if CUDA else []
B = 32  # the smallest bucket: the fewest lanes for the interpreter


def triton(capacity: int, policy: EvictionPolicy | None = None, **kw) -> IDTransformer:
    return IDTransformer(
        capacity, policy or EvictionPolicy("lru"), device=DEVICE, backend="triton", bucket_size=B, **kw
    )


class Resident:
    """Who holds which slot of one table, from the transformer's own reports."""

    def __init__(self, t: IDTransformer) -> None:
        self.t = t
        self.where: dict[int, int] = {}

    def check(self, ids: torch.Tensor, out, pinned: set[int], base: int = 0) -> None:
        ids_l = ids.reshape(-1).tolist()
        before = dict(self.where)
        assert int(out.hits) == sum(i in before for i in ids_l), "hits: sightings of resident IDs"
        evicted = list(zip(out.evicted_ids.tolist(), (out.evicted_slots - base).tolist()))
        admitted = list(zip(out.admitted_ids.tolist(), (out.admitted_slots - base).tolist()))
        for i, s in evicted:
            assert self.where.pop(i) == s, "evicted from a slot it did not hold"
            assert s not in pinned, "a slot pinned by a batch in flight was evicted"
            assert i not in ids_l, "an ID of the batch itself was evicted"
        for i, s in admitted:
            assert i not in self.where, "admitted an ID already resident"
            assert 0 <= s < self.t.capacity, "a slot outside the table"
            self.where[i] = s
        assert len(set(self.where.values())) == len(self.where), "two IDs share a slot"
        slots = out.slots.reshape(-1).tolist()
        for i, s in zip(ids_l, slots):
            assert s == (self.where[i] + base if i in self.where else -1), f"ID {i}: slot {s}"
        left_out = {i for i in ids_l if i not in self.where}
        assert set(out.rejected_ids.tolist()) <= left_out, "a rejected ID got a slot"
        # against the table's own state
        state = self.t.state_dict()
        assert dict(zip(state["ids"].tolist(), state["slots"].tolist())) == self.where
        assert len(self.t) == len(self.where)
        asked = torch.tensor(sorted(set(ids_l) | {-99}), dtype=torch.int64)  # (-99 is never in a batch)
        found = self.t.find(asked.to(self.t.device)).tolist()
        assert found == [self.where.get(i, -1) for i in asked.tolist()], "find: each ID's slot, -1 if none"


def _stream(seed: int, steps: int, size: int, spread: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(size, generator=g) ** 2 * spread).long() - 10 for _ in range(steps)]


@pytest.mark.parametrize(
    "policy,threshold",
    [(EvictionPolicy("lru", ttl_steps=2), 1), (EvictionPolicy("hybrid", log_factor=0.5, decay_steps=2), 2)],
    ids=["lru-ttl", "hybrid-admit-2"],
)
def test_one_table_keeps_its_invariants_with_batches_in_flight(policy, threshold):
    t = triton(70, policy, admit_threshold=threshold, sketch_width=1 << 8)  # buckets of 32, 32 and 6
    ref = Resident(t)
    in_flight: list = []
    evicted = 0
    for ids in _stream(0, 12, 30, 220):
        pinned = {s for out in in_flight for s in out.distinct_slots.tolist() if s >= 0}
        out = t.transform(ids.to(DEVICE), pin=True)
        ref.check(ids, _cpu(out), pinned)
        evicted += len(out.evicted_ids)
        in_flight.append(out)
        if len(in_flight) > 2:
            t.release(in_flight.pop(0).distinct_slots, distinct=True)
    assert evicted > 5, f"the stream was meant to evict ({evicted})"
    for out in in_flight:
        t.release(out.distinct_slots, distinct=True)
    assert int(t.pins.sum()) == 0, "every pin released"
    with pytest.raises(ValueError, match="not pinned"):
        t.release(in_flight[0].distinct_slots, distinct=True)
    with pytest.raises(IndexError, match="out of range for a table of 70 slots"):
        t.release(torch.tensor([70]))


def _cpu(out):
    if not CUDA:
        return out
    for f in ("slots", "admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots", "rejected_ids"):
        setattr(out, f, getattr(out, f).cpu())
    return out


def test_a_batch_larger_than_the_table_is_placed_as_far_as_it_fits():
    """No TooManyIDs or NoRoom on triton: what does not fit is left out (slot -1), counted."""
    t = triton(40)
    out = t.transform(torch.arange(100, device=DEVICE), pin=True)
    placed = out.slots[out.slots >= 0]
    assert len(placed) == 40 and len(set(placed.tolist())) == 40, "every slot used once"
    many = transform_many([t], torch.arange(100, 150, device=DEVICE), [50], pin=True)
    assert many.dropped == [50] and bool((many.slots == -1).all()), "every way pinned: all left out"
    t.release(out.distinct_slots, distinct=True)
    again = transform_many([t], torch.arange(100, 150, device=DEVICE), [50])
    came, went = again.counts["admitted_ids"][0], again.counts["evicted_ids"][0]
    assert again.errors == [None] and came == went > 0 and again.dropped == [50 - came], "a full table: one out, one in"


def test_tables_together_with_bases_and_alone_keep_their_slots():
    """Three tables in one call (bases as a sharded trainer gives them), then one of them
    alone, then the three again in a new order: a table keeps its slots wherever it is
    transformed (joining another map copies its rows), and release_many finds each table's."""
    tables = [
        triton(64, EvictionPolicy("lru")),
        triton(50, EvictionPolicy("lfu", log_factor=1.0)),
        triton(32, EvictionPolicy("hybrid"), admit_threshold=2, sketch_width=1 << 8),
    ]
    refs = [Resident(t) for t in tables]
    bases = [0, 64, 114]
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        sizes = [int(x) for x in torch.randint(0, 30, (3,), generator=g)]
        ids = torch.randint(0, 90, (sum(sizes),), generator=g)
        many = transform_many(tables, ids.to(DEVICE), sizes, pin=True, bases=bases)
        assert many.errors == [None, None, None]
        for k, (ref, block, out) in enumerate(zip(refs, ids.split(sizes), many.results)):
            assert out is not None
            ref.check(block, _cpu(out), set(), bases[k])
            assert many.dropped[k] == int((out.slots == -1).sum())
        assert release_many(tables, [r.distinct_slots for r in many.results if r is not None]) == [None] * 3
    alone = tables[1].transform(torch.tensor([1, 2, 3], device=DEVICE))
    refs[1].check(torch.tensor([1, 2, 3]), _cpu(alone), set())
    reordered = [tables[2], tables[0], tables[1]]  # a new order: they join a new map
    ids = torch.tensor([5, 6, 7, 8, 9, 1, 2])
    many = transform_many(reordered, ids.to(DEVICE), [2, 2, 3])
    for ref, block, out in zip([refs[2], refs[0], refs[1]], ids.split([2, 2, 3]), many.results):
        assert out is not None
        ref.check(block, _cpu(out), set())
    assert tables[0].space is tables[1].space is tables[2].space


def test_state_round_trips_and_another_layout_is_placed_anew():
    t = triton(64, EvictionPolicy("hybrid"))
    for ids in _stream(3, 6, 30, 150):
        t.transform(ids.to(DEVICE))
    state = t.state_dict()
    twin = triton(64, EvictionPolicy("hybrid"))
    twin.load_state_dict(state)
    assert (twin.step, len(twin)) == (t.step, len(t))
    for key in ("ids", "slots", "last_access", "freq"):
        assert torch.equal(twin.state_dict()[key], state[key]), f"same layout: {key} kept"
    batch = torch.arange(40, device=DEVICE)
    a, b = t.transform(batch), twin.transform(batch)
    assert torch.equal(a.slots, b.slots) and torch.equal(a.evicted_ids, b.evicted_ids), "the two go on alike"
    # the kernel's state (a global order): each ID placed anew in its bucket, the best kept
    kernel = IDTransformer(64, EvictionPolicy("hybrid"), backend="kernel")
    for ids in _stream(4, 6, 40, 400):
        kernel.transform(ids)
    k_state = kernel.state_dict()
    placed = triton(64, EvictionPolicy("hybrid"))
    placed.load_state_dict(k_state)
    got = placed.state_dict()
    assert set(got["ids"].tolist()) <= set(k_state["ids"].tolist()) and placed.step == kernel.step
    assert len(placed) >= 0.75 * len(kernel), "a full kernel table's IDs mostly fit the buckets"
    resident = torch.nonzero(got["last_access"] != -1).squeeze(1)
    assert torch.equal(resident, got["slots"].sort().values)
    with pytest.raises(ValueError, match="state is of a table of 64 slots, this one has 65"):
        triton(65).load_state_dict(state)


def test_one_launch_and_one_copy_a_call_for_one_table_as_for_26(monkeypatch):
    counted = DeviceWork(monkeypatch, bucket_map)
    figures = {}
    for n in (1, 26):
        tables = [triton(B, EvictionPolicy("hybrid")) for _ in range(n)]
        ids = torch.arange(3).repeat(n).to(DEVICE)
        transform_many(tables, ids, [3] * n)  # the tables join one map
        found = {}
        figures[n] = counted.count(lambda: found.update(m=transform_many(tables, ids, [3] * n, pin=True)))
        many = found["m"]
        figures[f"release {n}"] = counted.count(
            lambda: release_many(tables, [r.distinct_slots for r in many.results if r is not None])
        )
    assert figures[1] == figures[26], f"1 table: {figures[1]}, 26: {figures[26]} (launches, ops, copies)"
    assert figures[1][0] == 1 and figures[1][2] == 1, figures
    assert figures["release 1"] == figures["release 26"] and figures["release 1"][::2] == (1, 1), figures


def test_an_unchecked_release_copies_nothing_and_a_fault_shows_with_the_next_batch(monkeypatch, caplog):
    """What a training step does: the release without a host copy; a batch released twice is
    named in the log with the next batch's one copy."""
    import logging

    from dynemb.idtransformer.many import release_many_flat

    counted = DeviceWork(monkeypatch, bucket_map)
    t = triton(64)
    many = transform_many([t], torch.arange(10, device=DEVICE), [10], pin=True)
    slots, counts = many.flat["distinct_slots"], many.counts["distinct_slots"]
    launches, _, copies = counted.count(lambda: release_many_flat([t], slots, counts, check=False))
    assert (launches, copies) == (1, 0) and int(t.pins.sum()) == 0
    assert release_many_flat([t], slots, counts, check=False) == [None]  # twice: not seen yet
    with caplog.at_level(logging.ERROR, "dynemb.idtransformer"):
        transform_many([t], torch.arange(3, device=DEVICE), [3])
        transform_many([t], torch.arange(3, device=DEVICE), [3])
    assert caplog.text.count("10 slots of table 0 (capacity 64) were released but not pinned") == 1, caplog.text


def test_backends_are_chosen_and_refused_clearly(monkeypatch):
    assert IDTransformer(4).backend == "kernel"
    with pytest.raises(ValueError, match="is not one of"):
        IDTransformer(4, backend="cuda")
    with pytest.raises(ValueError, match="one bucket size, not \\[32, 64\\]"):
        a, b = triton(8), IDTransformer(8, device=DEVICE, backend="triton", bucket_size=64)
        transform_many([a, b], torch.arange(2, device=DEVICE), [1, 1])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        IDTransformer(4, backend="triton")


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="kernel and triton tables side by side on CPU (the interpreter)")
def test_sharded_triton_tables_keep_the_invariants(one_process_group):
    """transform_tables and a TransformStream on triton tables: every ID's global slot is its
    owner's row for it, the evicted left, and the stream gives every batch back."""
    import sys

    from dynemb.idtransformer.sharded import ShardedIDTransformer, release_tables, transform_tables

    sys.path.insert(0, str(TESTS / "dist"))
    import transform_stream_worker as worker

    def tables():
        return [ShardedIDTransformer(64, EvictionPolicy("lru"), backend="triton", bucket_size=B) for _ in range(2)]

    g = torch.Generator().manual_seed(4)
    batches = [
        [torch.randint(0, 120, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g) for _ in range(2)]
        for _ in range(6)
    ]
    mine = tables()
    refs = [Resident(t.local) for t in mine]
    for blocks in batches:
        results = transform_tables(mine, blocks, pin=True)
        for ref, block, out in zip(refs, blocks, results):
            ref.check(block, out.owned, set())
            assert torch.equal(out.slots, out.owned.slots), "one rank: the owner's slots are the caller's"
        release_tables(mine, results)
    got, _ = worker.run_stream(tables(), batches)
    assert sorted(got) == list(range(len(batches)))


@pytest.mark.slow
def test_the_bench_runs_the_triton_backend_end_to_end(capsys):
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import idtransformer_bench

    for tables in ("1", "3"):
        args = ["--device", DEVICE, "--backends", "triton,torch", "--capacity", "64", "--batch", "40"]
        args += ["--universe", "500", "--warmup", "2", "--batches", "2", "--skip-mch", "--tables", tables]
        assert idtransformer_bench.main(args) == 0
        out = capsys.readouterr().out
        assert "triton" in out and "host copies per batch 1.00" in out, out
        rates = [float(r) for r in re.findall(r"hit rate (\S+)", out)]
        assert len(rates) == 2 and abs(rates[0] - rates[1]) < 0.1, out


def test_the_profile_runs_and_names_where_the_time_goes(capsys, tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import idtransformer_profile

    args = ["--device", DEVICE, "--capacity", "64", "--batch", "40", "--universe", "500", "--tables", "2"]
    args += ["--warmup", "2", "--batches", "1", "--top", "5", "--trace", str(tmp_path / "trace.json")]
    assert idtransformer_profile.main(args) == 0
    out = capsys.readouterr().out
    assert "2 table(s), batches of 40 IDs" in out and "IDs/s" in out and "aten::" in out
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_no_kernel_argument_takes_a_name_of_the_launchers_own():
    """Triton's launcher binds a launch's arguments in a generated function whose own locals are
    `params`, `specialization` and `options` (triton/runtime/jit.py,
    create_function_from_signature): a kernel argument of one of those names is replaced by
    the launcher's dict, and the launch fails on a GPU ("failed to specialize argument of type:
    dict") though it runs under the interpreter, as on this CPU."""
    import inspect

    from triton.runtime.jit import KernelInterface

    kernels = [(name, obj) for name, obj in vars(bucket_map).items() if isinstance(obj, KernelInterface)]
    assert len(kernels) >= 3
    taken = {"params", "specialization", "options"}
    clashes = [f"{name}({arg})" for name, k in kernels for arg in inspect.signature(k.fn).parameters if arg in taken]
    assert clashes == []


@pytest.mark.cuda
def test_on_cuda_the_call_does_not_sync_but_for_its_copy(monkeypatch):
    real = bucket_map.to_host

    def allowed(counts):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(counts)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(bucket_map, "to_host", allowed)
    t = IDTransformer(1000, EvictionPolicy("hybrid"), admit_threshold=2, device="cuda")
    assert t.backend == "triton"
    batches = [b.cuda() for b in _stream(5, 30, 200, 3000)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in batches:
            t.transform(ids, pin=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(t) > 0
