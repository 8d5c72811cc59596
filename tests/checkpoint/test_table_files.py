"""Portable table files (dynemb/checkpoint/table_files.py) and `dynemb table export|import`, against
real PS processes: embedded → files → Redis-backed, bit for bit; corrupt, truncated and missing
shards, bad manifests and schema clashes refused before anything is written."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
from helpers import dynemb, fill, same_bits, unique

from dynemb.checkpoint.table_files import (
    MANIFEST,
    Manifest,
    TableFileError,
    TableReader,
    TableWriter,
    export_table,
    import_table,
)
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import TableNotFound
from dynemb.ps_server.schema import TableSchema
from dynemb.testing.local_ps import LocalPS


@pytest.fixture(scope="module")
def redis_client(redis_url):
    """A client of one Redis-backed PS (in a namespace of its own) that the module's tests share."""
    namespace = f"tf{uuid.uuid4().hex[:8]}"
    with LocalPS("--backend", redis_url, "--namespace", namespace, "--not-serving-seconds", "0") as ps:
        with PSClient(ps.address, timeout=30) as client:
            yield client


@pytest.fixture(scope="module")
def disk_client(tmp_path_factory):
    """A client of one disk-backed PS (RocksDB) that the module's tests share."""
    folder = tmp_path_factory.mktemp("disk")
    with LocalPS("--backend", f"disk://{folder}/rows", "--not-serving-seconds", "0") as ps:
        with PSClient(ps.address, timeout=30) as client:
            yield client


