"""A published version of one table: a folder that a serving store applies whole or not at all.

    <root>/<table>/v00000042/
        version.json                 the manifest, written last
        rows-00000.safetensors       ids (n,) int64; values (n, dim) in the version's dtype;
                                     scales (n,) float32 (int8 only)
        deleted-00000.safetensors    ids (m,) int64: tombstones, ids the PS no longer holds

A full version holds every row of the table at its cut and no tombstones; a delta holds the
rows changed since its parent (the version before it) and the ids deleted since. A version is
made in a hidden folder (`.v00000042.partial`) and renamed into place after its manifest is
written, so a reader never sees one half made; a publisher killed midway leaves only the hidden
folder, which the next VersionWriter of that number replaces.

version.json (format "dynemb.version", version 1):

    {"format": "dynemb.version", "version": 1, "table": "user", "number": 42,
     "kind": "delta", "parent": 41, "base": 40,      base: the full version the chain starts at
     "step": 1200, "time": 1764300000.5,             the training step and Unix time of the cut
     "dtype": "int8", "dim": 64, "rows": 1234, "deleted": 56,
     "files": [{"file": "rows-00000.safetensors", "kind": "rows", "count": 1234, "sha256": "..."},
               {"file": "deleted-00000.safetensors", "kind": "deleted", "count": 56, "sha256": "..."}],
     "source": {...}}                                free-form: where the rows came from

chain() says which versions take a serving store from the version it holds to the newest, and
checks every file of them first: a gap, a corrupt file, or a file whose tensors are not what the
manifest says (names, dtype, shape, counts) is refused before anything is applied. A version's
identity is its manifest's sha256 (`digest`): a store keeps the one it applied.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dynemb.checkpoint.table_files import check_layout, read_json_object, sha256_of
from dynemb.common.errors import UserError, shown
from dynemb.common.names import check_name, inside
from dynemb.ps_server.schema import MAX_ROW_WIDTH
from dynemb.publish.quantize import STORED, Quantized, check_dtype, quantize

FORMAT = "dynemb.version"
FORMAT_VERSION = 1
MANIFEST = "version.json"
KINDS = ("full", "delta")
DEFAULT_ROWS_PER_FILE = 1 << 20
_FOLDER = re.compile(r"^v(\d{8})$")
_FILE = re.compile(r"^(rows|deleted)-\d{5}\.safetensors$")
# the safetensors dtype of each published dtype's values (bf16: its bit patterns)
_ST_DTYPE = {"fp32": "F32", "fp16": "F16", "bf16": "U16", "int8": "I8"}
# Tests only: a writer stops for good after writing this many files (a kill -9 lands mid-version).
STALL_ENV = "DYNEMB_TEST_PUBLISH_STALL_AFTER"


class VersionError(UserError, ValueError):
    """A version folder or chain that cannot be applied: missing, incomplete, corrupt or a gap."""


def folder_name(number: int) -> str:
    """A version's folder name: v00000042."""
    return f"v{number:08d}"


def table_folder(root: str | os.PathLike, table: str) -> Path:
    """root/<table>/, the table's name checked (dynemb/common/names.py): never a path out of root."""
    return inside(root, table, error=VersionError)


@dataclass(frozen=True)
class VersionFile:
    """One file of a version, as version.json lists it."""

    file: str
    kind: str  # "rows" or "deleted"
    count: int
    sha256: str


