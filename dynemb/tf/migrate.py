"""Move embedding tables out of a TensorFlow checkpoint into PS tables or table files.

Each table is given as a spec, `NAME=TENSOR[,key=value...]`:

    NAME            the PS table (or table folder) to write
    TENSOR          a tensor of the checkpoint (TF2: its key or its object path without
                    /.ATTRIBUTES/VARIABLE_VALUE, or a name the object graph gives it: the
                    variable's own name, its layer's, another object path; Keras: the dataset
                    path or the layer name; TFRA: the dynamic table's name), as `dynemb tf ls`
                    lists them
    offset=N        row r gets id N + r (default 0)
    vocab=FILE      row r gets the id on line r of FILE (UTF-8, one entry per line, as many
                    lines as the tensor has rows, no id twice)
    vocab-kind=K    ids: each line is an integer id (default);
                    tokens: each line is a token, its id XXH64(the token's UTF-8 bytes,
                    seed 0) as a signed int64 (xxhash.xxh64_intdigest(token.encode()))
    accumulator=T, m=T, v=T
                    the optimizer slots, where they were not found (or to override)

A TFRA table carries its ids (its keys): integer keys are the ids, string keys are hashed
like vocabulary tokens.

The optimizer state written is what the target optimizer keeps per row (dynemb/trainer/config.py
optimizer_state_width, the layout dynemb/tables/table_rows.py reads back):

    sgd               none
    adagrad           dim values: the Adagrad accumulator, element for element
    rowwise_adagrad   1 value: the mean of the row's accumulator. FBGEMM's row-wise Adagrad
                      adds the mean of the squared gradient to it each step, so the mean of
                      an element-wise accumulator is the value it would have reached on the
                      same gradients
    adam              2 x dim values: m then v (FBGEMM's momentum1, momentum2). Adam's step
                      count (TF's beta1_power/beta2_power or iterations) is global, not per
                      row, and is not carried: bias correction restarts with the new trainer

A slot the checkpoint lacks (or a TFRA key its slot table lacks) starts at the initializer's
state_init. Values are converted to the table's dtype: exact from the same or a narrower
float type, otherwise rounded to nearest even.

Nothing is written until every table checks out: names, shapes, dtypes, ids (vocabulary
length, duplicates), the CRC-32C of every tensor read and, for a PS, the schema of a table
that already exists there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from dynemb.common.arrays import unique_counts
from dynemb.ps_server.initializer import bf16_bits_to_float, float_to_bf16_bits
from dynemb.ps_server.schema import OPTIMIZERS, Initializer, TableSchema, optimizer_state_width
from dynemb.tf.errors import TFMigrationError
from dynemb.tf.source import FLOAT_DTYPES, Rows, Source, Table

# the slots each target optimizer's state is made of, in its order (dynemb/trainer/config.py)
SLOTS_USED = {"sgd": (), "adagrad": ("accumulator",), "rowwise_adagrad": ("accumulator",), "adam": ("m", "v")}
SLOT_KEYS = ("accumulator", "m", "v")
SPEC_KEYS = ("offset", "vocab", "vocab-kind", *SLOT_KEYS)
DEFAULT_CHUNK_ROWS = 1 << 16
INT64_MAX = (1 << 63) - 1


@dataclass
class TableSpec:
    """What one --table NAME=TENSOR[,key=value...] option asks for."""

    table: str
    tensor: str
    offset: int = 0
    vocab: str | None = None
    vocab_kind: str = "ids"
    slots: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> TableSpec:
        """The spec of a --table option's text.

        Raises:
            TFMigrationError: the text is malformed or names an unknown key.
        """
        head, *options = text.split(",")
        table, eq, tensor = head.partition("=")
        if not eq or not table or not tensor:
            raise TFMigrationError(f"--table {text!r}: expected NAME=TENSOR[,key=value...]")
        spec = cls(table, tensor)
        for opt in options:
            key, eq, value = opt.partition("=")
            if not eq or key not in SPEC_KEYS:
                raise TFMigrationError(
                    f"--table {text!r}: {opt!r} is not one of " + ", ".join(f"{k}=..." for k in SPEC_KEYS)
                )
            if key == "offset":
                try:
                    spec.offset = int(value)
                except ValueError:
                    raise TFMigrationError(f"--table {text!r}: offset must be an integer, got {value!r}") from None
            elif key == "vocab":
                spec.vocab = value
            elif key == "vocab-kind":
                if value not in ("ids", "tokens"):
                    raise TFMigrationError(f"--table {text!r}: vocab-kind must be ids or tokens, got {value!r}")
                spec.vocab_kind = value
            else:
                spec.slots[key] = value
        return spec


@dataclass
class Plan:
    """One table's migration, checked: where each part of its rows comes from."""

    spec: TableSpec
    source: Table
    schema: TableSchema
    optimizer: str
    ids: np.ndarray | None  # None: offset + row index
    slots: dict[str, Rows]
    notes: list[str]

    @property
    def num_rows(self) -> int:
        """Rows the table's values tensor holds."""
        return self.source.values.num_rows

    def tensors(self) -> list[Rows]:
        """Every tensor the migration reads: values, keys (TFRA) and slots."""
        return [r for r in (self.source.values, self.source.keys, *self.slots.values()) if r is not None]


