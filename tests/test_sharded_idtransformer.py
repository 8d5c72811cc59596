"""The sharded ID transformer across real torchrun processes (gloo), 2 and 4 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "dist" / "sharded_idtransformer_worker.py"


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.parametrize("world,policy", [(2, "hybrid"), (4, "lru")])
def test_each_rank_owns_its_ids_and_rows(world, policy):
    run = torchrun(world, WORKER, policy)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in range(world):
        assert f"OK rank {rank} of {world}" in run.stdout
