"""`dynemb ps ...`: run a parameter server, or talk to running ones.

Every `serve` flag has an environment variable (shown in --help), so the same
command line works in a systemd unit or a Kubernetes pod spec.

Each cmd_* function runs one subcommand with the parsed flags and returns its exit status (0 unless
its docstring says otherwise); a PSError or UserError reaches dynemb.cli, which prints it as one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time

import numpy as np

from dynemb.common.cli_args import add_command
from dynemb.ps_server.change_log import DEFAULT_MAX_IDS as DEFAULT_CHANGE_LOG
from dynemb.ps_server.entries import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_IDS
from dynemb.ps_server.errors import InvalidArgument, PSError

SERVE_EPILOG = """\
examples:
  dynemb ps serve                                    # embedded store, port 50051, /metrics on 9090
  dynemb ps serve --backend redis://localhost:6379/0 --namespace ctr_model
  dynemb ps serve --backend redis+cluster://10.0.0.1:7000,10.0.0.2:7000 --auth-token s3cret
  dynemb ps serve --backend "disk:///var/lib/dynemb/rows?cache_bytes=8GiB&sync=ack"   # rows on local SSD
  dynemb ps serve --tls-cert server.pem --tls-key server.key

The PS drains on SIGTERM or SIGINT: health turns NOT_SERVING; after --not-serving-seconds
new requests are refused with UNAVAILABLE (clients retry them), in-flight ones get
--drain-seconds to finish, and the process exits.
"""

CLIENT_EPILOG = """\
examples:
  dynemb ps tables --ps localhost:50051
  dynemb ps create-table user --dim 64 --state-width 64 --dtype fp32 --init uniform --init-a -0.01 --init-b 0.01
  dynemb ps describe user
  dynemb ps pull user 1 2 3
  dynemb ps stats
  dynemb ps drop user
"""


PLAN_EPILOG = """\
examples:
  dynemb ps plan --rows 1e10 --dim 64 --optimizer adam --samples-per-s 1e6 --ids-per-sample 40 --hit-rate 0.9
  dynemb ps plan --rows 2e9 --dim 128 --optimizer rowwise_adagrad --samples-per-s 300000 \\
      --ids-per-sample 26 --hit-rate 0.8 --replicas 0 --json
  dynemb ps plan --new-ids-per-day 1e9 --ttl 30d --dim 64 --optimizer adam \\
      --samples-per-s 1e6 --ids-per-sample 40 --hit-rate 0.9          # rows that expire