# -- ids ----------------------------------------------------------------------------------


def token_ids(tokens: list[bytes]) -> np.ndarray:
    """The ids of vocabulary tokens: XXH64 (seed 0) of each, as int64."""
    import xxhash

    return np.array([xxhash.xxh64_intdigest(t) for t in tokens], dtype=np.uint64).view(np.int64)


def read_vocab(path: str, kind: str, rows: int, table: str) -> np.ndarray:
    """The ids a vocabulary file gives the rows of a table.

    Args:
        path: the file, one line per row.
        kind: "ids" (each line an integer) or "tokens" (hashed by token_ids).
        rows: the rows of the table.
        table: the table, for the messages.

    Returns:
        One int64 id per row.

    Raises:
        TFMigrationError: the file cannot be read, has another number of lines, a line that is
            no integer, or an id twice.
    """
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as exc:
        raise TFMigrationError(f"vocabulary of table {table!r}: cannot read {path}: {exc.strerror}") from None
    if lines and lines[-1] == b"":
        lines.pop()  # the final newline
    lines = [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]
    if len(lines) != rows:
        raise TFMigrationError(
            f"{path}: {len(lines)} lines, but the tensor of table {table!r} has {rows} rows (line k names row k)"
        )
    if kind == "tokens":
        for k, ln in enumerate(lines):
            try:
                ln.decode("utf-8")
            except UnicodeDecodeError:
                raise TFMigrationError(f"{path}:{k + 1}: not UTF-8: {ln[:40]!r}") from None
        return token_ids(lines)
    ids = np.empty(rows, dtype=np.int64)
    for k, ln in enumerate(lines):
        try:
            value = int(ln.strip())
        except ValueError:
            raise TFMigrationError(
                f"{path}:{k + 1}: {ln[:40].decode('utf-8', 'replace')!r} is not an integer id "
                f"(vocab-kind=ids; use vocab-kind=tokens for words)"
            ) from None
        if not -(1 << 63) <= value <= INT64_MAX:
            raise TFMigrationError(f"{path}:{k + 1}: id {value} does not fit in int64")
        ids[k] = value
    return ids


def _check_distinct(ids: np.ndarray, what: str) -> None:
    uniq, counts = unique_counts(ids)
    if len(uniq) != len(ids):
        dup = uniq[counts > 1][0]
        rows = np.flatnonzero(ids == dup)[:2]
        raise TFMigrationError(
            f"{what}: id {dup} appears more than once (rows {rows[0]} and {rows[1]}); each row needs its own id"
        )


def _ids_of(spec: TableSpec, table: Table) -> np.ndarray | None:
    n = table.values.num_rows
    what = f"table {spec.table!r}"
    if table.keys is not None:
        if spec.vocab or spec.offset:
            raise TFMigrationError(
                f"--table {spec.table}: {table.name!r} is a TFRA table whose keys are the ids; "
                f"offset and vocab apply to plain tensors"
            )
        table.keys.verify()  # checked before use: a corrupt key must not read as a duplicate
        keys = table.keys.read(0, n)
        if table.keys.dtype == "string":
            ids = token_ids([bytes(k) for k in keys])
        elif table.keys.dtype in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32"):
            ids = keys.astype(np.int64)
        else:
            raise TFMigrationError(f"{what}: TFRA keys of dtype {table.keys.dtype} cannot be ids (integers or strings)")
        _check_distinct(ids, f"{what}: the TFRA keys")
        return ids
    if spec.vocab:
        if spec.offset:
            raise TFMigrationError(f"--table {spec.table}: give offset or vocab, not both")
        ids = read_vocab(spec.vocab, spec.vocab_kind, n, spec.table)
        _check_distinct(ids, f"{spec.vocab}")
        return ids
    if spec.offset + max(n - 1, 0) > INT64_MAX or spec.offset < -(1 << 63):
        raise TFMigrationError(f"{what}: offset {spec.offset} + {n} rows goes past the int64 id range")
    return None


# -- values -------------------------------------------------------------------------------


def to_float32(values: np.ndarray, tf_dtype: str) -> np.ndarray:
    """Values of TF dtype `tf_dtype` (bfloat16 as its bits) as float32."""
    return bf16_bits_to_float(values) if tf_dtype == "bfloat16" else values.astype(np.float32, copy=False)


