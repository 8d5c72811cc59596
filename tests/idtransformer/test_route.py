"""The kernel's routing ops (csrc/route.cpp) against their torch-ops references in
dynemb/idtransformer/route.py: the same send order, permutation and counts, and the same
regrouping of blocks, on random inputs with empty tables, one to five ranks and IDs anywhere in
int64."""

from __future__ import annotations

import pytest
import torch

from dynemb.idtransformer.hashing import owner_of
from dynemb.idtransformer.route import route, route_torch, transpose_blocks, transpose_blocks_torch

EDGES = [0, -1, 1, 2**63 - 1, -(2**63), 2**62, -(2**40) + 7]


def _ids(gen: torch.Generator, n: int) -> torch.Tensor:
    """Small IDs (repeats), any int64 (negative, huge) and the edges of the range."""
    small = torch.randint(-50, 50, (n,), generator=gen)
    wide = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)
    edges = torch.tensor(EDGES)[torch.randint(0, len(EDGES), (n,), generator=gen)]
    pick = torch.randint(0, 3, (n,), generator=gen)
    return torch.where(pick == 0, small, torch.where(pick == 1, wide, edges))


def _sizes(gen: torch.Generator, n_tables: int) -> list[int]:
    """Block sizes, about a third of them empty."""
    sizes = torch.randint(0, 60, (n_tables,), generator=gen)
    return torch.where(torch.rand(n_tables, generator=gen) < 0.3, 0, sizes).tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_route_matches_the_torch_reference(world):
    gen = torch.Generator().manual_seed(world)
    for case in range(40):
        n_tables = int(torch.randint(1, 30, (1,), generator=gen))
        sizes = _sizes(gen, n_tables)
        ids = _ids(gen, sum(sizes))
        send, position, counts = route(ids, sizes, world, kernel=True)
        want_send, want_position, want_counts = route_torch(ids, sizes, world)
        assert torch.equal(position, want_position), (world, case)
        assert torch.equal(send, want_send), (world, case)
        assert torch.equal(counts, want_counts), (world, case)
        # and what that means: send holds ids, each bucket its table's IDs that its rank owns,
        # in their order in ids
        assert torch.equal(send[position], ids)
        order = torch.argsort(position)
        table = torch.repeat_interleave(torch.arange(n_tables), torch.tensor(sizes, dtype=torch.int64))
        bucket = owner_of(ids, world) * n_tables + table
        assert torch.equal(bucket[order], torch.sort(bucket).values)
        assert (order.diff()[bucket[order].diff() == 0] > 0).all()
        assert torch.equal(counts, torch.bincount(bucket, minlength=world * n_tables))


def test_route_of_nothing():
    for sizes, world in [([], 2), ([0, 0, 0], 4), ([0], 1)]:
        send, position, counts = route(torch.zeros(0, dtype=torch.int64), sizes, world, kernel=True)
        assert send.numel() == position.numel() == 0
        assert torch.equal(counts, torch.zeros(world * len(sizes), dtype=torch.int64))


def test_route_refuses_sizes_that_do_not_fit():
    with pytest.raises(RuntimeError, match="add up to 3, not to the 4 ids"):
        route(torch.arange(4), [1, 2], 2, kernel=True)
    with pytest.raises(RuntimeError, match="negative"):
        route(torch.arange(4), [5, -1], 2, kernel=True)
    with pytest.raises(RuntimeError, match="world size"):
        route(torch.arange(4), [4], 0, kernel=True)


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 7), (2, 26), (4, 3), (5, 1)])
def test_transpose_blocks_matches_the_torch_reference_and_undoes_itself(rows, cols):
    gen = torch.Generator().manual_seed(rows * 100 + cols)
    for _ in range(20):
        counts = torch.randint(0, 9, (rows, cols), generator=gen)
        counts[torch.rand(rows, cols, generator=gen) < 0.3] = 0
        x = _ids(gen, int(counts.sum()))
        got = transpose_blocks(x, counts, kernel=True)
        assert torch.equal(got, transpose_blocks_torch(x, counts))
        assert torch.equal(transpose_blocks(got, counts.t(), kernel=True), x)
        assert torch.equal(transpose_blocks_torch(got, counts.t()), x)


def test_transpose_blocks_refuses_counts_that_do_not_fit():
    with pytest.raises(RuntimeError, match="add up to 6, not to the 5 elements"):
        transpose_blocks(torch.arange(5), torch.tensor([[1, 2], [3, 0]]), kernel=True)
    with pytest.raises(RuntimeError, match="negative"):
        transpose_blocks(torch.arange(1), torch.tensor([[2, -1]]), kernel=True)
