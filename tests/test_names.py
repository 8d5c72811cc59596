"""Names of tables (and the folders, files and versions named after them): one validated form
wherever a name enters (the PS, the CLI, table folders, version manifests, checkpoint
manifests), refused in one line naming the rule (dynemb/common/names.py), and never a path out of
the folder a command was given."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import dynemb

from dynemb.checkpoint import format as ckpt_format
from dynemb.checkpoint.table_files import TableFileError, TableReader, TableWriter
from dynemb.common.errors import UserError
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import TableSchema
from dynemb.publish import Lookup
from dynemb.publish.version import VersionError, VersionWriter, chain, numbers

RULE = "not starting with . or -"
# Each was accepted as a table name and made a path out of the folder given ('.', '..'), a
# hidden file ('.x') or a flag ('-x'); '/' and '' were refused already.
BAD = [".", "..", ".x", "-x", "a/b", "", "x" * 129]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("name", BAD)
def test_the_ps_refuses_a_table_of_a_bad_name_naming_the_rule(embedded_client, name):
    with pytest.raises(InvalidArgument, match="use 1 to 128 of the characters"):
        embedded_client.create_table_from_schema(_unchecked_schema(name))


def _unchecked_schema(name: str) -> TableSchema:
    """A schema of that name, past the client's own check: what a client of another language sends."""
    schema = TableSchema("placeholder", 4)
    object.__setattr__(schema, "name", name)
    return schema


@pytest.mark.parametrize("name", [".", "..", ".x", "-x"])
def test_a_bad_name_in_the_python_api_is_refused_before_any_file(tmp_path, name):
    out = tmp_path / "out"
    with pytest.raises(InvalidArgument, match=RULE):
        TableSchema(name, 4)
    with pytest.raises(UserError, match=RULE):
        VersionWriter(out, name, 1, "full", None, 1, "fp32", 4, 0)
    with pytest.raises(UserError, match=RULE):
        numbers(out, name)
    with pytest.raises(UserError, match=RULE):
        chain(out, name)
    with pytest.raises(InvalidArgument, match=RULE):
        Lookup(f"embedded://{out}", name)
    assert files_under(tmp_path) == set()


def test_commands_refuse_a_bad_table_name_in_one_line_and_write_nothing_outside(embedded_ps, embedded_client, tmp_path):
    """A table '..' on the PS (accepted before) and `--table ..`/`--as ..`: every command exits 1
    or 2 with one line naming the rule, no traceback, and writes nothing out of its folder."""
    with contextlib.suppress(InvalidArgument):  # refused now; the commands must hold either way
        embedded_client.create_table("..", 4)
        embedded_client.push("..", np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))
    work = tmp_path / "work"
    work.mkdir()
    folder = work / "folders" / "user"
    with TableWriter(folder, TableSchema("user", 4)) as w:
        w.write(np.arange(3), np.ones((3, 4), np.float32))
    before = files_under(tmp_path)
    ps = ["--ps", embedded_ps.address]
    commands = {  # each with the folder it may write in
        "work/out": ["table", "export", *ps, "--table", "..", "--out", str(work / "out")],
        "work/pub": ["table", "publish", *ps, "--table", "..", "--to", str(work / "pub")],
        "work/serving": ["table", "apply", str(work), "--to", f"embedded://{work / 'serving'}", "--table", ".."],
        "work/folders": ["table", "import", str(folder), *ps, "--as", ".."],
        "work/ckpt": ["checkpoint", "save", *ps, "--table", "..", "--out", str(work / "ckpt")],
        "-": ["ps", "create-table", "..", *ps, "--dim", "4"],
    }
    for allowed, argv in commands.items():
        done = dynemb(*argv)
        said = f"dynemb {' '.join(argv)}: exit {done.returncode}\n{done.stderr}"
        created = files_under(tmp_path) - before
        assert all(p.startswith(allowed) for p in created), f"{said}\nwritten outside {allowed}: {created}"
        assert done.returncode in (1, 2), said
        assert "Traceback" not in done.stderr and RULE in done.stderr, said
        errors = [line for line in done.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and RULE in errors[0], said


def test_a_table_folder_naming_a_bad_table_is_refused(tmp_path):
    folder = tmp_path / "user"
    with TableWriter(folder, TableSchema("user", 4)) as w:
        w.write(np.arange(3), np.ones((3, 4), np.float32))
    doc = json.loads((folder / "table.json").read_text())
    doc["schema"]["name"] = ".."
    (folder / "table.json").write_text(json.dumps(doc))
    with pytest.raises(TableFileError, match=RULE):
        TableReader(folder)


def test_a_version_manifest_naming_a_bad_table_is_refused(tmp_path):
    root = tmp_path / "pub"
    with VersionWriter(root, "user", 1, "full", None, 1, "fp32", 4, 0) as w:
        w.write_rows(np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))
    manifest = root / "user" / "v00000001" / "version.json"
    doc = json.loads(manifest.read_text())
    doc["table"] = ".."
    manifest.write_text(json.dumps(doc))
    with pytest.raises(VersionError, match=RULE):
        chain(root, "user")


@pytest.mark.parametrize(
    "field, value",
    [("files", {"../outside.bin": "0" * 64}), ("parent", "../elsewhere"), ("tables", {"..": {}})],
)
def test_a_checkpoint_manifest_naming_a_path_out_of_its_folder_is_refused(tmp_path, field, value):
    ckpt = tmp_path / "ckpts" / "step-00000001"
    ckpt.mkdir(parents=True)
    doc = {"format": ckpt_format.FORMAT, "version": ckpt_format.VERSION, "kind": "full", "files": {}, "tables": {}}
    doc[field] = value
    (ckpt / ckpt_format.MANIFEST).write_text(json.dumps(doc))
    (tmp_path / "outside.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="is not valid"):
        ckpt_format.verify(ckpt)
        ckpt_format.chain(ckpt)
    assert os.listdir(tmp_path / "ckpts") == ["step-00000001"]


def test_a_saved_embedded_generation_listing_a_file_out_of_its_folder_is_refused(tmp_path):
    from dynemb.ps_server.backends.embedded import EmbeddedStore, SnapshotError

    store = EmbeddedStore(str(tmp_path / "store"))
    store.create_table(TableSchema("user", 4))
    store.push("user", np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))
    store.save()
    listing_path = next((tmp_path / "store").glob("gen-*/tables.json"))
    listing = json.loads(listing_path.read_text())
    listing["tables"][0]["file"] = ".."  # the generation's parent: a folder, whatever its size says
    listing["tables"][0]["bytes"] = listing_path.parent.parent.stat().st_size
    listing_path.write_text(json.dumps(listing))
    with pytest.raises(SnapshotError, match=RULE):
        EmbeddedStore(str(tmp_path / "store"))
