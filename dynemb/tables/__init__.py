"""Dynamic tables for your own TorchRec model: the library's public API (docs/library.md).

    from dynemb import tables as dt

    dt.init_distributed()                                     # torchrun's group, or one of one process
    configs = [dt.TableConfig("user", policy="lru"), dt.TableConfig("item", admit_threshold=2)]
    model = dt.shard_model(model, configs, device)            # DMP; the dynamic tables row-wise, fused
    with dt.DynamicEmbeddings(model, configs, store=None) as dyn:   # None: the embedded store
        for batch in dyn.wrap(loader):                        # KJT of IDs in, KJT of slots out
            ...forward, backward, optimizer step...

Everything else under dynemb.tables is private: its modules may change without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Before any process group exists: TorchRec's apply_optimizer_in_backward imports
# torch.distributed.optim on its first call, and a default argument there
# (zero_redundancy_optimizer._broadcast_object's group=dist.group.WORLD) then captures the
# default group for good: destroy_process_group() could no longer free it, and its gloo threads
# ran on into interpreter shutdown, where one finishing a collective's work aborts the process.
import torch.distributed.optim  # noqa: F401

from dynemb.common.lazy import lazy_names

# name -> module; imported on first use, so that `import dynemb.tables.jagged` (the plain model,
# where TorchRec cannot load) does not load TorchRec through this package
_PUBLIC = {
    # an own TorchRec model (docs/library.md)
    "TableConfig": "dynemb.tables.config",
    "DynamicEmbeddings": "dynemb.tables.embeddings",
    "SetupError": "dynemb.tables.errors",
    "init_distributed": "dynemb.tables.embeddings",
    "StartRefused": "dynemb.tables.startup",
    "StartWords": "dynemb.tables.startup",
    "check_tables": "dynemb.tables.startup",
    "agree": "dynemb.tables.startup",
    "shard_model": "dynemb.tables.sharding",
    "constraints": "dynemb.tables.sharding",
    "sharders": "dynemb.tables.sharding",
    "start_full_tables": "dynemb.tables.baseline",
    "Initializer": "dynemb.ps_server.schema",
    "TableSchema": "dynemb.ps_server.schema",
    "TrainerMetrics": "dynemb.tables.metrics",
    "resolve_device": "dynemb.tables.device",
    "DeviceUnavailable": "dynemb.tables.device",
    "collective_device": "dynemb.tables.device",
    "control_group": "dynemb.tables.device",
    "dense_parameters": "dynemb.tables.dense",
    # where the rows live
    "RowStore": "dynemb.tables.row_store",
    "LocalRowStore": "dynemb.tables.row_store",
    "RemoteRowStore": "dynemb.tables.row_store",
    "open_store": "dynemb.tables.row_store",
    # underneath: the tables' rows, any model's dynamic tables, Adam on FBGEMM's CPU tables
    "TableRows": "dynemb.tables.table_rows",
    "find_tables": "dynemb.tables.table_rows",
    "fused_optimizer": "dynemb.tables.table_rows",
    "DynamicTables": "dynemb.tables.dynamic",
    "DynamicTableSpec": "dynemb.tables.dynamic",
    "RowSparseAdam": "dynemb.tables.sparse_adam",
    "TrainedOptimizer": "dynemb.tables.sparse_adam",
    "fused_tbes": "dynemb.tables.sparse_adam",
    # TorchRec's batch types where TorchRec loads, else stand-ins (TORCHREC_ERROR says why)
    "Batch": "dynemb.tables.jagged",
    "KeyedJaggedTensor": "dynemb.tables.jagged",
    "TORCHREC_ERROR": "dynemb.tables.jagged",
}

__all__ = [  # _PUBLIC's names (tests/tables/test_public_api.py holds the two equal)
    "Batch",
    "DeviceUnavailable",
    "DynamicEmbeddings",
    "DynamicTableSpec",
    "DynamicTables",
    "Initializer",
    "KeyedJaggedTensor",
    "LocalRowStore",
    "RemoteRowStore",
    "RowSparseAdam",
    "RowStore",
    "SetupError",
    "StartRefused",
    "StartWords",
    "TORCHREC_ERROR",
    "TableConfig",
    "TableRows",
    "TableSchema",
    "TrainedOptimizer",
    "TrainerMetrics",
    "agree",
    "check_tables",
    "collective_device",
    "constraints",
    "control_group",
    "dense_parameters",
    "find_tables",
    "fused_optimizer",
    "fused_tbes",
    "init_distributed",
    "open_store",
    "resolve_device",
    "shard_model",
    "sharders",
    "start_full_tables",
]

if TYPE_CHECKING:
    from dynemb.ps_server.schema import Initializer, TableSchema
    from dynemb.tables.baseline import start_full_tables
    from dynemb.tables.config import TableConfig
    from dynemb.tables.dense import dense_parameters
    from dynemb.tables.device import DeviceUnavailable, collective_device, control_group, resolve_device
    from dynemb.tables.dynamic import DynamicTables, DynamicTableSpec
    from dynemb.tables.embeddings import DynamicEmbeddings, init_distributed
    from dynemb.tables.errors import SetupError
    from dynemb.tables.jagged import TORCHREC_ERROR, Batch, KeyedJaggedTensor
    from dynemb.tables.metrics import TrainerMetrics
    from dynemb.tables.row_store import LocalRowStore, RemoteRowStore, RowStore, open_store
    from dynemb.tables.sharding import constraints, shard_model, sharders
    from dynemb.tables.sparse_adam import RowSparseAdam, TrainedOptimizer, fused_tbes
    from dynemb.tables.startup import StartRefused, StartWords, agree, check_tables
    from dynemb.tables.table_rows import TableRows, find_tables, fused_optimizer


__getattr__ = lazy_names("dynemb.tables", _PUBLIC, globals())
