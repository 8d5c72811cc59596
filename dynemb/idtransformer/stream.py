"""TransformStream: sharded transforms of a stream of batches, one exchange per batch.

transform_blocks (sharded.py) takes three all_to_alls a batch: the counts, the IDs, the
answers. A stream of batches needs only one, because every message's size can be known a
batch ahead. Exchange k carries, from each rank to each other:

    the answers (slots) to the IDs that rank sent in exchange k - 1, and the owner's refusal
    flags for that batch (one per table);
    the IDs of batch k that rank owns (their number went in exchange k - 1);
    the number of IDs of batch k + 1 that rank owns, per table, and whether there is a batch k + 1.

Between exchanges each owner transforms the IDs it received (transform_received), in the
same order as transform_blocks does (per table, rank 0's requests first), so the slots, the
evictions and everything after them are the same. A batch's slots come back one exchange
after its IDs went out:

    stream = TransformStream(tables, pin=True)
    stream.exchange(ids_0, sizes_0, tag_0)             # batch 0's counts go out
    while stream.open:
        answered = stream.exchange(ids_next, sizes_next, tag_next)   # or None at the end
        if answered: done(answered.tag, answered.slots, answered.results)   # an earlier batch's
        if stream.received: owned = stream.transform_received()   # this batch's share, here

The stream ends once a rank has no next batch (None): every rank learns it from that
exchange's counts, and a rank that did have one drops it (`dropped` holds its tag). A batch
that some owner refused raises BatchRefused from the exchange that brings its answers, on
every rank, carrying the results as transform_blocks' does; the stream is over then, and the
IDs of the batch after it, already received, are not transformed. Tables on one rank exchange
nothing: the message goes to the rank itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.route import Routed, route
from dynemb.idtransformer.sharded import (
    ShardedIDTransformer,
    ShareResults,
    _refused,
    local_dropped,
    transform_share,
)


class Answered(NamedTuple):
    """A batch whose answers came in an exchange."""

    tag: object  # the caller's tag of the batch
    slots: torch.Tensor  # the slots of its IDs, its tables' blocks end to end
    results: ShareResults  # per table, its ShardedTransformResult


class _Outgoing(NamedTuple):
    """A batch routed, whose IDs go out in the next exchange."""

    routed: Routed
    sizes: list[int]  # the caller's block per table
    tag: object


@dataclass
class _Awaiting:
    """A batch whose IDs went out, until its answers come back."""

    position: torch.Tensor  # where each of its IDs went in the send layout (Routed.position)
    sizes: list[int]
    asked: list[int]  # how many IDs it asked each owner: the sizes of the answers
    tag: object
    results: ShareResults | None = None  # this rank's share of it, once transformed


class _Answers(NamedTuple):
    """This rank's answers to the batch it transformed last, to go out in the next exchange."""

    slots: torch.Tensor  # in (source, table) blocks
    flags: torch.Tensor  # per table, whether this rank refused its share
    per_source: list[int]  # the answers for each source rank


class _Message(NamedTuple):
    """What one rank sends another in an exchange (in the order of the module's docstring): each
    part a tensor, or the size of that tensor. answers and flags are None unless answering."""

    answers: Any  # the slots of the IDs the receiver asked last time
    flags: Any  # per table, whether the sender refused that batch
    ids: Any  # the IDs the sender asks the receiver about
    header: Any  # per table, the IDs of the sender's next batch for the receiver; then whether it has one


def _pieces(message: _Message) -> list:
    """The parts of a message that travel."""
    return [x for x in message if x is not None]


def _unpack(got: torch.Tensor, layout: list[_Message]) -> list[_Message]:
    """The messages from each rank, cut from what came in by the sizes `layout` gives."""
    parts = iter(torch.split(got, [n for m in layout for n in _pieces(m)]))
    return [_Message(*(None if n is None else next(parts) for n in m)) for m in layout]


