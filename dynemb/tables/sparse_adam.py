"""Adam for embedding tables on CPU, where FBGEMM has none (its CPU TBE asserts SGD/Adagrad
and registers no CPU backward for Adam), with FBGEMM's GPU semantics: lazy (only the rows a
batch looked up are updated, as on the GPU), elementwise moments, bias correction by a step
count shared by all rows:

    m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
    w = w - lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay w)

How it gets each row's gradient without a backward of its own: the tables run with FBGEMM's
exact SGD at learning rate 1; a forward hook on each TBE saves the rows the lookup used and
zeroes them, so the fused backward leaves exactly -g (0 - 1 * g) in each used row; `step()`
(after backward) reads g, puts the saved rows back and applies Adam to them. This holds
because a sum/mean-pooled or unpooled lookup's gradient does not depend on the weights
(per-sample weights that need gradients are refused). The moments live beside the weights,
one (rows, dim) tensor each per table, and travel with the rows to the PS (TableRows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# An FBGEMM TBE (SplitTableBatchedEmbeddingBagsCodegen). fbgemm_gpu ships no type information,
# and nn.Module's type knows none of its methods (split_embedding_weights, feature_table_map, ...).
FusedTBE = Any


@dataclass
class _TBEAdam:
    weights: list[torch.Tensor]  # per table of the TBE: (rows, dim) views of its storage
    m: list[torch.Tensor]
    v: list[torch.Tensor]
    features: list[list[int]]  # per table: the TBE's features that look it up
    # rows the last training lookup used, per table, and their values before it zeroed them
    used: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    hook: object = field(default=None, repr=False)

    @property
    def states(self) -> list[list[torch.Tensor]]:
        """Per table, the optimizer state views that travel with a row: [m, v]."""
        return [[m, v] for m, v in zip(self.m, self.v)]


def fused_tbes(model: nn.Module) -> list[FusedTBE]:
    """The FBGEMM TBEs of the sharded embedding modules inside a DMP model."""
    from dynemb.tables.table_rows import embedding_kernels

    return [emb.emb_module for emb in embedding_kernels(model)]


class RowSparseAdam:
    """Adam on fused exact-SGD (learning rate 1) tables; call step() after each training
    backward, before the next training forward (TrainedOptimizer does)."""

    def __init__(
        self,
        tbes: list[FusedTBE],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        """tbes: FBGEMM TBEs running exact SGD at learning rate 1 (`fused_tbes(model)` of a DMP model)."""
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.iter = 0
        self.tables: list[_TBEAdam] = []
        for tbe in tbes:
            lr_now = tbe.get_learning_rate() if hasattr(tbe, "get_learning_rate") else None
            if lr_now is not None and lr_now != 1.0:
                raise ValueError(f"RowSparseAdam needs the tables' fused SGD at learning rate 1, got {lr_now}")
            weights = tbe.split_embedding_weights()
            fmap = list(tbe.feature_table_map)
            state = _TBEAdam(
                weights=weights,
                m=[torch.zeros_like(w, dtype=torch.float32) for w in weights],
                v=[torch.zeros_like(w, dtype=torch.float32) for w in weights],
                features=[[f for f, t in enumerate(fmap) if t == k] for k in range(len(weights))],
            )
            state.hook = tbe.register_forward_hook(self._make_hook(state), with_kwargs=True)
            tbe.dynemb_adam = state  # TableRows finds the moments here
            self.tables.append(state)

    @staticmethod
    def _make_hook(state: _TBEAdam):
        def after_lookup(tbe, args, kwargs, output):
            if not torch.is_grad_enabled():  # evaluation: nothing will be updated
                return
            if state.used is not None:
                raise RuntimeError("two training lookups without an optimizer step between them (RowSparseAdam)")
            names = ("indices", "offsets", "per_sample_weights")
            given = dict(zip(names, args)) | {k: kwargs[k] for k in names if k in kwargs}
            psw = given.get("per_sample_weights")
            if psw is not None and psw.requires_grad:
                raise NotImplementedError("RowSparseAdam: per-sample weights that need gradients")
            indices, offsets = given["indices"], given["offsets"]
            n_features = len(tbe.feature_table_map)
            batch = (offsets.numel() - 1) // max(1, n_features)
            starts = offsets[torch.arange(n_features + 1, device=offsets.device) * batch].tolist()  # per feature
            used = []
            with torch.no_grad():
                for w, feats in zip(state.weights, state.features):
                    parts = [indices[starts[f] : starts[f + 1]] for f in feats]
                    rows = torch.unique(torch.cat(parts)) if parts else indices[:0]
                    used.append((rows, w[rows].clone()))
                    # through .data: the TBE's backward holds its storage, and autograd's version
                    # check would refuse a tracked in-place write (the gradient does not read it)
                    w.data[rows] = 0
            state.used = used

        return after_lookup

    @torch.no_grad()
    def step(self) -> None:
        """Apply Adam to the rows the last training lookup used; nothing if there was none."""
        if all(s.used is None for s in self.tables):
            return
        self.iter += 1
        b1, b2 = self.betas
        c1, c2 = 1.0 - b1**self.iter, 1.0 - b2**self.iter
        for s in self.tables:
            for (rows, before), w, m, v in zip(s.used or [], s.weights, s.m, s.v):
                g = -w[rows].float()  # exact SGD at learning rate 1 from 0 left -g
                mr = m[rows].mul_(b1).add_(g, alpha=1 - b1)
                vr = v[rows].mul_(b2).addcmul_(g, g, value=1 - b2)
                m[rows], v[rows] = mr, vr
                update = (mr / c1) / ((vr / c2).sqrt() + self.eps)
                if self.weight_decay:
                    update += self.weight_decay * before.float()
                w[rows] = (before.float() - self.lr * update).to(w.dtype)
            s.used = None

    def state_dict(self) -> dict:
        """{'iter': the step count}; the moments are not in it."""
        return {"iter": self.iter}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count of state_dict()."""
        self.iter = int(state["iter"])


class TrainedOptimizer:
    """The optimizer the training loop steps: TorchRec's (dense + fused tables) plus, when the
    tables run Adam on CPU, RowSparseAdam's step after it."""

    def __init__(self, inner, sparse_adam: RowSparseAdam | None = None) -> None:
        self.inner, self.sparse_adam = inner, sparse_adam

    def zero_grad(self, set_to_none: bool = True) -> None:
        """zero_grad of the inner optimizer."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        """Step the inner optimizer, then RowSparseAdam if there is one."""
        self.inner.step(closure)
        if self.sparse_adam is not None:
            self.sparse_adam.step()

    def __getattr__(self, name):  # param_groups, state_dict, ... of the inner optimizer
        return getattr(self.inner, name)
