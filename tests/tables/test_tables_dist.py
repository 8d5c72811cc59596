"""The public API on 2 torchrun ranks: an own model trains exactly like full tables whichever way
the loop takes its batches (plain, a thread transforming ahead, TorchRec's
TrainPipelineSparseDist with and without it, with evaluation passes inside the loop), with no
process group made by the user, over the ranks' embedded stores and over a PS on Redis (and,
in the plain loop, over a PS on the disk store); over a PS, bit for bit the losses of the same
loop over the ranks' embedded stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import torchrun

WORKER = Path(__file__).parent / "tables_dist_worker.py"
MODES = ["plain", "prefetch", "pipeline", "pipeline_prefetch"]
EVAL_MODES = ["plain_eval", "pipeline_eval"]  # evaluation inside the loop: over the embedded stores only


@pytest.mark.dist
@pytest.mark.parametrize("store", ["embedded", "redis", "disk"])
@pytest.mark.torchrec
def test_two_ranks_train_exactly_like_full_tables_in_every_loop(store, tmp_path, make_ps, redis_url, redis_namespace):
    where = "embedded"
    if store == "redis":
        where = make_ps("--backend", redis_url, "--namespace", redis_namespace).address
    elif store == "disk":  # a PS on RocksDB: the plain loop only (the loops are the same over any PS)
        where = make_ps("--backend", f"disk://{tmp_path}/disk").address
    modes = MODES + (EVAL_MODES if store == "embedded" else [])
    if store == "disk":
        modes = ["plain"]
    # over a PS, the plain loop once more over the ranks' embedded stores: its losses must be the
    # PS run's bit for bit (rows travel as bytes; every store initialises a new row alike)
    here = [] if store == "embedded" else ["plain_here"]
    done = torchrun(2, WORKER, str(tmp_path), where, ",".join(["full", *modes, *here]))
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert len(got["full"]) == 24
        for mode in modes:
            diff = np.abs(got[mode] - got["full"])
            assert diff.max() <= 1e-6, f"rank {rank}, {mode}: losses part at step {int(diff.argmax())}"
        for mode in here:
            assert np.array_equal(got["plain"], got[mode]), f"rank {rank}: {store} and embedded losses differ"


@pytest.mark.dist
@pytest.mark.torchrec
def test_set_up_mistakes_on_two_ranks_are_one_line_on_each():
    done = torchrun(2, Path(__file__).parent / "tables_mistakes_worker.py")
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        assert (
            f"rank {rank} uneven: table user has 81 rows, not a multiple of the 2 ranks: dynamic tables keep an "
            f"equal block on each rank; make its num_embeddings a multiple of 2 (e.g. 82)"
        ) in done.stdout, done.stdout
        assert f"rank {rank} planned: table user is sharded " in done.stdout
        assert "dynamic tables need row_wise and fused: shard with dynemb.tables.shard_model" in done.stdout
    assert "KeyError" not in done.stderr
