"""The sharded transform of a trainer step, alone: over N gloo ranks on CPU, batch by batch
with transform_tables (three exchanges a batch) and as a stream (TransformStream: one).

    .venv/bin/python bench/transform_tables_bench.py               # 2 ranks, train_bench's shape

Each rank transforms, per step, one batch of IDs per table (26 tables, --batch per rank, Zipf
1.05 over --universe, --capacity slots per rank and table: train_bench's defaults at 10%), with
pin=True, and releases the batch two steps later, as the trainer's pipeline does. The first
--warmup steps fill the tables. Both ways run on the same batches, in --rounds alternating
rounds (this machine's speed drifts). Printed per rank and way: ms per step (median and
mean); the median of the main thread's CPU time a step (steadier than wall time on a busy
machine: it leaves out waiting and gloo's threads); and the whole process's CPU time a step,
gloo's threads included. --nproc 1 has nothing to exchange: the local work alone.
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

from dynemb.idtransformer.policy import EvictionPolicy  # noqa: E402
from dynemb.idtransformer.sharded import ShardedIDTransformer, release_tables, transform_tables  # noqa: E402
from dynemb.idtransformer.stream import TransformStream  # noqa: E402
from dynemb.trainer.zipf import BoundedZipf  # noqa: E402


def blocks_steps(tables, batches, warmup: int) -> tuple[list[float], list[float], float]:
    """transform_tables step by step (three exchanges each): per timed step, wall ms and the
    main thread's CPU ms; and the process's CPU ms per timed step (gloo's threads included)."""
    total, cpu, in_flight = [], [], []
    for k, ids in enumerate(batches):
        if k == warmup:
            start_process = time.process_time()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        results = transform_tables(tables, ids, pin=True)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        in_flight.append(results)
        if len(in_flight) > 2:  # released two steps later, as the trainer's pipeline does
            release_tables(tables, in_flight.pop(0))
        if k >= warmup:
            total.append(elapsed * 1e3)
            cpu.append(elapsed_cpu * 1e3)
    return total, cpu, (time.process_time() - start_process) * 1e3 / (len(batches) - warmup)


def stream_steps(tables, batches, warmup: int) -> tuple[list[float], list[float], float]:
    """The same batches through a TransformStream (one exchange each), timed alike: a step is
    an exchange and the transform of the share received."""
    stream = TransformStream(tables, pin=True)
    total, cpu, in_flight = [], [], []
    upcoming = iter(batches)

    def next_batch():
        ids = next(upcoming, None) if stream.taking else None
        return (None, None) if ids is None else (torch.cat(ids), [x.numel() for x in ids])

    stream.exchange(*next_batch())
    k = 0
    while stream.open:
        if k == warmup:
            start_process = time.process_time()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        stream.exchange(*next_batch())
        if stream.received is not None:
            while len(in_flight) > 2:
                release_tables(tables, in_flight.pop(0))
            in_flight.append(stream.transform_received())
        elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        if warmup <= k < len(batches):
            total.append(elapsed * 1e3)
            cpu.append(elapsed_cpu * 1e3)
        k += 1
    return total, cpu, (time.process_time() - start_process) * 1e3 / (len(batches) - warmup)


def worker(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.nproc)
    rng = np.random.default_rng([rank, 1])
    steps = args.warmup + args.steps
    draw = BoundedZipf(1.05, args.universe)  # as the trainer's synthetic data
    batches = [[torch.from_numpy(draw(rng, args.batch) - 1) for _ in range(args.tables)] for _ in range(steps)]
    modes = {"transform_tables": blocks_steps, "stream": stream_steps}
    for round_ in range(args.rounds):  # alternating, so both see the machine alike
        for mode, run in modes.items():
            tables = [ShardedIDTransformer(args.capacity, EvictionPolicy("hybrid")) for _ in range(args.tables)]
            total, cpu, process = run(tables, batches, args.warmup)
            print(
                f"rank {rank} round {round_} {mode:>16}: {statistics.median(total):.2f} ms median a step, "
                f"{statistics.mean(total):.2f} mean; CPU a step: main thread {statistics.median(cpu):.2f} "
                f"median, process {process:.2f} ({args.steps} steps)",
                flush=True,
            )
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
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both modes")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, (args, str(Path(tmp) / "init")), nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
