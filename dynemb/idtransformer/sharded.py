"""ShardedIDTransformer: one ID transformer per rank, each owning the IDs that hash to it.

    t = ShardedIDTransformer(capacity_per_rank=1_000_000, group=dist.group.WORLD)
    out = t.transform(local_ids)    # collective: every rank calls it, each with its own batch
    out.slots                       # global row of each of local_ids: rank r's rows are
                                    # [r * capacity_per_rank, (r + 1) * capacity_per_rank)
    out.owned                       # this rank's TransformResult for the IDs it owns: the
                                    # rows to pull (admitted) and push (evicted) live here
    t.release(out)                  # with pin=True, when the batch is through backward

An ID's owner is xxh64(id) % world_size, the same function the PS client shards by. There
is no coordinator: each rank sends every ID of its batch to the owner (one all_to_all for
the counts, one for the IDs), each owner maps all the IDs it received in one batched call
(the requests of rank 0 first, then rank 1, ...; an ID asked for by several ranks gets one
slot), and the slots travel back the same way (route.py lays the exchange out, on CPU in the
kernel). transform_tables does this for many tables in the same three exchanges, the owner
mapping every table's IDs in one call (many.py); on one rank there is nothing to exchange.
A stream of batches needs one exchange per batch (stream.py).
The slots an owner hands out are rows of its own block, so with TorchRec's row-wise sharding
(equal contiguous blocks) the row of an ID lives on the rank that owns the ID. Works with any
torch.distributed backend that has all_to_all (gloo on CPU, NCCL on CUDA). A batch that an
owner refuses raises BatchRefused on every rank, carrying the shares that went through, for
the caller to finish (see transform_tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

import torch
import torch.distributed as dist

from dynemb.idtransformer.ids import as_int64_ids
from dynemb.idtransformer.many import ManyResult, release_many, release_many_flat, transform_many
from dynemb.idtransformer.policy import DEFAULT_POLICY, EvictionPolicy
from dynemb.idtransformer.route import route, transpose_blocks
from dynemb.idtransformer.transformer import IDTransformer, TransformResult


@dataclass
class ShardedTransformResult:
    """What a sharded transform gives one rank: its ids' global slots and its share as owner."""

    slots: torch.Tensor  # global rows of the caller's ids (same shape); -1: not admitted
    owned: TransformResult  # the owner's view of what it received: its slots are global rows
    pinned: torch.Tensor | None = None  # this rank's local slots pinned for the batch


class BatchRefused(RuntimeError):
    """A sharded transform in which some owner refused its share of some table (its
    IDTransformer.transform raised: too many distinct IDs, no room, a slot at 255 pins). Every
    rank raises it from the same call, the refusing owner with its own error as __cause__.

    The shares that did go through stand (undoing them is not possible, see transform_tables):
    `results` holds them, one ShardedTransformResult per table as the call would have returned,
    this rank's share of a table it refused being empty (nothing admitted, evicted or pinned);
    its `slots` are -2 where an owner refused. The caller finishes these shares as any batch's
    (push the evicted rows, pull the admitted ones, release the pins: dynemb/tables/dynamic.py does),
    or their evicted rows are lost and their pins held for good.
    errors: per table, this rank's own refusal or None; refused_by: per table, the ranks that
    refused their share of it (the same on every rank)."""

    def __init__(
        self,
        message: str,
        results: Sequence[ShardedTransformResult],
        errors: list[Exception | None],
        refused_by: list[list[int]],
    ) -> None:
        super().__init__(message)
        self.results: Sequence[ShardedTransformResult] = results  # a ShareResults, from transform_blocks
        self.errors: list[Exception | None] = errors
        self.refused_by = refused_by


