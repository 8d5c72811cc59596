"""What the client's calls return: `PullResult` (a pull's rows) and `TableInfo` (a table's schema and size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import TableSchema


class LastSweep(NamedTuple):
    """A PS's last sweep of a table (sweeper.py): when it ended (Unix seconds), how long it
    took, the rows it looked at and deleted, and the rows still over the cap (all in use)."""

    finished: float
    seconds: float
    scanned: int
    deleted: int
    rows_over_cap: int

    @classmethod
    def from_proto(cls, msg: ps_pb2.LastSweep) -> LastSweep | None:
        if not msg.finished:
            return None
        return cls(msg.finished, msg.seconds, msg.scanned, msg.deleted, msg.rows_over_cap)


@dataclass(frozen=True)
class TableInfo:
    """A table's schema and its rows on the PSes asked (summed over shards).

    Attributes:
        schema: the schema (expected_rows summed over the shards).
        num_rows: rows stored, summed over the shards.
        lifecycle: when its rows expire (Lifecycle(): never); max_rows summed over the shards.
        last_sweep: the latest sweep of it over the shards (DescribeTable only; None: none yet).
        expired_reads: rows the PSes' pulls found expired, since they started (DescribeTable only).
        change_log: ids each PS's change log of the table keeps (0: none).
    """

    schema: TableSchema
    num_rows: int
    lifecycle: Lifecycle = Lifecycle()
    last_sweep: LastSweep | None = None
    expired_reads: int = 0
    change_log: int = 0

    @classmethod
    def from_proto(cls, msg: ps_pb2.TableInfo) -> TableInfo:
        """The TableInfo of a ps_pb2.TableInfo message."""
        return cls(
            TableSchema.from_proto(msg.spec),
            msg.num_rows,
            Lifecycle.from_proto(msg.spec.lifecycle),
            LastSweep.from_proto(msg.last_sweep),
            msg.expired_reads,
            msg.spec.change_log,
        )


@dataclass
class PullResult:
    """A pull's rows in the order of its ids.

    Attributes:
        rows: (n, dim + state_width), the table's dtype (bf16 as uint16 bits).
        missing: (n,) bool: ids never pushed, whose rows come initialised.
        dim: the table's embedding width.
    """

    rows: np.ndarray
    missing: np.ndarray
    dim: int

    @property
    def embeddings(self) -> np.ndarray:
        """The first dim columns of rows (a view)."""
        return self.rows[:, : self.dim]

    @property
    def state(self) -> np.ndarray:
        """The columns after dim: the optimizer state (a view)."""
        return self.rows[:, self.dim :]
