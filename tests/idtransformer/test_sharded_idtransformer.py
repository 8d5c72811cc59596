"""The sharded ID transformer across real torchrun processes (gloo), 2 and 3 ranks (a world
that is no power of two)."""

from __future__ import annotations

import pytest
from helpers import TESTS, torchrun

WORKER = TESTS / "dist" / "sharded_idtransformer_worker.py"

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world,policy", [(2, "hybrid"), (3, "lru")])
def test_each_rank_owns_its_ids_and_rows(world, policy):
    run = torchrun(world, WORKER, policy)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in range(world):
        assert f"OK rank {rank} of {world}" in run.stdout
