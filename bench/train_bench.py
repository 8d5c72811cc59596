"""Training throughput with dynamic tables against plain TorchRec with full tables.

    .venv/bin/python bench/train_bench.py                # 2 torchrun ranks on CPU (gloo)

Both runs train the same DLRM (26 tables) on the same synthetic batches with `torchrun
--nproc_per_node N -m dynemb.trainer`; the dynamic run keeps --capacity-fraction of each table's
IDs on the devices and every row in the PS: by default the embedded store in each rank's
process (the trainer's default without --ps), with --ps-process in a PS process on this
machine that every rank reaches through gRPC (and shared memory for the rows). The full run
holds every ID in plain row-wise sharded TorchRec tables. Printed: samples/s of each (all
ranks, timed over the training loop only, start-up and evaluation excluded) and the ratio
(goal >= 0.8).

    .venv/bin/python bench/train_bench.py --ps-process   # the rows in a PS process
    .venv/bin/python bench/train_bench.py --pairs 3      # 3 alternating pairs, their mean and median
    .venv/bin/python bench/train_bench.py --device cuda  # one rank per GPU (NCCL), both runs on the GPUs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dynemb.testing.local_ps import LocalPS  # noqa: E402


def run(nproc: int, extra: list[str], out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *"-m dynemb.trainer --no-progress --result-json".split(),
        str(out),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // nproc)))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"train_bench: {' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    print("   ", done.stdout.strip().splitlines()[-1])
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="both runs' --device: cuda (one rank per GPU, NCCL), cpu (gloo), auto: cuda when a GPU is visible",
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks [default: 2 on the CPU, one per GPU on cuda]")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--universe", type=int, default=100_000)
    p.add_argument("--capacity-fraction", type=float, default=0.1)
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="plain and dynamic runs in this many alternating pairs; each pair's ratio, then their "
        "mean and median (the plain run alone moves by ~20%% between runs on a 2-core machine)",
    )
    p.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="the dynamic run's --prefetch (batches transformed ahead by a thread); default: the trainer's",
    )
    p.add_argument(
        "--transform-priority",
        default=None,
        choices=("idle", "low", "normal"),
        help="the dynamic run's --transform-priority; default: the trainer's",
    )
    p.add_argument(
        "--ps-process",
        action="store_true",
        help="the dynamic run's rows in a PS process (dynemb ps serve, embedded backend) on this "
        "machine rather than in each rank's process",
    )
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is visible")
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if device == "cuda" else 2
    common = [
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--universe",
        str(args.universe),
        "--optimizer",
        args.optimizer,
        "--eval-batches",
        "2",
        "--device",
        device,
    ]
    dynamic = ["--capacity-fraction", str(args.capacity_fraction)]
    if args.prefetch is not None:
        dynamic += ["--prefetch", str(args.prefetch)]
    if args.transform_priority is not None:
        dynamic += ["--transform-priority", args.transform_priority]
    print(
        f"train_bench: DLRM, 26 tables, {args.nproc} ranks "
        f"({'NCCL, one GPU each' if device == 'cuda' else 'gloo, CPU'}), {args.steps} steps of {args.batch_size} "
        f"per rank, universe {args.universe:,} IDs per table, {args.optimizer}"
    )
    where = "a PS process" if args.ps_process else "in-process PS"
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            full = run(args.nproc, common + ["--no-dynamic"], Path(tmp) / "full.json")
            with contextlib.ExitStack() as stack:
                ps = ["--ps", stack.enter_context(LocalPS("--log-level", "WARNING")).address] if args.ps_process else []
                dyn = run(args.nproc, common + dynamic + ps, Path(tmp) / "dyn.json")
            ratios.append(dyn["samples_per_second"] / full["samples_per_second"])
            head = f"pair {pair + 1}: " if args.pairs > 1 else ""
            print(
                f"  {head}plain TorchRec, full tables           {full['samples_per_second']:>10,.0f} samples/s   "
                f"AUC {full['auc']:.4f}"
            )
            print(
                f"  {head}dynamic tables at {args.capacity_fraction:.0%}, {where:<13} "
                f"{dyn['samples_per_second']:>10,.0f} samples/s   AUC {dyn['auc']:.4f}   "
                f"hit rate {dyn['hit_rate']:.3f}"
            )
            print(f"  {head}ratio dynamic / full                  {ratios[-1]:>10.2f}   (goal >= 0.8)")
    if args.pairs > 1:
        print(
            f"  ratios {' '.join(f'{r:.2f}' for r in ratios)}   mean {statistics.mean(ratios):.2f}   "
            f"median {statistics.median(ratios):.2f}   (goal >= 0.8)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
