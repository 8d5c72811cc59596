"""The one form of a name that becomes a key or a path: a table's (on the PS, in a table folder,
a published version, a checkpoint), a Redis namespace's, and each part of a path a manifest
lists. Every place such a name enters checks it here: the PS's requests, the CLI's flags, the
files read, and each join of a name into a path (`inside`).

The rule: 1 to 128 of A-Z a-z 0-9 _ . -, the first not . or -. So no name is '.' or '..' (a
path out of the folder it is joined to), a hidden file, or a flag, and none holds a separator.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from dynemb.common.errors import UserError, shown

NAME_RULE = "use 1 to 128 of the characters A-Z a-z 0-9 _ . -, not starting with . or -"
# the whole name (fullmatch: `$` lets "t\n" through)
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def name_problem(name: object, what: str = "table name") -> str | None:
    """None if `name` is a valid name; else the one line that says why not (echoed capped)."""
    if isinstance(name, str) and NAME_RE.fullmatch(name):
        return None
    return f"{what} {shown(name)} is not valid: {NAME_RULE}"


def check_name(name: object, what: str = "table name", error: type[Exception] = UserError) -> str:
    """`name` if it is valid; else `error` naming it and the rule."""
    problem = name_problem(name, what)
    if problem is not None:
        raise error(problem)
    assert isinstance(name, str)
    return name


def inside(
    folder: str | os.PathLike, *names: str, what: str = "table name", error: type[Exception] = UserError
) -> Path:
    """folder / names[0] / names[1] ..., each name checked: a path that stays in folder."""
    path = Path(folder)
    for name in names:
        path = path / check_name(name, what, error)
    return path


def name_arg(what: str = "table name"):
    """An argparse `type` that refuses a bad name in argparse's one error line."""

    def parse(text: str) -> str:
        problem = name_problem(text, what)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return text

    parse.__name__ = what  # argparse names the type in some messages
    return parse
