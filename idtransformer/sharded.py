"""ShardedIDTransformer: one ID transformer per rank, each owning the IDs that hash to it.

    t = ShardedIDTransformer(capacity_per_rank=1_000_000, group=dist.group.WORLD)
    out = t.transform(local_ids)    # collective: every rank calls it, each with its own batch
    out.slots                       # global row of each of local_ids: rank r's rows are
                                    # [r * capacity_per_rank, (r + 1) * capacity_per_rank)
    out.owned                       # this rank's TransformResult for the IDs it owns: the
                                    # rows to pull (admitted) and push (evicted) live here
    t.release(out)                  # with pin=True, when the batch is through backward

An ID's owner is xxh64(id) % world_size, the same function the PS client shards by. There
is no coordinator: each rank sends every ID of its batch to the owner (one all_to_all for
the counts, one for the IDs), each owner maps all the IDs it received in one batched call
(the requests of rank 0 first, then rank 1, ...; an ID asked for by several ranks gets one
slot), and the slots travel back the same way (route.py lays the exchange out, on CPU in the
kernel). transform_tables does this for many tables in the same three exchanges, the owner
mapping every table's IDs in one call (many.py); on one rank there is nothing to exchange.
The slots an owner hands out are rows of its own block, so with TorchRec's row-wise sharding
(equal contiguous blocks) the row of an ID lives on the rank that owns the ID. Works with any
torch.distributed backend that has all_to_all (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from idtransformer.ids import as_int64_ids
from idtransformer.many import release_many, transform_many
from idtransformer.policy import EvictionPolicy
from idtransformer.route import route, transpose_blocks
from idtransformer.transformer import IDTransformer, TransformResult


@dataclass
class ShardedTransformResult:
    slots: torch.Tensor  # global rows of the caller's ids (same shape); -1: not admitted
    owned: TransformResult  # the owner's view of what it received: its slots are global rows
    pinned: torch.Tensor | None = None  # this rank's local slots pinned for the batch


class ShardedIDTransformer:
    def __init__(
        self,
        capacity_per_rank: int,
        policy: EvictionPolicy = EvictionPolicy(),
        admit_threshold: int = 1,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        **kwargs,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.capacity_per_rank = capacity_per_rank
        self.offset = self.rank * capacity_per_rank
        self.local = IDTransformer(capacity_per_rank, policy, admit_threshold, device=device, **kwargs)
        self.device = self.local.device

    def transform(self, ids: torch.Tensor, pin: bool = False) -> ShardedTransformResult:
        """Collective. ids: this rank's batch (int64, any shape)."""
        return transform_tables([self], [ids], pin)[0]

    def release(self, result: ShardedTransformResult) -> None:
        """Unpin what this rank pinned for a batch (local: no communication)."""
        if result.pinned is None:
            raise ValueError("this batch was not transformed with pin=True")
        self.local.release(result.pinned, distinct=True)
        result.pinned = None

    def state_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local": self.local.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"state is of rank {state['rank']} of {state['world_size']}, this is rank {self.rank} "
                f"of {self.world_size} (a different world size needs a re-shard: export and re-import)"
            )
        self.local.load_state_dict(state["local"])


def release_tables(tables: list[ShardedIDTransformer], results: list[ShardedTransformResult]) -> None:
    """tables[t].release(results[t]) for every table (local: no communication), the tables on
    the kernel in one call; the first error is raised once every table has been released."""
    for out in results:
        if out.pinned is None:
            raise ValueError("this batch was not transformed with pin=True")
    errors = release_many([t.local for t in tables], [out.pinned for out in results])
    for out, error in zip(results, errors):
        if error is None:
            out.pinned = None
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


def transform_tables(tables: list[ShardedIDTransformer], ids: list[torch.Tensor],
                     pin: bool = False) -> list[ShardedTransformResult]:
    """Collective: transform one batch of IDs per table, for all tables in one exchange (one
    all_to_all of counts, one of IDs, one of rows, whatever the number of tables). Every
    rank passes the same tables in the same order (the same group).

    When an owner refuses its share of a table (IDTransformer.transform's errors), it answers
    -2 for it so that no rank hangs, and every rank raises: the refusing owner its own error
    (for a slot at 255 pins, that table of that owner is unchanged), the others a RuntimeError
    naming the refusal. The shares that other owners, or other tables, did transform in the
    same call stand, and their results (evictions to push, pins to release) are lost with
    the error."""
    ids = [as_int64_ids(x) for x in ids]
    every = torch.cat([x.reshape(-1) for x in ids]) if ids else torch.zeros(0, dtype=torch.int64)
    _, results = transform_blocks(tables, every, [x.numel() for x in ids], pin)
    for out, x in zip(results, ids):
        out.slots = out.slots.reshape(x.shape)
    return results


def transform_blocks(tables: list[ShardedIDTransformer], ids: torch.Tensor, sizes: list[int],
                     pin: bool = False) -> tuple[torch.Tensor, list[ShardedTransformResult]]:
    """transform_tables over the tables' IDs laid end to end (table t's are the sizes[t] after
    those of tables 0..t-1): (the slots of all, in that layout; each table's result, whose
    slots are views of them)."""
    if not tables:
        return ids[:0], []
    first = tables[0]
    group, world, device = first.group, first.world_size, first.device
    every = as_int64_ids(ids).reshape(-1).to(device)
    if world == 1:  # nothing to exchange
        many = transform_many([t.local for t in tables], every, sizes, pin, [t.offset for t in tables])
        if many.error is not None:
            raise many.error
        return many.slots, _results(many.slots, sizes, many.results, pin)

    # send layout: for each destination rank, table 0's IDs it owns, then table 1's, ...
    kernel = all(t.local.backend == "kernel" for t in tables)  # else torch ops (CUDA)
    n_tables = len(tables)
    send, position, counts = route(every, sizes, world, kernel)  # counts: (dest, table)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # now (source, table)
    recv_matrix = recv_counts.view(world, n_tables)
    send_per_rank = counts.view(world, n_tables).sum(1).tolist()
    recv_per_rank = recv_matrix.sum(1).tolist()
    received = _exchange(send, send_per_rank, recv_per_rank, group)

    # per table, the requests of rank 0 first, then rank 1, ...: received's (source, table)
    # blocks become (table, source) ones
    mine_sizes = recv_matrix.sum(0).tolist()
    many = transform_many([t.local for t in tables], transpose_blocks(received, recv_matrix, kernel), mine_sizes,
                          pin, [t.offset for t in tables])
    if many.error is not None:  # answer anyway (-2: refused), or the other ranks would hang
        for block, error in zip(torch.split(many.slots, mine_sizes), many.errors):
            if error is not None:
                block.fill_(-2)
    answers = transpose_blocks(many.slots, recv_matrix.t(), kernel)  # back to (source, table) blocks
    answered = _exchange(answers, recv_per_rank, send_per_rank, group)
    if many.error is not None:
        raise many.error
    if answered.numel() and int(answered.min()) == -2:  # (slots are >= -2: min is the cheaper test)
        raise RuntimeError("the owner of some of this batch's IDs refused the batch (see that rank's error)")
    flat_slots = answered.index_select(0, position)  # (faster than answered[position] on CPU)
    return flat_slots, _results(flat_slots, sizes, many.results, pin)


def _results(flat_slots: torch.Tensor, sizes: list[int], owned: list[TransformResult],
             pin: bool) -> list[ShardedTransformResult]:
    return [ShardedTransformResult(slots, out, out.distinct_slots if pin else None)
            for slots, out in zip(torch.split(flat_slots, sizes), owned)]
