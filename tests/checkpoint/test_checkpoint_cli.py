"""`dynemb checkpoint inspect|save|restore` against real PS processes: a training job's
checkpoint chain restored onto a fresh PS holds the trained rows; PS tables saved and restored
onto another backend bit for bit; corrupt files and schema clashes named, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import checkpointed_config, dynemb, fill, same_bits, unique

from dynemb.ps_server.client import PSClient
from dynemb.testing.local_ps import REPO, LocalPS
from dynemb.trainer.train import train

pytestmark = [pytest.mark.slow, pytest.mark.torchrec]  # a training job's checkpoints in its fixtures


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A finished job's checkpoints (step 10 full, step 20 incremental) and its final tables."""
    ck = tmp_path_factory.mktemp("job") / "ck"
    result = train(checkpointed_config(ck), collect_tables=True)
    return ck, result.tables


@pytest.fixture(scope="module")
def redis_ps(redis_url):
    ps = LocalPS("--backend", redis_url, "--namespace", unique("ck"), "--not-serving-seconds", "0").start()
    yield ps
    ps.close()


def test_inspect_lists_and_describes_checkpoints(job):
    ck, tables = job
    res = dynemb("checkpoint", "inspect", str(ck), timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"2 checkpoint(s) in {ck}:",
        "  step-00000010  step 10  full",
        "  step-00000020  step 20  incremental <- step-00000010",
    ]
    res = dynemb("checkpoint", "inspect", str(ck / "step-00000020"), "--verify", "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "  kind         incremental, builds on step-00000010" in out
    assert "  chain        step-00000010 -> step-00000020" in out
    assert "  tables       dynamic (PS), optimizer adagrad" in out
    assert len([line for line in out.splitlines() if " dynemb_t_" in line]) == len(tables)
    assert out.splitlines()[-2:] == [
        f"verified step-00000010: {count_files(ck / 'step-00000010')} files, sha256 match",
        f"verified step-00000020: {count_files(ck / 'step-00000020')} files, sha256 match",
    ]


def test_a_reader_that_goes_away_ends_inspect_quietly(job):
    """`dynemb checkpoint inspect ... | head -1`: the pipe closes before the output is written."""
    ck, _ = job
    read, write = os.pipe()
    os.close(read)  # nobody will read: every write fails with EPIPE
    res = subprocess.run(
        [sys.executable, *"-m dynemb.cli checkpoint inspect".split(), str(ck / "step-00000020")],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    os.close(write)
    assert res.returncode == 141 and "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


def count_files(folder) -> int:
    return len(json.loads((folder / "manifest.json").read_text())["files"])


def test_restore_puts_a_training_chain_on_a_fresh_ps(job, make_ps):
    ck, tables = job
    ps = make_ps()
    res = dynemb("checkpoint", "restore", str(ck / "step-00000020"), "--ps", ps.address, "--quiet", timeout=300)
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == len(tables)
    with PSClient(ps.address, timeout=30) as client:
        for name, (first, rows) in tables.items():
            ids = np.arange(first, first + len(rows), dtype=np.int64)
            got = client.pull(f"dynemb_{name}", ids).rows
            np.testing.assert_array_equal(got, rows, err_msg=f"table {name}")


@pytest.mark.slow
def test_save_and_restore_onto_another_backend_bit_for_bit(embedded_client, redis_ps, tmp_path):
    a, b = unique("save_a"), unique("save_b")
    _, ids_a, rows_a = fill(embedded_client, a, "fp32", n=300, seed=3)
    _, ids_b, rows_b = fill(embedded_client, b, "bf16", n=40, dim=4, state_width=1, seed=4)
    snap = tmp_path / "snap"
    addr = embedded_client.addresses[0]
    res = dynemb("checkpoint", "save", "--ps", addr, "--table", a, "--table", b, "--out", str(snap), timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"saved 2 table(s) -> {snap}"
    assert f"save {a}" in res.stderr  # the progress bar
    res = dynemb("checkpoint", "inspect", str(snap), timeout=300)
    assert "(PS tables only: dynemb checkpoint save)" in res.stdout and f"  {a:<24} {300:>10}" in res.stdout

    # rows changed and added after the save are gone after a restore
    embedded_client.push(a, ids_a[:10], np.zeros_like(rows_a[:10]))
    embedded_client.push(a, np.array([12345], np.int64), np.ones((1, rows_a.shape[1]), np.float32))
    for target in (addr, redis_ps.address):
        res = dynemb("checkpoint", "restore", str(snap), "--ps", target, "--quiet", timeout=300)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [f"restored table {a}: 300 rows", f"restored table {b}: 40 rows"]
        with PSClient(target, timeout=30) as client:
            assert same_bits(client.pull(a, ids_a).rows, rows_a)
            assert same_bits(client.pull(b, ids_b).rows, rows_b)
            assert client.describe_table(a).num_rows == 300

    res = dynemb("checkpoint", "save", "--ps", addr, "--table", a, "--out", str(snap), timeout=300)
    assert res.returncode == 1 and "exists and is not empty" in res.stderr


def test_a_corrupt_checkpoint_or_a_schema_clash_writes_nothing(job, make_ps, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(job[0], ck)
    ps = make_ps()
    with PSClient(ps.address, timeout=30) as client:
        # a table of the checkpoint's name, another schema: refused before any table is written
        client.create_table("dynemb_t_4", dim=3, state_width=0)
        res = dynemb("checkpoint", "restore", str(ck / "step-00000020"), "--ps", ps.address, "--quiet", timeout=300)
        assert res.returncode == 1
        assert "table 'dynemb_t_4' exists on the PS with another schema" in res.stderr
        assert [t.schema.name for t in client.list_tables()] == ["dynemb_t_4"]

        shard = sorted((ck / "step-00000010" / "tables" / "t_0").glob("*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:-7])
        for args in (
            ["restore", str(ck / "step-00000020"), "--ps", ps.address],
            ["inspect", str(ck / "step-00000020"), "--verify"],
        ):
            res = dynemb("checkpoint", *args, "--quiet", timeout=300)
            assert res.returncode == 1, res.stdout
            last = res.stderr.strip().splitlines()[-1]
            assert last == f"dynemb: error: {shard}: sha256 differs from manifest.json (corrupt or changed)"
        assert [t.schema.name for t in client.list_tables()] == ["dynemb_t_4"]
