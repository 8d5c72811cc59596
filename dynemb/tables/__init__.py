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

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Before any process group exists: TorchRec's apply_optimizer_in_backward imports
# torch.distributed.optim on its first call, and a default argument there
# (zero_redundancy_optimizer._broadcast_object's group=dist.group.WORLD) then captures the
# default group for good: destroy_process_group() could no longer free it, and its gloo threads
# ran on into interpreter shutdown, where one finishing a collective's work aborts the process.
import torch.distributed.optim  # noqa: F401

# name -> module; imported on first use, so that `import dynemb.tables.jagged` (the plain model,
# where TorchRec cannot load) does not load TorchRec through this package
_PUBLIC = {
    "TableConfig": "dynemb.tables.config",
    "DynamicEmbeddings": "dynemb.tables.embeddings",
    "SetupError": "dynemb.tables.embeddings",
    "init_distributed": "dynemb.tables.embeddings",
    "StartRefused": "dynemb.tables.startup",
    "shard_model": "dynemb.tables.sharding",
    "constraints": "dynemb.tables.sharding",
    "sharders": "dynemb.tables.sharding",
    "Initializer": "dynemb.ps_server.schema",
    "RowStore": "dynemb.tables.row_store",
}

__all__ = [  # _PUBLIC's names (a test holds the two equal)
    "DynamicEmbeddings",
    "Initializer",
    "RowStore",
    "SetupError",
    "StartRefused",
    "TableConfig",
    "constraints",
    "init_distributed",
    "shard_model",
    "sharders",
]

if TYPE_CHECKING:
    from dynemb.ps_server.schema import Initializer
    from dynemb.tables.config import TableConfig
    from dynemb.tables.embeddings import DynamicEmbeddings, SetupError, init_distributed
    from dynemb.tables.row_store import RowStore
    from dynemb.tables.sharding import constraints, shard_model, sharders
    from dynemb.tables.startup import StartRefused


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dynemb.tables' has no attribute {name!r}")
    value = getattr(import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
