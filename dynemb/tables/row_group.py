"""Rows of several tables read and written together: one gather and one scatter for all.

A step's row moves touch every dynamic table (evicted rows out, admitted rows in). TorchRec
puts tables of one kind in one FBGEMM TBE, whose tables' weights and optimizer states are
views of one flat storage each (split_embedding_weights, split_optimizer_states). When every
table's weights, and each of its states, are such views of one width, RowGroup indexes each
storage once for all tables, instead of a small gather or scatter per table and state with
its Python around it. Otherwise (tables in several TBEs, different dims, Adam's moments on
CPU, which are tensors of their own) it goes table by table through TableRows: the same
rows either way.

    group = RowGroup([rows_a, rows_b])
    data = group.read(slots, [2, 3])      # slots: 2 table rows of a, then 3 of b
    group.write(slots, [2, 3], data)      # data: per table, (n, dim + state width) float32

Rows are read on the tables' device, and written from any (row_moves.py moves them to and from
the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dynemb.tables.table_rows import TableRows


@dataclass
class _Flat:
    whole: torch.Tensor  # (storage rows, k): the storage all the tables' views are part of
    shift: np.ndarray  # per table: its table row r is row r + shift[t] of whole

    def rows(self, slots: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The rows of `whole` at `slots`, counts[t] of them table t's, after those of the tables
        before it (numpy's repeat: a third of the time of torch's repeat_interleave here)."""
        shift = torch.from_numpy(np.repeat(self.shift, counts))
        if slots.is_cuda:  # from pinned memory: the copy does not hold the host up (nor sync the device)
            shift = shift.pin_memory().to(slots.device, non_blocking=True)
        return slots + shift


def _flat(views: list[torch.Tensor], row_offsets: list[int]) -> _Flat | None:
    """One view over the storage that all `views` ((rows, k) each, row-major) are part of, or
    None where they are not all such views of one storage."""
    first = views[0]
    k = first.shape[1]
    base, phase = first.untyped_storage().data_ptr(), first.storage_offset() % k  # whole's row 0 starts at phase
    for v in views:
        if (
            v.dim() != 2
            or v.shape[1] != k
            or v.dtype != first.dtype
            or v.stride() != (k, 1)
            or v.untyped_storage().data_ptr() != base
            or v.storage_offset() % k != phase
        ):
            return None
    n = (first.untyped_storage().nbytes() // first.element_size() - phase) // k
    # .data: writes through `whole` leave the TBE's version counter alone (see TableRows.write)
    whole = first.data.as_strided((n, k), (k, 1), phase)
    shift = np.array(
        [(v.storage_offset() - phase) // k - offset for v, offset in zip(views, row_offsets)], dtype=np.int64
    )
    return _Flat(whole, shift)


class RowGroup:
    """Several tables' rows read and written together (see the module doc).

    Args:
        tables: the tables, in the order read and write take their slots.
    """

    def __init__(self, tables: list[TableRows]) -> None:
        self.tables = tables
        self.flats: list[_Flat] | None = None
        if tables and len({t.dim for t in tables}) == 1 and len({len(t.states) for t in tables}) == 1:
            offsets = [t.row_offset for t in tables]
            flats = [_flat([t.weights for t in tables], offsets)]
            flats += [_flat([t.states[j] for t in tables], offsets) for j in range(len(tables[0].states))]
            found = [f for f in flats if f is not None]
            if len(found) == len(flats):
                self.flats = found

    @property
    def shared(self) -> bool:
        """Whether one gather or scatter per storage serves every table."""
        return self.flats is not None

    def read(self, slots: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Per table, the (counts[t], dim + state width) float32 rows at its table rows, which
        are the counts[t] of `slots` after those of the tables before it."""
        if self.flats is None:
            return [t.read(s - t.row_offset) for t, s in zip(self.tables, torch.split(slots, counts))]
        with torch.no_grad():
            # index_select into one preallocated block: about half the time of advanced indexing
            data = torch.empty(len(slots), sum(f.whole.shape[1] for f in self.flats), device=self.flats[0].whole.device)
            at = 0
            for f in self.flats:
                k = f.whole.shape[1]
                data[:, at : at + k] = f.whole.index_select(0, f.rows(slots, counts))
                at += k
        return list(torch.split(data, counts))

    def write(self, slots: torch.Tensor, counts: list[int], rows: list[np.ndarray | torch.Tensor | None]) -> None:
        """Write rows[t] (None where counts[t] is 0) at table t's rows in `slots` (as read)."""
        given: list[torch.Tensor] = []
        for i, (r, n) in enumerate(zip(rows, counts)):
            if n:
                if r is None:
                    raise ValueError(f"RowGroup.write: rows[{i}] is None, but counts[{i}] is {n}")
                given.append(_tensor(r))
        if self.flats is None:
            parts = iter(given)
            for t, s, n in zip(self.tables, torch.split(slots, counts), counts):
                if n:
                    t.write(s - t.row_offset, next(parts))
            return
        if not given:
            return
        data = torch.cat(given).to(self.flats[0].whole.device)
        with torch.no_grad():
            at = 0
            for f in self.flats:
                k = f.whole.shape[1]
                f.whole.index_copy_(0, f.rows(slots, counts), data[:, at : at + k].to(f.whole.dtype))
                at += k


def _tensor(rows: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows, np.float32)) if isinstance(rows, np.ndarray) else rows
