"""The training job: read top to bottom.

    dynemb train --steps 300                      # one process, embedded PS in-process
    torchrun --nproc_per_node 2 -m dynemb.trainer ...    # N ranks (gloo on CPU); each rank keeps the
                                                  # rows of its own IDs in-process unless --ps
    torchrun --nproc_per_node <GPUs> -m dynemb.trainer --device cuda ...   # one rank per GPU, NCCL

1. the rank's device (--device: device.py) and torch.distributed up (a one-process group when
   not under torchrun);
2. the PS: --ps addresses, or the embedded store in each rank's process (a rank holds the
   rows of the IDs it owns: row_store.LocalRowStore);
3. the DLRM under DistributedModelParallel (model.py), dynamic tables in front of it
   (dynamic.py) unless --no-dynamic;
4. the loop: TrainPipelineSparseDist (batch i+1's transform, PS pull and input
   distribution happen while batch i trains), or a plain loop with --no-pipeline;
5. evaluation: AUC and log-loss over held-out batches, all ranks together.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dynemb import tables as dt
from dynemb.checkpoint import Checkpointer
from dynemb.idtransformer.hashing import owner_of
from dynemb.publish import PublishConfig, publish_tables
from dynemb.tables import RowStore, TrainerMetrics, find_tables, init_distributed, resolve_device
from dynemb.trainer.collectives import all_gather_ragged
from dynemb.trainer.config import TrainConfig, table_name
from dynemb.trainer.data import SyntheticCriteo, batches_per_epoch, count_distinct_ids, file_batches
from dynemb.trainer.model import Built, build
from dynemb.trainer.result import TrainResult
from dynemb.trainer.startup import check_before_training, checkpointer, choose_resume
from dynemb.trainer.store import open_row_store

log = logging.getLogger("dynemb.trainer")
_CPU = torch.device("cpu")


def make_dynamic(cfg: TrainConfig, built: Built, store: RowStore, metrics: TrainerMetrics) -> dt.DynamicEmbeddings:
    """The dynamic tables in front of the built model, one per table of it, as cfg sets them
    (their ID transformers and row moves on the model's device), over the job's PS tables."""
    configs = []
    for name in built.table_names:
        t, schema = cfg.table_config(name), built.schemas[name]
        configs.append(
            dt.TableConfig(
                name,
                policy=t.policy,
                evict_fraction=t.evict_fraction,
                ttl_steps=t.ttl_steps or None,
                admit_threshold=t.admit_threshold,
                initializer=schema.initializer,
                expected_rows=schema.expected_rows,
                lifecycle=t.lifecycle(),
            )
        )
    # "warm": check_before_training has refused (or with --fresh dropped) rows left on the PS
    # already, with the flags' words, before the model was built
    return dt.DynamicEmbeddings(
        built.model, configs, store=store, start="warm", table_prefix=cfg.ps_table_prefix, metrics=metrics
    )


def batches(cfg: TrainConfig, split: int, start: int = 0):
    """This rank's batches of a split (0: training, from batch `start` on; 1: held out)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.data.source == "synthetic":
        data = SyntheticCriteo(cfg.data, cfg.batch_size, rank, world)
        out = data.train_batches(start) if split == 0 else data.eval_batches(cfg.eval_batches)
    else:
        out = itertools.islice(file_batches(cfg.data, cfg.batch_size, rank, world, split), start, None)
    if cfg.table.dynamic:
        return out
    from dynemb.trainer.full_tables import job_batches  # IDs hashed into the rows; ranks stop together

    return job_batches(cfg, out, split)


def size_tables(cfg: TrainConfig) -> TrainConfig:
    """Collective. File data without --universe: each table without a --capacity gets one from a
    count of its feature's distinct IDs (rank 0 counts in one pass, every rank gets the counts):
    a dynamic table --capacity-fraction of them, a full table as many rows as IDs (which, under
    id mod rows, still collide: the hashing trick has no one-to-one size)."""
    names = [table_name(i) for i in range(cfg.data.num_sparse)]
    if cfg.data.source == "synthetic" or cfg.data.universe or all(cfg.table_config(n).capacity for n in names):
        return cfg
    counts: list[Any] = [count_distinct_ids(cfg.data, cfg.progress) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(counts, src=0)
    tables = {n: dict(cfg.tables.get(n, {})) for n in names}
    for name, distinct in zip(names, counts[0]):
        t = cfg.table_config(name)
        if not t.capacity:
            tables[name]["capacity"] = max(1, math.ceil(distinct * (t.capacity_fraction if t.dynamic else 1.0)))
    if dist.get_rank() == 0:
        print(
            f"sized the tables from {cfg.data.source}: {_span(counts[0])} distinct IDs per feature, "
            f"{_span([tables[n]['capacity'] for n in names])} rows per table (--universe or --capacity skip the count)",
            file=sys.stderr,
            flush=True,
        )
    return dataclasses.replace(cfg, tables=tables)


def _span(values: list[int]) -> str:
    return f"{min(values):,}" if min(values) == max(values) else f"{min(values):,} to {max(values):,}"


def train(cfg: TrainConfig, collect_tables: bool = False) -> TrainResult:
    """The whole job on this rank: build, restore (cfg.resume), train, checkpoint, evaluate.

    Collective: under torchrun every rank calls it with the same cfg; alone it makes a group
    of one.

    Args:
        cfg: the job's settings (config.py).
        collect_tables: also return this rank's block of every table after training (rows
            read back from the PS for dynamic tables), for tests and checks.

    Returns:
        Losses per step, evaluation AUC and log-loss, throughput, hit rates (and the tables).
    """
    if cfg.model == "plain":  # torch EmbeddingBags, no TorchRec (plain.py)
        from dynemb.trainer.plain import train_plain

        return train_plain(cfg)
    device = resolve_device(cfg.device)
    created = init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = choose_resume(size_tables(cfg))  # --resume auto: the newest checkpoint, if any (startup.py)
    if not cfg.table.dynamic and rank == 0:  # the job's first line: how IDs find their rows
        from dynemb.trainer.full_tables import describe

        print(describe(cfg), file=sys.stderr, flush=True)
    store = open_row_store(cfg)
    dynamic: dt.DynamicEmbeddings | None = None
    metrics = TrainerMetrics(rank, job=cfg.metrics_job())
    store.watch_calls(metrics.ps_calls)  # retries, failures and a call blocked now, as metrics
    if cfg.metrics_port:  # + local rank: every machine's (or pod's) ranks serve on the same ports
        metrics.serve(cfg.metrics_port + int(os.environ.get("LOCAL_RANK", "0")), cfg.metrics_address)
    try:
        check_before_training(cfg, store)  # the checkpoint's settings, then rows left on the PS (startup.py)
        built = build(cfg, device)
        dynamic = make_dynamic(cfg, built, store, metrics) if cfg.table.dynamic else None
        ckpt = checkpointer(cfg, built, dynamic, store) if cfg.checkpoint_dir or cfg.resume else None
        first_step = ckpt.restore(cfg.resume) if ckpt is not None and cfg.resume else 0
        data_start = ckpt.data_start if ckpt is not None and cfg.resume else 0
        result = _loop(cfg, built, dynamic, metrics, ckpt, first_step, device, data_start)
        result.first_step, result.data_start = first_step, data_start
        if cfg.checkpoint_at_end and result.losses:
            assert ckpt is not None, "TrainConfig refuses checkpoint_at_end without checkpoint_dir"
            ckpt.save(first_step + len(result.losses))
        last = first_step + len(result.losses)
        if cfg.publish_at_end and dynamic is not None and not any(k == last for k, _ in result.versions):
            result.versions.append((last, publish(cfg, dynamic, last)))
        result.auc, result.logloss = evaluate(cfg, built, dynamic, device)
        if dynamic is not None:
            dynamic.close()  # the PS holds every row the job has trained
            if world > 1:  # ... from every rank, before any rank reads rows back
                dist.barrier()
        if collect_tables:
            result.tables = _collect_tables(built, dynamic, store)
        metrics.finished.set(1)  # done: a rank that stops answering now is no alert (DynembTrainerDown)
        if cfg.metrics_port and cfg.metrics_linger_seconds:
            time.sleep(cfg.metrics_linger_seconds)  # the final counts stay up for Prometheus' next scrape
        return result
    finally:
        if dynamic is not None and not dynamic.closed:  # a failed run: its rows reach the PS all the same
            try:
                dynamic.close()
            except Exception as exc:  # noqa: BLE001 - the run's own error is the one raised
                log.error("could not push the resident rows to %s: %s", store.where, exc)
        store.close()
        if created:
            dist.destroy_process_group()


def publish(cfg: TrainConfig, dynamic: dt.DynamicEmbeddings, step: int) -> dict[str, int]:
    """Collective: versions of every dynamic table for serving, at this step (dynemb.publish);
    the version numbers by table on rank 0, {} elsewhere."""
    config = PublishConfig(cfg.publish_to, dtype=cfg.publish_dtype or None, full_every=cfg.publish_full_every)
    versions = publish_tables(dynamic, config, step)
    if versions:  # rank 0
        cut = ", ".join(
            f"{v.table} v{v.number} ({v.kind}, {v.rows:,} rows, {v.deleted:,} deleted)" for v in versions.values()
        )
        print(f"step {step}: published {cut} -> {cfg.publish_to}", file=sys.stderr, flush=True)
    return {name: v.number for name, v in versions.items()}


def _agreed(rank0_says: bool) -> bool:
    """Collective: rank 0's answer, on every rank (ranks' clocks may differ)."""
    said = [rank0_says]
    dist.broadcast_object_list(said, src=0, group=dt.control_group())
    return bool(said[0])


def _loop(
    cfg: TrainConfig,
    built: Built,
    dynamic: dt.DynamicEmbeddings | None,
    metrics: TrainerMetrics,
    ckpt: Checkpointer | None = None,
    first_step: int = 0,
    device: torch.device = _CPU,
    data_start: int | None = None,
) -> TrainResult:
    """Steps first_step .. cfg.steps - 1, on each rank's batches from data_start on (default:
    first_step; another where a checkpoint of another world size was restored). With
    checkpoints, in segments that end at each checkpoint step: the pipeline drains there (no
    batch in flight) and a fresh one starts."""
    rank = dist.get_rank()
    result = TrainResult()
    data_start = first_step if data_start is None else data_start
    data = iter(batches(cfg, split=0, start=data_start))
    if ckpt is not None:
        data = ckpt.tap(data)  # the global IDs each batch touches (incremental checkpoints)
    # The batches the loop holds at once: TorchRec's pipeline fetches batch i + 2 before batch
    # i's forward (3), a plain loop one at a time. With cfg.prefetch, a thread transforms
    # batches ahead of that.
    in_flight = 3 if cfg.pipeline else 1
    model, optimizer = built.model, built.optimizer
    model.train()
    every = cfg.checkpoint_every if ckpt is not None else 0
    publishing = cfg.publish_every if dynamic is not None else 0
    # by time: rank 0 looks every log_every steps (a segment ends there) and tells every rank
    timed = cfg.log_every if cfg.publish_every_seconds and dynamic is not None else 0
    published_at = time.monotonic()
    pipeline = None

    def segment(end: int) -> tuple[Generator, Callable[[], torch.Tensor]]:
        """The batches up to step `end` (a generator: closing it stops its transform thread),
        and the function that trains one of them."""
        nonlocal pipeline

        def limited_batches():
            part = itertools.islice(data, end - k)
            # wrapped per segment: at its end every row move is settled and the transform
            # thread, if any, is done, before a checkpoint is taken
            ready = (
                part
                if dynamic is None
                else dynamic.wrap(part, in_flight=in_flight, prefetch=cfg.prefetch, priority=cfg.transform_priority)
            )
            yield from ready if device.type == "cpu" else (pinned(b) for b in ready)

        limited = limited_batches()
        if not cfg.pipeline:

            def plain() -> torch.Tensor:
                batch = on_device(next(limited), device)
                optimizer.zero_grad()
                loss, _ = model(batch)
                loss.backward()
                optimizer.step()
                return loss

            return limited, plain
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        if pipeline is not None:
            pipeline.detach()
        pipeline = this = TrainPipelineSparseDist(model, optimizer, device)
        return limited, lambda: this.progress(limited)[0]  # DLRMTrain's output: (loss, logits, labels)

    total = planned_steps(cfg)
    if cfg.data.source != "synthetic" and cfg.data.epochs:  # the batches left of the epochs
        total = first_step + max(0, total - data_start)
    evaluating = cfg.eval_every

    def boundary(k: int) -> int:  # the end of the segment that starts at step k
        return min([total, *((k // p + 1) * p for p in (every, evaluating, publishing, timed) if p)])

    bar = tqdm(
        total=total,
        initial=first_step,
        desc=f"train (rank {rank})",
        unit="step",
        disable=not cfg.progress or rank != 0,
    )
    start, logged = time.perf_counter(), 0
    pending: list[torch.Tensor] = []  # losses still on the device: read back once per log_every steps

    def read_losses() -> None:
        if pending:
            result.losses.extend(torch.stack(pending).cpu().tolist())
            pending.clear()

    k = first_step
    current, step = segment(boundary(k))
    try:
        while k < total:
            try:
                loss = step()
            except StopIteration:
                result.data_ran_out = True
                break
            pending.append(loss.detach())
            metrics.steps.inc()
            metrics.samples.inc(cfg.batch_size)
            if (k + 1) % cfg.log_every == 0 or k + 1 == total:
                read_losses()
                window, logged = result.losses[logged:], len(result.losses)
                elapsed = time.perf_counter() - start
                rate = len(result.losses) * cfg.batch_size * dist.get_world_size() / elapsed
                metrics.samples_per_second.set(rate / dist.get_world_size())
                metrics.loss.set(float(np.mean(window)))
                post = {"loss": f"{np.mean(window):.4f}", "samples/s": f"{rate:,.0f}"}
                if dynamic is not None:
                    post["hit"] = f"{dynamic.last_hit_rate:.3f}"
                bar.set_postfix(post)
                if not cfg.progress and rank == 0:  # no bar to show them: a line per log_every steps
                    line = "  ".join(f"{key} {value}" for key, value in post.items())
                    print(f"step {k + 1}: {line}", file=sys.stderr, flush=True)
            bar.update(1)
            k += 1
            if k < total and k == boundary(k - 1):  # drained: the segment ended here
                current.close()  # a plain loop's has not seen its end: its thread is joined
                if every and k % every == 0:
                    assert ckpt is not None, "every > 0 only with a Checkpointer"
                    ckpt.save(k)
                due = bool(publishing and k % publishing == 0)
                if timed and k % timed == 0:
                    due = _agreed(time.monotonic() - published_at >= cfg.publish_every_seconds)
                if due:
                    assert dynamic is not None, "publishing only with dynamic tables"
                    result.versions.append((k, publish(cfg, dynamic, k)))
                    published_at = time.monotonic()
                if evaluating and k % evaluating == 0:
                    if pipeline is not None:
                        pipeline.detach()  # the model's own forward, for evaluation
                    result.evals.append((k, *evaluate(cfg, built, dynamic, device)))
                    if rank == 0:
                        bar.write(f"step {k}: eval AUC {result.evals[-1][1]:.4f}  log-loss {result.evals[-1][2]:.4f}")
                current, step = segment(boundary(k))
    finally:  # a step that raised leaves no transform thread behind, nor a bar on the error's line
        current.close()
        bar.close()
    read_losses()
    if result.data_ran_out and rank == 0:
        log.warning(
            "the training data ran out after step %d of %d (%s): the run ends there%s",
            k,
            total,
            cfg.data.source,
            "" if cfg.data.epochs else "; --epochs N trains N passes over it",
        )
    if pipeline is not None:  # cfg.pipeline: the first segment() made one
        pipeline.detach()  # the model's own forward back, for evaluation
    elapsed = time.perf_counter() - start
    result.samples_per_second = len(result.losses) * cfg.batch_size * dist.get_world_size() / max(elapsed, 1e-9)
    if dynamic is not None:
        result.hit_rate, result.table_hit_rates = dynamic.hit_rate()
        result.hit_rates = dynamic.hit_rates[: len(result.losses)]  # not the ones fetched ahead
    return result


def pinned(batch):
    """The batch with its host tensors in pinned memory, so that on_device's copies do not hold
    the host up; a KJT that dynamic tables already moved to their device (DynamicTables.wrap)
    stays there."""
    kjt = batch.sparse_features
    return dataclasses.replace(
        batch,
        dense_features=batch.dense_features.pin_memory(),
        sparse_features=kjt if kjt.values().device.type != "cpu" else kjt.pin_memory(),
        labels=batch.labels.pin_memory(),
    )


def on_device(batch, device: torch.device):
    """The batch on `device` (copied without holding the host up where it is pinned); on the
    CPU the batch itself."""
    return batch if device.type == "cpu" else batch.to(device, non_blocking=True)


def planned_steps(cfg: TrainConfig) -> int:
    """The steps of the job: `steps`, or with file data and `epochs`, that many passes' batches."""
    if cfg.data.source == "synthetic" or not cfg.data.epochs:
        return cfg.steps
    return cfg.data.epochs * batches_per_epoch(cfg.data, cfg.batch_size, dist.get_world_size())


def _collect_tables(built: Built, dynamic: dt.DynamicEmbeddings | None, store: RowStore) -> dict:
    out = {}
    for name, r in find_tables(built.model).items():
        if dynamic is None:
            out[name] = (r.row_offset, r.read(torch.arange(r.local_rows)).cpu().numpy())
        else:  # the same block of IDs, as the PS has them (IDs are < the universe here)
            rank, world = dist.get_rank(), dist.get_world_size()
            block = -(-built.model_rows_full // world)
            first = rank * block
            ids = np.arange(first, min(first + block, built.model_rows_full), dtype=np.int64)
            table = built.schemas[name].name
            out[name] = (
                first,
                store.pull(table, ids)
                if not store.per_rank
                else _pull_from_owners(store, table, ids, built.model_rows_full),
            )
    return out


def _pull_from_owners(store: RowStore, table: str, ids: np.ndarray, universe: int) -> np.ndarray:
    """Collective, per-rank stores: the rows of `ids` (this rank's), each from its owner's store."""
    rank, world = dist.get_rank(), dist.get_world_size()
    every = torch.arange(universe)
    mine = every[owner_of(every, world) == rank].numpy()
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (mine, store.pull(table, mine)))  # every owner's rows, to every rank
    rows = np.empty((len(ids), got[0][1].shape[1]), np.float32)
    for owned, owned_rows in got if len(ids) else []:
        at = np.searchsorted(ids, owned)  # ids: ascending
        hit = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == owned)
        rows[at[hit]] = owned_rows[hit]
    return rows


@torch.no_grad()
def evaluate(
    cfg: TrainConfig, built: Built, dynamic: dt.DynamicEmbeddings | None, device: torch.device = _CPU
) -> tuple[float, float]:
    """AUC and log-loss over every rank's held-out batches, computed on `device` (the model's)."""
    from torchmetrics.functional.classification import binary_auroc

    model = built.model
    model.eval()
    logits, labels = [], []
    data = batches(cfg, split=1)
    # dynamic tables: looked up, not transformed: held-out IDs are neither admitted nor pushed,
    # and an ID without a device row reads its PS row (or initial value) through a slot lent
    # for the forward
    looked = dynamic.wrap(data, train=False) if dynamic is not None else data
    for batch in looked:
        _, (_, logit, label) = model(on_device(batch, device))
        logits.append(logit.reshape(-1))
        labels.append(label.reshape(-1))
    model.train()
    local = torch.stack([torch.cat(logits), torch.cat(labels)]) if logits else torch.zeros(2, 0, device=device)
    every = torch.cat(all_gather_ragged(local), dim=1)  # on the group's device (NCCL: the GPU)
    if every.shape[1] == 0:
        return float("nan"), float("nan")
    logit, label = every[0], every[1]
    auc = float(binary_auroc(torch.sigmoid(logit), label.long()))
    logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logit, label))
    return auc, logloss
