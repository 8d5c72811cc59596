"""Checkpoints of a job with dynamic tables (`dynemb checkpoint`) and portable table folders
(`dynemb table`): every row with its optimizer state, restorable on any number of ranks.

    from dynemb.checkpoint import Checkpointer, CheckpointSettings

    ckpt = Checkpointer.of(dyn, dense_optimizer, CheckpointSettings(batch_size=256, directory="ckpt"))
    step = ckpt.restore("latest") if resuming else 0     # collective
    ...
    ckpt.save(step)                                       # collective, at a step boundary

The names below are the public API; the modules are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynemb.common.lazy import lazy_names

_PUBLIC = {
    "Checkpointer": "dynemb.checkpoint.checkpoint",
    "CheckpointSettings": "dynemb.checkpoint.checkpoint",
    "CheckpointTable": "dynemb.checkpoint.checkpoint",
    "check_settings": "dynemb.checkpoint.checkpoint",
    "data_start": "dynemb.checkpoint.checkpoint",
    "CheckpointError": "dynemb.checkpoint.format",
    "checkpoints": "dynemb.checkpoint.format",
    "read_manifest": "dynemb.checkpoint.format",
    "export_tables": "dynemb.checkpoint.export",
    "TableReader": "dynemb.checkpoint.table_files",
    "TableWriter": "dynemb.checkpoint.table_files",
}

__all__ = [  # _PUBLIC's names (tests/tables/test_public_api.py holds the two equal)
    "CheckpointError",
    "CheckpointSettings",
    "CheckpointTable",
    "Checkpointer",
    "TableReader",
    "TableWriter",
    "check_settings",
    "checkpoints",
    "data_start",
    "export_tables",
    "read_manifest",
]

if TYPE_CHECKING:
    from dynemb.checkpoint.checkpoint import (
        Checkpointer,
        CheckpointSettings,
        CheckpointTable,
        check_settings,
        data_start,
    )
    from dynemb.checkpoint.export import export_tables
    from dynemb.checkpoint.format import CheckpointError, checkpoints, read_manifest
    from dynemb.checkpoint.table_files import TableReader, TableWriter


__getattr__ = lazy_names("dynemb.checkpoint", _PUBLIC, globals())
