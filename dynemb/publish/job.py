"""Versions cut from a training job, at a step: every rank pushes the rows it changed since the
last publish, then rank 0 cuts each table's next version from the PS (publisher.py).

A trainer's resident rows are newer than the PS's: training changes them on the device and
pushes them only when they are evicted. So a version cut from the PS alone would lag the job.
At a publish step each rank first pushes the rows it looked up since its last publish (the
slots whose last access is past that step, on the device: DynamicEmbeddings.flush with
changed_only), not every resident row; a barrier, and the PS holds every row as trained at that
step; rank 0 cuts the versions while the others wait, so no push lands in the middle.
"""

from __future__ import annotations

import logging

from dynemb.common.errors import UserError
from dynemb.publish.publisher import PublishConfig, publish_table
from dynemb.publish.version import Version

log = logging.getLogger("dynemb.publish")


def publish_tables(dynamic, config: PublishConfig, step: int, *, full: bool = False) -> dict[str, Version]:
    """Collective: cut the next version of every dynamic table of the job, at this step.

    Call it at the same step on every rank, between steps (no batch in flight: a wrapped
    iterator's end, as for a checkpoint).

    Args:
        dynamic: the job's DynamicEmbeddings (its rows on a PS: publishing reads the PS's logs).
        config: where the versions go and how (PublishConfig).
        step: the training step of the cut, kept in each version.
        full: full versions, whatever the chains.

    Returns:
        On rank 0 each table's version, by TorchRec table name; {} on the other ranks.

    Raises:
        UserError: the rows are not on a PS (an embedded store in the trainer keeps no change log).
    """
    import torch.distributed as dist

    from dynemb.tables import control_group

    client = getattr(dynamic.store, "client", None)
    if client is None:
        raise UserError(
            f"publishing reads the PS's change log: these tables keep their rows in {dynamic.store.where}; "
            "run a PS (`dynemb ps serve`) and give its address (--ps)"
        )
    pushed = dynamic.flush(changed_only=True)
    group = control_group()
    dist.barrier(group=group)  # every rank's changed rows are on the PS
    out: dict[str, Version] = {}
    if dist.get_rank(group) == 0:
        for name in dynamic.names:
            out[name] = publish_table(client, dynamic.schemas[name].name, config, step=step, full=full)
        log.info(
            "step %d: published %s (this rank pushed %d changed rows first)",
            step,
            ", ".join(f"{n} v{v.number} ({v.kind}, {v.rows} rows, {v.deleted} deleted)" for n, v in out.items()),
            pushed,
        )
    dist.barrier(group=group)  # no rank pushes before the versions are cut
    return out
