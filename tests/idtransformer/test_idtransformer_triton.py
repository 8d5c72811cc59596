"""The triton backend (triton_map.py, device_transform.py) against the compiled kernel, call by
call: the same slots, admissions, evictions, rejections, hits, records, refusals and state;
one host copy per transform; the map's tombstones and rebuild; the victims' radix select;
transform_many and the sharded transform on triton tables; the bench's smoke run. Without a
GPU (CI) the triton tables run on CPU under Triton's interpreter; with one, on CUDA, and the
pass also runs under torch's sync debug mode ("error")."""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import REPO, TESTS

from dynemb.idtransformer import device_transform
from dynemb.idtransformer.many import release_many, transform_many
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.transformer import IDTransformer, NoRoom, TooManyIDs, _lowest
from dynemb.idtransformer.triton_select import lowest

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# without a GPU, conftest.py turns Triton's interpreter on before anything imports the kernels

# on a GPU every test here runs the triton tables there: `pytest -m cuda` selects them
pytestmark = [pytest.mark.cuda] if CUDA else []

FIELDS = ("slots", "admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots")


def pair(**kw) -> tuple[IDTransformer, IDTransformer]:
    return IDTransformer(backend="kernel", **kw), IDTransformer(backend="triton", device=DEVICE, **kw)


def outcome(t: IDTransformer, fn):
    try:
        return fn(t)
    except (RuntimeError, ValueError, IndexError) as e:
        return e


