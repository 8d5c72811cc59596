"""Checkpoints of a training job, consistent across all ranks and the PS, taken at a step
boundary (no batch in flight), and restore that continues training exactly. The folder
layout, manifest and chains are dynemb/checkpoint/format.py's.

What goes in: dynamic tables' rows from the PS (flushed first; rank 0 writes them, gathered
from every rank where each keeps the rows of its own IDs in-process), full
tables' rows per rank, each rank's ID transformers and row-sparse Adam step, and the dense
parameters with their optimizer (rank 0; DDP keeps them equal on every rank). The data
position is the step, and the training samples the job had taken by then over all ranks
(`samples` in the manifest).

A checkpoint of N ranks restores onto M ranks (resharding). The rows are global (one folder
per dynamic table; full tables' per-rank folders hold global row numbers): each rank takes the
IDs it owns under M, or the rows of its block. The ID transformers are rebuilt: each rank
re-admits the IDs it now owns that were resident on any old rank, the most recently or often
used first (its eviction policy's order) as far as its slots go; the others stay on the PS,
where every resident row was flushed before the save. Their admission sketches are summed
(a count-min sketch never counts low, and the sum keeps that). The dense part and the
optimizer step counts are the same on every rank. The data resumes at the same global sample
where the ranks' streams allow it (see data_start()).

The restore work is split so that no rank's grows with the number of ranks: each file is
read by one rank. The sha256 check takes every M-th file per rank. A dynamic table's shard
files (each link of the chain) are shared out by rows (spread(): largest first, to the rank
with the fewest so far; every rank computes the same): the tables are cleared once, then
each rank pushes its files' rows to the PS, or, with per-rank stores, sends them to their
owners (all_to_all over the gloo control group), a barrier between links so a newer link's
rows land after its base's. On another world size rank r reads old rank files r, r + M, ...
and sends each resident entry to its new owner (all_to_all); the sketches are summed and the
step counts maxed by all_reduce. A full table's rank reads only the old per-rank folders
whose row-wise blocks (derived from the old world size, TorchRec's layout) overlap its own.
Checkpointer.work says what a rank read and wrote.

A full checkpoint holds every row; an incremental one (CheckpointSettings.full_every k > 1) only
the rows of IDs the training touched since the previous checkpoint (its `parent`); restore
applies the chain from the last full one on. The dense part is small and saved whole each
time. torch.save rather than torch.distributed.checkpoint for it: DCP loads into tensors that
already exist, and a fresh job's optimizer creates its state only at its first step.

All ranks call save() and restore() together; the folder must be one all ranks see (a shared
filesystem when ranks are on several machines).

Nothing here knows the job that trains: any TorchRec model under DistributedModelParallel, its
tables' optimizer applied in backward, can be checkpointed. The caller says how
(CheckpointSettings: folder, retention, how often full, samples per step, what the manifest
records of the job) and what (Checkpointer's arguments: the model, its dense optimizer, an
optional RowSparseAdam, the DynamicEmbeddings or None, the row store, each table's PS schema
and features, the optimizer's name). The reference DLRM job builds them in dynemb/trainer/startup.py.
"""

from __future__ import annotations

import heapq
import io
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from dynemb.checkpoint.format import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    chain,
    checkpoints,
    files_digest,
    read_manifest,
    step_folder,
    table_parts,
    unfinished,
    verify,
    write_manifest,
)
from dynemb.checkpoint.table_files import DEFAULT_CHUNK_ROWS, TableReader, TableWriter
from dynemb.checkpoint.table_files import MANIFEST as TABLE_MANIFEST
from dynemb.common.arrays import unique
from dynemb.common.names import inside
from dynemb.idtransformer.hashing import owner_of
from dynemb.idtransformer.transformer import FREE, IDTransformer
from dynemb.ps_server.schema import TableSchema
from dynemb.tables.dense import dense_parameters
from dynemb.tables.device import ensure_control_group
from dynemb.tables.row_store import RowStore
from dynemb.tables.sparse_adam import RowSparseAdam
from dynemb.tables.table_rows import find_tables, table_configs

if TYPE_CHECKING:  # types only: a job of full tables never loads the dynamic tables' machinery
    from dynemb.tables.dynamic import DynamicTables
    from dynemb.tables.embeddings import DynamicEmbeddings

# what check_fits tells a job of another optimizer than the checkpoint's ({optimizer}: the
# checkpoint's); a caller with flags names its flag instead (CheckpointSettings.optimizer_hint)
OPTIMIZER_HINT = "restore it with optimizer {optimizer}, or start anew without restoring"


@dataclass(frozen=True)
class CheckpointSettings:
    """How a job checkpoints: where, how many are kept, how often a full one, and what the
    manifest records of the job. What is checkpointed is given to Checkpointer itself.

    Raises:
        ValueError: batch_size, keep or full_every below 1.
    """

    # samples each rank takes per step: with the step, the data position (manifest `samples`,
    # data_start()); a job resumed on another world size or batch size resumes at that sample
    batch_size: int
    directory: str | os.PathLike = ""  # where step-NNNNNNNN/ folders go; "": none (restore a named folder only)
    keep: int = 3  # the newest checkpoints kept (and every one their chains build on)
    full_every: int = 1  # every k-th checkpoint is full, the others incremental (rows touched since)
    progress: bool = True  # rank 0's progress bars while saving, verifying and restoring
    # the job's settings (JSON-able), the manifest's `config`; None records {"batch_size": ...}.
    # A manifest with none is one of PS tables alone (`dynemb checkpoint save`), not a job's.
    config: Mapping[str, Any] | None = None
    optimizer_hint: str = OPTIMIZER_HINT  # what a job of another optimizer is told to do

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.keep < 1 or self.full_every < 1:
            raise ValueError(
                f"batch_size, keep and full_every must be >= 1, got {self.batch_size}, {self.keep}, {self.full_every}"
            )

    def manifest_config(self) -> dict[str, Any]:
        """The manifest's `config`: the job's settings as given, else its batch size alone."""
        return dict(self.config) if self.config is not None else {"batch_size": self.batch_size}


