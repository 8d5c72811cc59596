"""`dynemb checkpoint ...`: checkpoints (dynemb/checkpoint/format.py) from and onto a PS.

Each subcommand is one cmd_* function registered in add_parser: it takes the parsed flags
and returns the exit status (0 unless its docstring says otherwise). A training job checkpoints itself
(`dynemb train --checkpoint-dir D --checkpoint-every N`) and resumes with `--resume`; these
commands work on the folders without a job.
"""

from __future__ import annotations

import argparse

from dynemb.checkpoint import table_cli
from dynemb.common.cli_args import add_command, add_command_group, quiet_flag, table_flag
from dynemb.ps_server.cli import add_client_flags

# subcommand: (its line in the list of commands, the start of its own --help)
HELP = {
    "checkpoint": (
        "inspect, save and restore checkpoints",
        "Checkpoints: inspect a training job's checkpoints, save PS tables as a checkpoint and restore one onto "
        "any PS. (`export` and `import` are the old names of `dynemb table export|import`.)",
    ),
    "inspect": (
        "show what a checkpoint holds; --verify checks every file",
        "Print a checkpoint's step, kind, chain, ranks, optimizer and tables with their row counts; for a folder "
        "of checkpoints, list them. --verify checks the sha256 of every file of the checkpoint and of the ones it "
        "builds on.",
    ),
    "save": (
        "checkpoint PS tables into a new folder",
        "Write PS tables (rows with optimizer state) as a checkpoint: tables/<table>/ folders and a manifest with "
        "the sha256 of every file, moved into place only when complete. `restore` puts them back on any PS.",
    ),
    "restore": (
        "put a checkpoint's tables on a PS (replacing their rows)",
        "Verify a checkpoint and the incremental ones it builds on, then replace each of its tables' rows on the "
        "PS with the checkpoint's (the full one, then each increment). Nothing is written when a check fails. To "
        "resume training, use `dynemb train --resume CKPT` instead: it also restores the model, optimizers and ID "
        "transformers.",
    ),
}

EPILOG = """\
examples:
  # what a training job's checkpoint holds (and whether every file is intact)
  dynemb checkpoint inspect ckpt/step-00000200 --verify
  dynemb checkpoint inspect ckpt/                    # the checkpoints in a folder
  # a training checkpoint's tables (its incremental chain applied) onto a PS, e.g. for serving
  dynemb checkpoint restore ckpt/step-00000200 --ps localhost:50051
  # a consistent, checksummed copy of every table on a PS, and back
  dynemb checkpoint save --ps localhost:50051 --out snap/
  dynemb checkpoint restore snap/ --ps localhost:50051
Portable table folders (one table each, no manifest): `dynemb table export|import`.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `checkpoint` and its subcommands to the `dynemb` command's subparsers `sub`."""
    ck_sub = add_command_group(sub, "checkpoint", HELP, EPILOG, "checkpoint_command")

    p = add_command(ck_sub, "inspect", HELP, EPILOG)
    p.add_argument("folder", help="a checkpoint (step-NNNNNNNN/) or a folder of them")
    p.add_argument("--verify", action="store_true", help="check every file's sha256 (exit 1 naming a bad one)")
    quiet_flag(p)
    p.set_defaults(func=cmd_inspect)

    p = add_command(ck_sub, "save", HELP, EPILOG)
    add_client_flags(p)
    p.add_argument("--out", required=True, help="the checkpoint folder to create (must not hold files)")
    table_flag(p, "a table to save (repeat for several) [default: every table on the PS]")
    quiet_flag(p)
    p.set_defaults(func=cmd_save)

    p = add_command(ck_sub, "restore", HELP, EPILOG)
    p.add_argument("folder", help="a checkpoint folder (with manifest.json)")
    add_client_flags(p)
    table_flag(p, "restore only this table (repeat for several) [default: all]")
    quiet_flag(p)
    p.set_defaults(func=cmd_restore)

    # the old names of `dynemb table export|import`, kept for one release
    table_cli.add_table_commands(ck_sub, old_name_of="dynemb table")


def cmd_inspect(args) -> int:
    """`dynemb checkpoint inspect`; 2 where --verify is given a folder of checkpoints."""
    from dynemb.checkpoint.format import MANIFEST, chain, describe, verify

    print(describe(args.folder))
    if args.verify:
        from pathlib import Path

        links = chain(args.folder) if (Path(args.folder) / MANIFEST).is_file() else []
        if not links:
            print("--verify checks one checkpoint; give a step-NNNNNNNN/ folder")
            return 2
        for c in links:
            n = len(verify(c, progress=not args.quiet)["files"])
            print(f"verified {c.name}: {n} files, sha256 match")
    return 0


def cmd_save(args) -> int:
    """`dynemb checkpoint save`: the chosen PS tables into a new checkpoint folder."""
    from dynemb.checkpoint.format import save_tables
    from dynemb.checkpoint.table_cli import chosen_tables
    from dynemb.ps_server.cli import client_from_args

    with client_from_args(args) as ps:
        names = chosen_tables(ps, args, "saved")
        if not names:
            return 0
        out = save_tables(ps, names, args.out, progress=not args.quiet)
    print(f"saved {len(names)} table(s) -> {out}")
    return 0


def cmd_restore(args) -> int:
    """`dynemb checkpoint restore`: a checkpoint's tables onto a PS, each check passed first."""
    from dynemb.checkpoint.format import restore_tables
    from dynemb.ps_server.cli import client_from_args

    with client_from_args(args) as ps:
        written = restore_tables(ps, args.folder, args.table or None, progress=not args.quiet)
    for name, n in written.items():
        print(f"restored table {name}: {n} rows")
    return 0
