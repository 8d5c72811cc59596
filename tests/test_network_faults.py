"""Network faults between real processes, made by a fault-injecting TCP proxy in the test
(dynemb/testing/fault_proxy.py) put between them: a trainer cut off from its PS, a PS cut off
from Redis, a slow and lossy link under bench/ps_load.py. What each must show: a step that
fails says so in one line naming the PS and a resume loses nothing; health follows the store
and no acknowledged row is lost; a bad link costs latency, never an error."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from helpers import wait_until
from ps_procs import wait_for_health

from dynemb.checkpoint.format import checkpoints, read_manifest
from dynemb.ps_server.client import PSClient, RetryPolicy
from dynemb.ps_server.errors import PSError
from dynemb.testing.fault_proxy import FaultProxy
from dynemb.testing.local_ps import REPO

pytestmark = pytest.mark.slow

# -- a trainer cut off from its PS --------------------------------------------------------

STEPS = 30
# a PS call is tried for 1 s at a time and given up on after 4 s: a cut of 2 s is waited out,
# a longer one fails the step
TRAIN = (
    f"--steps {STEPS} --num-sparse 3 --universe 1000 --capacity-fraction 0.2 --evict-fraction 0.1 --dim 8 "
    "--dense-arch 16,8 --over-arch 16,1 --batch-size 16 --eval-batches 1 --no-progress --optimizer adagrad "
    "--checkpoint-every 5 --ps-attempt-seconds 1 --ps-timeout-seconds 4"
).split()
DEADLINE_S = 4.0


def train(ps_address: str, prefix: str, out, *extra: str, log: str = "") -> subprocess.Popen:
    """`dynemb train` on the PS at ps_address, tables prefixed `prefix`, checkpoints in out/prefix;
    its stderr in out/{log or prefix}stderr."""
    err = open(out / f"{log or prefix}stderr", "w")  # a file: readable while the job runs
    job = subprocess.Popen(
        [sys.executable, "-m", "dynemb.cli", "train", "--ps", ps_address, "--ps-table-prefix", prefix]
        + ["--checkpoint-dir", str(out / f"{prefix}ck"), "--result-json", str(out / f"{prefix}json"), *TRAIN, *extra],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    err.close()
    return job


def stderr_of(out, prefix: str) -> str:
    return (out / f"{prefix}stderr").read_text(errors="replace")


def ps_tables(address: str, prefix: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every table of the job on the PS, sorted by id: {name without prefix: (ids, rows)}."""
    out = {}
    with PSClient(address, timeout=60) as client:
        for info in client.list_tables():
            name = info.schema.name
            if name.startswith(prefix):
                chunks = list(client.export(name))
                ids = np.concatenate([c[0] for c in chunks])
                order = np.argsort(ids)
                out[name[len(prefix) :]] = (ids[order], np.concatenate([c[1] for c in chunks])[order])
    return out


