"""A table's change log: the ids pushed to it, each logged before its row is written, so that a
publisher (dynemb.publish) finds the rows changed since its last version at a cost that grows
with the changes, not with the table (docs/publish.md).

Off unless a table asks for it (SetChangeLog, or its spec at creation): a table that is never
published pays nothing. On, each push appends its ids (8 bytes each, and its time) to the log,
which keeps the newest `max_ids`; a reader that falls further behind than that is told (gap)
and publishes a full version instead. Ids are logged before the write, so a write cut short
leaves ids logged whose rows did not change (a reader pulls them and finds them as they are),
never the reverse. Deletions have their own log (lifecycle.py, Deletions).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dynemb.ps_server.errors import InvalidArgument

# Ids a change log keeps when turned on without a size (128 MiB of ids on Redis).
DEFAULT_MAX_IDS = 1 << 24
MIN_MAX_IDS = 1 << 12
MAX_MAX_IDS = 1 << 30


def checked_max_ids(table: str, max_ids: int) -> int:
    """max_ids if it is 0 (off) or within the limits; InvalidArgument naming them if not."""
    if max_ids and not MIN_MAX_IDS <= max_ids <= MAX_MAX_IDS:
        raise InvalidArgument(
            f"table {table!r}: a change log of {max_ids} ids is out of range: use 0 (off) or "
            f"{MIN_MAX_IDS} to {MAX_MAX_IDS} ids"
        )
    return int(max_ids)


def no_change_log(table: str) -> InvalidArgument:
    """The error for reading the change log of a table that keeps none."""
    return InvalidArgument(
        f"table {table!r} keeps no change log: turn it on first (SetChangeLog; `dynemb ps changes {table} --on`)"
    )


class Changes(NamedTuple):
    """A stretch of a table's change log.

    Attributes:
        ids: the ids pushed, in the order logged; an id pushed several times appears as often,
            and one deleted since is not stored (a reader pulls them to see what is).
        times: when each was logged (Unix seconds, float64).
        cursor: where the next read starts (pass it as `after`).
        gap: ids logged after `after` are no longer there (the log was trimmed past it, or the
            cursor is from another log: the table was made again): read the whole table.
    """

    ids: np.ndarray
    times: np.ndarray
    cursor: str
    gap: bool
