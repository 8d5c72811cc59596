"""Run by torchrun from tests/checkpoint/test_checkpoint.py: on every rank, a job that checkpoints every
10 steps, then a job resumed from step 20 (an incremental checkpoint); each rank saves both
jobs' losses, hit rates and table blocks to OUT/rank{r}.npz."""

from __future__ import annotations

import faulthandler
import os
import sys

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import config, leave_process_groups  # noqa: E402

from dynemb.trainer.train import train  # noqa: E402


def main() -> None:
    out, optimizer, dynamic = sys.argv[1], sys.argv[2], sys.argv[3] == "dynamic"
    ps = sys.argv[4] if len(sys.argv) > 4 else ""  # a PS process's address; "": in-process per rank
    faulthandler.dump_traceback_later(500, exit=True)  # a hung collective prints its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = os.path.join(out, "ck")
    first = train(
        config(
            optimizer, dynamic=dynamic, steps=40, checkpoint_dir=ck, checkpoint_every=10, ps=ps, checkpoint_full_every=2
        ),
        collect_tables=True,
    )
    # the same checkpoint flags (another folder): its pipeline drains at step 30 as the first
    # job's did, so the ID transformers see the same pins there
    resumed = train(
        config(
            optimizer,
            dynamic=dynamic,
            steps=40,
            checkpoint_dir=os.path.join(out, "ck2"),
            ps=ps,
            checkpoint_every=10,
            resume=os.path.join(ck, "step-00000020"),
        ),
        collect_tables=True,
    )
    arrays = {}
    for tag, result in (("first", first), ("resumed", resumed)):
        arrays[f"{tag}_losses"] = np.array(result.losses)
        arrays[f"{tag}_hit_rates"] = np.array(result.hit_rates)
        arrays[f"{tag}_auc"] = np.array(result.auc)
        for name, (start, rows) in result.tables.items():
            arrays[f"{tag}_table_{name}"], arrays[f"{tag}_first_{name}"] = rows, np.array(start)
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
