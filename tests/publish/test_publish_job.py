"""Versions cut from a training job (dynemb.publish.publish_tables) on 1 and 2 torchrun ranks,
over a PS on the embedded store and on Redis: each version's chain is the PS's rows at its cut,
bit for bit, with training, evictions and deletions between versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import torchrun

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

WORKER = Path(__file__).parent / "publish_worker.py"


@pytest.mark.dist
@pytest.mark.parametrize("ranks,backend", [(1, "embedded"), (2, "redis")])
def test_versions_of_a_training_job_are_the_ps_rows_at_each_cut(ranks, backend, tmp_path, make_ps, request):
    flags = ()
    if backend == "redis":
        flags = (
            "--backend",
            request.getfixturevalue("redis_url"),
            "--namespace",
            request.getfixturevalue("redis_namespace"),
        )
    ps = make_ps(*flags)
    done = torchrun(ranks, WORKER, str(tmp_path), ps.address)
    assert done.returncode == 0, done.stderr[-4000:]
    checks = json.loads((tmp_path / "result.json").read_text())
    assert [(c["table"], c["number"], c["kind"]) for c in checks] == [
        (t, n, "full" if n == 1 else "delta") for n in (1, 2, 3) for t in ("user", "item")
    ]
    assert all(c["exact"] for c in checks), checks
    assert all(c["flushed_all"] and c["pushed_again"] == 0 and c["resident"] > 0 for c in checks), checks
    assert all(c["deleted"] > 0 for c in checks if c["number"] > 1)  # the deletions between versions
    assert all(0 < c["rows"] <= c["stored"] for c in checks if c["number"] > 1)


@pytest.mark.dist
def test_the_training_job_publishes_by_time_and_at_the_end(tmp_path, make_ps):
    """`dynemb train --publish-to DIR --publish-every-seconds S --publish-at-end` on 2 ranks, as a
    user runs it: rank 0 looks every --log-every steps, and every rank publishes when it says."""
    import os
    import subprocess
    import sys

    from dynemb.publish import chain
    from dynemb.trainer.config import TrainConfig

    ps = make_ps()
    flags = (
        "--steps 10 --num-sparse 2 --universe 1000 --capacity-fraction 0.3 --dim 8 --dense-arch 16,8 "
        "--over-arch 16,1 --batch-size 16 --eval-batches 1 --no-progress"
    ).split()
    root = tmp_path / "published"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dynemb.trainer",
         *flags, "--ps", ps.address, "--publish-to", str(root), "--publish-every-seconds", "0.001",
         "--log-every", "4", "--publish-at-end", "--publish-dtype", "fp16"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    for table in ("dynemb_t_0", "dynemb_t_1"):
        versions = chain(root, table)
        assert [(v.number, v.kind, v.step, v.dtype) for v in versions] == [
            (1, "full", 4, "fp16"), (2, "delta", 8, "fp16"), (3, "delta", 10, "fp16")
        ]  # fmt: skip
    assert "step 8: published dynemb_t_0 v2 (delta, " in done.stderr
    with pytest.raises(ValueError, match="publish_to needs ps"):
        TrainConfig(publish_to=str(root))
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(ps="x:1", publish_to=str(root), publish_every=3, publish_every_seconds=1)


def test_the_training_job_publishes_every_n_steps(tmp_path, make_ps):
    from helpers import config

    from dynemb.publish import chain
    from dynemb.trainer.train import train

    ps = make_ps()
    root = tmp_path / "published"
    result = train(config("adagrad", dynamic=True, steps=10, ps=ps.address, publish_to=str(root), publish_every=5))
    assert result.versions == [(5, {f"t_{i}": 1 for i in range(6)})]  # none at the end: not asked
    assert [v.kind for v in chain(root, "dynemb_t_0")] == ["full"]
