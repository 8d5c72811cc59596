"""`dynemb tf ls|migrate`: look into a TensorFlow checkpoint and move its embedding tables into
PS tables or table files, without TensorFlow installed."""

from __future__ import annotations

import argparse
import sys

from dynemb.common.cli_args import add_command, add_command_group, quiet_flag, rows_per_shard_flag
from dynemb.ps_server.cli import add_client_flags, add_init_flags

# subcommand: (its line in the list of commands, the start of its own --help)
HELP = {
    "tf": (
        "list TensorFlow checkpoints' tensors; migrate tables to the PS or table files",
        "Read TensorFlow checkpoints (no TensorFlow needed): list their tensors and tables, move embedding tables "
        "with their optimizer state into PS tables or table folders.",
    ),
    "ls": (
        "list a checkpoint's tensors, and the tables (with slots) it has",
        "List every tensor (name, dtype, shape, role) and every embedding table found, with its optimizer slots: "
        "the names `dynemb tf migrate --table` takes.",
    ),
    "migrate": (
        "move tables (with optimizer state) into PS tables or table folders",
        "Move embedding tables of a TensorFlow checkpoint, with their optimizer slots, into PS tables (--ps) or "
        "table folders (--out).",
    ),
}

FORMATS = """\
CKPT is any of:
  a checkpoint prefix (model.ckpt-1000, ckpt-3), its .index or         TF1 Saver, TF2 tf.train.Checkpoint
    .data-00000-of-0000N file
  a folder with a `checkpoint` file                                    its latest checkpoint
  a SavedModel folder                                                  its variables/
  model.weights.h5, model.keras                                        Keras 3
TensorFlow Recommenders-Addons dynamic tables (-keys/-values, _mht_XofY shards) are found in
any of the checkpoints and listed by their own name.
"""

MIGRATE_EPILOG = (
    FORMATS
    + """
--table NAME=TENSOR[,key=value...] (repeat for several tables):
  NAME              the PS table / table folder to write
  TENSOR            a tensor or table as `dynemb tf ls CKPT` lists it (TF2: the object path
                    without /.ATTRIBUTES/VARIABLE_VALUE will do, and so will any name in its
                    ALSO column: the variable's own name, e.g. a Keras layer path
                    user_emb/embeddings, the layer alone, other object paths; Keras files:
                    the layer name)
  offset=N          ids: row r gets id N + r (the default, with N = 0)
  vocab=FILE        ids: line r of FILE is row r's id (one per line, as many lines as rows)
  vocab-kind=tokens the vocabulary lines are tokens: id = XXH64(UTF-8 bytes, seed 0) as
                    int64; vocab-kind=ids (the default): each line is an integer id
  accumulator=T, m=T, v=T
                    optimizer slots, where `tf ls` found none (or to override)
  TFRA tables bring their own ids (their keys).

--optimizer is what you will train with in dynemb; its per-row state is filled from the
checkpoint's slots: adagrad <- the Adagrad accumulator; rowwise_adagrad <- the mean of each
row's accumulator; adam <- Adam's m and v; sgd keeps none. Missing slots start at
--state-init. Everything (names, shapes, ids, checksums, the PS's schemas) is checked before
anything is written.

examples:
  dynemb tf ls model.ckpt-1000
  dynemb tf migrate model.ckpt-1000 --optimizer adagrad --ps localhost:50051 \\
      --table user=emb/user --table item=emb/item,vocab=items.txt,vocab-kind=tokens
  dynemb tf migrate saved_model/ --optimizer adam --out tables/ --table user=model/user_emb,offset=1000000
  dynemb tf migrate model.keras --optimizer rowwise_adagrad --ps ps-0:50051 --table user=user_emb
"""
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `tf` and its subcommands to the `dynemb` command's subparsers `sub`."""
    tf_sub = add_command_group(sub, "tf", HELP, FORMATS, "tf_command")

    p = add_command(tf_sub, "ls", HELP, FORMATS)
    p.add_argument("checkpoint", metavar="CKPT")
    p.set_defaults(func=cmd_ls)

    p = add_command(tf_sub, "migrate", HELP, MIGRATE_EPILOG)
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument(
        "--table",
        action="append",
        required=True,
        metavar="NAME=TENSOR[,key=value...]",
        help="a table to move (repeat for several); see below",
    )
    p.add_argument(
        "--optimizer",
        required=True,
        choices=("sgd", "adagrad", "rowwise_adagrad", "adam"),
        help="the optimizer dynemb will train these tables with: sets the state kept per row",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="DIR", help="write table folders DIR/<NAME>/ (see `dynemb checkpoint`)")
    add_client_flags(p, ps_default=None, ps_group=where)
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="table dtype [default fp32]")
    add_init_flags(
        p,
        "how the PS fills rows of ids never written, for a table it creates [default zeros]",
        "optimizer state of new rows and of rows whose slots the checkpoint lacks [default 0]",
    )
    p.add_argument("--replace", action="store_true", help="--ps: delete the tables' rows on the PS first")
    p.add_argument("--overwrite", action="store_true", help="--out: replace table folders that hold files")
    rows_per_shard_flag(p, "--out: rows per shard file")
    quiet_flag(p)
    p.set_defaults(func=cmd_migrate)


