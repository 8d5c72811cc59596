"""Where a triton transform's time goes: torch.profiler over a few batches of the
idtransformer_bench stream, after a warm-up that fills the table.

    python3 bench/idtransformer_profile.py                        # on a GPU machine
    python3 bench/idtransformer_profile.py --tables 26 --batch 65536
    TRITON_INTERPRET=1 .venv/bin/python bench/idtransformer_profile.py --device cpu --capacity 64 \
        --batch 40 --universe 500 --warmup 2 --batches 2    # smoke run on CPU

Printed: wall time per batch (timed on batches apart from the profiled ones), the device's
busy time per batch (the sum of its kernels and copies), device operations per batch, and the
top operators by device time (CPU time on CPU).
With --trace FILE, the Chrome trace too. Read it against the goal of issue 31 (1e9 IDs/s):
a wall time far over the busy time is launch and host overhead, not kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.idtransformer_bench import sync, table_batch, zipf_batches  # noqa: E402
from dynemb.idtransformer.many import transform_many  # noqa: E402
from dynemb.idtransformer.policy import EvictionPolicy  # noqa: E402
from dynemb.idtransformer.transformer import IDTransformer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=262_144)
    p.add_argument("--universe", type=int, default=10**8)
    p.add_argument("--tables", type=int, default=1)
    p.add_argument("--warmup", type=int, default=20, help="batches before profiling [default %(default)s]")
    p.add_argument("--batches", type=int, default=5, help="timed batches, then as many profiled [default %(default)s]")
    p.add_argument("--top", type=int, default=25, help="operators listed [default %(default)s]")
    p.add_argument("--trace", type=Path, help="also write the Chrome trace here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    tables = [
        IDTransformer(args.capacity, EvictionPolicy("hybrid", evict_fraction=0.05), device=device, backend="triton")
        for _ in range(args.tables)
    ]
    sizes = [args.batch] * args.tables
    bases = [k * args.capacity for k in range(args.tables)]
    batches = [
        table_batch(b, args.tables, device)
        for b in zipf_batches(args.warmup + 2 * args.batches, args.batch, args.universe, seed=0)
    ]

    def transform(x: torch.Tensor) -> None:
        if args.tables == 1:
            tables[0].transform(x)
        else:
            transform_many(tables, x, sizes, bases=bases)

    for x in batches[: args.warmup]:
        transform(x)
    sync(device)
    # timed without the profiler (its start, stop and per-operator records are not the pass's)
    start = time.perf_counter()
    for x in batches[args.warmup : args.warmup + args.batches]:
        transform(x)
    sync(device)
    wall = (time.perf_counter() - start) / args.batches
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for x in batches[args.warmup + args.batches :]:
            transform(x)
        sync(device)
    events = prof.key_averages()
    n = args.batches
    if cuda:
        # the device's own records (kernels, copies, fills): an operator's self device time repeats its kernels'
        busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / n / 1e3
        launches = sum(e.count for e in events if e.device_type == DeviceType.CUDA)
        sort = "self_device_time_total"
    else:
        busy, launches, sort = float("nan"), 0, "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    ids = args.batch * args.tables
    print(
        f"idtransformer_profile: {args.tables} table(s), batches of {args.batch:,} IDs, capacity {args.capacity:,}, "
        f"{torch.cuda.get_device_name() if cuda else 'cpu'}"
    )
    print(f"  wall per batch (unprofiled)   {wall * 1e3:9.2f} ms   {ids / wall:,.0f} IDs/s")
    print(f"  device busy per batch         {busy:9.2f} ms   (profiled batches)")
    print(f"  device ops per batch          {launches / n:9.1f}   (kernels, copies, fills)")
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
