"""Batches transformed ahead by a thread of their own (dynemb/tables/prefetch.py): the same training
whatever the threads' timing, errors raised in the loop, a clean stop."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist
from helpers import config

from dynemb.idtransformer.sharded import BatchRefused
from dynemb.idtransformer.transformer import TooManyIDs
from dynemb.tables.dynamic import DynamicTables
from dynemb.trainer.model import build
from dynemb.trainer.train import batches, init_distributed, make_dynamic, open_row_store, train

pytestmark = pytest.mark.torchrec  # TorchRec and fbgemm-gpu: needed by every test here


def _transform_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dynemb-transform"]


def _jittered(monkeypatch, seed: int) -> list[int]:
    """Random sleeps in the transform thread and in the loop's releases; returns the list that
    collects how many batches were in flight at each transform."""
    rng = random.Random(seed)
    seen: list[int] = []
    took, release = DynamicTables._took, DynamicTables.release_oldest

    def slow_took(self, results, keep):  # a batch's share transformed here: in flight before it?
        seen.append(len(self.in_flight))
        time.sleep(rng.random() * 0.004)
        return took(self, results, keep)

    def slow_release(self):
        time.sleep(rng.random() * 0.004)
        release(self)

    monkeypatch.setattr(DynamicTables, "_took", slow_took)
    monkeypatch.setattr(DynamicTables, "release_oldest", slow_release)
    return seen


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "plain"])
def test_what_is_pinned_at_each_transform_does_not_depend_on_timing(pipeline, monkeypatch):
    """window - 1 batches in flight at every transform once the loop is under way, whichever
    thread runs late: the same evictions, so the same hit rates and losses, run after run."""
    runs = []
    for seed in (1, 2):
        with monkeypatch.context() as m:
            seen = _jittered(m, seed)
            result = train(config("rowwise_adagrad", dynamic=True, pipeline=pipeline, steps=40, prefetch=1))
        runs.append((seen, result))
    window = (3 if pipeline else 1) + 1
    for seen, result in runs:
        # the evaluation's batches (2, inline) come after the 40 transformed ahead
        assert seen[:40] == [min(k, window - 1) for k in range(40)]
        assert len(result.losses) == 40
    (_, a), (_, b) = runs
    assert a.hit_rates == b.hit_rates and a.hit_rate < 1.0
    assert a.losses == b.losses
    assert not _transform_threads()


@pytest.mark.parametrize("optimizer,prefetch", [("rowwise_adagrad", 0), ("adam", 0), ("sgd", 2)])
def test_training_is_exact_with_or_without_the_thread(optimizer, prefetch):
    """The acceptance test (tests/trainer/test_trainer_exact.py runs it with the default, prefetch=1)
    with the transform on the training thread, and two batches ahead."""
    full = train(config(optimizer, dynamic=False, steps=60), collect_tables=True)
    dyn = train(config(optimizer, dynamic=True, steps=60, prefetch=prefetch), collect_tables=True)
    diff = np.abs(np.array(full.losses) - np.array(dyn.losses))
    assert len(diff) == 60 and diff.max() <= 1e-6, f"losses part at step {int(diff.argmax())}: {diff.max():.3g}"
    assert dyn.hit_rate < 1.0
    for name, (_, rows) in full.tables.items():
        np.testing.assert_allclose(dyn.tables[name][1], rows, rtol=0, atol=1e-6, err_msg=f"table {name}")


@pytest.mark.timeout(120)
def test_a_batch_refused_on_the_thread_is_raised_in_the_loop():
    """More distinct IDs in a batch than a table holds: the error the inline transform gives,
    raised where the loop takes the batch; the thread is gone, nothing hangs."""
    cfg = config("sgd", dynamic=True, steps=10, prefetch=1)
    cfg.table.capacity = 20  # a batch of 48 samples, 2 IDs each, has more distinct IDs than that
    with pytest.raises((BatchRefused, TooManyIDs)) as refused:
        train(cfg)
    assert "distinct" in str(refused.value) or "distinct" in str(refused.value.__cause__)
    assert not _transform_threads()


def test_closing_the_batches_stops_the_thread_and_leaves_batches_releasable():
    cfg = config("rowwise_adagrad", dynamic=True, steps=10)
    created = init_distributed()
    store = open_row_store(cfg)
    try:
        built = build(cfg)
        tables = make_dynamic(cfg, built, store, None).tables  # the engine under the public API
        wrapped = tables.wrap(batches(cfg, split=0), window=3)  # an endless stream
        for _ in range(2):
            next(wrapped)
            tables.release_oldest()
        next(wrapped)
        wrapped.close()
        assert not _transform_threads()
        assert 1 <= len(tables.in_flight) <= 3  # taken and not released, or transformed ahead
        while tables.in_flight:  # releases apply at once again
            tables.release_oldest()
        assert not tables._moving
        assert tables.flush() > 0
    finally:
        store.close()
        if created:
            dist.destroy_process_group()


def test_a_window_below_one_is_refused():
    from dynemb.tables.prefetch import TransformAhead

    with pytest.raises(ValueError, match="window must be >= 1"):
        TransformAhead(object(), iter(()), window=0)


class _GatedTables:
    """What TransformAhead asks of DynamicTables: the stream waits at a gate, then passes the
    batches through."""

    def __init__(self) -> None:
        from dynemb.tables.row_group import RowGroup
        from dynemb.tables.row_moves import RowMoves

        self.gate = threading.Event()
        self.entered = threading.Event()  # the thread is in the stream (its priority set before)
        self.moves = RowMoves(RowGroup([]))  # on the CPU: nothing to wait for

    def defer_releases(self) -> None:
        pass

    def end_deferred_releases(self) -> None:
        pass

    def transform_stream(self, batches, before_each):
        self.entered.set()
        self.gate.wait(30)
        yield from batches


@pytest.mark.parametrize("priority", ["idle", "low", "normal"])
def test_the_transform_thread_runs_at_the_priority_asked_for(priority):
    import os

    from dynemb.tables.prefetch import TransformAhead

    tables = _GatedTables()
    ahead = TransformAhead(tables, iter([1, 2, 3]), window=1, priority=priority)
    assert tables.entered.wait(10)
    tid = ahead.native_id
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    policy = os.sched_getscheduler(tid)
    assert policy == (os.SCHED_IDLE if priority == "idle" else os.SCHED_OTHER)
    assert os.getpriority(os.PRIO_PROCESS, tid) == (19 if priority == "low" else main_nice)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread is left as it was
    tables.gate.set()
    assert list(ahead) == [1, 2, 3]


def test_an_unknown_priority_is_refused():
    from dynemb.tables.prefetch import TransformAhead
    from dynemb.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="one of .*'idle'.*got 'high'"):
        TransformAhead(_GatedTables(), iter(()), window=1, priority="high")
    with pytest.raises(ValueError, match="transform_priority must be idle, low or normal, got 'fast'"):
        TrainConfig(transform_priority="fast")


def test_a_job_transforms_at_normal_priority_unless_asked(monkeypatch):
    """The default may not depend on an idle machine: at SCHED_IDLE any other busy process can
    starve the transform thread (300 steps took over 150 s instead of 16 s beside two busy loops)."""
    import argparse

    from dynemb.tables import prefetch
    from dynemb.trainer.config import add_arguments, from_args

    asked: list[str] = []
    monkeypatch.setattr(prefetch, "set_thread_priority", asked.append)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args("--steps 3 --num-sparse 2 --universe 500 --batch-size 8 --no-progress".split()))
    assert cfg.transform_priority == "normal" and cfg.prefetch > 0
    train(cfg)
    assert asked and set(asked) == {"normal"}
