"""`dynemb table ...`: portable table folders (dynemb/checkpoint/table_files.py) from and onto a PS.

A table folder holds one table's rows with their optimizer state, on any backend; unlike a
checkpoint (`dynemb checkpoint`) it has no manifest, chain or model state.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from dynemb.common.cli_args import add_command, add_command_group, quiet_flag, rows_per_shard_flag, table_flag
from dynemb.common.names import name_arg

# subcommand: (its line in the list of commands, the start of its own --help)
HELP = {
    "table": (
        "export PS tables to portable folders and import them into any PS; publish versions for serving",
        "Portable table folders (safetensors shards + table.json): export PS tables into them and import them "
        "into any PS, on any backend. Versions for serving: publish a table's changes as versions.",
    ),
    "export": (
        "write PS tables to table folders (OUT/<table>/)",
        "Stream PS tables (rows with their optimizer state) into OUT/<table>/: table.json plus "
        "part-NNNNN.safetensors shards.",
    ),
    "import": (
        "write table folders into a PS (any backend)",
        "Check every shard of the table folders (sha256, shapes, dtype) and the PS's schemas, then stream the "
        "rows into the PS. Nothing is written when a check fails. The table is created if absent; one that "
        "exists must have the same schema.",
    ),
}

EPILOG = """\
A table folder holds table.json (schema, row count, shard list with sha256) and
part-NNNNN.safetensors shards with tensors ids (int64), embeddings and state
(the optimizer state); dynemb/checkpoint/table_files.py documents the format.

examples:
  # every table of a PS into out/<table>/
  dynemb table export --ps localhost:50051 --out out/
  # two tables, 1M rows per shard file
  dynemb table export --ps ps-0:50051,ps-1:50051 --table user --table item --out out/ --rows-per-shard 1000000
  # all table folders under out/ into another PS (embedded or Redis: any backend)
  dynemb table import out/ --ps localhost:50052
  # one table under a new name, its old rows there deleted first
  dynemb table import out/user --as user_v2 --replace --ps localhost:50052
"""


def add_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Adds `table` and its subcommands to the `dynemb` command's subparsers `sub`; returns
    its own subparsers (where dynemb.publish adds `publish`)."""
    table_sub = add_command_group(sub, "table", HELP, EPILOG, "table_command")
    add_table_commands(table_sub)
    return table_sub


def add_table_commands(sub: argparse._SubParsersAction, old_name_of: str = "") -> None:
    """Registers `export` and `import` under `sub`.

    Args:
        sub: the subparsers to add them to.
        old_name_of: set where these are old names kept for one release (e.g. "dynemb table"):
            their help says so and each use prints a note naming the new command.
    """
    from dynemb.ps_server.cli import add_client_flags

    texts = HELP
    if old_name_of:
        texts = {verb: (f"{help} (old name of `{old_name_of} {verb}`)", text) for verb, (help, text) in HELP.items()}
    p = add_command(sub, "export", texts, EPILOG)
    add_client_flags(p)
    p.add_argument("--out", required=True, help="folder to write the table folders in (created if absent)")
    table_flag(p, "a table to export (repeat for several) [default: every table on the PS]")
    rows_per_shard_flag(p, "rows per part-NNNNN.safetensors file")
    p.add_argument("--overwrite", action="store_true", help="replace table folders that already hold files")
    quiet_flag(p)
    p.set_defaults(func=_warned(cmd_export, old_name_of, "export"))

    p = add_command(sub, "import", texts, EPILOG)
    p.add_argument("folder", help="a table folder (with table.json) or a folder of them")
    add_client_flags(p)
    table_flag(p, "import only this table of FOLDER (repeat for several) [default: all]")
    p.add_argument(
        "--as",
        dest="rename",
        metavar="NAME",
        type=name_arg(),
        help="the PS table name, when importing exactly one table [default: its own name]",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="delete the table's rows on the PS before writing (otherwise rows are added/overwritten)",
    )
    p.add_argument(
        "--expected-rows",
        type=int,
        default=0,
        help="rows a table the import creates is expected to hold (the PS sizes its layout by it, e.g. for a "
        "table that will grow) [default: the folder's rows]",
    )
    quiet_flag(p)
    p.set_defaults(func=_warned(cmd_import, old_name_of, "import"))


def _warned(command: Callable, old_name_of: str, verb: str) -> Callable:
    if not old_name_of:
        return command

    def run(args) -> int:
        print(
            f"dynemb: note: this command is now `{old_name_of} {verb}`; the old name goes in the next release",
            file=sys.stderr,
        )
        return command(args)

    return run


def chosen_tables(ps, args, done: str) -> list[str]:
    """The tables `--table` names, else every table on the PS (saying so when there is none).

    Args:
        ps: a connected PSClient.
        args: parsed flags with `table` (a list) and `ps` (the address, for the message).
        done: what would have happened to them ("exported", "saved"), for the message.
    """
    names = args.table or [info.schema.name for info in ps.list_tables()]
    if not names:
        print(f"no tables on the PS at {args.ps}; nothing {done}")
    return names


def cmd_export(args) -> int:
    """`dynemb table export`: the chosen PS tables into OUT/<table>/ folders."""
    from dynemb.checkpoint.table_files import export_table
    from dynemb.common.names import inside
    from dynemb.ps_server.cli import client_from_args

    with client_from_args(args) as ps:
        names = chosen_tables(ps, args, "exported")
        for name in names:
            ps.describe_table(name)  # a missing table fails before any file is written
        # a name the PS lists was checked when the table was made, perhaps by an older dynemb
        folders = {name: inside(args.out, name) for name in names}
        for name in names:
            m = export_table(
                ps,
                name,
                folders[name],
                rows_per_shard=args.rows_per_shard,
                overwrite=args.overwrite,
                progress=not args.quiet,
            )
            print(f"exported {name}: {m.num_rows} rows in {len(m.shards)} shard(s) -> {folders[name]}")
    return 0


def cmd_import(args) -> int:
    """`dynemb table import`: table folders into a PS, every shard and schema checked first."""
    import dataclasses

    from dynemb.checkpoint.table_files import (
        TableFileError,
        TableReader,
        check_no_conflict,
        import_table,
        table_folders,
    )
    from dynemb.ps_server.cli import client_from_args

    folders = table_folders(args.folder)
    readers = {r.schema.name: r for r in map(TableReader, folders)}
    if args.table:
        unknown = [t for t in args.table if t not in readers]
        if unknown:
            raise TableFileError(f"{args.folder}: no table folder for {unknown}; it has {sorted(readers)}")
        readers = {t: readers[t] for t in args.table}
    if args.rename and len(readers) != 1:
        raise TableFileError(
            f"--as names one table, but {len(readers)} would be imported ({sorted(readers)}); pick one with --table"
        )
    with client_from_args(args) as ps:
        # Check everything first: a bad shard or a schema clash anywhere writes nothing anywhere.
        for name, reader in readers.items():
            reader.verify(progress=not args.quiet)
            check_no_conflict(
                ps, dataclasses.replace(reader.schema, name=args.rename or name), str(reader.folder / "table.json")
            )
        for name, reader in readers.items():
            target = args.rename or name
            n = import_table(
                ps,
                reader.folder,
                table=target,
                replace=args.replace,
                progress=not args.quiet,
                verify=False,
                expected_rows=args.expected_rows,
            )
            print(f"imported {reader.folder} -> table {target}: {n} rows")
    return 0
