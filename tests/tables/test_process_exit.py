"""A job's process groups end before the interpreter does.

A gloo worker thread still alive at interpreter finalization can abort a job that has done its
work ("terminate called without an active exception", seen once in a 2-rank example run): the
thread takes the GIL when it releases its last collective's tensors, and a finalizing Python
answers that with pthread_exit inside C++. dynemb.tables.device ends the groups at exit
(atexit); these check that no gloo thread is left once every atexit handler has run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

# runs first, so that its handler runs last (atexit: last in, first out)
PROBE = """
import atexit, glob, sys

def gloo_threads():
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(open(path).read().strip())
        except OSError:
            pass
    return sorted(n for n in names if "gloo" in n)

atexit.register(lambda: print("gloo threads at exit:", gloo_threads(), flush=True))
"""


def run(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE + body], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_group_made_by_init_distributed_and_left_open_ends_at_exit():
    out = run(
        """
import torch
import torch.distributed as dist
from dynemb import tables as dt

dt.init_distributed()
t = torch.ones(4)
dist.all_reduce(t)  # the group's threads have worked; the job never destroys the group
print("sum", t.tolist())
"""
    )
    assert "sum [1.0, 1.0, 1.0, 1.0]" in out
    assert "gloo threads at exit: []" in out, out


@pytest.mark.torchrec
def test_the_groups_of_a_finished_example_end_before_the_interpreter():
    """two_tower.py as a user runs it: its model (a DMP, with reference cycles) still holds the
    groups it destroyed, and dynemb's own, when its main() returns."""
    out = run(
        """
import runpy
sys.argv = ["two_tower.py", "--steps", "3", "--eval-batches", "1"]
runpy.run_path("examples/two_tower.py", run_name="__main__")
"""
    )
    assert "steps 3" in out
    assert "gloo threads at exit: []" in out, out
