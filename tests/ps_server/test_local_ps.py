"""dynemb.testing.local_ps.LocalPS: a PS process started for a trainer or a test goes when its parent goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import wait_until

pytestmark = pytest.mark.slow


def test_a_killed_parent_leaves_no_ps_behind():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from dynemb.testing.local_ps import LocalPS; import time; ps = LocalPS().start(); "
            "print(ps.proc.pid, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    ps_pid = int(parent.stdout.readline())
    os.kill(ps_pid, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    gone_within(ps_pid, 20)


def gone_within(pid: int, seconds: float) -> None:
    """Until process pid is gone (a zombie counts: its parent, now init, reaps it); killed if not."""

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    try:
        wait_until(gone, timeout=seconds, what="the PS to end with its parent", interval=0.1)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        raise


def test_a_ps_started_from_a_thread_outlives_the_thread_not_the_process():
    """The PS ends with the process that started it, not with the thread (what Linux's
    PR_SET_PDEATHSIG would do): a PS started from a worker thread keeps serving after it."""
    code = (
        "from dynemb.testing.local_ps import LocalPS; import threading, time; box = []; "
        "t = threading.Thread(target=lambda: box.append(LocalPS().start())); t.start(); t.join(); "
        "print(box[0].proc.pid, box[0].address, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ps_pid, address = parent.stdout.readline().split()
        from dynemb.ps_server.client import PSClient

        time.sleep(1.0)  # the starting thread ended before the print: a death signal would have acted
        with PSClient(address, timeout=10) as ps:
            assert ps.health() == ["SERVING"]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    gone_within(int(ps_pid), 20)
