"""torchrun elastic (`--nnodes 1:2`, c10d rendezvous) with `--resume auto`, both ways:

- a node goes away: two agents of one rank each train; one agent (a node) is killed right after
  the step-10 checkpoint; the other agent's rank fails on the lost peer, the agent restarts it
  (`--max-restarts`), the new rendezvous has one node, and the job goes on from step 10 at
  world size 1 to the end;
- a node joins: one agent trains alone; a second one arrives, the first agent restarts its rank
  (a membership change: not counted against --max-restarts), and the job goes on at world size
  2 from the newest complete checkpoint, row for row as a 2-rank job resumed from it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TESTS, torchrun

from dynemb.checkpoint.format import checkpoints, read_manifest
from dynemb.checkpoint.table_files import TableReader
from dynemb.testing.local_ps import REPO

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here

WORKER = TESTS / "dist" / "elastic_worker.py"
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
    # missed after 3 s (a beat goes out once the last is 1 s old, so live beats can come ~2 s
    # apart: 2 attempts could take a live node for dead); the rendezvous waits 15 s for more
    # nodes once it has the minimum
    conf = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=15"
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


GROW_FLAGS = [
    *FLAGS[2 : FLAGS.index("--checkpoint-every")],  # all but --steps 40 and the checkpoints
    *"--steps 30 --checkpoint-every 5 --checkpoint-keep 10 --checkpoint-at-end --resume auto".split(),
]


def elastic_agent(port: int, is_host: int, out: Path, name: str, flags: list[str], **env: str) -> subprocess.Popen:
    """A torchrun agent of the `--nnodes 1:2` c10d job on `port` (one rank), its output in
    out/<name>.out and .err: a round of the rendezvous starts 1 s after its first node came.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: else a node that joins waits forever for the
    workers' store address, which the running agent does not publish again (torch 2.13)."""
    conf = f"is_host={is_host},last_call_timeout=1"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"),
        *("--max-restarts", "0", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "grow-test", "--rdzv-conf", conf),
        *(str(WORKER), *flags, "--result-json", str(out / f"{name}-rank{{rank}}.json")),
    ]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env)
    with open(out / f"{name}.out", "w") as stdout, open(out / f"{name}.err", "w") as stderr:
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=stdout, stderr=stderr, text=True)


def wait_for(path: Path, agents: list[subprocess.Popen], seconds: float) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert all(a.poll() is None for a in agents), f"an agent ended before {path} appeared"
        assert time.monotonic() < end, f"no {path} after {seconds} s"
        time.sleep(0.2)


def table_rows(folder: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A table of a checkpoint: its IDs ascending, and their rows (embedding and optimizer state)."""
    parts = [(ids, np.concatenate([e, s], axis=1)) for ids, e, s in TableReader(folder / "tables" / name).chunks()]
    ids, rows = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    order = np.argsort(ids)
    return ids[order], rows[order]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ps", ["", "process"], ids=["in-process-rows", "ps-process"])
def test_a_node_joins_and_the_job_goes_on_at_the_larger_size(tmp_path, ps):
    """Agent A trains alone (world size 1), checkpoints at steps 5 and 10, and is cut off in the
    middle of its step-15 checkpoint (manifest written, folder not yet renamed) when agent B
    arrives: A's agent sees a node waiting and restarts its rank, and the job goes on at world
    size 2 from step 10, the newest complete checkpoint, to step 30. Its final checkpoint is
    row for row what a 2-rank job resumed from that step-10 checkpoint computes. The rows: in
    each rank's process, or on a PS the ranks share (there the restarted ranks find the rows
    that A's rank left, and the checkpoint's replace them)."""
    from dynemb.testing.local_ps import LocalPS

    with contextlib.ExitStack() as stack:
        job_ps = ["--ps", stack.enter_context(LocalPS()).address] if ps else []
        reference_ps = ["--ps", stack.enter_context(LocalPS()).address] if ps else []
        grow(tmp_path, job_ps, reference_ps)


def grow(tmp_path: Path, ps_flags: list[str], ref_ps_flags: list[str]) -> None:
    ck = tmp_path / "ck"
    flags = [*GROW_FLAGS, *ps_flags, "--checkpoint-dir", str(ck)]
    port = free_port()
    a = elastic_agent(port, 1, tmp_path, "a", flags, DYNEMB_TEST_ALONE_CUT_AT="15")
    agents = [a]
    try:
        wait_for(ck / "step-00000015.partial" / "manifest.json", agents, 600)
        agents.append(elastic_agent(port, 0, tmp_path, "b", flags))
        for p in agents:
            p.wait(timeout=600)
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = "".join((tmp_path / f"{n}.out").read_text() for n in "ab")
    err = "".join((tmp_path / f"{n}.err").read_text() for n in "ab")
    assert [p.returncode for p in agents] == [0, 0], out[-3000:] + err[-8000:]
    # A's agent stopped its rank for B (torchrun logs the "Detected 1 new nodes" at INFO only)
    assert "closing signal SIGTERM" in (tmp_path / "a.err").read_text()
    # not a failure's restart. At the end the host agent (A, holding the rendezvous store) may
    # exit before B's agent closes the rendezvous: B then logs that it could not (a warning, with
    # the store's connection trace) and still exits 0, as torchrun does at any job's end
    closing = "has failed to shutdown the rendezvous"
    assert "failed (exitcode" not in err, err[-8000:]
    assert not [line for line in err.splitlines() if "error" in line and closing not in line], err[-8000:]
    assert "--resume auto: no checkpoint in" in err  # A's first start
    assert f"resuming from {ck / 'step-00000010'} (step 10, 1 rank) on 2 ranks" in err, err[-8000:]
    assert "steps 20 (resumed at step 10)" in out
    saved = {c.name: read_manifest(c) for c in checkpoints(ck)}
    assert [(n, d["world_size"]) for n, d in saved.items()] == [
        ("step-00000005", 1),
        ("step-00000010", 1),
        ("step-00000015", 2),
        ("step-00000020", 2),
        ("step-00000025", 2),
        ("step-00000030", 2),
    ]
    assert not list(ck.glob("*.partial"))  # the cut-off one was written again, whole
    # the data went on from the same global sample: 10 steps x 48 = 5 steps of 2 ranks x 48
    assert saved["step-00000015"]["samples"] == saved["step-00000010"]["samples"] + 5 * 2 * 48
    # the reference: a 2-rank job resumed from the same step-10 checkpoint, without elastic agents
    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copytree(ck / "step-00000010", ref / "step-00000010")
    done = torchrun(
        2,
        WORKER,
        *GROW_FLAGS[:-2],
        *ref_ps_flags,
        "--checkpoint-dir",
        str(ref),
        "--resume",
        str(ref / "step-00000010"),
        "--result-json",
        str(tmp_path / "ref-rank{rank}.json"),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in range(2):
        got = json.loads(next(tmp_path.glob(f"[ab]-rank{rank}.json")).read_text())["losses"]
        want = json.loads((tmp_path / f"ref-rank{rank}.json").read_text())["losses"]
        assert len(got) == 20 and np.isfinite(got).all() and got == want, rank
    for name in saved["step-00000010"]["tables"]:
        before, _ = table_rows(ck / "step-00000010", name)
        ids, rows = table_rows(ck / "step-00000030", name)
        assert len(before) and np.isin(before, ids).all(), name  # no row of step 10 lost
        want_ids, want_rows = table_rows(ref / "step-00000030", name)
        np.testing.assert_array_equal(ids, want_ids, err_msg=name)
        np.testing.assert_array_equal(rows, want_rows, err_msg=name)  # rows with optimizer state
