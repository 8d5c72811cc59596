"""dynemb.testing.local_ps.LocalPS: a PS process started for a trainer or a test goes when its parent goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def test_a_killed_parent_leaves_no_ps_behind():
    parent = subprocess.Popen(
        [sys.executable, "-c", "from dynemb.testing.local_ps import LocalPS; import time; ps = LocalPS().start(); "
                               "print(ps.proc.pid, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    ps_pid = int(parent.stdout.readline())
    os.kill(ps_pid, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(ps_pid, 0)
        except ProcessLookupError:
            return  # gone
        # a zombie counts as gone: its parent (now init) reaps it
        with open(f"/proc/{ps_pid}/stat") as f:
            if f.read().split()[2] == "Z":
                return
        time.sleep(0.1)
    os.kill(ps_pid, signal.SIGKILL)
    raise AssertionError("the PS outlived its killed parent by 20 s")


def test_a_ps_started_from_a_thread_outlives_the_thread_not_the_process():
    """The PS ends with the process that started it, not with the thread (what Linux's
    PR_SET_PDEATHSIG would do): a PS started from a worker thread keeps serving after it."""
    code = ("from dynemb.testing.local_ps import LocalPS; import threading, time; box = []; "
            "t = threading.Thread(target=lambda: box.append(LocalPS().start())); t.start(); t.join(); "
            "print(box[0].proc.pid, box[0].address, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ps_pid, address = parent.stdout.readline().split()
        from dynemb.ps_server.client import PSClient

        time.sleep(1.0)  # the starting thread is long gone
        with PSClient(address, timeout=10) as ps:
            assert ps.health() == ["SERVING"]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{ps_pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(int(ps_pid), signal.SIGKILL)
    raise AssertionError("the PS outlived its killed parent by 20 s")
