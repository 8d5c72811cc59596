"""Portable table files: one PS table (ids, embeddings, optimizer state) in a folder.

A table's folder:

    table.json               the manifest, written last (a folder without it is incomplete)
    part-00000.safetensors   the rows, at most rows_per_shard per file
    part-00001.safetensors
    ...

table.json (format "dynemb.table", version 1):

    {
      "format": "dynemb.table",
      "version": 1,
      "schema": {                        the table exactly as the PS knows it (ps_server.schema)
        "name": "user", "dim": 8, "state_width": 1, "dtype": "fp32",
        "initializer": {"kind": "uniform", "a": -0.01, "b": 0.01, "seed": 0, "state_init": 0.0}
      },
      "num_rows": 1500,
      "shards": [
        {"file": "part-00000.safetensors", "rows": 1000, "sha256": "9f86d0..."},
        {"file": "part-00001.safetensors", "rows": 500, "sha256": "60303a..."}
      ],
      "source": {"kind": "ps", ...}      free-form: where the rows came from
    }

Each shard holds three tensors of n rows (safetensors, little-endian, any reader can open it):

    ids          int64 (n,)               distinct ids
    embeddings   (n, dim)                 the table's dtype
    state        (n, state_width)         the table's dtype: the optimizer state, laid out as
                                          dynemb/ps_server/schema.py optimizer_state_width says (sgd:
                                          none; adagrad: dim values; rowwise_adagrad: 1; adam:
                                          m then v, dim each)

The PS keeps a row as one array of the table's dtype (embedding then state), so the state is
stored in that dtype too and an export/import round trip is bit for bit. Table dtype → tensor
dtype: fp32 → F32, fp16 → F16, bf16 → U16 holding the bfloat16 bit patterns (numpy has no
bfloat16; torch: `tensor.view(torch.bfloat16)`). A reader refuses a version it does not know,
checks every shard's sha256 before using it, and names the file and field of any mismatch.

    with TableWriter("out/user", schema, rows_per_shard=1 << 20) as w:
        w.write(ids, embeddings, state)          # any number of chunks
    for ids, emb, state in TableReader("out/user").chunks():
        ...
    export_table(client, "user", "out/user")     # PS → folder
    import_table(client, "out/user", table="user_v2", replace=True)   # folder → any PS
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dynemb.common.errors import UserError, shown
from dynemb.ps_server.errors import InvalidArgument, TableNotFound
from dynemb.ps_server.schema import TableSchema

FORMAT = "dynemb.table"
VERSION = 1
MANIFEST = "table.json"
DEFAULT_ROWS_PER_SHARD = 1 << 20
DEFAULT_CHUNK_ROWS = 1 << 16
TENSORS = ("ids", "embeddings", "state")
_SHARD_NAME = re.compile(r"^part-\d{5,}\.safetensors$")
_ST_DTYPE = {"fp32": "F32", "fp16": "F16", "bf16": "U16"}  # bf16: bit patterns, see above


class TableFileError(UserError, ValueError):
    """A table folder that cannot be used: missing, corrupt, or at odds with the PS."""


def tensor_layout(path: Path, error: type[Exception]) -> dict[str, tuple[str, list[int]]]:
    """{tensor: (safetensors dtype, shape)} of a safetensors file, read from its header only;
    `error` naming the file if it is not one safetensors reads (its header's length and every
    tensor's offsets are checked against the file's size by the reader: a header claiming 2^40
    rows or 2^62 bytes is refused, not allocated)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: (f.get_slice(name).get_dtype(), list(f.get_slice(name).get_shape())) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise error(f"{path}: not a readable safetensors file: {exc}") from None


def check_layout(path: Path, want: dict[str, tuple[str, list[int]]], error: type[Exception], what: str) -> None:
    """The file holds exactly the tensors of `want` ({name: (dtype, shape)}), or `error` naming
    the first difference and `what` the manifest says the file is."""
    have = tensor_layout(path, error)
    if set(have) != set(want):
        raise error(f"{path}: holds tensors {shown(sorted(have))}, expected {sorted(want)} ({what})")
    for name, (dtype, shape) in want.items():
        if have[name] != (dtype, shape):
            got_dtype, got_shape = have[name]
            raise error(f"{path}: tensor {name!r} is {got_dtype} {got_shape}, expected {dtype} {shape} ({what})")


def shard_name(index: int) -> str:
    """The file name of shard number index, e.g. part-00000.safetensors."""
    return f"part-{index:05d}.safetensors"


