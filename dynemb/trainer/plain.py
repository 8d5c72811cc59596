"""The plain model: the dynamic tables in front of torch.nn.EmbeddingBag tables (sum pooling)
with torch's sparse optimizers, and none of TorchRec or fbgemm-gpu. For a GPU host where
fbgemm-gpu does not load (its CUDA build does not match torch's, say), and as the shortest
reading of how the dynamic tables sit in front of a model.

    dynemb train --model plain --optimizer adagrad --steps 300

What it leaves out, and says so when asked for: several ranks (one process: every ID is its
own, the tables are not sharded), the pipeline (a plain loop), checkpoints, a PS at --ps (the
embedded store), and the optimizers torch has no sparse, row-exact form of (row-wise Adagrad;
Adam, whose torch form counts steps per table, not per row). The model: the dense features
through an MLP, beside each feature's pooled embedding, through the over MLP to one logit.
"""

from __future__ import annotations

import itertools
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dynemb.common.errors import UserError
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.ps_server.initializer import initial_rows
from dynemb.tables import (
    Batch,
    DynamicTables,
    DynamicTableSpec,
    KeyedJaggedTensor,
    LocalRowStore,
    TableRows,
    TrainerMetrics,
    init_distributed,
    resolve_device,
)
from dynemb.trainer.config import TrainConfig, table_name
from dynemb.trainer.data import SyntheticCriteo, feature_names, file_batches
from dynemb.trainer.full_tables import job_batches
from dynemb.trainer.result import TrainResult
from dynemb.trainer.schemas import ps_schema, table_rows_total

SPARSE_OPTIMIZERS = ("sgd", "adagrad")  # torch's with sparse gradients and per-row state


class PlainRefused(UserError):
    """A setting the plain model does not have."""


