"""Dynamic tables: a batch of global IDs in, the same batch over device rows out.

For every table, a ShardedIDTransformer maps the batch's IDs to rows of the table (each
rank owning the IDs that hash to it and a block of rows, matching TorchRec's row-wise
sharding). On the owner, in batched tensor ops (one gather and one scatter per step for all
tables, where their rows share one storage: dynemb/tables/row_group.py): the rows of evicted IDs,
with their optimizer state, are read from the TBE and pushed to the PS first (their rows are
about to be reused), then the rows of admitted IDs are pulled (a never-seen ID comes back
initialised by the table's initializer) and written in.
The batch's slots are pinned until `release_oldest()` says the batch is through backward and
the optimizer step, so a batch in flight never has a row pushed or reused under it.
On a GPU the rows go to and from the host through pinned buffers on a side stream, and the
training stream waits on events, not on the device (dynemb/tables/row_moves.py); the batches
themselves stay on the CPU until the loop (or the pipeline) copies them over.
A batch that some owner refuses (too many distinct IDs for a table, no room) raises
BatchRefused on every rank, after the shares of it that went through have had their rows moved
and their pins released: the tables stay consistent, and the caller may go on with other
(smaller) batches.

    tables = DynamicTables(find_tables(model), specs, store, metrics)
    for batch in tables.wrap(batches):   # transform + pull/push as each batch is fetched
        ...train on batch...
        tables.release_oldest()
    tables.flush()                       # push every resident row (checkpoints, tests)

With `wrap(batches, ahead=1)` a batch's rows move while the caller trains on earlier
batches: the push and pull it starts are finished (pulled rows written in) when the next
batch is transformed, or by `settle()`. That is for a caller that fetches batch j + 1 before
it runs batch j's forward, as TorchRec's TrainPipelineSparseDist does (it fetches j + 2):
the PS round trip then overlaps a step of compute instead of stalling the main thread. The
slots involved are not in any batch in flight (pins), so nothing reads or writes them
meanwhile. With `wrap(batches, window=w)` a thread of their own transforms the batches ahead
of the caller instead, and hands each over with its rows in place (dynemb/tables/prefetch.py),
through `transform_stream`: the same transforms with one exchange between the ranks per
batch instead of three.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from dynemb.idtransformer.device_select import compact
from dynemb.idtransformer.find import Found, find_blocks
from dynemb.idtransformer.policy import EvictionPolicy
from dynemb.idtransformer.sharded import (
    BatchRefused,
    ShardedIDTransformer,
    ShardedTransformResult,
    ShareResults,
    release_tables,
    transform_blocks,
)
from dynemb.idtransformer.stream import TransformStream
from dynemb.ps_server.lifecycle import Lifecycle
from dynemb.ps_server.schema import TableSchema
from dynemb.tables.batches import find_kjt, get_kjt, with_kjt
from dynemb.tables.device import collective_device
from dynemb.tables.errors import SetupError
from dynemb.tables.jagged import Batch, KeyedJaggedTensor
from dynemb.tables.metrics import TABLE_COUNTERS, TrainerMetrics
from dynemb.tables.prefetch import TransformAhead
from dynemb.tables.row_group import RowGroup
from dynemb.tables.row_moves import RowMoves
from dynemb.tables.row_store import RowStore
from dynemb.tables.table_rows import TableRows
from dynemb.tables.touch import ResidentToucher

log = logging.getLogger("dynemb.trainer")
_ROWS_PULLED = [name for name, _ in TABLE_COUNTERS].index("rows_pulled")


@dataclass
class DynamicTableSpec:
    """One dynamic table: its TorchRec name, the features it serves, its PS table, eviction and admission."""

    name: str  # the TorchRec table's name
    features: list[str]  # the KJT keys it serves
    ps_schema: TableSchema  # its PS table (name, dim, state width, initializer)
    policy: EvictionPolicy
    admit_threshold: int = 1
    lifecycle: Lifecycle | None = None  # set on its PS table at start (None: left as it is)


class LookedUp(NamedTuple):
    """A batch looked up without training (DynamicTables.look_up)."""

    kjt: KeyedJaggedTensor  # over slots; IDs without a device row left out of their bags
    missing: dict[str, torch.Tensor]  # per key of a dynamic table: its bags' missing rows summed, (batch, dim)


@dataclass
class _Layout:
    """Where a KJT's values of dynamic tables are: their positions (grouped by table, in the
    order of DynamicTables.names; a slice when they are the first values already in that
    order), those values, and how many each table has."""

    order: torch.Tensor | slice
    ids: torch.Tensor
    sizes: list[int]


@dataclass
class _Moves:
    """One batch's row moves in flight: the push of its evicted rows, the pull of its admitted
    ones, and where what the pull returns goes: the admitted table rows of every table (in
    the order of self.transformers) and how many each has."""

    push: Future | None
    pull: Future | None
    admitted_slots: torch.Tensor
    admitted_counts: list[int]
    held: torch.Tensor | None = None  # the evicted rows' host buffer, until pushed (RowMoves.give_back)


@dataclass
class _Share:
    """This rank's share of a batch, every table at once, table after table (in the order of
    DynamicTables.names): the admitted and evicted IDs with their table rows, how many of each
    per table, and per table the IDs looked up, hits and rejections (for the metrics)."""

    admitted_ids: torch.Tensor
    admitted_slots: torch.Tensor
    admitted: list[int]
    evicted_ids: torch.Tensor
    evicted_slots: torch.Tensor
    evicted: list[int]
    looked: list[int]
    hits: list[int]
    rejected: list[int]

    @staticmethod
    def of(results: Sequence[ShardedTransformResult]) -> _Share:
        """From a batch's results: whole where the transform gave them whole (ShareResults),
        else joined from each table's."""
        if isinstance(results, ShareResults) and results.whole:
            f, c, sizes, hits = results.many.flat_parts()
            return _Share(
                f["admitted_ids"],
                f["admitted_slots"],
                c["admitted_ids"],
                f["evicted_ids"],
                f["evicted_slots"],
                c["evicted_ids"],
                sizes,
                hits,
                c.get("rejected_ids", [0] * len(sizes)),  # (the kernel's whole path has no admission sketch)
            )
        owned = [out.owned for out in results]

        def cat(field: str) -> torch.Tensor:
            return torch.cat([getattr(o, field) for o in owned]) if owned else torch.zeros(0, dtype=torch.int64)

        return _Share(
            cat("admitted_ids"),
            cat("admitted_slots"),
            [o.admitted_ids.shape[0] for o in owned],
            cat("evicted_ids"),
            cat("evicted_slots"),
            [o.evicted_ids.shape[0] for o in owned],
            [o.slots.shape[0] for o in owned],
            [int(o.hits) for o in owned],
            [o.rejected_ids.shape[0] for o in owned],
        )


