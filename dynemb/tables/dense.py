"""The dense part of a TorchRec model: the parameters a dense optimizer steps after backward.

TorchRec's apply_optimizer_in_backward gives the embedding tables their own (fused) optimizer,
applied during backward; every other parameter (MLPs, interaction layers) is left to an
ordinary optimizer. A model builder hands those to its dense optimizer, and a checkpoint saves
and restores them with it (dynemb/checkpoint/checkpoint.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.optim.optimizers import in_backward_optimizer_filter


def dense_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters not updated in backward (the dense layers'), by name.

    Args:
        model: a TorchRec model (DistributedModelParallel or the module it wraps), its tables'
            optimizer applied in backward.

    Returns:
        Each such parameter by its name in model.named_parameters(), in that order.
    """
    return dict(in_backward_optimizer_filter(model.named_parameters()))
