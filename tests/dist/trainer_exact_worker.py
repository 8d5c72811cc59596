"""Run by torchrun from tests/trainer/test_trainer_exact.py: for each optimizer named (comma-separated),
the full and the dynamic model on every rank, one after the other; each rank saves its losses and
table blocks to OUT/rank{r}-{optimizer}.npz. Several optimizers in one job: the ranks' start-up
(seconds of imports each) is paid once."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import config, leave_process_groups  # noqa: E402

from dynemb.trainer.train import train  # noqa: E402


def main() -> None:
    out, optimizers = sys.argv[1], sys.argv[2].split(",")
    # a PS process's address (one optimizer: the job's tables would meet another's there);
    # "": in-process stores, per rank
    ps = sys.argv[3] if len(sys.argv) > 3 else ""
    assert not ps or len(optimizers) == 1, "one optimizer a job over a PS process"
    import faulthandler

    faulthandler.dump_traceback_later(500, exit=True)  # a hung collective prints its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for optimizer in optimizers:
        full = train(config(optimizer, dynamic=False), collect_tables=True)
        dyn = train(config(optimizer, dynamic=True, ps=ps), collect_tables=True)
        arrays = {
            "full_losses": np.array(full.losses),
            "dyn_losses": np.array(dyn.losses),
            "hit_rate": np.array(dyn.hit_rate),
            "eval_full": np.array([full.auc, full.logloss]),
            "eval_dyn": np.array([dyn.auc, dyn.logloss]),
        }
        for name, (first, rows) in full.tables.items():
            arrays[f"full_{name}"], arrays[f"full_{name}_first"] = rows, np.array(first)
            dfirst, drows = dyn.tables[name]
            arrays[f"dyn_{name}"], arrays[f"dyn_{name}_first"] = drows, np.array(dfirst)
        np.savez(os.path.join(out, f"rank{rank}-{optimizer}.npz"), **arrays)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
