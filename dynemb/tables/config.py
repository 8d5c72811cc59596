"""One dynamic table's settings: how IDs are evicted and admitted, and its table on the PS."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from dynemb.idtransformer.policy import POLICIES, EvictionPolicy
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import Initializer, TableSchema, check_name

STARTS = ("new", "warm", "fresh", "resume")


@dataclass(frozen=True)
class TableConfig:
    """How one TorchRec table of the model becomes dynamic.

    The table's `num_embeddings` (EmbeddingBagConfig / EmbeddingConfig) is its capacity: the
    rows kept on the devices, split evenly over the ranks. Its rows' width and optimizer state
    come from the model (the fused optimizer applied to it), not from here.

    Args:
        name: the TorchRec table's name (EmbeddingBagConfig.name).
        policy: which resident IDs leave first when the table is full: "lru", "lfu" or "hybrid"
            (LFU with decay by idle time; dynemb/idtransformer/policy.py).
        evict_fraction: share of the table freed at once when it is full (the CPU kernel; on a
            GPU the map frees one slot of the ID's bucket per new ID, see docs/idtransformer.md).
        ttl_steps: IDs idle for more steps than this are evicted before any other (None: no TTL).
        admit_threshold: sightings an ID needs before it gets a row (1: at once); IDs below it
            are left out of their bags.
        ps_table: its table on the PS or embedded store (default: `name`, after
            DynamicEmbeddings' table_prefix).
        initializer: the row a never-seen ID starts from (default: uniform in +-1/sqrt(dim),
            seeded by the table's name).
        expected_rows: how many rows the PS table will hold, a sizing hint for Redis (0: unknown).
        capacity: if given, checked against the model's num_embeddings for the table.
        lifecycle: when its rows leave the PS (TTL, row cap: dynemb.ps_server.lifecycle), set on
            the PS table at start; None leaves the PS table's as it is. Rows resident on the
            devices are in use: the job touches them on the PS every touch interval.

    Raises:
        ValueError: a setting out of its range, named with the limit.
    """

    name: str
    policy: str = "lru"
    evict_fraction: float = 0.05
    ttl_steps: int | None = None
    admit_threshold: int = 1
    ps_table: str = ""
    initializer: Initializer | None = None
    expected_rows: int = 0
    capacity: int | None = None
    lifecycle: Lifecycle | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"table {self.name}: policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.admit_threshold < 1:
            raise ValueError(f"table {self.name}: admit_threshold must be >= 1 (sightings), got {self.admit_threshold}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"table {self.name}: capacity must be >= 1 rows, got {self.capacity}")
        if self.ps_table:
            check_name(self.ps_table, "ps_table")
        if self.lifecycle is not None:
            self.lifecycle.checked(self.name)
        self.eviction()  # checks evict_fraction and ttl_steps

    def eviction(self) -> EvictionPolicy:
        """The ID transformer's eviction policy for this table."""
        return EvictionPolicy(self.policy, evict_fraction=self.evict_fraction, ttl_steps=self.ttl_steps)

    def schema(self, dim: int, state_width: int, prefix: str = "") -> TableSchema:
        """Its PS table for rows `dim` wide with `state_width` optimizer values (the model's)."""
        name = prefix + (self.ps_table or self.name)
        scale = 1.0 / math.sqrt(dim)
        init = self.initializer or Initializer("uniform", -scale, scale, seed=zlib.crc32(self.name.encode()))
        return TableSchema(name, dim, state_width, "fp32", init, expected_rows=self.expected_rows)