@dataclass
class Version:
    """A version's manifest (see the module), and the folder it was read from."""

    table: str
    number: int
    kind: str
    parent: int | None
    base: int
    step: int
    time: float
    dtype: str
    dim: int
    rows: int
    deleted: int
    files: list[VersionFile]
    source: dict = field(default_factory=dict)
    folder: Path | None = None
    digest: str = ""  # the sha256 of its version.json: which version of that number it is

    def to_dict(self) -> dict:
        """The manifest as version.json holds it."""
        doc = {"format": FORMAT, "version": FORMAT_VERSION}
        doc.update({k: v for k, v in asdict(self).items() if k not in ("folder", "digest")})
        return doc

    @classmethod
    def read(cls, folder: str | os.PathLike) -> Version:
        """A version folder's manifest, every field checked (not the files: check_files).

        Raises:
            VersionError: missing, not JSON, a field missing or of the wrong type or at odds
                with another, or a format version this dynemb does not read.
        """
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise VersionError(f"{path}: missing (an incomplete or no version)")
        doc = read_json_object(path, VersionError)

        def need(key: str, kind: type | tuple, nullable: bool = False):
            if key not in doc:
                raise VersionError(f"{path}: field {key!r} is missing")
            value = doc[key]
            if (value is None and nullable) or (isinstance(value, kind) and not isinstance(value, bool)):
                return value
            raise VersionError(f"{path}: field {key!r} must be {getattr(kind, '__name__', kind)}, got {shown(value)}")

        if need("format", str) != FORMAT:
            raise VersionError(f"{path}: field 'format' is {shown(doc['format'])}, expected {FORMAT!r}")
        if not 1 <= need("version", int) <= FORMAT_VERSION:
            raise VersionError(f"{path}: format version {doc['version']} is not one this dynemb reads: upgrade dynemb")
        kind = need("kind", str)
        if kind not in KINDS:
            raise VersionError(f"{path}: field 'kind' must be 'full' or 'delta', got {shown(kind)}")
        try:
            dtype = check_dtype(need("dtype", str))
        except ValueError as exc:
            raise VersionError(f"{path}: field 'dtype': {exc}") from None
        files = []
        for k, entry in enumerate(need("files", list)):
            where = f"{path}: files[{k}]"
            if not isinstance(entry, dict) or set(entry) != {"file", "kind", "count", "sha256"}:
                raise VersionError(f"{where} must be an object of file, kind, count and sha256, got {shown(entry)}")
            m = _FILE.match(entry["file"]) if isinstance(entry["file"], str) else None
            if m is None or m.group(1) != entry["kind"]:
                raise VersionError(f"{where}: file {shown(entry['file'])} is no {shown(entry['kind'])} file name")
            if not isinstance(entry["count"], int) or isinstance(entry["count"], bool) or entry["count"] < 0:
                raise VersionError(f"{where}.count must be an integer >= 0, got {shown(entry['count'])}")
            if not isinstance(entry["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
                raise VersionError(f"{where}.sha256 must be 64 hex digits, got {shown(entry['sha256'])}")
            files.append(VersionFile(**entry))
        v = cls(
            table=check_name(need("table", str), f"{path}: field 'table': table name", VersionError),
            number=need("number", int),
            kind=kind,
            parent=need("parent", int, nullable=True),
            base=need("base", int),
            step=need("step", int),
            time=float(need("time", (int, float))),
            dtype=dtype,
            dim=need("dim", int),
            rows=need("rows", int),
            deleted=need("deleted", int),
            files=files,
            source=doc.get("source") or {},
            folder=folder,
            digest=sha256_of(path),
        )
        if not isinstance(v.source, dict):
            raise VersionError(f"{path}: field 'source' must be an object, got {shown(v.source)}")
        if not 1 <= v.dim <= MAX_ROW_WIDTH:
            raise VersionError(f"{path}: field 'dim' must be 1 to {MAX_ROW_WIDTH}, got {v.dim}")
        if v.number < 1 or v.base < 1:
            raise VersionError(f"{path}: fields 'number' and 'base' must be >= 1, got {v.number} and {v.base}")
        for what, total in (("rows", v.rows), ("deleted", v.deleted)):
            counted = sum(f.count for f in files if f.kind == what)
            if counted != total:
                raise VersionError(f"{path}: field {what!r} is {total} but its files hold {counted}")
        if folder.name != folder_name(v.number):
            raise VersionError(f"{path}: number {v.number} is not that of its folder {folder.name!r}")
        if v.kind == "full" and (v.base != v.number or v.deleted):
            raise VersionError(f"{path}: a full version is its own base and holds no tombstones")
        if v.kind == "delta" and (v.parent is None or not v.base <= v.parent < v.number):
            raise VersionError(f"{path}: a delta's parent must be a version from its base on and before it")
        return v

    def check_files(self) -> None:
        """Every file there with the sha256 the manifest lists, and holding the tensors it says
        (a file can match its sha256 and still not be what the manifest describes: another
        width, dtype or count); VersionError naming the first that is missing or differs."""
        assert self.folder is not None
        for f in self.files:
            path = self.folder / f.file
            if not path.is_file():
                raise VersionError(f"{path}: missing (listed in {MANIFEST})")
            if sha256_of(path) != f.sha256:
                raise VersionError(f"{path}: its sha256 is not the one {MANIFEST} lists: the file is corrupt")
            what = f"{MANIFEST}: {f.count} {f.kind}" + (f", dim {self.dim}, {self.dtype}" if f.kind == "rows" else "")
            check_layout(path, self._layout(f), VersionError, what)

    def _layout(self, f: VersionFile) -> dict[str, tuple[str, list[int]]]:
        """The tensors {name: (safetensors dtype, shape)} the manifest says file f holds."""
        want = {"ids": ("I64", [f.count])}
        if f.kind == "rows":
            want["values"] = (_ST_DTYPE[self.dtype], [f.count, self.dim])
            if self.dtype == "int8":
                want["scales"] = ("F32", [f.count])
        return want

    def row_chunks(self) -> Iterator[tuple[np.ndarray, Quantized]]:
        """(ids, rows in the version's dtype), file by file."""
        for ids, tensors in self._tensors("rows"):
            yield ids, Quantized(tensors["values"], tensors.get("scales"))

    def deleted_ids(self) -> np.ndarray:
        """Every tombstone of the version (int64)."""
        parts = [ids for ids, _ in self._tensors("deleted")]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _tensors(self, kind: str) -> Iterator[tuple[np.ndarray, dict]]:
        from safetensors.numpy import load_file

        assert self.folder is not None
        for f in self.files:
            if f.kind == kind:
                tensors = load_file(str(self.folder / f.file))
                yield tensors.pop("ids"), tensors


class VersionWriter:
    """Make version `number` of a table under root/<table>/ (see the module); rows and
    tombstones in any number of calls, then close() (or the end of `with`) writes the manifest
    and puts the folder in place.

    Args:
        root: the published tables' folder.
        table: the table's name.
        number: the version's number (>= 1).
        kind: "full" or "delta".
        parent: the version before it (None for the first).
        base: the full version its chain starts at (its own number for a full).
        dtype: the rows' published dtype (quantize.DTYPES).
        dim: the embedding width.
        step: the training step of the cut.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        table: str,
        number: int,
        kind: str,
        parent: int | None,
        base: int,
        dtype: str,
        dim: int,
        step: int,
        rows_per_file: int = DEFAULT_ROWS_PER_FILE,
        source: dict | None = None,
    ) -> None:
        check_dtype(dtype)
        if kind not in KINDS:
            raise ValueError(f"a version is 'full' or 'delta', not {kind!r}")
        if number < 1:
            raise ValueError(f"version numbers start at 1, got {number}")
        self.table_folder = table_folder(root, table)
        self.final = self.table_folder / folder_name(number)
        if self.final.exists():
            raise VersionError(f"{self.final}: version {number} of table {table!r} is there already")
        self.partial = self.table_folder / f".{folder_name(number)}.partial"
        shutil.rmtree(self.partial, ignore_errors=True)  # a publisher killed midway left it
        self.partial.mkdir(parents=True)
        self.manifest = Version(table, number, kind, parent, base, step, 0.0, dtype, dim, 0, 0, [], source or {})
        self.rows_per_file = rows_per_file
        self._closed = False

    def write_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rows (n, dim) of the table's values (float32, fp16, or bf16 bit patterns) under ids."""
        if rows.shape != (len(ids), self.manifest.dim):
            raise ValueError(f"rows must be ({len(ids)}, {self.manifest.dim}), got {rows.shape}")
        for lo in range(0, len(ids), self.rows_per_file):
            q = quantize(rows[lo : lo + self.rows_per_file], self.manifest.dtype)
            tensors = {"ids": np.ascontiguousarray(ids[lo : lo + self.rows_per_file], dtype=np.int64)}
            tensors["values"] = np.ascontiguousarray(q.values, dtype=STORED[self.manifest.dtype])
            if q.scales is not None:
                tensors["scales"] = q.scales
            self._file("rows", tensors)
            self.manifest.rows += len(tensors["ids"])

    def write_deleted(self, ids: np.ndarray) -> None:
        """Tombstones: ids the PS no longer holds (a delta's alone)."""
        if self.manifest.kind == "full" and len(ids):
            raise ValueError("a full version holds no tombstones (what it lacks, serving lacks)")
        for lo in range(0, len(ids), self.rows_per_file):
            part = np.ascontiguousarray(ids[lo : lo + self.rows_per_file], dtype=np.int64)
            self._file("deleted", {"ids": part})
            self.manifest.deleted += len(part)

    def _file(self, kind: str, tensors: dict[str, np.ndarray]) -> None:
        from safetensors.numpy import save_file

        name = f"{kind}-{sum(f.kind == kind for f in self.manifest.files):05d}.safetensors"
        path = self.partial / name
        save_file(tensors, str(path), metadata={"format": FORMAT, "table": self.manifest.table})
        self.manifest.files.append(VersionFile(name, kind, len(tensors["ids"]), sha256_of(path)))
        if len(self.manifest.files) == int(os.environ.get(STALL_ENV, "-1")):
            while True:  # tests only (STALL_ENV)
                time.sleep(60)

    def close(self) -> Version:
        """Write version.json, then put the folder in place; returns the manifest."""
        if not self._closed:
            self.manifest.time = time.time()
            tmp = self.partial / f".{MANIFEST}.tmp"
            tmp.write_text(json.dumps(self.manifest.to_dict(), indent=2) + "\n")
            os.replace(tmp, self.partial / MANIFEST)
            os.replace(self.partial, self.final)
            self.manifest.folder = self.final
            self.manifest.digest = sha256_of(self.final / MANIFEST)
            self._closed = True
        return self.manifest

    def __enter__(self) -> VersionWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # nothing half made stays visible: the hidden folder goes
            shutil.rmtree(self.partial, ignore_errors=True)


def numbers(root: str | os.PathLike, table: str) -> list[int]:
    """The numbers of the table's complete versions (their folders in place), ascending."""
    folder = table_folder(root, table)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _FOLDER.match(p.name)))


