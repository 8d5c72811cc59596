"""RowGroup: several tables' rows read and written in one gather/scatter per storage, where the
tables are views of one storage as in an FBGEMM TBE, gives what TableRows gives table by table."""

from __future__ import annotations

import numpy as np
import torch

from dynemb.tables.row_group import RowGroup
from dynemb.tables.table_rows import TableRows

DIM = 4
SIZES, OFFSETS = [5, 7, 3], [10, 0, 3]  # local rows and where each table's block starts


def _tbe_like(seed: int, separate: bool = False) -> list[TableRows]:
    """Three tables whose weights and row-wise state are consecutive views of one flat
    weight storage and one state storage (with a gap, as a TBE's offsets may leave), or with
    separate: the second table's weights a tensor of its own."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(2 + sum(SIZES) * DIM, generator=gen)[2:]  # not at the storage's start
    state = torch.rand(sum(SIZES) + 1, generator=gen)
    tables, at = [], 0
    for k, (rows, offset) in enumerate(zip(SIZES, OFFSETS)):
        w = weights[at * DIM : (at + rows) * DIM].view(rows, DIM)
        if separate and k == 1:
            w = w.clone()
        tables.append(TableRows(f"t{k}", w, [state[1 + at : 1 + at + rows].view(-1, 1)], offset))
        at += rows
    return tables


def test_a_shared_storage_is_read_and_written_as_table_by_table():
    gen = torch.Generator().manual_seed(3)
    slots = [torch.randperm(n, generator=gen)[: n - 1] + off for n, off in zip(SIZES, OFFSETS)]
    counts = [len(s) for s in slots]
    every = torch.cat(slots)
    for separate in (False, True):
        group, alone = RowGroup(_tbe_like(1, separate)), _tbe_like(1, separate)
        assert group.shared is not separate
        got = group.read(every, counts)
        for t, s, g in zip(alone, slots, got):
            assert torch.equal(g, t.read(s - t.row_offset))
        new = [np.random.default_rng(k).random((n, DIM + 1), dtype=np.float32) for k, n in enumerate(counts)]
        group.write(every, counts, new)
        for t, s, r in zip(alone, slots, new):
            t.write(s - t.row_offset, torch.from_numpy(r))
        for g, t in zip(group.tables, alone):
            assert torch.equal(g.weights, t.weights) and torch.equal(g.states[0], t.states[0])


def test_a_table_with_nothing_to_move_is_skipped():
    group, alone = RowGroup(_tbe_like(2)), _tbe_like(2)
    rows = torch.tensor([10, 12, 3])  # table 0's rows 0 and 2, none of table 1, table 2's row 0
    group.write(rows, [2, 0, 1], [np.ones((2, DIM + 1), np.float32), None, np.zeros((1, DIM + 1), np.float32)])
    alone[0].write(torch.tensor([0, 2]), torch.ones(2, DIM + 1))
    alone[2].write(torch.tensor([0]), torch.zeros(1, DIM + 1))
    for g, t in zip(group.tables, alone):
        assert torch.equal(g.weights, t.weights) and torch.equal(g.states[0], t.states[0])
    assert [len(x) for x in group.read(rows, [2, 0, 1])] == [2, 0, 1]
