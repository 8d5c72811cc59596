"""Rows that expire: a table's lifecycle (TTL, row cap), the stamp every row carries, and the
rules a sweep deletes by. The same on every backend (docs/ps.md, "Rows that expire").

Every row carries a stamp: the time (Unix seconds, uint32) it was last written or read by a
trainer. Writes stamp rows with the PS's clock; pulls refresh the stamps of rows older than
`touch_every_s`; trainers refresh the rows resident on their devices (which the PS does not see
used) every `touch_every_s` with `touch`. So a row in use is never older than about twice
`touch_every_s`, and nothing younger than `keep_s` (more than that, with room for late
touches) is ever deleted by a sweep:

- TTL: rows whose stamp is older than ttl_s are expired: a pull treats them as absent (the ID
  comes back as a never-seen one), and a sweep deletes them;
- row cap: past max_rows (counted row by row, not from the kept count, which a PS killed between
  a write and its count change leaves off), a sweep deletes exactly the rows over the cap, the
  oldest stamps first and, within one stamp, the lowest ids first (a Cutoff), but none younger
  than keep_s: a table whose rows are all in use stays over its cap, and says so (rows_over_cap).

Stamps written before a lifecycle was set count as the time it was set (`since`), so setting a
TTL on a live table never expires, at once, rows that were read but not written since.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from dynemb.protos import ps_pb2
from dynemb.ps_server.errors import InvalidArgument

STAMP_BYTES = 4
STAMP_DTYPE = np.dtype("<u4")

# How often rows in use are touched, for a table with a cap and no TTL (with a TTL: ttl_s / 4).
DEFAULT_TOUCH_EVERY_S = 600
# The shortest TTL and touch interval (whole seconds: the stamps' resolution).
MIN_TTL_S = 4
MIN_TOUCH_EVERY_S = 1
# The longest TTL: about 68 years, so that a cutoff stays within the stamps' uint32.
MAX_TTL_S = 1 << 31
MAX_ROWS = 1 << 48


def now_stamp(now: float | None = None) -> int:
    """The stamp of `now` (default: this moment): whole Unix seconds."""
    return int(time.time() if now is None else now)


def stamp_bytes(now: float | None = None) -> bytes:
    """The 4 bytes a row written at `now` carries after its values (little-endian uint32)."""
    return now_stamp(now).to_bytes(STAMP_BYTES, "little")


class Lifecycle(NamedTuple):
    """When a table's rows leave the PS.

    Args:
        ttl_s: rows neither written nor read for this many seconds are deleted; 0: never.
        max_rows: past this many rows the least recently used go first; 0: no cap.
        touch_every_s: how often rows in use are touched (pulls refresh older stamps; trainers
            touch their resident rows); 0: ttl_s / 4, or DEFAULT_TOUCH_EVERY_S without a TTL.
        since: when the lifecycle was set (Unix seconds; set by the store).
    """

    ttl_s: int = 0
    max_rows: int = 0
    touch_every_s: int = 0
    since: int = 0

    @property
    def active(self) -> bool:
        """Whether rows of this table ever expire."""
        return bool(self.ttl_s or self.max_rows)

    @property
    def touch_interval_s(self) -> int:
        """Seconds between touches of a row in use (touch_every_s, or the default)."""
        if self.touch_every_s:
            return self.touch_every_s
        return max(MIN_TOUCH_EVERY_S, self.ttl_s // 4) if self.ttl_s else DEFAULT_TOUCH_EVERY_S

    @property
    def keep_s(self) -> int:
        """Rows younger than this are never deleted by a sweep: a row in use is refreshed at
        least every 2 touch intervals (read at up to one interval old, then touched within the
        next); a third is room for late touches."""
        return 3 * self.touch_interval_s

    def expired_before(self, now: float | None = None) -> int:
        """The stamp below which rows are expired by the TTL (0: no TTL, nothing expires)."""
        return max(0, now_stamp(now) - self.ttl_s) if self.ttl_s else 0

    def refresh_before(self, now: float | None = None) -> int:
        """The stamp below which a read row's stamp is refreshed (0: no lifecycle, never)."""
        return max(0, now_stamp(now) - self.touch_interval_s) if self.active else 0

    def to_dict(self) -> dict:
        return {k: int(v) for k, v in self._asdict().items() if v}

    @classmethod
    def from_dict(cls, d: dict | None) -> Lifecycle:
        d = d or {}
        return cls(**{k: int(d.get(k, 0)) for k in cls._fields})

    def to_proto(self) -> ps_pb2.Lifecycle:
        return ps_pb2.Lifecycle(**self._asdict())

    @classmethod
    def from_proto(cls, m: ps_pb2.Lifecycle) -> Lifecycle:
        """The lifecycle a message asks for (values over the limits are refused by checked())."""
        return cls(*(min(int(getattr(m, k)), 1 << 62) for k in cls._fields))

    def checked(self, table: str) -> Lifecycle:
        """This lifecycle if it is valid; InvalidArgument naming the setting and its limit."""
        where = f"table {table!r}"
        if self.ttl_s and not MIN_TTL_S <= self.ttl_s <= MAX_TTL_S:
            raise InvalidArgument(
                f"{where}: ttl {self.ttl_s} s is out of range: use 0 (never) or {MIN_TTL_S} to {MAX_TTL_S} s"
            )
        if self.ttl_s < 0 or self.max_rows < 0 or self.touch_every_s < 0:
            raise InvalidArgument(f"{where}: ttl, max_rows and touch_every must be >= 0 (0: not set)")
        if self.max_rows > MAX_ROWS:
            raise InvalidArgument(f"{where}: max_rows {self.max_rows} is over the limit of {MAX_ROWS}")
        if self.touch_every_s and self.touch_every_s > MAX_TTL_S:
            raise InvalidArgument(f"{where}: touch_every {self.touch_every_s} s is over the limit of {MAX_TTL_S} s")
        if self.ttl_s and 2 * self.touch_interval_s > self.ttl_s:
            # a row in use is refreshed at least every 2 touch intervals: that must fit the TTL
            raise InvalidArgument(
                f"{where}: touch_every {self.touch_every_s} s is too long for a ttl of {self.ttl_s} s: "
                f"rows in use must be touched at most every ttl / 2 = {self.ttl_s // 2} s"
            )
        return self


