"""Load test of ONE parameter server over Redis: many clients pulling and pushing at once.

    .venv/bin/python bench/ps_load.py                  # 64 clients for 60 s (redis-server + PS started here)
    .venv/bin/python bench/ps_load.py --soak           # release soak: the same for 1 hour, progress every minute
    .venv/bin/python bench/ps_load.py --clients 8 --duration 10          # a quick look
    .venv/bin/python bench/ps_load.py --redis redis://10.0.0.5:6379/0    # your Redis; a PS is started here on it
    .venv/bin/python bench/ps_load.py --cluster 3      # a 3-master Redis Cluster started here instead
    .venv/bin/python bench/ps_load.py --ps 10.0.0.7:50051 --redis redis://10.0.0.5:6379/0 \\
        --ps-metrics http://10.0.0.7:9090/metrics     # a running PS (add --ps-pid PID when it runs on this machine)
    .venv/bin/python bench/ps_load.py --ttl 30 --duration 180 --clients 8 --push-rate 5000   # rows that expire

What happens:
 1. Unless --ps is given, a redis-server (on a free port; no persistence) and a PS over it
    are started as child processes (redis-server: DYNEMB_REDIS_SERVER, .bin/ or PATH); with
    --cluster N a Redis Cluster of N masters instead, whose memory and CPU figures are the sums
    over its masters.
 2. A table (--table, rows of --dim embedding + --state-width optimizer-state floats) is
    created and every id of the id space (--id-space random 62-bit ids) is written: the
    prefill. From then on no request adds a row, so Redis memory has no reason to grow.
 3. --clients clients (each its own PSClient, one call in flight at a time) pull or push
    batches of --batch ids drawn uniformly from the id space, for --duration seconds.
    An id's row is a fixed function of the id, so every pull is checked value for value.
 4. Every --sample-seconds the PS's RSS and Redis's used_memory are sampled.
 5. Printed: a table of requests, rows/s and p50/p99/max latency per method, the memory
    figures, PASS or FAIL lines, and last one JSON line (also written to --json).

It fails (exit 1, each reason on a FAIL line) when any call failed (counted by gRPC status
code; a pull with wrong or missing values counts as an error too), the PS's /metrics
counted errors, the table's row count changed, or memory grew past the limits after
warm-up: the median of the samples in the last 10% of the run against the median of the
10% ending at warm-up's end (--warmup-fraction of the run), over --max-rss-growth (PS) or
--max-redis-growth (Redis). Exit 2: bad arguments or a part that did not start.

With --ttl SECONDS (rows that expire; docs/ps.md, "Rows that expire"), steps 2 to 5 change:
 2. The table is created with that TTL and a touch interval of TTL // 2, and nothing is
    prefilled (--id-space is only the rows the table declares: set it near the steady size).
    A PS started here sweeps every --sweep-every seconds (1), so a pass over the table comes
    every max(--sweep-every, TTL / 8) seconds (dynemb/ps_server/sweeper.py).
 3. Each push writes a batch of ids never pushed before in the run (client k's count up from
    (k + 1) << 40), as fast as the PS answers, or at --push-rate new ids a second over all
    clients (a client waits for its turn to push; pulls keep their --pull-fraction of the
    calls); the rate of new ids is measured. Each pull reads a batch drawn from the ids its
    client pushed in the last TTL // 2 seconds: rows that cannot have expired, and that no pull
    refreshes (their stamps are younger than the touch interval), so every row lives from its
    push alone. A pulled id that comes back missing is a LIVE_ROW_LOST error, wrong values
    WRONG_ROWS.
 4. Every --sample-seconds the table's row count (and last sweep) is read too; the progress
    lines print the counts sampled since the line before.
 5. Printed besides: the steady size, the median of the counts sampled in the last 25% of the
    run, against the rate of new ids x (TTL + the pass interval), and the bounds a row's
    lifetime sets: at least TTL, at most TTL + 1 s (stamps are whole seconds) + the pass
    interval + the sweeper's poll (--sweep-every / 4) + 2 passes' time, counted per sample over
    the ids pushed that long before it (bench/load_observe.py). After the load the bench waits
    for the table to empty: every row pushed must be deleted by a sweep, none lost on the way
    (the PS's dynemb_ps_rows_expired_total), within the longest lifetime.
It fails besides when a live row was lost, the steady size is outside its bounds, the counts
of the last quarter spread more than --steady-band (max / min: 1.3, or the saw-tooth of the
passes alone if more: (TTL + 1 s + pass interval + poll + a pass) / TTL), or still grow by more
than half the new ids pushed meanwhile (the slope of the counts: a sweeper that falls behind
makes its passes, and so the bounds, longer as the table grows), or the table did not empty.
The memory check's warm-up ends only once the table can have reached its steady size (the
longest lifetime + a window); the row-count check of step 5 is replaced by these.
The sweeper must keep up: a pass reads every row of the table (whole rows: the stamp is at the
end of the value) and sweeps a quarter of the time, so the new ids it can take a second are
a fraction of what a PS can push. On the 2-core dev box 2 clients pushing flat out (16k new
ids/s of 512-byte rows, TTL 4 s) outran it, passes of 128k rows taking 9 s, and the table
grew all run: use --push-rate there.

Soak for a release: run `bench/ps_load.py --soak` on a machine like production's and keep
its output; it must end in PASS. The same checks hold over the hour; a progress line comes
every --report-seconds (60 under --soak) so a stall or a climb in memory shows as it happens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import redis
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_clients import COUNTER_SLOTS, ERRORS, PULLS, PUSHES, ROWS, LoadSpec, client_process, expected_rows  # noqa: E402
from bench.load_observe import (  # noqa: E402
    Lifetimes,
    MemorySampler,
    TableWatch,
    growth,
    ps_error_counts,
    ps_rows_expired,
    steady_size,
)
from dynemb.ps_server.client import PSClient  # noqa: E402
from dynemb.ps_server.errors import PSError  # noqa: E402
from dynemb.ps_server.lifecycle import MIN_TTL_S, Lifecycle  # noqa: E402
from dynemb.ps_server.schema import TableSchema  # noqa: E402
from dynemb.ps_server.sweeper import MAX_PASS_EVERY_S  # noqa: E402
from dynemb.testing.local_ps import LocalPS  # noqa: E402
from dynemb.testing.local_redis import RedisClusterProcesses, RedisProcess  # noqa: E402

MiB = 1 << 20
PREFILL_CHUNK = 16384
PATTERNS = 4096  # distinct row values; an id's row is patterns[id % PATTERNS]


class SetupError(Exception):
    """A part of the run could not be set up; the message says which and why (exit 2)."""


@dataclass
class Target:
    address: str
    ps_pid: int | None
    redis_url: str | list[str] | None  # what to sample: a server, or a Cluster's masters
    metrics_url: str | None
    describe: str
    local_ps: LocalPS | None = None  # the PS started here, for its log


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    load = p.add_argument_group("load")
    load.add_argument("--clients", type=int, default=64, help="concurrent clients [default %(default)s]")
    load.add_argument("--duration", type=float, help="seconds of load [default 60; 3600 with --soak]")
    load.add_argument(
        "--soak",
        action="store_true",
        help="release soak: 1 hour unless --duration, memory sampled every 10 s, a progress line a minute",
    )
    # Threads in a few processes, not a process per client: a client's own work per call is
    # small next to the PS's (which issues one Redis command per touched bucket, ~1,000 per
    # batch of 1,024), and 64 processes would take the 2 cores' time from the PS being
    # measured. More than one process keeps the clients' GIL from adding to the latencies.
    load.add_argument(
        "--procs",
        type=int,
        default=2,
        help="client processes the clients are spread over, as threads [default %(default)s]",
    )
    load.add_argument("--batch", type=int, default=1024, help="ids per pull or push [default %(default)s]")
    load.add_argument(
        "--pull-fraction",
        type=float,
        default=0.5,
        help="share of calls that are pulls, the rest pushes [default %(default)s]",
    )
    load.add_argument(
        "--id-space",
        type=int,
        default=250_000,
        help="distinct ids the batches draw from, all written before the run [default %(default)s]",
    )
    load.add_argument("--dim", type=int, default=64, help="embedding floats per row [default %(default)s]")
    load.add_argument(
        "--state-width", type=int, default=64, help="optimizer-state floats per row [default %(default)s]"
    )
    load.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds one call may take before it counts as DEADLINE_EXCEEDED [default %(default)s]",
    )
    load.add_argument("--seed", type=int, default=0)

    expiry = p.add_argument_group("rows that expire")
    expiry.add_argument(
        "--ttl",
        type=int,
        metavar="SECONDS",
        help=f"a table with this TTL (>= {MIN_TTL_S}) fed new ids only, its steady size checked (module doc)",
    )
    expiry.add_argument(
        "--sweep-every",
        type=float,
        metavar="SECONDS",
        help="with --ttl: the PS's --sweep-every, given to a PS started here [default 1]; with --ps, "
        "what that PS runs with [default 60, the PS's own default]",
    )
    expiry.add_argument(
        "--push-rate",
        type=float,
        metavar="IDS_PER_S",
        help="with --ttl: new ids pushed a second at most, over all clients (each waits for its turn to "
        "push; pulls keep their share of the calls) [default: as fast as the PS answers]",
    )
    expiry.add_argument(
        "--steady-band",
        type=float,
        default=1.3,
        help="with --ttl: the most the last quarter's largest row count may be over its smallest "
        "(or the lifetimes' most / least, if more) [default %(default)s]",
    )

    checks = p.add_argument_group("memory checks")
    checks.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.2,
        help="leading share of the run that memory may grow in [default %(default)s]",
    )
    checks.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.10,
        help="most the PS's RSS may grow after warm-up, as a ratio [default %(default)s]",
    )
    checks.add_argument(
        "--max-redis-growth",
        type=float,
        default=0.10,
        help="most Redis used_memory may grow after warm-up, as a ratio [default %(default)s]",
    )
    checks.add_argument("--sample-seconds", type=float, help="memory sampling interval [default 1; 10 with --soak]")
    checks.add_argument(
        "--report-seconds",
        type=float,
        help="a progress line this often [default: a sixth of the run, at least 10 s; 60 with --soak]",
    )

    where = p.add_argument_group("what to load (default: a redis-server and a PS started here)")
    where.add_argument("--ps", metavar="HOST:PORT", help="a running PS to load instead of starting one")
    where.add_argument("--ps-pid", type=int, help="with --ps on this machine: its process id, to sample its RSS")
    where.add_argument("--ps-metrics", metavar="URL", help="with --ps: its /metrics URL, to read its own error count")
    where.add_argument(
        "--redis",
        metavar="URL",
        help="redis://[user:pass@]host:port/db or rediss://...: the Redis to sample (with --ps) "
        "or to start the PS on (without); a standalone server",
    )
    where.add_argument(
        "--cluster",
        type=int,
        metavar="MASTERS",
        help="start a Redis Cluster of this many masters (no replicas) for the PS instead of one redis-server",
    )
    where.add_argument(
        "--namespace", default="ps_load", help="Redis key prefix of a PS started here [default %(default)s]"
    )
    where.add_argument("--table", default="ps_load", help="table to create and load [default %(default)s]")
    where.add_argument("--keep-table", action="store_true", help="leave the table in place at the end")
    p.add_argument(
        "--json",
        type=Path,
        default=Path(__file__).parent / "out" / "ps_load.json",
        help="also write the result here [default %(default)s]",
    )
    args = p.parse_args(argv)

    args.duration = args.duration if args.duration is not None else (3600.0 if args.soak else 60.0)
    args.sample_seconds = args.sample_seconds or (10.0 if args.soak else 1.0)
    args.report_seconds = args.report_seconds or (60.0 if args.soak else max(10.0, args.duration / 6))
    for name in ("clients", "procs", "batch", "id_space", "dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.state_width < 0:
        p.error(f"--state-width must be 0 or more, got {args.state_width}")
    for name in ("duration", "timeout", "sample_seconds", "report_seconds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.pull_fraction <= 1.0:
        p.error(f"--pull-fraction must be between 0 and 1, got {args.pull_fraction}")
    if not 0.0 < args.warmup_fraction < 1.0:
        p.error(f"--warmup-fraction must be between 0 and 1 (both excluded), got {args.warmup_fraction}")
    if args.sample_seconds > args.duration * (1 - args.warmup_fraction) / 2:
        p.error(
            f"--sample-seconds {args.sample_seconds} leaves fewer than 2 samples after warm-up "
            f"of a {args.duration:g} s run"
        )
    if args.procs > args.clients:
        p.error(f"--procs {args.procs} is more than --clients {args.clients}")
    if args.cluster is not None and args.cluster < 1:
        p.error(f"--cluster must be at least 1 master, got {args.cluster}")
    if args.cluster and (args.ps or args.redis):
        p.error("--cluster starts a Cluster for a PS started here: not with --ps or --redis")
    if args.ps is None and (args.ps_pid or args.ps_metrics):
        p.error("--ps-pid and --ps-metrics describe a running PS: give its address with --ps")
    if args.redis and not args.redis.startswith(("redis://", "rediss://", "unix://")):
        p.error(f"--redis must be a standalone server's redis://, rediss:// or unix:// URL, got {args.redis!r}")
    if args.ttl is None:
        for name in ("sweep_every", "push_rate"):
            if getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')} goes with --ttl")
        return args
    if args.push_rate is not None and args.push_rate <= 0:
        p.error(f"--push-rate must be positive, got {args.push_rate}")
    if args.ttl < MIN_TTL_S:
        p.error(f"--ttl must be at least {MIN_TTL_S} s, got {args.ttl}")
    if args.pull_fraction >= 1.0:
        p.error("--ttl needs pushes of new ids: give a --pull-fraction under 1")
    args.sweep_every = args.sweep_every if args.sweep_every is not None else (60.0 if args.ps else 1.0)
    if args.sweep_every <= 0:
        p.error(f"--sweep-every must be positive (the PS must sweep), got {args.sweep_every}")
    if args.steady_band < 1.0:
        p.error(f"--steady-band must be at least 1, got {args.steady_band}")
    most = lifetimes(args).most
    if 0.75 * args.duration < 1.25 * most:
        p.error(
            f"--duration {args.duration:g} s is too short for --ttl {args.ttl}: the last quarter of the run, "
            f"whose row counts are judged, must start after 1.25x the longest a row stays ({most:.1f} s), "
            f"so at least {1.25 * most / 0.75:.0f} s"
        )
    return args


def lifetimes(args, pass_seconds: float = 0.0) -> Lifetimes:
    """How long a row of the --ttl table stays (bench/load_observe.py): its pass interval is
    sweeper.Sweeper.pass_every's, its poll sweeper.Sweeper._next_wait's."""
    pass_every = max(args.sweep_every, min(args.ttl / 8, MAX_PASS_EVERY_S))
    return Lifetimes(float(args.ttl), pass_every, args.sweep_every / 4, pass_seconds)


def attach(args, stack: ExitStack) -> Target:
    """The PS to load: the one given, or one started here (over the Redis given, or one started here)."""
    if args.ps:
        if args.ps_pid:
            try:
                psutil.Process(args.ps_pid)
            except psutil.NoSuchProcess:
                raise SetupError(f"--ps-pid {args.ps_pid}: no such process on this machine") from None
        return Target(args.ps, args.ps_pid, args.redis, args.ps_metrics, f"the PS at {args.ps}")
    redis_url = args.redis
    sampled: str | list[str] | None = redis_url
    if args.cluster:
        try:
            cluster = RedisClusterProcesses(masters=args.cluster).start()
        except (FileNotFoundError, RuntimeError) as exc:
            raise SetupError(f"could not start a Redis Cluster: {exc}") from None
        stack.callback(cluster.close)
        redis_url = cluster.url
        sampled = [f"redis://{a}/0" for a in cluster.addresses]
    elif redis_url is None:
        try:
            redis_url = sampled = stack.enter_context(RedisProcess()).url
        except (FileNotFoundError, RuntimeError) as exc:
            raise SetupError(f"could not start redis-server: {exc}") from None
    sweep = ("--sweep-every", str(args.sweep_every)) if args.ttl else ()
    ps = LocalPS(
        *("--backend", redis_url, "--namespace", args.namespace, "--log-level", "WARNING"),
        *("--not-serving-seconds", "0", *sweep),
    )
    try:
        stack.enter_context(ps)
    except RuntimeError as exc:
        raise SetupError(str(exc)) from None
    return Target(
        ps.address,
        ps.proc.pid,
        sampled,
        f"http://127.0.0.1:{ps.metrics_port}/metrics",
        f"a PS started here ({ps.address}, pid {ps.proc.pid}) over {redis_url}",
        ps,
    )


def prefill(client: PSClient, table: str, ids: np.ndarray, patterns: np.ndarray) -> None:
    for lo in tqdm(
        range(0, len(ids), PREFILL_CHUNK), desc="prefill: every id of the id space", unit="chunk", leave=False
    ):
        chunk = ids[lo : lo + PREFILL_CHUNK]
        client.push(table, chunk, expected_rows(patterns, chunk), timeout=600)


def live_totals(live) -> np.ndarray:
    """[pulls, pushes, rows, errors] so far, over every client."""
    return np.frombuffer(live, dtype=np.int64).reshape(-1, COUNTER_SLOTS).sum(axis=0)


def run_load(
    args, spec: LoadSpec, sampler: MemorySampler, watch: TableWatch | None = None
) -> tuple[list[dict], list[str], dict]:
    """Start the client processes and watch the run (with --ttl, the table's size too). Returns
    their results, any setup errors, and the CPU seconds the PS and Redis used during it."""
    ctx = mp.get_context("spawn")  # not fork: gRPC's threads do not survive a fork
    live = ctx.Array("q", args.clients * COUNTER_SLOTS, lock=False)  # each slot has one writer
    barrier = ctx.Barrier(args.procs + 1)
    results = ctx.Queue()
    bounds = np.linspace(0, args.clients, args.procs + 1).astype(int)
    procs = [
        ctx.Process(
            target=client_process,
            args=(int(lo), int(hi - lo), spec, live, barrier, results),
            daemon=True,
            name=f"ps-load-clients-{k}",
        )
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout=300)
    except threading.BrokenBarrierError:
        got = collect(results, len(procs), timeout=30)
        for proc in procs:
            proc.join(10)
        return [], [r["setup_error"] for r in got if "setup_error" in r] or ["client processes did not start"], {}
    t0, cpu_at_start = time.monotonic(), sampler.cpu_seconds()
    sampler.sample(0.0)
    last_report, last_totals = 0.0, live_totals(live)
    if watch:
        watch.sample(0.0, int(last_totals[PUSHES]) * args.batch)
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]"
    with tqdm(total=args.duration, desc="load", bar_format=bar_format) as bar:
        next_at = args.sample_seconds
        while next_at <= args.duration + 1e-9:
            time.sleep(max(0.0, t0 + next_at - time.monotonic()))
            t = time.monotonic() - t0
            sampler.sample(t)
            totals = live_totals(live)
            if watch:
                watch.sample(t, int(totals[PUSHES]) * args.batch)
            bar.update(min(t, args.duration) - bar.n)
            bar.set_postfix_str(
                f"{(totals[PULLS] + totals[PUSHES]) / t:.1f} req/s, errors {totals[ERRORS]}, "
                f"PS RSS {mib(sampler.ps_rss[-1])}" + (f", rows {watch.series(t - 1e-9)}" if watch else ""),
                refresh=False,
            )
            if t - last_report >= args.report_seconds - 1e-6:
                d, span = totals - last_totals, t - last_report
                tqdm.write(
                    f"[{t:6.0f}/{args.duration:.0f} s] {(d[PULLS] + d[PUSHES]) / span:,.1f} req/s, "
                    f"{d[ROWS] / span:,.0f} rows/s in the last {span:.0f} s; errors {totals[ERRORS]}; "
                    f"PS RSS {mib(sampler.ps_rss[-1])}; Redis used_memory {mib(sampler.redis_used[-1])}"
                    + (f"; rows stored: {watch.series(last_report)}" if watch else ""),
                    file=sys.stdout,
                )
                sys.stdout.flush()
                last_report, last_totals = t, totals
            next_at += args.sample_seconds
    got = collect(results, len(procs), timeout=args.timeout + 120)  # before join: a full pipe blocks exit
    cpu = {k: (v - cpu_at_start[k] if v is not None else None) for k, v in sampler.cpu_seconds().items()}
    for proc in procs:
        proc.join(30)
    errors = [r["setup_error"] for r in got if "setup_error" in r]
    if len(got) < len(procs):
        errors.append(
            f"{len(procs) - len(got)} client process(es) died without a result (exit codes "
            f"{[p.exitcode for p in procs]})"
        )
    return [r for r in got if "setup_error" not in r], errors, cpu


def collect(results, n: int, timeout: float) -> list[dict]:
    """Up to n results from the client processes, waiting at most `timeout` seconds in all."""
    deadline, got = time.monotonic() + timeout, []
    while len(got) < n:
        try:
            got.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            break
    return got


def latency_row(lat: np.ndarray) -> dict:
    if len(lat) == 0:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    p50, p99 = np.percentile(lat, [50, 99]) * 1000
    return {
        "count": int(len(lat)),
        "p50_ms": round(float(p50), 3),
        "p99_ms": round(float(p99), 3),
        "max_ms": round(float(lat.max() * 1000), 3),
    }


def mib(x: float) -> str:
    return "n/a" if np.isnan(x) else f"{x / MiB:,.1f} MiB"


def ms(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    # the table declares the rows it will hold, as a user's does: the PS sizes its Redis layout by them
    schema = TableSchema(args.table, args.dim, args.state_width, "fp32", expected_rows=args.id_space)
    rng = np.random.default_rng(args.seed)
    ids = rng.choice(1 << 62, size=args.id_space, replace=False).astype(np.int64)
    patterns = rng.random((PATTERNS, schema.width), dtype=np.float32)
    with ExitStack() as stack:
        try:
            target = attach(args, stack)
            client = stack.enter_context(PSClient(target.address, timeout=60))
            client.wait_ready(timeout=30)
            if args.ttl:
                # the touch interval at ttl // 2: pulls (of ids pushed within it) never refresh a stamp
                lifecycle = Lifecycle(ttl_s=args.ttl, touch_every_s=args.ttl // 2)
                client.create_table_from_schema(schema, lifecycle=lifecycle)
                info = client.describe_table(args.table)
                if info.num_rows or info.lifecycle.ttl_s != args.ttl:
                    raise SetupError(
                        f"table {args.table!r} exists with {info.num_rows:,} rows and a TTL of "
                        f"{info.lifecycle.ttl_s} s: --ttl needs a new table (drop it, or name another with --table)"
                    )
            else:
                client.create_table_from_schema(schema)
                prefill(client, args.table, ids, patterns)
            rows_before = client.describe_table(args.table).num_rows
            sampler = MemorySampler(target.ps_pid, target.redis_url)
            stack.callback(sampler.close)
            sampler.sample(0.0)  # reaches both now, so a wrong --redis or --ps-pid fails before the run
            sampler.reset()
            ps_errors_before = ps_error_counts(target.metrics_url) if target.metrics_url else None
            expired_before = ps_rows_expired(target.metrics_url, args.table) if target.metrics_url else None
        except (SetupError, PSError, OSError, ValueError, redis.RedisError, psutil.Error) as exc:
            print(f"ps_load: setup failed: {exc}", file=sys.stderr)
            return 2
        if args.ttl:
            life = lifetimes(args)
            rate = f"at most {args.push_rate:,.0f}/s" if args.push_rate else "as fast as the PS answers"
            stored = (
                f"TTL {args.ttl} s, new ids only ({rate}), pulls of those pushed in the last {args.ttl // 2} s; "
                f"sweeps every {life.pass_every:g} s (--sweep-every {args.sweep_every:g}); "
                f"{args.id_space:,} rows declared"
            )
        else:
            stored = f"{rows_before:,} rows stored (id space {args.id_space:,}, prefilled)"
        print(
            f"ps_load: {args.clients} clients in {args.procs} process{'es' if args.procs > 1 else ''} for "
            f"{args.duration:g} s against {target.describe}; batches of {args.batch:,} ids, "
            f"{args.pull_fraction:.0%} pulls; rows of "
            f"{args.dim} + {args.state_width} fp32 ({schema.row_bytes} B); {stored}; {os.cpu_count()} CPUs",
            flush=True,
        )
        spec = LoadSpec(
            target.address,
            args.table,
            ids if not args.ttl else ids[:0],
            patterns,
            args.batch,
            args.pull_fraction,
            args.timeout,
            args.duration,
            args.seed,
            args.ttl or 0,
            float(args.ttl // 2) if args.ttl else 0.0,
            args.batch * args.clients / args.push_rate if args.push_rate else 0.0,
        )
        failures: list[str] = []
        watch = TableWatch(client, args.table) if args.ttl else None
        try:
            results, setup_errors, cpu = run_load(args, spec, sampler, watch)
        except psutil.NoSuchProcess:
            log = target.local_ps.log()[-3000:] if target.local_ps else ""
            print(f"FAIL: the PS process {target.ps_pid} exited during the run\n{log}")
            return 1
        failures += [f"client processes: {e}" for e in setup_errors]
        drained = None
        try:
            rows_after = client.describe_table(args.table).num_rows
            if watch is not None:
                pushed = sum(len(r["latencies"]["push"]) for r in results) * args.batch
                most = lifetimes(args, watch.pass_figures()["seconds_max"]).most
                drained = drain(client, args.table, pushed, target.metrics_url, expired_before, most + 10)
            ps_errors_after = ps_error_counts(target.metrics_url) if target.metrics_url else None
            if not args.keep_table:
                client.drop_table(args.table)
        except (PSError, OSError) as exc:
            failures.append(f"the PS did not answer after the run: {exc}")
            rows_after, ps_errors_after = None, None
        cpu["clients"] = sum(r["cpu_seconds"] for r in results)
        summary = summarize(
            args,
            target,
            schema,
            results,
            sampler,
            cpu,
            rows_before,
            rows_after,
            ps_errors_before,
            ps_errors_after,
            failures,
            watch,
            drained,
        )
    print_summary(args, summary)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


def drain(client: PSClient, table: str, pushed: int, metrics_url, expired_before, wait_s: float) -> dict:
    """With --ttl, after the load: wait (at most wait_s) until every row pushed has expired and
    been deleted by a sweep (the table empty; the PS's rows-expired count up by `pushed`); then
    count the ids the table's deletion log keeps."""
    started = time.monotonic()
    while True:
        rows = client.describe_table(table).num_rows
        expired = None if metrics_url is None else int(ps_rows_expired(metrics_url, table) - (expired_before or 0))
        waited = time.monotonic() - started
        if (rows == 0 and expired in (None, pushed)) or waited > wait_s:
            break
        time.sleep(0.25)
    logged, cursor = 0, ""
    for _ in range(100_000):
        part = client.read_deletions(table, after=cursor)
        if not len(part.ids):
            break
        logged, cursor = logged + len(part.ids), part.cursor
    return {
        "seconds": round(waited, 2),
        "wait_limit_s": round(wait_s, 2),
        "rows_pushed": pushed,
        "rows_left": rows,
        "rows_expired": expired,
        "deletion_log_ids": logged,
    }


def summarize(
    args,
    target,
    schema,
    results,
    sampler,
    cpu,
    rows_before,
    rows_after,
    ps_errors_before,
    ps_errors_after,
    failures,
    watch: TableWatch | None = None,
    drained: dict | None = None,
) -> dict:
    lat = {
        m: np.concatenate([r["latencies"][m] for r in results]) if results else np.array([]) for m in ("pull", "push")
    }
    errors_by_method: dict[str, dict[str, int]] = {"pull": {}, "push": {}}
    first_error: dict[str, str] = {}
    for r in results:
        for (method, code), n in r["errors"].items():
            errors_by_method[method][code] = errors_by_method[method].get(code, 0) + n
        for code, msg in r["first_error"].items():
            first_error.setdefault(code, msg)
    errors: dict[str, int] = {}
    for per in errors_by_method.values():
        for code, n in per.items():
            errors[code] = errors.get(code, 0) + n
    span = (max(r["ended"] for r in results) - min(r["started"] for r in results)) if results else 0.0
    requests = {m: len(lat[m]) for m in lat}
    total = sum(requests.values())
    rows = total * args.batch

    warmup_end = args.warmup_fraction * args.duration
    window = max(0.1 * args.duration, args.sample_seconds)
    expiry, steady = None, None
    if watch is not None:
        passes = watch.pass_figures()
        life = lifetimes(args, passes["seconds_max"])
        steady = steady_size(
            watch.times,
            watch.rows,
            watch.pushed,
            args.duration,
            life,
            in_flight=args.clients * args.batch,
            band=args.steady_band,
        )
        failures += steady.failures
        if watch.errors:
            failures.append(f"{watch.errors} reads of the table's row count failed (first: {watch.first_error[:200]})")
        # memory may grow until the table can have reached its steady size: judge it from there
        warmup_end = max(warmup_end, life.most + window)
        expiry = {
            "ttl_s": args.ttl,
            "sweep_every_s": args.sweep_every,
            "pass_every_s": life.pass_every,
            "pull_window_s": args.ttl // 2,
            "push_rate_asked": args.push_rate,
            "new_ids_pushed": len(lat["push"]) * args.batch,
            "passes": passes,
            "steady": steady.as_json(),
            "drain": drained,
            "rows_samples": [[round(t, 2), r] for t, r in zip(watch.times, watch.rows)],
        }
        if drained is not None:
            if drained["rows_left"]:
                failures.append(
                    f"the table still held {drained['rows_left']:,} rows {drained['seconds']:.1f} s after the load "
                    f"ended, past the longest a row may stay ({life.most:.1f} s) + 10 s"
                )
            if drained["rows_expired"] is not None and drained["rows_expired"] != drained["rows_pushed"]:
                failures.append(
                    f"{drained['rows_pushed']:,} new ids were pushed and the sweeps deleted "
                    f"{drained['rows_expired']:,} rows: {drained['rows_pushed'] - drained['rows_expired']:+,} "
                    "unaccounted for"
                )
    memory = {}
    memory_skipped = None
    if watch is not None and warmup_end + window > args.duration:
        memory_skipped = (
            f"not judged: the table reaches its steady size only {warmup_end - window:.0f} s into the run, "
            f"which leaves no {window:g} s window after it"
        )
    for name, values, limit in (
        ("ps_rss", sampler.ps_rss, args.max_rss_growth),
        ("redis_used_memory", sampler.redis_used, args.max_redis_growth),
    ):
        if not values or np.isnan(values[0]) or memory_skipped:
            memory[name] = None
            continue
        g = growth(sampler.times, values, warmup_end, args.duration, window)
        memory[name] = g.as_json() | {"limit": limit}
        if g.ratio > limit:
            what = "the PS's RSS" if name == "ps_rss" else "Redis used_memory"
            failures.append(
                f"{what} grew {g.ratio:+.1%} after warm-up ({g.at_warmup_end / MiB:,.1f} -> "
                f"{g.at_end / MiB:,.1f} MiB), over the limit of {limit:.0%}"
            )

    if errors:
        detail = "; ".join(f"{code} x{n} (first: {first_error.get(code, '')[:200]})" for code, n in errors.items())
        failures.append(f"{sum(errors.values()):,} calls failed: {detail}")
    if results and total == 0:
        failures.append("no call completed in the run")
    server_errors = None
    if ps_errors_before is not None and ps_errors_after is not None:
        server_errors = {
            c: int(n - ps_errors_before.get(c, 0))
            for c, n in ps_errors_after.items()
            if n - ps_errors_before.get(c, 0) > 0
        }
        if server_errors:
            failures.append(f"the PS's /metrics counted errors during the run: {server_errors}")
    if watch is None and rows_after is not None and rows_after != rows_before:
        failures.append(
            f"the table held {rows_before:,} rows before the run and {rows_after:,} after; "
            "no call of the run adds a row"
        )
    return {
        "bench": "ps_load",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target": target.describe,
        "row_bytes": schema.row_bytes,
        "cpus": os.cpu_count(),
        "seconds": round(span, 3),
        "requests": requests | {"all": total},
        "requests_per_s": round(total / span, 2) if span else 0.0,
        "rows_per_s": round(rows / span, 1) if span else 0.0,
        "latency_ms": {m: latency_row(lat[m]) for m in ("pull", "push")}
        | {"all": latency_row(np.concatenate([lat["pull"], lat["push"]]))},
        "errors": errors,
        "errors_total": sum(errors.values()),
        "errors_by_method": errors_by_method,
        "ps_metrics_errors": server_errors,
        "rows_stored": {"before": rows_before, "after": rows_after},
        "memory": memory,
        "memory_warmup_end_s": round(warmup_end, 3),
        "memory_skipped": memory_skipped,
        "memory_samples": len(sampler.times),
        "cpu_seconds": {k: (None if v is None else round(v, 2)) for k, v in cpu.items()},
        "expiry": expiry,
        "ok": not failures,
        "failures": failures,
    }


def print_summary(args, s: dict) -> None:
    span = s["seconds"] or float("nan")
    print(
        f"\n{'method':<8}{'requests':>10}{'req/s':>10}{'rows/s':>12}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'max ms':>10}{'errors':>8}"
    )
    for m in ("pull", "push", "all"):
        n, lat = s["requests"][m], s["latency_ms"][m]
        errs = s["errors_total"] if m == "all" else sum(s["errors_by_method"][m].values())
        print(
            f"{m:<8}{n:>10,}{n / span:>10,.1f}{n * args.batch / span:>12,.0f}{ms(lat['p50_ms']):>10}"
            f"{ms(lat['p99_ms']):>10}{ms(lat['max_ms']):>10}{errs:>8,}"
        )
    window = max(0.1 * args.duration, args.sample_seconds)
    if s["expiry"] is not None:
        print_expiry(args, s["expiry"])
    warmup = f"{args.warmup_fraction:.0%} of the run"
    if s["expiry"] is not None:
        warmup = f"{s['memory_warmup_end_s']:.0f} s in: where the table can have reached its steady size, or {warmup}"
    print(
        f"\nmemory: median over {window:g} s ending at warm-up's end ({warmup}) "
        f"and at the run's end; {s['memory_samples']} samples"
    )
    if s["memory_skipped"]:
        print(f"memory growth {s['memory_skipped']}")
    print(f"{'':<20}{'warm-up end':>14}{'end':>12}{'peak':>12}{'growth':>9}{'limit':>8}")
    for name, label in (("ps_rss", "PS RSS"), ("redis_used_memory", "Redis used_memory")):
        g = s["memory"][name]
        if g is None and s["memory_skipped"]:
            print(f"{label:<20}  not judged")
            continue
        if g is None:
            print(f"{label:<20}  not measured" + (" (give --ps-pid)" if name == "ps_rss" else " (give --redis)"))
            continue
        print(
            f"{label:<20}{g['at_warmup_end_bytes'] / MiB:>10,.1f} MiB{g['at_end_bytes'] / MiB:>8,.1f} MiB"
            f"{g['peak_bytes'] / MiB:>8,.1f} MiB{g['growth']:>+9.1%}{g['limit']:>8.0%}"
        )
    cpu = s["cpu_seconds"]
    print(
        "CPU seconds in the run: "
        + ", ".join(
            f"{k} {'n/a' if v is None else format(v, '.1f')}"
            for k, v in (("PS", cpu.get("ps")), ("Redis", cpu.get("redis")), ("clients", cpu.get("clients")))
        )
        + f" (of {s['seconds'] * s['cpus']:.0f} on {s['cpus']} CPUs)"
    )
    server = s["ps_metrics_errors"]
    errors = "not read (give --ps-metrics)" if server is None else sum(server.values())
    print(f"PS /metrics errors during the run: {errors}")
    print(
        f"rows stored: {s['rows_stored']['before']:,} before, "
        f"{'?' if s['rows_stored']['after'] is None else format(s['rows_stored']['after'], ',')} after"
    )
    for f in s["failures"]:
        print(f"FAIL: {f}")
    if s["ok"] and s["expiry"] is not None:
        print(
            f"PASS: {s['requests']['all']:,} calls in {s['seconds']:.1f} s, no errors, no live row lost, the table "
            f"steady at {n_or(s['expiry']['steady']['steady_rows'])} rows within its bounds, every row expired after, "
            f"memory {'not judged' if s['memory_skipped'] else 'steady'}"
        )
    elif s["ok"]:
        print(f"PASS: {s['requests']['all']:,} calls in {s['seconds']:.1f} s, no errors, memory steady")


def print_expiry(args, e: dict) -> None:
    """The --ttl figures: the sweeps seen, the steady size against its bounds, the drain."""
    st, p, life = e["steady"], e["passes"], e["steady"]["lifetime_s"]
    asked = f", at most {e['push_rate_asked']:,.0f}/s asked" if e["push_rate_asked"] else ""
    print(
        f"\nTTL {e['ttl_s']} s: {e['new_ids_pushed']:,} new ids pushed{asked}; "
        f"sweeps: a pass every {e['pass_every_s']:g} s "
        f"(--sweep-every {e['sweep_every_s']:g}, or ttl / 8 if longer); {p['seen']} passes seen "
        f"(sampling every {args.sample_seconds:g} s), {ms_or(p['seconds_mean'])} s each on average, "
        f"{p['seconds_max']:.2f} s at most, their ends {ms_or(p['interval_median_s'])} s apart (median), "
        f"at most {p['scanned_max']:,} rows scanned and {p['deleted_max']:,} deleted by one"
    )
    print(
        f"steady size: {n_or(st['steady_rows'])} rows (median of the {st['samples']} samples from "
        f"{st['window_from_s']:.0f} s on, the last 25% of the run; min {n_or(st['min_rows'])}, max "
        f"{n_or(st['max_rows'])}, max/min {ms_or(st['max_over_min'], '.3f')} against a band of {st['band']:.2f}; "
        f"growth meanwhile {ms_or(st['kept_share'], '+.1%')} of the new ids pushed)"
    )
    ratio = st["steady_rows"] / st["expected_rows"] if st["samples"] and st["expected_rows"] else float("nan")
    print(
        f"expected: {st['new_ids_per_s']:,.0f} new ids/s x (TTL {e['ttl_s']} + pass interval "
        f"{e['pass_every_s']:g} s) = {st['rate_x_expected_lifetime']:,} rows; counted over each sample's "
        f"last {life['expected']:g} s of pushes: {n_or(st['expected_rows'])} (steady / that: {ratio:.3f})"
    )
    print(
        f"bounds: the rows pushed in the last {life['least']:g} s (TTL: all still stored) to the last "
        f"{life['most']:.2f} s (TTL + 1 s of whole-second stamps + pass interval + sweeper poll "
        f"{e['sweep_every_s'] / 4:g} s + 2 x the longest pass) plus the pushes in flight: "
        f"{n_or(st['bounds_rows'][0])} .. {n_or(st['bounds_rows'][1])} rows"
    )
    d = e["drain"]
    if d is not None:
        expired = "not read (give --ps-metrics)" if d["rows_expired"] is None else f"{d['rows_expired']:,}"
        print(
            f"after the load: {d['rows_left']:,} rows left {d['seconds']:.1f} s on (waited at most "
            f"{d['wait_limit_s']:.1f} s); rows pushed {d['rows_pushed']:,}, deleted by sweeps {expired}; "
            f"the deletion log keeps the newest {d['deletion_log_ids']:,} ids"
        )


def ms_or(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def n_or(x) -> str:
    return "?" if x is None else f"{x:,}"


if __name__ == "__main__":
    sys.exit(main())
