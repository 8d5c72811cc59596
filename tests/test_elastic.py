"""torchrun elastic (`--nnodes 1:2`, c10d rendezvous, `--max-restarts`) with `--resume auto`:
two agents of one rank each train; one agent (a node) is killed right after the step-10
checkpoint; the other agent's rank fails on the lost peer, the agent restarts it, the new
rendezvous has one node, and the job goes on from step 10 at world size 1 to the end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dynemb.testing.local_ps import REPO
from dynemb.trainer.checkpoint_format import checkpoints, read_manifest
from dynemb.trainer.table_files import TableReader

WORKER = Path(__file__).parent / "dist" / "elastic_worker.py"
FLAGS = (
    "--steps 40 --num-sparse 6 --universe 6000 --ids-per-feature 2 --dim 8 --capacity-fraction 0.1 "
    "--evict-fraction 0.1 --batch-size 48 --dense-arch 16,8 --over-arch 16,1 --eval-batches 2 "
    "--optimizer adagrad --no-progress --checkpoint-every 10 --resume auto"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def table_ids(folder: Path, name: str) -> np.ndarray:
    return np.sort(np.concatenate([ids for ids, _, _ in TableReader(folder / "tables" / name).chunks()]))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_goes_away_and_the_job_resumes_at_the_smaller_size(tmp_path):
    ck = tmp_path / "ck"
    # the host agent (it keeps the rendezvous store) survives; a dead node's heartbeat is
    # missed after 2 s; the rendezvous waits 15 s for more nodes once it has the minimum
    conf = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=15"
    port = free_port()

    def agent(is_host: int, restarts: int, **env: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            str(restarts),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"localhost:{port}",
            "--rdzv-id",
            "elastic-test",
            "--rdzv-conf",
            f"is_host={is_host},{conf}",
            str(WORKER),
            *FLAGS,
            "--checkpoint-dir",
            str(ck),
            "--result-json",
            str(tmp_path / f"result-{is_host}.json"),
        ]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    stays = agent(1, restarts=2)
    time.sleep(1)  # the host agent's store up first
    goes = agent(0, restarts=0, DYNEMB_TEST_NODE_DIES_AFTER="10")
    try:
        out, err = stays.communicate(timeout=800)
    finally:
        for p in (stays, goes):
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert goes.returncode == -9  # SIGKILL: the node went away
    assert stays.returncode == 0, out[-3000:] + err[-6000:]
    assert "another rank of the job is gone" in err
    assert "resuming from " + str(ck / "step-00000010") + " (step 10, 2 ranks) on 1 rank" in err
    assert "steps 30 (resumed at step 10)" in out
    losses = json.loads((tmp_path / "result-1.json").read_text())["losses"]
    assert len(losses) == 30 and np.isfinite(losses).all()
    saved = {c.name: read_manifest(c) for c in checkpoints(ck)}
    assert [(n, d["world_size"]) for n, d in saved.items()] == [
        ("step-00000010", 2),
        ("step-00000020", 1),
        ("step-00000030", 1),
    ]
    # the data went on from the same global sample: 2 ranks x 10 steps x 48 = batch 20 of 1 rank
    assert saved["step-00000020"]["samples"] == saved["step-00000010"]["samples"] + 10 * 48
    for name in saved["step-00000010"]["tables"]:  # no row lost: every ID of step 10 is still there
        before, after = table_ids(ck / "step-00000010", name), table_ids(ck / "step-00000020", name)
        assert len(before) and np.isin(before, after).all(), name
