"""Model quality of dynamic tables against full tables with the hashing trick (issue 21).

    .venv/bin/python bench/quality_bench.py                       # synthetic data written as TSV
    .venv/bin/python bench/quality_bench.py --source day_0.tsv    # a Criteo-format file of yours

Three `dynemb train` runs (one process each, embedded PS) with the same model, seed and data,
one pass over the training lines (every --eval-fraction-th line held out, or --eval-source):

  (a) exact: every ID its own row. The IDs of TSV data are 64-bit hashes, so a full table
      cannot hold them exactly (it can only hash them into its rows); (a) is a dynamic table
      with capacity >= the distinct IDs of the largest table: no ID is ever evicted, no two
      IDs share a row, and rows start from the same initializer as a full table's;
  (b) dynamic tables at --fraction (20%) of the distinct IDs of the largest table: IDs come
      and go, and an evicted ID's row waits on the PS until it is seen again;
  (c) full tables with exactly (b)'s rows (`--no-dynamic --universe R`): each ID takes row
      id mod R, the hashing trick, and IDs that collide share a row.

Every table gets the same row count R (the largest table's distinct IDs times --fraction) in
(b) and (c), so both hold the same memory. Printed: AUC and log-loss of each, side by side, and
the goals: (b) within 0.002 AUC of (a); (b) ahead of (c).

The synthetic data is the trainer's own generator (dynemb/trainer/data.py: Zipf IDs, a label
that depends on a hidden score of each ID and on the dense features), written as Criteo lines:
label, 13 integer columns (round(100 * (e^x - 1)) of each dense x), 26 hex columns (the ID).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_synthetic_tsv(path: Path, lines: int, universe: int, zipf: float, seed: int, batch: int = 4096) -> None:
    """`lines` samples of the trainer's synthetic generator as Criteo lines."""
    from dynemb.trainer.config import DataConfig
    from dynemb.trainer.data import SyntheticCriteo

    data = SyntheticCriteo(DataConfig(universe=universe, zipf=zipf, data_seed=seed), batch)
    line = "\t".join(["%d"] * (1 + data.cfg.num_dense) + ["%08x"] * data.cfg.num_sparse) + "\n"
    with open(path, "w") as f:
        for k in range(math.ceil(lines / batch)):
            b = data.batch(k)
            n = min(batch, lines - k * batch)
            dense = np.rint(100 * np.expm1(b.dense_features.numpy()[:n])).astype(np.int64)
            ids = b.sparse_features.values().numpy().reshape(data.cfg.num_sparse, batch)[:, :n].T  # per sample
            table = np.concatenate([b.labels.numpy()[:n, None].astype(np.int64), dense, ids], axis=1)
            f.write("".join(line % tuple(row) for row in table.tolist()))


def has_eval_source() -> bool:
    from dynemb.trainer.config import DataConfig

    return "eval_source" in {f.name for f in dataclasses.fields(DataConfig)}