def sha256_of(path: Path) -> str:
    """The file's sha256, hex (what table.json and checkpoint manifests record)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object a manifest file holds; error, naming the file, if it is not valid JSON
    or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


@dataclass(frozen=True)
class Shard:
    """One shard file as table.json lists it: its name, rows and sha256."""

    file: str
    rows: int
    sha256: str


@dataclass
class Manifest:
    """A table folder's table.json (the format is in the module doc)."""

    schema: TableSchema
    num_rows: int
    shards: list[Shard]
    source: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The manifest as the JSON object table.json holds."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "schema": self.schema.to_dict(),
            "num_rows": self.num_rows,
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "source": self.source,
        }

    @classmethod
    def read(cls, folder: str | os.PathLike) -> Manifest:
        """The folder's table.json, every field checked.

        Raises:
            TableFileError: the file is missing or not valid JSON, or a field is missing, of the wrong
                type or at odds with another (a format version this dynemb does not read included).
        """
        path = Path(folder) / MANIFEST
        if not path.is_file():
            what = "folder" if Path(folder).is_dir() else "no such folder"
            raise TableFileError(
                f"{path}: missing ({what}); a table folder has a {MANIFEST} written by "
                f"`dynemb checkpoint export` or `dynemb tf migrate --out`"
            )
        doc = read_json_object(path, TableFileError)

        def need(key: str, kind: type | tuple):
            if key not in doc:
                raise TableFileError(f"{path}: field {key!r} is missing")
            if not isinstance(doc[key], kind) or isinstance(doc[key], bool):
                raise TableFileError(
                    f"{path}: field {key!r} must be {getattr(kind, '__name__', kind)}, got {shown(doc[key])}"
                )
            return doc[key]

        if need("format", str) != FORMAT:
            raise TableFileError(f"{path}: field 'format' is {shown(doc['format'])}, expected {FORMAT!r}")
        version = need("version", int)
        if version > VERSION or version < 1:
            raise TableFileError(
                f"{path}: format version {version} is not one this dynemb reads (1..{VERSION}); upgrade dynemb"
            )
        try:
            schema = TableSchema.from_dict(need("schema", dict))
        except (InvalidArgument, KeyError, TypeError, ValueError) as exc:
            raise TableFileError(f"{path}: field 'schema' is not a valid table schema: {exc}") from None
        num_rows = need("num_rows", int)
        shards = []
        for k, entry in enumerate(need("shards", list)):
            where = f"{path}: shards[{k}]"
            if not isinstance(entry, dict) or not {"file", "rows", "sha256"} <= set(entry):
                raise TableFileError(f"{where} must be an object with file, rows and sha256, got {shown(entry)}")
            if not isinstance(entry["file"], str) or not _SHARD_NAME.match(entry["file"]):
                raise TableFileError(
                    f"{where}.file must be a name like part-00000.safetensors, got {shown(entry['file'])}"
                )
            if not isinstance(entry["rows"], int) or entry["rows"] < 0:
                raise TableFileError(f"{where}.rows must be an integer >= 0, got {shown(entry['rows'])}")
            if not isinstance(entry["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
                raise TableFileError(f"{where}.sha256 must be 64 hex digits, got {shown(entry['sha256'])}")
            shards.append(Shard(entry["file"], entry["rows"], entry["sha256"]))
        if sum(s.rows for s in shards) != num_rows:
            raise TableFileError(
                f"{path}: num_rows is {num_rows} but the shards hold {sum(s.rows for s in shards)} rows"
            )
        return cls(schema, num_rows, shards, doc.get("source") or {})


def existing_files(folder: str | os.PathLike) -> list[Path]:
    """The table files (manifest, shards) a folder already holds."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.name == MANIFEST or _SHARD_NAME.match(p.name)]


class TableWriter:
    """Write a table folder from chunks of (ids, embeddings, state); shards roll every
    rows_per_shard rows and table.json is written by close() (or at the end of `with`)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        schema: TableSchema,
        *,
        rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
        source: dict | None = None,
        overwrite: bool = False,
    ) -> None:
        if rows_per_shard < 1:
            raise TableFileError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.folder = Path(folder)
        self.schema = schema
        self.rows_per_shard = rows_per_shard
        self.source = source or {}
        self._dtype = schema.np_dtype
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._shards: list[Shard] = []
        self._closed = False
        old = existing_files(self.folder)
        if old and not overwrite:
            raise TableFileError(
                f"{self.folder}: already holds table files ({', '.join(p.name for p in old[:3])}"
                f"{'...' if len(old) > 3 else ''}); choose an empty folder, or replace them "
                f"(`dynemb table export --overwrite`)"
            )
        # The manifest goes first: an overwrite cut short must not leave one listing new parts.
        for p in sorted(old, key=lambda p: p.name != MANIFEST):
            p.unlink()
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, ids, embeddings, state=None) -> None:
        """Add rows; full shards are written as they fill.

        Args:
            ids: (n,) integer ids.
            embeddings: (n, dim) of the table's dtype.
            state: (n, state_width) of the table's dtype; None for a table without state.

        Raises:
            TableFileError: the writer is closed, or an array's shape or dtype is wrong.
        """
        if self._closed:
            raise TableFileError(f"{self.folder}: writer already closed")
        s = self.schema
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise TableFileError(f"table {s.name!r}: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
        n = len(ids)
        if state is None:
            state = np.zeros((n, 0), dtype=self._dtype)
        for what, arr, width in (("embeddings", embeddings, s.dim), ("state", state, s.state_width)):
            arr = np.asarray(arr)
            if arr.shape != (n, width):
                raise TableFileError(f"table {s.name!r}: {what} must have shape ({n}, {width}), got {arr.shape}")
            if arr.dtype != self._dtype:
                raise TableFileError(
                    f"table {s.name!r}: {what} must be {self._dtype} (the table's {s.dtype}), got {arr.dtype}"
                )
        if n:
            self._pending.append((ids.astype(np.int64), np.asarray(embeddings), np.asarray(state)))
            self._pending_rows += n
        while self._pending_rows >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def _flush(self, rows: int) -> None:
        from safetensors.numpy import save_file

        ids, emb, st = (np.concatenate([p[k] for p in self._pending]) for k in range(3))
        name = shard_name(len(self._shards))
        path = self.folder / name
        try:
            save_file(
                {
                    "ids": np.ascontiguousarray(ids[:rows]),
                    "embeddings": np.ascontiguousarray(emb[:rows]),
                    "state": np.ascontiguousarray(st[:rows]),
                },
                str(path),
                metadata={
                    "format": FORMAT,
                    "version": str(VERSION),
                    "table": self.schema.name,
                    "dtype": self.schema.dtype,
                },
            )
        except Exception as exc:  # SafetensorError: an I/O error (disk full...) arrives as its text only
            raise OSError(f"{path}: could not write the shard ({exc})") from exc
        self._shards.append(Shard(name, rows, sha256_of(path)))
        rest = len(ids) - rows
        self._pending = [(ids[rows:], emb[rows:], st[rows:])] if rest else []
        self._pending_rows = rest

    def close(self) -> Manifest:
        """Write the rows still pending and then table.json; returns the manifest."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        manifest = Manifest(self.schema, sum(s.rows for s in self._shards), list(self._shards), self.source)
        if not self._closed:
            tmp = self.folder / f".{MANIFEST}.tmp"
            tmp.write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
            os.replace(tmp, self.folder / MANIFEST)
            self._closed = True
        return manifest

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # no manifest: the folder reads as incomplete
            self._closed = True


class TableReader:
    """Read a table folder: the manifest at once, shards checked (sha256, tensors) before use."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)

    @property
    def schema(self) -> TableSchema:
        """The table's schema, from table.json."""
        return self.manifest.schema

    @property
    def num_rows(self) -> int:
        """Rows in the table, from table.json."""
        return self.manifest.num_rows

    def verify(self, progress: bool = False) -> None:
        """Check every shard: present, sha256 as listed, tensors of the listed rows, the
        schema's widths and dtype. Raises TableFileError naming the first bad file."""
        from tqdm import tqdm

        with tqdm(
            total=self.num_rows, unit="row", desc=f"verify {self.schema.name}", disable=not progress, leave=False
        ) as bar:
            for shard in self.manifest.shards:
                self._check_shard(shard)
                bar.update(shard.rows)

    def _check_shard(self, shard: Shard) -> None:
        path = self.folder / shard.file
        if not path.is_file():
            raise TableFileError(f"{path}: missing (listed in {self.folder / MANIFEST})")
        got = sha256_of(path)
        if got != shard.sha256:
            raise TableFileError(
                f"{path}: sha256 is {got}, {MANIFEST} says {shard.sha256}: the file is "
                f"corrupt or truncated ({path.stat().st_size} bytes)"
            )
        s = self.schema
        want = {
            "ids": ("I64", [shard.rows]),
            "embeddings": (_ST_DTYPE[s.dtype], [shard.rows, s.dim]),
            "state": (_ST_DTYPE[s.dtype], [shard.rows, s.state_width]),
        }
        what = f"table {s.name!r}: {shard.rows} rows, dim {s.dim}, state_width {s.state_width}, dtype {s.dtype}"
        check_layout(path, want, TableFileError, what)

    def chunks(
        self, chunk_rows: int = DEFAULT_CHUNK_ROWS, verify: bool = True, shards: list[Shard] | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(ids, embeddings, state) in the table's dtype, at most chunk_rows at a time; each
        shard is checked (verify=True) before any of its rows is yielded. `shards`: only
        these of the manifest's (default: all), e.g. a process's share of the table."""
        from safetensors import safe_open

        for shard in self.manifest.shards if shards is None else shards:
            if verify:
                self._check_shard(shard)
            with safe_open(str(self.folder / shard.file), framework="numpy") as f:
                ids_t, emb_t, st_t = (f.get_slice(k) for k in TENSORS)
                for lo in range(0, shard.rows, chunk_rows):
                    hi = min(lo + chunk_rows, shard.rows)
                    yield ids_t[lo:hi], emb_t[lo:hi], st_t[lo:hi]


def table_folders(path: str | os.PathLike) -> list[Path]:
    """The table folders at path: path itself if it has a table.json, else its subfolders that do."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return [path]
    if not path.is_dir():
        raise TableFileError(f"{path}: no such folder")
    found = sorted(p for p in path.iterdir() if (p / MANIFEST).is_file())
    if not found:
        raise TableFileError(f"{path}: no {MANIFEST} in it or in any folder directly under it")
    return found


def schema_differences(have: TableSchema, want: TableSchema) -> list[str]:
    """Fields where two schemas differ, as 'field: a vs b' (name aside)."""
    a, b = have.to_dict(), want.to_dict()
    out = []
    for key in ("dim", "state_width", "dtype"):
        if a[key] != b[key]:
            out.append(f"{key} {a[key]!r} vs {b[key]!r}")
    for key, value in a["initializer"].items():
        if value != b["initializer"][key]:
            out.append(f"initializer.{key} {value!r} vs {b['initializer'][key]!r}")
    return out


def check_no_conflict(client, schema: TableSchema, what: str) -> bool:
    """Raise TableFileError if the PS has a table of this name with another schema; True if
    it has one with this very schema."""
    try:
        have = client.describe_table(schema.name).schema
    except TableNotFound:
        return False
    diffs = schema_differences(have, schema)
    if diffs:
        raise TableFileError(
            f"{what}: table {schema.name!r} exists on the PS with another schema "
            f"(PS vs files: {'; '.join(diffs)}); import under another name or drop it first"
        )
    return True


def export_table(
    client,
    table: str,
    folder: str | os.PathLike,
    *,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    overwrite: bool = False,
    progress: bool = True,
    rows_per_chunk: int = 0,
) -> Manifest:
    """Stream a PS table (PSClient.export) into a table folder."""
    from tqdm import tqdm

    info = client.describe_table(table)
    schema = info.schema
    source = {"kind": "ps", "addresses": list(client.addresses)}
    with (
        TableWriter(folder, schema, rows_per_shard=rows_per_shard, source=source, overwrite=overwrite) as w,
        tqdm(total=info.num_rows, unit="row", desc=f"export {table}", disable=not progress) as bar,
    ):
        for ids, rows in client.export(table, rows_per_chunk=rows_per_chunk):
            w.write(ids, rows[:, : schema.dim], rows[:, schema.dim :])
            bar.update(len(ids))
    return w.close()


def import_table(
    client,
    folder: str | os.PathLike,
    table: str | None = None,
    replace: bool = False,
    *,
    progress: bool = True,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    verify: bool = True,
    expected_rows: int = 0,
) -> int:
    """Write a table folder into a PS (PSClient.import_rows), as `table` or under its own name.

    Every shard is checked (verify=False: the caller just did) and the PS's schema compared
    before the first row is sent, so a bad folder writes nothing. replace=True first deletes
    the table's rows on the PS. A table the import creates is sized for expected_rows (0: the
    folder's rows; TableSchema.expected_rows). Returns the rows written."""
    from tqdm import tqdm

    reader = TableReader(folder)
    # the rows it holds sized for (the PS's layout; no part of the schema's identity)
    schema = dataclasses.replace(
        reader.schema, name=table or reader.schema.name, expected_rows=expected_rows or reader.num_rows
    )
    if verify:
        reader.verify(progress=progress)
    check_no_conflict(client, schema, str(reader.folder / MANIFEST))
    with tqdm(total=reader.num_rows, unit="row", desc=f"import {schema.name}", disable=not progress) as bar:

        def rows():
            for ids, emb, st in reader.chunks(chunk_rows, verify=False):
                bar.update(len(ids))
                yield ids, np.concatenate([emb, st], axis=1)

        return client.import_rows(schema, rows(), replace=replace)
