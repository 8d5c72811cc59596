"""Cut version v of a table from the PS: the rows changed since v-1 and the ids deleted since,
or every row (a full version), into a version folder (version.py; docs/publish.md).

What changed comes from the PS's logs, read from the cursors the version before recorded:
- the table's change log (change_log.py): the ids pushed since (turned on by the first publish);
- its deletion log: the ids expired or deleted since;
- the store's log of dropped tables: a table dropped (and made again) since gets a full version.

The ids of both logs, made unique, are pulled: the ones found are the delta's rows (their
embedding part, in the version's dtype), the ones missing its tombstones. So a delta costs what
changed, not the table's size. The cursors are read before the rows: a row written meanwhile
comes in this version as it is then, and again in the next, so a version is never older than
its cut; with writers stopped at the cut (a training job's `--publish-every` flushes every rank
first) it is the PS's rows at the cut, exactly.

A full version comes first, then every `full_every` versions, and whenever the logs cannot say
what changed (a log trimmed past the cursor, the table dropped, its schema, dtype or PSes
changed): a new serving replica starts from the newest full and the deltas after it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from dynemb.common.arrays import unique
from dynemb.ps_server.change_log import DEFAULT_MAX_IDS
from dynemb.ps_server.schema import TableSchema
from dynemb.publish.version import DEFAULT_ROWS_PER_FILE, Version, VersionWriter, folder_name, numbers, table_folder

log = logging.getLogger("dynemb.publish")

DEFAULT_FULL_EVERY = 24
# Ids a log read asks each PS for; rows a pull moves at once.
LOG_READ_IDS = 1 << 20
PULL_IDS = 1 << 18


@dataclass(frozen=True)
class PublishConfig:
    """How a table's versions are cut.

    Args:
        root: the published tables' folder (versions go to root/<table>/vNNNNNNNN/).
        dtype: the rows' published dtype (fp32, fp16, bf16, int8); None: the table's own.
        full_every: a full version every this many versions (1: every version is full).
        change_log: ids the PS's change log of the table keeps, if the publisher turns it on:
            a publisher that falls further behind than that publishes a full version.
        rows_per_file: rows per safetensors file of a version.
    """

    root: str | os.PathLike
    dtype: str | None = None
    full_every: int = DEFAULT_FULL_EVERY
    change_log: int = DEFAULT_MAX_IDS
    rows_per_file: int = DEFAULT_ROWS_PER_FILE

    def __post_init__(self) -> None:
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1 (1: every version full), got {self.full_every}")


@dataclass(frozen=True)
class _Cursors:
    """Where the PS's logs stood at a cut: each a client cursor (one per PS, comma-joined)."""

    changes: str
    deletions: str
    drops: str

    def to_dict(self) -> dict:
        return {"changes": self.changes, "deletions": self.deletions, "drops": self.drops}