What it computes (docs/scale.md explains each step and worked examples):
  rows = --rows, or for rows that expire the steady state: min(--max-rows, --rows +
  --new-ids-per-day x --ttl in days): a row lives a TTL past its last use, so the table holds
  the IDs first seen within the last TTL, and --rows, long-lived rows in use, on top.
  misses/s = samples/s x IDs per sample x (1 - hit rate): each is pulled from the PS, and
  about as many evicted rows are pushed back, so the PS moves 2 x misses rows/s.
  Redis memory = rows x (the row's bytes on Redis, with its 4-byte last-touched stamp);
  masters = enough for the memory at --redis-gib-per-master each, and for the rows/s at
  --utilisation of one core each.
  PS processes = rows/s over --utilisation x the rows/s one PS process was measured to move.
  The disk tier, the same rows on disk PSes with no Redis: bytes on disk = rows x 1.15 x (the
  row and its id), as measured; disk PSes = enough for the bytes at --disk-tib-per-ps each and
  for the rows/s at --utilisation of one disk PS's measured rate; a DRAM cache of
  --disk-cache-fraction of the rows' bytes; then which tier to pick, by RAM and processes.
The measured constants (and the benchmark each comes from) are in dynemb/ps_server/sizing.py.
Numbers may be written 1e10, 10000000000 or 10_000_000_000.
"""

# subcommand: (its line in `dynemb ps --help`, the start of its own --help)
HELP = {
    "plan": (
        "size Redis and the PS processes for a model and a training rate, and a disk tier (no PS needed)",
        "Print what a model needs: Redis memory, Redis Cluster masters, PS processes, the rows/s\n"
        "the PS must move, CPU and network, from the model's size, the training rate and\n"
        "measured constants; then the same rows on disk PSes (bytes on disk, disk PSes, their\n"
        "DRAM cache and memory), and which of the two to pick.",
    ),
    "serve": (
        "run a parameter server",
        "Run a long-lived PS: gRPC service (with health checking and reflection) over the embedded store or Redis, "
        "and a Prometheus /metrics endpoint.",
    ),
    # the commands that talk to running PSs say the same in both places
    **{
        name: (text, text)
        for name, text in {
            "tables": "list the tables with their schemas and row counts",
            "create-table": "create a table on every PS (no error if it exists with the same schema)",
            "describe": "show one table's schema, row count, lifecycle (TTL, row cap) and last sweep",
            "lifecycle": "set when a table's rows expire (TTL, row cap) on every PS, on a live table",
            "changes": "keep or stop a table's change log (the ids pushed, which `dynemb table publish` reads)",
            "drop": "drop a table and all its rows on every PS",
            "pull": "print the rows of some ids",
            "stats": "per-PS backend, uptime, tables and request counts",
            "health": "health status of each PS (exit 1 unless all SERVING)",
        }.items()
    },
}


def _env(name: str, default=None, cast=str):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return cast(value)
    except ValueError:
        raise SystemExit(f"environment variable {name}={value!r} is not a valid {cast.__name__}") from None


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


_flag.__name__ = "boolean (1/0, true/false, yes/no, on/off)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `ps` and its subcommands to the `dynemb` command's subparsers `sub`."""
    ps = sub.add_parser("ps", help="parameter server: serve, or manage tables on running ones")
    ps_sub = ps.add_subparsers(dest="ps_command", metavar="COMMAND", required=True)

    serve = add_command(ps_sub, "serve", HELP, SERVE_EPILOG)

    def option(flag: str, env: str, default, help: str, cast=str, shown: bool = True) -> None:
        """A serve flag whose default comes from the environment variable `env`; its help says so."""
        tail = f"[env {env}, default %(default)s]" if shown else f"[env {env}]"
        kind = {} if cast is str else {"type": cast}
        serve.add_argument(flag, default=_env(env, default, cast), help=f"{help} {tail}".lstrip(), **kind)

    option(
        "--address",
        "DYNEMB_PS_ADDRESS",
        "127.0.0.1:50051",
        "host:port to listen on; port 0 picks a free one. The default takes calls from this machine only: "
        "listening on every interface (0.0.0.0:50051, e.g. in a pod) is a choice you make",
    )
    option(
        "--backend",
        "DYNEMB_PS_BACKEND",
        "",
        "where rows live: embedded:// (the default: in this process, lost on exit), embedded:///DIR (saved to "
        "DIR on shutdown, loaded at start), disk:///DIR[?cache_bytes=256MiB&sync=ack|MS&compression=none|lz4] "
        "(RocksDB in DIR: rows beyond RAM, each write in its log; docs/ps.md), redis://[user:pass@]host:port/db, "
        "rediss://... (TLS), "
        "redis+cluster://host:port[,host:port], redis+sentinel://host:port[,host:port]/MASTER_NAME (Sentinels)",
        shown=False,
    )
    option("--namespace", "DYNEMB_NAMESPACE", "dynemb", "Redis key prefix, so several models share one Redis")
    option("--max-message-mb", "DYNEMB_PS_MAX_MESSAGE_MB", 64.0, "largest gRPC message in MiB, either way", float)
    option(
        "--max-row-width",
        "DYNEMB_PS_MAX_ROW_WIDTH",
        16384,
        "widest rows (dim + state_width values) a table created here may have, at most 65536; wider ones are refused",
        int,
    )
    option(
        "--max-request-mb",
        "DYNEMB_PS_MAX_REQUEST_MB",
        64.0,
        "most MiB of rows one pull or push may ask for or carry, in its messages or through shared memory: "
        "bounds the memory one request makes the PS use",
        float,
    )
    option(
        "--max-request-entries",
        "DYNEMB_PS_MAX_REQUEST_ENTRIES",
        DEFAULT_MAX_ENTRIES,
        "most entries (a table's pull or push each) one PullMany or PushMany may have",
        int,
    )
    option(
        "--max-request-ids",
        "DYNEMB_PS_MAX_REQUEST_IDS",
        DEFAULT_MAX_IDS,
        "most ids one request may carry, over all its entries",
        int,
    )
    option("--workers", "DYNEMB_PS_WORKERS", 16, "request-handling threads", int)
    option(
        "--auth-token",
        "DYNEMB_PS_AUTH_TOKEN",
        None,
        "require 'authorization: Bearer TOKEN' on every call (server reflection too; health checks too with "
        "--auth-health). Prefer the variable: a flag shows in `ps`",
        shown=False,
    )
    serve.add_argument(
        "--auth-health",
        action="store_true",
        default=_env("DYNEMB_PS_AUTH_HEALTH", False, _flag),
        help="health checks need the token too (off by default so kubelet and load-balancer "
        "probes, which send none, work) [env DYNEMB_PS_AUTH_HEALTH=1]",
    )
    option("--tls-cert", "DYNEMB_PS_TLS_CERT", None, "PEM certificate: serve TLS", shown=False)
    option("--tls-key", "DYNEMB_PS_TLS_KEY", None, "PEM private key of --tls-cert", shown=False)
    option(
        "--tls-client-ca",
        "DYNEMB_PS_TLS_CLIENT_CA",
        None,
        "mutual TLS: accept only clients whose certificate this CA (PEM) signed",
        shown=False,
    )
    option(
        "--metrics-port",
        "DYNEMB_PS_METRICS_PORT",
        9090,
        "port of the Prometheus /metrics endpoint; -1 turns it off, 0 picks a free one",
        int,
    )
    option(
        "--max-table-labels",
        "DYNEMB_PS_MAX_TABLE_LABELS",
        1000,
        "tables whose rows /metrics shows under their own table label; the rows of further tables "
        'count under table="(other)" (ListTables and Stats show every table)',
        int,
    )
    option(
        "--metrics-address",
        "DYNEMB_PS_METRICS_ADDRESS",
        "127.0.0.1",
        "address of the /metrics endpoint (0.0.0.0: every interface)",
    )
    option(
        "--drain-seconds", "DYNEMB_PS_DRAIN_SECONDS", 30.0, "on SIGTERM, how long in-flight requests may take", float
    )
    option(
        "--not-serving-seconds",
        "DYNEMB_PS_NOT_SERVING_SECONDS",
        1.0,
        "on SIGTERM, how long health says NOT_SERVING while requests are still taken, before the port closes",
        float,
    )
    option(
        "--redis-buckets",
        "DYNEMB_PS_REDIS_BUCKETS",
        4096,
        "Redis hashes of a new table that declares no expected rows (fixed once a table exists); rows per "
        "hash over Redis's hash-max-listpack-entries cost ~1.35x their bytes in Redis memory (README: Redis memory)",
        int,
    )
    option(
        "--redis-rows-per-bucket",
        "DYNEMB_PS_REDIS_ROWS_PER_BUCKET",
        16,
        "rows a Redis hash is sized for in a new table that declares its expected rows: it gets "
        "expected_rows / this many hashes (up to 2^28), kept as compact listpacks",
        int,
    )
    option(
        "--redis-listpack",
        "DYNEMB_PS_REDIS_LISTPACK",
        "auto",
        "auto: raise Redis's hash-max-listpack-value/-entries (CONFIG SET, never lowered) to what the tables' "
        "rows need, so their hashes take ~1.12x the rows' bytes, not ~1.35x; off: leave Redis's config alone",
    )
    option(
        "--redis-durable",
        "DYNEMB_PS_REDIS_DURABLE",
        "auto",
        "acknowledge a push or delete only once Redis replicas have it (WAIT), so a failover loses no "
        "acknowledged row: auto = 1 replica on each master that has any; N = N replicas, else the write "
        "fails and is retried; off = never wait (a failover may lose the last writes)",
    )
    option(
        "--redis-durable-timeout-ms",
        "DYNEMB_PS_REDIS_DURABLE_TIMEOUT_MS",
        2000,
        "how long a durable write waits for its replicas before it fails (and is retried)",
        int,
    )
    option(
        "--backend-check-seconds",
        "DYNEMB_PS_BACKEND_CHECK_SECONDS",
        1.0,
        "how often to ping the store; while it does not answer, health says NOT_SERVING",
        float,
    )
    option(
        "--sweep-every",
        "DYNEMB_PS_SWEEP_EVERY",
        60.0,
        "seconds between sweeps of a table whose rows expire (TTL, row cap), or ttl / 8 if longer, at most "
        "an hour; of the PSes over one store, one sweeps each table; 0: this PS sweeps nothing",
        float,
    )
    option(
        "--shm-max-mb",
        "DYNEMB_PS_SHM_MAX_MB",
        4096.0,
        "same-host clients' memory segments this PS maps at once, for row transfer without copies through "
        "gRPC; 0: none (such clients send rows as bytes)",
        float,
    )
    option(
        "--shm-idle-seconds",
        "DYNEMB_PS_SHM_IDLE_SECONDS",
        300.0,
        "drop a segment unused this long (its client died)",
        float,
    )
    serve.add_argument(
        "--read-only",
        action="store_true",
        default=_env("DYNEMB_PS_READ_ONLY", False, _flag),
        help="serve published tables (`dynemb table apply`) read only: pulls return rows and a missing mask, "
        "nothing initialised; every write is refused. --backend is the serving store: the Redis (its --namespace) "
        "or embedded:///DIR, reloaded when a newer apply lands [env DYNEMB_PS_READ_ONLY]",
    )
    option(
        "--follow-seconds",
        "DYNEMB_PS_FOLLOW_SECONDS",
        1.0,
        "read only over embedded:///DIR: how often to look for a newer apply",
        float,
    )
    serve.add_argument("--port-file", help="write the bound port here once serving (for scripts and tests)")
    option("--log-level", "DYNEMB_LOG_LEVEL", "INFO", "")
    serve.set_defaults(func=cmd_serve)

    add_plan_parser(ps_sub)

    def client_parser(name: str) -> argparse.ArgumentParser:
        p = add_command(ps_sub, name, HELP, CLIENT_EPILOG)
        add_client_flags(p)
        return p

    p = client_parser("tables")
    p.set_defaults(func=cmd_tables)
    p = client_parser("create-table")
    p.add_argument("table")
    p.add_argument("--dim", type=int, required=True, help="embedding values per row")
    p.add_argument("--state-width", type=int, default=0, help="optimizer-state values per row [default 0]")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    p.add_argument(
        "--expected-rows",
        type=int,
        default=0,
        help="rows the table is expected to hold (over all PSes); the store sizes its layout by it "
        "(Redis: compact hashes of ~16 rows) [default 0: the store's default]",
    )
    add_init_flags(p, "how rows never pushed are filled when pulled [default zeros]", "initial optimizer-state value")
    add_lifecycle_flags(p)
    p.set_defaults(func=cmd_create_table)
    p = client_parser("lifecycle")
    p.add_argument("table")
    add_lifecycle_flags(p)
    p.add_argument("--never", action="store_true", help="rows never expire (clears the TTL and the row cap)")
    p.set_defaults(func=cmd_lifecycle)
    p = client_parser("changes")
    p.add_argument("table")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--on",
        action="store_true",
        help=f"keep a change log of the newest {DEFAULT_CHANGE_LOG:,} ids pushed, on each PS",
    )
    g.add_argument(
        "--max-ids",
        type=_number("whole"),
        help="keep a change log of the newest this many ids pushed, on each PS (4096 to 2^30)",
    )
    g.add_argument("--off", action="store_true", help="keep none (a publisher then cuts a full version next)")
    p.set_defaults(func=cmd_changes)
    p = client_parser("describe")
    p.add_argument("table")
    p.set_defaults(func=cmd_describe)
    p = client_parser("drop")
    p.add_argument("table")
    p.add_argument("--missing-ok", action="store_true", help="no error if the table does not exist")
    p.set_defaults(func=cmd_drop)
    p = client_parser("pull")
    p.add_argument("table")
    p.add_argument("ids", nargs="+", type=int)
    p.set_defaults(func=cmd_pull)
    p = client_parser("stats")
    p.set_defaults(func=cmd_stats)
    p = client_parser("health")
    p.add_argument(
        "--service",
        default="",
        help="health service to ask about: '' (the PS can serve; NOT_SERVING while its store is away or it "
        "drains: a readiness check) or 'liveness' (the process is alive: a liveness check) [default '']",
    )
    p.set_defaults(func=cmd_health)