class TransformStream:
    """Sharded transforms of a stream of batches, one exchange each (see the module doc).

    Args:
        tables: the tables, each a ShardedIDTransformer of the same group.
        pin: pin each batch's slots until it is released.
    """

    def __init__(self, tables: list[ShardedIDTransformer], pin: bool = False) -> None:
        if not tables:
            raise ValueError("a transform stream needs at least one table")
        self.tables, self.pin = tables, pin
        first = tables[0]
        self.group, self.world, self.device = first.group, first.world_size, first.device
        self.n_tables = len(tables)
        self.kernel = all(t.local.backend == "kernel" for t in tables)  # else torch ops (CUDA)
        self.open = True  # another exchange is due
        self.received: torch.Tensor | None = None  # IDs to transform here, in (table, source) blocks
        self.dropped: list = []  # tags of batches a rank had when another had none
        self._started = False
        self._out: _Outgoing | None = None  # the batch whose IDs go out next
        self._in_counts: torch.Tensor | None = None  # (source, table): the IDs of that batch coming here
        self._recv_matrix: torch.Tensor | None = None
        self._answers: _Answers | None = None
        self._errors: list = []  # per table, this rank's refusal of the batch it transformed last
        self._awaiting: deque[_Awaiting] = deque()

    def exchange(self, ids: torch.Tensor | None, sizes: list[int] | None = None, tag=None) -> Answered | None:
        """Collective. Args: ids, sizes: the next batch (its tables' IDs end to end, as in
        transform_blocks), or None when this rank has no more; tag: the caller's, returned with
        its answers. Returns the batch whose answers came in this exchange, or None."""
        if not self.open:
            raise RuntimeError("this transform stream is over")
        if self.received is not None:
            raise RuntimeError("transform_received() the IDs of the last exchange before the next one")
        upcoming = None
        if ids is not None and self.taking:
            ids = as_int64_ids(ids).reshape(-1).to(self.device)
            if sizes is None or len(sizes) != self.n_tables or sum(sizes) != ids.numel():
                raise ValueError(f"sizes must give the {self.n_tables} tables' blocks of the {ids.numel()} IDs")
            upcoming = _Outgoing(route(ids, sizes, self.world, self.kernel), list(sizes), tag)
        elif ids is not None:  # the stream is ending: the batch goes nowhere
            self.dropped.append(tag)
        self._started = True
        T, world = self.n_tables, self.world

        # what goes to each rank and what comes from each; answers go both ways or neither: a
        # batch went out last time on every rank or on none
        answering = bool(self._awaiting)
        header = torch.zeros(world, T + 1, dtype=torch.int64, device=self.device)
        if upcoming is not None:
            header[:, :T] = upcoming.routed.counts.view(world, T)
            header[:, T] = 1
        out = self._out
        out_per_dest = out.routed.counts.view(world, T).sum(1).tolist() if out is not None else [0] * world
        in_per_source = self._in_counts.sum(1).tolist() if self._in_counts is not None else [0] * world
        ids_out = torch.split(out.routed.send, out_per_dest) if out is not None else [header[0, :0]] * world
        if answering:
            mine = self._answers
            assert mine is not None, "transform_received() comes between exchanges"
            answers = torch.split(mine.slots, mine.per_source)
            asked = self._awaiting[0].asked  # what this rank asked each owner: the answers' sizes
            sending = [_Message(answers[d], mine.flags, ids_out[d], header[d]) for d in range(world)]
            layout = [_Message(asked[s], T, in_per_source[s], T + 1) for s in range(world)]
        else:
            sending = [_Message(None, None, ids_out[d], header[d]) for d in range(world)]
            layout = [_Message(None, None, in_per_source[s], T + 1) for s in range(world)]
        send = torch.cat([x for m in sending for x in _pieces(m)])
        if world == 1:  # the message is for this rank itself
            got = send
        else:
            recv_sizes = [sum(_pieces(m)) for m in layout]
            send_sizes = [sum(x.numel() for x in _pieces(m)) for m in sending]
            got = torch.empty(sum(recv_sizes), dtype=torch.int64, device=self.device)
            dist.all_to_all_single(got, send, recv_sizes, send_sizes, group=self.group)

        received = _unpack(got, layout)
        headers = torch.stack([m.header for m in received])
        if out is not None:  # this batch's IDs went out: their answers come next time
            self._awaiting.append(_Awaiting(out.routed.position, out.sizes, out_per_dest, out.tag))
            self._recv_matrix = self._in_counts
            self.received = torch.cat([m.ids for m in received])
        more = bool(headers[:, T].all())
        if upcoming is not None and not more:
            self.dropped.append(upcoming.tag)
        self._out = upcoming if more else None
        self._in_counts = headers[:, :T].contiguous() if more else None
        self._answers = None
        if not answering:
            self.open = more or bool(self._awaiting)
            return None

        done = self._awaiting.popleft()
        assert done.results is not None  # transform_received() set them
        self.open = more or bool(self._awaiting)
        flat_slots = torch.cat([m.answers for m in received]).index_select(0, done.position)
        done.results.set_slots(flat_slots, done.sizes)
        refusals = torch.stack([m.flags for m in received])  # (owner, table)
        if bool(refusals.any()):
            self.open = False
            self.received = None  # the next batch's IDs: not transformed, the stream is over
            refused_by = [torch.nonzero(column).squeeze(1).tolist() for column in refusals.t().cpu()]
            error = next((e for e in self._errors if e is not None), None)
            raise _refused(done.results, self._errors, refused_by, self.tables[0].rank, self.tables) from error
        return Answered(done.tag, flat_slots, done.results)

    @property
    def taking(self) -> bool:
        """Whether the next exchange takes a batch (the ranks have all had one so far)."""
        return self.open and (not self._started or self._out is not None)

    def transform_received(self) -> ShareResults:
        """This rank's share of the batch whose IDs came in the last exchange, transformed: per
        table a ShardedTransformResult whose `owned` is what to move here (rows to pull and to
        push) and whose `slots` arrive with the exchange that answers the batch. A share this
        rank refused is empty (its error goes out with the answers, and comes back from that
        exchange as BatchRefused on every rank)."""
        if self.received is None or self._recv_matrix is None:
            raise RuntimeError("nothing was received to transform")
        recv_matrix = self._recv_matrix.view(self.world, self.n_tables)
        many, answers, flags = transform_share(self.tables, self.received, recv_matrix, self.pin, self.kernel)
        self.received = None
        self._answers = _Answers(answers, flags, recv_matrix.sum(1).tolist())
        self._errors = many.errors
        # no slots yet: they come with the exchange that answers the batch
        dropped = local_dropped(many) if self.world == 1 else None  # one rank: its answers are its own
        results = ShareResults(many.slots[:0], [0] * self.n_tables, many, self.pin, dropped=dropped)
        self._awaiting[-1].results = results  # their slots come with the next exchange
        return results
