"""What a job checks before it trains, on every rank at once, before it creates its PS tables:

1. with --resume, that the checkpoint is one of a job with these settings (ranks, optimizer,
   tables), from its manifest: a job resumed with another --optimizer hears that, not what
   the PS says of its tables of the other schema;
2. its PS tables as an earlier run left them: a table of the same name with another schema
   is refused (another job's, or this one's with other settings), and rows in them are
   refused too unless the job says what to do with them: --warm-start trains on from them,
   --fresh drops them first, --resume replaces them with the checkpoint's anyway. A rerun
   must not silently start from the embeddings of the last one (and fresh dense layers).

Before both, choose_resume settles what --resume auto means: the newest complete checkpoint in
--checkpoint-dir if there is one (torchrun's elastic restarts then go on from it, at whatever
world size the new rendezvous has), else a start from step 0.

One PS call for all of it (ListTables: each table's schema and rows), made by rank 0 where the
ranks share a PS, by each rank where each keeps its own rows (the embedded store, empty at a
job's start). Every rank raises the same error, so none is left waiting in a collective.

The checkpoint module knows no TrainConfig: checkpoint_settings and checkpointer say what this
job's flags make of it (and which flag a job of another optimizer is told to give).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dynemb import tables as dt
from dynemb.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSettings,
    CheckpointTable,
    check_settings,
    checkpoints,
    data_start,
    read_manifest,
)
from dynemb.trainer.config import TrainConfig, table_name
from dynemb.trainer.schemas import ps_schema

if TYPE_CHECKING:  # types only: model.py loads TorchRec's sharding and models
    from dynemb.trainer.model import Built

log = logging.getLogger("dynemb.trainer")

# what a job resumed with another --optimizer than its checkpoint's is told ({optimizer}: the checkpoint's)
RESUME_OPTIMIZER_HINT = "resume with --optimizer {optimizer}, or start a new run without --resume"

# what the job's refusals name: its flags (dynemb.tables' own messages name the API's arguments)
_WORDS = dt.StartWords(
    warm="--warm-start trains on from them",
    fresh="--fresh drops them first",
    resume="--resume continues from a checkpoint",
    prefix="--ps-table-prefix gives this job tables of its own",
    dropped="--fresh",
    schema_fields=(("dim", "--dim"), ("state_width", "--optimizer"), ("initializer", "--seed, --init-scale")),
)


def choose_resume(cfg: TrainConfig) -> TrainConfig:
    """Collective: cfg with --resume auto made a checkpoint folder (the newest complete one in
    checkpoint_dir, as rank 0 sees it: every rank takes the same) or "" (none yet). Rank 0
    says which, and, where the checkpoint is of another world size, what happens to the rows
    and to the data position."""
    if not cfg.resume:
        return cfg
    world = dist.get_world_size()
    chosen: list[Any] = [cfg.resume]
    if dist.get_rank() == 0:
        if cfg.resume == "auto":
            have = checkpoints(cfg.checkpoint_dir)
            chosen[0] = str(have[-1]) if have else ""
            if not have:
                print(f"--resume auto: no checkpoint in {cfg.checkpoint_dir} yet, starting at step 0", file=sys.stderr)
        folder = chosen[0] if chosen[0] != "latest" else str(next(iter(checkpoints(cfg.checkpoint_dir)[-1:]), ""))
        if folder:
            _say_resuming(folder, cfg, world)
    if world > 1:
        dist.broadcast_object_list(chosen, src=0)
    return dataclasses.replace(cfg, resume=chosen[0]) if chosen[0] != cfg.resume else cfg


def checkpoint_settings(cfg: TrainConfig) -> CheckpointSettings:
    """How the job of cfg checkpoints: its --checkpoint-* flags, and the whole cfg recorded in
    each manifest (`config`)."""
    return CheckpointSettings(
        batch_size=cfg.batch_size,
        directory=cfg.checkpoint_dir,
        keep=cfg.checkpoint_keep,
        full_every=cfg.checkpoint_full_every,
        progress=cfg.progress,
        config=dataclasses.asdict(cfg),
        optimizer_hint=RESUME_OPTIMIZER_HINT,
    )


def checkpointer(
    cfg: TrainConfig, built: Built, dynamic: dt.DynamicEmbeddings | None, store: dt.RowStore
) -> Checkpointer:
    """The Checkpointer of the DLRM job of cfg: its model as build() made it (one feature per
    table), its dense optimizer and row-sparse Adam, its dynamic tables (None: full ones)."""
    tables = [
        CheckpointTable(name, built.schemas[name], (feature,))
        for name, feature in zip(built.table_names, built.features)
    ]
    return Checkpointer(
        checkpoint_settings(cfg),
        built.model,
        tables,
        built.dense_optimizer,
        optimizer=cfg.optimizer,
        dynamic=dynamic,
        store=store,
        sparse_adam=built.optimizer.sparse_adam,
    )


def _say_resuming(folder: str, cfg: TrainConfig, world: int) -> None:
    """Rank 0's line on the checkpoint a job resumes from (a bad one is refused later, by
    check_settings and restore, with the problem named: nothing said here)."""
    try:
        doc = read_manifest(folder)
        step, was = int(doc["step"]), int(doc["world_size"])
        start = data_start(doc, cfg.batch_size, world)
    except (CheckpointError, KeyError, TypeError, ValueError):
        return
    line = f"resuming from {folder} (step {step}, {was} rank{'s' * (was != 1)})"
    if was != world:
        samples = start * cfg.batch_size * world
        line += (
            f" on {world} rank{'s' * (world != 1)}: rows and ID transformers resharded to their new owners; "
            f"each rank's data resumes at its batch {start}, global sample {samples:,}"
        )
        taken = doc.get("samples")
        if taken is not None and samples != taken:
            line += f" (the checkpoint was at sample {taken:,}: {taken - samples:,} samples are seen again)"
    print(line, file=sys.stderr, flush=True)


def check_before_training(cfg: TrainConfig, store: dt.RowStore) -> None:
    """Collective: the checks above (and --fresh's drop); raises the same error on every rank.
    Made before the model is built: a job refused is told at once."""
    rank = dist.get_rank()
    schemas = {table_name(i): ps_schema(cfg, i) for i in range(cfg.data.num_sparse)}  # as build() names them
    start = "fresh" if cfg.fresh else "resume" if cfg.resume else "warm" if cfg.warm_start else "new"

    def check() -> None:
        if rank == 0 and cfg.resume:
            check_settings(
                checkpoint_settings(cfg),
                cfg.resume,
                schemas,
                dist.get_world_size(),
                optimizer=cfg.optimizer,
                dynamic=cfg.table.dynamic,
            )
        if cfg.table.dynamic:
            dt.check_tables(list(schemas.values()), store, start, rank, _WORDS)

    dt.agree(check, store)
