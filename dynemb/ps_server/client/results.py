"""What the client's calls return: `PullResult` (a pull's rows) and `TableInfo` (a table's schema and size)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server.schema import TableSchema


@dataclass(frozen=True)
class TableInfo:
    """A table's schema and its rows on the PSes asked (summed over shards)."""

    schema: TableSchema
    num_rows: int

    @classmethod
    def from_proto(cls, msg: ps_pb2.TableInfo) -> TableInfo:
        """The TableInfo of a ps_pb2.TableInfo message."""
        return cls(TableSchema.from_proto(msg.spec), msg.num_rows)


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
