"""Run by torchrun from tests/checkpoint/test_reshard.py, on 2 ranks (`first`) and then on another number
(`resume`), each rank saving what it saw to OUT/<phase>-<world>-rank<r>.npz:

- first: a 2-rank job of 20 steps, checkpointed at 10 (full) and 20 (incremental, the end);
  its rows (with optimizer state) after the last step, this rank's block of every table.
- resume: the step-20 checkpoint restored onto this world size with nothing left to train
  (the same blocks, read back, and each rank's rebuilt ID transformers: resident IDs and the
  rows in their slots, and the files and rows the restore read and wrote on this rank), then
  a job that trains on from it to step 30 and checkpoints there.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import config, leave_process_groups  # noqa: E402

from dynemb.checkpoint.checkpoint import Checkpointer  # noqa: E402
from dynemb.trainer.train import train  # noqa: E402


def main() -> None:
    out, phase, optimizer, tables = sys.argv[1:5]
    ps = sys.argv[5] if len(sys.argv) > 5 else ""
    dynamic = tables == "dynamic"
    # a hung collective prints its stacks
    faulthandler.dump_traceback_later(int(os.environ.get("HANG_S", "500")), exit=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ck = os.path.join(out, "ck")
    arrays: dict[str, np.ndarray] = {}

    def keep(tag: str, result) -> None:
        arrays[f"{tag}_losses"] = np.array(result.losses)
        arrays[f"{tag}_first_step"] = np.array(result.first_step)
        arrays[f"{tag}_data_start"] = np.array(result.data_start)
        for name, (start, rows) in result.tables.items():
            arrays[f"{tag}_table_{name}"], arrays[f"{tag}_start_{name}"] = rows, np.array(start)

    if phase == "first":
        cfg = config(
            optimizer,
            dynamic=dynamic,
            steps=20,
            checkpoint_dir=ck,
            checkpoint_every=10,
            checkpoint_full_every=2,
            checkpoint_at_end=True,
            ps=ps,
        )
        keep("first", train(cfg, collect_tables=True))
    else:
        restore = Checkpointer.restore

        def spy(self, which):  # the ID transformers as restore left them, before any step
            step = restore(self, which)
            for key, value in self.work.items():  # what this rank read and wrote
                arrays[f"work_{key}"] = np.array(value)
            for name, t in self.dynamic.transformers.items() if self.dynamic is not None else []:
                state = t.local.state_dict()
                arrays[f"resident_ids_{name}"] = state["ids"].numpy()
                arrays[f"resident_rows_{name}"] = self.dynamic.rows[name].read(state["slots"]).numpy()
                arrays[f"capacity_{name}"] = np.array(t.local.capacity)
            return step

        Checkpointer.restore = spy
        at20 = os.path.join(ck, "step-00000020")
        keep("restored", train(config(optimizer, dynamic=dynamic, steps=20, resume=at20, ps=ps), collect_tables=True))
        Checkpointer.restore = restore
        cfg = config(
            optimizer,
            dynamic=dynamic,
            steps=30,
            resume=at20,
            ps=ps,
            checkpoint_dir=os.path.join(out, f"ck{world}"),
            checkpoint_at_end=True,
        )
        keep("trained", train(cfg))
    np.savez(os.path.join(out, f"{phase}-{world}-rank{rank}.npz"), **arrays)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
