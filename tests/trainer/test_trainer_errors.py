"""A training job's errors as its user sees them, from real torchrun ranks over a real PS
process: one line (rank 0's), no traceback of the job's, and the checkpoint's settings checked
before the PS's tables; a rerun on a PS that holds its tables' rows refuses to start unless
--warm-start or --fresh says what to do with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynemb.ps_server.client import PSClient
from dynemb.trainer.config import TrainConfig

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

# a job that trains in seconds: 3 small tables, 6 steps
FLAGS = (
    "--steps 6 --num-sparse 3 --universe 1000 --capacity-fraction 0.5 --dim 8 --dense-arch 16,8 --over-arch 16,1 "
    "--batch-size 16 --eval-batches 1 --log-every 1 --no-progress"
).split()


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m dynemb.trainer ARGS`, as a user runs the job; one rank as
    `python -m dynemb.trainer ARGS` (no launcher: it would cost a torch import and no check)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    return subprocess.run(
        [sys.executable, *launcher, "-m", "dynemb.trainer", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def _our_tracebacks(stderr: str) -> list[str]:
    """Tracebacks but torchrun's own: its launcher raises ChildFailedError (and Python prints
    that) whenever a rank exits non-zero; the ranks' would be prefixed [rankN]."""
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return [b for b in blocks if "ChildFailedError" not in b] + [
        line for line in stderr.splitlines() if "[rank" in line
    ]


def _losses(path: Path) -> list[float]:
    return json.loads(path.read_text())["losses"]


@pytest.mark.dist
def test_a_resume_with_another_optimizer_is_one_line_from_rank_0(tmp_path, make_ps):
    """The issue's case: resuming an adagrad run's checkpoint with --optimizer adam on the PS
    that run left its (adagrad) tables on. The checkpoint's check comes first and says what
    differs, once, where the PS's TableExists used to end three tracebacks."""
    ps = make_ps()
    ck = tmp_path / "ck"
    job = [*FLAGS, "--ps", ps.address, "--checkpoint-dir", str(ck)]
    first = _torchrun(*job, "--optimizer", "adagrad", "--checkpoint-at-end", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]

    resumed = _torchrun(*job, "--optimizer", "adam", "--resume", "latest")
    assert resumed.returncode != 0
    assert _errors(resumed.stderr) == [
        f"dynemb: error: {ck / 'step-00000006'}: optimizer adagrad, this job's is adam "
        f"(resume with --optimizer adagrad, or start a new run without --resume)"
    ], resumed.stderr[-6000:]
    assert _our_tracebacks(resumed.stderr) == [], resumed.stderr[-6000:]


@pytest.mark.dist
def test_a_rerun_on_the_same_ps_refuses_unless_told_what_to_do_with_the_rows(tmp_path, make_ps):
    """The issue's rerun that silently warm-started: refused in one line, then each way out
    (and a table of another schema named with the flags that help). The rerun that is refused
    runs on 2 ranks (one line, rank 0's); the others on one, as the tables are the same."""
    ps = make_ps()
    job = [*FLAGS, "--ps", ps.address, "--optimizer", "adagrad"]
    first = _torchrun(*job, "--result-json", str(tmp_path / "first.json"), nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    with PSClient(ps.address, timeout=30) as client:
        rows = {t.schema.name: t.num_rows for t in client.list_tables()}
    assert sorted(rows) == ["dynemb_t_0", "dynemb_t_1", "dynemb_t_2"] and all(rows.values()), rows

    again = _torchrun(*job)
    assert again.returncode != 0
    assert _errors(again.stderr) == [
        f"dynemb: error: the PS {ps.address} already holds {sum(rows.values()):,} rows in 3 of this job's "
        f"tables (dynemb_t_0, dynemb_t_1, dynemb_t_2), left by an earlier run: --warm-start trains on from "
        f"them, --fresh drops them first, --resume continues from a checkpoint, --ps-table-prefix gives "
        f"this job tables of its own"
    ], again.stderr[-6000:]
    assert _our_tracebacks(again.stderr) == [], again.stderr[-6000:]

    warm = _torchrun(*job, "--warm-start", "--result-json", str(tmp_path / "warm.json"), nproc=1)
    assert warm.returncode == 0, warm.stderr[-3000:]
    # the same job from the rows the first left: embeddings trained on, so other losses
    assert _losses(tmp_path / "warm.json") != _losses(tmp_path / "first.json")

    fresh = _torchrun(*job, "--fresh", "--result-json", str(tmp_path / "fresh.json"), nproc=1)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "--fresh: dropped 3 tables" in fresh.stderr
    # from fresh tables again: the first run's very losses, neither run's rows left behind
    assert _losses(tmp_path / "fresh.json") == _losses(tmp_path / "first.json")

    # tables of another schema (another optimizer's) are no tables to train on, rows or none
    other = _torchrun(*job, "--optimizer", "adam", "--warm-start", nproc=1)
    assert other.returncode != 0
    (line,) = _errors(other.stderr)
    assert line.startswith(f"dynemb: error: the PS {ps.address} holds a table dynemb_t_0 with another schema"), line
    assert "state_width 8 there, 16 for this job (--optimizer)" in line and "--ps-table-prefix" in line, line
    assert "--fresh" in line and _our_tracebacks(other.stderr) == [], other.stderr[-6000:]


def test_warm_start_and_fresh_exclude_each_other():
    with pytest.raises(ValueError, match="warm_start and fresh exclude each other"):
        TrainConfig(warm_start=True, fresh=True)
    done = subprocess.run(
        [sys.executable, "-m", "dynemb.trainer", "--warm-start", "--fresh"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "dynemb train: error: warm_start and fresh exclude each other: keep the PS's rows or drop them, not both"
    ]