def test_a_trainer_cut_off_from_its_ps_fails_in_one_line_and_resumes_losing_nothing(make_ps, tmp_path):
    """A cut shorter than the trainer's PS deadline is waited out; a longer one fails the job
    with one line naming the PS, soon after the deadline (no hang); resumed from its last
    checkpoint once the link is back, the job ends with the losses and PS tables of a run
    that never met a fault, bit for bit."""
    ps = make_ps()
    with FaultProxy("127.0.0.1", ps.port) as link:
        clean = train(ps.address, "clean_", tmp_path)  # alongside, straight to the PS
        job = train(link.address, "cut_", tmp_path)
        ck = tmp_path / "cut_ck"

        def at_checkpoint(n: int) -> None:
            wait_until(lambda: len(checkpoints(ck)) >= n or job.poll() is not None, timeout=120, what="a checkpoint")
            assert job.poll() is None, f"the job ended before the cut: {stderr_of(tmp_path, 'cut_')[-3000:]}"

        at_checkpoint(1)
        link.cut()  # half the deadline: waited out
        time.sleep(DEADLINE_S / 2)
        link.heal()
        at_checkpoint(2)
        assert job.poll() is None, stderr_of(tmp_path, "cut_")[-3000:]
        assert "DEADLINE_EXCEEDED; retrying" in stderr_of(tmp_path, "cut_")  # it met the cut, and waited

        link.cut()  # past the deadline: the step fails
        cut_at = time.monotonic()
        code = job.wait(timeout=60)
        failed_after = time.monotonic() - cut_at
        err = stderr_of(tmp_path, "cut_")
        assert code != 0, err[-3000:]
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and link.address in errors[0], err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        # the deadline twice (the step's call, then the push of the resident rows it tries before
        # exiting: 9.7 s seen), and the job's own exit
        assert failed_after < 2 * DEADLINE_S + 5, f"failed {failed_after:.1f} s after the cut: {errors[0]}"

        link.heal()
        at = read_manifest(checkpoints(ck)[-1])["step"]
        assert 10 <= at < STEPS
        resumed = train(link.address, "cut_", tmp_path, "--resume", "latest", log="resumed_")
        assert resumed.wait(timeout=300) == 0, stderr_of(tmp_path, "resumed_")[-3000:]
        assert clean.wait(timeout=300) == 0, stderr_of(tmp_path, "clean_")[-3000:]

    got = json.loads((tmp_path / "cut_json").read_text())
    want = json.loads((tmp_path / "clean_json").read_text())
    assert got["losses"] == want["losses"][at:] and got["auc"] == want["auc"]
    a, b = ps_tables(ps.address, "cut_"), ps_tables(ps.address, "clean_")
    assert a.keys() == b.keys() and len(a) == 3
    for name in a:
        np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=f"ids of {name}")
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=f"rows of {name}")
    print(f"\ntrainer <-> PS cut past the {DEADLINE_S:g} s deadline: failed {failed_after:.1f} s in: {errors[0]}")


# -- a PS cut off from Redis ----------------------------------------------------------------


def redis_ps(make_ps, link: FaultProxy, query: str = ""):
    """A PS over the Redis behind `link`, checking it every 0.2 s."""
    url = f"redis://{link.address}/0{query}"
    return make_ps("--backend", url, "--namespace", f"nf{uuid.uuid4().hex[:8]}", "--backend-check-seconds", "0.2")


def test_a_ps_cut_off_from_redis_goes_not_serving_and_back_losing_no_row(redis_process, make_ps):
    """Health says NOT_SERVING within seconds of the cut and SERVING within seconds of the
    heal; a push meanwhile is not acknowledged (one line naming the PS); every row acknowledged
    before or after is there bit for bit, the newest value of each id, none left stale by a
    write of the cut that landed late."""
    store = redis_process()
    rng = np.random.default_rng(7)
    with FaultProxy("127.0.0.1", store.port) as link:
        # socket_timeout=1: with redis-py's 10 s and the PS's 3 tries a ping into a cut takes
        # 30 s, and so does NOT_SERVING (test_health_sees_a_cut_off_redis_with_default_settings)
        ps = redis_ps(make_ps, link, "?socket_timeout=1")
        with PSClient(ps.address, timeout=10) as client:
            client.create_table("rows", dim=8, state_width=8)
            want: dict[int, np.ndarray] = {}

            def push(ids: np.ndarray) -> None:
                rows = rng.standard_normal((len(ids), 16), dtype=np.float32)
                client.push("rows", ids, rows)
                want.update(zip(ids.tolist(), rows))

            push(np.arange(0, 2000, dtype=np.int64))
            link.cut()
            cut_at = time.monotonic()
            wait_for_health(client, "NOT_SERVING", timeout=10)
            not_serving_after = time.monotonic() - cut_at
            during = np.arange(1000, 3000, dtype=np.int64)  # half of them acknowledged before
            # one try: the PS's answer itself (a retried call that runs out of time says only
            # DEADLINE_EXCEEDED and the PS, its earlier tries' cause dropped)
            with PSClient(ps.address, timeout=10, retry=RetryPolicy(attempts=1)) as once:
                with pytest.raises(PSError) as refused:
                    once.push("rows", during, rng.standard_normal((len(during), 16), dtype=np.float32))
            message = str(refused.value)
            assert "\n" not in message and ps.address in message and f"Redis at {link.address}" in message, message

            link.heal()
            healed_at = time.monotonic()
            wait_for_health(client, "SERVING", timeout=10)
            serving_after = time.monotonic() - healed_at
            push(np.arange(1500, 4000, dtype=np.int64))  # over rows of before and of the cut
            time.sleep(0.5)  # room for a write of the cut to land late, if one could
            ids = np.array(sorted(want), dtype=np.int64)
            got = client.pull("rows", ids)
    assert not got.missing.any(), f"{int(got.missing.sum())} acknowledged rows missing"
    np.testing.assert_array_equal(got.rows, np.stack([want[i] for i in ids.tolist()]))
    assert not_serving_after < 6 and serving_after < 3, (not_serving_after, serving_after)
    print(
        f"\nPS <-> Redis cut: NOT_SERVING {not_serving_after:.1f} s after the cut, SERVING {serving_after:.1f} s "
        f"after the heal; a push during it: {message}"
    )