def duration_flag_type(whole: bool = False):
    """An argparse type for a duration (seconds, or 90s, 5m, 12h, 30d): float seconds, or whole
    seconds of at least 1."""
    from dynemb.ps_server.sizing import parse_duration

    def duration(text: str) -> float:
        try:
            seconds = parse_duration(text)
        except PSError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return max(1, round(seconds)) if whole else seconds

    duration.__name__ = "duration"
    return duration


def add_lifecycle_flags(p: argparse.ArgumentParser) -> None:
    """--ttl, --max-rows, --touch-every: when a table's rows expire (docs/ps.md, "Rows that expire")."""
    duration = duration_flag_type(whole=True)
    g = p.add_argument_group("rows that expire")
    g.add_argument(
        "--ttl",
        type=duration,
        default=0,
        help="delete rows neither written nor read by a trainer for this long: seconds, or 90m, 12h, 30d "
        "[default: never]",
    )
    g.add_argument(
        "--max-rows",
        type=_number("whole"),
        default=0,
        help="past this many rows (over all PSes), delete the least recently used first, none in use [default: no cap]",
    )
    g.add_argument(
        "--touch-every",
        type=duration,
        default=0,
        help="how often rows in use are touched (trainers, pulls) [default: ttl / 4, or 10m without a TTL]",
    )


