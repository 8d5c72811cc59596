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
slot), and the slots travel back the same way. The slots an owner hands out are rows of its
own block, so with TorchRec's row-wise sharding (equal contiguous blocks) the row of an ID
lives on the rank that owns the ID. Works with any torch.distributed backend that has
all_to_all (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from idtransformer.hashing import owner_of
from idtransformer.policy import EvictionPolicy
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

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.group)
        return recv

    def transform(self, ids: torch.Tensor, pin: bool = False) -> ShardedTransformResult:
        """Collective. ids: this rank's batch (int64, any shape)."""
        if ids.dtype != torch.int64:
            raise TypeError(f"ids must be an int64 tensor, got {ids.dtype}")
        flat = ids.reshape(-1).to(self.device)
        owner = owner_of(flat, self.world_size)
        order = torch.argsort(owner, stable=True)  # grouped by owner, batch order kept within
        send_counts_t = torch.bincount(owner, minlength=self.world_size)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()

        received = self._exchange(flat[order], send_counts, recv_counts)
        # A refused batch (too many distinct IDs, no room) must not leave the other ranks
        # waiting in the next collective: the error travels with the answer (slot -2).
        error = None
        try:
            owned = self.local.transform(received, pin=pin)
            local_slots = owned.slots
        except (ValueError, RuntimeError) as e:
            error = e
            owned = None
            local_slots = torch.full_like(received, -2)
        rows = torch.where(local_slots >= 0, local_slots + self.offset, local_slots)
        answered = self._exchange(rows, recv_counts, send_counts)
        if error is not None:
            raise error
        if bool((answered == -2).any()):
            raise RuntimeError("the owner of some of this batch's IDs refused the batch (see that rank's error)")
        slots = torch.empty_like(flat)
        slots[order] = answered
        owned.slots = rows
        owned.admitted_slots = owned.admitted_slots + self.offset
        owned.evicted_slots = owned.evicted_slots + self.offset
        pinned = torch.unique(local_slots[local_slots >= 0]) if pin else None
        return ShardedTransformResult(slots.reshape(ids.shape), owned, pinned)

    def release(self, result: ShardedTransformResult) -> None:
        """Unpin what this rank pinned for a batch (local: no communication)."""
        if result.pinned is None:
            raise ValueError("this batch was not transformed with pin=True")
        self.local.release(result.pinned)
        result.pinned = None

    def owns(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows >= self.offset) & (rows < self.offset + self.capacity_per_rank)

    def state_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local": self.local.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"state is of rank {state['rank']} of {state['world_size']}, this is rank {self.rank} "
                f"of {self.world_size} (a different world size needs a re-shard: export and re-import)"
            )
        self.local.load_state_dict(state["local"])
