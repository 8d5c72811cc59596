"""The tables of a job as its settings size them, and their PS schemas (no TorchRec here: the
plain model, plain.py, uses them too)."""

from __future__ import annotations

import math

from dynemb.ps_server.schema import MAX_EXPECTED_ROWS, Initializer, TableSchema, optimizer_state_width
from dynemb.trainer.config import TrainConfig, table_name


def table_rows_total(cfg: TrainConfig, world_size: int, name: str) -> int:
    """Rows of a table across all ranks: for a full table its capacity if given, else the
    universe; for a dynamic one its capacity, rounded up to equal blocks per rank."""
    t = cfg.table_config(name)
    if not t.dynamic:
        return t.capacity or cfg.data.universe
    cap = t.capacity or math.ceil(cfg.data.universe * t.capacity_fraction)
    per_rank = max(1, math.ceil(cap / world_size))
    return per_rank * world_size


def ps_schema(cfg: TrainConfig, feature: int) -> TableSchema:
    """The PS schema of table t_<feature>: fp32, uniform in ±init_scale (default 1/sqrt(dim)),
    expected to hold the feature's ID universe (every ID ever seen has a row on the PS; 0 when
    not known: the store's default layout)."""
    scale = cfg.table_config(table_name(feature)).init_scale or 1.0 / math.sqrt(cfg.table.dim)
    return TableSchema(
        name=cfg.ps_table_prefix + table_name(feature),
        dim=cfg.table.dim,
        state_width=optimizer_state_width(cfg.optimizer, cfg.table.dim),
        dtype="fp32",
        initializer=Initializer("uniform", -scale, scale, seed=cfg.seed * 1000 + feature),
        expected_rows=min(cfg.data.universe, MAX_EXPECTED_ROWS),
    )
