"""Errors about what a user gave (a file, a flag, a name) rather than about the PS.

The `dynemb` command prints these as one clear line, without a traceback, like PSError.
"""

from __future__ import annotations

SHOWN_CHARS = 64


def shown(value) -> str:
    """`value` as an error message quotes it: its repr, cut short when long. What a message
    quotes may be megabytes (a hostile table name, a corrupt file's field), and a gRPC status
    message over the client's metadata limit (16 KiB) never arrives at all: the client gets
    RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead."""
    if isinstance(value, (str, bytes)) and len(value) > SHOWN_CHARS:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} {unit})"
    text = repr(value)
    if len(text) > 2 * SHOWN_CHARS:
        return f"{text[: 2 * SHOWN_CHARS]}... (a {type(value).__name__} of {len(text)} characters)"
    return text


class UserError(Exception):
    """Bad input, named: the file or field, what was expected and what was found."""
