"""Run by torchrun from tests/tables/test_tables_dist.py: set-up mistakes on 2 ranks, each
rank printing the one line it was told (none may hang in a collective or crash with a KeyError)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import leave_process_groups  # noqa: E402
from tables_models import CONFIGS, Tiny  # noqa: E402
from torchrec.distributed import DistributedModelParallel  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad  # noqa: E402

from dynemb import tables as dt  # noqa: E402


def told(make) -> str:
    try:
        make()
    except dt.SetupError as exc:
        return str(exc)
    return "no error"


def model(rows: int):
    m = Tiny(rows)
    apply_optimizer_in_backward(RowWiseAdagrad, m.ebc.parameters(), {"lr": 0.1})
    return m


def mistakes(rank: int) -> None:
    uneven = dt.shard_model(model(81), CONFIGS)  # 81 rows on 2 ranks
    print(f"rank {rank} uneven: {told(lambda: dt.DynamicEmbeddings(uneven, CONFIGS))}", flush=True)
    planned = DistributedModelParallel(model(80), device=torch.device("cpu"))  # TorchRec's own plan
    print(f"rank {rank} planned: {told(lambda: dt.DynamicEmbeddings(planned, CONFIGS))}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    mistakes(dist.get_rank())  # its models gone with it, before the groups are
    leave_process_groups()


if __name__ == "__main__":
    main()