class ShardedIDTransformer:
    """One IDTransformer per rank, each owning the IDs that hash to it (see the module doc).

    Args:
        capacity_per_rank: slots per rank; rank r's are global rows [r * c, (r + 1) * c).
        policy: the eviction policy.
        admit_threshold: sightings an ID needs before it gets a slot.
        group: the process group; None is the default group.
        device: where this rank's transformer lives.
        name: the table's name, for errors (default: its number in the call).
        **kwargs: passed to IDTransformer.
    """

    def __init__(
        self,
        capacity_per_rank: int,
        policy: EvictionPolicy = DEFAULT_POLICY,
        admit_threshold: int = 1,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        name: str | None = None,
        **kwargs,
    ) -> None:
        self.name = name
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.capacity_per_rank = capacity_per_rank
        self.offset = self.rank * capacity_per_rank
        self.local = IDTransformer(capacity_per_rank, policy, admit_threshold, device=device, **kwargs)
        self.device = self.local.device

    def transform(self, ids: torch.Tensor, pin: bool = False) -> ShardedTransformResult:
        """Collective. ids: this rank's batch (int64, any shape). A refused batch raises
        BatchRefused on every rank (see transform_tables): finish its `results`."""
        return transform_tables([self], [ids], pin)[0]

    def release(self, result: ShardedTransformResult) -> None:
        """Unpin what this rank pinned for a batch (local: no communication)."""
        if result.pinned is None:
            raise ValueError("this batch was not transformed with pin=True")
        self.local.release(result.pinned, distinct=True)
        result.pinned = None

    def state_dict(self) -> dict:
        """This rank's transformer state, with its rank and the world size."""
        return {"rank": self.rank, "world_size": self.world_size, "local": self.local.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() of the same rank and world size; else ValueError."""
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"state is of rank {state['rank']} of {state['world_size']}, this is rank {self.rank} "
                f"of {self.world_size} (a different world size needs a re-shard: export and re-import)"
            )
        self.local.load_state_dict(state["local"])


class ShareResults(Sequence[ShardedTransformResult]):
    """A batch's results on this rank, one ShardedTransformResult per table (what
    transform_tables returns), each made when first looked at; `many` is this rank's share of
    every table at once (its ManyResult), for a caller that moves and releases all tables
    together (the trainer): cutting 26 tables' tensors into per-table results and joining them
    again cost more than the rows' moves themselves."""

    def __init__(
        self, flat_slots: torch.Tensor, sizes: list[int], many: ManyResult, pin: bool, dropped: int | None = None
    ) -> None:
        self.flat_slots, self.sizes, self.many, self.pin = flat_slots, sizes, many, pin
        # how many of flat_slots are -1 (IDs not admitted), where the host knows it without
        # reading them (one rank, triton tables: the pass counted them); else None
        self.dropped = dropped
        self.released = False  # released whole (release_tables), before or after the items were made
        self._items: list[ShardedTransformResult] | None = None

    def _made(self) -> list[ShardedTransformResult]:
        if self._items is None:
            self._items = _results(self.flat_slots, self.sizes, self.many.results, self.pin and not self.released)
        return self._items

    @overload
    def __getitem__(self, k: int) -> ShardedTransformResult: ...

    @overload
    def __getitem__(self, k: slice) -> list[ShardedTransformResult]: ...

    def __getitem__(self, k: int | slice) -> ShardedTransformResult | list[ShardedTransformResult]:
        return self._made()[k]

    def __len__(self) -> int:
        return len(self.sizes)

    def set_slots(self, flat_slots: torch.Tensor, sizes: list[int]) -> None:
        """The slots of the caller's IDs, once they are known (TransformStream's answers)."""
        self.flat_slots, self.sizes = flat_slots, sizes
        if self._items is not None:
            for item, slots in zip(self._items, torch.split(flat_slots, sizes)):
                item.slots = slots

    @property
    def whole(self) -> bool:
        """Whether `many` holds every table's share as one tensor each (kernel tables, none refused)."""
        return self.many.flat is not None and self.many.error is None

    def release_whole(self, tables: list[ShardedIDTransformer]) -> bool:
        """release_tables' one-call path: False where it does not apply (then per table)."""
        backends = {t.local.backend for t in tables}
        if not (self.pin and self.whole and backends in ({"kernel"}, {"triton"})):
            return False
        if self._items is not None and any(item.pinned is None for item in self._items):
            return False  # some released per table: that path says which
        if self.released:
            raise ValueError("this batch was not transformed with pin=True (or was released already)")
        flat, counts, _, _ = self.many.flat_parts()  # whole: every table's at once (the kernel's, or triton's)
        # triton: no host copy here, its one a step is the transform's (faults logged with it)
        check = backends != {"triton"}
        errors = release_many_flat([t.local for t in tables], flat["distinct_slots"], counts["distinct_slots"], check)
        self.released = True
        for k, item in enumerate(self._items or []):
            if errors[k] is None:
                item.pinned = None
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
        return True


def release_tables(tables: list[ShardedIDTransformer], results: Sequence[ShardedTransformResult]) -> None:
    """tables[t].release(results[t]) for every table (local: no communication), the tables on
    the kernel in one call; the first error is raised once every table has been released.
    results: a list of them, or the ShareResults that transform_blocks gives."""
    if isinstance(results, ShareResults) and results.release_whole(tables):
        return
    pinned: list[torch.Tensor] = []
    for out in results:
        if out.pinned is None:
            raise ValueError("this batch was not transformed with pin=True")
        pinned.append(out.pinned)
    errors = release_many([t.local for t in tables], pinned)
    for out, error in zip(results, errors):
        if error is None:
            out.pinned = None
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


