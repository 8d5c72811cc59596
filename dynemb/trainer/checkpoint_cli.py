"""`dynemb checkpoint ...`: checkpoints (dynemb/trainer/checkpoint_format.py) and portable table
files (dynemb/trainer/table_files.py) from and onto a PS.

Each subcommand is one function registered in add_parser. A training job checkpoints itself
(`dynemb train --checkpoint-dir D --checkpoint-every N`) and resumes with `--resume`; these
commands work on the folders without a job.
"""

from __future__ import annotations

import argparse

EPILOG = """\
A table folder holds table.json (schema, row count, shard list with sha256) and
part-NNNNN.safetensors shards with tensors ids (int64), embeddings and state
(the optimizer state); dynemb/trainer/table_files.py documents the format.

examples:
  # what a training job's checkpoint holds (and whether every file is intact)
  dynemb checkpoint inspect ckpt/step-00000200 --verify
  dynemb checkpoint inspect ckpt/                    # the checkpoints in a folder
  # a training checkpoint's tables (its incremental chain applied) onto a PS, e.g. for serving
  dynemb checkpoint restore ckpt/step-00000200 --ps localhost:50051
  # a consistent, checksummed copy of every table on a PS, and back
  dynemb checkpoint save --ps localhost:50051 --out snap/
  dynemb checkpoint restore snap/ --ps localhost:50051
  # every table of a PS into out/<table>/
  dynemb checkpoint export --ps localhost:50051 --out out/
  # two tables, 1M rows per shard file
  dynemb checkpoint export --ps ps-0:50051,ps-1:50051 --table user --table item --out out/ --rows-per-shard 1000000
  # all table folders under out/ into another PS (embedded or Redis: any backend)
  dynemb checkpoint import out/ --ps localhost:50052
  # one table under a new name, its old rows there deleted first
  dynemb checkpoint import out/user --as user_v2 --replace --ps localhost:50052
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    from dynemb.ps_server.cli import add_client_flags

    ck = sub.add_parser("checkpoint", help="inspect, save and restore checkpoints; export/import portable table files",
                        description="Checkpoints and table files: inspect a training job's checkpoints, save PS "
                        "tables as a checkpoint and restore one onto any PS, export tables to portable "
                        "folders (safetensors shards + table.json) and import them into any PS.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ck_sub = ck.add_subparsers(dest="checkpoint_command", metavar="COMMAND", required=True)

    p = ck_sub.add_parser("inspect", help="show what a checkpoint holds; --verify checks every file",
                          description="Print a checkpoint's step, kind, chain, ranks, optimizer and tables "
                          "with their row counts; for a folder of checkpoints, list them. --verify checks "
                          "the sha256 of every file of the checkpoint and of the ones it builds on.",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a checkpoint (step-NNNNNNNN/) or a folder of them")
    p.add_argument("--verify", action="store_true", help="check every file's sha256 (exit 1 naming a bad one)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_inspect)

    p = ck_sub.add_parser("save", help="checkpoint PS tables into a new folder",
                          description="Write PS tables (rows with optimizer state) as a checkpoint: "
                          "tables/<table>/ folders and a manifest with the sha256 of every file, moved "
                          "into place only when complete. `restore` puts them back on any PS.",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_flags(p)
    p.add_argument("--out", required=True, help="the checkpoint folder to create (must not hold files)")
    p.add_argument("--table", action="append", default=[],
                   help="a table to save (repeat for several) [default: every table on the PS]")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_save)

    p = ck_sub.add_parser("restore", help="put a checkpoint's tables on a PS (replacing their rows)",
                          description="Verify a checkpoint and the incremental ones it builds on, then "
                          "replace each of its tables' rows on the PS with the checkpoint's (the full one, "
                          "then each increment). Nothing is written when a check fails. To resume "
                          "training, use `dynemb train --resume CKPT` instead: it also restores the model, "
                          "optimizers and ID transformers.",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a checkpoint folder (with manifest.json)")
    add_client_flags(p)
    p.add_argument("--table", action="append", default=[],
                   help="restore only this table (repeat for several) [default: all]")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_restore)

    p = ck_sub.add_parser("export", help="write PS tables to table folders (OUT/<table>/)",
                          description="Stream PS tables (rows with their optimizer state) into OUT/<table>/: "
                          "table.json plus part-NNNNN.safetensors shards.",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_flags(p)
    p.add_argument("--out", required=True, help="folder to write the table folders in (created if absent)")
    p.add_argument("--table", action="append", default=[],
                   help="a table to export (repeat for several) [default: every table on the PS]")
    p.add_argument("--rows-per-shard", type=int, default=1 << 20,
                   help="rows per part-NNNNN.safetensors file [default %(default)s]")
    p.add_argument("--overwrite", action="store_true", help="replace table folders that already hold files")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_export)

    p = ck_sub.add_parser("import", help="write table folders into a PS (any backend)",
                          description="Check every shard of the table folders (sha256, shapes, dtype) and "
                          "the PS's schemas, then stream the rows into the PS. Nothing is written when a "
                          "check fails. The table is created if absent; one that exists must have the "
                          "same schema.",
                          epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a table folder (with table.json) or a folder of them")
    add_client_flags(p)
    p.add_argument("--table", action="append", default=[],
                   help="import only this table of FOLDER (repeat for several) [default: all]")
    p.add_argument("--as", dest="rename", metavar="NAME",
                   help="the PS table name, when importing exactly one table [default: its own name]")
    p.add_argument("--replace", action="store_true",
                   help="delete the table's rows on the PS before writing (otherwise rows are added/overwritten)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_import)


def cmd_inspect(args) -> int:
    from dynemb.trainer.checkpoint_format import MANIFEST, chain, describe, verify

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
    from dynemb.ps_server.cli import client_from_args
    from dynemb.trainer.checkpoint_format import save_tables

    with client_from_args(args) as ps:
        names = args.table or [info.schema.name for info in ps.list_tables()]
        if not names:
            print(f"no tables on the PS at {args.ps}; nothing saved")
            return 0
        out = save_tables(ps, names, args.out, progress=not args.quiet)
    print(f"saved {len(names)} table(s) -> {out}")
    return 0


def cmd_restore(args) -> int:
    from dynemb.ps_server.cli import client_from_args
    from dynemb.trainer.checkpoint_format import restore_tables

    with client_from_args(args) as ps:
        written = restore_tables(ps, args.folder, args.table or None, progress=not args.quiet)
    for name, n in written.items():
        print(f"restored table {name}: {n} rows")
    return 0


def cmd_export(args) -> int:
    from pathlib import Path

    from dynemb.ps_server.cli import client_from_args
    from dynemb.trainer.table_files import export_table

    with client_from_args(args) as ps:
        names = args.table or [info.schema.name for info in ps.list_tables()]
        if not names:
            print(f"no tables on the PS at {args.ps}; nothing exported")
            return 0
        for name in names:
            ps.describe_table(name)  # a missing table fails before any file is written
        for name in names:
            m = export_table(ps, name, Path(args.out) / name, rows_per_shard=args.rows_per_shard,
                             overwrite=args.overwrite, progress=not args.quiet)
            print(f"exported {name}: {m.num_rows} rows in {len(m.shards)} shard(s) -> {Path(args.out) / name}")
    return 0


def cmd_import(args) -> int:
    import dataclasses

    from dynemb.ps_server.cli import client_from_args
    from dynemb.trainer.table_files import TableFileError, TableReader, check_no_conflict, import_table, table_folders

    folders = table_folders(args.folder)
    readers = {r.schema.name: r for r in map(TableReader, folders)}
    if args.table:
        unknown = [t for t in args.table if t not in readers]
        if unknown:
            raise TableFileError(f"{args.folder}: no table folder for {unknown}; it has {sorted(readers)}")
        readers = {t: readers[t] for t in args.table}
    if args.rename and len(readers) != 1:
        raise TableFileError(f"--as names one table, but {len(readers)} would be imported ({sorted(readers)}); "
                             f"pick one with --table")
    with client_from_args(args) as ps:
        # Check everything first: a bad shard or a schema clash anywhere writes nothing anywhere.
        for name, reader in readers.items():
            reader.verify(progress=not args.quiet)
            check_no_conflict(ps, dataclasses.replace(reader.schema, name=args.rename or name),
                              str(reader.folder / "table.json"))
        for name, reader in readers.items():
            target = args.rename or name
            n = import_table(ps, reader.folder, table=target, replace=args.replace,
                             progress=not args.quiet, verify=False)
            print(f"imported {reader.folder} -> table {target}: {n} rows")
    return 0
