"""The one error of dynemb/trainer/tf: a checkpoint or a request that cannot be used, named."""

from __future__ import annotations

from dynemb.common.errors import UserError


class CheckpointError(UserError, ValueError):
    """A TensorFlow checkpoint that is missing, corrupt or truncated, an unknown dtype, a tensor
    that does not fit its table: the message names the file or tensor and what was expected."""
