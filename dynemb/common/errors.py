"""Errors about what a user gave (a file, a flag, a name) rather than about the PS.

The `dynemb` command prints these as one clear line, without a traceback, like PSError.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, named: the file or field, what was expected and what was found."""