def train(name: str, flags: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "dynemb.trainer", *flags, "--no-progress", "--result-json", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"quality_bench: run {name} failed: {' '.join(cmd)}\n{done.stderr[-4000:]}")
    if "Out of bounds" in done.stderr:
        sys.exit(f"quality_bench: run {name}: FBGEMM looked IDs up out of bounds:\n{done.stderr[-2000:]}")
    got = json.loads(out.read_text())
    got["seconds"] = time.perf_counter() - start
    got["steps"] = len(got["losses"])
    print(
        f"  {name}: {got['steps']} steps, AUC {got['auc']:.4f}, log-loss {got['logloss']:.4f} ({got['seconds']:.0f} s)",
        flush=True,
    )
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", help="a Criteo TSV file (or folder); default: synthetic data written to a file")
    p.add_argument(
        "--eval-source",
        help="held-out Criteo TSV file (or folder), where the trainer has --eval-source; "
        "default: every --eval-fraction-th line of the source",
    )
    p.add_argument("--lines", type=int, default=400_000, help="synthetic: lines written (training + held out)")
    p.add_argument("--universe", type=int, default=100_000, help="synthetic: IDs per feature drawn from")
    p.add_argument("--zipf", type=float, default=1.05, help="synthetic: skew of the ID draw")
    p.add_argument("--data-seed", type=int, default=0, help="synthetic: which data")
    p.add_argument("--fraction", type=float, default=0.2, help="rows of (b) and (c), as a share of the distinct IDs")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of the source's lines held out")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", default="rowwise_adagrad")
    p.add_argument("--seed", type=int, default=0, help="the model's seed, the same in the three runs")
    p.add_argument("--keep", help="keep the synthetic file here")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.eval_source and not has_eval_source():
        p.error("--eval-source: this trainer has no --eval-source yet (use --eval-fraction)")

    with tempfile.TemporaryDirectory() as tmp:
        if args.source:
            source = Path(args.source)
            what = f"{source}"
        else:
            source = Path(args.keep) if args.keep else Path(tmp) / "synthetic.tsv"
            t0 = time.perf_counter()
            write_synthetic_tsv(source, args.lines, args.universe, args.zipf, args.data_seed)
            what = (
                f"synthetic Criteo TSV: {args.lines:,} lines, Zipf {args.zipf} over {args.universe:,} IDs per "
                f"feature (written in {time.perf_counter() - t0:.0f} s)"
            )
        from dynemb.trainer.data import distinct_ids, tsv_files

        files = tsv_files(str(source)) + (tsv_files(args.eval_source) if args.eval_source else [])
        distinct = distinct_ids(files, num_dense=13, num_sparse=26, progress=False)
        largest = max(distinct)
        rows = max(1, math.ceil(args.fraction * largest))
        print(f"quality_bench: {what}")
        print(
            f"  distinct IDs per table: {min(distinct):,} to {largest:,} ({sum(distinct):,} in all); "
            f"rows per table: (a) {largest:,}, (b) and (c) {rows:,} ({args.fraction:.0%} of {largest:,})"
        )
        common = [
            *("--source", str(source)),
            *(("--eval-source", args.eval_source, "--eval-fraction", "0") if args.eval_source else ()),
            *(() if args.eval_source else ("--eval-fraction", str(args.eval_fraction))),
            *("--steps", "1000000000"),  # one pass: the data runs out first
            *("--batch-size", str(args.batch_size), "--dim", str(args.dim), "--dense-arch", f"64,{args.dim}"),
            *("--optimizer", args.optimizer, "--seed", str(args.seed), "--log-every", "1000000"),
        ]
        out = Path(tmp)
        runs = {}
        runs["a"] = train(
            "(a) exact: dynamic, capacity >= distinct IDs", [*common, "--capacity", str(largest)], out / "a.json"
        )
        runs["b"] = train(
            f"(b) dynamic tables at {args.fraction:.0%}", [*common, "--capacity", str(rows)], out / "b.json"
        )
        runs["c"] = train(
            f"(c) full tables at {args.fraction:.0%}, hashing trick",
            [*common, "--no-dynamic", "--universe", str(rows)],
            out / "c.json",
        )

    a, b, c = runs["a"], runs["b"], runs["c"]
    print()
    print(f"  {'':<46}{'AUC':>8}{'log-loss':>10}{'rows/table':>12}{'hit rate':>10}")
    for key, label, r in (
        ("a", "(a) exact (dynamic, no eviction)", largest),
        ("b", f"(b) dynamic, {args.fraction:.0%}", rows),
        ("c", f"(c) full + hashing trick, {args.fraction:.0%}", rows),
    ):
        got = runs[key]
        hit = f"{got['hit_rate']:.3f}" if key != "c" else "-"
        print(f"  {label:<46}{got['auc']:>8.4f}{got['logloss']:>10.4f}{r:>12,}{hit:>10}")
    d_ba, d_bc = b["auc"] - a["auc"], b["auc"] - c["auc"]
    goal1, goal2 = abs(d_ba) <= 0.002, d_bc > 0
    print(
        f"  AUC (b) - (a) {d_ba:+.4f}   goal: within 0.002: {'met' if goal1 else 'NOT met'}\n"
        f"  AUC (b) - (c) {d_bc:+.4f}   goal: > 0: {'met' if goal2 else 'NOT met'}\n"
        f"  log-loss (b) - (a) {b['logloss'] - a['logloss']:+.4f}, (b) - (c) {b['logloss'] - c['logloss']:+.4f}; "
        f"{b['steps']} training steps of {args.batch_size} each run; {platform.node() or 'this machine'}, "
        f"{os.cpu_count()} CPUs"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"distinct": distinct, "rows": rows, "runs": {k: v | {"losses": None} for k, v in runs.items()}})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