def check(cfg: TrainConfig) -> None:
    """Raise PlainRefused, naming the setting, for what the plain model leaves out."""
    refused = [
        (cfg.optimizer not in SPARSE_OPTIMIZERS, f"--optimizer {cfg.optimizer} (it has sgd and adagrad)"),
        (bool(cfg.ps), "--ps (it keeps the rows in the embedded store)"),
        (bool(cfg.checkpoint_dir or cfg.resume), "checkpoints"),
        (dist.is_initialized() and dist.get_world_size() > 1, "several ranks (it runs in one process)"),
    ]
    for bad, what in refused:
        if bad:
            raise PlainRefused(f"the plain model (--model plain, no fbgemm-gpu) has no {what}")


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class PlainModel(nn.Module):
    """Dense MLP and one EmbeddingBag per sparse feature, concatenated, then the over MLP.

    Args:
        cfg: the job's settings (arch, tables, data shape, seed).
        device: where the model lives.
    """

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__()
        self.features = feature_names(cfg.data.num_sparse)
        dim = cfg.table.dim
        torch.manual_seed(cfg.seed)  # the dense layers start alike in every run of this config
        self.dense = _mlp([cfg.data.num_dense, *cfg.dense_arch], last_relu=True)
        self.over = _mlp([cfg.dense_arch[-1] + dim * len(self.features), *cfg.over_arch], last_relu=False)
        self.tables = nn.ModuleList()
        for i in range(len(self.features)):
            name = table_name(i)
            rows = table_rows_total(cfg, 1, name)
            weight = torch.zeros(rows, dim)
            if not cfg.table_config(name).dynamic:  # every ID's row starts as the PS would hand it out
                weight = torch.from_numpy(initial_rows(ps_schema(cfg, i), np.arange(rows))[:, :dim].copy())
            self.tables.append(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=weight))
        self.to(device)

    def forward(self, batch: Batch, missing: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """(mean log-loss, logits) of the batch; `missing`: per feature, pooled rows to add (look_up)."""
        kjt: KeyedJaggedTensor = batch.sparse_features
        lengths = kjt.lengths().view(len(kjt.keys()), -1).long()
        weights = kjt.weights_or_none()
        values = kjt.values().split(kjt.length_per_key())
        pooled = []
        for k, (key, table) in enumerate(zip(self.features, self.tables)):
            offsets = torch.cat([lengths.new_zeros(1), lengths[k].cumsum(0)[:-1]])
            w = None if weights is None else weights.split(kjt.length_per_key())[k]
            out = table(values[k], offsets, per_sample_weights=w)
            pooled.append(out if not missing else out + missing[key].to(out.device))
        logits = self.over(torch.cat([self.dense(batch.dense_features), *pooled], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def _optimizers(cfg: TrainConfig, model: PlainModel) -> list[torch.optim.Optimizer]:
    """The tables' optimizer (sparse gradients, lr) and the dense layers' (dense_lr), of one kind."""
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    if cfg.optimizer == "adagrad":
        return [
            torch.optim.Adagrad(model.tables.parameters(), lr=cfg.lr, eps=1e-8),
            torch.optim.Adagrad(dense, lr=cfg.dense_lr, eps=1e-8),
        ]
    return [torch.optim.SGD(model.tables.parameters(), lr=cfg.lr), torch.optim.SGD(dense, lr=cfg.dense_lr)]


def _table_rows(model: PlainModel, sparse: torch.optim.Optimizer) -> dict[str, TableRows]:
    """Each table's weights and optimizer state (Adagrad's sum: dim values a row) as TableRows."""
    out = {}
    for i, table in enumerate(model.tables):
        assert isinstance(table, nn.EmbeddingBag)
        state = sparse.state[table.weight]  # Adagrad makes its state when made; SGD has none
        states = [state["sum"]] if "sum" in state else []
        out[table_name(i)] = TableRows(table_name(i), table.weight, states, 0)
    return out


def _batches(cfg: TrainConfig, split: int):
    if cfg.data.source == "synthetic":
        data = SyntheticCriteo(cfg.data, cfg.batch_size)
        out = data.train_batches() if split == 0 else data.eval_batches(cfg.eval_batches)
    else:
        out = file_batches(cfg.data, cfg.batch_size, 0, 1, split)
    return out if cfg.table.dynamic else job_batches(cfg, out, split)  # full tables: IDs hashed into their rows


def _on(batch: Batch, device: torch.device) -> Batch:
    return batch if device.type == "cpu" else batch.pin_memory().to(device, non_blocking=True)


def train_plain(cfg: TrainConfig) -> TrainResult:
    """The whole job in one process with the plain model: train cfg.steps steps, evaluate.

    Raises:
        PlainRefused: a setting the plain model leaves out (see the module doc).
    """
    check(cfg)
    device = resolve_device(cfg.device)
    created = init_distributed(device)
    check(cfg)  # torchrun with several ranks: refused before any of them trains
    store = LocalRowStore(per_rank=False)
    try:
        model = PlainModel(cfg, device)
        optimizers = _optimizers(cfg, model)
        dynamic = None
        if cfg.table.dynamic:
            specs = []
            for i, feature in enumerate(model.features):
                t = cfg.table_config(table_name(i))
                policy = EvictionPolicy(t.policy, evict_fraction=t.evict_fraction, ttl_steps=t.ttl_steps or None)
                spec = DynamicTableSpec(
                    table_name(i), [feature], ps_schema(cfg, i), policy, t.admit_threshold, t.lifecycle()
                )
                specs.append(spec)
            rows = _table_rows(model, optimizers[0])
            dynamic = DynamicTables(rows, specs, store, TrainerMetrics(0), device=device)
        result = _loop(cfg, model, optimizers, dynamic, device)
        result.auc, result.logloss = _evaluate(cfg, model, dynamic, device)
        return result
    finally:
        store.close()
        if created:
            dist.destroy_process_group()


def _loop(cfg, model: PlainModel, optimizers, dynamic: DynamicTables | None, device: torch.device) -> TrainResult:
    result = TrainResult()
    data = itertools.islice(_batches(cfg, 0), cfg.steps)
    window = 1 + cfg.prefetch if cfg.prefetch else 0  # a plain loop: none in flight at a fetch (prefetch.py)
    ready = data if dynamic is None else dynamic.wrap(data, window=window, priority=cfg.transform_priority)
    losses: list[torch.Tensor] = []  # on the device until the end: no sync per step
    start = time.perf_counter()
    model.train()
    for batch in ready:
        for opt in optimizers:
            opt.zero_grad()
        loss, _ = model(_on(batch, device))
        loss.backward()
        for opt in optimizers:
            opt.step()
        if dynamic is not None:
            dynamic.release_oldest()
        losses.append(loss.detach())
        if len(losses) % cfg.log_every == 0:  # with or without --progress: these lines are its progress
            print(f"step {len(losses)}: loss {float(losses[-1]):.4f}", file=sys.stderr, flush=True)
    result.losses = torch.stack(losses).cpu().tolist() if losses else []
    result.data_ran_out = len(result.losses) < cfg.steps
    result.samples_per_second = len(result.losses) * cfg.batch_size / max(time.perf_counter() - start, 1e-9)
    if dynamic is not None:
        result.hit_rate, result.table_hit_rates = dynamic.run_hit_rates()
        result.hit_rates = list(dynamic.hit_rates)
    return result


@torch.no_grad()
def _evaluate(cfg, model: PlainModel, dynamic: DynamicTables | None, device: torch.device) -> tuple[float, float]:
    """AUC and log-loss over the held-out batches; IDs without a device row read their PS row."""
    from torchmetrics.functional.classification import binary_auroc

    model.eval()
    data = _batches(cfg, 1)
    looked = dynamic.look_up_batches(data) if dynamic is not None else ((b, None) for b in data)
    logits, labels = [], []
    for batch, missing in looked:
        _, logit = model(_on(batch, device), missing)
        logits.append(logit)
        labels.append(batch.labels)
    model.train()
    if not logits:
        return float("nan"), float("nan")
    logit, label = torch.cat(logits).cpu(), torch.cat(labels).cpu()
    auc = float(binary_auroc(torch.sigmoid(logit), label.long()))
    return auc, float(nn.functional.binary_cross_entropy_with_logits(logit, label))
