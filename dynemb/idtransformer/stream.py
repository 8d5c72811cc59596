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
        if answered: tag, slots, results = answered     # an earlier batch's, done
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

import torch
import torch.distributed as dist

from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.route import route
from dynemb.idtransformer.sharded import ShardedIDTransformer, ShareResults, _refused, transform_share


class TransformStream:
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
        self._out = None  # (send, position, counts (dest, table), sizes, tag) of the batch whose IDs go out next
        self._in_counts: torch.Tensor | None = None  # (source, table): the IDs of that batch coming here
        self._recv_matrix: torch.Tensor | None = None
        self._answers = None  # (answers in (source, table) blocks, refusal flags, per-source totals)
        self._errors: list = []  # per table, this rank's refusal of the batch it transformed last
        self._awaiting: deque = deque()  # batches whose IDs went out: (position, sizes, per-dest totals, tag, results)

    def exchange(self, ids: torch.Tensor | None, sizes: list[int] | None = None, tag=None):
        """Collective. ids, sizes: the next batch (its tables' IDs end to end, as in
        transform_blocks), or None when this rank has no more. Returns (tag, flat slots,
        results) of the batch whose answers came in this exchange, or None."""
        if not self.open:
            raise RuntimeError("this transform stream is over")
        if self.received is not None:
            raise RuntimeError("transform_received() the IDs of the last exchange before the next one")
        upcoming = None
        if ids is not None and self.taking:
            ids = as_int64_ids(ids).reshape(-1).to(self.device)
            if sizes is None or len(sizes) != self.n_tables or sum(sizes) != ids.numel():
                raise ValueError(f"sizes must give the {self.n_tables} tables' blocks of the {ids.numel()} IDs")
            send, position, counts = route(ids, sizes, self.world, self.kernel)  # counts: (dest, table)
            upcoming = (send, position, counts, list(sizes), tag)
        elif ids is not None:  # the stream is ending: the batch goes nowhere
            self.dropped.append(tag)
        self._started = True
        T, world = self.n_tables, self.world

        # what goes to each rank and what comes from each, in the order of the module's docstring;
        # answers go both ways or neither: a batch went out last time on every rank or on none
        answering = bool(self._awaiting)
        header = torch.zeros(world, T + 1, dtype=torch.int64, device=self.device)
        if upcoming is not None:
            header[:, :T] = upcoming[2].view(world, T)
            header[:, T] = 1
        out = self._out
        out_per_dest = out[2].view(world, T).sum(1).tolist() if out is not None else [0] * world
        in_per_source = self._in_counts.sum(1).tolist() if self._in_counts is not None else [0] * world
        if answering:
            answers, flags, answer_per_source = self._answers
            answer_blocks = torch.split(answers, answer_per_source)
            asked_per_dest = self._awaiting[0][2]  # what this rank asked each owner: the answers' sizes
        send_blocks = torch.split(out[0], out_per_dest) if out is not None else None
        pieces, send_sizes, recv_parts = [], [], []
        for d in range(world):
            if answering:
                pieces += [answer_blocks[d], flags]
                recv_parts += [asked_per_dest[d], T]
            if out is not None:
                pieces.append(send_blocks[d])
            pieces.append(header[d])
            recv_parts += [in_per_source[d], T + 1]
            send_sizes.append((answer_per_source[d] + T if answering else 0) + out_per_dest[d] + T + 1)
        send = torch.cat(pieces)
        per = 4 if answering else 2  # pieces from each rank
        if world == 1:  # the message is for this rank itself
            got = send
        else:
            recv_sizes = [sum(recv_parts[per * s: per * (s + 1)]) for s in range(world)]
            got = torch.empty(sum(recv_sizes), dtype=torch.int64, device=self.device)
            dist.all_to_all_single(got, send, recv_sizes, send_sizes, group=self.group)

        # take it apart: per source, [answers, flags,] IDs, counts and has-next
        parts = torch.split(got, recv_parts)
        ids_in = [parts[per * s + per - 2] for s in range(world)]
        headers = torch.stack([parts[per * s + per - 1] for s in range(world)])
        if out is not None:  # this batch's IDs went out: their answers come next time
            self._awaiting.append([out[1], out[3], out_per_dest, out[4], None])
            self._recv_matrix = self._in_counts
            self.received = torch.cat(ids_in)
        more = bool(headers[:, T].all())
        if upcoming is not None and not more:
            self.dropped.append(upcoming[4])
        self._out = upcoming if more else None
        self._in_counts = headers[:, :T].contiguous() if more else None
        self._answers = None
        if not answering:
            self.open = more or bool(self._awaiting)
            return None

        position, sizes, _, tag, results = self._awaiting.popleft()
        self.open = more or bool(self._awaiting)
        flat_slots = torch.cat([parts[per * s] for s in range(world)]).index_select(0, position)
        results.set_slots(flat_slots, sizes)
        refusals = torch.stack([parts[per * s + 1] for s in range(world)])  # (owner, table)
        if bool(refusals.any()):
            self.open = False
            self.received = None  # the next batch's IDs: not transformed, the stream is over
            refused_by = [torch.nonzero(column).squeeze(1).tolist() for column in refusals.t().cpu()]
            error = next((e for e in self._errors if e is not None), None)
            raise _refused(results, self._errors, refused_by, self.tables[0].rank) from error
        return tag, flat_slots, results

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
        if self.received is None:
            raise RuntimeError("nothing was received to transform")
        recv_matrix = self._recv_matrix.view(self.world, self.n_tables)
        many, answers, flags = transform_share(self.tables, self.received, recv_matrix, self.pin, self.kernel)
        self.received = None
        self._answers = (answers, flags, recv_matrix.sum(1).tolist())
        self._errors = many.errors
        # no slots yet: they come with the exchange that answers the batch
        results = ShareResults(many.slots[:0], [0] * self.n_tables, many, self.pin)
        self._awaiting[-1][4] = results  # their slots come with the next exchange
        return results
