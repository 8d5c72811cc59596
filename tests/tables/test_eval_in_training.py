"""Evaluation inside a training loop (issue 45): a `wrap(..., train=False)` pass every few steps
of a `wrap(train_batches)` loop leaves the training where it was, bit for bit, plain and with
TorchRec's pipeline (2 ranks: test_tables_dist.py); what cannot work beside it is refused in one
line at the second wrap, never a silent stop; a loop left early frees the tables at once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tables_dist_worker as worker  # noqa: E402
from tables_models import CONFIGS, build  # noqa: E402

from dynemb import tables as dt  # noqa: E402

pytestmark = [pytest.mark.torchrec, pytest.mark.usefixtures("one_process_group")]


@pytest.mark.parametrize("mode", ["plain", "pipeline"])
def test_training_with_evaluation_inside_equals_training_without(mode):
    full = worker.run("full", None, 0)
    without = worker.run(mode, None, 0)
    with_eval = worker.run(f"{mode}_eval", None, 0)
    assert len(with_eval) == worker.STEPS, f"the training loop stopped after {len(with_eval)} steps"
    assert with_eval == without, "an evaluation pass changed the training"
    assert max(abs(a - b) for a, b in zip(with_eval, full)) <= 1e-6, "dynamic tables part from full ones"


def _few(n: int = 4):
    return worker.batches(0, steps=n)


def test_what_cannot_run_beside_a_training_loop_is_refused_in_one_line():
    model, _ = build(worker.CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS, table_prefix="refused_") as dyn:
        training = dyn.wrap(_few())
        next(training)
        with pytest.raises(dt.SetupError, match="another training wrap's loop has not ended"):
            dyn.wrap(_few())
        evaluating = dyn.wrap(_few(), train=False)
        next(evaluating)
        with pytest.raises(dt.SetupError, match="an evaluation wrap's loop has not ended"):
            dyn.wrap(_few(), train=False)
        evaluating.close()
        assert len(list(training)) == 3, "the training loop goes on after the refusals"
        ahead = dyn.wrap(_few(), prefetch=1)
        next(ahead)
        with pytest.raises(dt.SetupError, match="inside a training wrap with prefetch"):
            dyn.wrap(_few(), train=False)
        ahead.close()


def test_a_loop_left_early_frees_the_tables_for_the_next():
    model, _ = build(worker.CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS, table_prefix="left_") as dyn:
        for _ in dyn.wrap(_few()):
            break  # the wrap ends here (nothing else holds it): its batch released
        assert len(dyn.tables.in_flight) == 0
        unstarted = dyn.wrap(_few())  # made, never started: the next wrap closes it
        assert len(list(dyn.wrap(_few()))) == 4
        with pytest.raises(StopIteration):
            next(unstarted)
        with torch.no_grad():
            for batch in dyn.wrap(_few(2), train=False):
                model(batch.sparse_features)
        assert len(dyn.tables.in_flight) == 0
