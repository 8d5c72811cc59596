"""Faults injected into real processes during training: a PS killed with SIGKILL and started
again on its address, a PS paused (SIGSTOP) past the trainer's per-try deadline. The trainer
retries, carries on, and ends with the same losses and the same PS tables, bit for bit, as a
run of the same seed without the fault: no acknowledged push is lost, no stale one wins.
Redis itself restarted (AOF on) mid-training: the PS says NOT_SERVING meanwhile, recovers by
itself, and the tables are again those of an unfaulted run.
A torchrun rank killed with SIGKILL stops the job; resumed from its last checkpoint, the job
ends with the losses and tables of an unfaulted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
from helpers import job_tables, pause, wait_until
from ps_procs import wait_for_health

from dynemb.ps_server.client import PSClient
from dynemb.testing.local_ps import REPO, LocalPS
from dynemb.testing.local_redis import RedisProcess

pytestmark = pytest.mark.slow

STEPS = 120
TRAIN = [
    "--steps",
    str(STEPS),
    *(
        "--num-sparse 4 --universe 4000 --ids-per-feature 2 --dim 8 "
        "--capacity-fraction 0.1 --evict-fraction 0.1 --batch-size 48 "
        "--dense-arch 16,8 --over-arch 16,1 --eval-batches 2 --optimizer adagrad "
        "--no-progress --ps-attempt-seconds 1 --ps-timeout-seconds 120"
    ).split(),
]


def start_training(ps: LocalPS, out, prefix: str, target: str | None = None) -> subprocess.Popen:
    """The job, on `ps` (or on `target`, a --ps value); its stderr in a file (see stderr_of),
    readable while it runs."""
    with open(out / f"{prefix}.stderr", "w") as err:
        job = subprocess.Popen(
            [
                sys.executable,
                *"-m dynemb.cli train --ps".split(),
                target or ps.address,
                "--ps-table-prefix",
                prefix,
                "--result-json",
                str(out / f"{prefix}.json"),
                *TRAIN,
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    job.stderr_path = out / f"{prefix}.stderr"
    return job


def stderr_of(job: subprocess.Popen) -> str:
    return job.stderr_path.read_text(errors="replace")


def wait_for_log(job: subprocess.Popen, line: str) -> None:
    """Until the job has logged `line` (it met the fault and retries), still running."""
    wait_until(lambda: line in stderr_of(job) or job.poll() is not None, timeout=60, what=repr(line), interval=0.1)
    assert job.poll() is None, f"the trainer gave up during the fault: {stderr_of(job)[-3000:]}"


def pushed_rows(address: str) -> int:
    with PSClient(address, timeout=5) as client:
        return sum(int(t.num_rows) for t in client.list_tables())


def pushes_served(ps: LocalPS) -> float:
    """Push and PushMany calls `ps` answered OK (the trainer pushes evicted rows with PushMany)."""
    text = ps.metrics_text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(
            (
                'dynemb_ps_requests_total{code="OK",method="Push"}',
                'dynemb_ps_requests_total{code="OK",method="PushMany"}',
            )
        )
    )


def wait_for_rows(ps: LocalPS, job: subprocess.Popen, at_least: int, timeout: float = 120) -> None:
    """Until the job has pushed rows (it is mid-training, its tables evicting)."""
    wait_until(
        lambda: pushed_rows(ps.address) >= at_least or job.poll() is not None,
        timeout=timeout,
        what="training to push rows",
        interval=0.2,
    )
    assert job.poll() is None, f"training ended before the fault: {stderr_of(job)[-3000:]}"


@pytest.fixture
def redis_ps(redis_url):
    """A PS over Redis (rows outlive the PS process); stopped at the end."""
    namespace = f"faults{uuid.uuid4().hex[:8]}"
    made: list[LocalPS] = []

    def make(*extra: str) -> LocalPS:
        ps = LocalPS("--backend", redis_url, "--namespace", namespace, "--not-serving-seconds", "0", *extra).start()
        made.append(ps)
        return ps

    yield make
    for ps in made:
        ps.close()


def finish(job: subprocess.Popen) -> str:
    job.wait(timeout=600)
    err = stderr_of(job)
    assert job.returncode == 0, err[-4000:]
    return err


def compare_with_unfaulted(tmp_path, ps: LocalPS, faulted: str) -> None:
    clean = start_training(ps, tmp_path, "clean_")
    finish(clean)
    got = json.loads((tmp_path / f"{faulted}.json").read_text())
    want = json.loads((tmp_path / "clean_.json").read_text())
    assert len(got["losses"]) == STEPS
    assert got["losses"] == want["losses"] and got["auc"] == want["auc"]
    a, b = job_tables(ps.address, faulted), job_tables(ps.address, "clean_")
    assert a.keys() == b.keys() and len(a) == 4
    for name in a:
        np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=f"ids of {name}")
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=f"rows of {name}")


@pytest.mark.torchrec
def test_a_ps_killed_mid_training_and_restarted_loses_nothing(redis_ps, tmp_path):
    ps = redis_ps()
    port = ps.port
    job = start_training(ps, tmp_path, "killed_")
    wait_for_rows(ps, job, at_least=200)
    ps.stop(signal.SIGKILL)
    wait_for_log(job, "UNAVAILABLE; retrying")  # its calls fail and back off meanwhile
    ps = redis_ps("--address", f"127.0.0.1:{port}")  # the same address, the same Redis
    finish(job)
    compare_with_unfaulted(tmp_path, ps, "killed_")


@pytest.mark.torchrec
def test_a_paused_ps_past_the_try_deadline_loses_nothing(redis_ps, tmp_path):
    ps = redis_ps()
    job = start_training(ps, tmp_path, "paused_")
    wait_for_rows(ps, job, at_least=200)
    pause(ps.proc.pid)
    try:  # past --ps-attempt-seconds 1: a try is abandoned and sent again
        wait_for_log(job, "DEADLINE_EXCEEDED; retrying")
    finally:
        os.kill(ps.proc.pid, signal.SIGCONT)
    finish(job)
    compare_with_unfaulted(tmp_path, ps, "paused_")


@pytest.mark.torchrec
def test_a_ps_replica_killed_mid_training_fails_over_to_another(redis_ps, tmp_path):
    first, second = redis_ps(), redis_ps()  # two PS processes over the same Redis and namespace
    replicas = f"{first.address}|{second.address}"
    job = start_training(first, tmp_path, "replica_", target=replicas)
    wait_for_rows(first, job, at_least=200)
    assert pushes_served(first) > 0  # the job was on the first replica until the kill
    served_before = pushes_served(second)
    first.stop(signal.SIGKILL)  # and not started again
    # No check for the client's "UNAVAILABLE; retrying" line: gRPC's pick_first moves to the
    # live replica by itself, so that line is logged only if a call happened to be in flight
    # at the kill (the Redis restart test below checks the retry path).
    finish(job)
    assert pushes_served(second) > served_before  # the rest of the job went to the other replica
    compare_with_unfaulted(tmp_path, second, "replica_")


@pytest.mark.torchrec
def test_redis_restarted_mid_training_loses_nothing(tmp_path):
    """Redis as the docs set it up for production: AOF on, fsync every second. A restart
    (SIGTERM: Redis writes its AOF out and exits) while trainers push."""
    store = RedisProcess(["appendonly yes", "appendfsync everysec"]).start()
    ps = LocalPS(
        "--backend", store.url, "--namespace", "aof", "--not-serving-seconds", "0", "--backend-check-seconds", "0.2"
    )
    try:
        ps.start()
        job = start_training(ps, tmp_path, "redis_")
        wait_for_rows(ps, job, at_least=200)
        store.stop()
        with PSClient(ps.address, timeout=5) as client:
            wait_for_health(client, "NOT_SERVING")  # probes see the PS cannot serve
        wait_for_log(job, "UNAVAILABLE; retrying")  # the trainer's calls fail and back off meanwhile
        store.start()  # the same port and folder: the AOF is loaded again
        with PSClient(ps.address, timeout=5) as client:
            wait_for_health(client, "SERVING")  # by itself
        finish(job)
        compare_with_unfaulted(tmp_path, ps, "redis_")
    finally:
        ps.close()
        store.close()


# -- a trainer rank killed ---------------------------------------------------------

# capacity: room for the 4 batches in flight at a transform (the pipeline's 3, one transformed ahead)
RANKED = [
    *(
        "--steps 60 --num-sparse 4 --universe 4000 --ids-per-feature 2 --dim 8 "
        "--capacity-fraction 0.2 --evict-fraction 0.1 --batch-size 32 "
        "--dense-arch 16,8 --over-arch 16,1 --eval-batches 2 --optimizer adam "
        "--no-progress --checkpoint-every 10 --checkpoint-at-end"
    ).split(),
]


def torchrun_training(ck, out, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [
            sys.executable,
            *("-m torch.distributed.run --standalone --nproc_per_node=2 -m dynemb.trainer").split(),
            *RANKED,
            "--checkpoint-dir",
            str(ck),
            "--result-json",
            str(out / "rank{rank}.json"),
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rank_pid(launcher: int, local_rank: int) -> int | None:
    """The pid of a torchrun worker, by its LOCAL_RANK (read from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return int(entry)
    return None


def final_tables(folder) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    from dynemb.checkpoint.table_files import TableReader

    out = {}
    for table in sorted((folder / "tables").iterdir()):
        ids, emb, state = (np.concatenate(parts) for parts in zip(*TableReader(table).chunks()))
        order = np.argsort(ids)
        out[table.name] = (ids[order], emb[order], state[order])
    return out


@pytest.mark.dist
@pytest.mark.torchrec
def test_a_killed_rank_stops_the_job_and_a_restart_from_the_checkpoint_ends_the_same(tmp_path):
    from dynemb.checkpoint.format import checkpoints, read_manifest

    (tmp_path / "clean").mkdir()
    (tmp_path / "faulted").mkdir()
    clean = torchrun_training(tmp_path / "clean" / "ck", tmp_path / "clean")
    out, err = clean.communicate(timeout=600)
    assert clean.returncode == 0, err[-4000:]

    ck = tmp_path / "faulted" / "ck"
    job = torchrun_training(ck, tmp_path / "faulted")
    # killed after its first checkpoint, mid-training
    wait_until(lambda: checkpoints(ck) or job.poll() is not None, timeout=300, what="a checkpoint", interval=0.2)
    assert job.poll() is None, job.communicate()[1][-4000:]
    victim = rank_pid(job.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = job.communicate(timeout=300)  # torchrun stops the other rank and exits: no hang
    assert job.returncode != 0
    assert "SIGKILL" in err or "Signal 9" in err, err[-3000:]
    saved = checkpoints(ck)
    assert saved
    at = read_manifest(saved[-1])["step"]
    assert at < 60  # it did not get to the end

    resumed = torchrun_training(ck, tmp_path / "faulted", "--resume", "latest")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-4000:]
    assert f"resumed at step {at}" in out + err
    for rank in range(2):
        want = json.loads((tmp_path / "clean" / f"rank{rank}.json").read_text())
        got = json.loads((tmp_path / "faulted" / f"rank{rank}.json").read_text())
        assert got["losses"] == want["losses"][at:], f"rank {rank}"
        assert got["auc"] == want["auc"]
    a = final_tables(tmp_path / "clean" / "ck" / "step-00000060")
    b = final_tables(ck / "step-00000060")
    assert a.keys() == b.keys() and len(a) == 4
    for name in a:
        for x, y in zip(a[name], b[name]):
            np.testing.assert_array_equal(x, y, err_msg=f"table {name}")
