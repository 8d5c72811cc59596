"""BucketSlotMap (the CUDA backend's set-associative slot map) by invariants, not by slot parity
with the CPU kernel (shared/DESIGN.md, "The slot map's contract"): one slot per resident pair and
one pair per slot, within its table's range and its bucket; evicted = exactly the pairs that
left; pinned slots never evicted; policies, TTL and admission as documented; export/restore;
one launch and one host copy a batch for 1 table as for 26; and the hit rate on a Zipf stream
within a point of the CPU kernel's. Without a GPU the kernels run under Triton's interpreter,
so the sizes stay small."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import REPO, DeviceWork

from dynemb.idtransformer import bucket_map
from dynemb.idtransformer.admission import CountMinSketch
from dynemb.idtransformer.bucket_map import BucketSlotMap, TableSpec, bucket_of
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.transformer import IDTransformer

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.cuda] if CUDA else []
B = 32  # the smallest bucket: the fewest lanes for the interpreter


class Reference:
    """Who is resident where, from the map's own outputs, and what must hold batch by batch."""

    def __init__(self, m: BucketSlotMap) -> None:
        self.m = m
        self.where: dict[tuple[int, int], int] = {}  # (table, id) -> slot

    def check(self, ids: torch.Tensor, sizes: list[int], found, pinned: set[tuple[int, int]]) -> None:
        m, c = self.m, found.counts
        tabs = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).tolist()
        pairs = list(zip(tabs, ids.tolist()))
        assert c.distinct == len(set(pairs))
        assert c.hits == sum(p in self.where for p in pairs), "hits are the sightings of resident pairs"
        admitted = list(zip(*(x.tolist() for x in found.admitted)))
        evicted = list(zip(*(x.tolist() for x in found.evicted)))
        assert (len(admitted), len(evicted)) == (c.admitted, c.evicted)
        assert len(set(evicted)) == len(evicted), "a pair evicted twice"
        admitted_slots = {(t, s) for t, _, s in admitted}
        for t, i, s in evicted:
            assert self.where.pop((t, i)) == s, "evicted from a slot it did not hold"
            assert (t, s) not in pinned, "a pinned slot was evicted"
            assert (t, s) in admitted_slots, "a slot emptied but not given to an admitted pair"
        for t, i, s in admitted:
            assert (t, i) not in self.where, "admitted a resident pair"
            assert 0 <= s < m.tables[t].capacity, "a slot outside its table"
            self.where[(t, i)] = s
        slots = list(self.where.items())
        assert len({(t, s) for (t, _), s in slots}) == len(slots), "two resident pairs share a slot"
        got = found.slots.tolist()
        for (t, i), s in zip(pairs, got):
            assert s == self.where.get((t, i), -1), "a pair's slot is not where it lives"
        assert got.count(-1) == sum(1 for p in pairs if p not in self.where)
        refused = {p for p in pairs if p not in self.where}
        assert c.rejected + c.refused == len(refused)
        # against the storage: exactly these pairs, each in the bucket it hashes to
        e = m.export()
        held = {(t, i): s for t, i, s in zip(*(x.tolist() for x in e[:3]))}
        assert held == self.where, "the storage holds other pairs than those admitted and not evicted"
        assert m.resident() == [sum(1 for t, _ in self.where if t == k) for k in range(len(m.tables))]
        rows = e.slots + m._first_row[e.tables]
        assert torch.equal(rows // m.bucket_size, bucket_of(e.tables, e.ids, m._first_bucket, m._buckets))


def _stream(seed: int, sizes_max: int, tables: int, steps: int, spread: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        sizes = torch.randint(0, sizes_max, (tables,), generator=gen).tolist()
        ids = (torch.rand(sum(sizes), generator=gen) ** 2 * spread).long() - 10  # skewed, repeats, negatives
        yield ids, sizes


TABLES = [
    TableSpec(64, EvictionPolicy("lru", ttl_steps=3)),
    TableSpec(90, EvictionPolicy("lfu", log_factor=1.0)),  # its last bucket: 26 ways of 32
    TableSpec(32, EvictionPolicy("hybrid", log_factor=0.5, decay_steps=2), admit_threshold=2, sketch_width=1 << 8),
]


def test_invariants_over_a_stream_of_three_tables_with_pins_in_flight():
    m = BucketSlotMap(TABLES, bucket_size=B, device=DEVICE)
    ref = Reference(m)
    in_flight: list = []
    evicted = 0
    for ids, sizes in _stream(0, 36, 3, 10, 200):
        pinned = {(t, s) for f in in_flight for t, s in zip(*_pinned(m, f))}
        found = m.find_or_insert(ids.to(DEVICE), sizes, pin=True)
        ref.check(ids, sizes, _cpu(found), pinned)
        evicted += found.counts.evicted
        in_flight.append(found)
        if len(in_flight) > 2:  # released two batches later
            m.release(in_flight.pop(0).rows, check=True)
    assert evicted > 20, f"the stream was meant to evict ({evicted}); refusals: test_a_bucket_with_every_way_pinned"
    for f in in_flight:
        m.release(f.rows, check=True)
    assert int(m.pins.sum()) == 0, "release unpins exactly the batch's slots"


def _pinned(m: BucketSlotMap, found) -> tuple[list[int], list[int]]:
    rows = found.rows.cpu()
    rows = rows[rows >= 0]
    tabs = torch.searchsorted(torch.tensor(m.first_rows), rows, right=True) - 1
    return tabs.tolist(), (rows - torch.tensor(m.first_rows)[tabs]).tolist()


def _cpu(found):
    return found if not CUDA else type(found)(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in found))


def test_a_bucket_with_every_way_pinned_refuses_and_never_shares_a_row():
    m = BucketSlotMap([TableSpec(B, EvictionPolicy("lru"))], bucket_size=B, device=DEVICE)
    first = m.find_or_insert(torch.arange(B + 5, device=DEVICE), [B + 5], pin=True)  # 5 more than the bucket
    c = first.counts
    assert (c.admitted, c.refused, c.evicted) == (B, 5, 0), c
    assert sorted(first.slots[first.slots >= 0].tolist()) == list(range(B)), "each way once"
    blocked = m.find_or_insert(torch.arange(100, 110, device=DEVICE), [10], pin=True)
    assert (blocked.counts.refused, blocked.counts.evicted) == (10, 0), "pinned ways were taken"
    assert bool((blocked.slots == -1).all())
    m.release(first.rows, check=True)
    freed = m.find_or_insert(torch.arange(100, 110, device=DEVICE), [10])
    assert (freed.counts.admitted, freed.counts.evicted) == (10, 10), freed.counts
    assert set(freed.evicted.slots.tolist()) == set(freed.admitted.slots.tolist())
    with pytest.raises(ValueError, match="not pinned"):  # the first batch again
        m.release(first.rows, check=True)
    assert int(m.pins.min()) == 0 and m.resident() == [B]


def _one_bucket(policy: EvictionPolicy, threshold: int = 1) -> BucketSlotMap:
    return BucketSlotMap([TableSpec(B, policy, threshold, sketch_width=1 << 8)], bucket_size=B, device=DEVICE)


def _go(m: BucketSlotMap, ids) -> bucket_map.Found:
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return m.find_or_insert(ids.to(DEVICE), [ids.numel()])


def test_lru_evicts_the_least_recently_used_way():
    m = _one_bucket(EvictionPolicy("lru"))
    for k in range(4):
        _go(m, range(8 * k, 8 * k + 8))  # 32 IDs, 8 a step
    _go(m, [0, 1, 2])  # touched: now the most recent
    out = _go(m, [100, 101, 102, 103])
    assert sorted(out.evicted.ids.tolist()) == [3, 4, 5, 6], "the least recent that were not touched"


def test_lfu_keeps_the_frequent_where_lru_would_not():
    m = _one_bucket(EvictionPolicy("lfu", log_factor=0.0))  # log_factor 0: every batch that sees an ID bumps it
    _go(m, range(32))
    for _ in range(3):
        _go(m, range(16))  # 0-15: frequent, and older than 16-31 after the next step
    _go(m, range(16, 32))
    out = _go(m, [100, 101])
    assert sorted(out.evicted.ids.tolist()) == [16, 17], "LFU evicted a frequent ID (LRU's choice)"


def test_ttl_evicts_the_expired_first_whatever_their_frequency():
    m = _one_bucket(EvictionPolicy("lfu", log_factor=0.0, ttl_steps=3))
    _go(m, range(32))
    for _ in range(4):
        _go(m, range(16))  # 0-15: frequent, last seen at step 4
    for _ in range(3):
        _go(m, [])
    _go(m, range(16, 32))  # step 8: 16-31 seen again, rarer
    out = _go(m, [200])  # step 9: 0-15 idle for 5 steps, more than the TTL
    assert out.evicted.ids.tolist() == [0], "an expired way goes first (then the lowest way)"


def test_hybrid_decays_a_once_hot_id_until_it_goes():
    m = _one_bucket(EvictionPolicy("hybrid", log_factor=0.0, decay_steps=2))
    for _ in range(6):
        _go(m, [7])  # admitted at 5, then 5 bumps
    m.find_or_insert(torch.arange(100, 130, device=DEVICE), [30], pin=True)  # 30 ways held for good
    s7 = int(_go(m, [7, 130]).slots[0])
    assert int(m.freq[s7]) == 10, "decayed by one point (2 idle steps), bumped by one"
    for k in range(14):  # each step a new ID, for one of two ways: 7's or the last newcomer's
        out = _go(m, [1000 + k])
        if 7 in out.evicted.ids.tolist():
            break
    else:
        pytest.fail("a once-hot ID never decayed enough to be evicted")
    assert k == 9, f"evicted after {k + 1} idle steps: 10 - idle // 2 reaches the newcomers' 5 at 10"


def test_admission_waits_for_the_threshold_and_counts_in_the_sketch():
    m = _one_bucket(EvictionPolicy("lru"), threshold=3)
    seen = [_go(m, [42, 42]).counts, _go(m, [42]).counts]
    assert [(c.rejected, c.admitted) for c in seen] == [(1, 0), (0, 1)], "admitted at its third sighting"
    assert _go(m, [42]).counts.hits == 1
    # the kernel counts as CountMinSketch.add does, in the table's own sketch
    twin = CountMinSketch(1 << 8, 4)
    twin.add(torch.tensor([42, 42]))
    twin.add(torch.tensor([42]))
    sketch = m.sketches[0]
    assert sketch is not None and torch.equal(sketch.counts.cpu(), twin.counts)
    specs = [
        TableSpec(B),
        TableSpec(B, admit_threshold=2, sketch_width=1 << 8, sketch_depth=2),
        TableSpec(B, admit_threshold=3, sketch_width=1 << 9),
    ]
    many = BucketSlotMap(specs, bucket_size=B, device=DEVICE)
    many.find_or_insert(torch.tensor([9, 9, 9, 9, 9], device=DEVICE), [1, 2, 2])
    assert many.sketches[0] is None, "a table without a threshold has no sketch"
    for k, seen in ((1, 2), (2, 2)):
        twin = CountMinSketch(specs[k].sketch_width, specs[k].sketch_depth)
        twin.add(torch.tensor([9]), torch.tensor([seen]))
        sketch = many.sketches[k]
        assert sketch is not None and torch.equal(sketch.counts.cpu(), twin.counts), f"table {k}'s sketch"


def test_the_kernels_scores_are_the_policys():
    gen = torch.Generator().manual_seed(3)
    policies = [
        EvictionPolicy("lru"),
        EvictionPolicy("lfu", ttl_steps=7),
        EvictionPolicy("hybrid", decay_steps=3),
        EvictionPolicy("hybrid", decay_steps=5, ttl_steps=20),
    ]
    m = BucketSlotMap([TableSpec(B, p) for p in policies], bucket_size=B, device=DEVICE)
    m.steps = [50] * len(policies)
    m.last_access.copy_(torch.randint(0, 51, (m.rows,), generator=gen, dtype=torch.int32))
    m.freq.copy_(torch.randint(0, 256, (m.rows,), generator=gen, dtype=torch.uint8))
    got = m.scores().cpu().view(len(policies), B)
    for k, p in enumerate(policies):
        want = p.scores(m.last_access.cpu().view(-1, B)[k], m.freq.cpu().view(-1, B)[k], 50)
        assert torch.equal(got[k], want), p


def test_export_and_restore_round_trip():
    m = BucketSlotMap(TABLES, bucket_size=B, device=DEVICE)
    batches = list(_stream(1, 30, 3, 8, 150))
    for ids, sizes in batches[:5]:
        m.find_or_insert(ids.to(DEVICE), sizes)
    saved = m.export()
    twin = BucketSlotMap(TABLES, bucket_size=B, device=DEVICE)
    twin.restore(saved)
    assert twin.resident() == m.resident() and twin.steps == m.steps
    for ids, sizes in batches[5:]:  # the two go on alike
        a, b = m.find_or_insert(ids.to(DEVICE), sizes), twin.find_or_insert(ids.to(DEVICE), sizes)
        assert torch.equal(a.slots, b.slots) and a.counts == b.counts
        assert all(torch.equal(x, y) for x, y in zip(a.evicted, b.evicted))
    other = BucketSlotMap([t._replace(capacity=2 * t.capacity) for t in TABLES], 2 * B, DEVICE)
    with pytest.raises(ValueError, match="outside the buckets"):
        other.restore(saved)
    twice = saved._replace(slots=torch.zeros_like(saved.slots))
    with pytest.raises(ValueError, match="slot twice|outside the buckets"):
        twin.restore(twice)


def test_tables_get_slots_in_their_own_range_in_one_launch(monkeypatch):
    """26 tables cost what 1 costs: one Triton launch, the same torch ops, one host copy."""
    counted = DeviceWork(monkeypatch, bucket_map)
    figures = {}
    for n in (1, 26):
        m = BucketSlotMap([TableSpec(B, EvictionPolicy("hybrid"), 2, 1 << 8) for _ in range(n)], B, DEVICE)
        ids = torch.arange(3).repeat(n).to(DEVICE)  # every table: IDs 0, 1, 2
        m.find_or_insert(ids, [3] * n)  # counted once each: not admitted yet
        found = {}
        figures[n] = counted.count(lambda: found.update(f=m.find_or_insert(ids, [3] * n, pin=True)))
        f = found["f"]
        assert f.counts.admitted == 3 * n
        assert sorted(zip(f.admitted.tables.tolist(), f.admitted.ids.tolist())) == [
            (t, i) for t in range(n) for i in range(3)
        ]
        assert bool(((f.slots >= 0) & (f.slots < B)).all()), "a slot outside its table"
        rows = f.rows.cpu()
        assert sorted((rows // B).tolist()) == sorted(torch.arange(n).repeat_interleave(3).tolist()), "rows by table"
        figures[f"release {n}"] = counted.count(lambda: m.release(f.rows))
    assert figures[1] == figures[26], f"1 table: {figures[1]}, 26: {figures[26]} (launches, ops, copies)"
    assert figures[1][0] == 1 and figures[1][2] == 1, figures
    assert figures["release 1"] == figures["release 26"] and figures["release 1"][::2] == (1, 0), figures


@pytest.mark.slow
def test_zipf_hit_rate_within_a_point_of_the_kernel():
    """LRU at one capacity, batches of 64 Zipf(1.05) IDs: the CPU kernel (global order, one
    eviction at a time) against 8 buckets of 32."""
    capacity, batch, steps = 256, 64, 30
    rng = np.random.default_rng(0)
    stream = torch.from_numpy(rng.zipf(1.05, size=batch * steps).astype(np.int64) % 10**7 * 2654435761)
    policy = EvictionPolicy("lru", evict_fraction=1 / capacity)
    kernel = IDTransformer(capacity, policy, backend="kernel")
    m = BucketSlotMap([TableSpec(capacity, policy)], bucket_size=B, device=DEVICE)
    hits_kernel = hits_map = sightings = 0
    for k, ids in enumerate(stream.split(batch)):
        a, b = int(kernel.transform(ids).hits), m.find_or_insert(ids.to(DEVICE), [batch]).counts
        if k >= steps // 4:  # past the warm-up
            hits_kernel, hits_map, sightings = hits_kernel + a, hits_map + b.hits, sightings + batch
    rate_kernel, rate_map = hits_kernel / sightings, hits_map / sightings
    assert rate_kernel > 0.1, "the stream was meant to hit"
    assert abs(rate_map - rate_kernel) <= 0.01, f"kernel {rate_kernel:.4f}, bucket map {rate_map:.4f}"


def test_bad_geometry_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="table 1: capacity must be >= 1, got 0"):
        BucketSlotMap([TableSpec(100), TableSpec(0)], bucket_size=32, device=DEVICE)
    with pytest.raises(ValueError, match="sketch width must be a power of two"):
        BucketSlotMap([TableSpec(100, admit_threshold=2, sketch_width=100)], bucket_size=32, device=DEVICE)
    with pytest.raises(ValueError, match="power of two in \\[32, 1024\\]"):
        BucketSlotMap([TableSpec(96)], bucket_size=48, device=DEVICE)
    with pytest.raises(ValueError, match="each of the 2 tables"):
        BucketSlotMap([TableSpec(32), TableSpec(32)], bucket_size=32, device=DEVICE).find_or_insert(
            torch.arange(3), [3]
        )


GPU_TRITON = REPO / ".venv" / "triton-gpu"  # scripts/setup_env.sh puts the GPU machine's Triton there


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="on a GPU the kernels compile when they run")
@pytest.mark.parametrize("triton_at", ["venv", "gpu"], ids=["triton-of-the-venv", "triton-of-the-gpu-machine"])
def test_kernels_compile_for_sm90(triton_at):
    """What Triton's compiler refuses and its interpreter accepts (a constexpr-true early
    return, an argument named like the launcher's locals, constants over int64) fails here: the
    kernels are compiled to cubin for an H100/H200 (sm_90) without a GPU, in a process without
    TRITON_INTERPRET (the kernels are decorated for the interpreter in this one), with .venv's
    Triton and with the GPU machine's (shared/DESIGN.md: 3.6.0)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_at == "gpu":
        version = GPU_TRITON / ".version"
        assert version.exists(), f"no Triton in {GPU_TRITON}: run scripts/setup_env.sh"
        env["PYTHONPATH"] = os.pathsep.join([str(GPU_TRITON), str(REPO)])
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split().count("cubin") == 3, done.stdout
    if triton_at == "gpu":
        assert f"triton {version.read_text().strip()}" in done.stdout, done.stdout


_COMPILE = """
import triton
print("triton", triton.__version__)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dynemb.idtransformer import bucket_map as bm

P, I32 = "*i64", "i32"
kernels = {
    bm._find_or_insert_kernel: (
        dict(keys_ptr=P, last_ptr="*i32", freq_ptr="*u8", pins_ptr="*i32", uniq_ptr=P, utab_ptr=P, ubucket_ptr=P,
             ucount_ptr=P, bstart_ptr=P, params_ptr=P, steps_ptr=P, log_factor_ptr="*fp64", sketch_ptr="*i32",
             mult_ptr=P, urow_ptr=P, uslot_ptr=P, arank_ptr="*i32", erank_ptr="*i32", rrank_ptr="*i32", gone_ptr=P,
             admitted_ptr=P, evicted_ptr=P, rejected_ptr=P, counts_ptr=P, n_tables=I32, out_len=I32),
        dict(B=128, DEPTH=4, PIN=True, CHUNK=64),
    ),
    bm._release_kernel: (dict(pins_ptr="*i32", rows_ptr=P, row_table_ptr=P, n=I32, counts_ptr=P), dict(BLOCK=256)),
    bm._scores_kernel: (
        dict(last_ptr="*i32", freq_ptr="*u8", out_ptr=P, tab_ptr=P, params_ptr=P, steps_ptr=P, n=I32),
        dict(BLOCK=256),
    ),
}
for fn, (sig, consts) in kernels.items():
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(fn.__name__, "cubin", len(out.asm["cubin"]))
"""
