"""Helpers shared by test modules (a test module imports from here, never from another test module)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from dynemb.ps_server.client import PSClient, RetryPolicy
    from dynemb.trainer.config import TrainConfig

T = TypeVar("T")

TESTS = Path(__file__).resolve().parent  # the suite's folder: dist/ workers, fixtures/
REPO = TESTS.parent


def wait_until(
    condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition", interval: float = 0.02
) -> T:
    """Call `condition` until it returns something true, and return that; fail the test when it
    has not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(interval)
    return value


def noted_retry(**policy) -> tuple[RetryPolicy, threading.Event]:
    """RetryPolicy(**policy), and an Event set once a call it governs has failed and is about to
    be tried again: what a test waits for instead of sleeping while a PS is away."""
    from dynemb.ps_server.client import RetryPolicy

    retrying = threading.Event()

    class Noted(RetryPolicy):
        def backoffs(self):
            for delay in super().backoffs():  # drawn after a try failed
                retrying.set()
                yield delay

    return Noted(**policy), retrying


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (a process group's transport loop and workers)."""
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


def leave_process_groups() -> None:
    """End a torchrun worker's distributed part with no gloo thread left running: destroy the
    groups, then collect the cyclic garbage that still holds them (a model, a failed job's
    frames), so that their destructors join their threads while the interpreter is whole. A
    gloo thread that finishes a collective's work during interpreter shutdown takes the GIL and
    aborts the process ("terminate called without an active exception")."""
    import gc

    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()
    # a destroyed group's threads end on their own: on a loaded machine not always at once
    deadline = time.monotonic() + 10
    while (left := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"gloo threads outlive the process groups: {left}"


def dynemb(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    check: bool = False,
    keep_carriage_returns: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m dynemb.cli ARGS` from the checkout, its output captured as text (ENV added to
    this process's environment). check: fail the test with its stderr unless it exits 0.
    keep_carriage_returns: decode the output by hand, so that a progress bar's carriage returns
    stay as they are (text mode would turn them into newlines)."""
    done = subprocess.run(
        [sys.executable, "-m", "dynemb.cli", *args],
        capture_output=True,
        text=not keep_carriage_returns,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    if keep_carriage_returns:
        done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    if check:
        assert done.returncode == 0, f"dynemb {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`script` under torchrun on nproc local ranks (gloo), its output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def config(optimizer: str, dynamic: bool, **extra) -> TrainConfig:
    """A small training job (6 tables, 100 steps unless `steps` is given) that trains in seconds."""
    from dynemb.trainer.config import DataConfig, TableConfig, TrainConfig

    return TrainConfig(
        data=DataConfig(num_sparse=6, universe=6000, zipf=1.1, ids_per_feature=2),
        table=TableConfig(dim=8, capacity_fraction=0.1, dynamic=dynamic, evict_fraction=0.1),
        optimizer=optimizer,
        lr=0.1,
        dense_lr=0.05,
        batch_size=48,
        eval_batches=2,
        dense_arch=[16, 8],
        over_arch=[16, 1],
        progress=False,
        **({"steps": 100} | extra),
    )


def checkpointed_config(folder: Path) -> TrainConfig:
    """config()'s adagrad job on dynamic tables, 20 steps, checkpointed into `folder` at steps
    10 (full) and 20 (incremental, at the end)."""
    return config(
        "adagrad",
        dynamic=True,
        steps=20,
        checkpoint_dir=str(folder),
        checkpoint_every=10,
        checkpoint_full_every=2,
        checkpoint_at_end=True,
    )


def readme_output(command: str) -> list[str]:
    """The lines README.md quotes as the output of `$ command` (a console block's prompt line), up to
    the block's next prompt or end; a test fails when the README quotes no such command."""
    quoted, block = None, False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if quoted is not None:
                break
            block = line.strip() == "```console"
        elif block and line.startswith("$ "):
            if quoted is not None:
                break
            quoted = [] if line[2:].strip() == command else None
        elif block and quoted is not None:
            quoted.append(line)
    assert quoted, f"README.md quotes no output of `$ {command}` in a console block"
    return quoted


def steady(line: str) -> str:
    """An output line without what the machine and the terminal decide: a progress bar's drawing and
    times, and samples per second. What is left (steps, losses, AUC, hit rates) a deterministic job repeats."""
    line = re.sub(r"\|[^|]*\|", "|bar|", line, count=1)
    line = re.sub(r"\[\d+:\d+<\d+:\d+, *[\d.]+step/s", "[time", line)
    return re.sub(r"samples/s=[\d,]*\d|[\d,]*\d samples/s", "samples/s", line)


def unique(prefix: str) -> str:
    """A table name no other test uses."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def fill(ps: PSClient, name: str, dtype: str, n: int, dim: int = 6, state_width: int = 6, seed: int = 0):
    """A table of n rows whose values are arbitrary bit patterns (NaNs, infinities, -0 included)."""
    from dynemb.ps_server.schema import Initializer, TableSchema

    rng = np.random.default_rng(seed)
    schema = TableSchema(name, dim, state_width, dtype, Initializer("normal", 0.0, 0.02, seed=7, state_init=0.1))
    ps.create_table_from_schema(schema)
    ids = rng.choice(1 << 62, n, replace=False).astype(np.int64) - (1 << 61)
    bits = rng.integers(0, np.iinfo(np.uint32).max, (n, schema.width), dtype=np.uint32, endpoint=True)
    rows = bits.view(np.float32) if dtype == "fp32" else bits.astype(np.uint16)
    rows = rows.view(schema.np_dtype) if dtype != "fp32" else rows
    ps.push(name, ids, rows)
    return schema, ids, rows


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def learnable_tsv(path: Path, n: int, seed: int = 0) -> str:
    """Criteo lines whose label is a fixed function of the first categorical column (16 values)
    and of nothing else: dense columns are noise, no column is ever missing. A model that looks
    every ID up as row 0 learns nothing (AUC 0.5); one that finds the IDs' rows learns it."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        first = int(rng.integers(0, 16))
        cats = [f"{first:08x}"] + [f"{int(rng.integers(0, 40)):08x}" for _ in range(25)]
        label = str(int((first * 7919) % 16 < 8))
        dense = [str(int(rng.integers(0, 20))) for _ in range(13)]
        lines.append("\t".join([label, *dense, *cats]) + "\n")
    path.write_text("".join(lines))
    return str(path)


def job_tables(address: str, prefix: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every table of a job on the PS at address, sorted by id: {name without prefix: (ids, rows)}."""
    from dynemb.ps_server.client import PSClient

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


class DeviceWork:
    """Kernel launches (Triton's), torch ops (each a kernel launch or more on a GPU; views
    aside) and host copies (`module.to_host`) while count() runs a function. Under Triton's
    interpreter a launch's own argument copies are not counted as the pass's ops."""

    def __init__(self, monkeypatch, module) -> None:
        import torch
        import triton
        from torch.utils._python_dispatch import TorchDispatchMode

        self.launches = self.ops = self.copies = 0
        self.on = False
        outer = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if outer.on and not func.is_view:
                    outer.ops += 1
                return func(*args, **(kwargs or {}))

        self.mode = Ops()
        real_copy = module.to_host

        def copy(counts):
            self.copies += 1
            return real_copy(counts)

        monkeypatch.setattr(module, "to_host", copy)
        if torch.cuda.is_available():
            real_run = triton.runtime.jit.JITFunction.run

            def run(fn, *a, **kw):
                self.launches += self.on
                return real_run(fn, *a, **kw)

            monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", run)
        else:  # the interpreter's launches (their argument copies are not the pass's ops)
            from triton.runtime.interpreter import GridExecutor

            real_call = GridExecutor.__call__

            def call(executor, *a, **kw):
                self.launches += self.on
                was, self.on = self.on, False
                try:
                    return real_call(executor, *a, **kw)
                finally:
                    self.on = was

            monkeypatch.setattr(GridExecutor, "__call__", call)

    def count(self, fn) -> tuple[int, int, int]:
        self.launches = self.ops = self.copies = 0
        with self.mode:
            self.on = True
            try:
                fn()
            finally:
                self.on = False
        return self.launches, self.ops, self.copies


def pause(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP a process and wait until every thread of it has stopped. A process with threads
    stops once the thread that takes the signal runs; on a busy machine another of its threads
    (a PS's gRPC poller) can still answer a request meanwhile (seen: a "hung" PS that answered
    in 1 ms). SIGCONT resumes it."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped {timeout}s after SIGSTOP: its threads are {states}")
        time.sleep(0.002)
