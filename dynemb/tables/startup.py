"""What dynamic tables check before a job trains: the store's tables as an earlier run left them.

A table of the same name with another schema is refused (another job's, or this one's with other
settings), and rows in them are refused too unless the job says what to do with them: "warm"
trains on from them, "fresh" drops them first, "resume" lets a checkpoint replace them. A rerun
must not silently start from the embeddings of the last one (and fresh dense layers).

One store call for all of it (each table's schema and rows), made by rank 0 where the ranks
share a PS, by each rank where each keeps its own rows. Every rank raises the same error, so
none is left waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dynemb.common.errors import UserError
from dynemb.ps_server.errors import PSError
from dynemb.ps_server.schema import TableSchema
from dynemb.tables.config import STARTS
from dynemb.tables.row_store import RowStore

log = logging.getLogger("dynemb.tables")


class StartRefused(UserError):
    """Tables that will not start as asked: what was found, and how to say what to do."""


@dataclass(frozen=True)
class StartWords:
    """How the messages name the choices: the API's arguments, or a CLI's flags."""

    warm: str = 'start="warm" trains on from them'
    fresh: str = 'start="fresh" drops them first'
    resume: str = 'start="resume" with restore() continues from a checkpoint'
    prefix: str = "table_prefix= gives this job tables of its own"
    dropped: str = "start=fresh"  # what the line on a fresh start's drop begins with
    schema_fields: tuple[tuple[str, str], ...] = (
        ("dim", "the table's embedding_dim"),
        ("state_width", "the fused optimizer"),
        ("initializer", "TableConfig.initializer"),
    )


def check_tables(
    wanted: list[TableSchema], store: RowStore, start: str, rank: int = 0, words: StartWords = StartWords()
) -> None:
    """The store's tables against the job's (not collective; see agree()).

    Args:
        wanted: the job's tables.
        store: where their rows are.
        start: "new" (refuse rows left by an earlier run), "warm", "fresh" or "resume".
        rank: this rank (only rank 0 logs).
        words: how messages name the choices.

    Raises:
        StartRefused: a table with another schema, or rows left while start is "new".
    """
    if start not in STARTS:
        raise ValueError(f"start must be one of {', '.join(STARTS)}, got {start!r}")
    found, where = store.tables(), store.where
    mine = {s.name: s for s in wanted}
    left = {name: found[name] for name in mine if name in found}  # name: (schema, rows), in the job's order
    if not left:
        return
    if start == "fresh":
        rows = sum(n for _, n in left.values())
        for name in left:
            store.drop_table(name)
        if rank == 0:
            what = f"{len(left)} tables ({_names(left)}, {rows:,} rows)"
            log.warning("%s: dropped %s on %s", words.dropped, what, where)
        return
    for name, (schema, _) in left.items():
        if schema != mine[name]:
            raise StartRefused(
                f"{where} holds a table {name} with another schema than this job's "
                f"({_differences(schema, mine[name], dict(words.schema_fields))}), left by another job or a run with "
                f"other settings: {words.prefix}, run with that run's settings, or drop the tables: {words.fresh}"
            )
    rows = sum(n for _, n in left.values())
    if rows and start == "new":
        holding = {name: v for name, v in left.items() if v[1]}
        raise StartRefused(
            f"{where} already holds {rows:,} rows in {len(holding)} of this job's tables ({_names(holding)}), "
            f"left by an earlier run: {words.warm}, {words.fresh}, {words.resume}, {words.prefix}"
        )


def agree(check: Callable[[], None], store: RowStore, group: dist.ProcessGroup | None = None) -> None:
    """Collective: run `check` on rank 0 (on every rank where each keeps its own rows), and raise
    its error, if any, on every rank: the error itself where it is a user's, else its text."""
    rank = dist.get_rank(group)
    mine: Exception | None = None
    if rank == 0 or store.per_rank:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            mine = exc
    told = mine
    if mine is not None and not isinstance(mine, (UserError, PSError, OSError)):
        told = RuntimeError(f"rank {rank}: {type(mine).__name__}: {mine}")
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, told, group=group)
    if mine is not None:
        raise mine
    first = next((e for e in every if e is not None), None)
    if first is not None:
        raise first


def _names(tables: dict) -> str:
    names = list(tables)
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"


def _differences(there: TableSchema, here: TableSchema, fields: dict[str, str]) -> str:
    a, b = there.to_dict(), here.to_dict()
    return "; ".join(
        f"{key} {a[key]} there, {b[key]} for this job ({fields.get(key, key)})"
        for key in a
        if key != "name" and a[key] != b[key]
    )
