"""Run by torchrun from tests/idtransformer/test_sharded_idtransformer.py: every rank checks the sharded
ID transformer against a single-process model of what its owner share must do."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import leave_process_groups  # noqa: E402

from dynemb.idtransformer.hashing import owner_of  # noqa: E402
from dynemb.idtransformer.policy import EvictionPolicy  # noqa: E402
from dynemb.idtransformer.sharded import BatchRefused, ShardedIDTransformer, transform_tables  # noqa: E402
from dynemb.idtransformer.transformer import IDTransformer  # noqa: E402
from dynemb.trainer.collectives import all_gather_ragged  # noqa: E402

CAPACITY = 48


def _owned_by_me(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """What the owner `rank` receives of every rank's batch, in rank order."""
    return torch.cat([b[owner_of(b, world) == rank] for b in all_gather_ragged(batch)])


def _owned(r: int, world: int, n: int, skip: int = 0) -> list[int]:
    """n IDs owned by rank r (the same on every rank), after the first `skip` of them."""
    ids = torch.arange(10_000)
    return ids[owner_of(ids, world) == r][skip:skip + n].tolist()


def _pin_refusal(rank: int, world: int) -> None:
    """A batch whose IDs include one whose slot (on rank 0) is pinned by 255 batches in flight:
    rank 0 refuses it with its table untouched and answers -2, every other rank gets a clear
    error instead of hanging, with its own share's result to release; after a release the
    same batch goes through."""
    tiny = ShardedIDTransformer(8, EvictionPolicy("lru", evict_fraction=0.5))
    x = _owned(0, world, 1)[0]
    tiny.transform(torch.tensor(_owned(rank, world, 8)))  # every rank's table full (x on rank 0)
    held = [tiny.transform(torch.tensor([x]), pin=True) for _ in range(255)]
    batch = torch.tensor([x] + _owned(0, world, 2, skip=8) + _owned(rank, world, 2, skip=10))
    before = tiny.local.state_dict()
    try:
        transform_tables([tiny], [batch], pin=True)
        raise AssertionError("a batch with a slot at 255 pins went through")
    except BatchRefused as e:
        assert e.refused_by == [[0]], e.refused_by
        tiny.release(e.results[0])  # the other ranks' shares went through: their pins go
        if rank == 0:
            assert "pinned by 255 batches in flight" in str(e), str(e)
            assert "pinned by 255" in str(e.__cause__) and e.errors[0] is e.__cause__
            after = tiny.local.state_dict()
            assert after.keys() == before.keys()
            for key, value in before.items():
                same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
                assert same, f"a refused batch changed {key}"
        else:
            assert "rank 0 refused its share of table 0" in str(e), str(e)
            assert e.errors == [None] and e.__cause__ is None
    tiny.release(held.pop())
    out = transform_tables([tiny], [batch], pin=True)[0]
    assert (out.slots >= 0).all()
    if rank == 0:
        assert set(_owned(0, world, 2, skip=8)) <= set(out.owned.admitted_ids.tolist())
        assert len(out.owned.evicted_ids) >= 2 and x not in out.owned.evicted_ids.tolist()
    tiny.release(out)
    for h in held:
        tiny.release(h)
    assert int(tiny.local.pins.sum()) == 0  # on every rank