class SentToOwners(NamedTuple):
    """A batch's IDs sent to their owners (send_to_owners): both sides of the exchange."""

    position: torch.Tensor  # where each ID of the batch stands in the send layout
    sent_counts: torch.Tensor  # (world, tables): IDs this rank sent each owner, per table
    sent_per_rank: list[int]  # their sums per owner
    asked: torch.Tensor  # the IDs the ranks sent this one, in (source, table) blocks
    asked_counts: torch.Tensor  # (world, tables): IDs each source rank sent, per table
    asked_per_rank: list[int]  # their sums per source


def send_to_owners(ids: torch.Tensor, sizes: list[int], world: int, kernel: bool, group) -> SentToOwners:
    """Collective: each of a batch's IDs (laid out in blocks of `sizes`, one per table) to the rank
    that owns it, in the send layout (for each owner, table 0's IDs it owns, then table 1's ...):
    one all_to_all of the counts, one of the IDs. On one rank, nothing to exchange."""
    n_tables = len(sizes)
    send, position, counts = route(ids, sizes, world, kernel)  # counts: (owner, table)
    sent_counts = counts.view(world, n_tables)
    sent_per_rank = sent_counts.sum(1).tolist()
    if world == 1:
        return SentToOwners(position, sent_counts, sent_per_rank, send, sent_counts, sent_per_rank)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # now (source, table)
    asked_counts = recv_counts.view(world, n_tables)
    asked_per_rank = asked_counts.sum(1).tolist()
    asked = _exchange(send, sent_per_rank, asked_per_rank, group)
    return SentToOwners(position, sent_counts, sent_per_rank, asked, asked_counts, asked_per_rank)


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


def transform_tables(
    tables: list[ShardedIDTransformer], ids: list[torch.Tensor], pin: bool = False
) -> Sequence[ShardedTransformResult]:
    """Collective: transform one batch of IDs per table, for all tables in one exchange (one
    all_to_all of counts, one of IDs, one of rows, whatever the number of tables). Every
    rank passes the same tables in the same order (the same group).

    When an owner refuses its share of a table (IDTransformer.transform's errors), it answers
    -2 for it so that no rank hangs, and all ranks agree on it (each owner's refusal flags, one
    per table, ride on its answers to every rank): every rank raises BatchRefused, the
    refusing owner with its own error as the cause (a refused share changed nothing of that
    table on that owner, or for no room only its clock and touches). The shares that other
    owners, or other tables, transformed in the same call stand: they admitted IDs whose rows
    are still to be pulled, evicted IDs whose rows are still to be pushed, and pinned their
    slots. The error carries them (BatchRefused.results) for the caller to finish, as it would
    have finished the batch: nothing evicted is lost, nothing stays pinned.

    (Completing rather than undoing them: an evicted ID's slot may already hold an admitted
    one, so undoing means putting the map, the counters, the clock and the admission sketch
    back as they were, in both backends; agreeing before anything changes needs a dry run of
    every table and one more round trip for every batch. Finishing the shares is what the
    caller does with every batch anyway.)"""
    ids = [as_int64_ids(x) for x in ids]
    every = torch.cat([x.reshape(-1) for x in ids]) if ids else torch.zeros(0, dtype=torch.int64)
    _, results = transform_blocks(tables, every, [x.numel() for x in ids], pin)
    for out, x in zip(results, ids):
        out.slots = out.slots.reshape(x.shape)
    return results


def transform_blocks(
    tables: list[ShardedIDTransformer], ids: torch.Tensor, sizes: list[int], pin: bool = False
) -> tuple[torch.Tensor, Sequence[ShardedTransformResult]]:
    """transform_tables over the tables' IDs laid end to end (table t's are the sizes[t] after
    those of tables 0..t-1): (the slots of all, in that layout; each table's result, whose
    slots are views of them: a ShareResults, or an empty list without tables)."""
    if not tables:
        return ids[:0], []
    first = tables[0]
    group, world, device = first.group, first.world_size, first.device
    every = as_int64_ids(ids).reshape(-1).to(device)
    if world == 1:  # nothing to exchange
        many = transform_many([t.local for t in tables], every, sizes, pin, [t.offset for t in tables])
        results = ShareResults(many.slots, sizes, many, pin, dropped=local_dropped(many))
        if many.error is not None:
            for out, error in zip(results, many.errors):
                if error is not None:
                    out.slots.fill_(-2)
            refused_by = [[0] if e is not None else [] for e in many.errors]
            raise _refused(results, many.errors, refused_by, 0, tables) from many.error
        return many.slots, results

    kernel = all(t.local.backend == "kernel" for t in tables)  # else torch ops (CUDA)
    sent = send_to_owners(every, sizes, world, kernel, group)
    many, answers, refused = transform_share(tables, sent.asked, sent.asked_counts, pin, kernel)
    answered, refusals = _answer(answers, refused, sent.asked_per_rank, sent.sent_per_rank, group)
    flat_slots = answered.index_select(0, sent.position)  # (faster than answered[position] on CPU)
    results = ShareResults(flat_slots, sizes, many, pin)
    if bool(refusals.any()):
        refused_by = [torch.nonzero(column).squeeze(1).tolist() for column in refusals.t().cpu()]
        raise _refused(results, many.errors, refused_by, first.rank, tables) from many.error
    return flat_slots, results


