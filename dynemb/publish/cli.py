"""`dynemb table publish`: versions of PS tables for serving (dynemb/publish/publisher.py)."""

from __future__ import annotations

import argparse
import time

from dynemb.common.cli_args import add_command, quiet_flag, table_flag
from dynemb.publish.publisher import DEFAULT_FULL_EVERY
from dynemb.publish.quantize import DTYPES

HELP = {
    "publish": (
        "publish versions of PS tables for serving: the rows changed and ids deleted since the last",
        "Cut the next version of each table into DIR/<table>/vNNNNNNNN/: the rows changed since the last version "
        "(embedding values only, in the table's dtype or --dtype) and the ids deleted since, or every row (a full "
        "version: the first, every --full-every, and whenever the PS's logs cannot say what changed). The first "
        "publish of a table turns on its change log on the PS. docs/publish.md has the format.",
    ),
    "apply": (
        "apply published versions to a serving store (Redis, or an embedded store's files)",
        "Take each table of a serving store from the version it holds to the newest in DIR: the newest full version "
        "and the deltas after it, or just the deltas after the one it holds. Every file of the chain is checked "
        "first (sha256, tensors, dtype, shapes, counts, widths against the store): a gap, a corrupt or lying file, "
        "or another publisher's folder writes nothing. Readers (`dynemb ps serve --read-only`, "
        "dynemb.publish.Lookup) switch from one version to the next at once, never reading a mix; an apply cut "
        "short is finished by the next.",
    ),
}

EPILOG = """\
examples:
  # the next version of every table of a PS
  dynemb table publish --ps localhost:50051 --to published/
  # one table, int8 rows (a scale per row), a full version every 10, every 5 minutes until stopped
  dynemb table publish --ps localhost:50051 --table user --to published/ --dtype int8 --full-every 10 --every 5m
"""

APPLY_EPILOG = """\
examples:
  # every table published under published/ into a Redis, namespace "serving"
  dynemb table apply published/ --to redis://localhost:6379 --namespace serving
  # follow: apply new versions as they appear, every 10 s, until stopped
  dynemb table apply published/ --to redis://localhost:6379 --namespace serving --follow --every 10s
  # into an embedded store's files, which `dynemb ps serve --read-only --backend embedded:///srv/tables` serves
  dynemb table apply published/ --to embedded:///srv/tables
"""


def add_parser(table_sub: argparse._SubParsersAction) -> None:
    """Adds `publish` to the `dynemb table` command's subparsers."""
    from dynemb.ps_server.cli import add_client_flags, duration_flag_type

    p = add_command(table_sub, "publish", HELP, EPILOG)
    add_client_flags(p)
    p.add_argument("--to", required=True, metavar="DIR", help="the published tables' folder (created if absent)")
    table_flag(p, "a table to publish (repeat for several) [default: every table on the PS]")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the rows' dtype in the version (int8: row-wise, a float32 scale per row) [default: the table's own]",
    )
    p.add_argument(
        "--full-every",
        type=int,
        default=DEFAULT_FULL_EVERY,
        metavar="K",
        help=f"a full version every K versions, from which a new serving replica starts [default {DEFAULT_FULL_EVERY}]",
    )
    p.add_argument("--full", action="store_true", help="cut a full version now, whatever the chain")
    p.add_argument("--step", type=int, default=0, help="the training step to record in the version [default 0]")
    p.add_argument(
        "--every",
        type=duration_flag_type(),
        default=0,
        metavar="DURATION",
        help="publish again every DURATION (seconds, or 30s, 5m, 1h) until stopped [default: once]",
    )
    quiet_flag(p)
    p.set_defaults(func=cmd_publish)

    p = add_command(table_sub, "apply", HELP, APPLY_EPILOG)
    p.add_argument("folder", metavar="DIR", help="the published tables' folder (`dynemb table publish --to`)")
    p.add_argument(
        "--to",
        required=True,
        metavar="URL",
        help="the serving store: redis://, rediss://, redis+cluster:// (with --namespace), or embedded:///DIR",
    )
    p.add_argument("--namespace", default="dynemb", help="the Redis key namespace of the serving store [dynemb]")
    table_flag(p, "a table to apply (repeat for several) [default: every table published in DIR]")
    p.add_argument("--follow", action="store_true", help="keep applying new versions as they appear, until stopped")
    p.add_argument(
        "--every",
        type=duration_flag_type(),
        default=10.0,
        metavar="DURATION",
        help="with --follow: how often to look for new versions [default 10s]",
    )
    quiet_flag(p)
    p.set_defaults(func=cmd_apply)


def cmd_publish(args) -> int:
    """`dynemb table publish`: the next version of each chosen table."""
    from tqdm import tqdm

    from dynemb.checkpoint.table_cli import chosen_tables
    from dynemb.ps_server.cli import client_from_args
    from dynemb.publish.publisher import PublishConfig, publish_table

    config = PublishConfig(args.to, dtype=args.dtype, full_every=args.full_every)
    with client_from_args(args) as ps:
        while True:
            started = time.monotonic()
            for name in chosen_tables(ps, args, "published"):
                t0 = time.perf_counter()
                with tqdm(unit="row", desc=f"publish {name}", disable=args.quiet) as bar:
                    v = publish_table(ps, name, config, step=args.step, full=args.full, progress=bar.update)
                what = f"{v.rows:,} rows" + (f", {v.deleted:,} deleted" if v.kind == "delta" else "")
                print(
                    f"published {name} v{v.number} ({v.kind}, {v.dtype}: {what}) in "
                    f"{time.perf_counter() - t0:.2f} s -> {v.folder}",
                    flush=True,
                )
            if not args.every:
                return 0
            time.sleep(max(0.0, args.every - (time.monotonic() - started)))


def cmd_apply(args) -> int:
    """`dynemb table apply`: each chosen table's serving copy to the newest version."""
    from pathlib import Path

    from tqdm import tqdm

    from dynemb.common.names import name_problem
    from dynemb.publish.apply import apply_table, serving_store
    from dynemb.publish.version import VersionError, numbers

    root = Path(args.folder)
    if not root.is_dir():
        raise VersionError(f"{root}: no such folder of published tables")
    store = serving_store(args.to, args.namespace)
    while True:
        # a folder whose name is no table's (hidden, say) holds no published table
        found = [p.name for p in root.iterdir() if p.is_dir() and name_problem(p.name) is None]
        names = args.table or sorted(name for name in found if numbers(root, name))
        if not names and not args.follow:
            print(f"no published tables in {root}; nothing applied")
            return 0
        for name in names:
            t0 = time.perf_counter()
            with tqdm(unit="row", desc=f"apply {name}", disable=args.quiet) as bar:
                done = apply_table(store, root, name, progress=bar.update)
            if done.versions:
                applied = ", ".join(f"v{n}" for n in done.versions)
                took = time.perf_counter() - t0
                print(f"{name}: applied {applied} in {took:.2f} s (holds v{done.holds})", flush=True)
            elif not args.follow:
                print(f"{name}: holds v{done.holds}, the newest", flush=True)
        if not args.follow:
            return 0
        time.sleep(args.every)
