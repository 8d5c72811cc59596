"""Rows of a sharded TorchRec table, with their optimizer state, read and written in batches.

DistributedModelParallel with the FUSED compute kernel keeps each rank's shard of a table in
an FBGEMM TBE (SplitTableBatchedEmbeddingBagsCodegen); `split_embedding_weights()` and
`split_optimizer_states()` are views of its storage, one per table. TableRows gathers, for
one table, this rank's weight view (local_rows, dim), its optimizer-state views and where
its block starts in the table (row-wise sharding: one contiguous block per rank). A PS row
is the embedding followed by the optimizer state flattened (Adagrad: dim momentum values;
row-wise Adagrad: one; Adam: m then v, dim each; SGD: none).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class TableRows:
    """One table's rows on this rank: its weight view, optimizer-state views and first table row."""

    name: str
    weights: torch.Tensor  # (local_rows, dim)
    states: list[torch.Tensor]  # each (local_rows, k)
    row_offset: int  # the table row of local row 0

    @property
    def dim(self) -> int:
        """The embedding width."""
        return self.weights.shape[1]

    @property
    def local_rows(self) -> int:
        """Rows of the table on this rank."""
        return self.weights.shape[0]

    @property
    def state_width(self) -> int:
        """Optimizer-state values per row, over every state view."""
        return sum(s.shape[1] for s in self.states)

    def read(self, local: torch.Tensor) -> torch.Tensor:
        """(n, dim + state_width) float32 rows at local row indices, on the table's device."""
        local = local.to(self.weights.device)
        with torch.no_grad():
            return torch.cat([self.weights[local].float()] + [s[local].float() for s in self.states], dim=1)

    def write(self, local: torch.Tensor, rows: torch.Tensor) -> None:
        """Written through .data, which autograd does not version: a transform thread
        (dynemb/tables/prefetch.py) writes rows while a batch's forward and backward are under way,
        and the TBE's backward would refuse a weights tensor changed since its forward. The
        rows written are never the batch's own (those slots are pinned), so its gradient is
        the same."""
        local, rows = local.to(self.weights.device), rows.to(self.weights.device)
        with torch.no_grad():
            self.weights.data[local] = rows[:, : self.dim].to(self.weights.dtype)
            at = self.dim
            for s in self.states:
                s.data[local] = rows[:, at : at + s.shape[1]].to(s.dtype)
                at += s.shape[1]


def sharded_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The sharded EmbeddingBagCollection and EmbeddingCollection modules inside `model`."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return (m for m in model.modules() if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)))


def embedding_kernels(model: nn.Module) -> Iterator[Any]:
    """Each group of tables of those modules that one kernel serves (its `config` names the
    tables; a FUSED one holds its FBGEMM TBE as `emb_module`)."""
    for module in sharded_modules(model):
        lookups: Any = module._lookups  # TorchRec's internals (untyped)
        for lookup in lookups:
            yield from getattr(lookup, "module", lookup)._emb_modules  # a DDP-wrapped lookup (data-parallel tables)


def table_configs(model: nn.Module) -> dict[str, Any]:
    """The EmbeddingBagConfig / EmbeddingConfig each table of those modules was made from, by
    table name (TorchRec keeps them on the sharded module, not publicly)."""
    configs: dict[str, Any] = {}
    for module in sharded_modules(model):
        kept = getattr(module, "_embedding_bag_configs", None) or getattr(module, "_embedding_configs", None) or []
        configs.update((c.name, c) for c in kept)
    return configs


def find_tables(model: nn.Module) -> dict[str, TableRows]:
    """Every fused-kernel table of the sharded embedding modules (EmbeddingBagCollection and
    EmbeddingCollection) inside `model`, by name."""
    found: dict[str, TableRows] = {}
    for emb in embedding_kernels(model):
        tbe = getattr(emb, "emb_module", None)
        if tbe is None or not hasattr(tbe, "split_optimizer_states"):
            raise TypeError(f"table group {emb.config.embedding_names} does not use the FUSED compute kernel")
        weights = tbe.split_embedding_weights()
        adam = getattr(tbe, "dynemb_adam", None)  # Adam on CPU: dynemb/tables/sparse_adam.py
        states = adam.states if adam is not None else tbe.split_optimizer_states()
        for k, table in enumerate(emb.config.embedding_tables):
            offset = table.local_metadata.shard_offsets[0] if table.local_metadata is not None else 0
            st = [s if s.dim() == 2 else s.view(-1, 1) for s in (states[k] if k < len(states) else [])]
            found[table.name] = TableRows(table.name, weights[k], st, int(offset))
    return found


# FBGEMM's optimizer of a fused table, by the PS's name of it (what a row's optimizer state is)
_OPTIMIZERS = {
    "exact_sgd": "sgd",
    "sgd": "sgd",
    "exact_adagrad": "adagrad",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
    "adam": "adam",
}


def fused_optimizer(model: nn.Module) -> str:
    """The optimizer fused into the tables of the sharded embedding modules in `model`, by the
    name the PS and checkpoints give it (sgd, adagrad, rowwise_adagrad, adam; another of
    FBGEMM's by its own name). Adam on FBGEMM's CPU tables (RowSparseAdam) is adam.

    Raises:
        ValueError: the tables run different optimizers, or there is no fused table.
    """
    names = set()
    for emb in embedding_kernels(model):
        tbe = getattr(emb, "emb_module", None)
        if tbe is None or not hasattr(tbe, "optimizer"):
            continue
        kind = str(getattr(tbe.optimizer, "value", tbe.optimizer))
        names.add("adam" if getattr(tbe, "dynemb_adam", None) is not None else _OPTIMIZERS.get(kind, kind))
    if len(names) != 1:
        raise ValueError(f"the model's fused tables run {sorted(names) or 'no optimizer'}: expected one")
    return names.pop()