@pytest.mark.xfail(
    strict=True,
    reason="a ping into a cut waits out redis-py's socket_timeout (10 s) on each of the PS's 3 tries: "
    "health says NOT_SERVING only ~30 s into the cut (BackendWatch.check has no deadline of its own)",
)
def test_health_sees_a_cut_off_redis_with_default_settings(redis_process, make_ps):
    store = redis_process()
    with FaultProxy("127.0.0.1", store.port) as link:
        ps = redis_ps(make_ps, link)
        with PSClient(ps.address, timeout=10) as client:
            wait_for_health(client, "SERVING")
            link.cut()
            try:
                wait_for_health(client, "NOT_SERVING", timeout=6)
            finally:
                link.heal()


# -- a slow, lossy link under load ----------------------------------------------------------


def test_ps_load_over_a_slow_lossy_link_has_no_errors(redis_url, make_ps, tmp_path):
    """bench/ps_load.py's clients reach the PS through 200 ms of delay each way and 5% loss:
    every call succeeds (the bench checks every pulled value), and the latency figures show
    the link (printed; pytest -s shows them)."""
    # no shared memory: the rows go through the link, as a remote client's do (a client on
    # this host would hand them over in memory, and only the calls would cross the proxy)
    ps = make_ps("--backend", redis_url, "--namespace", f"nf{uuid.uuid4().hex[:8]}", "--shm-max-mb", "0")
    batch, row_bytes = 128, (16 + 16) * 4
    with FaultProxy("127.0.0.1", ps.port) as link:
        link.delay(0.2)
        link.loss(0.05)
        run = subprocess.run(
            [sys.executable, "bench/ps_load.py", "--ps", link.address]
            + ["--ps-metrics", f"http://127.0.0.1:{ps.metrics_port}/metrics", "--json", str(tmp_path / "load.json")]
            + f"--clients 8 --procs 1 --duration 5 --batch {batch} --id-space 4096 --dim 16 --state-width 16".split(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        forwarded = link.bytes_forwarded
    table = "\n".join(line for line in run.stdout.splitlines() if line.startswith(("method", "pull ", "push ", "all ")))
    shown = f"ps_load over 200 ms + 5% loss each way:\n{table}\n{run.stdout[-1500:]}{run.stderr[-1500:]}"
    print("\n" + shown.split("\n" + run.stdout[-1500:])[0])
    summary = json.loads((tmp_path / "load.json").read_text())
    assert summary["errors_total"] == 0 and summary["requests"]["all"] > 0, shown
    assert summary["rows_stored"]["before"] == summary["rows_stored"]["after"], shown
    # The one failure the bench sees is the PS's count of refused AttachSegment calls: each
    # client sees a loopback address and asks for shared memory, which --shm-max-mb 0 refuses.
    refused = {
        line.split("{", 1)[1].split("}", 1)[0]
        for line in ps.metrics_text().splitlines()
        if line.startswith("dynemb_ps_requests_total{") and 'code="OK"' not in line and not line.endswith(" 0.0")
    }
    assert refused <= {'code="FAILED_PRECONDITION",method="AttachSegment"'}, (refused, shown)
    assert all("FAILED_PRECONDITION" in f for f in summary["failures"]), shown
    latency = summary["latency_ms"]["all"]
    # 200 ms each way on every call; a lost chunk a retransmission timeout more (a round trip
    # of 400 ms + 200 ms): with ~2 chunks a call each way, some call meets one
    assert latency["p50_ms"] >= 400 and latency["max_ms"] >= 1000, shown
    # the rows crossed the link: every batch's bytes at least, each way it went
    assert forwarded >= summary["requests"]["all"] * batch * row_bytes, (forwarded, shown)
