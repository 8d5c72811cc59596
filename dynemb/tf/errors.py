"""The one error of dynemb/tf (`dynemb tf ls|migrate`): a TensorFlow checkpoint, or a
request to migrate tables out of one, that cannot be used, named.

Not dynemb.checkpoint.format.CheckpointError, which is about dynemb's own training
checkpoints; this one has its own name so that neither is caught or raised for the other.
"""

from __future__ import annotations

from dynemb.common.errors import UserError


class TFMigrationError(UserError, ValueError):
    """A TensorFlow checkpoint that is missing, corrupt or truncated, an unknown dtype, a tensor
    that does not fit its table, a --table spec or flag that cannot be met: the message names the
    file, tensor or flag and what was expected. A UserError, so `dynemb` prints it as one line."""
