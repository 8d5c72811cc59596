"""What `dynemb table apply` checks before it writes (dynemb/publish/version.py, apply.py): every
file of the chain, against its manifest and the store, on every backend. A well-formed lie (a
file whose sha256 matches a manifest that does not describe it) and a malformed file are refused
with one line, nothing written; a store that holds a version refuses to call another one by its
number."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Callable

import numpy as np
import pytest
from helpers import dynemb
from safetensors.numpy import save_file

from dynemb.ps_server.backends.embedded import EmbeddedStore
from dynemb.ps_server.backends.serving_redis import ServingRedis
from dynemb.publish.apply import apply_table, serving_store
from dynemb.publish.version import VersionError, VersionWriter, folder_name

DIM = 4


def write_version(root, number, kind, ids, value: float, deleted=(), dtype="fp32"):
    ids = np.asarray(ids, dtype=np.int64)
    parent, base = (None, number) if kind == "full" else (number - 1, 1)
    with VersionWriter(root, "user", number, kind, parent, base, dtype, DIM, number) as w:
        w.write_rows(ids, np.full((len(ids), DIM), value, np.float32))
        w.write_deleted(np.asarray(deleted, dtype=np.int64))


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def tensors_file(tmp_path, tensors: dict[str, np.ndarray]) -> bytes:
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    return path.read_bytes()


def lie(root, number: int, file: str, data: bytes | None, **manifest) -> None:
    """Version `number`'s file replaced by data (None: kept) and manifest fields changed (a
    "files" entry's count as count=...), the manifest's sha256 and counts made to match: a
    version that is consistent on its face."""
    folder = root / "user" / folder_name(number)
    if data is not None:
        (folder / file).write_bytes(data)
    doc = json.loads((folder / "version.json").read_text())
    for entry in doc["files"]:
        if entry["file"] == file:
            entry["sha256"] = hashlib.sha256((folder / file).read_bytes()).hexdigest()
            entry["count"] = manifest.pop("count", entry["count"])
    doc.update(manifest)
    doc["rows"] = sum(e["count"] for e in doc["files"] if e["kind"] == "rows")
    (folder / "version.json").write_text(json.dumps(doc))


N = 3  # rows in the bad version (ids 10, 11, 12)
IDS = np.array([10, 11, 12], np.int64)
# name -> (the rows file's bytes given a tmp folder, or None: kept; manifest changes)
MALFORMED: dict[str, tuple[Callable | None, dict]] = {
    "values of another width": (lambda t: tensors_file(t, {"ids": IDS, "values": np.ones((N, 2 * DIM), "<f4")}), {}),
    "values of another dtype": (lambda t: tensors_file(t, {"ids": IDS, "values": np.ones((N, DIM), "<f2")}), {}),
    "manifest dim wrong": (None, {"dim": 2 * DIM}),
    "manifest dtype wrong": (None, {"dtype": "int8"}),
    "header of 2^40 ids": (
        lambda t: safetensors_bytes({"ids": {"dtype": "I64", "shape": [1 << 40], "data_offsets": [0, 8 << 40]}}),
        {},
    ),
    "header length 2^62": (lambda t: struct.pack("<Q", 1 << 62) + b"{}", {}),
    "500 ids, 400 rows": (
        lambda t: tensors_file(t, {"ids": np.arange(500), "values": np.ones((400, DIM), "<f4")}),
        {"count": 500},
    ),
    "no ids tensor": (lambda t: tensors_file(t, {"values": np.ones((N, DIM), "<f4")}), {}),
    "row count off by one": (None, {"count": N + 1}),
    "ids not int64": (
        lambda t: tensors_file(t, {"ids": IDS.astype("<f8"), "values": np.ones((N, DIM), "<f4")}),
        {},
    ),
    "not safetensors": (lambda t: b"\x00" * 7, {}),
}


def state(target: str, namespace: str) -> tuple:
    """What a reader of the store sees of the table: (the version held, id -> first value)."""
    store = serving_store(target, namespace)
    ids = np.arange(20, dtype=np.int64)
    if isinstance(store, ServingRedis):
        head = store.raw_head("user")
        rows, found, _ = store.pull("user", ids)
        return head.version, head.pending, {int(i): float(r[0]) for i, r, f in zip(ids, rows, found) if f}
    es = EmbeddedStore(str(store))
    rows, found = es.pull("user", ids)
    return es.published_version("user"), 0, {int(i): float(r[0]) for i, r, f in zip(ids, rows, found) if f}


def test_every_malformed_version_is_refused_before_a_write_on_every_store(target, redis_namespace, tmp_path):
    """The store holds v1; v2 is a good delta, v3 a bad one: the apply writes nothing, not even
    v2, and says what is wrong in a VersionError; then, v3 repaired, the chain applies whole."""
    root = tmp_path / "published"
    write_version(root, 1, "full", range(5), 1.0)
    apply_table(serving_store(target, redis_namespace), root, "user")
    before = state(target, redis_namespace)
    write_version(root, 2, "delta", [0, 1], 2.0, deleted=[4])
    good = tmp_path / "good"
    write_version(root, 3, "delta", IDS, 3.0)
    shutil.copytree(root / "user" / folder_name(3), good)
    for case, (data, manifest) in MALFORMED.items():
        shutil.rmtree(root / "user" / folder_name(3))
        shutil.copytree(good, root / "user" / folder_name(3))
        lie(root, 3, "rows-00000.safetensors", data(tmp_path) if data else None, **manifest)
        with pytest.raises(VersionError) as refused:
            apply_table(serving_store(target, redis_namespace), root, "user")
        assert "\n" not in str(refused.value), case
        assert state(target, redis_namespace) == before, f"{case}: the store changed"
    shutil.rmtree(root / "user" / folder_name(3))
    shutil.copytree(good, root / "user" / folder_name(3))
    assert apply_table(serving_store(target, redis_namespace), root, "user").versions == [2, 3]
    assert state(target, redis_namespace)[2] == {0: 2.0, 1: 2.0, 2: 1.0, 3: 1.0, 10: 3.0, 11: 3.0, 12: 3.0}


def test_a_delta_of_another_width_than_the_store_is_refused_before_a_write(target, redis_namespace, tmp_path):
    root = tmp_path / "published"
    write_version(root, 1, "full", range(5), 1.0)
    apply_table(serving_store(target, redis_namespace), root, "user")
    before = state(target, redis_namespace)
    write_version(root, 2, "delta", [0], 2.0)
    with VersionWriter(root, "user", 3, "delta", 2, 1, "fp32", 2 * DIM, 3) as w:  # consistent, but 8 wide
        w.write_rows(IDS, np.ones((N, 2 * DIM), np.float32))
    with pytest.raises(VersionError, match="dim"):
        apply_table(serving_store(target, redis_namespace), root, "user")
    assert state(target, redis_namespace) == before


def test_a_store_refuses_to_call_another_version_by_the_number_it_holds(target, redis_namespace, tmp_path):
    """The published folder made again from scratch (another publisher, a folder wiped): the
    store's v2 is not the folder's v2, and the store is newer than the folder's newest."""
    root = tmp_path / "published"
    write_version(root, 1, "full", range(5), 1.0)
    write_version(root, 2, "delta", [0], 2.0)
    assert apply_table(serving_store(target, redis_namespace), root, "user").holds == 2
    before = state(target, redis_namespace)
    shutil.rmtree(root)
    write_version(root, 1, "full", range(5), 7.0)
    write_version(root, 2, "delta", [0], 8.0)
    with pytest.raises(VersionError, match="not the version 2 the store holds"):
        apply_table(serving_store(target, redis_namespace), root, "user")
    shutil.rmtree(root / "user" / folder_name(2))
    with pytest.raises(VersionError, match="newer than the newest"):
        apply_table(serving_store(target, redis_namespace), root, "user")
    assert state(target, redis_namespace) == before


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_apply_command_says_what_is_wrong_in_one_line(redis_url, redis_namespace, tmp_path, case):
    root = tmp_path / "published"
    write_version(root, 1, "full", range(5), 1.0)
    write_version(root, 2, "delta", IDS, 3.0)
    data, manifest = MALFORMED[case]
    lie(root, 2, "rows-00000.safetensors", data(tmp_path) if data else None, **manifest)
    for to in (redis_url, f"embedded://{tmp_path / 'serving'}"):
        done = dynemb("table", "apply", str(root), "--to", to, "--namespace", redis_namespace, "--quiet")
        said = f"{case}, {to}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        assert done.returncode == 1 and "Traceback" not in done.stderr, said
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("dynemb: error: "), said
        assert not done.stdout.strip(), said  # nothing applied, not even v1


