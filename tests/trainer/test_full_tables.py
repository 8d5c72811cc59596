"""Full (`--no-dynamic`) tables on file data (issue 21, bugs 1 and 2): IDs are signed 64-bit
hashes, mapped into a table's rows by id mod rows (the hashing trick), never looked up out of
bounds (FBGEMM reads row 0 instead, and the job trained garbage with exit 0); and ranks whose
lines do not split evenly stop together (one rank's extra batch waited forever for the others)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import learnable_tsv
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.trainer.full_tables import IDOutOfRange, check_in_rows, full_batches, hash_into_rows

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here


def _kjt(per_key: dict[str, list[int]]) -> KeyedJaggedTensor:
    """One ID per sample; every key has the same number of samples."""
    keys = list(per_key)
    values = [v for k in keys for v in per_key[k]]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.ones(len(values), dtype=torch.int32)
    )


def test_ids_are_hashed_into_the_rows_negative_ones_too():
    ids = [-1, -7, 0, 5, 9, 10, 123, 2**63 - 1, -(2**63), -4_611_686_018_427_387_905]
    kjt = hash_into_rows(_kjt({"cat_0": ids, "cat_1": list(range(10))}), 10)
    got = kjt["cat_0"].values().tolist()
    assert got == [v % 10 for v in ids]  # Python's mod: in [0, 10) for negative ids too
    assert all(0 <= v < 10 for v in got)
    assert kjt["cat_1"].values().tolist() == list(range(10))  # ids in range: unchanged
    assert kjt.keys() == ["cat_0", "cat_1"] and kjt.lengths().tolist() == [1] * 20


def test_rows_per_feature():
    kjt = hash_into_rows(_kjt({"cat_0": [-3, 7, 20], "cat_1": [-3, 7, 20]}), {"cat_0": 5, "cat_1": 100})
    assert kjt["cat_0"].values().tolist() == [2, 2, 0]
    assert kjt["cat_1"].values().tolist() == [97, 7, 20]


def test_an_id_outside_its_table_is_an_error_naming_table_id_and_rows():
    kjt = _kjt({"cat_0": [1, 2, 3], "cat_1": [4, 1000, 5]})
    check_in_rows(kjt, 1001)  # all in range
    with pytest.raises(IDOutOfRange, match=r"ID 1000 of feature cat_1 is outside table t_1's 1,000 rows"):
        check_in_rows(kjt, 1000, {"cat_0": "t_0", "cat_1": "t_1"})
    with pytest.raises(IDOutOfRange, match=r"ID -2 of feature cat_0 .* 1,000 rows"):
        check_in_rows(_kjt({"cat_0": [-2, 1]}), 1000)


def test_full_batches_map_every_batch():
    batch = Batch(
        dense_features=torch.zeros(3, 2),
        sparse_features=_kjt({"cat_0": [-1, 5, 17], "cat_1": [0, 1, 2]}),
        labels=torch.zeros(3),
    )
    (got,) = list(full_batches([batch], {"cat_0": 4, "cat_1": 4}))
    assert got.sparse_features["cat_0"].values().tolist() == [3, 1, 1]
    assert got.sparse_features["cat_1"].values().tolist() == [0, 1, 2]
    assert got.labels is batch.labels and got.dense_features is batch.dense_features


def _flags(*extra: str) -> list[str]:
    return [*"--no-dynamic --dim 8 --dense-arch 16,8 --over-arch 16,1 --no-progress".split(), *extra]


@pytest.mark.slow
def test_no_dynamic_trains_on_tsv_hashes(tmp_path):
    """`dynemb train --no-dynamic --source day.tsv`: the IDs (XXH64 hashes) find their rows, the
    job says how, and it learns the data (before: "Out of bounds ... Setting idx to zero" per
    batch, every ID on row 0, AUC 0.5)."""
    source = learnable_tsv(tmp_path / "day.tsv", 1600)
    out = tmp_path / "result.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynemb.trainer",
            *_flags("--source", source, "--universe", "1000", "--batch-size", "64", "--steps", "40"),
            *"--eval-fraction 0.2 --lr 0.2 --dense-lr 0.05 --result-json".split(),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Out of bounds" not in run.stderr + run.stdout
    assert "full tables: 1,000 rows each, IDs mapped by id mod 1,000 (hashing trick" in run.stderr
    got = json.loads(out.read_text())
    assert len(got["losses"]) == 20  # 1280 training lines: 20 batches, then the data ran out
    assert got["auc"] > 0.8, got


def _torchrun_train(*flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`dynemb train` on 2 torchrun ranks; a job that has not ended within `timeout` seconds
    fails the test, and its process group (torchrun and both ranks) is killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, *"-m torch.distributed.run --standalone --nproc_per_node=2 -m dynemb.trainer".split()]
    proc = subprocess.Popen(
        [*args, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the 2-rank job did not end within {timeout:.0f}s (hung); its stderr: {stderr[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("pipeline", ["--pipeline", "--no-pipeline"])
def test_uneven_ranks_stop_together_on_full_tables(tmp_path, pipeline):
    """2 ranks, batch 16, a 66-line file with every second line held out: 33 training lines and
    33 held-out ones. Rank 0 gets 17 of each (2 batches), rank 1 16 (1 batch); rank 0's extra
    batch of training and of evaluation is dropped with a warning, and the job ends (before:
    rank 0's second step waited forever in a collective rank 1 never joined)."""
    source = learnable_tsv(tmp_path / "day.tsv", 66)
    out = tmp_path / "result.json"
    run = _torchrun_train(
        *_flags("--source", source, "--universe", "500", "--batch-size", "16", "--steps", "10", pipeline),
        *"--eval-fraction 0.5 --result-json".split(),
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Out of bounds" not in run.stderr + run.stdout
    assert "rank 0 had 1 more training batch than another rank (1 sample): dropped, not trained on" in run.stderr
    assert "rank 0 had 1 more held-out batch than another rank (1 sample): dropped, not used" in run.stderr
    assert "rank 1 had" not in run.stderr
    got = json.loads(out.read_text())
    assert len(got["losses"]) == 1 and np.isfinite(got["losses"]).all() and np.isfinite(got["auc"])


def test_the_cli_says_an_id_out_of_range_in_one_line_from_its_rank():
    from dynemb.trainer.cli import _failure
    from dynemb.trainer.full_tables import IDOutOfRange

    assert _failure(IDOutOfRange("ID 9 of feature cat_0 is outside table t_0's 4 rows")) == (
        "ID 9 of feature cat_0 is outside table t_0's 4 rows",
        None,  # this rank's data: it reports, naming itself
    )
