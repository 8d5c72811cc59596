"""Load test of one PS over Redis: many concurrent clients pulling and pushing for a while.

    .venv/bin/python bench/ps_load.py                    # 64 clients, 60 s (the release check)
    .venv/bin/python bench/ps_load.py --soak             # the same checks for an hour (release testing)
    .venv/bin/python bench/ps_load.py --clients 8 --seconds 10 --ids 20000   # a quick look

It starts a redis-server and `dynemb ps serve` over it (or uses --redis URL), fills a table of
--ids rows (dim 64 + 64 optimizer-state floats by default) so that Redis holds every row before
timing starts, then runs --clients clients, each pulling or pushing (half and half) batches of
--batch random ids as fast as it can. Printed: requests/s and rows/s, p50/p99/max latency per
method, errors by status code, and the PS's RSS and Redis' used_memory sampled every second.

Pass/fail (exit 1 with the reason): any error; PS RSS or Redis used_memory growing by more than
--max-growth between the end of the warm-up (--warmup, a share of the run) and the end: a PS that
serves a fixed working set must not keep growing.

Clients are threads spread over --procs processes (each its own PSClient, so its own channel):
on a small machine 64 clients as 64 processes would measure the operating system's scheduler
rather than the PS, while threads in one process would be limited by that process's GIL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLE = "load"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- the clients (in worker processes) ------------------------------------------------


def client_loop(address: str, ids: int, batch: int, width: int, stop_at: float, seed: int, out: dict) -> None:
    import grpc

    from ps_server.client import PSClient, RetryPolicy
    from ps_server.errors import PSError

    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((batch, width)).astype(np.float32)
    lat = {"pull": [], "push": []}
    errors: dict[str, int] = {}
    n_rows = 0
    # no retries: a load test must see every failure, not hide it behind a retry
    with PSClient(address, timeout=30, retry=RetryPolicy(attempts=1)) as ps:
        while (now := time.monotonic()) < stop_at:
            batch_ids = rng.integers(0, ids, batch)
            op = "pull" if rng.random() < 0.5 else "push"
            try:
                if op == "pull":
                    ps.pull(TABLE, batch_ids)
                else:
                    ps.push(TABLE, batch_ids, rows)
                lat[op].append((now, time.monotonic() - now))
                n_rows += batch
            except PSError as exc:
                code = getattr(exc, "code", grpc.StatusCode.UNKNOWN)
                errors[code.name] = errors.get(code.name, 0) + 1
    out.update(lat=lat, errors=errors, rows=n_rows)


def worker(address: str, clients: int, first_seed: int, args: dict, stop_at: float, queue) -> None:
    results = [dict() for _ in range(clients)]
    threads = [threading.Thread(target=client_loop, args=(address, args["ids"], args["batch"], args["width"], stop_at,
                                                          first_seed + k, results[k]))
               for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(results)


# -- the run --------------------------------------------------------------------------


def percentiles(samples: list[float]) -> dict:
    if not samples:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    a = np.array(samples) * 1e3
    return {"n": len(a), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


def fill(address: str, ids: int, width: int, quiet: bool = False) -> None:
    from tqdm import tqdm

    from ps_server.client import PSClient

    rng = np.random.default_rng(0)
    with PSClient(address, timeout=120) as ps:
        ps.create_table(TABLE, dim=width // 2, state_width=width - width // 2)
        step = 16384
        for lo in tqdm(range(0, ids, step), desc="filling", unit="batch", leave=False, disable=quiet):
            chunk = np.arange(lo, min(lo + step, ids))
            ps.push(TABLE, chunk, rng.standard_normal((len(chunk), width)).astype(np.float32))


def run(args) -> dict:
    from tqdm import tqdm

    from dynemb.local import LocalPS
    from dynemb.local_redis import RedisProcess

    redis_proc = None
    if args.redis:
        redis_url = args.redis
    else:
        redis_proc = RedisProcess(["maxmemory 0"]).start()
        redis_url = redis_proc.url
    ps = LocalPS("--backend", redis_url, "--namespace", f"load{os.getpid()}", "--workers", str(args.ps_workers),
                 "--not-serving-seconds", "0").start()
    import redis as redis_py

    redis_client = redis_py.Redis.from_url(redis_url)
    try:
        fill(ps.address, args.ids, args.width, args.no_progress)
        procs = max(1, min(args.procs, args.clients))
        share = [args.clients // procs + (k < args.clients % procs) for k in range(procs)]
        ctx = mp.get_context("spawn")  # a fresh interpreter: gRPC does not survive fork
        queue = ctx.Queue()
        start = time.monotonic() + 3.0  # the workers' start-up is not timed
        stop_at = start + args.seconds
        workers = [ctx.Process(target=worker, args=(ps.address, n, 1000 * k, vars(args), stop_at, queue))
                   for k, n in enumerate(share)]
        for w in workers:
            w.start()
        samples = []  # (t, ps rss, redis used_memory)
        warm_end = start + args.warmup * args.seconds
        last_line = time.monotonic()
        with tqdm(total=int(args.seconds), desc=f"{args.clients} clients", disable=args.no_progress,
                  bar_format="{desc}: {n}/{total} s |{bar}| {remaining} left") as bar:
            while (now := time.monotonic()) < stop_at:
                if now >= start:
                    samples.append((now, rss_bytes(ps.proc.pid), int(redis_client.info("memory")["used_memory"])))
                    bar.n = min(int(now - start), int(args.seconds))
                    bar.refresh()
                if args.soak and now - last_line > 60:  # a soak run leaves a trail in its log
                    last_line = now
                    _, rss, used = samples[-1] if samples else (0, 0, 0)
                    tqdm.write(f"[{time.strftime('%H:%M:%S')}] PS RSS {rss / 2**20:.1f} MiB, "
                               f"Redis used_memory {used / 2**20:.1f} MiB")
                time.sleep(1.0)
        results = [r for _ in workers for r in queue.get(timeout=120)]
        for w in workers:
            w.join(60)
        if ps.proc.poll() is not None:
            raise RuntimeError(f"the PS died under load:\n{ps.log()[-3000:]}")
    finally:
        redis_client.close()
        ps.close()
        if redis_proc is not None:
            redis_proc.close()

    def timed(op: str) -> list[float]:  # latencies of calls started after the warm-up
        return [d for r in results for t, d in r["lat"][op] if t >= warm_end]

    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    requests = sum(len(r["lat"]["pull"]) + len(r["lat"]["push"]) for r in results)
    rows = sum(r["rows"] for r in results)
    after_warmup = [s for s in samples if s[0] >= warm_end] or samples[-1:]
    growth = {
        "ps_rss": after_warmup[-1][1] / after_warmup[0][1] - 1,
        "redis_used_memory": after_warmup[-1][2] / after_warmup[0][2] - 1,
    }
    return {
        "clients": args.clients, "seconds": args.seconds, "batch": args.batch, "ids": args.ids,
        "row_bytes": 4 * args.width, "requests": requests, "requests_per_s": requests / args.seconds,
        "rows_per_s": rows / args.seconds, "errors": errors,
        "pull": percentiles(timed("pull")), "push": percentiles(timed("push")),
        "ps_rss_mib": [after_warmup[0][1] / 2**20, after_warmup[-1][1] / 2**20],
        "redis_used_memory_mib": [after_warmup[0][2] / 2**20, after_warmup[-1][2] / 2**20],
        "growth": growth,
    }


def report(r: dict, max_growth: float) -> list[str]:
    """Print the figures; return the reasons it failed (none: it passed)."""
    print(f"ps_load: {r['clients']} clients, {r['seconds']:.0f} s, batches of {r['batch']} ids of {r['row_bytes']} B "
          f"over {r['ids']:,} stored rows, one PS over Redis")
    print(f"  {'':<6} {'calls':>9} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for op in ("pull", "push"):
        p = r[op]
        if p["n"]:
            print(f"  {op:<6} {p['n']:>9,} {p['p50_ms']:>9.2f} {p['p99_ms']:>9.2f} {p['max_ms']:>9.2f}")
    print(f"  {r['requests_per_s']:,.0f} requests/s, {r['rows_per_s']:,.0f} rows/s, errors: {r['errors'] or 'none'}")
    print(f"  PS RSS {r['ps_rss_mib'][0]:.1f} -> {r['ps_rss_mib'][1]:.1f} MiB ({r['growth']['ps_rss']:+.1%}); "
          f"Redis used_memory {r['redis_used_memory_mib'][0]:.1f} -> {r['redis_used_memory_mib'][1]:.1f} MiB "
          f"({r['growth']['redis_used_memory']:+.1%}), from the end of the warm-up to the end")
    failed = []
    if r["errors"]:
        failed.append(f"{sum(r['errors'].values())} calls failed: {r['errors']}")
    for name, g in r["growth"].items():
        if g > max_growth:
            failed.append(f"{name} grew {g:.1%} after the warm-up (limit {max_growth:.0%})")
    if not r["pull"]["n"] or not r["push"]["n"]:
        failed.append("no pull or no push completed after the warm-up")
    return failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64, help="concurrent clients [default %(default)s]")
    p.add_argument("--seconds", type=float, default=None, help="how long they run [default 60; 3600 with --soak]")
    p.add_argument("--soak", action="store_true", help="the long release-testing run: an hour unless --seconds, "
                                                       "a memory line every minute")
    p.add_argument("--batch", type=int, default=256, help="ids per pull or push [default %(default)s]")
    p.add_argument("--ids", type=int, default=200_000, help="rows stored (ids drawn from 0..N-1) [default %(default)s]")
    p.add_argument("--width", type=int, default=128, help="floats per row: dim + optimizer state [default %(default)s]")
    p.add_argument("--procs", type=int, default=max(2, os.cpu_count() or 2),
                   help="client processes the clients are spread over [default %(default)s]")
    p.add_argument("--ps-workers", type=int, default=16, help="the PS's request threads [default %(default)s]")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run before memory and latency count "
                                                             "[default %(default)s]")
    p.add_argument("--max-growth", type=float, default=0.10, help="largest memory growth after the warm-up that "
                                                                  "passes [default %(default)s]")
    p.add_argument("--redis", help="an existing Redis URL (default: start a redis-server)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 3600.0 if args.soak else 60.0
    if args.clients < 1 or args.seconds <= 0 or args.batch < 1 or args.ids < 1 or args.width < 2:
        p.error("--clients, --seconds, --batch and --ids must be positive, --width at least 2")
    result = run(args)
    failed = report(result, args.max_growth)
    result["failed"] = failed
    line = json.dumps(result)
    print("JSON " + line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    for reason in failed:
        print(f"ps_load: FAILED: {reason}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