def _torch_routing(rank: int, world: int) -> None:
    """Tables on the torch backend route with torch ops (as on CUDA), the kernel's tables with
    the kernel's routing ops: the same answers, the same owner shares, call by call."""
    kinds = ["lru", "hybrid", "lfu"]
    pairs = [[ShardedIDTransformer(CAPACITY, EvictionPolicy(k, evict_fraction=0.25), backend=b) for k in kinds]
             for b in ("kernel", "torch")]
    gen = torch.Generator().manual_seed(2000 + rank)
    for step in range(8):
        batches = [(torch.rand(int(torch.randint(0, 30, (1,), generator=gen)), generator=gen) ** 2 * 200).long() - 50
                   for _ in kinds]
        fast, slow = (transform_tables(tables, batches) for tables in pairs)
        for a, b in zip(fast, slow):
            assert torch.equal(a.slots, b.slots), step
            assert torch.equal(a.owned.slots, b.owned.slots), step
            assert torch.equal(a.owned.evicted_ids, b.owned.evicted_ids), step


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = EvictionPolicy(sys.argv[1] if len(sys.argv) > 1 else "hybrid", evict_fraction=0.25)
    sharded = ShardedIDTransformer(CAPACITY, policy, admit_threshold=2, sketch_width=1 << 10)
    model = IDTransformer(CAPACITY, policy, admit_threshold=2, sketch_width=1 << 10)  # this rank's share
    # a second table, transformed in the same exchange (transform_tables), with its own model
    other = ShardedIDTransformer(CAPACITY // 2, EvictionPolicy("lfu", evict_fraction=0.5))
    other_model = IDTransformer(CAPACITY // 2, EvictionPolicy("lfu", evict_fraction=0.5))
    gen = torch.Generator().manual_seed(1000 + rank)
    in_flight = []
    for step in range(30):
        size = int(torch.randint(1, 40, (1,), generator=gen))
        batch = (torch.rand(size, generator=gen) ** 2 * 150).long() * 7919 - 300  # overlaps across ranks
        if step % 3 == 2:
            out = sharded.transform(batch, pin=step % 2 == 0)
        else:
            other_batch = batch[: size // 2 + 1] * 3 + 1
            out, other_out = transform_tables([sharded, other], [batch, other_batch], pin=step % 2 == 0)
            expect_other = other_model.transform(_owned_by_me(other_batch, rank, world), pin=step % 2 == 0)
            assert torch.equal(other_out.owned.evicted_ids, expect_other.evicted_ids), step
            half = (CAPACITY // 2) * rank
            assert torch.equal(other_out.owned.slots, torch.where(expect_other.slots >= 0, expect_other.slots + half, -1))
            if other_out.pinned is not None:
                other.release(other_out)
                other_model.release(expect_other.slots)

        # what every rank sent, to model this rank's share and check the answers
        batches = all_gather_ragged(batch)
        got = all_gather_ragged(out.slots)

        mine = torch.cat([b[owner_of(b, world) == rank] for b in batches])
        expect = model.transform(mine, pin=step % 2 == 0)
        offset = rank * CAPACITY
        assert torch.equal(out.owned.slots, torch.where(expect.slots >= 0, expect.slots + offset, -1)), step
        assert torch.equal(out.owned.admitted_ids, expect.admitted_ids), step
        assert torch.equal(out.owned.admitted_slots, expect.admitted_slots + offset), step
        assert torch.equal(out.owned.evicted_ids, expect.evicted_ids), step
        assert torch.equal(out.owned.evicted_slots, expect.evicted_slots + offset), step

        # every rank's answer: a row in the owner's block, one row per ID, one ID per row
        where: dict[int, int] = {}
        for b, s in zip(batches, got):
            owners = owner_of(b, world)
            admitted = s >= 0
            assert torch.equal(s[admitted] // CAPACITY, owners[admitted]), f"step {step}: row outside owner's block"
            for i, row in zip(b.tolist(), s.tolist()):
                if row >= 0:
                    assert where.setdefault(i, row) == row, f"step {step}: id {i} got two rows"
        assert len(set(where.values())) == len(where), f"step {step}: two ids share a row"

        if out.pinned is not None:
            in_flight.append((out, expect))
        if len(in_flight) > 1:
            done, done_expect = in_flight.pop(0)
            sharded.release(done)
            model.release(done_expect.slots)
    assert torch.equal(sharded.local.records, model.records)
    _pin_refusal(rank, world)
    _torch_routing(rank, world)
    print(f"OK rank {rank} of {world}: {len(sharded.local)} resident", flush=True)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