@dataclass(frozen=True)
class CheckpointTable:
    """One embedding table of the model, as a checkpoint holds it."""

    name: str  # the TorchRec table name (its folder tables/<name>/, the manifest's key)
    schema: TableSchema  # its rows on the PS: the PS table's name, dim, optimizer state, initializer
    features: tuple[str, ...]  # the KeyedJaggedTensor keys whose IDs index it (for incremental checkpoints)

    def __post_init__(self) -> None:
        # a table no feature looks up would never count as touched: its increments would miss rows
        if isinstance(self.features, str) or not self.features:
            raise ValueError(
                f"table {self.name}: features must be a tuple of one or more KJT keys, got {self.features!r}"
            )


class Checkpointer:
    """Saves a job's checkpoints and restores one; tracks the IDs touched between checkpoints
    (for incremental ones). Needs torch.distributed initialised; every rank makes one alike.

    Args:
        settings: where and how (CheckpointSettings).
        model: the sharded model (DistributedModelParallel): its full tables' rows (find_tables)
            and its dense parameters (dense_parameters: those not updated in backward).
        tables: every embedding table of the model, in the same order on every rank.
        dense_optimizer: the optimizer of the dense parameters: a torchrec KeyedOptimizer
            (KeyedOptimizerWrapper, CombinedOptimizer), or a plain torch optimizer.
        optimizer: the tables' optimizer by name (the PS's: sgd, adagrad, ...), recorded in the
            manifest; a job of another one is refused at restore.
        dynamic: the DynamicEmbeddings in front of the model (their ID transformers and device
            rows are saved, their rows flushed to the store first), or None where the tables
            are full (every row in the model).
        store: the dynamic tables' rows (the PS, or each rank's own store); None: the
            DynamicEmbeddings' own. Full tables need none.
        sparse_adam: RowSparseAdam where the tables run Adam on CPU: its step count is saved.
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        model: nn.Module,
        tables: Sequence[CheckpointTable],
        dense_optimizer: torch.optim.Optimizer,
        *,
        optimizer: str,
        dynamic: DynamicEmbeddings | None = None,
        store: RowStore | None = None,
        sparse_adam: RowSparseAdam | None = None,
    ) -> None:
        self.settings, self.model = settings, model
        self.dense_optimizer, self.sparse_adam, self.optimizer = dense_optimizer, sparse_adam, optimizer
        # the tables' own machinery (transformers, device rows, flush): what a checkpoint holds of them
        self.dynamic: DynamicTables | None = dynamic.tables if dynamic is not None else None
        self._store = store if store is not None or dynamic is None else dynamic.store
        self.tables = list(tables)
        self.names = [t.name for t in self.tables]
        self.schemas = {t.name: t.schema for t in self.tables}  # by TorchRec table name
        self.root = Path(settings.directory) if settings.directory else None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # every collective of a save, restore and the like goes over the gloo control group
        # (the default group where that is gloo): the training thread's, beside NCCL's default
        # group on a GPU, which the training loop drives (docs/design.md, "Communicators and threads")
        self.group = ensure_control_group()
        self.saved = 0  # checkpoints this job wrote (full every settings.full_every)
        self.last: str | None = None  # the newest checkpoint's folder name, the next one's parent
        self.touched: dict[str, list[np.ndarray]] = {name: [] for name in self.names}
        # the data position: at step base_step the job's ranks had taken base_samples samples
        self.base_step, self.base_samples = 0, 0
        self.data_start = 0  # each rank's batch index in its stream at the restored step
        # what this rank read and wrote in the last restore: old rank files (their numbers),
        # table files, rows read from them and rows written into the tables or the PS
        self.work: dict[str, Any] = {"rank_files": [], "table_files": [], "rows_read": 0, "rows_stored": 0}

    @classmethod
    def of(
        cls,
        dynamic: DynamicEmbeddings,
        dense_optimizer: torch.optim.Optimizer,
        settings: CheckpointSettings,
        *,
        sparse_adam: RowSparseAdam | None = None,
    ) -> Checkpointer:
        """The Checkpointer of the model behind `dynamic`, all read off it: its dynamic tables
        (their PS schemas and features), the optimizer fused into them, its dense parameters
        with `dense_optimizer`.

        Args:
            dynamic: the DynamicEmbeddings in front of the model.
            dense_optimizer: the optimizer of the model's other parameters.
            settings: where and how (CheckpointSettings).
            sparse_adam: RowSparseAdam where the tables run Adam on CPU.

        Raises:
            CheckpointError: the model has fused tables that are not dynamic (a checkpoint holds
                dynamic or full tables, not both yet).
        """
        from dynemb.tables.table_rows import fused_optimizer

        engine = dynamic.tables
        others = sorted(set(find_tables(dynamic.model)) - set(engine.names))
        if others:
            raise CheckpointError(
                f"the model's tables {', '.join(others)} are not dynamic: a checkpoint holds dynamic tables or "
                f"full ones, not both yet; give them a TableConfig too"
            )
        tables = [CheckpointTable(n, engine.specs[n].ps_schema, tuple(engine.specs[n].features)) for n in engine.names]
        return cls(
            settings,
            dynamic.model,
            tables,
            dense_optimizer,
            optimizer=fused_optimizer(dynamic.model),
            dynamic=dynamic,
            sparse_adam=sparse_adam,
        )

    @property
    def store(self) -> RowStore:
        """Where the dynamic tables' rows are (only they use one)."""
        if self._store is None:
            raise CheckpointError("dynamic tables need a row store: none was given")
        return self._store

    def _bar(self, names: list[str], what: str) -> tqdm:
        """Rank 0's bar over the tables; it goes when done, so the training bar stays on its line."""
        quiet = not self.settings.progress or self.rank != 0
        return tqdm(names, desc=f"{what}: tables", unit="table", leave=False, disable=quiet)

    def _directory(self) -> Path:
        """The folder checkpoints go in (settings.directory)."""
        if self.root is None:
            raise CheckpointError("no checkpoint folder: the checkpoint settings give no directory")
        return self.root

    # -- between checkpoints ------------------------------------------------------

    def tap(self, batches):
        """The training batches, unchanged; with incremental checkpoints their IDs (global,
        before any transform) are noted on the way."""
        for batch in batches:
            if self.settings.full_every > 1:
                kjt = batch.sparse_features
                for table in self.tables:
                    ids = np.concatenate([kjt[key].values().numpy() for key in table.features])
                    self.touched[table.name].append(unique(ids))
            yield batch

    def _touched_everywhere(self) -> dict[str, np.ndarray]:
        """Per table, every ID any rank touched since the last checkpoint."""
        mine = {n: unique(np.concatenate(v)) if v else np.zeros(0, np.int64) for n, v in self.touched.items()}
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        return {n: unique(np.concatenate([e[n] for e in every])).astype(np.int64) for n in mine}

    # -- save ---------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Collective, at a step boundary: every rank calls it after the same step.

        Raises:
            CheckpointError: a transform thread is working on the tables (a wrap with prefetch
                still running): it moves rows while they would be saved.
        """
        if self.dynamic is not None and self.dynamic.transforming_ahead:
            raise CheckpointError(
                f"step {step}: a thread is transforming batches ahead (wrap(prefetch=...)) and moves rows while they "
                f"would be saved: save between wraps (e.g. wrap(itertools.islice(batches, n)) up to the checkpoint "
                f"step), or wrap with prefetch=0"
            )
        full = self.last is None or self.saved % self.settings.full_every == 0
        touched = None if full else self._touched_everywhere()
        root = self._directory()
        final = root / step_folder(step)
        work = root / (step_folder(step) + ".partial")

        def prepare() -> None:
            if self.rank == 0:
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)

        self._agree(step, work, prepare)
        if self.dynamic is not None:
            self.dynamic.flush()
            dist.barrier(group=self.group)  # every rank's rows are on the PS

        def write_parts() -> None:
            self._save_tables(work, touched)
            self._save_rank(work / f"rank-{self.rank:05d}.pt")
            if self.rank == 0:
                self._save_dense(work / "dense.pt")

        self._agree(step, work, write_parts)

        def publish() -> None:
            if self.rank == 0:
                manifest = {
                    "format": FORMAT,
                    "version": VERSION,
                    "step": step,
                    "samples": self.samples_at(step),
                    "world_size": self.world,
                    "kind": "full" if full else "incremental",
                    "parent": None if full else self.last,
                    "dynamic": self.dynamic is not None,
                    "optimizer": self.optimizer,
                    "tables": {n: self.schemas[n].to_dict() for n in self.names},
                    "config": self.settings.manifest_config(),
                    "files": files_digest(work),
                }
                write_manifest(work, manifest, final)
                self._retain()

        self._agree(step, work, publish)
        self.saved += 1
        self.last = final.name
        self.touched = {name: [] for name in self.touched}
        return final

    def samples_at(self, step: int) -> int:
        """The training samples all ranks had taken by `step` (step counts this job's steps
        and those before it; a resharded job's ranks take batch_size each per step)."""
        return self.base_samples + (step - self.base_step) * self.settings.batch_size * self.world

    def _agree(self, step: int, work: Path, part) -> None:
        """Run this rank's part of a save; if it failed to write on any rank (disk full, no
        permission, ...), every rank raises the same CheckpointError and the half-written
        folder goes. Collective: no rank is left waiting at a barrier for one that failed."""
        mine: str | None
        try:
            part()
            mine = None
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            mine = f"rank {self.rank}: {where}{exc.strerror or exc}"
        except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it
            mine = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        problems = [p for p in every if p is not None]
        if problems:
            if self.rank == 0:
                shutil.rmtree(work, ignore_errors=True)
            # work is <root>/step-NNNNNNNN.partial
            kept = f"the last one, {work.parent / self.last}, is intact" if self.last else "no earlier one exists"
            raise CheckpointError(f"checkpoint at step {step} could not be written ({'; '.join(problems)}); {kept}")

    def _save_tables(self, work: Path, touched: dict[str, np.ndarray] | None) -> None:
        names = self.names
        if self.dynamic is not None:
            # rank 0 writes each table: read from the PS all ranks share, or gathered from every
            # rank's own store (per-rank stores hold the rows of the IDs their rank owns)
            if self.rank != 0 and not self.store.per_rank:
                return
            failure: Exception | None = None
            for name in self._bar(names, "checkpoint"):
                schema = self.schemas[name]
                chunks = self._table_rows(schema, None if touched is None else touched[name])
                # a failure is raised once every table's rounds are over: the other ranks are
                # still sending (or rank 0 still taking) this table's rows and the next ones'
                try:
                    if self.rank != 0:
                        for _ in chunks:  # this rank's rows, sent to rank 0
                            pass
                        continue
                    with TableWriter(inside(work / "tables", name), schema, source={"kind": "checkpoint"}) as w:
                        for ids, rows in chunks:
                            rows = np.asarray(rows, dtype=schema.np_dtype)
                            w.write(ids, rows[:, : schema.dim], rows[:, schema.dim :])
                except Exception as exc:  # noqa: BLE001 - raised below
                    if not self.store.per_rank:  # rank 0 alone: nothing to keep in step with
                        raise
                    failure = failure or exc
                    for _ in chunks:  # the rest of this table's rounds
                        pass
            if failure is not None:
                raise failure
            return
        for name, r in find_tables(self.model).items():
            schema = self.schemas[name]
            local = torch.arange(r.local_rows)
            if touched is not None:  # this rank's rows among the touched IDs
                touched_ids = torch.from_numpy(touched[name])
                in_block = (touched_ids >= r.row_offset) & (touched_ids < r.row_offset + r.local_rows)
                local = (touched_ids[in_block] - r.row_offset).long()
            rows = r.read(local).cpu().numpy().astype(schema.np_dtype)
            with TableWriter(
                inside(work / "tables", name) / f"rank-{self.rank:05d}",
                schema,
                source={"kind": "checkpoint", "rank": self.rank},
            ) as w:
                w.write(local.numpy() + r.row_offset, rows[:, : schema.dim], rows[:, schema.dim :])

    def _table_rows(self, schema, touched: np.ndarray | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, rows) chunks of a dynamic table for a checkpoint (every row, or those of the
        touched IDs), on rank 0; with per-rank stores a collective, in which every rank sends
        its own rows to rank 0 and gets nothing."""
        table, per_rank = schema.name, self.store.per_rank
        ids = touched if touched is None or not per_rank else touched[self._owned(touched)]

        def rows() -> Iterator[tuple[np.ndarray, np.ndarray]]:  # read in the rounds: errors surface there
            if ids is None:
                yield from self.store.export(table)
            elif len(ids):
                yield ids, self.store.pull(table, ids)

        return self._gather_at_rank0(rows()) if per_rank else rows()

    def _gather_at_rank0(self, mine: Iterator[tuple]) -> Iterator[tuple]:
        """Collective: every rank's chunks, yielded on rank 0 (elsewhere nothing), a chunk
        from each rank at a time, so that rank 0 never holds more than a chunk of each. A rank
        whose rows cannot be read says so in its place and goes on with the rounds, so no rank
        is left waiting; each raises once the rounds are over (rank 0 naming the rank)."""
        failed: list[str] = []
        own_error: Exception | None = None
        chunk: tuple | str | None  # a chunk, what went wrong reading it, or None: no more
        while True:
            try:
                chunk = next(mine, None) if own_error is None else None
            except Exception as exc:  # noqa: BLE001 - raised after the rounds
                own_error, chunk = exc, f"rank {self.rank}: {type(exc).__name__}: {exc}"
            got: list[Any] | None = [None] * self.world if self.rank == 0 else None  # rank 0's alone
            dist.gather_object(chunk, got, dst=0, group=self.group)
            more = [got is None or any(c is not None for c in got)]
            dist.broadcast_object_list(more, src=0, group=self.group)
            if not more[0]:
                break
            if got is not None:
                failed += [c for c in got if isinstance(c, str)]
                yield from (c for c in got if c is not None and not isinstance(c, str))
        if own_error is not None:
            raise own_error
        if failed:
            raise RuntimeError("could not read the rows to save: " + "; ".join(failed))

    def _owned(self, ids: np.ndarray) -> np.ndarray:
        """Mask of the ids this rank owns (the sharded ID transformer's owner_of)."""
        return owner_of(torch.from_numpy(np.ascontiguousarray(ids, np.int64)), self.world).numpy() == self.rank

    def _save_rank(self, path: Path) -> None:
        state: dict = {"rank": self.rank}
        if self.dynamic is not None:
            state["transformers"] = {n: t.local.state_dict() for n, t in self.dynamic.transformers.items()}
        if self.sparse_adam is not None:
            state["sparse_adam"] = self.sparse_adam.state_dict()
        _save_torch(state, path)

    def _save_dense(self, path: Path) -> None:
        params = {k: v.detach().clone() for k, v in dense_parameters(self.model).items()}
        _save_torch({"parameters": params, "optimizer": self.dense_optimizer.state_dict()}, path)

    def _retain(self) -> None:
        """Keep the newest settings.keep checkpoints and every one their chains build on;
        remove what saves cut off left (no save of this job's is in progress: its ranks are
        all here, past this one)."""
        for stale in unfinished(self._directory()):
            shutil.rmtree(stale, ignore_errors=True)
        have = checkpoints(self._directory())
        keep: set[Path] = set()
        for c in have[-self.settings.keep :]:
            keep.update(chain(c))
        for c in have:
            if c not in keep:  # the manifest first: a removal cut off leaves no complete-looking folder
                (c / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(c, ignore_errors=True)

    # -- restore ------------------------------------------------------------------

    def resolve(self, which: str) -> Path:
        """The folder of checkpoint `which` (a folder, or "latest" in settings.directory).

        Raises:
            CheckpointError: no such checkpoint, or "latest" without a directory.
        """
        if which == "latest":
            self._directory()  # raises without one
        return resolve(which, self.root)

    def restore(self, which: str) -> int:
        """Collective: load the checkpoint (a folder or "latest") into the model, the PS and
        the ID transformers; returns its step, where training goes on.

        Raises:
            CheckpointError: the checkpoint is missing, damaged or of another job, or a
                transform thread is working on the tables (a wrap with prefetch still running).
        """
        if self.dynamic is not None and self.dynamic.transforming_ahead:
            raise CheckpointError(
                f"restore {which}: a thread is transforming batches ahead (wrap(prefetch=...)) and moves rows while "
                f"they would be replaced: restore before the first wrap or between wraps"
            )
        folder = self.resolve(which)
        self.work = {"rank_files": [], "table_files": [], "rows_read": 0, "rows_stored": 0}
        # check everything before anything changes, each file on one rank; all ranks stop alike
        mine: str | None = None
        try:
            links = chain(folder)
            share = (self.rank, self.world)
            docs = [verify(c, progress=self.settings.progress and self.rank == 0, share=share) for c in links]
            if self.rank == 0:
                self._check_fits(folder, docs[-1])
        except (CheckpointError, OSError) as exc:
            mine = str(exc)
        problems: list[Any] = [None] * self.world
        dist.all_gather_object(problems, mine, group=self.group)
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise CheckpointError(problem)
        doc = docs[-1]
        self._restore_tables(links)
        written_by = int(doc["world_size"])
        if written_by == self.world:  # each rank's own state, as it was
            rank_state = torch.load(folder / f"rank-{self.rank:05d}.pt", map_location="cpu", weights_only=False)
            self.work["rank_files"].append(self.rank)
            if self.dynamic is not None:
                for name, t in self.dynamic.transformers.items():
                    t.local.load_state_dict(_unpinned(rank_state["transformers"][name]))
            adam_state = rank_state.get("sparse_adam")
        else:
            adam_state = self._reshard_rank_states(folder, written_by)
        if self.dynamic is not None:
            self._pull_resident(self.dynamic)
        if self.sparse_adam is not None:
            self.sparse_adam.load_state_dict(adam_state)
        dense = torch.load(folder / "dense.pt", map_location="cpu", weights_only=False)
        with torch.no_grad():
            for k, p in dense_parameters(self.model).items():
                p.copy_(dense["parameters"][k])
        _load_optimizer(self.dense_optimizer, dense["optimizer"])
        self.last = folder.name
        step = int(doc["step"])
        self.base_step = step
        self.data_start = data_start(doc, self.settings.batch_size, self.world)
        self.base_samples = self.data_start * self.settings.batch_size * self.world
        dist.barrier(group=self.group)
        return step

    def _reshard_rank_states(self, folder: Path, written_by: int) -> dict | None:
        """The per-rank state of a checkpoint of `written_by` ranks, for this rank of another
        world size: the ID transformers rebuilt from every old rank's (the IDs this rank owns
        now), and the row-sparse Adam step count (the same on every rank; the largest taken).
        Collective: rank r reads the old ranks' files r, r + world, ... and sends each entry to
        its new owner; the sketches are summed and the step counts maxed over all ranks.
        Returns that Adam state (None if the checkpoint has none)."""
        names = list(self.dynamic.transformers) if self.dynamic is not None else []
        table_of = {n: t for t, n in enumerate(names)}
        found: dict[int, list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {
            t: [] for t in range(len(names))
        }
        sketches: dict[int, torch.Tensor] = {}
        step, adam_iter = 0, -1
        for first in range(0, written_by, self.world):  # one file per rank at a time: they may be large
            send: list[list[np.ndarray]] = [[] for _ in range(self.world)]
            old_rank = first + self.rank
            if old_rank < written_by:
                state = torch.load(folder / f"rank-{old_rank:05d}.pt", map_location="cpu", weights_only=False)
                self.work["rank_files"].append(old_rank)
                if state.get("sparse_adam") is not None:
                    adam_iter = max(adam_iter, int(state["sparse_adam"]["iter"]))
                for name, old in state["transformers"].items() if names else []:
                    if name not in table_of:
                        continue
                    t = table_of[name]
                    step = max(step, int(old["step"]))
                    slots, ids = old["slots"].long(), old["ids"].numpy().astype(np.int64)
                    entries = [ids, old["last_access"][slots].numpy(), old["freq"][slots].numpy()]
                    for dest, rows in self._by_owner(ids):
                        picked = [e[rows].astype(np.int64) for e in entries]
                        send[dest].append(np.concatenate([[old_rank, t, len(rows)], *picked]))
                    if "sketch" in old:
                        counts = old["sketch"]["counts"].to(torch.int64)
                        sketches[t] = sketches[t] + counts if t in sketches else counts
            for got in self._all_to_all(send):
                at = 0
                while at < len(got):
                    old_rank, t, n = (int(x) for x in got[at : at + 3])
                    ids, last, freq = (torch.from_numpy(got[at + 3 + k * n : at + 3 + (k + 1) * n]) for k in range(3))
                    found[t].append((old_rank, (ids, last.to(torch.int32), freq.to(torch.uint8))))
                    at += 3 + 3 * n
        # one all_reduce each: the largest step counts, whether a table's sketches exist and
        # their shape, then their sum (a rank that read no file adds zeros)
        shapes = [tuple(sketches[t].shape) if t in sketches else (0, 0) for t in range(len(names))]
        flat = [step, adam_iter] + [x for shape in shapes for x in (1 if shape != (0, 0) else 0, *shape)]
        agreed = torch.tensor(flat, dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        step, adam_iter = int(agreed[0]), int(agreed[1])
        shape_of = {t: tuple(agreed[3 + 3 * t : 5 + 3 * t].tolist()) for t in range(len(names)) if agreed[2 + 3 * t]}
        if shape_of:
            counts = [sketches.get(t, torch.zeros(shape_of[t], dtype=torch.int64)) for t in shape_of]
            summed = torch.cat([c.reshape(-1) for c in counts])
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
            parts = torch.split(summed, [c.numel() for c in counts])
            sketches = {t: part.reshape(shape_of[t]) for t, part in zip(shape_of, parts)}
        if self.dynamic is not None:
            for t, transformer in enumerate(self.dynamic.transformers.values()):
                by_old_rank = [entries for _, entries in sorted(found[t], key=lambda f: f[0])]
                rebuild_transformer(transformer.local, by_old_rank, step, sketches.get(t))
        return None if adam_iter < 0 else {"iter": adam_iter}

    def _by_owner(self, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(rank, positions in ids) of each rank that owns some of ids under this world size
        (the sharded ID transformer's owner_of), the positions in the order of ids."""
        owner = owner_of(torch.from_numpy(np.ascontiguousarray(ids, np.int64)), self.world).numpy()
        order = np.argsort(owner, kind="stable")
        ends = np.cumsum(np.bincount(owner, minlength=self.world))
        for dest in range(self.world):
            lo = ends[dest - 1] if dest else 0
            if ends[dest] > lo:
                yield dest, order[lo : ends[dest]]

    def _all_to_all(self, send: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Collective, over the gloo control group: send[d] (int64 arrays, joined) to rank d;
        returns what each rank sent this one, by source rank."""
        group = self.group
        parts = [np.concatenate(p).astype(np.int64) if p else np.zeros(0, np.int64) for p in send]
        counts = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        out = torch.empty(int(got.sum()), dtype=torch.int64)
        dist.all_to_all_single(
            out,
            torch.from_numpy(np.concatenate(parts)),
            output_split_sizes=got.tolist(),
            input_split_sizes=counts.tolist(),
            group=group,
        )
        return [x.numpy() for x in torch.split(out, got.tolist())]

    def _check_fits(self, folder: Path, doc: dict) -> None:
        check_fits(
            folder,
            doc,
            self.schemas,
            self.world,
            optimizer=self.optimizer,
            dynamic=self.dynamic is not None,
            optimizer_hint=self.settings.optimizer_hint,
        )

    def _restore_tables(self, links: list[Path]) -> None:
        if self.dynamic is not None:
            self._restore_dynamic(links)
            dist.barrier(group=self.group)  # the PS holds the checkpoint's rows before any rank pulls
            return
        self._restore_full(links)

    def _restore_dynamic(self, links: list[Path]) -> None:
        """Collective: the chain's rows of the dynamic tables into the PS all ranks share, or
        into each rank's own store the rows of the IDs it owns. Each shard file is read by one
        rank (spread() shares them out by rows); with per-rank stores its rows go to their
        owners by all_to_all. The tables are cleared first, and each link is in before the
        next link's rows (newer) go on top."""
        names = self.names
        schemas = [self.schemas[n] for n in names]
        per_rank = self.store.per_rank
        if per_rank or self.rank == 0:  # the old rows go, once, before any rank writes
            for schema in schemas:
                self.store.replace(schema, [])
        dist.barrier(group=self.group)
        for link in links:
            readers = [TableReader(inside(link / "tables", name)) for name in names]
            pieces = [(t, shard) for t, r in enumerate(readers) for shard in r.manifest.shards]
            takes = spread([shard.rows for _, shard in pieces], self.world)
            mine = [p for p, rank in zip(pieces, takes) if rank == self.rank]
            self.work["table_files"] += [f"{link.name}/{names[t]}/{shard.file}" for t, shard in mine]
            quiet = not self.settings.progress or self.rank != 0
            bar = tqdm(
                total=sum(shard.rows for _, shard in mine),
                desc=f"restore {link.name}",
                unit="row",
                leave=False,
                disable=quiet,
            )

            if per_rank:
                chunks_of = [-(-shard.rows // DEFAULT_CHUNK_ROWS) for _, shard in pieces]
                rounds = max(sum(c for c, rank in zip(chunks_of, takes) if rank == r) for r in range(self.world))
                ours = ((t, ids, block) for t, shard in mine for ids, block in self._shard_rows(readers[t], shard, bar))
                self._route_rows(ours, rounds, schemas)
            else:
                for t, shard in mine:
                    self.work["rows_stored"] += self.store.load(schemas[t], self._shard_rows(readers[t], shard, bar))
            bar.close()
            dist.barrier(group=self.group)  # this link's rows are in before the next one's go on top

    def _shard_rows(self, reader: TableReader, shard, bar: tqdm) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, rows) chunks of one shard file of a table folder (rows: embedding, then state)."""
        for ids, e, s in reader.chunks(verify=False, shards=[shard]):
            self.work["rows_read"] += len(ids)
            bar.update(len(ids))
            yield ids, np.concatenate([e, s], axis=1)

    def _route_rows(self, ours: Iterator[tuple[int, np.ndarray, np.ndarray]], rounds: int, schemas) -> None:
        """Collective: in `rounds` rounds, each rank's next chunk of (table, ids, rows) goes to
        the ranks that own its IDs, and each rank writes what it gets into its own store."""
        for _ in range(rounds):
            send: list[list[np.ndarray]] = [[] for _ in range(self.world)]
            chunk = next(ours, None)
            if chunk is not None:
                t, ids, block = chunk
                block = np.ascontiguousarray(block, dtype=np.float32)  # what push stores
                width = block.shape[1]
                for dest, picked in self._by_owner(ids):
                    words = np.zeros(-(-len(picked) * width // 2), np.int64)  # two float32 per int64
                    words.view(np.float32)[: len(picked) * width] = block[picked].reshape(-1)
                    send[dest].append(np.concatenate([[t, len(picked), width], ids[picked], words]))
            for got in self._all_to_all(send):
                at = 0
                while at < len(got):
                    t, n, width = (int(x) for x in got[at : at + 3])
                    nwords = -(-n * width // 2)
                    ids = got[at + 3 : at + 3 + n]
                    block = got[at + 3 + n : at + 3 + n + nwords].view(np.float32)[: n * width].reshape(n, width)
                    self.store.push(schemas[t].name, ids, block)
                    self.work["rows_stored"] += n
                    at += 3 + n + nwords

    def _restore_full(self, links: list[Path]) -> None:
        """Full tables: global row numbers in per-rank folders; each rank takes its block's
        rows, from its own folder when the link was written by as many ranks, else from the
        folders of the old ranks whose blocks overlap its own. The old blocks are derived from
        the old world size (_row_block, TorchRec's row-wise layout), once this rank's own
        block is seen to follow it; every row read is checked to lie in its block. A full
        table has the same rows under any world size (TorchRec's num_embeddings)."""
        totals = table_sizes(self.model)
        for name, r in find_tables(self.model).items():
            first, end = r.row_offset, r.row_offset + r.local_rows
            total = totals[name]
            derived = _row_block(total, self.world, self.rank) == (first, end)
            for c in links:
                written_by = int(read_manifest(c)["world_size"])
                blocks = {}  # old rank -> its rows [lo, hi)
                if written_by == self.world:
                    blocks[self.rank] = (first, end)
                elif not derived:  # every part, their rows filtered
                    blocks = {int(p.name.split("-")[1]): (0, total) for p in table_parts(c, name)}
                elif end > first:  # arithmetic only: no other part's file is looked at
                    for old_rank in range(first // -(-total // written_by), written_by):
                        lo, hi = _row_block(total, written_by, old_rank)
                        if lo >= end:
                            break
                        if hi > first:
                            blocks[old_rank] = (lo, hi)
                for old_rank, (lo, hi) in blocks.items():
                    part = inside(c / "tables", name) / f"rank-{old_rank:05d}"
                    if not (part / TABLE_MANIFEST).is_file():
                        continue  # an old rank with no rows of the table wrote none
                    self.work["table_files"].append(f"{c.name}/{name}/{part.name}")
                    for ids, e, s in TableReader(part).chunks(verify=False):
                        self.work["rows_read"] += len(ids)
                        if len(ids) and (ids.min() < lo or ids.max() >= hi):
                            raise CheckpointError(
                                f"{part}: holds rows {ids.min()}..{ids.max()}, outside rows {lo}..{hi - 1}, "
                                f"the block of rank {old_rank} of {written_by} under row-wise sharding"
                            )
                        keep = (ids >= first) & (ids < end)
                        if keep.any():
                            local = torch.from_numpy(ids[keep] - first)
                            rows = np.concatenate([e[keep], s[keep]], axis=1)
                            r.write(local, torch.from_numpy(rows).float())
                            self.work["rows_stored"] += int(keep.sum())

    def _pull_resident(self, dynamic: DynamicTables) -> None:
        """The rows of the IDs the restored transformers hold, from the PS into their slots."""
        for name, t in dynamic.transformers.items():
            local = t.local
            slots = torch.nonzero(local.last_access != -1).squeeze(1)
            if len(slots):
                ids = local.slot_id[slots].cpu().numpy()
                rows = self.store.pull(self.schemas[name].name, ids)
                dynamic.rows[name].write(slots, torch.from_numpy(np.asarray(rows, dtype=np.float32)))


def rebuild_transformer(
    local: IDTransformer,
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    step: int,
    sketch: torch.Tensor | None,
) -> int:
    """Fill an empty ID transformer with resident IDs of other transformers (a checkpoint of
    another world size): those of `found` ((ids, last access, freq) per old rank) that fit,
    the ones its eviction policy would keep first; the rest stay out (their rows on the PS).
    `sketch`: the admission sketches' counters summed, if they have one. Returns the IDs
    admitted."""
    ids = torch.cat([f[0] for f in found]) if found else torch.zeros(0, dtype=torch.int64)
    last = torch.cat([f[1] for f in found]).to(torch.int32) if found else torch.zeros(0, dtype=torch.int32)
    freq = torch.cat([f[2] for f in found]).to(torch.uint8) if found else torch.zeros(0, dtype=torch.uint8)
    if len(ids) > local.capacity:  # the highest scores stay (the lowest are evicted first)
        keep = torch.topk(local.policy.scores(last, freq, step), local.capacity).indices
        keep = keep.sort().values  # in the order found: deterministic slots
        ids, last, freq = ids[keep], last[keep], freq[keep]
    n = len(ids)
    state: dict[str, Any] = {
        "capacity": local.capacity,
        "step": step,
        "slots": torch.arange(n),
        "ids": ids,
        "last_access": torch.full((local.capacity,), FREE, dtype=torch.int32),
        "freq": torch.zeros(local.capacity, dtype=torch.uint8),
        "pins": torch.zeros(local.capacity, dtype=torch.uint8),  # no batch in flight at a checkpoint
    }
    state["last_access"][:n], state["freq"][:n] = last, freq
    if local.sketch is not None:
        have = local.sketch.state_dict()
        counts = have["counts"] if sketch is None else sketch.clamp(max=torch.iinfo(torch.int32).max).to(torch.int32)
        state["sketch"] = {"width": have["width"], "depth": have["depth"], "counts": counts}
    local.load_state_dict(state)
    return n


def _unpinned(state: dict) -> dict:
    """An ID transformer's saved state with no slot pinned. A checkpoint is taken at a step
    boundary: a batch whose slots were still pinned then (a loop that had not yet asked for the
    next batch) is through its step, and the job that saved goes on to release it; a restored
    job has no batch in flight to release, so its pins would hold those slots for good (as
    rebuild_transformer does for another world size)."""
    return {**state, "pins": torch.zeros_like(state["pins"])}


def spread(sizes: list[int], world: int) -> list[int]:
    """The rank that takes each piece of work of `sizes` (e.g. a shard file's rows): the
    largest first, each to the rank with the least so far (the lowest of equals). Every rank
    computes the same, with no message."""
    heap = [(0, r) for r in range(world)]
    takes = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: equal sizes by index
        load, rank = heapq.heappop(heap)
        takes[i] = rank
        heapq.heappush(heap, (load + sizes[i], rank))
    return takes


def _row_block(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[first, end) of rank's block of a table of `rows` rows sharded row-wise over `world`
    ranks as TorchRec does: ceil(rows / world) each, the last ones shorter or empty."""
    size = -(-rows // world)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def data_start(doc: dict, batch_size: int, world: int) -> int:
    """Where each rank's training stream resumes (its batch index) for a job of `world` ranks
    and `batch_size` per rank resuming from the checkpoint of manifest `doc`: at the global
    sample the checkpoint's ranks had reached, rounded down to a whole step of the new job
    (its ranks' streams start at multiples of batch_size * world: up to that many samples
    are seen again). The same step for the same world size and batch size."""
    samples = doc.get("samples")
    if samples is None:  # a manifest of before `samples`: steps of its job alone
        samples = int(doc["step"]) * int(doc["config"]["batch_size"]) * int(doc["world_size"])
    return int(samples) // (batch_size * world)


def resolve(which: str, directory: str | os.PathLike | None) -> Path:
    """The checkpoint folder `which` names.

    Args:
        which: a checkpoint folder, or "latest": the newest complete one in `directory`.
        directory: the folder of a job's checkpoints (CheckpointSettings.directory; "" or
            None: none).

    Raises:
        CheckpointError: "latest" with no directory, or none complete in it.
    """
    if which == "latest":
        if not directory:
            raise CheckpointError("resume latest: no checkpoint folder to look in (the settings give no directory)")
        have = checkpoints(directory)
        if not have:
            raise CheckpointError(f"resume latest: no checkpoint in {directory}")
        return have[-1]
    return Path(which)


def check_settings(
    settings: CheckpointSettings,
    which: str,
    schemas: Mapping[str, TableSchema],
    world: int,
    *,
    optimizer: str,
    dynamic: bool,
) -> None:
    """Whether the checkpoint `which` names (resolve(): a folder or "latest" in
    settings.directory) is one a job of these settings can continue from (ranks, table kind,
    optimizer, table schemas), from its manifest alone: cheap, and made before the job
    touches its PS tables, so that a job with other settings hears that rather than what the
    PS says of its tables. Arguments as check_fits'.

    Raises:
        CheckpointError: the checkpoint is missing or of another job; restore() checks the
            files as well.
    """
    folder = resolve(which, settings.directory)
    check_fits(
        folder,
        read_manifest(folder),
        schemas,
        world,
        optimizer=optimizer,
        dynamic=dynamic,
        optimizer_hint=settings.optimizer_hint,
    )


def check_fits(
    folder: Path,
    doc: dict,
    schemas: Mapping[str, TableSchema],
    world: int,
    *,
    optimizer: str,
    dynamic: bool,
    optimizer_hint: str = OPTIMIZER_HINT,
) -> None:
    """Whether the checkpoint of `folder` (its manifest `doc`) is of a job like this one.

    Args:
        folder: the checkpoint's folder (named in the messages).
        doc: its manifest (read_manifest).
        schemas: this job's PS table schemas, by TorchRec table name.
        world: this job's ranks (any: a checkpoint restores onto another world size).
        optimizer: this job's tables' optimizer, by name.
        dynamic: whether this job's tables are dynamic (rows on the PS) rather than full.
        optimizer_hint: what a job of another optimizer is told to do; {optimizer} stands
            for the checkpoint's.

    Raises:
        CheckpointError: naming the difference.
    """
    if doc.get("config") is None:
        raise CheckpointError(
            f"{folder}: holds PS tables only (made by `dynemb checkpoint save`), not a "
            f"training job's state; put them on a PS with `dynemb checkpoint restore`"
        )
    if not isinstance(doc.get("world_size"), int) or doc["world_size"] < 1:
        raise CheckpointError(f"{folder}: its manifest has no world size (the ranks that wrote it)")
    missing = [f"rank-{r:05d}.pt" for r in range(doc["world_size"]) if f"rank-{r:05d}.pt" not in doc["files"]]
    if missing:
        raise CheckpointError(f"{folder}: written by {doc['world_size']} ranks, but it lists no {missing[0]}")
    if doc["dynamic"] != dynamic:
        raise CheckpointError(
            f"{folder}: {'dynamic' if doc['dynamic'] else 'full'} tables, this job's are "
            f"{'dynamic' if dynamic else 'full'}"
        )
    if doc["optimizer"] != optimizer:
        hint = optimizer_hint.format(optimizer=doc["optimizer"])
        raise CheckpointError(f"{folder}: optimizer {doc['optimizer']}, this job's is {optimizer} ({hint})")
    want = {n: s.to_dict() for n, s in schemas.items()}
    if doc["tables"] != want:
        differ = sorted(set(want) ^ set(doc["tables"])) or [n for n in want if want[n] != doc["tables"][n]]
        raise CheckpointError(f"{folder}: its tables differ from this job's ({', '.join(differ[:5])})")


def table_sizes(model: nn.Module) -> dict[str, int]:
    """Rows of each table of the sharded embedding modules inside `model` across all ranks
    (TorchRec's num_embeddings), by name: what the row-wise blocks of any world size are cut
    from (_row_block)."""
    return {name: int(c.num_embeddings) for name, c in table_configs(model).items()}


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a saved state_dict into `optimizer`. A torchrec KeyedOptimizer makes its state
    lazily (at its first step) and loads only into state that exists: init_state() makes it,
    then the checkpoint's overwrites it. A plain torch optimizer takes the state as saved."""
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state):
        init_state()
    optimizer.load_state_dict(state)


def _save_torch(obj, path: Path) -> None:
    """torch.save through memory: its own writer reports a full disk as "basic_ios::clear:
    iostream error"; Python's names the file and the reason."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        with open(path, "wb") as f:
            f.write(buf.getbuffer())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
