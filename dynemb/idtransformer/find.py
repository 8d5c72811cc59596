"""Find: a batch's IDs -> the slots that hold them, without admitting, touching or pinning.

What a forward without backward (evaluation) needs: transform admits the IDs it meets,
evicts others for them and counts every sighting, so a held-out batch run through it would
leave its IDs in the tables (and, once evicted or flushed, on the PS) and change what stays
resident. find_blocks only reads: each owner looks the IDs it owns up in its slot map and
answers the slot, or -1 for an ID it holds no row of. The exchange is transform's (route
and all_to_all, one call for all tables); the owner's side of it is returned as well, for
the caller to answer the missing IDs' rows (the owner's store holds them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.route import transpose_blocks
from dynemb.idtransformer.sharded import ShardedIDTransformer, _exchange, send_to_owners


class Found(NamedTuple):
    """A batch looked up. The send layout holds the batch's IDs by (owner, table) block; the
    asked layout holds what the other ranks asked this rank, by (source, table) block."""

    slots: torch.Tensor  # per ID of the batch, in its flat layout: the global slot, -1 if none
    answers: torch.Tensor  # the send layout's slots, as the owners answered them
    position: torch.Tensor  # where each ID of the batch stands in the send layout
    sent_counts: torch.Tensor  # (world, tables): IDs this rank asked each owner, per table
    asked: torch.Tensor  # the IDs asked of this rank, in the asked layout
    asked_slots: torch.Tensor  # their slots here (-1: no row here), the same layout
    asked_counts: torch.Tensor  # (world, tables): IDs each source rank asked, per table


# The owner's answer for the IDs it holds no row of: given each table's IDs asked of this rank
# and their slots (-1: none), each table's slots with the -1s replaced where it chooses.
AnswerMissing = Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]


def find_blocks(
    tables: list[ShardedIDTransformer],
    ids: torch.Tensor,
    sizes: list[int],
    answer_missing: AnswerMissing | None = None,
) -> Found:
    """Collective: the slots of one batch's IDs, for many tables in one exchange.

    Args:
        tables: every rank's same tables, in the same order (one group).
        ids: the batch's IDs of table 0, then those of table 1, ... (int64).
        sizes: how many IDs each table has in `ids`.
        answer_missing: on each owner, before the answers go back: the slots to answer for
            the IDs it holds no row of (see AnswerMissing); None answers -1.

    Returns:
        The slots, and both sides of the exchange (Found). Nothing of any table changes.
    """
    first = tables[0]
    group, world, device = first.group, first.world_size, first.device
    every = as_int64_ids(ids).reshape(-1).to(device)
    kernel = all(t.local.backend == "kernel" for t in tables)
    sent = send_to_owners(every, sizes, world, kernel, group)
    table_major = transpose_blocks(sent.asked, sent.asked_counts, kernel)
    per_table = torch.split(table_major, sent.asked_counts.sum(0).tolist())
    answered = [_find(t, x) for t, x in zip(tables, per_table)]
    if answer_missing is not None:
        answered = answer_missing(list(per_table), answered)
    found = torch.cat(answered) if tables else sent.asked[:0]
    asked_slots = transpose_blocks(found, sent.asked_counts.t(), kernel)
    answers = asked_slots if world == 1 else _exchange(asked_slots, sent.asked_per_rank, sent.sent_per_rank, group)
    slots = answers.index_select(0, sent.position)
    return Found(slots, answers, sent.position, sent.sent_counts, sent.asked, asked_slots, sent.asked_counts)


def _find(table: ShardedIDTransformer, ids: torch.Tensor) -> torch.Tensor:
    if ids.numel() == 0:
        return ids.clone()
    local = table.local.find(ids)
    return torch.where(local >= 0, local + table.offset, -1)