def chain(root: str | os.PathLike, table: str, have: int | None = None) -> list[Version]:
    """The versions that take a store holding version `have` (None: none yet) of the table to
    the newest, in order, every file of them checked: [] when it has the newest already.

    From `have` on, the deltas after it, each the child of the one before; where that chain is
    broken (a version missing, or a delta of another parent), or for a store that has none, the
    newest full version and the deltas after it.

    Raises:
        VersionError: no way there (no full version to start from past a gap), or a file of
            the chain is missing or corrupt; nothing is to be applied then.
    """
    have_numbers = numbers(root, table)
    folder = table_folder(root, table)
    if not have_numbers:
        raise VersionError(f"{folder}: no versions of table {table!r}")
    newest = have_numbers[-1]
    if have is not None and have >= newest:
        return []
    versions = {n: Version.read(folder / folder_name(n)) for n in have_numbers}
    for v in versions.values():
        if v.table != table:
            raise VersionError(f"{v.folder}: a version of table {v.table!r}, not {table!r}")

    def deltas_from(start: int) -> list[Version] | None:
        out, at = [], start
        for n in range(start + 1, newest + 1):
            v = versions.get(n)
            if v is None or v.kind != "delta" or v.parent != at:
                return None
            out.append(v)
            at = n
        return out

    picked = deltas_from(have) if have is not None else None
    if picked is None:
        fulls = [n for n, v in versions.items() if v.kind == "full" and (have is None or n > have)]
        picked = None
        for n in sorted(fulls, reverse=True):
            rest = deltas_from(n)
            if rest is not None:
                picked = [versions[n], *rest]
                break
        if picked is None:
            since = "" if have is None else f" after version {have}"
            raise VersionError(
                f"{folder}: no chain of versions{since} to version {newest}: a version is missing or a delta's "
                f"parent is not the version before it, and no full version after the gap starts one"
            )
    for v in picked:
        v.check_files()
    return picked
