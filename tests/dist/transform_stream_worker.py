"""Run by torchrun from tests/idtransformer/test_transform_stream.py: every rank puts a stream of batches
through a TransformStream (one exchange each) and the same batches through transform_tables
(three exchanges each) on twin tables, and checks they agree call by call; then the endings
(a rank with fewer batches, a refused batch). Prints OK rank r of w."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import leave_process_groups  # noqa: E402

from dynemb.idtransformer.policy import EvictionPolicy  # noqa: E402
from dynemb.idtransformer.sharded import BatchRefused, ShardedIDTransformer, release_tables, transform_tables  # noqa: E402
from dynemb.idtransformer.stream import TransformStream  # noqa: E402

IN_FLIGHT = 2  # batches pinned at a transform, as with the trainer's pipeline


def tables(n: int, capacity: int, policy: str) -> list[ShardedIDTransformer]:
    return [ShardedIDTransformer(capacity, EvictionPolicy(policy, evict_fraction=0.1)) for _ in range(n)]


def batches(rank: int, count: int, n_tables: int) -> list[list[torch.Tensor]]:
    """Zipf-ish IDs, a different number per rank, table and batch; some blocks empty."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for k in range(count):
        blocks = []
        for t in range(n_tables):
            n = 0 if (k + t + rank) % 7 == 3 else int(torch.randint(20, 90, (1,), generator=g))
            u = torch.rand(n, generator=g, dtype=torch.float64)
            blocks.append((u.pow(3) * 4000).long() + 5000 * t)
        out.append(blocks)
    return out


def run_stream(ts, stream_batches):
    """(tag -> (flat slots, results)), the stream, via the protocol of stream.py's docstring."""
    stream = TransformStream(ts, pin=True)
    todo = iter(enumerate(stream_batches))
    got, in_flight = {}, []

    def upcoming():
        item = next(todo, None) if stream.taking else None
        if item is None:
            return None, None, None
        k, blocks = item
        return torch.cat(blocks), [b.numel() for b in blocks], k

    stream.exchange(*upcoming())
    while stream.open:
        answered = stream.exchange(*upcoming())
        if answered is not None:
            tag, slots, results = answered
            got[tag] = (slots, results)
        if stream.received is not None:
            while len(in_flight) > IN_FLIGHT:
                release_tables(ts, in_flight.pop(0))
            in_flight.append(stream.transform_received())
    return got, stream


def same_as_transform_tables(rank: int, world: int, policy: str) -> None:
    n_tables, count = 3, 25
    mine = batches(rank, count, n_tables)
    a, b = tables(n_tables, 400, policy), tables(n_tables, 400, policy)
    expect, in_flight = [], []
    for blocks in mine:
        while len(in_flight) > IN_FLIGHT:
            release_tables(a, in_flight.pop(0))
        out = transform_tables(a, blocks, pin=True)
        expect.append(out)
        in_flight.append(out)
    got, stream = run_stream(b, mine)
    assert sorted(got) == list(range(count)) and not stream.dropped, (sorted(got), stream.dropped)
    for k in range(count):
        slots, results = got[k]
        assert torch.equal(slots, torch.cat([o.slots.reshape(-1) for o in expect[k]])), k
        for t in range(n_tables):
            e, r = expect[k][t].owned, results[t].owned
            assert torch.equal(expect[k][t].slots, results[t].slots), (k, t)
            for field in ("admitted_ids", "admitted_slots", "evicted_ids", "evicted_slots", "distinct_slots"):
                assert torch.equal(getattr(e, field), getattr(r, field)), (k, t, field)
            assert int(e.hits) == int(r.hits), (k, t)
    evictions = sum(int(o.owned.evicted_ids.numel()) for out in expect for o in out)
    assert evictions > 0, "the tables never filled: nothing was checked of eviction"
    for x, y in zip(a, b):
        assert torch.equal(x.local.records, y.local.records)


def a_rank_with_fewer_batches(rank: int, world: int) -> None:
    """Rank 0 has 5 batches, the others 7: every rank gets its first 5 answered, the others'
    6th is dropped (the 7th never read), and the stream ends without a hang."""
    mine = batches(rank, 5 if rank == 0 else 7, 2)
    read = []
    got, stream = run_stream(tables(2, 400, "lru"), _recording(mine, read))
    assert sorted(got) == list(range(5)), sorted(got)
    assert stream.dropped == ([] if rank == 0 else [5]), stream.dropped
    assert len(read) == (5 if rank == 0 else 6), len(read)
    assert not stream.open


def _recording(items, read):
    for x in items:
        read.append(x)
        yield x


def a_refused_batch(rank: int, world: int) -> None:
    """Batch 3 has more distinct IDs for table 1 than an owner's share holds: every rank raises
    BatchRefused from the exchange that answers batch 3, naming the owners, with its own
    results for the batch (the other table's went through: its slots are rows); batch 4's IDs,
    already received, are not transformed."""
    ts = tables(2, 60, "lru")
    mine = [[torch.arange(10) + 100 * k + 7 * rank, torch.arange(10) + 100 * k] for k in range(6)]
    mine[3][1] = torch.arange(1000, 1000 + 60 * world * 3)  # each owner gets ~180 > 60
    got = []
    try:
        run = run_stream(ts, mine)
        raise AssertionError(f"batch 3 went through: {sorted(run[0])}")
    except BatchRefused as e:
        assert sorted(e.refused_by[1]) == list(range(world)) and e.refused_by[0] == [], e.refused_by
        assert "too" in str(e) or "distinct" in str(e), str(e)
        assert (e.results[1].slots == -2).all()
        assert (e.results[0].slots >= 0).all()
        assert e.results[0].slots.numel() == 10
        got.append(e)
    assert len(got) == 1
    assert all(t.local.step == 4 for t in ts[:1]), [t.local.step for t in ts]  # batches 0-3, not 4


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = sys.argv[1] if len(sys.argv) > 1 else "hybrid"
    same_as_transform_tables(rank, world, policy)
    a_rank_with_fewer_batches(rank, world)
    a_refused_batch(rank, world)
    print(f"OK rank {rank} of {world}", flush=True)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