def local_dropped(many: ManyResult) -> int | None:
    """How many IDs of a one-rank batch got no slot, where the pass counted them (else None)."""
    return None if many.dropped is None else sum(many.dropped)


def transform_share(
    tables: list[ShardedIDTransformer], received: torch.Tensor, recv_matrix: torch.Tensor, pin: bool, kernel: bool
) -> tuple[ManyResult, torch.Tensor, torch.Tensor]:
    """An owner's part of a sharded transform: the IDs it received, in (source, table) blocks of
    recv_matrix's sizes, transformed per table with the requests of rank 0 first, then rank 1,
    .... Returns (what transform_many gave, the answers in (source, table) blocks, each table's
    refusal flag as int64). A refused table's answers are -2: the owner answers anyway, or the
    other ranks would hang."""
    mine_sizes = recv_matrix.sum(0).tolist()
    many = transform_many(
        [t.local for t in tables],
        transpose_blocks(received, recv_matrix, kernel),
        mine_sizes,
        pin,
        [t.offset for t in tables],
    )
    if many.error is not None:
        for block, error in zip(torch.split(many.slots, mine_sizes), many.errors):
            if error is not None:
                block.fill_(-2)
    answers = transpose_blocks(many.slots, recv_matrix.t(), kernel)  # back to (source, table) blocks
    refused = torch.tensor([e is not None for e in many.errors], dtype=torch.int64, device=answers.device)
    return many, answers, refused


def _answer(
    answers: torch.Tensor, refused: torch.Tensor, recv_per_rank: list[int], send_per_rank: list[int], group
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exchange of answers, each owner's block to a rank followed by its refusal flags (one
    per table): (the answers to this rank's IDs, every owner's flags as a (world, tables)
    matrix). Riding on the answers, the flags reach every rank, one that asked a refusing owner
    nothing included, at no extra round trip (an all_reduce of them cost 0.5-1.3 ms a step on
    2 gloo ranks, as much as the whole routing's tensor work)."""
    n = refused.numel()
    send = torch.cat([x for block in torch.split(answers, recv_per_rank) for x in (block, refused)])
    got = _exchange(send, [c + n for c in recv_per_rank], [c + n for c in send_per_rank], group)
    parts = torch.split(got, [x for c in send_per_rank for x in (c, n)])
    return torch.cat(parts[0::2]), torch.stack(parts[1::2])


def _results(
    flat_slots: torch.Tensor, sizes: list[int], owned: list[TransformResult | None], pin: bool
) -> list[ShardedTransformResult]:
    """Each table's result; a share this rank refused (owned None) as an empty one."""
    shares = [out if out is not None else _nothing(flat_slots.device) for out in owned]
    return [
        ShardedTransformResult(slots, out, out.distinct_slots if pin else None)
        for slots, out in zip(torch.split(flat_slots, sizes), shares)
    ]


def _nothing(device: torch.device) -> TransformResult:
    """A refused share's result: nothing looked up, admitted, evicted or pinned."""
    none = torch.zeros(0, dtype=torch.int64, device=device)
    return TransformResult(
        slots=none,
        admitted_ids=none,
        admitted_slots=none,
        evicted_ids=none,
        evicted_slots=none,
        rejected_ids=none,
        hits=0,
        distinct_slots=none,
    )


def _refused(
    results: Sequence[ShardedTransformResult],
    errors: list[Exception | None],
    refused_by: list[list[int]],
    rank: int,
    tables: Sequence[ShardedIDTransformer],
) -> BatchRefused:
    names = [f"table {t.name}" if t.name else f"table {k}" for k, t in enumerate(tables)]
    parts = [f"rank {rank} refused its share of {names[t]}: {e}" for t, e in enumerate(errors) if e is not None]
    parts += [
        f"rank {r} refused its share of {names[t]} (that rank's error says why)"
        for t, ranks in enumerate(refused_by)
        for r in ranks
        if r != rank
    ]
    return BatchRefused("batch refused: " + "; ".join(parts), results, errors, refused_by)
