"""The layouts of a sharded transform's exchange (sharded.py): which rank each ID goes to, and
in which order.

    send, position, counts = route(ids, sizes, world, kernel=True)
    # ids: the tables' IDs end to end (table t's are the sizes[t] after those of 0..t-1)
    # send: for destination rank 0, table 0's IDs it owns, then table 1's, ..., then for
    #   rank 1...; within a (rank, table) bucket in the order of ids
    # position: where each of ids is in send (send[position] == ids), so answers in the
    #   layout of send come back to that of ids by a gather, answers[position]
    # counts: (world * len(sizes),) bucket sizes, rank-major
    mine = transpose_blocks(received, recv_counts)    # (source, table) blocks -> (table, source)
    back = transpose_blocks(mine, recv_counts.t())    # and back

An ID's owner is hashing.owner_of (xxh64(id) % world, the PS client's sharding). On CPU the
compiled kernel does each in one or two passes (csrc/route.cpp); the torch-ops versions (CUDA,
or tables on the torch backend) give the same results and are the reference the tests hold the
kernel to.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dynemb.idtransformer.hashing import owner_of
from dynemb.idtransformer.kernel import ops


class Routed(NamedTuple):
    """The send layout of int64 IDs laid out in blocks (see the module)."""

    send: torch.Tensor  # the IDs by (destination rank, table) bucket
    position: torch.Tensor  # where each ID is in send
    counts: torch.Tensor  # (world * tables,) bucket sizes, rank-major


def route(ids: torch.Tensor, sizes: list[int], world: int, kernel: bool) -> Routed:
    """Args: ids (int64), laid out in blocks of `sizes`, one per table; world: the ranks; kernel:
    the compiled kernel (CPU), else torch ops. Returns: their Routed layout (see the module)."""
    if kernel:
        out = ops().route(ids, sizes, world)
        return Routed(out.send, out.position, out.counts)
    return route_torch(ids, sizes, world)


def route_torch(ids: torch.Tensor, sizes: list[int], world: int) -> Routed:
    """route() in torch ops (any device)."""
    n_tables = len(sizes)
    # (output_size and index_add_ rather than bincount: sizes known on the host, no sync on CUDA)
    table_of = torch.repeat_interleave(
        torch.arange(n_tables, device=ids.device),
        torch.tensor(sizes, dtype=torch.int64, device=ids.device),
        output_size=ids.numel(),
    )
    bucket = owner_of(ids, world) * n_tables + table_of  # (destination, table); one hash call for all
    order = torch.argsort(bucket, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=ids.device)
    counts = torch.zeros(world * n_tables, dtype=torch.int64, device=ids.device)
    return Routed(ids[order], position, counts.index_add_(0, bucket, torch.ones_like(bucket)))


def transpose_blocks(x: torch.Tensor, counts: torch.Tensor, kernel: bool) -> torch.Tensor:
    """x (1-D) laid out in blocks (r, c) row after row, counts[r][c] elements each (counts 2-D
    int64), laid out column after column: (0, 0), (1, 0), ..., (0, 1), (1, 1), ..."""
    if kernel:
        return ops().transpose_blocks(x, counts)
    return transpose_blocks_torch(x, counts)


def transpose_blocks_torch(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """transpose_blocks() in torch ops (any device)."""
    # within a column the blocks already come in row order: a stable sort by column does it
    rows, cols = counts.shape
    column = torch.arange(cols, device=x.device).repeat(rows)
    column = column.repeat_interleave(counts.reshape(-1).to(x.device), output_size=x.numel())
    return x[torch.argsort(column, stable=True)]
