"""The sharded transform of a trainer step, alone: transform_tables over N gloo ranks on CPU.

    .venv/bin/python bench/transform_tables_bench.py               # 2 ranks, train_bench's shape

Each rank transforms, per step, one batch of IDs per table (26 tables, --batch per rank, Zipf
1.05 over --universe, --capacity slots per rank and table: train_bench's defaults at 10%), with
pin=True, and releases the batch two steps later, as the trainer's pipeline does. The first
--warmup steps fill the tables. Printed per rank: ms per step of transform_tables (median and
mean), and the median of the main thread's CPU time in it (steadier than wall time on a busy
machine: it leaves out waiting and gloo's threads). --nproc 1 has nothing to exchange: the
local work alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from idtransformer.policy import EvictionPolicy  # noqa: E402
from idtransformer.sharded import ShardedIDTransformer, transform_tables  # noqa: E402
from trainer.zipf import BoundedZipf  # noqa: E402


def worker(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.nproc)
    tables = [ShardedIDTransformer(args.capacity, EvictionPolicy("hybrid")) for _ in range(args.tables)]
    rng = np.random.default_rng([rank, 1])
    steps = args.warmup + args.steps
    draw = BoundedZipf(1.05, args.universe)  # as the trainer's synthetic data
    batches = [[torch.from_numpy(draw(rng, args.batch) - 1) for _ in tables] for _ in range(steps)]
    total, cpu, in_flight = [], [], []
    for k, ids in enumerate(batches):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        results = transform_tables(tables, ids, pin=True)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        in_flight.append(results)
        if len(in_flight) > 2:
            for t, out in zip(tables, in_flight.pop(0)):
                t.release(out)
        if k >= args.warmup:
            total.append(elapsed * 1e3)
            cpu.append(elapsed_cpu * 1e3)
    line = (f"rank {rank}: transform_tables {statistics.median(total):.2f} ms median, "
            f"{statistics.mean(total):.2f} mean, main-thread CPU {statistics.median(cpu):.2f} median "
            f"({args.steps} steps)")
    print(line, flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--universe", type=int, default=100_000)
    p.add_argument("--capacity", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, (args, str(Path(tmp) / "init")), nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