def to_table_dtype(values: np.ndarray, tf_dtype: str, dtype: str) -> np.ndarray:
    """Values of a TF dtype as the table stores them: exact where the table's type holds them."""
    if dtype == "bf16":
        return values if tf_dtype == "bfloat16" else float_to_bf16_bits(to_float32(values, tf_dtype))
    if dtype == "fp16":
        return values if tf_dtype == "float16" else to_float32(values, tf_dtype).astype(np.float16)
    return to_float32(values, tf_dtype)


def _slot_shape_ok(rows: Rows, n: int, dim: int, rowwise: bool) -> bool:
    if rows.shape == (n, dim):
        return True
    return rowwise and rows.shape in ((n,), (n, 1))


def plan(
    source: Source, specs: list[TableSpec], optimizer: str, dtype: str = "fp32", initializer: Initializer | None = None
) -> list[Plan]:
    """Check every spec against the checkpoint and build its plan (reads ids, no values)."""
    if optimizer not in OPTIMIZERS:
        raise TFMigrationError(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")
    initializer = initializer or Initializer()
    names = [s.table for s in specs]
    if len(set(names)) != len(names):
        raise TFMigrationError(f"a table name is given twice: {names}")
    plans = []
    for spec in specs:
        table = source.table(spec.tensor)
        values = table.values
        what = f"table {spec.table!r} ({values.label})"
        if values.dtype not in FLOAT_DTYPES:
            raise TFMigrationError(
                f"{what}: dtype {values.dtype}; an embedding must be a float tensor ({', '.join(FLOAT_DTYPES)})"
            )
        if len(values.shape) != 2 or values.shape[1] < 1:
            raise TFMigrationError(f"{what}: shape {list(values.shape)}; an embedding table is (rows, dim)")
        n, dim = values.shape
        schema = TableSchema(
            spec.table, dim, optimizer_state_width(optimizer, dim), dtype, initializer, expected_rows=int(n)
        )
        slots = dict(table.slots)
        for key, tensor in spec.slots.items():
            slots[key] = source.rows(tensor)
        needed = SLOTS_USED[optimizer]
        notes = []
        for key in needed:
            rows = slots.get(key)
            if rows is None:
                notes.append(
                    f"no {key} slot for {spec.table!r} in the checkpoint: its state starts at "
                    f"{initializer.state_init:g}"
                )
                continue
            if rows.dtype not in FLOAT_DTYPES:
                raise TFMigrationError(f"{what}: slot {key} ({rows.label}) has dtype {rows.dtype}, not a float type")
            if not _slot_shape_ok(rows, n, dim, optimizer == "rowwise_adagrad"):
                raise TFMigrationError(
                    f"{what}: slot {key} ({rows.label}) has shape {list(rows.shape)}, the table's values are {[n, dim]}"
                )
        if not table.embedding and table.name in source.tables():
            notes.append(
                f"{spec.table!r}: {source.shown(table.name)} is not named or made like an embedding (it is "
                f"listed under other 2-D variables by `dynemb tf ls`); moved all the same"
            )
        unused = sorted(set(slots) - set(needed))
        if unused:
            notes.append(
                f"{spec.table!r}: slot(s) {', '.join(unused)} not kept (optimizer {optimizer} has no use for them)"
            )
        plans.append(
            Plan(
                spec, table, schema, optimizer, _ids_of(spec, table), {k: slots[k] for k in needed if k in slots}, notes
            )
        )
    return plans


@contextmanager
def progress_bar(progress: bool, **kwargs) -> Iterator:
    """A tqdm bar (kwargs are tqdm's) that an error clears instead of leaving it half drawn.

    Args:
        progress: False gives a disabled bar (updates do nothing, nothing is printed).
    Returns:
        A context manager yielding the bar; on leaving it the bar is closed, and kept on the
        screen only if its `leave` says so and no exception is on its way out.
    """
    from tqdm import tqdm

    bar = tqdm(disable=not progress, **kwargs)
    try:
        yield bar
    except BaseException:
        # The CLI prints the error next: a stopped bar left above (or before) it reads as
        # work still under way, so it goes.
        bar.leave = False
        raise
    finally:
        bar.close()


def verify(plans: list[Plan], progress: bool = True) -> None:
    """The CRC-32C (or, for HDF5, a full read) of every tensor the plans use.

    Raises:
        TFMigrationError: a tensor whose bytes do not match its checksum, or cannot be read.
    """
    tensors = [r for p in plans for r in p.tensors()]
    with progress_bar(progress, total=len(tensors), desc="verify", unit="tensor", leave=False) as bar:
        for rows in tensors:
            rows.verify()
            bar.update()


def chunks(p: Plan, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, embeddings, state) in the table's dtype."""
    s = p.schema
    state_init = to_table_dtype(np.array([s.initializer.state_init], np.float32), "float32", s.dtype)[0]
    for lo in range(0, p.num_rows, chunk_rows):
        hi = min(lo + chunk_rows, p.num_rows)
        ids = np.arange(lo, hi, dtype=np.int64) + p.spec.offset if p.ids is None else p.ids[lo:hi]
        emb = to_table_dtype(p.source.values.read(lo, hi), p.source.values.dtype, s.dtype)
        parts = []
        for key in SLOTS_USED[p.optimizer]:
            width = 1 if p.optimizer == "rowwise_adagrad" else s.dim
            rows = p.slots.get(key)
            if rows is None:
                parts.append(np.full((hi - lo, width), state_init, dtype=s.np_dtype))
                continue
            values = rows.read(lo, hi)
            if width == 1:
                values = to_float32(values, rows.dtype).reshape(hi - lo, -1)
                values = values.astype(np.float64).mean(axis=1, keepdims=True) if values.shape[1] > 1 else values
                part = to_table_dtype(values.astype(np.float32), "float32", s.dtype)
            else:
                part = to_table_dtype(values, rows.dtype, s.dtype)
            if rows.missing is not None:
                part = np.array(part)
                part[rows.missing(lo, hi)] = state_init
            parts.append(part)
        state = np.concatenate(parts, axis=1) if parts else np.zeros((hi - lo, 0), s.np_dtype)
        yield ids, np.ascontiguousarray(emb, dtype=s.np_dtype), np.ascontiguousarray(state, dtype=s.np_dtype)


def check_ps(client, plans: list[Plan]) -> None:
    """Every target that exists on the PS has the plan's dim, state width and dtype; a table
    that exists is written with its own schema (its initializer stays)."""
    from dynemb.ps_server.errors import TableNotFound

    for p in plans:
        try:
            have = client.describe_table(p.schema.name).schema
        except TableNotFound:
            continue
        # each figure's source named, so the user knows which flag (if any) would change it
        why = {
            "dim": "the checkpoint needs",
            "state_width": f"--optimizer {p.optimizer} needs",
            "dtype": "--dtype asks for",
        }
        diffs = [
            f"{k} {getattr(have, k)!r} ({why[k]} {getattr(p.schema, k)!r})"
            for k in ("dim", "state_width", "dtype")
            if getattr(have, k) != getattr(p.schema, k)
        ]
        if diffs:
            raise TFMigrationError(
                f"table {p.schema.name!r} exists on the PS with "
                + ", ".join(diffs)
                + "; migrate into another table or drop it first"
            )
        p.schema = have


def to_ps(
    client, plans: list[Plan], replace: bool = False, progress: bool = True, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> dict[str, int]:
    """Stream each plan's rows into its PS table (check_ps first). Returns {table: rows written}."""
    written = {}
    for p in plans:
        with progress_bar(progress, total=p.num_rows, unit="row", desc=f"migrate {p.schema.name}") as bar:

            def rows(p=p, bar=bar):
                for ids, emb, state in chunks(p, chunk_rows):
                    bar.update(len(ids))
                    yield ids, np.concatenate([emb, state], axis=1)

            written[p.schema.name] = client.import_rows(p.schema, rows(), replace=replace)
    return written


def to_files(
    out: str | os.PathLike,
    plans: list[Plan],
    source: Source,
    *,
    rows_per_shard: int,
    overwrite: bool = False,
    progress: bool = True,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> dict[str, str]:
    """Write each plan to OUT/<table>/ (dynemb/checkpoint/table_files.py).

    Returns:
        {table: its folder}.
    Raises:
        TFMigrationError: a folder already holds table files and overwrite is False.
    """
    from dynemb.checkpoint.table_files import TableWriter, existing_files

    folders = {p.schema.name: os.path.join(out, p.schema.name) for p in plans}
    for folder in folders.values():  # all checked before the first is written
        if existing_files(folder) and not overwrite:
            raise TFMigrationError(f"{folder}: already holds table files; choose another --out or give --overwrite")
    for p in plans:
        origin = {
            "kind": "tensorflow",
            "checkpoint": str(source.path),
            "format": source.kind,
            "tensor": p.source.values.label,
            "optimizer": p.optimizer,
            "slots": {k: r.label for k, r in p.slots.items()},
            "ids": (
                "keys"
                if p.source.keys is not None
                else f"vocab {p.spec.vocab} ({p.spec.vocab_kind})"
                if p.spec.vocab
                else f"row index + {p.spec.offset}"
            ),
        }
        with (
            TableWriter(
                folders[p.schema.name], p.schema, rows_per_shard=rows_per_shard, source=origin, overwrite=overwrite
            ) as w,
            progress_bar(progress, total=p.num_rows, unit="row", desc=f"migrate {p.schema.name}") as bar,
        ):
            for ids, emb, state in chunks(p, chunk_rows):
                w.write(ids, emb, state)
                bar.update(len(ids))
    return folders