@pytest.mark.parametrize("target", ["redis", "disk"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_embedded_to_files_to_another_store_bit_for_bit(embedded_client, tmp_path, dtype, target, request):
    target_client = request.getfixturevalue(f"{target}_client")  # the PS the files are imported into
    name = unique(f"rt_{dtype}")
    schema, ids, rows = fill(embedded_client, name, dtype, n=1000, seed=len(dtype))
    manifest = export_table(embedded_client, name, tmp_path / name, rows_per_shard=300, progress=False)
    assert [s.rows for s in manifest.shards] == [300, 300, 300, 100]
    assert manifest.schema == schema and manifest.num_rows == 1000
    doc = json.loads((tmp_path / name / MANIFEST).read_text())
    assert doc["format"] == "dynemb.table" and doc["version"] == 1 and doc["schema"] == schema.to_dict()
    assert sorted(os.listdir(tmp_path / name)) == [f"part-0000{k}.safetensors" for k in range(4)] + [MANIFEST]

    reader = TableReader(tmp_path / name)
    got = [np.concatenate(parts) for parts in zip(*reader.chunks(chunk_rows=128))]
    order = np.argsort(got[0])
    expect = np.argsort(ids)
    assert np.array_equal(got[0][order], ids[expect])
    assert same_bits(np.concatenate([got[1], got[2]], axis=1)[order], rows[expect])

    assert import_table(target_client, tmp_path / name, progress=False) == 1000
    assert target_client.describe_table(name).schema == schema
    assert target_client.describe_table(name).num_rows == 1000
    pulled = target_client.pull(name, ids)
    assert not pulled.missing.any()
    assert same_bits(pulled.rows, rows)


def test_writer_rolls_shards_and_reader_gives_back_every_row(tmp_path):
    schema = TableSchema("w", dim=3, state_width=1)
    rng = np.random.default_rng(0)
    chunks = [
        (
            np.arange(k, k + n),
            rng.standard_normal((n, 3)).astype(np.float32),
            rng.standard_normal((n, 1)).astype(np.float32),
        )
        for k, n in ((0, 7), (7, 5), (12, 13), (25, 0))
    ]
    with TableWriter(tmp_path / "w", schema, rows_per_shard=10) as w:
        for c in chunks:
            w.write(*c)
    m = Manifest.read(tmp_path / "w")
    assert [s.rows for s in m.shards] == [10, 10, 5] and m.num_rows == 25
    out = [np.concatenate(p) for p in zip(*TableReader(tmp_path / "w").chunks(chunk_rows=4))]
    for got, want in zip(out, (np.concatenate(p) for p in zip(*chunks))):
        assert np.array_equal(got, want)

    with pytest.raises(TableFileError, match="already holds table files"):
        TableWriter(tmp_path / "w", schema)
    w = TableWriter(tmp_path / "w", schema, overwrite=True)
    with pytest.raises(TableFileError, match=r"embeddings must have shape \(2, 3\), got \(2, 4\)"):
        w.write([1, 2], np.zeros((2, 4), np.float32), np.zeros((2, 1), np.float32))
    with pytest.raises(TableFileError, match="state must be float32 .* got float64"):
        w.write([1, 2], np.zeros((2, 3), np.float32), np.zeros((2, 1)))
    assert not (tmp_path / "w" / MANIFEST).exists(), "an overwrite removes the old manifest first"


def test_a_writer_that_fails_leaves_no_manifest(tmp_path):
    schema = TableSchema("f", dim=2)
    with pytest.raises(RuntimeError):
        with TableWriter(tmp_path / "f", schema, rows_per_shard=2) as w:
            w.write([1, 2, 3], np.ones((3, 2), np.float32))
            raise RuntimeError("export cut short")
    assert (tmp_path / "f" / "part-00000.safetensors").exists()
    with pytest.raises(TableFileError, match="table.json: missing"):
        TableReader(tmp_path / "f")


@pytest.fixture(scope="module")
def exported(embedded_ps, tmp_path_factory):
    """A 3-shard table folder exported from the embedded PS (copied per test before damage)."""
    folder = tmp_path_factory.mktemp("exported") / "src"
    with PSClient(embedded_ps.address) as ps:
        name = unique("src")
        fill(ps, name, "fp32", n=90, dim=4, state_width=1)
        export_table(ps, name, folder, rows_per_shard=30, progress=False)
    return folder


@pytest.fixture
def copy_of(exported, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(exported, dst)
    return dst


def assert_nothing_written(ps: PSClient, table: str) -> None:
    with pytest.raises(TableNotFound):
        ps.describe_table(table)


def test_corrupt_shard_is_named_and_nothing_is_written(redis_client, copy_of):
    path = copy_of / "part-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one flipped bit in the last shard's values
    path.write_bytes(bytes(data))
    table = unique("corrupt")
    with pytest.raises(TableFileError, match=r"part-00002\.safetensors: sha256 is [0-9a-f]{64}, table\.json says"):
        import_table(redis_client, copy_of, table=table, progress=False)
    assert_nothing_written(redis_client, table)


def test_truncated_and_missing_shards(redis_client, copy_of):
    path = copy_of / "part-00001.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    table = unique("trunc")
    truncated = rf"part-00001\.safetensors: sha256 .* corrupt or truncated \({size - 100} bytes\)"
    with pytest.raises(TableFileError, match=truncated):
        import_table(redis_client, copy_of, table=table, progress=False)
    path.unlink()
    with pytest.raises(TableFileError, match=r"part-00001\.safetensors: missing \(listed in .*table\.json\)"):
        import_table(redis_client, copy_of, table=table, progress=False)
    assert_nothing_written(redis_client, table)


def test_a_shard_with_the_right_checksum_but_wrong_tensors(copy_of):
    from safetensors.numpy import save_file

    from dynemb.checkpoint.table_files import sha256_of

    path = copy_of / "part-00000.safetensors"
    save_file(
        {"ids": np.arange(30), "embeddings": np.zeros((30, 5), np.float32), "state": np.zeros((30, 1), np.float32)},
        str(path),
    )
    doc = json.loads((copy_of / MANIFEST).read_text())
    doc["shards"][0]["sha256"] = sha256_of(path)
    (copy_of / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(
        TableFileError,
        match=r"part-00000\.safetensors: tensor 'embeddings' is F32 \[30, 5\], "
        r"expected F32 \[30, 4\]",
    ):
        TableReader(copy_of).verify()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=2), "format version 2 is not one this dynemb reads"),
        (lambda d: d.update(format="other"), "field 'format' is 'other', expected 'dynemb.table'"),
        (lambda d: d.pop("num_rows"), "field 'num_rows' is missing"),
        (lambda d: d.update(num_rows=91), "num_rows is 91 but the shards hold 90 rows"),
        (lambda d: d["schema"].update(dim=0), "field 'schema' is not a valid table schema: .*dim must be"),
        (lambda d: d["shards"][0].update(file="../x.safetensors"), r"shards\[0\]\.file must be a name like"),
        (lambda d: d["shards"][1].pop("sha256"), r"shards\[1\] must be an object with file, rows and sha256"),
    ],
)
def test_bad_manifests_are_named(copy_of, edit, message):
    doc = json.loads((copy_of / MANIFEST).read_text())
    edit(doc)
    (copy_of / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(TableFileError, match=message):
        TableReader(copy_of)


def test_not_json(copy_of):
    (copy_of / MANIFEST).write_text("{oops")
    with pytest.raises(TableFileError, match="table.json: not valid JSON"):
        TableReader(copy_of)


def test_schema_clash_with_an_existing_table_writes_nothing(redis_client, copy_of):
    table = unique("clash")
    redis_client.create_table(table, dim=4, state_width=4)  # the files have state_width 1
    redis_client.push(table, [1], np.ones((1, 8), np.float32))
    with pytest.raises(
        TableFileError,
        match=rf"table '{table}' exists on the PS with another schema "
        r"\(PS vs files: state_width 4 vs 1; initializer",
    ):
        import_table(redis_client, copy_of, table=table, replace=True, progress=False)
    assert redis_client.describe_table(table).num_rows == 1
    assert np.array_equal(redis_client.pull(table, [1]).rows, np.ones((1, 8), np.float32))


@pytest.mark.slow
def test_cli_export_import_end_to_end(embedded_client, redis_client, tmp_path, copy_of):
    a, b = unique("cli_a"), unique("cli_b")
    _, ids_a, rows_a = fill(embedded_client, a, "fp32", n=50, seed=1)
    _, ids_b, rows_b = fill(embedded_client, b, "fp16", n=20, dim=3, state_width=0, seed=2)
    out = tmp_path / "out"
    ps, redis_address = embedded_client.addresses[0], redis_client.addresses[0]
    tables = ["--table", a, "--table", b]
    res = dynemb("table", "export", "--ps", ps, *tables, "--out", str(out), *"--rows-per-shard 16 --quiet".split())
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"exported {a}: 50 rows in 4 shard(s) -> {out / a}",
        f"exported {b}: 20 rows in 2 shard(s) -> {out / b}",
    ]

    res = dynemb("table", "import", str(out), "--ps", redis_address, "--quiet")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"imported {out / a} -> table {a}: 50 rows",
        f"imported {out / b} -> table {b}: 20 rows",
    ]
    assert same_bits(redis_client.pull(a, ids_a).rows, rows_a)
    assert same_bits(redis_client.pull(b, ids_b).rows, rows_b)

    renamed = unique("cli_renamed")
    res = dynemb("table", "import", str(out), "--table", b, "--as", renamed, "--ps", redis_address)
    assert res.returncode == 0, res.stderr
    assert "import " + renamed in res.stderr  # the progress bar
    assert same_bits(redis_client.pull(renamed, ids_b).rows, rows_b)

    (copy_of / "part-00001.safetensors").write_bytes(b"not a shard")
    res = dynemb("table", "import", str(copy_of), "--as", unique("bad"), "--ps", redis_address)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dynemb: error: {copy_of / 'part-00001.safetensors'}: sha256 is")
    assert "Traceback" not in res.stderr

    res = dynemb("table", "import", str(out), "--as", "x", "--ps", redis_address)
    assert res.returncode == 1 and "--as names one table, but 2 would be imported" in res.stderr
    res = dynemb("table", "export", "--ps", ps, "--table", "no_such_table", "--out", str(tmp_path / "none"))
    assert res.returncode == 1 and "NOT_FOUND" in res.stderr and not (tmp_path / "none").exists()


def test_the_old_checkpoint_export_import_names_still_work_for_one_release(embedded_client, tmp_path):
    name = unique("old_cli")
    _, ids, rows = fill(embedded_client, name, "fp32", n=10, seed=3)
    ps = embedded_client.addresses[0]
    res = dynemb("checkpoint", "export", "--ps", ps, "--table", name, "--out", str(tmp_path), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "this command is now `dynemb table export`" in res.stderr
    renamed = unique("old_cli_back")
    res = dynemb("checkpoint", "import", str(tmp_path / name), "--as", renamed, "--ps", ps, "--quiet")
    assert res.returncode == 0, res.stderr
    assert "this command is now `dynemb table import`" in res.stderr
    assert same_bits(embedded_client.pull(renamed, ids).rows, rows)