def same_result(a, b, what: str) -> None:
    """a from the kernel, b from triton: equal in every field, or the same refusal."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        assert type(a) is type(b) and str(a) == str(b), f"{what}: kernel {a!r}, triton {b!r}"
        return
    for field in FIELDS:
        x, y = getattr(a, field), getattr(b, field).cpu()
        assert torch.equal(x, y), f"{what} {field}: kernel {x.tolist()[:20]} != triton {y.tolist()[:20]}"
    assert torch.equal(a.rejected_ids.sort().values, b.rejected_ids.sort().values.cpu()), f"{what} rejected"
    assert int(a.hits) == int(b.hits), f"{what} hits"
    assert sorted(a.distinct_slots.tolist()) == sorted(b.distinct_slots.tolist()), f"{what} distinct slots"


def same_state(k: IDTransformer, t: IDTransformer, what: str) -> None:
    assert torch.equal(k.records, t.records.cpu()), f"{what}: records (ids, last access, freq, pins) differ"
    assert (k.step, k.resident) == (t.step, t.resident), f"{what}: step/resident"
    ks, ts = k.state_dict(), t.state_dict()
    for key in ("slots", "ids", "last_access", "freq", "pins"):
        assert torch.equal(ks[key], ts[key]), f"{what}: state {key}"
    if k.sketch is not None:
        assert torch.equal(k.sketch.counts, t.sketch.counts.cpu()), f"{what}: sketch"


def stream(seed: int, steps: int, top: int = 200) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        size = int(torch.randint(1, 90, (1,), generator=g))
        out.append((torch.rand(size, generator=g) ** 3 * top).long() - 20)  # skewed, repeats, negatives
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,threshold,ttl,fraction",
    [
        ("lru", 1, None, 0.3),
        ("lfu", 3, None, 0.05),
        ("hybrid", 2, 4, 0.3),
        ("hybrid", 1, None, 1.0),
        ("lfu", 1, 2, 1.0),
    ],
)
def test_triton_matches_the_kernel_call_by_call(kind, threshold, ttl, fraction):
    """Random batches with repeats, pins held over two batches in flight, releases, refusals for
    want of room; then a state_dict loaded into fresh tables on both sides, and more calls."""
    policy = EvictionPolicy(kind, evict_fraction=fraction, ttl_steps=ttl, log_factor=1.0, decay_steps=3)
    kw = dict(capacity=64, policy=policy, admit_threshold=threshold, sketch_width=1 << 10)
    k, t = pair(**kw)
    held: list[torch.Tensor] = []
    refusals = 0
    for step, ids in enumerate(stream(threshold * 10 + len(kind) + int(fraction * 100), 24)):
        pin = step % 3 == 0
        a, b = outcome(k, lambda x: x.transform(ids, pin=pin)), outcome(t, lambda x: x.transform(ids, pin=pin))
        same_result(a, b, f"step {step}")
        refusals += isinstance(a, NoRoom)
        if pin and not isinstance(a, Exception):
            held.append(a.slots)
        if len(held) > 2:
            s = held.pop(0)
            k.release(s)
            t.release(s)
        same_state(k, t, f"step {step}")
    state = t.state_dict()
    k2, t2 = pair(**kw)
    k2.load_state_dict(state)
    t2.load_state_dict(state)
    for step, ids in enumerate(stream(7, 8)):
        same_result(outcome(k2, lambda x: x.transform(ids)), outcome(t2, lambda x: x.transform(ids)), f"loaded {step}")
        same_state(k2, t2, f"after load, step {step}")
    if fraction == 0.3 and kind == "lru":
        assert refusals, "the stream was meant to run out of room at least once"


def test_a_batch_with_too_many_ids_changes_nothing():
    k, t = pair(capacity=8)
    for x in (k, t):
        x.transform(torch.arange(5), pin=True)
    ids = torch.arange(20).repeat(2)
    a, b = outcome(k, lambda x: x.transform(ids)), outcome(t, lambda x: x.transform(ids))
    assert isinstance(b, TooManyIDs) and "20 distinct IDs" in str(b)
    same_result(a, b, "too many")
    same_state(k, t, "after too many")
    assert t.step == 1


def test_no_room_touches_but_admits_nothing():
    """Every slot pinned: the new IDs find no room; the batch was seen (step, touches, sketch)."""
    k, t = pair(capacity=4, policy=EvictionPolicy("lfu", log_factor=0.0), admit_threshold=1)
    for x in (k, t):
        x.transform(torch.tensor([1, 2, 3, 4]), pin=True)
    ids = torch.tensor([1, 1, 9, 10])
    a, b = outcome(k, lambda x: x.transform(ids)), outcome(t, lambda x: x.transform(ids))
    assert isinstance(b, NoRoom) and "2 new IDs" in str(b)
    same_result(a, b, "no room")
    same_state(k, t, "after no room")
    assert t.step == 2 and int(t.freq[0]) == int(k.freq[0])


def test_pins_full_and_release_errors_change_nothing():
    k, t = pair(capacity=8, policy=EvictionPolicy("lru"), admit_threshold=2, sketch_width=1 << 8)
    for x in (k, t):
        for _ in range(2):  # admitted at the second sighting, pinned
            x.transform(torch.tensor([1, 2]), pin=True)
        state = x.state_dict()  # then 253 more pins on ID 1's slot: 254 batches in flight
        state["pins"][0] += 253
        x.load_state_dict(state)
        x.transform(torch.tensor([1]), pin=True)
    same_state(k, t, "before the 256th pin")
    assert int(t.pins[0]) == 255
    a = outcome(k, lambda x: x.transform(torch.tensor([2, 1, 7]), pin=True))
    b = outcome(t, lambda x: x.transform(torch.tensor([2, 1, 7]), pin=True))
    assert isinstance(b, RuntimeError) and "255 batches" in str(b)
    same_result(a, b, "pins full")
    same_state(k, t, "after pins full")
    for bad in (torch.tensor([7]), torch.tensor([0, 40]), torch.tensor([40, 7])):  # not pinned, outside
        a, b = outcome(k, lambda x: x.release(bad, distinct=True)), outcome(t, lambda x: x.release(bad, distinct=True))
        assert isinstance(b, (ValueError, IndexError))
        same_result(a, b, f"release {bad.tolist()}")
        same_state(k, t, f"after release {bad.tolist()}")
    for x in (k, t):
        x.release(torch.tensor([0, 1]), distinct=True)
    same_state(k, t, "after a release")


def test_one_host_copy_per_transform(monkeypatch):
    """Every call, refused or not, reads the device once: through device_transform.to_host; and
    no tensor is read on the host any other way inside the pass."""
    copies = []
    real = device_transform.to_host

    def counted(counts):
        copies.append(counts.numel())
        return real(counts)

    monkeypatch.setattr(device_transform, "to_host", counted)
    t = IDTransformer(16, EvictionPolicy("hybrid", evict_fraction=0.25), admit_threshold=2, device=DEVICE)
    assert t.backend == "triton" or not CUDA
    t = IDTransformer(16, EvictionPolicy("hybrid", evict_fraction=0.25), 2, backend="triton", device=DEVICE)
    calls = 0
    for ids in stream(3, 8, top=60):
        calls += 1
        outcome(t, lambda x: x.transform(ids, pin=calls % 2 == 0))
    outcome(t, lambda x: x.transform(torch.arange(40)))  # too many IDs
    calls += 1
    assert len(copies) == calls, f"{len(copies)} host copies in {calls} transforms"

    # the host reads that a sync would be on CUDA, refused inside the pass (the one copy aside)
    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a tensor inside the batched pass")

    inside = {"copy": False}

    def allowed(counts):
        inside["copy"] = True
        try:
            return real(counts)
        finally:
            inside["copy"] = False

    monkeypatch.setattr(device_transform, "to_host", allowed)
    for name in ("item", "__bool__", "__int__", "__index__", "tolist"):
        original = getattr(torch.Tensor, name)

        def guard(self, *a, _original=original, **kw):
            if not inside["copy"] and self.numel() == 1 and not _interpreter_frame():
                refuse()
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, guard)
    t.transform(torch.tensor([1, 2, 3, 1000, 1001]))
    with pytest.raises(TooManyIDs):
        t.transform(torch.arange(40))


def _interpreter_frame() -> bool:
    """Whether the caller is Triton's interpreter (it reads scalars as it runs a kernel)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@pytest.mark.cuda