def _lifecycle_from_args(args):
    from dynemb.ps_server.lifecycle import Lifecycle

    return Lifecycle(ttl_s=args.ttl, max_rows=args.max_rows, touch_every_s=args.touch_every)


def _lifecycle_text(info) -> str:
    """A table's lifecycle and last sweep, in a line (`describe`, `lifecycle`)."""
    from dynemb.ps_server.sizing import format_duration

    lc = info.lifecycle
    if not lc.active:
        return "rows never expire"
    parts = [f"ttl={format_duration(lc.ttl_s)}" if lc.ttl_s else "ttl=none"]
    parts.append(f"max_rows={lc.max_rows}" if lc.max_rows else "max_rows=none")
    parts.append(f"touch_every={format_duration(lc.touch_interval_s)}")
    return " ".join(parts)


def _number(kind: str):
    """An argparse type: a finite number, written 1e10, 10000000000 or 10_000_000_000; whole
    when kind is "whole"."""

    def parse(text: str) -> float | int:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number (write e.g. 1e10 or 10000000000)") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if kind == "whole":
            if value != int(value):
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
            return int(text) if text.strip().lstrip("+-").replace("_", "").isdigit() else int(value)
        return value

    parse.__name__ = f"{kind} number"
    return parse


def add_plan_parser(ps_sub: argparse._SubParsersAction) -> None:
    """Adds `ps plan`."""
    from dynemb.ps_server.sizing import OPTIMIZERS, parse_duration

    p = add_command(ps_sub, "plan", HELP, PLAN_EPILOG)
    model = p.add_argument_group("the model (--rows, or --new-ids-per-day with --ttl or --max-rows, or both)")
    model.add_argument(
        "--rows",
        type=_number("whole"),
        help="rows stored, all tables together (e.g. 1e10); with --new-ids-per-day, the long-lived "
        "rows (in use, so never idle for a TTL) on top of the expiring ones",
    )
    model.add_argument("--dim", type=_number("whole"), required=True, help="embedding values per row (e.g. 64)")
    model.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        required=True,
        help="the trainer's optimizer: it sets the optimizer state stored with each row (sgd none, "
        "rowwise_adagrad 1 value, adagrad dim values, adam 2 x dim)",
    )

    def duration(text: str) -> float:
        try:
            return parse_duration(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    expiry = p.add_argument_group("rows that expire (the plan is for their steady state)")
    expiry.add_argument(
        "--new-ids-per-day",
        type=_number("real"),
        help="IDs seen for the first time a day, all tables together (e.g. 1e9); needs --ttl or --max-rows",
    )
    expiry.add_argument(
        "--ttl",
        type=duration,
        help="a row neither read nor written this long is deleted: seconds, or a number with s, m, h or d "
        "(e.g. 30d, 12h)",
    )
    expiry.add_argument("--max-rows", type=_number("whole"), help="the row cap: the most rows stored (e.g. 2e10)")
    rate = p.add_argument_group("the training rate")
    rate.add_argument(
        "--samples-per-s", type=_number("real"), required=True, help="samples trained per second, all trainers"
    )
    rate.add_argument(
        "--ids-per-sample", type=_number("real"), required=True, help="IDs looked up per sample, all features together"
    )
    rate.add_argument(
        "--hit-rate",
        type=_number("real"),
        required=True,
        help="share of IDs found in the trainers' device tables, 0 to 1 (the trainer's metrics report it)",
    )
    fleet = p.add_argument_group("the fleet")
    fleet.add_argument(
        "--utilisation",
        type=_number("real"),
        default=0.5,
        help="share of measured capacity to plan on; the rest is headroom [default %(default)s]",
    )
    fleet.add_argument(
        "--redis-gib-per-master",
        type=_number("real"),
        default=32.0,
        help="row data one Redis master holds; give its machine more RAM for forks and fragmentation "
        "[default %(default)s]",
    )
    fleet.add_argument(
        "--replicas", type=_number("whole"), default=1, help="replicas per Redis master [default %(default)s]"
    )
    disk = p.add_argument_group("the disk tier (disk:// PSes instead of Redis, priced beside it)")
    disk.add_argument(
        "--disk-tib-per-ps",
        type=_number("real"),
        default=2.5,
        help="TiB of rows (after compaction) one disk PS's own disk holds. The default fills ~70%% of a "
        "3.84 TB NVMe drive (3.49 TiB): RocksDB writes a compaction's new files before it deletes the old "
        "ones, keeps deleted rows until compacted and its log besides, and SSDs slow down when nearly "
        "full [default %(default)s]",
    )
    disk.add_argument(
        "--disk-cache-fraction",
        type=_number("real"),
        default=0.1,
        help="each disk PS's DRAM cache (its cache_bytes) as a share of the bytes of the rows it holds, "
        "above 0, at most 1. Only 0.1 was measured: a hit rate of 0.81 in the PS's pool of rows on Zipf(1.05) "
        "batches [default %(default)s]",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    """`ps plan`: print the plan (an InvalidArgument for a value out of range)."""
    from dynemb.ps_server.sizing import format_plan, plan

    result = plan(
        args.rows,
        args.dim,
        args.optimizer,
        args.samples_per_s,
        args.ids_per_sample,
        args.hit_rate,
        utilisation=args.utilisation,
        redis_gib_per_master=args.redis_gib_per_master,
        replicas=args.replicas,
        new_ids_per_day=args.new_ids_per_day,
        ttl=args.ttl,
        max_rows=args.max_rows,
        disk_tib_per_ps=args.disk_tib_per_ps,
        disk_cache_fraction=args.disk_cache_fraction,
    )
    print(json.dumps(result.as_dict(), sort_keys=True) if args.json else format_plan(result))
    return 0


def cmd_serve(args) -> int:
    """`dynemb ps serve`: serve until SIGTERM or SIGINT, then drain and exit the process (0); 2 where the
    PS cannot start."""
    from dynemb.ps_server.parent_watch import die_with_parent
    from dynemb.ps_server.server import PSServer, ServeConfig

    die_with_parent()

    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The handler only records the signal: it runs in the main thread between two bytecodes,
    # wherever that thread is, so taking a lock there (an Event's, logging's) can deadlock
    # against the main thread itself (seen: a PS not out 60 s after SIGTERM). Installed before
    # the server starts and the port file appears, so an early SIGTERM still drains.
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        config = ServeConfig(
            address=args.address,
            backend=args.backend,
            namespace=args.namespace,
            max_message_bytes=int(args.max_message_mb * (1 << 20)),
            max_row_width=args.max_row_width,
            max_request_bytes=int(args.max_request_mb * (1 << 20)),
            max_request_entries=args.max_request_entries,
            max_request_ids=args.max_request_ids,
            workers=args.workers,
            auth_token=args.auth_token or None,
            auth_health=args.auth_health,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            metrics_address=args.metrics_address,
            max_table_labels=args.max_table_labels,
            drain_seconds=args.drain_seconds,
            not_serving_seconds=args.not_serving_seconds,
            redis_buckets=args.redis_buckets,
            redis_rows_per_bucket=args.redis_rows_per_bucket,
            redis_listpack=args.redis_listpack,
            redis_durable=args.redis_durable,
            redis_durable_timeout_ms=args.redis_durable_timeout_ms,
            backend_check_seconds=args.backend_check_seconds,
            sweep_every_seconds=args.sweep_every,
            shm_max_bytes=int(args.shm_max_mb * (1 << 20)),
            shm_idle_seconds=args.shm_idle_seconds,
            read_only=args.read_only,
            follow_seconds=args.follow_seconds,
        )
        server = PSServer(config).start()
    except Exception as exc:  # bad flags or an unusable port: say so, exit non-zero
        logging.getLogger("dynemb.ps").error("cannot start the PS: %s", exc)
        return 2
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{server.port} {server.metrics_port or 0}\n")
        os.replace(tmp, args.port_file)
    while not signals:
        time.sleep(0.1)  # the handler runs during the sleep; the loop sees it within 0.1 s
    logging.getLogger("dynemb.ps").info("got %s", signal.Signals(signals[0]).name)
    server.stop(close_port=False)
    # Exit without grpc's shutdown (see PSServer.stop): the connections close with the process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def add_client_flags(p: argparse.ArgumentParser, ps_default: str | None = "localhost:50051", ps_group=None) -> None:
    """--ps, --auth-token, --tls-ca, --timeout: how a command reaches running PSs (--ps goes
    into ps_group where given, e.g. a mutually exclusive group)."""
    default = _env("DYNEMB_PS", ps_default)
    (ps_group or p).add_argument(
        "--ps",
        default=default,
        help="PS address(es), comma-separated shards; 'a:50051|b:50051' = replicas of one shard "
        "over the same Redis [env DYNEMB_PS" + (", default %(default)s]" if default else "]"),
    )
    p.add_argument("--auth-token", default=_env("DYNEMB_PS_AUTH_TOKEN"), help="[env DYNEMB_PS_AUTH_TOKEN]")
    p.add_argument(
        "--tls-ca",
        default=_env("DYNEMB_PS_TLS_CA"),
        help="CA certificate (PEM) to reach a TLS PS [env DYNEMB_PS_TLS_CA]",
    )
    p.add_argument(
        "--tls-cert",
        default=_env("DYNEMB_PS_CLIENT_CERT"),
        help="this client's certificate (PEM), for a PS that wants mutual TLS [env DYNEMB_PS_CLIENT_CERT]",
    )
    p.add_argument(
        "--tls-key",
        default=_env("DYNEMB_PS_CLIENT_KEY"),
        help="private key (PEM) of --tls-cert [env DYNEMB_PS_CLIENT_KEY]",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call [default %(default)s]")


def add_init_flags(p: argparse.ArgumentParser, init_help: str, state_init_help: str) -> None:
    """Adds --init, --init-a, --init-b, --init-seed and --state-init: how a table's new rows are filled.

    Args:
        p: the command's parser.
        init_help: the help of --init (what it fills, for this command).
        state_init_help: the help of --state-init.
    """
    p.add_argument("--init", choices=("zeros", "constant", "uniform", "normal"), default="zeros", help=init_help)
    p.add_argument("--init-a", type=float, default=0.0, help="constant value / uniform low / normal mean")
    p.add_argument("--init-b", type=float, default=0.0, help="uniform high / normal std")
    p.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--state-init", type=float, default=0.0, help=state_init_help)


def initializer_from_args(args):
    """The Initializer (schema.py) the flags of add_init_flags describe."""
    from dynemb.ps_server.schema import Initializer

    return Initializer(args.init, args.init_a, args.init_b, args.init_seed, args.state_init)


def client_from_args(args):
    """A PSClient for the flags of add_client_flags."""
    from dynemb.ps_server.client import PSClient

    return PSClient(
        args.ps,
        auth_token=args.auth_token,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        timeout=args.timeout,
    )


def _table_line(info) -> str:
    s = info.schema
    init = s.initializer
    return (
        f"{s.name:<24} dim={s.dim:<5} state_width={s.state_width:<4} dtype={s.dtype:<5} "
        f"init={init.kind}({init.a:g},{init.b:g}) rows={info.num_rows}"
    )


def cmd_tables(args) -> int:
    """`dynemb ps tables`: print each table's schema and row count."""
    with client_from_args(args) as ps:
        tables = ps.list_tables()
    for info in tables:
        print(_table_line(info))
    if not tables:
        print("(no tables)")
    return 0


def cmd_create_table(args) -> int:
    """`dynemb ps create-table`: create the table on every PS and print it."""
    with client_from_args(args) as ps:
        info = ps.create_table(
            args.table,
            args.dim,
            args.state_width,
            args.dtype,
            initializer_from_args(args),
            expected_rows=args.expected_rows,
            lifecycle=_lifecycle_from_args(args),
        )
    print(_table_line(info))
    if info.lifecycle.active:
        print(f"{'':<24} {_lifecycle_text(info)}")
    return 0


def cmd_lifecycle(args) -> int:
    """`dynemb ps lifecycle`: set when a table's rows expire, on every PS."""
    from dynemb.ps_server.lifecycle import Lifecycle

    lifecycle = Lifecycle() if args.never else _lifecycle_from_args(args)
    if not args.never and not lifecycle.active:
        raise InvalidArgument(
            "dynemb ps lifecycle: give --ttl and/or --max-rows (and --touch-every if wanted), or --never"
        )
    with client_from_args(args) as ps:
        info = ps.set_lifecycle(args.table, lifecycle)
    print(f"{args.table}: {_lifecycle_text(info)}")
    return 0


def cmd_changes(args) -> int:
    """`dynemb ps changes`: keep (or stop keeping) a table's change log, on every PS."""
    max_ids = 0 if args.off else (DEFAULT_CHANGE_LOG if args.on else args.max_ids)
    with client_from_args(args) as ps:
        info = ps.set_change_log(args.table, max_ids)
    state = (
        f"a change log of the newest {info.change_log:,} ids pushed, on each PS" if info.change_log else "no change log"
    )
    print(f"{args.table}: {state}")
    return 0


def cmd_describe(args) -> int:
    """`dynemb ps describe`: print one table's schema, row count, lifecycle and last sweep as JSON."""
    with client_from_args(args) as ps:
        info = ps.describe_table(args.table)
        doc = {**info.schema.to_dict(), "expected_rows": info.schema.expected_rows, "num_rows": info.num_rows}
        if info.lifecycle.active:
            doc["lifecycle"] = {**info.lifecycle.to_dict(), "touch_every_s": info.lifecycle.touch_interval_s}
            doc["last_sweep"] = info.last_sweep._asdict() if info.last_sweep else None
            doc["expired_reads"] = info.expired_reads
        doc["change_log"] = info.change_log
        print(json.dumps(doc, indent=2))
    return 0


def cmd_drop(args) -> int:
    """`dynemb ps drop`: drop a table on every PS."""
    with client_from_args(args) as ps:
        n = ps.drop_table(args.table, missing_ok=args.missing_ok)
    print(f"dropped {args.table} ({n} rows)")
    return 0


def cmd_pull(args) -> int:
    """`dynemb ps pull`: print the rows of some ids (bf16 as values)."""
    with client_from_args(args) as ps:
        got = ps.pull(args.table, np.array(args.ids, dtype=np.int64))
        rows = got.rows
        if ps.schema(args.table).dtype == "bf16":  # rows travel as bf16 bit patterns: print the values
            from dynemb.ps_server.initializer import bf16_bits_to_float

            rows = bf16_bits_to_float(rows)
    with np.printoptions(precision=4, suppress=True, linewidth=120, threshold=24, edgeitems=4):
        for i, row, miss in zip(args.ids, rows, got.missing):
            print(f"{i}: {'(missing) ' if miss else ''}{row}")
    return 0


def cmd_stats(args) -> int:
    """`dynemb ps stats`: print each PS's stats as JSON."""
    from google.protobuf import json_format

    with client_from_args(args) as ps:
        for address, reply in zip(ps.addresses, ps.stats()):
            print(json.dumps({"address": address, **json_format.MessageToDict(reply)}, indent=2))
    return 0


def cmd_health(args) -> int:
    """`dynemb ps health`: print each PS's health; 1 unless all are SERVING."""
    with client_from_args(args) as ps:
        status = ps.health(timeout=args.timeout, service=args.service)
        for address, s in zip(ps.addresses, status):
            print(f"{address}: {s}")
    return 0 if all(s == "SERVING" for s in status) else 1
