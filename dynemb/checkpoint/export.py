"""Every row of a job's dynamic tables, written as table folders (table_files.py) for serving or
another job: from a PS the ranks share, or from the embedded stores each rank keeps of its own
IDs (gathered at rank 0, chunk by chunk: no rank holds more than a chunk of another's).

    export_tables(dyn, "out/tables")        # collective; out/tables/<table>/table.json + shards
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from tqdm import tqdm

from dynemb.checkpoint.table_files import DEFAULT_ROWS_PER_SHARD, Manifest, TableWriter
from dynemb.common.names import inside
from dynemb.tables.device import ensure_control_group

if TYPE_CHECKING:
    from dynemb.tables.embeddings import DynamicEmbeddings


def export_tables(
    dynamic: DynamicEmbeddings,
    directory: str | os.PathLike,
    *,
    overwrite: bool = False,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    progress: bool = True,
) -> dict[str, Manifest]:
    """Collective: every row of every dynamic table, with its optimizer state, into
    directory/<TorchRec table name>/ (one table folder each, its schema the PS table's).

    Resident rows are pushed first (flush), so the folders hold what the job has trained.
    Rank 0 writes; the others send it their stores' rows where each rank keeps its own.

    Args:
        dynamic: the job's DynamicEmbeddings.
        directory: where the table folders go.
        overwrite: replace table folders already there.
        rows_per_shard: rows per safetensors file.
        progress: a progress bar on rank 0.

    Returns:
        On rank 0 each table's manifest, by TorchRec table name; {} on the other ranks.
    """
    dynamic.flush()
    group = ensure_control_group()  # gloo beside NCCL: the rows travel as Python objects
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    per_rank = dynamic.store.per_rank and world > 1
    if not per_rank:
        dist.barrier(group=group)  # every rank's resident rows are on the shared store
    out: dict[str, Manifest] = {}
    for name in dynamic.names:
        schema = dynamic.schemas[name]
        mine = dynamic.store.export(schema.name) if (per_rank or rank == 0) else iter(())
        if rank != 0:
            if per_rank:
                _send(mine, group)
            continue
        folder = inside(directory, name)
        source = {"kind": "dynemb.tables", "store": dynamic.store.where, "ranks": world}
        with (
            TableWriter(folder, schema, rows_per_shard=rows_per_shard, source=source, overwrite=overwrite) as w,
            tqdm(unit="row", desc=f"export {name}", disable=not progress) as bar,
        ):
            for ids, rows in _received(mine, group) if per_rank else mine:
                w.write(ids, rows[:, : schema.dim], rows[:, schema.dim :])
                bar.update(len(ids))
        out[name] = w.close()
    return out


def _send(chunks: Any, group: dist.ProcessGroup | None) -> None:
    """A rank's side of _received: one chunk a round (None once it has none left), until rank 0
    says every rank is done."""
    it = iter(chunks)
    while True:
        dist.gather_object(next(it, None), None, dst=0, group=group)
        done: list[Any] = [None]
        dist.broadcast_object_list(done, src=0, group=group)
        if done[0]:
            return


def _received(mine: Any, group: dist.ProcessGroup | None):
    """Rank 0: its own chunks, then each round's chunks from the others, until a round brings
    none (every rank sends None once its rows are all sent)."""
    yield from mine
    world = dist.get_world_size(group)
    while True:
        got: list[Any] = [None] * world
        dist.gather_object(None, got, dst=0, group=group)
        chunks = [c for c in got[1:] if c is not None]
        done: list[Any] = [not chunks]
        dist.broadcast_object_list(done, src=0, group=group)
        yield from chunks
        if done[0]:
            return
