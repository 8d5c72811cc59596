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
    .venv/bin/python bench/train_bench.py --device cuda --dlrm-sizes --batch-size 8192   # issue 43's figure

--dlrm-sizes trains at a DLRM's sizes rather than a smoke test's: embedding dim 128, a bottom
MLP of 512,256,128, 1,000,000 IDs a table drawn Zipf(1.05), 100 steps, a capacity of a tenth
of each table (a hit rate near 0.9). The two runs see the same batches from the same seed, so
their losses agree (dynamic tables train exactly like full ones); the largest relative gap
between the two runs' losses over the steps, and between their AUCs, is printed with the speeds.
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


def agreement(full: dict, dyn: dict) -> str:
    """How far apart the two runs' losses (step by step) and AUCs are, relative to the full run's."""
    pairs = list(zip(full["losses"], dyn["losses"]))
    loss_gap = max((abs(a - b) / max(abs(a), 1e-12) for a, b in pairs), default=float("nan"))
    auc_gap = abs(full["auc"] - dyn["auc"]) / max(abs(full["auc"]), 1e-12)
    return f"same run? losses within {loss_gap:.1e} relative over {len(pairs)} steps, AUC within {auc_gap:.1e}"


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
    p.add_argument("--dim", type=int, default=None, help="embedding dim [default: the trainer's, 16]")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the IDs [default: the trainer's]")
    p.add_argument(
        "--dlrm-sizes",
        action="store_true",
        help="dim 128, bottom MLP 512,256,128, 1,000,000 IDs a table, 100 steps (unless given otherwise)",
    )
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
    given = set(argv if argv is not None else sys.argv[1:])
    if args.dlrm_sizes:  # what a flag given beside it says wins
        args.dim = args.dim or 128
        args.universe = args.universe if "--universe" in given else 1_000_000
        args.steps = args.steps if "--steps" in given else 100
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
    if args.dim is not None:
        bottom = [512, 256, args.dim] if args.dlrm_sizes else [64, args.dim]
        common += ["--dim", str(args.dim), "--dense-arch", ",".join(map(str, bottom))]
    if args.zipf is not None:
        common += ["--zipf", str(args.zipf)]
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
            print(f"  {head}{agreement(full, dyn)}")
    if args.pairs > 1:
        print(
            f"  ratios {' '.join(f'{r:.2f}' for r in ratios)}   mean {statistics.mean(ratios):.2f}   "
            f"median {statistics.median(ratios):.2f}   (goal >= 0.8)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