class SweepSlice(NamedTuple):
    """What one slice of a sweep did.

    Attributes:
        cursor: where the next slice starts; 0 when the pass is done.
        scanned: rows looked at.
        deleted: the ids deleted (each logged in the table's deletion log).
        oldest: the oldest stamp among the rows the slice kept (0: it kept none).
    """

    cursor: int
    scanned: int
    deleted: np.ndarray
    oldest: int = 0


class Deletions(NamedTuple):
    """A stretch of a table's deletion log.

    Attributes:
        ids: the ids that left the table (expired, deleted, or the whole table dropped), in
            the order logged; an id may appear more than once, and one stored again since is
            stored (a reader checks what it needs to).
        times: when each was logged (Unix seconds, float64).
        cursor: where the next read starts (pass it as `after`).
        gap: the log was trimmed past `after`: some deletions since are no longer there.
    """

    ids: np.ndarray
    times: np.ndarray
    cursor: str
    gap: bool


class Drop(NamedTuple):
    """A table dropped: its name and when (Unix seconds)."""

    table: str
    time: float


class Drops(NamedTuple):
    """A stretch of a store's log of dropped tables (every row of each left with it).

    Attributes:
        drops: the tables dropped after the cursor, oldest first.
        cursor: where the next read starts (pass it as `after`).
        gap: the log was trimmed past `after`: some drops are no longer there.
    """

    drops: list[Drop]
    cursor: str
    gap: bool


# Drops a store's log keeps.
DROP_LOG_ENTRIES = 10_000


# The lowest int64 id: a Cutoff at (stamp, LOWEST_ID) makes due exactly the rows stamped below it.
LOWEST_ID = -(1 << 63)


class Cutoff(NamedTuple):
    """Where a sweep deletes up to: a row is due if (its stamp, its id) < (stamp, id). The id
    splits one stamp's rows, so that the row cap deletes exactly down to the cap even when many
    rows share a second (one push). Cutoff(): nothing is due; Cutoff(s): the rows stamped below s.
    Cutoffs order as tuples do: max() of two deletes what either would, min() what both would."""

    stamp: int = 0
    id: int = LOWEST_ID

    def due(self, stamps: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of the rows (their stamps, `since` applied, and ids) this cutoff makes due."""
        return (stamps < self.stamp) | ((stamps == self.stamp) & (ids < self.id))
