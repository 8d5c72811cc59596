"""Checkpoint folders on disk: the manifest, its checks, incremental chains, and the
operations that need no training job (`dynemb checkpoint save|restore|inspect`).

    <root>/step-00000100/
        manifest.json      written last: format, version, step, samples (taken by all ranks
                           by that step: the data position), world size, kind ("full" or
                           "incremental"), parent (the checkpoint an incremental one builds on),
                           tables (name -> PS schema), the job's config, and "files": the
                           sha256 of every other file in the folder
        dense.pt           dense parameters + dense optimizer (training checkpoints)
        rank-00000.pt ...  per rank: ID transformers' state, row-sparse Adam's step
        tables/<table>/    a table folder (dynemb/checkpoint/table_files.py), or one per rank
                           (tables/<table>/rank-00000/ ...) for tables not behind the PS

`dynemb checkpoint save` writes the same layout with only tables/ (kind "full", no step, no
config): a consistent, checksummed copy of PS tables, which `restore` puts back on any PS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dynemb.checkpoint.table_files import MANIFEST as TABLE_MANIFEST
from dynemb.checkpoint.table_files import TableReader, TableWriter, check_no_conflict, sha256_of
from dynemb.common.errors import UserError, shown
from dynemb.common.names import check_name, inside
from dynemb.ps_server.schema import TableSchema

FORMAT = "dynemb.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_FOLDER = re.compile(r"step-[0-9]{8,}")  # step_folder()'s names


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used: missing, corrupt, or not of this job."""


def step_folder(step: int) -> str:
    """The folder name of a step's checkpoint, e.g. step-00000100."""
    return f"step-{step:08d}"


def files_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder (but a manifest), by relative path."""
    return {
        str(p.relative_to(folder)): sha256_of(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, f".{MANIFEST}.tmp")
    }


def write_manifest(work: Path, manifest: dict, final: Path) -> None:
    """The manifest last, then the whole folder renamed into place: a checkpoint is either
    complete or absent (a cut-off save leaves only a .partial folder)."""
    tmp = work / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    os.replace(tmp, work / MANIFEST)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(work, final)


def read_manifest(folder: str | os.PathLike) -> dict:
    """The checkpoint's manifest.json, its format, version and main fields checked.

    Raises:
        CheckpointError: the manifest is missing, not valid JSON, of another format or version,
            or without its files, tables or kind.
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (not a checkpoint, or one cut short)")
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        got = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else (None, None)
        raise CheckpointError(
            f"{path}: format {shown(got[0])} version {shown(got[1])}, expected {FORMAT!r} version {VERSION}"
        )
    for key, kind in (("files", dict), ("tables", dict), ("kind", str)):
        if not isinstance(doc.get(key), kind):
            raise CheckpointError(f"{path}: field {key!r} missing or not a {kind.__name__}")
    _check_names(path, doc)
    return doc


def _check_names(path: Path, doc: dict) -> None:
    """Every name the manifest joins into a path (its tables, each part of its files' paths,
    its parent's) valid (dynemb/common/names.py): none leads out of the checkpoint's folder."""
    for key in doc["tables"]:
        check_name(key, f"{path}: field 'tables': table name", CheckpointError)
    for rel in doc["files"]:
        for part in rel.split("/"):
            check_name(part, f"{path}: field 'files': {shown(rel)}: path part", CheckpointError)
    if doc.get("parent") is not None:
        check_name(doc["parent"], f"{path}: field 'parent': checkpoint name", CheckpointError)


def verify(folder: str | os.PathLike, progress: bool = False, share: tuple[int, int] = (0, 1)) -> dict:
    """The manifest, after checking every file it lists against its sha256 (and that no
    table file is there that it does not list).

    Args:
        share: (k, n): check only every n-th file (by name) from the k-th on, so that n
            processes check a checkpoint together, each file once.
    """
    folder = Path(folder)
    doc = read_manifest(folder)
    k, n = share
    for rel, digest in tqdm(
        sorted(doc["files"].items())[k::n], desc=f"verify {folder.name}", unit="file", disable=not progress
    ):
        path = inside(folder, *rel.split("/"), what="path part", error=CheckpointError)
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {MANIFEST} but missing")
        if sha256_of(path) != digest:
            raise CheckpointError(f"{path}: sha256 differs from {MANIFEST} (corrupt or changed)")
    return doc


def checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under root, oldest first: step-N folders with a manifest. Not a
    step-N.partial folder, even with its manifest written: a save stopped before its rename
    (its job's workers restarted by their elastic agent, say) is not complete."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_FOLDER.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len("step-") :]))


def unfinished(root: str | os.PathLike) -> list[Path]:
    """The step-N.partial folders under root: saves that were cut off (or one in progress)."""
    root = Path(root)
    return sorted(p for p in root.glob("step-*.partial") if p.is_dir()) if root.is_dir() else []


def chain(folder: str | os.PathLike) -> list[Path]:
    """The checkpoints to apply, the last full one first, ending with `folder`."""
    out = [Path(folder)]
    while (parent := read_manifest(out[0]).get("parent")) is not None:
        if not (out[0].parent / parent).is_dir():
            raise CheckpointError(
                f"{out[0]}: builds on {parent}, which is not in {out[0].parent} "
                f"(an incremental checkpoint needs its chain back to a full one)"
            )
        out.insert(0, inside(out[0].parent, parent, what="checkpoint name", error=CheckpointError))
        if len(out) > 10_000:
            raise CheckpointError(f"{folder}: parent chain does not end in a full checkpoint")
    return out


def table_parts(folder: Path, key: str) -> list[Path]:
    """The table folders of one table in one checkpoint: tables/<key>/ itself, or its
    per-rank folders."""
    base = inside(folder / "tables", key, error=CheckpointError)
    if (base / TABLE_MANIFEST).is_file():
        return [base]
    parts = sorted(p for p in base.glob("rank-*") if (p / TABLE_MANIFEST).is_file())
    if not parts and not base.is_dir():
        raise CheckpointError(f"{folder}: no folder under tables/ for table {shown(key)} of its manifest")
    return parts


def _rows(reader: TableReader, bar=None) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    for ids, emb, state in reader.chunks(verify=False):
        if bar is not None:
            bar.update(len(ids))
        yield ids, np.concatenate([emb, state], axis=1)


# -- operations on a PS, no training job -----------------------------------------------


def save_tables(client, names: list[str], out: str | os.PathLike, progress: bool = True) -> Path:
    """A checkpoint of PS tables (kind full, tables only) in folder `out`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; pick a new folder")
    infos = [client.describe_table(n) for n in names]  # a missing table fails before any file
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    for info in infos:
        schema = info.schema
        with (
            TableWriter(work / "tables" / schema.name, schema, source={"kind": "checkpoint save"}) as w,
            tqdm(
                total=info.num_rows, unit="row", unit_scale=True, desc=f"save {schema.name}", disable=not progress
            ) as bar,
        ):
            for ids, rows in client.export(schema.name):
                w.write(ids, rows[:, : schema.dim], rows[:, schema.dim :])
                bar.update(len(ids))
    work.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": None,
        "world_size": None,
        "kind": "full",
        "parent": None,
        "dynamic": True,
        "optimizer": None,
        "source": "dynemb checkpoint save",
        "tables": {i.schema.name: i.schema.to_dict() for i in infos},
        "config": None,
        "files": files_digest(work),
    }
    if out.exists():
        out.rmdir()
    write_manifest(work, manifest, out)
    return out


def restore_tables(
    client, folder: str | os.PathLike, tables: list[str] | None = None, progress: bool = True
) -> dict[str, int]:
    """Put a checkpoint's tables (its whole chain applied) on a PS: each table's rows there
    are replaced by the checkpoint's. Everything is checked before the first write.
    Returns rows written per PS table."""
    links = chain(folder)
    docs = [verify(c, progress=progress) for c in links]
    keys = list(docs[-1]["tables"])
    if tables:
        unknown = [t for t in tables if t not in keys]
        if unknown:
            raise CheckpointError(f"{folder}: no table {shown(unknown)}; it has {shown(keys)}")
        keys = tables
    plan = []
    for key in keys:
        schema = TableSchema.from_dict(docs[-1]["tables"][key])
        check_no_conflict(client, schema, f"{folder}: table {shown(key)}")
        plan.append((key, schema, [[TableReader(p) for p in table_parts(c, key)] for c in links]))
    written = {}
    for _, schema, per_link in plan:
        deltas = per_link[1:]
        total = sum(r.num_rows for link in per_link for r in link)
        schema = dataclasses.replace(schema, expected_rows=total)  # the PS sizes the table by it
        with tqdm(total=total, unit="row", unit_scale=True, desc=f"restore {schema.name}", disable=not progress) as bar:
            n = client.import_rows(schema, (c for r in per_link[0] for c in _rows(r, bar)), replace=True)
            for link in deltas:
                for reader in link:
                    for ids, rows in _rows(reader, bar):
                        client.push(schema.name, ids, rows)
                        n += len(ids)
        written[schema.name] = n
    return written


def describe(folder: str | os.PathLike) -> str:
    """What `dynemb checkpoint inspect` prints: a checkpoint's manifest in a few lines, or
    the checkpoints under a root folder."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file() and folder.is_dir():
        found = checkpoints(folder)
        if not found:
            raise CheckpointError(f"{folder}: no {MANIFEST} here and no step-*/ checkpoints under it")
        lines = [f"{len(found)} checkpoint(s) in {folder}:"]
        for c in found:
            doc = read_manifest(c)
            parent = f" <- {doc['parent']}" if doc.get("parent") else ""
            lines.append(f"  {c.name}  step {doc.get('step')}  {doc['kind']}{parent}")
        return "\n".join(lines)
    doc = read_manifest(folder)
    size = sum((folder / rel).stat().st_size for rel in doc["files"] if (folder / rel).is_file())
    lines = [
        f"checkpoint {folder}",
        f"  step         {doc.get('step')}"
        + ("" if doc.get("config") else "  (PS tables only: dynemb checkpoint save)"),
        f"  kind         {doc['kind']}" + (f", builds on {doc['parent']}" if doc.get("parent") else ""),
        f"  chain        {' -> '.join(c.name for c in chain(folder))}",
    ]
    if doc.get("world_size") is not None:
        samples = f", {doc['samples']:,} samples taken" if doc.get("samples") is not None else ""
        lines.append(f"  ranks        {doc['world_size']}{samples} (resumes on any number)")
        lines.append(
            f"  tables       {'dynamic (PS)' if doc.get('dynamic') else 'full (per rank)'}, "
            f"optimizer {doc.get('optimizer')}"
        )
    lines.append(f"  files        {len(doc['files'])}, {size / 2**20:.1f} MiB")
    lines.append(f"  {'table':<24} {'rows':>10}  schema")
    for key, spec in doc["tables"].items():
        rows = sum(TableReader(p).num_rows for p in table_parts(folder, key))
        lines.append(
            f"  {key:<24} {rows:>10}  {spec['name']} dim={spec['dim']} state_width={spec['state_width']} "
            f"dtype={spec['dtype']}"
        )
    return "\n".join(lines)
