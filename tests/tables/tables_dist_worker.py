"""Run by torchrun from tests/tables/test_tables_dist.py: an own model on every rank, with full
tables, then with DynamicEmbeddings in each way a loop can take its batches (plain, a thread
transforming ahead, TorchRec's TrainPipelineSparseDist with and without it; "_eval": with an
evaluation pass every EVAL_EVERY steps inside the training loop), the user making no process
group; each rank saves its losses to OUT/rank{r}.npz. Argument 2: PS addresses or "embedded".
tests/tables/test_eval_in_training.py runs `run` in one process too."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import leave_process_groups  # noqa: E402
from tables_models import CONFIGS, UNIVERSE, build, train_step  # noqa: E402
from torch import nn  # noqa: E402
from torchrec import KeyedJaggedTensor  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402

from dynemb import tables as dt  # noqa: E402

STEPS = 24
CAPACITY = 160  # 80 rows a rank, of the 400 IDs a table sees
EVAL_EVERY = 8


def batches(rank: int, steps: int = STEPS, size: int = 12):
    gen = torch.Generator().manual_seed(11 + rank)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * size,), generator=gen)
        values = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * UNIVERSE).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user_id", "item_id"], values=values, lengths=lengths)
        yield Batch(torch.zeros(size, 1), kjt, (torch.rand(size, generator=gen) < 0.5).float())


class Trained(nn.Module):
    """What TrainPipelineSparseDist runs: batch in, (loss, output) out; the output is the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch):
        logits = self.model(batch.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, loss.detach()


HERE = "_here"


def run(mode: str, store: str | None, rank: int) -> list[float]:
    rows = UNIVERSE if mode == "full" else CAPACITY
    model, dense = build(rows)
    if mode == "full":
        return [train_step(model, dense, b.sparse_features, b.labels) for b in batches(rank)]
    prefix = f"{mode}_"
    evaluating = mode.endswith("_eval")
    mode = mode.removesuffix("_eval")
    pipelined = mode.startswith("pipeline")
    prefetch = 1 if mode.endswith("prefetch") else 0
    losses: list[float] = []
    with dt.DynamicEmbeddings(model, CONFIGS, store=store, table_prefix=prefix) as dyn:
        data = dyn.wrap(batches(rank), in_flight=3 if pipelined else 1, prefetch=prefetch)
        if not pipelined:
            for b in data:
                losses.append(train_step(model, dense, b.sparse_features, b.labels))
                if evaluating and len(losses) % EVAL_EVERY == 0:
                    evaluate(dyn, model, rank)
        else:
            from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
            from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

            # the pipeline steps one optimizer: the dense one, beside the fused tables' own
            opt = CombinedOptimizer([KeyedOptimizerWrapper(dict(model.named_parameters()), lambda _: dense)])
            pipeline = TrainPipelineSparseDist(Trained(model).train(), opt, torch.device("cpu"))  # type: ignore[arg-type]
            while True:
                try:
                    loss = pipeline.progress(data)
                except StopIteration:
                    break
                losses.append(float(loss))
                if evaluating and len(losses) % EVAL_EVERY == 0:
                    trained = pipeline.detach()  # the model's own forward, the batches in flight kept
                    evaluate(dyn, model, rank)
                    pipeline.attach(trained)
    return losses


def evaluate(dyn: dt.DynamicEmbeddings, model: nn.Module, rank: int) -> None:
    """A pass over held-out batches (IDs training has not seen among them) inside the loop."""
    with torch.no_grad():
        for b in dyn.wrap(batches(rank + 100, steps=3), train=False):
            model(b.sparse_features)


def main() -> None:
    out, store = sys.argv[1], sys.argv[2]
    import faulthandler

    faulthandler.dump_traceback_later(200, exit=True)  # a hung collective prints its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # a mode ending in HERE runs over the ranks' own embedded stores whatever `store` is: the
    # same loop over two stores, for a bit-for-bit comparison of their losses
    got = {
        m: run(m.removesuffix(HERE), None if store == "embedded" or m.endswith(HERE) else store, rank)
        for m in sys.argv[3].split(",")
    }
    np.savez(os.path.join(out, f"rank{rank}.npz"), **{m: np.array(v) for m, v in got.items()})
    leave_process_groups()


if __name__ == "__main__":
    main()
