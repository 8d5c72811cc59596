"""ID transformer throughput and hit rate against TorchRec's MCHManagedCollisionModule.

    .venv/bin/python bench/idtransformer_bench.py                     # CPU, the issue's setting
    python3 bench/idtransformer_bench.py --device cuda                # on a GPU machine
    TRITON_INTERPRET=1 .venv/bin/python bench/idtransformer_bench.py --backends triton --capacity 64 \
        --batch 40 --universe 500 --warmup 2 --batches 2 --skip-mch  # smoke run of the triton pass on CPU
    python3 bench/idtransformer_bench.py --device cuda --tables 26 --batch 65536   # a DLRM step's 26 tables

--backends picks which of our backends run, one after the other on the same batches: by
default the kernel on CPU; on CUDA the triton backend (where triton imports) and the torch
ops, each with its host syncs per batch (torch's sync debug mode) beside its IDs/s.

A Zipf(1.05) stream over 10^8 distinct IDs (rank r → a fixed scrambled 62-bit ID; rank r has
probability ~ r^-1.05 among the 10^8, dynemb/trainer/zipf.py), batches of 262,144, capacity 10^6.
--folded draws the stream of sessions 1-9 instead: numpy's unbounded Zipf folded into the
universe (% 10^8), where ~40% of the draws exceed 10^8 and land spread evenly over it (a
stream that is 40% IDs never seen again). Both sides first see --warmup batches (the table fills and
eviction starts), then the same --batches timed batches. MCH: DistanceLFU eviction,
eviction_interval 10 (its eviction cost is inside its timing, as ours is).

--tables N: N tables of --capacity each, every batch --batch IDs for each (table t's are the
stream's IDs scrambled by a bijection of its own: the same hit statistics, other IDs), all
tables of a batch in one call (transform_many: on triton one pass for all); IDs/s counts every
table's. MCH is timed on table 0's stream alone (its tables run one after the other anyway).

Printed: IDs/s of each and the ratio (goal >= 10x MCH; the first backend's), hit rate of each
(share of the batch's IDs already resident before the batch; goal >= MCH's), resident bytes
per ID (goal <= 32), and for the triton backend its host copies per batch (1 by design).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.idtransformer.many import transform_many  # noqa: E402
from dynemb.idtransformer.policy import EvictionPolicy  # noqa: E402
from dynemb.idtransformer.transformer import IDTransformer  # noqa: E402
from dynemb.trainer.zipf import BoundedZipf  # noqa: E402


def zipf_batches(n_batches: int, batch: int, universe: int, seed: int, folded: bool = False) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    draw = BoundedZipf(1.05, universe)
    out = []
    for _ in range(n_batches):
        rank = ((rng.zipf(1.05, batch) % universe) if folded else draw(rng, batch) - 1).astype(np.uint64)
        with np.errstate(over="ignore"):  # scramble: rank → a fixed 62-bit ID
            ids = (rank * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(2)
        out.append(torch.from_numpy(ids.astype(np.int64)))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def table_batch(b: torch.Tensor, tables: int, device: torch.device) -> torch.Tensor:
    """The batch of every table, end to end: table t's IDs are b's, scrambled by t (a bijection)."""
    x = b.to(device)
    if tables == 1:
        return x
    salts = torch.arange(tables, dtype=torch.int64, device=device) * 0x5851F42D4C957F2D
    return (x.unsqueeze(0) ^ salts.unsqueeze(1)).reshape(-1)


def run_ours(args, batches, device, backend: str) -> dict:
    tables = [
        IDTransformer(
            args.capacity,
            EvictionPolicy("hybrid", evict_fraction=args.evict_fraction),
            device=device,
            backend=backend,
            admit_threshold=args.admit_threshold,
        )
        for _ in range(args.tables)
    ]
    t = tables[0]
    sizes = [args.batch] * args.tables
    bases = [k * args.capacity for k in range(args.tables)]

    def transform(x: torch.Tensor) -> list:
        if args.tables == 1:
            return [t.transform(x).hits]
        many = transform_many(tables, x, sizes, bases=bases)
        return [many.hits] if many.flat is not None else [r.hits for r in many.results if r is not None]

    hits = total = timed = 0
    elapsed = 0.0
    copies = [0]
    if t.backend == "triton":  # count the map's device-to-host copies through its one door
        from dynemb.idtransformer import bucket_map

        real = bucket_map.to_host

        def counted(counts):
            copies[0] += 1
            return real(counts)

        bucket_map.to_host = counted
    try:
        for k, b in enumerate(tqdm(batches, desc=f"idtransformer ({t.backend})", unit="batch", leave=False)):
            x = table_batch(b, args.tables, device)
            sync(device)
            if k == args.warmup:
                copies[0] = 0
            start = time.perf_counter()
            out = transform(x)
            sync(device)
            if k >= args.warmup:
                elapsed += time.perf_counter() - start
                hits += sum(sum(h) if isinstance(h, list) else int(h) for h in out)
                total += x.numel()
                timed += 1
    finally:
        if t.backend == "triton":
            bucket_map.to_host = real
    result = {
        "backend": t.backend,
        "ids_per_s": total / elapsed,
        "hit_rate": hits / total,
        "bytes_per_id": sum(x.nbytes for x in tables) / max(sum(len(x) for x in tables), 1),
        "resident": sum(len(x) for x in tables),
    }
    if t.backend == "triton":
        result["copies"] = copies[0] / max(timed, 1)
    if device.type == "cuda":
        last = table_batch(batches[-1], args.tables, device)  # (the copy to the device is not the transform's)
        result["syncs"] = count_syncs(lambda: transform(last))
    return result


def backends_for(device: torch.device, asked: str) -> list[str]:
    """The backends to run: those asked (comma-separated), or by default the device's."""
    if asked != "auto":
        return asked.split(",")
    if device.type != "cuda":
        return ["kernel"]
    from dynemb.idtransformer.backend import triton_available

    return ["triton", "torch"] if triton_available() else ["torch"]


