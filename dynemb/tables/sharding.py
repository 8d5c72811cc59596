"""How a model's dynamic tables must be sharded, and a one-call DistributedModelParallel for it.

Dynamic tables need each table row-wise sharded with the FUSED compute kernel: each rank then
holds one contiguous block of a table's rows (the slots of the IDs it owns), and the optimizer
runs inside the embedding backward, so its state sits beside the rows where dynemb reads and
writes it. TorchRec's planner does that when asked through constraints; its
EmbeddingBagCollectionSharder leaves row-wise out of what it offers on CPU (it works there:
docs/design.md), so the sharders here add it.

    model = shard_model(model, ["user", "item"], device)          # DMP, the dynamic tables row-wise
    # or with a planner of your own:
    planner = EmbeddingShardingPlanner(topology, constraints=constraints(["user", "item"]))
    plan = planner.collective_plan(model, sharders())
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders())
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingType

from dynemb.tables.config import TableConfig


class RowWiseSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EmbeddingBagCollection sharder, row-wise offered on CPU too (TorchRec offers it
    on CUDA already, and this adds nothing there)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's sharding types for the device, row-wise added."""
        types = super().sharding_types(compute_device_type)
        return types if ShardingType.ROW_WISE.value in types else [*types, ShardingType.ROW_WISE.value]


class RowWiseSequenceSharder(EmbeddingCollectionSharder):
    """TorchRec's EmbeddingCollection sharder, row-wise offered wherever it is not already."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's sharding types for the device, row-wise added."""
        types = super().sharding_types(compute_device_type)
        return types if ShardingType.ROW_WISE.value in types else [*types, ShardingType.ROW_WISE.value]


def sharders() -> list[ModuleSharder[nn.Module]]:
    """The sharders a model with dynamic tables is planned and wrapped with (EmbeddingBagCollection
    and EmbeddingCollection, row-wise offered on every device)."""
    return [RowWiseSharder(), RowWiseSequenceSharder()]


def constraints(tables: Iterable[TableConfig | str]) -> dict[str, ParameterConstraints]:
    """Planner constraints that shard each dynamic table row-wise with the FUSED kernel.

    Args:
        tables: the dynamic tables (their configs or TorchRec table names).

    Returns:
        {table name: ParameterConstraints}, to merge into a planner's own constraints.
    """
    return {
        (t.name if isinstance(t, TableConfig) else t): ParameterConstraints(
            sharding_types=[ShardingType.ROW_WISE.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for t in tables
    }


def shard_model(
    model: nn.Module,
    tables: Iterable[TableConfig | str],
    device: torch.device | str = "cpu",
    other_constraints: dict[str, ParameterConstraints] | None = None,
) -> DistributedModelParallel:
    """The model under DistributedModelParallel, its dynamic tables sharded row-wise and fused.

    Collective: every rank calls it. The model's embedding modules should be made on the "meta"
    device and have their fused optimizer applied (torchrec's apply_optimizer_in_backward)
    before; the other tables are planned as TorchRec's planner chooses (or as
    `other_constraints` say).

    Args:
        model: the unsharded model.
        tables: its dynamic tables (configs or TorchRec table names).
        device: this rank's device.
        other_constraints: planner constraints of the model's other tables.

    Returns:
        The sharded model.
    """
    device = torch.device(device)
    wanted = {**(other_constraints or {}), **constraints(tables)}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device=device.type), constraints=wanted
    )
    plan = planner.collective_plan(model, sharders(), dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders())
