"""dynemb.local.LocalPS: a PS process started for a trainer or a test goes when its parent goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def test_a_killed_parent_leaves_no_ps_behind():
    parent = subprocess.Popen(
        [sys.executable, "-c", "from dynemb.local import LocalPS; import time; ps = LocalPS().start(); "
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
