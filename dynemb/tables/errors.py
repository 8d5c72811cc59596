"""The tables' own error: a set-up that cannot work, said in one line with its fix."""

from __future__ import annotations

from dynemb.common.errors import UserError


class SetupError(UserError):
    """Dynamic tables that cannot be put in front of the model as given: what is wrong and the fix."""
