"""Version folders: written whole or not at all, read back as written, and chained from the
version a store holds to the newest, with gaps and corrupt files refused before any is used."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dynemb.publish.quantize import dequantize
from dynemb.publish.version import MANIFEST, Version, VersionError, VersionWriter, chain, folder_name, numbers


def write(root, number, kind="delta", parent=None, base=1, dtype="fp32", rows=50, deleted=()):
    rng = np.random.default_rng(number)
    ids = rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64)
    values = rng.standard_normal((rows, 8)).astype(np.float32)
    parent = number - 1 if parent is None and kind == "delta" else parent
    with VersionWriter(root, "user", number, kind, parent, number if kind == "full" else base, dtype, 8, 10 * number,
                       rows_per_file=20) as w:  # fmt: skip
        w.write_rows(ids, values)
        w.write_deleted(np.asarray(deleted, dtype=np.int64))
    return ids, values


def test_a_chain_reads_back_what_was_written(tmp_path):
    ids1, rows1 = write(tmp_path, 1, "full", None)
    ids2, rows2 = write(tmp_path, 2, deleted=[5, 6, 7])
    write(tmp_path, 3, dtype="int8")
    assert numbers(tmp_path, "user") == [1, 2, 3]
    assert [v.number for v in chain(tmp_path, "user")] == [1, 2, 3]
    assert [v.number for v in chain(tmp_path, "user", have=1)] == [2, 3]
    assert chain(tmp_path, "user", have=3) == []
    v1, v2, v3 = chain(tmp_path, "user")
    assert (v1.kind, v1.parent, v1.base, v1.rows, v1.deleted, v1.step) == ("full", None, 1, 50, 0, 10)
    assert (v2.kind, v2.parent, v2.base, v2.deleted) == ("delta", 1, 1, 3)
    assert [f.file for f in v1.files] == ["rows-00000.safetensors", "rows-00001.safetensors", "rows-00002.safetensors"]
    got = list(v1.row_chunks())
    assert np.array_equal(np.concatenate([i for i, _ in got]), ids1)
    assert np.array_equal(np.concatenate([q.values for _, q in got]).view(np.uint32), rows1.view(np.uint32))
    assert v2.deleted_ids().tolist() == [5, 6, 7] and v1.deleted_ids().tolist() == []
    (ids3, q3), *_ = v3.row_chunks()
    assert q3.values.dtype == np.int8 and q3.scales is not None and q3.scales.dtype == np.float32
    assert Version.read(v3.folder).to_dict() == json.loads((v3.folder / MANIFEST).read_text())
    assert dequantize(q3, "int8").shape == (20, 8)


def test_a_version_half_made_is_never_seen_and_the_next_writer_replaces_it(tmp_path):
    write(tmp_path, 1, "full")
    with pytest.raises(RuntimeError, match="killed"):
        with VersionWriter(tmp_path, "user", 2, "delta", 1, 1, "fp32", 8, 20) as w:
            w.write_rows(np.arange(3), np.zeros((3, 8), np.float32))
            raise RuntimeError("killed")
    assert numbers(tmp_path, "user") == [1] and sorted(p.name for p in (tmp_path / "user").iterdir()) == ["v00000001"]
    # as if killed -9 before close: only the hidden folder, which the next writer of 2 replaces
    w = VersionWriter(tmp_path, "user", 2, "delta", 1, 1, "fp32", 8, 20)
    w.write_rows(np.arange(3), np.ones((3, 8), np.float32))
    assert numbers(tmp_path, "user") == [1] and chain(tmp_path, "user", have=1) == []
    write(tmp_path, 2)
    assert numbers(tmp_path, "user") == [1, 2]
    assert [v.number for v in chain(tmp_path, "user", have=1)] == [2]
    with pytest.raises(VersionError, match="version 2 of table 'user' is there already"):
        VersionWriter(tmp_path, "user", 2, "delta", 1, 1, "fp32", 8, 20)


def test_a_gap_is_refused_unless_a_full_version_after_it_starts_a_chain(tmp_path):
    for n in (1, 2, 3):
        write(tmp_path, n, "full" if n == 1 else "delta")
    shutil.rmtree(tmp_path / "user" / folder_name(2))
    with pytest.raises(VersionError, match="no chain of versions after version 1 to version 3"):
        chain(tmp_path, "user", have=1)
    write(tmp_path, 4, "full")
    write(tmp_path, 5, base=4)
    assert [v.number for v in chain(tmp_path, "user", have=1)] == [4, 5]
    assert [v.number for v in chain(tmp_path, "user")] == [4, 5]  # a new store starts at the newest full
    # a delta whose parent is not the version before it breaks the chain too
    write(tmp_path, 6, parent=4, base=4)
    with pytest.raises(VersionError, match="no chain"):
        chain(tmp_path, "user", have=5)


def test_a_corrupt_or_missing_file_is_refused_before_anything_is_used(tmp_path):
    write(tmp_path, 1, "full")
    write(tmp_path, 2, deleted=[1, 2])
    path = tmp_path / "user" / folder_name(2) / "rows-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(VersionError, match=r"v00000002/rows-00001.safetensors: its sha256 is not the one"):
        chain(tmp_path, "user", have=1)
    path.unlink()
    with pytest.raises(VersionError, match=r"rows-00001.safetensors: missing \(listed in version.json\)"):
        chain(tmp_path, "user")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other"}, "field 'format' is 'other'"),
        ({"version": 9}, "format version 9 is not one this dynemb reads"),
        ({"kind": "half"}, "'kind' must be 'full' or 'delta'"),
        ({"dtype": "fp8"}, "field 'dtype': a published dtype is one of"),
        ({"rows": 7}, "field 'rows' is 7 but its files hold 50"),
        ({"number": 3}, "number 3 is not that of its folder 'v00000002'"),
        ({"parent": 2}, "a delta's parent must be a version from its base on and before it"),
        ({"step": "ten"}, "field 'step' must be int, got 'ten'"),
    ],
)
def test_a_manifest_at_odds_with_itself_names_the_field(tmp_path, change, message):
    write(tmp_path, 1, "full")
    write(tmp_path, 2)
    path = tmp_path / "user" / folder_name(2) / MANIFEST
    doc = json.loads(path.read_text())
    doc.update(change)
    path.write_text(json.dumps(doc))
    with pytest.raises(VersionError, match=message):
        Version.read(path.parent)


def test_bad_arguments_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="one of fp32, fp16, bf16, int8"):
        VersionWriter(tmp_path, "user", 1, "full", None, 1, "fp64", 8, 0)
    with pytest.raises(ValueError, match="numbers start at 1"):
        VersionWriter(tmp_path, "user", 0, "full", None, 0, "fp32", 8, 0)
    with VersionWriter(tmp_path, "user", 1, "full", None, 1, "fp32", 8, 0) as w:
        with pytest.raises(ValueError, match=r"rows must be \(2, 8\)"):
            w.write_rows(np.arange(2), np.zeros((2, 4), np.float32))
        with pytest.raises(ValueError, match="a full version holds no tombstones"):
            w.write_deleted(np.arange(2))
    with pytest.raises(VersionError, match="no versions of table 'item'"):
        chain(tmp_path, "item")


def test_a_manifest_that_is_no_json_object_is_named(tmp_path):
    write(tmp_path, 1, "full")
    path = tmp_path / "user" / folder_name(1) / MANIFEST
    path.write_text("{not json")
    with pytest.raises(VersionError, match=r"version.json: not valid JSON"):
        chain(tmp_path, "user")
    path.write_text("[1, 2]")
    with pytest.raises(VersionError, match="expected a JSON object, got list"):
        Version.read(path.parent)
    path.unlink()
    with pytest.raises(VersionError, match=r"version.json: missing \(an incomplete or no version\)"):
        Version.read(path.parent)
