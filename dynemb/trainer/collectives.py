"""all_gather of tensors whose last dimension differs from rank to rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dynemb.tables import collective_device


def all_gather_ragged(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's `t`, in rank order. Shapes may differ in the last dimension only; the
    tensors travel padded to the longest (all_gather wants equal shapes), on the group's device
    (the CPU on gloo, the GPU on NCCL), where they come back."""
    world = dist.get_world_size(group)
    device = collective_device(group)  # NCCL's collectives take GPU tensors, gloo's CPU ones
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([t.shape[-1]], device=device), group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(*t.shape[:-1], width, dtype=t.dtype, device=device)
    padded[..., : t.shape[-1]] = t
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [g[..., : int(s.item())] for g, s in zip(gathered, sizes)]
