"""Run by torchrun from tests/checkpoint/test_checkpoint.py: a 2-rank job with dynamic tables in each
rank's own store checkpoints at step 10, and
- write: on rank 0 writing a table's first rows fails (ENOSPC, as on a full disk) while rank
  1 is still sending it that table's rows;
- read: on rank 1 reading its rows fails.
Each rank writes what it raised, and what a collective after it gave, to OUT/rank{r}.txt."""

from __future__ import annotations

import errno
import faulthandler
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import config, leave_process_groups  # noqa: E402

from dynemb.checkpoint.format import CheckpointError  # noqa: E402
from dynemb.checkpoint.table_files import TableWriter  # noqa: E402
from dynemb.tables.row_store import LocalRowStore  # noqa: E402
from dynemb.trainer.train import train  # noqa: E402


def no_space(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def store_gone(self, table):
    raise RuntimeError("the store is gone")


def main() -> None:
    out, fault = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(300, exit=True)  # a rank left waiting prints its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if fault == "write" and rank == 0:  # fails in the middle of the gathered rows: rank 1's are still to come
        TableWriter.write = no_space
    if fault == "read" and rank == 1:
        LocalRowStore.export = store_gone
    try:
        train(config("adagrad", dynamic=True, steps=20, checkpoint_dir=os.path.join(out, "ck"), checkpoint_every=10))
        said = "no error"
    except CheckpointError as exc:
        said = f"CheckpointError: {exc}"
    # the ranks' collectives still pair up: each gets the others' own words
    words = [None] * dist.get_world_size()
    dist.all_gather_object(words, f"rank {rank} after the failed save")
    said += "\n" + "; ".join(words)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(said)
    leave_process_groups()  # no gloo thread left to abort the exit


if __name__ == "__main__":
    main()