@pytest.mark.parametrize("case", ["header of 2^40 ids", "header length 2^62", "no ids tensor", "not safetensors"])
def test_the_import_command_says_what_is_wrong_with_a_shard_in_one_line(embedded_ps, tmp_path, case):
    from dynemb.checkpoint.table_files import TableWriter
    from dynemb.ps_server.schema import TableSchema

    folder = tmp_path / "user"
    with TableWriter(folder, TableSchema("user", DIM)) as w:
        w.write(IDS, np.ones((N, DIM), np.float32))
    shard = folder / "part-00000.safetensors"
    shard.write_bytes(MALFORMED[case][0](tmp_path))
    doc = json.loads((folder / "table.json").read_text())
    doc["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (folder / "table.json").write_text(json.dumps(doc))
    done = dynemb("table", "import", str(folder), "--ps", embedded_ps.address, "--as", f"t{abs(hash(case))}", "--quiet")
    said = f"{case}: exit {done.returncode}\n{done.stderr}"
    assert done.returncode == 1 and "Traceback" not in done.stderr, said
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("dynemb: error: "), said


@pytest.mark.parametrize("field, value", [("source", [1]), ("dim", 0), ("dim", 1 << 20), ("base", 0)])
def test_a_manifest_field_out_of_its_range_is_refused_by_name(tmp_path, field, value):
    from dynemb.publish.version import Version

    root = tmp_path / "published"
    write_version(root, 1, "full", range(5), 1.0)
    lie(root, 1, "rows-00000.safetensors", None, **{field: value})
    with pytest.raises(VersionError, match=f"field '{field}'|fields 'number' and 'base'"):
        Version.read(root / "user" / folder_name(1))