def _shape(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def cmd_ls(args) -> int:
    """`dynemb tf ls`: print a checkpoint's tensors, then its tables and other 2-D variables."""
    from dynemb.tf.source import open_source

    src = open_source(args.checkpoint)
    tensors = src.tensors()
    tables = src.tables()
    role: dict[str, str] = {}
    for t in tables.values():
        shown = src.shown(t.name)
        for part in t.values.parts:
            role[part] = (
                f"values of table {shown}" if t.keys is not None else "table" if t.embedding else "other 2-D variable"
            )
        for part in t.keys.parts if t.keys is not None else ():
            role[part] = f"keys of table {shown}"
        for slot, slot_rows in t.slots.items():
            for part in slot_rows.parts:
                role.setdefault(part, f"{slot} slot of {shown}")
    print(f"{src.path}: {src.kind}, {len(tensors)} tensors")
    # the object graph's names of the variables (a Keras model's layer paths), where it has them
    named = bool(src.variable_names)
    rows = [("TENSOR", "DTYPE", "SHAPE") + (("VARIABLE",) if named else ()) + ("ROLE",)]
    rows += [
        (t.name, t.dtype, _shape(t.shape))
        + ((src.variable_names.get(t.name, ""),) if named else ())
        + (role.get(t.name, ""),)
        for t in tensors
    ]
    for line in _columns(rows):
        print(line.rstrip())
    print()
    if not tables:
        print("no tables (2-D float tensors) found")
        return 0
    embeddings = {n: t for n, t in tables.items() if t.embedding}
    others = {n: t for n, t in tables.items() if not t.embedding}
    if embeddings:
        print(_table_section("embedding tables", src, embeddings))
    else:
        print(
            "no embedding tables: no TFRA table, partitioned variable or Keras Embedding layer, and no name with "
            "embedding or emb in it"
        )
    if others:
        print()
        print(
            _table_section(
                "other 2-D variables", src, others, "not named or made like embeddings, e.g. a Dense kernel; "
            )
        )
    return 0


def _table_section(title: str, src, tables: dict, why: str = "") -> str:
    """One listing of tables: the names --table takes, sizes, kinds, slots and other names."""
    also = any(src.other_names(name) for name in tables)
    head = why + "--table NAME=TENSOR takes the first column" + (", or a name in ALSO" if also else "")
    rows = [("TABLE", "ROWS", "DIM", "DTYPE", "KIND", "SLOTS") + (("ALSO",) if also else ())]
    for name, t in sorted(tables.items(), key=lambda item: src.shown(item[0])):
        slots = ", ".join(f"{k}={src.shown(r.label)}" for k, r in sorted(t.slots.items())) or "-"
        if t.note:
            slots += f" ({t.note})"
        rows.append(
            (src.shown(name), str(t.values.num_rows), str(t.values.shape[1]), t.values.dtype, t.kind, slots)
            + ((", ".join(src.other_names(name)) or "-",) if also else ())
        )
    return "\n".join([f"{title} ({head}):"] + ["  " + line.rstrip() for line in _columns(rows)])


def cmd_migrate(args) -> int:
    """`dynemb tf migrate`: plan and check every table, then write them to the PS or folders."""
    from dynemb.ps_server.cli import initializer_from_args
    from dynemb.tf import migrate
    from dynemb.tf.errors import TFMigrationError
    from dynemb.tf.source import open_source

    if args.rows_per_shard < 1:
        raise TFMigrationError(f"--rows-per-shard must be >= 1, got {args.rows_per_shard}")
    specs = [migrate.TableSpec.parse(t) for t in args.table]
    src = open_source(args.checkpoint)
    plans = migrate.plan(src, specs, args.optimizer, args.dtype, initializer_from_args(args))
    migrate.verify(plans, progress=not args.quiet)
    for p in plans:
        for note in p.notes:
            print(f"note: {note}", file=sys.stderr)
    if args.out:
        folders = migrate.to_files(
            args.out, plans, src, rows_per_shard=args.rows_per_shard, overwrite=args.overwrite, progress=not args.quiet
        )
        targets = {name: f"folder {folder}" for name, folder in folders.items()}
    else:
        from dynemb.ps_server.cli import client_from_args

        with client_from_args(args) as ps:
            migrate.check_ps(ps, plans)
            migrate.to_ps(ps, plans, replace=args.replace, progress=not args.quiet)
        targets = {p.schema.name: f"PS table {p.schema.name}" for p in plans}
    for p in plans:
        # by the names `tf ls` lists (user_emb/embeddings, not optimizer/_trainable_variables/0/...)
        slots = ", ".join(f"{k}={src.shown(r.label)}" for k, r in p.slots.items()) or "none"
        print(
            f"migrated {src.shown(p.source.values.label)} ({p.num_rows} rows x {p.schema.dim}, {args.optimizer} "
            f"state from slots: {slots}) -> {targets[p.schema.name]}"
        )
    return 0
