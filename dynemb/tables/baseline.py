"""A full-table baseline that starts where dynamic tables start: for comparing a job with
dynamic tables against the same model with every ID in plain TorchRec tables.

    full = shard_model(FullModel(), tables)   # num_embeddings: every ID (IDs 0..N-1 are rows 0..N-1)
    start_full_tables(full, tables)           # each row as the store hands out a never-seen ID
    # the same batches, the same seed: the two jobs' losses agree (docs/library.md)

A dynamic table's never-seen ID starts from its PS table's initializer (TableConfig.schema),
drawn from a seed and the ID, so the baseline's row of ID k is that same draw, and its
optimizer state starts as the store starts it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dynemb.ps_server.initializer import initial_rows
from dynemb.tables.config import TableConfig
from dynemb.tables.errors import SetupError
from dynemb.tables.table_rows import find_tables


def start_full_tables(model: nn.Module, tables: Sequence[TableConfig]) -> None:
    """Write this rank's rows of each table of `tables` in a sharded full model (one row per ID:
    row k holds ID k) as a dynamic table of that config starts ID k, with its optimizer state.
    Not collective: each rank writes its own block.

    Args:
        model: the full model under DistributedModelParallel (fused kernel, e.g. shard_model).
        tables: the configs the dynamic job uses (their initializers).

    Raises:
        SetupError: a config names no table of the model.
    """
    found = find_tables(model)
    for config in tables:
        rows = found.get(config.name)
        if rows is None:
            raise SetupError(f"no table {config.name!r} in the full model; its tables: {', '.join(found)}")
        schema = config.schema(rows.dim, rows.state_width)
        ids = torch.arange(rows.row_offset, rows.row_offset + rows.local_rows)
        start = torch.from_numpy(initial_rows(schema, ids.numpy()))
        rows.write(torch.arange(rows.local_rows), start)
