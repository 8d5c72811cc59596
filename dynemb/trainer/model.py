"""The DLRM (torchrec.models.dlrm) with one row-wise sharded, fused-optimizer table per sparse
feature, under DistributedModelParallel; and the PS schema of each table.

A dynamic table has `capacity` rows in all (capacity / world_size per rank, the owner
blocks of the sharded ID transformer); a full table has one row per ID of the universe,
initialised row by row with the same initializer the PS uses for a never-seen ID, so a
full model and a dynamic one start from the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Before any process group exists: torchrec's apply_optimizer_in_backward imports
# torch.distributed.optim on its first call, and a default argument there
# (zero_redundancy_optimizer._broadcast_object's group=dist.group.WORLD) then captures the
# default group for good. destroy_process_group() could no longer free it, and its gloo threads
# ran on into interpreter shutdown, where one finishing a collective's work takes the GIL and
# aborts the process ("terminate called without an active exception").
import torch.distributed.optim  # noqa: F401
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from dynemb import tables as dt
from dynemb.ps_server.initializer import initial_rows
from dynemb.ps_server.schema import TableSchema
from dynemb.tables import RowSparseAdam, TrainedOptimizer, dense_parameters, find_tables, fused_tbes
from dynemb.trainer.config import TrainConfig, table_name
from dynemb.trainer.data import feature_names
from dynemb.trainer.schemas import ps_schema, table_rows_total


def _sparse_optimizer(cfg: TrainConfig, device: torch.device):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr}
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad, {"lr": cfg.lr, "eps": 1e-8}
    if cfg.optimizer == "rowwise_adagrad":
        return RowWiseAdagrad, {"lr": cfg.lr, "eps": 1e-8}
    if device.type == "cuda":
        return torch.optim.Adam, {"lr": cfg.lr, "eps": 1e-8}
    # FBGEMM's CPU TBE has no Adam: the tables run exact SGD at learning rate 1 and
    # RowSparseAdam turns that into Adam (see dynemb/tables/sparse_adam.py)
    return torch.optim.SGD, {"lr": 1.0}


def _dense_optimizer(cfg: TrainConfig):
    if cfg.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=cfg.dense_lr)
    if cfg.optimizer == "adam":
        return lambda params: torch.optim.Adam(params, lr=cfg.dense_lr)
    return lambda params: torch.optim.Adagrad(params, lr=cfg.dense_lr)


@dataclass
class Built:
    """What build() returns: the sharded model, its optimizer and the tables' names and schemas."""

    model: DistributedModelParallel
    optimizer: TrainedOptimizer  # TorchRec's CombinedOptimizer, plus RowSparseAdam for Adam on CPU
    table_names: list[str]
    features: list[str]
    schemas: dict[str, TableSchema]  # by TorchRec table name
    model_rows_full: int  # the ID universe: rows of a full table
    dense_optimizer: KeyedOptimizerWrapper = None  # the dense layers' part of `optimizer`


_CPU = torch.device("cpu")


def build(cfg: TrainConfig, device: torch.device = _CPU) -> Built:
    """The DLRM model of cfg, sharded row-wise over the process group with fused sparse optimizers,
    on `device`: FBGEMM's CPU TBEs, or on cuda its GPU TBEs in GPU memory (the FUSED kernel).

    Needs torch.distributed initialised. Full (non-dynamic) tables get every row initialised as
    the PS would hand it out.
    """
    world = dist.get_world_size()
    features = feature_names(cfg.data.num_sparse)
    tables = [
        EmbeddingBagConfig(
            name=table_name(i),
            embedding_dim=cfg.table.dim,
            num_embeddings=table_rows_total(cfg, world, table_name(i)),
            feature_names=[f],
        )
        for i, f in enumerate(features)
    ]
    # the dense layers start alike in every run of this config, on any device: made on the CPU
    # from the seed (on a GPU they would draw from its own generator), then moved
    torch.manual_seed(cfg.seed)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.data.num_dense,
        dense_arch_layer_sizes=cfg.dense_arch,
        over_arch_layer_sizes=cfg.over_arch,
        dense_device=_CPU,
    )
    for name, part in dlrm.named_children():
        if name != "sparse_arch":  # the tables stay on "meta" until DMP shards them
            part.to(device)
    train_model = DLRMTrain(dlrm)
    opt_class, opt_args = _sparse_optimizer(cfg, device)
    apply_optimizer_in_backward(opt_class, train_model.model.sparse_arch.parameters(), opt_args)

    # row-wise, the FUSED kernel: what dynamic tables need, and full ones train the same way
    model = dt.shard_model(train_model, [t.name for t in tables], device)
    dense = KeyedOptimizerWrapper(dense_parameters(model), _dense_optimizer(cfg))
    sparse_adam = None
    if cfg.optimizer == "adam" and device.type == "cpu":
        sparse_adam = RowSparseAdam(fused_tbes(model), lr=cfg.lr, eps=1e-8)
    optimizer = TrainedOptimizer(CombinedOptimizer([model.fused_optimizer, dense]), sparse_adam)

    schemas = {t.name: ps_schema(cfg, i) for i, t in enumerate(tables)}
    if not cfg.table.dynamic:  # every ID's row starts as the PS would hand it out
        for name, r in find_tables(model).items():
            ids = torch.arange(r.row_offset, r.row_offset + r.local_rows)
            r.write(torch.arange(r.local_rows), torch.from_numpy(initial_rows(schemas[name], ids.numpy())))
    return Built(model, optimizer, [t.name for t in tables], features, schemas, cfg.data.universe, dense)
