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

import dataclasses
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
from dynemb.tables.errors import SetupError


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
        other_constraints: planner constraints of the model's other tables; one given for a
            dynamic table keeps what it says beside its sharding and kernel, which must allow
            row_wise and fused.

    Returns:
        The sharded model.

    Raises:
        SetupError: other_constraints asks a dynamic table for another sharding or kernel.
    """
    device = torch.device(device)
    wanted = _merged(other_constraints or {}, constraints(tables))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device=device.type), constraints=wanted
    )
    plan = planner.collective_plan(model, sharders(), dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders())


def _merged(
    other: dict[str, ParameterConstraints], dynamic: dict[str, ParameterConstraints]
) -> dict[str, ParameterConstraints]:
    """The planner's constraints: the other tables' as given; a dynamic table's own sharding and
    kernel, beside whatever else a constraint given for it says (refused where it asks for a
    sharding or kernel dynamic tables cannot have, rather than overridden unseen)."""
    merged = dict(other)
    for name, forced in dynamic.items():
        given = merged.get(name)
        if given is None:
            merged[name] = forced
            continue
        types, kernels = given.sharding_types, given.compute_kernels
        row_wise, fused = ShardingType.ROW_WISE.value, EmbeddingComputeKernel.FUSED.value
        if (types and row_wise not in types) or (kernels and fused not in kernels):
            raise SetupError(
                f"other_constraints[{name!r}] asks for sharding types {types} and compute kernels {kernels}, but "
                f"{name} is a dynamic table: they are sharded {row_wise} with the {fused} kernel; leave "
                f"sharding_types and compute_kernels out of its constraints"
            )
        merged[name] = dataclasses.replace(
            given, sharding_types=forced.sharding_types, compute_kernels=forced.compute_kernels
        )
    return merged