def count_syncs(fn) -> int:
    """Host-device synchronisations during fn(), as torch's sync debug mode reports them."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run_mch(args, batches, device) -> dict:
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    mch = MCHManagedCollisionModule(
        zch_size=args.capacity,
        device=device,
        eviction_policy=DistanceLFU_EvictionPolicy(),
        eviction_interval=10,
        input_hash_size=(1 << 63) - 1,
    )
    mch.train()
    hits = total = 0
    elapsed = 0.0
    for k, b in enumerate(tqdm(batches, desc="MCH", unit="batch", leave=False)):
        x = b.to(device)
        resident = torch.isin(x, mch._mch_sorted_raw_ids)  # before this batch
        sync(device)
        start = time.perf_counter()
        # offsets given, so no fbgemm cumsum op is needed (the CPU fbgemm build has none for CUDA)
        ones = torch.ones(x.numel(), dtype=torch.int64, device=device)
        features = {"f": JaggedTensor(values=x, lengths=ones, offsets=torch.arange(x.numel() + 1, device=device))}
        mch.remap(mch.profile(features))
        sync(device)
        if k >= args.warmup:
            elapsed += time.perf_counter() - start
            hits += int(resident.sum())
            total += x.numel()
    return {"ids_per_s": total / elapsed, "hit_rate": hits / total}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=262_144)
    p.add_argument("--universe", type=int, default=10**8)
    p.add_argument("--warmup", type=int, default=20, help="batches before timing [default %(default)s]")
    p.add_argument("--batches", type=int, default=20, help="timed batches [default %(default)s]")
    p.add_argument("--evict-fraction", type=float, default=0.05)
    p.add_argument(
        "--tables", type=int, default=1, help="tables transformed together, --batch IDs each [default %(default)s]"
    )
    p.add_argument(
        "--backends",
        default="auto",
        help="ours to run, comma-separated, of kernel (CPU), torch, triton (CUDA; CPU under TRITON_INTERPRET=1); "
        "auto: kernel on CPU, triton and torch on CUDA [default %(default)s]",
    )
    p.add_argument(
        "--admit-threshold",
        type=int,
        default=1,
        help="sightings before an ID gets a slot (1: every ID at once, as MCH) [default %(default)s]",
    )
    p.add_argument("--skip-mch", action="store_true", help="time only ours (no ratio)")
    p.add_argument(
        "--folded",
        action="store_true",
        help="the stream of sessions 1-9: numpy's unbounded Zipf folded into the universe",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    batches = zipf_batches(args.warmup + args.batches, args.batch, args.universe, seed=0, folded=args.folded)
    print(
        f"idtransformer_bench: Zipf(1.05) over {args.universe:,} IDs{' (folded)' if args.folded else ''}, "
        f"batches of {args.batch:,}{f' for each of {args.tables} tables' if args.tables > 1 else ''}, capacity "
        f"{args.capacity:,}, {args.warmup} warm-up + {args.batches} timed batches, device {device}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    if args.tables < 1:
        p.error(f"--tables must be >= 1, got {args.tables}")
    names = backends_for(device, args.backends)
    unknown = sorted(set(names) - {"kernel", "torch", "triton"})
    if unknown:
        p.error(f"--backends: {', '.join(unknown)} not among kernel, torch, triton")
    runs = []
    for name in names:
        ours = run_ours(args, batches, device, name)
        runs.append(ours)
        extra = f"   host syncs per batch {ours['syncs']}" if "syncs" in ours else ""
        if "copies" in ours:
            extra += f"   host copies per batch {ours['copies']:.2f}"
        print(
            f"  idtransformer ({ours['backend']:<6})  {ours['ids_per_s']:>14,.0f} IDs/s   hit rate "
            f"{ours['hit_rate']:.4f}   {ours['bytes_per_id']:.1f} bytes per resident ID "
            f"({ours['resident']:,} resident){extra}"
        )
    if args.skip_mch:
        return 0
    try:
        import torchrec  # noqa: F401
    except ImportError:
        print("  MCH: torchrec does not import here, skipped")
        return 0
    ours = runs[0]
    mch = run_mch(args, batches, device)
    print(f"  MCH (DistanceLFU, 10)    {mch['ids_per_s']:>14,.0f} IDs/s   hit rate {mch['hit_rate']:.4f}")
    print(
        f"  ratio IDs/s ours / MCH   {ours['ids_per_s'] / mch['ids_per_s']:>14.2f}   (goal >= 10; hit rate >= MCH's; "
        f"<= 32 bytes per ID)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