def publish_table(
    client,
    table: str,
    config: PublishConfig,
    *,
    step: int = 0,
    full: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Version:
    """Cut the table's next version from the PS (see the module).

    Args:
        client: a PSClient of the PSes that hold the table.
        table: the table's name.
        config: where versions go and how (PublishConfig).
        step: the training step of the cut (0: none), kept in the manifest.
        full: a full version whatever the chain.
        progress: called with the rows written, as they are.

    Returns:
        The version written (its manifest, folder set).

    Raises:
        TableNotFound: no such table on the PS.
        VersionError: the versions there are not of this table, or one is unreadable.
    """
    folder = table_folder(config.root, table)  # the name checked before the PS is asked
    info = client.describe_table(table)
    schema = info.schema
    dtype = config.dtype or schema.dtype
    have = numbers(config.root, table)
    previous = Version.read(folder / folder_name(have[-1])) if have else None
    why_full = "asked for" if full else _why_full(client, schema, dtype, config, previous)
    if not info.change_log:  # nothing before this moment is logged: this version is full
        log.info("table %s: turning on its change log (%d ids a PS)", table, config.change_log)
        client.set_change_log(table, config.change_log)
        why_full = why_full or "the table kept no change log (turned on now)"
    addresses = list(client.addresses)
    if why_full is None:
        assert previous is not None
        before = _Cursors(**previous.source["cursors"])
        ends = _ends(client, table)
        drops = _read_to(partial(client.read_drops, limit=1000), before.drops, ends.drops)
        changes = _read_to(partial(client.read_changes, table, limit=LOG_READ_IDS), before.changes, ends.changes)
        deletions = _read_to(
            partial(client.read_deletions, table, limit=LOG_READ_IDS), before.deletions, ends.deletions
        )
        changed = np.concatenate([np.zeros(0, np.int64), *(got.ids for got in changes)])
        deleted = np.concatenate([np.zeros(0, np.int64), *(got.ids for got in deletions)])
        if any(got.gap for got in drops + changes + deletions):
            why_full = "a log of the PS was trimmed past the last version's cursor"
        elif any(d.table == table for got in drops for d in got.drops):
            why_full = f"table {table!r} was dropped since the last version"
    else:
        ends = _ends(client, table)
    number = have[-1] + 1 if have else 1
    source = {"kind": "ps", "addresses": addresses, "cursors": ends.to_dict()}
    if why_full is not None:
        log.info("table %s: version %d is full (%s)", table, number, why_full)
        writer = VersionWriter(
            config.root, table, number, "full", previous.number if previous else None, number, dtype, schema.dim,
            step, config.rows_per_file, {**source, "full_because": why_full},
        )  # fmt: skip
        with writer:
            for ids, rows in client.export(table, rows_per_chunk=config.rows_per_file):
                writer.write_rows(ids, rows[:, : schema.dim])
                if progress is not None:
                    progress(len(ids))
        return writer.close()
    assert previous is not None
    candidates = unique(np.concatenate([changed, deleted]))
    writer = VersionWriter(
        config.root, table, number, "delta", previous.number, previous.base, dtype, schema.dim, step,
        config.rows_per_file, source,
    )  # fmt: skip
    with writer:
        gone = []
        for ids, rows, missing in _pulled(client, table, candidates, config.rows_per_file):
            writer.write_rows(ids[~missing], rows[~missing, : schema.dim])
            gone.append(ids[missing])
            if progress is not None:
                progress(len(ids))
        writer.write_deleted(np.concatenate(gone) if gone else np.zeros(0, np.int64))
    return writer.close()


def _why_full(client, schema: TableSchema, dtype: str, config: PublishConfig, previous: Version | None) -> str | None:
    """Why the next version cannot be a delta of `previous` (None: it can)."""
    if previous is None:
        return "the first version"
    cursors = previous.source.get("cursors")
    if previous.table != schema.name or not isinstance(cursors, dict) or set(cursors) != set(_Cursors.__annotations__):
        return f"version {previous.number} recorded no cursors of the PS's logs"
    if previous.source.get("addresses") != list(client.addresses):
        return f"the PSes are not those of version {previous.number} ({previous.source.get('addresses')})"
    if previous.dim != schema.dim or previous.dtype != dtype:
        return f"version {previous.number} is of dim {previous.dim}, {previous.dtype}; now dim {schema.dim}, {dtype}"
    if previous.number - previous.base + 1 >= config.full_every:
        return f"a full version every {config.full_every}"
    return None


def _ends(client, table: str) -> _Cursors:
    """The cursors of the logs' ends now: what a version cut now has read up to."""
    return _Cursors(
        client.read_changes(table, "$").cursor,
        client.read_deletions(table, "$").cursor,
        client.read_drops("$").cursor,
    )


def _reached(cursor: str, end: str) -> bool:
    """Whether every PS's cursor is at or past its end."""
    return all(int(c) >= int(e) for c, e in zip(cursor.split(","), end.split(",")))


def _read_to(read: Callable, after: str, end: str) -> list:
    """The stretches read(at) of a log (read_changes, read_deletions, read_drops) from cursor
    `after` until every PS's cursor is at `end` (or the log has no more)."""
    got: list = []
    while not _reached(after, end):
        got.append(read(after))
        if got[-1].cursor == after:
            break
        after = got[-1].cursor
    return got


def _pulled(client, table: str, ids: np.ndarray, per: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, rows, missing) of the ids, pulled in runs of at most `per`."""
    for lo in range(0, len(ids), per):
        part = ids[lo : lo + per]
        got = client.pull(table, part)
        yield part, got.rows, got.missing
