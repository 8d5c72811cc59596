"""The batch path of a GPU job, through the same code on CPU tensors: the DLRM job with its ID
transformers on the triton backend (under Triton's interpreter) trains as it does on the
kernel's, and the batch's way through the tables (its layout, its KJT over slots) reads
nothing back from where the batch is: the map counts the IDs it did not admit into its one
copy, so no read of the slots decides how the KJT is cut. The two backends evict different IDs
(the triton map within buckets, the kernel in a global order), but an evicted row comes back
from the PS as it left, so where no ID is left out for want of a way the losses and rows are
the same; the hit rates differ a little."""

from __future__ import annotations

import dataclasses
import functools
import threading
import traceback

import numpy as np
import pytest
import torch
from helpers import config

from dynemb.idtransformer import sharded
from dynemb.tables import dynamic
from dynemb.tables.dynamic import DynamicTables
from dynemb.trainer.train import train

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="triton tables on CPU tensors (the interpreter)"),
    pytest.mark.torchrec,
]


def _on(backend: str, monkeypatch) -> None:
    """The job's ID transformers on `backend` (DynamicTables asks for "auto": the kernel on CPU)."""

    class Sharded(sharded.ShardedIDTransformer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **(kwargs | {"backend": backend}))

    monkeypatch.setattr(dynamic, "ShardedIDTransformer", Sharded)


class _Reads:
    """Scalar reads of tensors (what a sync is on a GPU) inside DynamicTables' batch path."""

    def __init__(self, monkeypatch) -> None:
        # per thread: the batch path runs on the transform thread too, beside the loop's reads
        self.depth = threading.local()
        self.reads: list[str] = []
        for name in ("item", "__bool__", "__int__", "__index__", "tolist"):
            original = getattr(torch.Tensor, name)

            def guard(tensor, *a, _original=original, _name=name, **kw):
                if getattr(self.depth, "n", 0) > 0 and tensor.numel() == 1:
                    caller = traceback.extract_stack(limit=3)[0]  # who read it: the failure names it
                    self.reads.append(f"{_name} at {caller.filename}:{caller.lineno}")
                return _original(tensor, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, guard)
        for method in ("_layout", "_over_slots", "_on_device"):
            original = getattr(DynamicTables, method)  # (_over_slots: a staticmethod's function)

            @functools.wraps(original)
            def watched(*a, _original=original, **kw):
                self.depth.n = getattr(self.depth, "n", 0) + 1
                try:
                    return _original(*a, **kw)
                finally:
                    self.depth.n -= 1

            monkeypatch.setattr(DynamicTables, method, staticmethod(watched) if method == "_over_slots" else watched)
        for method in ("look_up", "look_up_in_place"):  # evaluation: not the training batch's path
            original = getattr(DynamicTables, method)

            @functools.wraps(original)
            def unwatched(*a, _original=original, **kw):
                was = getattr(self.depth, "n", 0)
                self.depth.n = -(1 << 20)
                try:
                    return _original(*a, **kw)
                finally:
                    self.depth.n = was

            monkeypatch.setattr(DynamicTables, method, unwatched)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [1, 2], ids=["admit-at-once", "admit-at-2"])
def test_triton_tables_train_as_the_kernels_and_read_nothing_back(threshold, monkeypatch):
    """Twelve steps of the DLRM job (6 dynamic tables of 600 rows, hit rate ~0.56; with a
    threshold, IDs left out of their bags every batch): the same losses and rows as on the kernel's
    tables, hit rates within a few points, and on triton no scalar read in the batch's path."""
    cfg = config("rowwise_adagrad", dynamic=True, steps=12)
    cfg = dataclasses.replace(cfg, table=dataclasses.replace(cfg.table, admit_threshold=threshold))
    runs = {}
    reads = {}
    for backend in ("kernel", "triton"):
        with monkeypatch.context() as m:
            _on(backend, m)
            watch = _Reads(m)
            runs[backend] = train(cfg, collect_tables=True)
            reads[backend] = watch.reads
    kernel, triton = runs["kernel"], runs["triton"]
    assert triton.losses == kernel.losses and len(triton.losses) == 12
    assert abs(triton.hit_rate - kernel.hit_rate) < 0.05 and triton.hit_rate < 1.0, (triton.hit_rate, kernel.hit_rate)
    for name, (_, rows) in kernel.tables.items():
        np.testing.assert_array_equal(triton.tables[name][1], rows, err_msg=f"table {name}")
    assert reads["triton"] == [], f"scalar reads in the batch path on triton tables: {reads['triton'][:5]}"
    # the kernel's path counts the IDs left out by reading its slots (free on the CPU): the guard sees it
    assert any(r.startswith("__int__") for r in reads["kernel"])
