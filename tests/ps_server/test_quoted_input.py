"""Errors quote what they were given through shown() (dynemb/common/errors.py): cut short, so
that a megabyte-long field of a request or a file makes a readable one-line message (and a
PS status that still fits the client's 16 KiB metadata limit; see test_server_errors.py)."""

from __future__ import annotations

import json

import pytest

from dynemb.checkpoint.format import MANIFEST as CHECKPOINT_MANIFEST
from dynemb.checkpoint.format import CheckpointError, read_manifest
from dynemb.checkpoint.table_files import MANIFEST, Manifest, TableFileError
from dynemb.common.errors import shown
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.schema import TableSchema
from dynemb.trainer.data import BadLine, parse_criteo_line

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

HUGE = "h" * 100_000


def test_shown():
    assert shown("abc") == "'abc'" and shown(3) == "3" and shown(None) == "None"
    assert shown(HUGE) == f"{'h' * 64!r}... (100000 characters)"
    assert shown(bytes(1000)) == f"{bytes(64)!r}... (1000 bytes)"
    long_list = shown(list(range(10_000)))
    assert long_list.startswith("[0, 1, 2, ") and long_list.endswith("(a list of 58890 characters)")
    assert len(long_list) < 200


@pytest.mark.parametrize(
    "make",
    [
        lambda: TableSchema.from_dict(TableSchema("t", dim=2).to_dict() | {"dtype": HUGE}),
        lambda: TableSchema.from_dict(TableSchema("t", dim=2).to_dict() | {"initializer": {"kind": HUGE}}),
        lambda: TableSchema.from_dict(TableSchema("t", dim=2).to_dict() | {"initializer": {HUGE: 1.0}}),
        lambda: TableSchema("t", dim=HUGE),
        lambda: TableSchema("t", dim=1, state_width=[0] * 100_000),
    ],
    ids=["dtype", "initializer-kind", "initializer-field", "dim", "state_width"],
)
def test_a_schema_quotes_its_fields_short(make):
    with pytest.raises(InvalidArgument) as info:
        make()
    assert len(str(info.value)) < 300, str(info.value)[:400]


def _manifest(**changes) -> dict:
    return {
        "format": "dynemb.table",
        "version": 1,
        "schema": TableSchema("t", dim=2).to_dict(),
        "num_rows": 1,
        "shards": [{"file": "part-00000.safetensors", "rows": 1, "sha256": "0" * 64}],
    } | changes


@pytest.mark.parametrize(
    "doc",
    [
        _manifest(format=HUGE),
        _manifest(version=HUGE),
        _manifest(schema={**TableSchema("t", dim=2).to_dict(), "name": HUGE}),
        _manifest(shards=[HUGE]),
        _manifest(shards=[{"file": HUGE, "rows": 1, "sha256": "0" * 64}]),
        _manifest(shards=[{"file": "part-00000.safetensors", "rows": HUGE, "sha256": "0" * 64}]),
        _manifest(shards=[{"file": "part-00000.safetensors", "rows": 1, "sha256": HUGE}]),
    ],
)
def test_a_table_manifest_quotes_its_fields_short(tmp_path, doc):
    (tmp_path / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(TableFileError) as info:
        Manifest.read(tmp_path)
    assert "(100000 characters)" in str(info.value) and len(str(info.value)) < 300 + len(str(tmp_path))


def test_a_checkpoint_manifest_quotes_its_format_short(tmp_path):
    (tmp_path / CHECKPOINT_MANIFEST).write_text(json.dumps({"format": HUGE, "version": 1}))
    with pytest.raises(CheckpointError, match=r"\(100000 characters\)") as info:
        read_manifest(tmp_path)
    assert len(str(info.value)) < 300 + len(str(tmp_path))


@pytest.mark.parametrize("label", [HUGE, "0." + "5" * 100_000])
def test_a_data_line_quotes_its_label_short(label):
    line = "\t".join([label, *["1"] * 13, *[""] * 26])
    with pytest.raises(BadLine, match="label must be 0 or 1") as info:
        parse_criteo_line(line, where="day.tsv:7")
    assert len(str(info.value)) < 200
