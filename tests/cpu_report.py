"""`--cpu-report FILE`: the CPU each test cost, its own and its processes', and the costliest.

The suite is CPU-bound on a small machine (docs/development.md), so its wall time is about its
CPU over the cores: a test that waits a minute on a sleeping server costs little, and one that
starts three torchrun jobs a lot. `--durations` shows the first kind as readily as the second;
this shows where the cores went. Per test: the worker's own CPU and that of the processes it
started and reaped (getrusage's RUSAGE_CHILDREN, which counts a child once it is waited for,
with the children it waited for in turn: a torchrun launcher's ranks included). A server kept
by a session fixture is counted when it stops, against the test then running. Each worker
appends a JSON line a test to FILE; the run ends with the 25 costliest and the total.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

SHOWN = 25


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--cpu-report",
        metavar="FILE",
        default="",
        help="append each test's CPU seconds (its own and its processes') to FILE, a JSON line a test; "
        "print the costliest at the end",
    )


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-report")
    if not path:
        yield
        return
    cpu, wall = _cpu(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu_s": round(_cpu() - cpu, 3), "wall_s": round(time.monotonic() - wall, 3)}
    with open(path, "a") as f:  # one short write: workers' lines do not interleave
        f.write(json.dumps(line) + "\n")


@pytest.hookimpl(tryfirst=True)  # before xdist starts the workers that write to it
def pytest_sessionstart(session) -> None:
    path = session.config.getoption("--cpu-report")
    if path and not hasattr(session.config, "workerinput"):  # the controller, or a run without workers
        Path(path).unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, config) -> None:
    path = Path(config.getoption("--cpu-report") or "")
    if not config.getoption("--cpu-report") or not path.is_file():
        return
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines.sort(key=lambda line: -line["cpu_s"])
    total = sum(line["cpu_s"] for line in lines)
    terminalreporter.section(f"costliest {SHOWN} tests in CPU seconds (--cpu-report {path})")
    for line in lines[:SHOWN]:
        terminalreporter.write_line(f"{line['cpu_s']:8.1f}s cpu {line['wall_s']:7.1f}s wall  {line['test']}")
    terminalreporter.write_line(f"{total:,.0f} CPU seconds in {len(lines):,} tests")
