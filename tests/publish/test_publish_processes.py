"""Train -> publish -> apply -> serve through real processes: `dynemb table publish`, `dynemb
table apply` and `dynemb ps serve --read-only`, over Redis and over an embedded store's files;
and kill -9 of the publisher and of the applier midway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import dynemb, wait_until

from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import ReadOnly
from dynemb.publish.apply import serving_store
from dynemb.publish.version import STALL_ENV as PUBLISH_STALL
from dynemb.publish.version import numbers
from dynemb.testing.local_ps import REPO

DIM, STATE = 4, 2


def started(*args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dynemb.cli", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rows_of(ids: np.ndarray, value: float) -> np.ndarray:
    rows = np.full((len(ids), DIM + STATE), value, np.float32)
    rows[:, 0] = ids
    return rows


@pytest.mark.parametrize("serving", ["redis", "files"])
def test_train_publish_apply_serve(make_ps, redis_namespace, tmp_path, request, serving):
    training = make_ps()
    root = tmp_path / "published"
    target = request.getfixturevalue("redis_url") if serving == "redis" else f"embedded://{tmp_path / 'serving'}"
    ids = np.arange(100, dtype=np.int64)
    with PSClient(training.address, timeout=30) as client:
        client.create_table("user", dim=DIM, state_width=STATE)
        client.push("user", ids, rows_of(ids, 1.0))
        out = dynemb("table", "publish", "--ps", training.address, "--to", str(root), "--quiet", check=True).stdout
        assert "published user v1 (full, fp32: 100 rows)" in out
        out = dynemb(
            "table", "apply", str(root), "--to", target, "--namespace", redis_namespace, "--quiet", check=True
        ).stdout
        assert "user: applied v1" in out and "(holds v1)" in out
        flags = ("--backend", target, "--namespace", redis_namespace, "--follow-seconds", "0.2")
        reader = make_ps("--read-only", *flags)
        with PSClient(reader.address, timeout=30) as serve:
            info = serve.describe_table("user")
            assert (info.schema.dim, info.schema.state_width, info.num_rows) == (DIM, 0, 100)
            got = serve.pull("user", np.array([5, 500]))
            assert got.missing.tolist() == [False, True]
            assert got.rows[0].tolist() == [5.0, 1.0, 1.0, 1.0] and not got.rows[1].any()  # zeros, no initializer
            wait_until(lambda: 'dynemb_ps_published_version{table="user"} 1.0' in reader.metrics_text(), timeout=20)
            assert "dynemb_ps_published_cut_timestamp_seconds" in reader.metrics_text()
            with pytest.raises(ReadOnly, match="read only"):
                serve.push("user", np.array([1]), np.zeros((1, DIM), np.float32))
            # training goes on: rows change, some are deleted; a delta published and applied
            client.push("user", ids[:10], rows_of(ids[:10], 2.0))
            client.delete("user", ids[90:])
            out = dynemb("table", "publish", "--ps", training.address, "--to", str(root), "--quiet", check=True).stdout
            assert "published user v2 (delta, fp32: 10 rows, 10 deleted)" in out
            dynemb("table", "apply", str(root), "--to", target, "--namespace", redis_namespace, "--quiet", check=True)

            def caught_up() -> bool:
                got = serve.pull("user", ids)
                return bool(got.missing[90:].all() and (got.rows[:10, 1] == 2.0).all())

            wait_until(caught_up, timeout=20, what="the read-only PS serving version 2")
            got = serve.pull("user", ids)
            assert not got.missing[:90].any() and (got.rows[10:90, 1] == 1.0).all()
            assert serve.describe_table("user").num_rows == 90


def test_a_publisher_killed_mid_version_leaves_none_half_made(make_ps, tmp_path):
    training = make_ps()
    root = tmp_path / "published"
    ids = np.arange(50, dtype=np.int64)
    with PSClient(training.address, timeout=30) as client:
        client.create_table("user", dim=DIM, state_width=STATE)
        client.push("user", ids, rows_of(ids, 1.0))
        dynemb("table", "publish", "--ps", training.address, "--to", str(root), "--quiet", check=True)
        client.push("user", ids[:5], rows_of(ids[:5], 2.0))
        client.delete("user", ids[-5:])
        # stalls after its rows file, before its tombstones and manifest: killed there
        publish = ("table", "publish", "--ps", training.address, "--to", str(root), "--quiet")
        p = started(*publish, env={PUBLISH_STALL: "1"})
        wait_until(lambda: (root / "user" / ".v00000002.partial" / "rows-00000.safetensors").exists(), timeout=60)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert numbers(root, "user") == [1]  # nothing a follower would apply
        out = dynemb("table", "apply", str(root), "--to", f"embedded://{tmp_path / 's'}", "--quiet", check=True).stdout
        assert "applied v1" in out
        # the next publish starts version 2 over, and nothing was lost
        out = dynemb("table", "publish", "--ps", training.address, "--to", str(root), "--quiet", check=True).stdout
        assert "published user v2 (delta, fp32: 5 rows, 5 deleted)" in out
        assert not (root / "user" / ".v00000002.partial").exists()


@pytest.mark.parametrize("stall", ["step1", "step2"])
def test_an_applier_killed_mid_version_is_finished_by_the_next(make_ps, redis_url, redis_namespace, tmp_path, stall):
    training = make_ps()
    root = tmp_path / "published"
    ids = np.arange(50, dtype=np.int64)
    apply = ("table", "apply", str(root), "--to", redis_url, "--namespace", redis_namespace, "--quiet")
    with PSClient(training.address, timeout=30) as client:
        client.create_table("user", dim=DIM, state_width=STATE)
        client.push("user", ids, rows_of(ids, 1.0))
        dynemb("table", "publish", "--ps", training.address, "--to", str(root), "--quiet", check=True)
        dynemb(*apply, check=True)
        client.push("user", ids, rows_of(ids, 2.0))
        client.delete("user", ids[:1])
        dynemb("table", "publish", "--ps", training.address, "--to", str(root), "--quiet", check=True)
    store = serving_store(redis_url, redis_namespace)
    p = started(*apply, env={"DYNEMB_TEST_APPLY_STALL": stall})
    wait_until(lambda: store.raw_head("user").pending == 2 and (stall == "step1" or store.raw_head("user").visible),
               timeout=60, what="the applier at its stall")  # fmt: skip
    time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    rows, found, version = store.pull("user", ids)
    if stall == "step1":  # readers still read version 1
        assert version == 1 and found.all() and (rows[:, 1] == 1.0).all()
    else:  # version 2, whole
        assert version == 2 and not found[0] and found[1:].all() and (rows[1:, 1] == 2.0).all()
    out = dynemb(*apply, check=True).stdout
    assert "applied v2" in out and "(holds v2)" in out
    head = store.raw_head("user")
    assert (head.version, head.pending, head.visible, head.rows) == (2, 0, 0, 49)
    rows, found, version = store.pull("user", ids)
    assert version == 2 and not found[0] and found[1:].all() and (rows[1:, 1] == 2.0).all()
