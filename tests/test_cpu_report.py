"""`--cpu-report`: a test's CPU is its own and its processes', not its wall time."""

import json
import os
import subprocess
import sys

from helpers import TESTS

CASES = """
import subprocess, sys

def test_burns():
    subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(30_000_000): x += i"], check=True)

def test_sleeps():
    subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5)"], check=True)
"""


def test_the_report_counts_a_tests_processes_and_not_its_waits(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    report = tmp_path / "cpu.jsonl"
    report.write_text('{"test": "left by an earlier run", "cpu_s": 999, "wall_s": 1}\n')
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "cpu_report", "-p", "no:randomly", "-p", "no:cacheprovider"]
        + ["--cpu-report", str(report), "-q", str(tmp_path / "test_cases.py")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line["test"].split("::")[-1]: line for line in map(json.loads, report.read_text().splitlines())}
    assert lines.keys() == {"test_burns", "test_sleeps"}  # the earlier run's line is gone
    burns, sleeps = lines["test_burns"], lines["test_sleeps"]
    # absolute figures, not shares of the wall time: on a loaded machine the busy child gets a
    # fraction of a core, but its CPU seconds stay what its loop costs (~1-2 s)
    assert burns["cpu_s"] > 0.5, burns
    assert sleeps["wall_s"] >= 1.5 and sleeps["cpu_s"] < 0.4, sleeps
    assert "costliest 25 tests in CPU seconds" in done.stdout and "CPU seconds in 2 tests" in done.stdout, done.stdout
    assert done.stdout.index("test_burns") < done.stdout.index("test_sleeps")  # the costlier first