class DynamicTables:
    """The dynamic tables of one DMP model on this rank: global IDs in, rows in place out.

    Args:
        rows: the model's row-wise sharded tables (`find_tables(model)`), by table name.
        specs: each dynamic table's policy, admission threshold, features and PS schema.
        store: where rows go when evicted and come from when admitted (a PS client or the
            rank's embedded store).
        metrics: per-table counters, occupancy and PS latency, if given.
        group: the process group of the ID owners [default: the world], for the exchanges
            the caller's thread makes (transform, look_up, run_hit_rates).
        thread_group: the process group of the exchanges a transform thread makes
            (transform_stream; wrap with a window) [default: group]. A group of its own keeps
            the thread from ever sharing one with the caller's collectives; gloo on a NCCL job,
            so that the thread drives no NCCL communicator beside the training loop's
            (docs/design.md, "Communicators and threads"). DynamicEmbeddings gives one.
        device: where the tables' rows and the ID transformers live (the rank's device); on
            a GPU rows move through pinned buffers on a side stream (row_moves.py).

    Raises:
        ValueError: a table's rows are not as wide as its PS table, or not row-wise sharded
            so that each rank's block of rows matches its block of IDs.
    """

    def __init__(
        self,
        rows: dict[str, TableRows],
        specs: list[DynamicTableSpec],
        store: RowStore,
        metrics: TrainerMetrics | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        thread_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.specs = {s.name: s for s in specs}
        self.store, self.metrics, self.process_group = store, metrics, group
        self.thread_group = thread_group if thread_group is not None else group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.rows: dict[str, TableRows] = {}
        self.transformers: dict[str, ShardedIDTransformer] = {}
        # per table, the transformer step of the last flush: a slot seen since (last_access at
        # or past it) holds a row training may have changed (flush(changed_only=True))
        self._flushed_at: dict[str, int] = {}
        self.feature_table: dict[str, str] = {}
        for spec in specs:
            r = rows[spec.name]
            if r.state_width != spec.ps_schema.state_width or r.dim != spec.ps_schema.dim:
                raise ValueError(
                    f"table {spec.name}: the model's rows are {r.dim} wide with {r.state_width} optimizer values, "
                    f"its PS table {spec.ps_schema.name} {spec.ps_schema.dim} and {spec.ps_schema.state_width}"
                )
            t = ShardedIDTransformer(
                r.local_rows,
                spec.policy,
                spec.admit_threshold,
                group=group,
                device=self.device,
                name=spec.name,
                backend="auto",
            )
            if t.offset != r.row_offset:
                raise ValueError(
                    f"table {spec.name}: rank {self.rank} holds rows from {r.row_offset}, but its ID owner block "
                    f"starts at {t.offset}: the table needs row-wise sharding with {r.local_rows} rows per rank"
                )
            self.rows[spec.name], self.transformers[spec.name] = r, t
            for f in spec.features:
                self.feature_table[f] = spec.name
            store.create_table(spec.ps_schema)
            if spec.lifecycle is not None:
                _set_lifecycle(store, spec.ps_schema.name, spec.lifecycle)
        self.names = list(self.transformers)  # every rank lists the tables in one order
        self.ps_names = [self.specs[n].ps_schema.name for n in self.names]
        self.row_group = RowGroup([self.rows[n] for n in self.names])  # one gather/scatter for all, where it can
        self.moves = RowMoves(self.row_group, self.device)  # to and from the host (pinned, a side stream on GPU)
        self.in_flight: deque[Sequence[ShardedTransformResult]] = deque()
        # where the metrics keep these tables (rows of TableStats' arrays, in the order of names),
        # under their PS names: the table label the PS's own metrics give them
        self._stat_rows = None if metrics is None else metrics.tables.add_tables(self.ps_names)
        self._capacity = np.array([self.transformers[n].capacity_per_rank for n in self.names], dtype=np.float64)
        self.last_hit_rate = 0.0
        # this rank's owned IDs looked up and found resident, per table, over the run
        self.looked_up = np.zeros(len(self.names), dtype=np.int64)
        self.found = np.zeros(len(self.names), dtype=np.int64)
        self.hit_rates = array("d")  # per transformed batch, in order (8 bytes a step)
        self.ahead = 0  # see wrap()
        self._keys_seen: tuple | None = None  # the KJT keys _key_table was made for
        self._key_table: tuple[torch.Tensor, bool] = (torch.zeros(0, dtype=torch.int64), True)
        self._moving: deque[_Moves] = deque()  # started, not yet settled (at most `ahead`)
        # releases the caller asked for while a transform thread owns the tables (prefetch.py);
        # None: none does, release_oldest releases at once
        self._deferred: int | None = None
        self._releases = threading.Condition()
        # slots lent to a looked-up batch: (its table's rows, the slots, their own rows kept)
        self._lent: list[tuple[TableRows, torch.Tensor, torch.Tensor]] = []
        # the rows resident here are in use: the PS hears so, for tables whose rows expire (touch.py)
        self.toucher = ResidentToucher(
            store, {self.specs[n].ps_schema.name: functools.partial(self._resident_ids, n) for n in self.names}
        )

    # -- one batch ------------------------------------------------------------------

    def transform(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Collective: every rank calls it with its own batch, in the same order.

        Args:
            kjt: the batch's sparse features, over global IDs.

        Returns:
            The same KJT over this rank's table rows (slots). The rows are in place on return,
            or (with self.ahead) by the next call or settle().

        Raises:
            BatchRefused: a table cannot hold the batch's distinct IDs; the shares of the batch
                that went through have had their rows moved and pins released.
        """
        self.settle()  # first: the rows of earlier batches in place before any slot is looked at
        self.toucher.maybe()
        kjt = self._on_device(kjt)
        layout = self._layout(kjt)
        tables = [self.transformers[n] for n in self.names]
        try:
            slots, results = transform_blocks(tables, layout.ids, layout.sizes, pin=True)
        except BatchRefused as refused:
            self._finish_refused(refused)
            raise
        self._took(results, keep=self.ahead)
        return self._over_slots(kjt, layout, slots, getattr(results, "dropped", None))

    def transform_stream(self, batches: Iterator[Any], before_each: Callable[[], bool]) -> Iterator[Any]:
        """Collective: the batches over device rows, as transform gives them one by one, but with
        one exchange between the ranks per batch instead of three (dynemb/idtransformer/stream.py):
        batch k is yielded, its rows in place, once batch k + 1's IDs have gone out. A batch is
        a KJT or holds one (dynemb/tables/batches.py), and comes back as it came with its KJT
        over slots. before_each() is called before each transform of this rank's share
        (prefetch.py makes room there); False stops the stream. The transform thread's: its
        exchanges go over thread_group."""
        stream = TransformStream([self.transformers[n] for n in self.names], pin=True)
        stream.group = self.thread_group  # the same ranks in the same order as the transformers' group

        def upcoming() -> tuple[torch.Tensor | None, list[int] | None, tuple[Any, Any, Any, _Layout] | None]:
            batch = next(batches, None) if stream.taking else None
            if batch is None:
                return None, None, None
            where = find_kjt(batch)
            kjt = self._on_device(get_kjt(batch, where))
            layout = self._layout(kjt)
            return layout.ids, layout.sizes, (batch, where, kjt, layout)  # the tag: what the answers apply to

        stream.exchange(*upcoming())
        while stream.open:
            try:
                answered = stream.exchange(*upcoming())
            except BatchRefused:  # the batch this rank took its share of last
                release_tables([self.transformers[n] for n in self.names], self.in_flight.pop())
                raise
            if answered is not None:
                tag = answered.tag  # upcoming()'s (batch, layout): the stream hands its tags back as given
                assert isinstance(tag, tuple), f"a batch tagged {type(tag).__name__}, not (batch, where, kjt, layout)"
                answered_batch, where, kjt, layout = tag
                kjt = self._over_slots(kjt, layout, answered.slots, answered.results.dropped)
                yield with_kjt(answered_batch, where, kjt)
            if stream.received is not None:
                if not before_each():
                    return
                self.toucher.maybe()
                self._took(stream.transform_received(), keep=0)
        if stream.dropped:
            log.warning("rank %d had %d more batches than another rank: not trained on", self.rank, len(stream.dropped))

    def _on_device(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch's KJT on the tables' device, moved there once: its per-key lengths counted
        on the host first (TorchRec's KJT keeps them through the move, so nothing reads them
        back from the device), then copied from pinned memory without waiting. Its IDs are
        transformed there and its slots stay there."""
        if kjt.values().device == self.device:
            return kjt
        kjt.length_per_key()
        kjt.offset_per_key()
        if self.device.type != "cuda":
            return kjt.to(self.device)
        if not kjt.values().is_pinned():
            kjt = kjt.pin_memory()
        return kjt.to(self.device, non_blocking=True)

    def _layout(self, kjt: KeyedJaggedTensor) -> _Layout:
        """The KJT's values grouped by table (its features' segments, in key order): one
        stable sort by each value's table; values of no dynamic table sort last and stay as
        they are. Keys that already come table after table (the usual case) need no sort: the
        values of dynamic tables are then the first ones. Worked out on the host from the KJT's
        per-key lengths (no read from the device); the IDs stay where the KJT is."""
        key_table, grouped = self._key_tables(kjt.keys())
        per_key = torch.tensor(kjt.length_per_key())
        sizes = torch.zeros(len(self.names) + 1, dtype=torch.int64).index_add_(0, key_table, per_key).tolist()
        n_dynamic = sum(sizes) - sizes[-1]
        values = kjt.values()
        if grouped:
            return _Layout(slice(0, n_dynamic), values[:n_dynamic], sizes[:-1])
        order = torch.argsort(key_table.repeat_interleave(per_key), stable=True)[:n_dynamic]
        order = order.to(values.device, non_blocking=True)  # (from pageable memory: staged, not waited for)
        return _Layout(order, values[order], sizes[:-1])

    def _took(self, results: Sequence[ShardedTransformResult], keep: int) -> None:
        """This rank's share of a batch transformed: pinned until released, its rows moving
        (settled but for the `keep` latest batches), counted."""
        self.in_flight.append(results)
        share = _Share.of(results)
        self._moving.append(self._start_moves(share))
        self.settle(keep=keep)
        looked, hit = self._count(share)
        self.last_hit_rate = hit / max(looked, 1)
        self.hit_rates.append(self.last_hit_rate)

    @staticmethod
    def _over_slots(
        kjt: KeyedJaggedTensor, layout: _Layout, slots: torch.Tensor, dropped: int | None = None
    ) -> KeyedJaggedTensor:
        """The KJT with its dynamic tables' IDs replaced by their slots, where the KJT is.

        dropped: how many slots are -1 (IDs not admitted yet, left out of their bags), if the
        host knows it (the triton backend counts them into its one copy); else they are counted
        here (a read of the device on a GPU). With none, the KJT keeps its per-key lengths on
        the host; with some, the lengths per key are the device's, read by whoever asks."""
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        new_values = values.clone()
        slots = slots.to(values.device)
        new_values[layout.order] = slots
        if dropped is None:
            dropped = int((slots < 0).sum())
        if dropped == 0:
            return KeyedJaggedTensor(
                keys=kjt.keys(),
                values=new_values,
                lengths=lengths,
                weights=weights,
                stride=kjt.stride(),
                length_per_key=kjt.length_per_key(),
                offset_per_key=kjt.offset_per_key(),
            )
        # IDs not admitted yet (below the admission threshold) are left out of their bags
        keep = torch.ones_like(values, dtype=torch.bool)  # features of no dynamic table keep their IDs
        keep[layout.order] = slots >= 0
        n, kept = values.numel(), values.numel() - dropped
        bag = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths.long(), output_size=n)
        lost = torch.zeros(len(lengths), dtype=torch.int64, device=values.device).index_add_(0, bag, (~keep).long())
        return KeyedJaggedTensor(
            keys=kjt.keys(),
            values=compact(new_values, keep, kept),
            lengths=(lengths.long() - lost).to(lengths.dtype),
            weights=None if weights is None else compact(weights, keep, kept),
        )

    def _finish_refused(self, refused: BatchRefused) -> None:
        """A refused batch (every rank gets here together): the shares of it that went
        through, on this rank's tables, are finished as a batch's moves are, and their pins
        released: evicted rows pushed (no row lost), admitted rows pulled and written in (their
        slots hold their own rows), nothing left pinned. The batch is not trained on, so the
        caller may go on with other batches. Finishing rather than undoing: see
        transform_tables (an evicted ID's slot may already be another's)."""
        share = _Share.of(refused.results)
        try:
            self._count(share)
            self._finish_moves(self._start_moves(share))
        finally:
            release_tables([self.transformers[n] for n in self.names], refused.results)

    def _key_tables(self, keys: list[str]) -> tuple[torch.Tensor, bool]:
        """For each KJT key, the index of its table in self.transformers (len: none); and
        whether those come in non-decreasing order (the values already grouped by table)."""
        key = tuple(keys)
        if key != self._keys_seen:
            missing = [f for f in self.feature_table if f not in key]
            if missing:  # (TorchRec would fail later on it with "'f' is not in list")
                have = ", ".join(keys) or "none"
                raise SetupError(
                    f"the batch's KJT has no feature {', '.join(map(repr, missing))} (of dynamic table "
                    f"{self.feature_table[missing[0]]}); its keys: {have}. Give every feature the model's tables "
                    f"read, with lengths 0 where a batch has no IDs for one"
                )
            # (keyed by str | None: a key of no dynamic table has no table name, and gets len(index))
            index: dict[str | None, int] = {name: i for i, name in enumerate(self.transformers)}
            table = [index.get(self.feature_table.get(k), len(index)) for k in keys]
            self._key_table = (torch.tensor(table, dtype=torch.int64), table == sorted(table))
            self._keys_seen = key
        return self._key_table

    def settle(self, keep: int = 0) -> None:
        """Finish the row moves started by earlier batches, all but the `keep` latest: a failed
        push raises here; pulled rows are written into their slots. Rows lent to a looked-up
        batch (look_up_in_place) are given back first."""
        self.give_back_lent()
        while len(self._moving) > keep:
            self._finish_moves(self._moving.popleft())
        self.moves.wait()  # on a GPU: this thread's stream, after the rows written in

    def _start_moves(self, share: _Share) -> _Moves:
        """Evicted rows out, then admitted rows in: every table's rows in one push and one pull
        (one call per PS each, not one per table), read in one gather (RowGroup). The evicted
        rows are read now: their slots may be handed out as soon as this returns."""
        evicted, evicting = {}, []  # evicting: the tables' numbers
        counts = share.evicted
        held = None
        if sum(counts):  # first: their rows are about to be reused
            data, held = self.moves.read_out(share.evicted_slots, counts)
            ids, at = share.evicted_ids.cpu().numpy(), 0
            for k, n in enumerate(counts):
                if n:
                    evicted[self.ps_names[k]] = (ids[at : at + n], data[k])
                    evicting.append(k)
                at += n
        pulling, wanted = [], {}
        ids, at = share.admitted_ids.cpu().numpy(), 0
        for k, n in enumerate(share.admitted):
            if n:
                wanted[self.ps_names[k]] = ids[at : at + n]
                pulling.append(k)
            at += n
        start = time.perf_counter()
        # in one call: over a PS, one hand-off to the client's thread, not one each (the rows read
        # out are not changed before the push is done: _finish_moves gives their buffer back after)
        push, pull = self.store.push_then_pull_many_async(evicted, wanted)
        if push is not None:
            push = self._timed(push, evicting, "push", start)
        if pull is not None:
            pull = self._timed(pull, pulling, "pull", start)
        return _Moves(push, pull, share.admitted_slots, share.admitted, held)

    def _finish_moves(self, moves: _Moves) -> None:
        if moves.push is not None:  # on the PS before their slots take other rows; a failed push fails the step
            moves.push.result()
        self.moves.give_back(moves.held)
        if moves.pull is not None:
            got = moves.pull.result()
            self.moves.write_in(
                moves.admitted_slots,
                moves.admitted_counts,
                [got[t] if n else None for t, n in zip(self.ps_names, moves.admitted_counts)],
            )

    def _timed(self, fut: Future, tables: list[int], op: str, start: float) -> Future:
        """Observe the call's time (from `start` to its reply) for each of its tables (by number)
        when it completes, in whichever thread completes it: the push and the pull overlap, so
        one timer around both would say nothing per direction."""
        if self.metrics is not None:
            assert self._stat_rows is not None  # added to the metrics with them (__init__)
            rows, stats = self._stat_rows[tables], self.metrics.tables

            def observe(_: Future) -> None:
                stats.observe(op, rows, time.perf_counter() - start)

            fut.add_done_callback(observe)
        return fut

    def _count(self, share: _Share) -> tuple[int, int]:
        """(looked up, hits) among the IDs this rank owns, over all tables; metrics updated,
        all tables at once."""
        looked, hits = np.array(share.looked, dtype=np.int64), np.array(share.hits, dtype=np.int64)
        self.looked_up += looked
        self.found += hits
        if self.metrics is not None:
            assert self._stat_rows is not None  # added to the metrics with them (__init__)
            admitted, evicted = np.array(share.admitted, dtype=np.int64), np.array(share.evicted, dtype=np.int64)
            # TABLE_COUNTERS' columns; misses are new IDs and rejected ones alike
            self.metrics.tables.count(
                self._stat_rows,
                np.stack(
                    [
                        looked,
                        hits,
                        looked - hits,
                        admitted,
                        evicted,
                        np.array(share.rejected, dtype=np.int64),
                        admitted,
                        evicted,
                    ],
                    1,
                ),
                self._occupancy(),
            )
        return int(looked.sum()), int(hits.sum())

    def _count_pulled(self, per_table) -> None:
        """Rows a look-up pulled from the store, per table in the order of names, into the
        metrics' rows_pulled (the PS counts them too)."""
        if self.metrics is not None:
            assert self._stat_rows is not None  # added to the metrics with them (__init__)
            counts = np.zeros((len(self.names), len(TABLE_COUNTERS)), dtype=np.int64)
            counts[:, _ROWS_PULLED] = per_table
            self.metrics.tables.count(self._stat_rows, counts, self._occupancy())

    def _occupancy(self) -> np.ndarray:
        """Each table's resident IDs as a share of its rows on this rank, in the order of names."""
        return np.array([self.transformers[n].local.resident for n in self.names]) / self._capacity

    def release_oldest(self) -> None:
        """The oldest batch in flight is through backward and the optimizer step. While a
        transform thread owns the tables (dynemb/tables/prefetch.py), it applies the release."""
        self.moves.released()  # on a GPU: rows read out from here on wait for that step
        with self._releases:
            if self._deferred is not None:
                self._deferred += 1
                self._releases.notify_all()
                return
        self._release_now()

    def _release_now(self) -> None:
        release_tables([self.transformers[n] for n in self.names], self.in_flight.popleft())

    @property
    def transforming_ahead(self) -> bool:
        """Whether a transform thread owns the tables now (wrap with a window, prefetch.py)."""
        return self._deferred is not None

    def defer_releases(self) -> None:
        """From now on a transform thread applies release_oldest's releases (make_room)."""
        with self._releases:
            if self._deferred is not None:
                raise RuntimeError("these tables already have a transform thread")
            self._deferred = 0

    def make_room(self, keep: int, stop: threading.Event) -> bool:
        """The transform thread, before a transform: apply the caller's releases until at most
        `keep` batches are in flight, waiting for them as needed, and no further (see
        prefetch.py: what is pinned at a transform depends on the batches alone). False if
        `stop` was set meanwhile."""
        with self._releases:
            if self._deferred is None:
                raise RuntimeError("make_room is the transform thread's: defer_releases() first")
            need = len(self.in_flight) - keep
            while self._deferred < need:
                if stop.is_set():
                    return False
                self._releases.wait(0.05)  # the timeout: `stop` has no way to notify
            take = max(need, 0)
            self._deferred -= take
        for _ in range(take):
            self._release_now()
        return True

    def end_deferred_releases(self) -> None:
        """The transform thread is done: the releases asked for and not applied are applied,
        and release_oldest releases at once again."""
        with self._releases:
            for _ in range(self._deferred or 0):
                self._release_now()
            self._deferred = None

    def wrap(self, batches: Iterator[Any], ahead: int = 0, window: int = 0, priority: str = "normal") -> Iterator[Any]:
        """The batches over device rows. ahead=1: a batch's rows may still be moving when it is
        yielded, until the next one is fetched (or settle()); see the module's docstring.
        window > 0: a thread of their own transforms them ahead of the caller, with their rows
        in place when yielded, scheduled at `priority` (dynemb/tables/prefetch.py, where `window` and
        `priority` are explained)."""
        if ahead not in (0, 1):
            raise ValueError(f"ahead must be 0 or 1, got {ahead}")
        if window:
            if ahead:
                raise ValueError("batches transformed ahead come with their rows in place: ahead must be 0")
            transformed = TransformAhead(self, batches, window, priority=priority)
            try:
                yield from transformed
            finally:
                transformed.close()
            return
        self.ahead = ahead
        try:
            for batch in batches:
                where = find_kjt(batch)
                yield with_kjt(batch, where, self.transform(get_kjt(batch, where)))
        finally:
            self.ahead = 0
            self.settle()

    def run_hit_rates(self) -> tuple[float, dict[str, float]]:
        """Collective: the share of the run's lookups that found their ID resident, over every
        rank's: of all lookups (each ID counts once per lookup), and of each table's. Over the
        caller's group, never the transform thread's: it may be called while a thread
        transforms ahead, and then counts the batches transformed so far, ahead of the loop
        included."""
        both = torch.from_numpy(np.stack([self.looked_up, self.found])).to(collective_device(self.process_group))
        dist.all_reduce(both, group=self.process_group)
        looked, found = both.cpu().numpy()
        per_table = {n: float(f / lk) if lk else float("nan") for n, lk, f in zip(self.names, looked, found)}
        return (float(found.sum() / looked.sum()) if looked.sum() else float("nan")), per_table

    # -- looking up without training (evaluation) ---------------------------------------

    def look_up(self, kjt: KeyedJaggedTensor) -> LookedUp:
        """Collective: a batch's rows for a forward without backward, changing nothing.

        A resident ID reads its device row through the KJT over slots; an ID without one reads
        its row where it lies (the PS, or its initial value if it was never trained), pulled by
        its owner and pooled here: nothing is admitted, evicted, pinned, counted or pushed, so
        held-out data leaves no trace on the tables or the PS.

        Args:
            kjt: the batch's sparse features, over global IDs; tables pool by sum.

        Returns:
            The KJT over slots of the resident IDs (the others left out of their bags), and
            for each key of a dynamic table the sum of its bags' missing rows, (batch, dim).
        """
        self.settle()  # rows of transformed batches in place before any is read
        layout = self._layout(kjt)
        found = find_blocks([self.transformers[n] for n in self.names], layout.ids, layout.sizes)
        rows = self._missing_rows(found)  # per value of layout, in its order (zero for a hit); on the device
        device = rows.device
        lengths = kjt.lengths().long().to(device)
        order = layout.order if isinstance(layout.order, slice) else layout.order.to(device)
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)[order]
        weights = kjt.weights_or_none()
        if weights is not None:
            rows = rows * weights.to(device)[order].unsqueeze(1)
        pooled = torch.zeros(len(lengths), rows.shape[1], device=device).index_add_(0, segment, rows)
        pooled = pooled.view(len(kjt.keys()), -1, rows.shape[1])
        missing = {
            key: pooled[k, :, : self.rows[self.feature_table[key]].dim]
            for k, key in enumerate(kjt.keys())
            if key in self.feature_table
        }
        return LookedUp(self._over_slots(kjt, layout, found.slots), missing)

    def _missing_rows(self, found: Found) -> torch.Tensor:
        """The embeddings of the batch's IDs that no owner holds a row of, as (values, widest dim),
        zero where an ID has a row: each owner pulls those it owns from its store (a pull
        stores nothing) and sends them back, in the order they were asked."""
        width = max(self.rows[n].dim for n in self.names)
        world = self.world_size
        device = found.asked.device  # the transformers': the rows come back there
        # the owner's side: what it was asked and holds no row of, pulled table by table
        asked_missing = found.asked_slots < 0
        n_tables = len(self.names)
        asked_counts = found.asked_counts.to(device)
        table_of = torch.arange(n_tables, device=device).repeat(world).repeat_interleave(asked_counts.reshape(-1))
        missing_table = table_of[asked_missing].cpu().numpy()
        missing_ids = found.asked[asked_missing].cpu().numpy()
        wanted = {self.ps_names[t]: missing_ids[missing_table == t] for t in range(n_tables)}
        pulled = self.store.pull_many_async({name: ids for name, ids in wanted.items() if len(ids)}).result()
        self._count_pulled(np.bincount(missing_table, minlength=n_tables))
        answer_host = np.zeros((len(missing_ids), width), dtype=np.float32)
        for t, name in enumerate(self.names):
            if self.ps_names[t] in pulled:
                dim = self.rows[name].dim
                answer_host[missing_table == t, :dim] = pulled[self.ps_names[t]][:, :dim]
        # the asker's side: the rows of its IDs answered -1, owner by owner
        sent_missing = found.answers < 0
        if world == 1:
            got = torch.from_numpy(answer_host).to(device)
        else:  # on the group's device (NCCL: the GPU), in the counts the owners answer
            wire = collective_device(self.process_group)
            source_of = torch.arange(world, device=device).repeat_interleave(asked_counts.sum(1))
            owner_of = torch.arange(world, device=device).repeat_interleave(found.sent_counts.to(device).sum(1))
            answer_counts = torch.bincount(source_of[asked_missing], minlength=world).tolist()
            got_counts = torch.bincount(owner_of[sent_missing], minlength=world).tolist()
            got = torch.empty(sum(got_counts), width, device=wire)
            answer = torch.from_numpy(answer_host).to(wire)
            dist.all_to_all_single(got, answer, got_counts, answer_counts, group=self.process_group)
            got = got.to(device)
        rows = torch.zeros(len(found.answers), width, device=device)
        rows[sent_missing] = got
        return rows.index_select(0, found.position.to(device))

    def look_up_in_place(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Collective: a batch over slots for a forward without backward, the model unchanged.

        A resident ID reads its own row. An ID without one has its row (from the store, or its
        initial value if it was never trained) lent a slot of its owner for the forward: the
        slot's own row is kept aside and written back by give_back_lent(), which every
        transform, look-up, settle and flush calls first. So the model's own forward pools
        every row, bags and sequences alike, and nothing is admitted, evicted, pinned, counted
        or pushed. Run the forward before the tables are used again.

        Args:
            kjt: the batch's sparse features, over global IDs.

        Returns:
            The KJT over slots.

        IDs without a row beyond the slots a table can lend on their owner (its rows less the
        batch's resident IDs and pinned slots) are left out of their bags, with a warning.
        """
        self.settle()  # rows of transformed batches in place (and rows lent before given back)
        layout = self._layout(kjt)
        tables = [self.transformers[n] for n in self.names]
        found = find_blocks(tables, layout.ids, layout.sizes, answer_missing=self._lend_slots)
        return self._over_slots(kjt, layout, found.slots)

    def _lend_slots(self, asked: list[torch.Tensor], slots: list[torch.Tensor]) -> list[torch.Tensor]:
        """The owner's side of look_up_in_place: for each table, the IDs asked of this rank that
        have no row here get a slot none of the batch's resident IDs and no pinned batch uses,
        their rows pulled (one call for every table) and written in, the slot's row kept."""
        missing = [s < 0 for s in slots]
        unique = [torch.unique(a[m], return_inverse=True) for a, m in zip(asked, missing)]
        wanted = {self.ps_names[k]: ids.cpu().numpy() for k, (ids, _) in enumerate(unique) if len(ids)}
        pulled = self.store.pull_many_async(wanted).result() if wanted else {}
        self._count_pulled([len(ids) for ids, _ in unique])
        out = []
        for k, name in enumerate(self.names):
            ids, inverse = unique[k]
            if not len(ids):
                out.append(slots[k])
                continue
            t, rows = self.transformers[name], self.rows[name]
            free = t.local.pins == 0
            used = slots[k][~missing[k]] - t.offset
            free[used.to(free.device)] = False
            lent = torch.nonzero(free).squeeze(1)[: len(ids)]
            if len(lent) < len(ids):  # answered -1 (left out of their bags): raising here would hang the exchange
                log.warning(
                    "table %s: %d IDs of a looked-up batch have no row on rank %d and only %d slots are free to lend: "
                    "%d left out of their bags; look up smaller batches",
                    name,
                    len(ids),
                    self.rank,
                    len(lent),
                    len(ids) - len(lent),
                )
            self._lent.append((rows, lent, rows.read(lent)))
            rows.write(lent, torch.from_numpy(pulled[self.ps_names[k]][: len(lent)]))
            given = torch.full((len(ids),), -1, dtype=torch.int64, device=lent.device)
            given[: len(lent)] = lent + t.offset
            answer = slots[k].clone()
            answer[missing[k]] = given.to(answer.device)[inverse.to(answer.device)]
            out.append(answer)
        return out

    def give_back_lent(self) -> None:
        """The rows of slots lent to a looked-up batch written back (look_up_in_place)."""
        while self._lent:
            rows, lent, kept = self._lent.pop()
            rows.write(lent, kept)

    def look_up_batches(self, batches: Iterator[Batch]) -> Iterator[tuple[Batch, dict[str, torch.Tensor]]]:
        """Collective: each batch over device rows and its missing rows pooled (look_up)."""
        for batch in batches:
            looked = self.look_up(batch.sparse_features)
            yield Batch(batch.dense_features, looked.kjt, batch.labels), looked.missing

    # -- whole tables ------------------------------------------------------------------

    def _resident_ids(self, name: str) -> np.ndarray:
        """The IDs of table `name` resident on this rank (read on the thread that transforms:
        one copy from the device, every touch interval)."""
        local = self.transformers[name].local
        return local.slot_id[local.last_access != -1].cpu().numpy()

    def flush(self, changed_only: bool = False) -> int:
        """Push resident rows (with their optimizer state) to the PS; rows stay resident.

        Args:
            changed_only: only the rows of slots looked up since the last flush (on the device:
                their last access is at or past the step of that flush): every row training can
                have changed since, so the PS then has every row as trained, at the cost of the
                rows touched rather than of every resident one.

        Returns:
            The rows pushed.
        """
        self.settle()
        pushed = 0
        for name, t in self.transformers.items():
            local = t.local
            live = local.last_access != -1
            if changed_only:
                live &= local.last_access >= self._flushed_at.get(name, 0)
            self._flushed_at[name] = local.step
            slots = torch.nonzero(live).squeeze(1)
            if len(slots):
                ids = local.slot_id[slots]
                rows = self.rows[name].read(slots).cpu().numpy()
                self.store.push(self.specs[name].ps_schema.name, ids.cpu().numpy(), rows)
                pushed += len(slots)
        return pushed


def _set_lifecycle(store: RowStore, table: str, lifecycle: Lifecycle) -> None:
    """The PS table's lifecycle set to `lifecycle`, unless it is that already (every rank asks;
    setting it again would move its `since`)."""
    have = store.lifecycle(table)
    want = (lifecycle.ttl_s, lifecycle.max_rows, lifecycle.touch_every_s)
    if (have.ttl_s, have.max_rows, have.touch_every_s) != want:
        store.set_lifecycle(table, lifecycle)
        log.info("PS table %s: rows now expire: %s", table, lifecycle.to_dict() or "never")