def test_on_cuda_the_pass_does_not_sync_but_for_its_copy(monkeypatch):
    real = device_transform.to_host

    def allowed(counts):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real(counts)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(device_transform, "to_host", allowed)
    t = IDTransformer(1000, EvictionPolicy("hybrid", evict_fraction=0.1), admit_threshold=2, device="cuda")
    assert t.backend == "triton"
    batches = [b.cuda() for b in stream(5, 30, top=3000)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in batches:
            t.transform(ids, pin=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(t) > 0


def test_shapes_dtypes_empty_batches_and_bytes():
    """2-D int32 IDs keep their shape; an empty batch advances the step; 32 bytes a slot."""
    k, t = pair(capacity=16, policy=EvictionPolicy("lru", evict_fraction=0.5))
    for ids in (
        torch.tensor([[3, 4], [4, -7]], dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        torch.arange(30),
    ):
        a, b = outcome(k, lambda x: x.transform(ids)), outcome(t, lambda x: x.transform(ids))
        same_result(a, b, f"ids {ids.tolist()}")
        if not isinstance(b, Exception):
            assert b.slots.shape == ids.shape
        same_state(k, t, f"after {ids.tolist()}")
    assert t.nbytes == 16 * 16 + 8 * t.triton_map.size  # records and map entries: ~32 bytes a slot


def test_backends_are_chosen_and_refused_clearly(monkeypatch):
    assert IDTransformer(4).backend == "kernel"
    with pytest.raises(ValueError, match="is not one of"):
        IDTransformer(4, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        IDTransformer(4, backend="triton")


def test_the_map_reuses_tombstones_and_rebuilds():
    """A long evicting stream: tombstones counted on the host, the map rebuilt, every resident
    ID found at its slot, nothing else found."""
    t = IDTransformer(32, EvictionPolicy("lru", evict_fraction=0.5), backend="triton", device=DEVICE)
    m = t.triton_map
    rebuilt = 0
    seen: set[int] = set()
    for k in range(12):
        ids = torch.arange(k * 20, k * 20 + 20)
        seen.update(ids.tolist())
        tombs = m.tombs
        t.transform(ids)
        rebuilt += m.tombs < tombs
        assert int((m.entries[: m.size] == -2).sum()) == m.tombs, "the host's count of tombstones"
    assert rebuilt, "tombstones never reached a quarter of the map"
    state = t.state_dict()
    assert torch.equal(m.find(state["ids"].to(DEVICE)).cpu(), state["slots"])
    gone = torch.tensor(sorted(seen - set(state["ids"].tolist())))
    assert (m.find(gone.to(DEVICE)) == -1).all()


def test_the_radix_select_picks_as_lowest_does():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        c = int(torch.randint(1, 3000 if trial % 10 == 0 else 50, (1,), generator=g))  # one block, or several
        scores = torch.randint(0, 3, (c,), generator=g) << 40 | torch.randint(0, 4, (c,), generator=g)
        scores[torch.rand(c, generator=g) < 0.3] = torch.iinfo(torch.int64).max
        scores[torch.rand(c, generator=g) < 0.2] -= 1 << 62
        if trial % 3 == 0:
            scores = torch.randint(-(2**62), 2**62, (c,), generator=g)
        n = int(torch.randint(0, c + 1, (1,), generator=g))
        want = torch.zeros(c, dtype=torch.bool)
        if n:
            want[_lowest(scores, n)] = True
        got = lowest(scores.to(DEVICE), torch.tensor(n, device=DEVICE)).cpu()
        assert torch.equal(got, want), (scores.tolist(), n)


@pytest.mark.slow
def test_triton_tables_in_transform_many_and_release_many():
    kw = [dict(capacity=c, policy=EvictionPolicy("hybrid", evict_fraction=0.3)) for c in (8, 40)]
    kernel = [IDTransformer(backend="kernel", **a) for a in kw]
    triton = [IDTransformer(backend="triton", device=DEVICE, **a) for a in kw]
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        sizes = [int(torch.randint(0, 12, (1,), generator=g)), int(torch.randint(1, 60, (1,), generator=g))]
        ids = torch.cat(
            [torch.randint(0, 30, (sizes[0],), generator=g), torch.randint(0, 200, (sizes[1],), generator=g)]
        )
        a, b = transform_many(kernel, ids, sizes, pin=True), transform_many(triton, ids, sizes, pin=True)
        assert torch.equal(a.slots, b.slots.cpu()), f"step {step}"
        assert [type(e) for e in a.errors] == [type(e) for e in b.errors]
        for x, y in zip(a.results, b.results):
            if x is not None:
                same_result(x, y, f"step {step}")
        release_many(kernel, [r.distinct_slots if r else torch.zeros(0, dtype=torch.long) for r in a.results])
        release_many(triton, [r.distinct_slots if r else torch.zeros(0, dtype=torch.long) for r in b.results])
        for x, y in zip(kernel, triton):
            same_state(x, y, f"step {step}")


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="kernel and triton tables side by side on CPU (the interpreter)")
def test_sharded_triton_tables_match_the_kernels(one_process_group):
    """transform_tables and a TransformStream (its exchange on the tables' device) on triton
    tables give what they give on kernel tables."""
    import sys

    from dynemb.idtransformer.sharded import ShardedIDTransformer, release_tables, transform_tables

    sys.path.insert(0, str(TESTS / "dist"))
    import transform_stream_worker as worker

    def tables(backend):  # room for the stream's three batches pinned in flight
        return [ShardedIDTransformer(64, EvictionPolicy("lru", evict_fraction=0.2), backend=backend) for _ in range(2)]

    g = torch.Generator().manual_seed(4)
    batches = [
        [torch.randint(0, 120, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g) for _ in range(2)]
        for _ in range(6)
    ]
    kernel, triton = tables("kernel"), tables("triton")
    for step, blocks in enumerate(batches):
        a, b = transform_tables(kernel, blocks, pin=True), transform_tables(triton, blocks, pin=True)
        for x, y in zip(a, b):
            assert torch.equal(x.slots, y.slots), f"step {step}"
            same_result(x.owned, y.owned, f"step {step}")
        release_tables(kernel, a)
        release_tables(triton, b)
    for x, y in zip(kernel, triton):
        same_state(x.local, y.local, "sharded")
    got_kernel, _ = worker.run_stream(tables("kernel"), batches)
    got_triton, _ = worker.run_stream(tables("triton"), batches)
    assert sorted(got_kernel) == sorted(got_triton) == list(range(len(batches)))
    for tag, (slots, _) in got_kernel.items():
        assert torch.equal(slots, got_triton[tag][0]), f"stream batch {tag}"


@pytest.mark.slow
def test_the_bench_runs_the_triton_backend_end_to_end(capsys):
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import idtransformer_bench

    args = ["--device", DEVICE, "--backends", "triton,torch", "--capacity", "64", "--batch", "40"]
    args += ["--universe", "500", "--warmup", "2", "--batches", "2", "--skip-mch"]
    assert idtransformer_bench.main(args) == 0
    out = capsys.readouterr().out
    assert "triton" in out and "host copies per batch 1.00" in out
    # a DLRM step's tables together: one copy a batch for all, the hit rate the kernel's
    args = ["--device", DEVICE, "--backends", "triton,torch", "--capacity", "64", "--batch", "40", "--tables", "3"]
    args += ["--universe", "500", "--warmup", "2", "--batches", "2", "--skip-mch"]
    assert idtransformer_bench.main(args) == 0
    out = capsys.readouterr().out
    assert "for each of 3 tables" in out and "host copies per batch 1.00" in out
    rates = re.findall(r"hit rate (\S+)", out)
    assert len(rates) == 2 and rates[0] == rates[1], out


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

    from dynemb.idtransformer import triton_map, triton_select

    kernels = [
        (module.__name__, name, obj)
        for module in (triton_map, triton_select)
        for name, obj in vars(module).items()
        if isinstance(obj, KernelInterface)
    ]
    assert len(kernels) >= 10
    taken = {"params", "specialization", "options"}
    clashes = [
        f"{module}.{name}({arg})"
        for module, name, kernel in kernels
        for arg in inspect.signature(kernel.fn).parameters
        if arg in taken
    ]
    assert clashes == []


@pytest.mark.parametrize("tables", [1, 3, 26])
def test_sums_per_table_by_segments_match_a_scatter(tables):
    """The pass's per-table sums (running sums read at each table's last lane) against a plain
    index_add_, for lanes table after table with tables of none, lanes of no table at the end,
    and no lanes at all; counts (bool) and sums (int64)."""
    from dynemb.idtransformer.device_transform import _Segments

    g = torch.Generator().manual_seed(tables)
    for n in (0, 1, 7, 1000):
        tab = torch.sort(torch.randint(0, tables + 1, (n,), generator=g)).values
        if tables > 2:
            tab[tab == 1] = 2  # a table with no lanes
        segments = _Segments(tab.to(DEVICE), tables)
        numbers = torch.randint(0, 5, (n,), generator=g)
        for values in (numbers, numbers > 2):
            want = torch.zeros(tables + 1, dtype=torch.int64).index_add_(0, tab, values.long())[:tables]
            assert torch.equal(segments.sum(values.to(DEVICE)).cpu(), want)
