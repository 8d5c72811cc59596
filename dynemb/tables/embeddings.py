"""DynamicEmbeddings: dynamic tables in front of a DistributedModelParallel model, in one object.

    model = shard_model(model, tables, device)               # DMP, the dynamic tables row-wise
    with DynamicEmbeddings(model, tables, store=None) as dyn:  # None: the embedded store
        for batch in dyn.wrap(train_batches):                 # KJT of global IDs -> KJT of slots
            loss = model(batch)
            loss.backward()
            optimizer.step()
        for batch in dyn.wrap(eval_batches, train=False):     # looked up: nothing admitted or pushed
            ...model(batch)...
    # leaving the block (an exception and Ctrl-C included) pushes every resident row to the store

Why wrapping the model's data rather than hooking TorchRec's planner and sharders, as NVIDIA's
dynamicemb does: the model, its tables and TorchRec's own fused kernels stay exactly as TorchRec
makes them (any EmbeddingBagCollection or EmbeddingCollection, any optimizer TorchRec fuses, any
TorchRec release), and the one thing dynemb changes, which ID a row holds, happens between the
data and the model, where a user can see it: a KJT of IDs in, a KJT of slots out.

Evaluation inside training: a `wrap(..., train=False)` while a training loop's wrap is under way
(every N steps, as most jobs evaluate) looks its batches up beside the training batches in
flight, whose pins and rows it leaves alone; the training loop then goes on where it was. With
a TorchRec pipeline, evaluate the model `pipeline.detach()` gives back and `attach` it after.

Pins: a batch's slots are pinned (never evicted, never given to another ID) from its transform
until the loop is through its backward and optimizer step. wrap() knows that from the loop
itself: when the loop asks for batch j + 1, batch j + 1 - in_flight is done. A plain loop
(fetch, forward, backward, step) has one batch in flight (in_flight=1); TorchRec's
TrainPipelineSparseDist fetches two ahead (in_flight=3).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import sys
import weakref
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dynemb.tables.config import STARTS, TableConfig
from dynemb.tables.device import ensure_control_group
from dynemb.tables.dynamic import DynamicTables, DynamicTableSpec
from dynemb.tables.errors import SetupError
from dynemb.tables.metrics import TrainerMetrics
from dynemb.tables.prefetch import PRIORITIES, TransformAhead
from dynemb.tables.row_store import RowStore, open_store
from dynemb.tables.startup import agree, check_tables
from dynemb.tables.table_rows import TableRows, find_tables, table_configs

log = logging.getLogger("dynemb.tables")
B = TypeVar("B")


_open: weakref.WeakSet[DynamicEmbeddings] = weakref.WeakSet()


@atexit.register
def _warn_unclosed() -> None:
    for dyn in list(_open):
        resident = dyn.resident_rows()
        if resident:
            print(
                f"dynemb: DynamicEmbeddings of tables {', '.join(dyn.names)} were never closed: {resident:,} rows "
                f"trained on this rank did not reach {dyn.store.where}. Use `with DynamicEmbeddings(...)` or "
                f"call close() (or flush()) before the process ends.",
                file=sys.stderr,
                flush=True,
            )


class DynamicEmbeddings:
    """Dynamic tables in front of a DistributedModelParallel model's tables.

    Collective: every rank makes it with the same tables, in the same order. The model's
    dynamic tables must be sharded row-wise with the FUSED kernel (shard_model does that);
    each table's num_embeddings is its capacity (rows on the devices), a multiple of the ranks.

    Args:
        model: the sharded model.
        tables: one config per dynamic table.
        store: where every row lives: None (the embedded store in this process; per rank
            under torchrun, each holding the rows of the IDs it owns), PS addresses
            ("host:port", comma-separated for several PS; checked at once), or a RowStore.
        start: what to do with rows an earlier run left in the store: "new" refuses to start
            over them, "warm" trains on from them, "fresh" drops them first, "resume" leaves them
            for restore() to replace.
        table_prefix: put in front of every PS table name.
        ps_timeout_seconds: how long the start waits for the PS to be ready, and one pull or
            push keeps retrying an unreachable PS.
        metrics: this rank's metrics to count in (TrainerMetrics; None: new ones, labelled `job`).
        metrics_port: serve this rank's Prometheus metrics on this port + LOCAL_RANK (0: off).
        job: the metrics' train_job label.

    Raises:
        SetupError: the model is not sharded as dynamic tables need, a table is missing, or
            its rows do not split evenly over the ranks (the message says how to fix it).
        StartRefused: the store holds this job's tables with rows (start="new") or with
            another schema.
    """

    def __init__(
        self,
        model: nn.Module,
        tables: Sequence[TableConfig],
        store: str | RowStore | None = None,
        *,
        start: str = "new",
        table_prefix: str = "",
        ps_timeout_seconds: float = 600.0,
        metrics: TrainerMetrics | None = None,
        metrics_port: int = 0,
        job: str = "dynemb",
    ) -> None:
        if start not in STARTS:
            raise ValueError(f"start must be one of {', '.join(STARTS)}, got {start!r}")
        if not dist.is_initialized():
            raise SetupError(
                "torch.distributed is not initialized: run under torchrun, or call "
                "dynemb.tables.init_distributed() first (it makes a group of one process)"
            )
        self.configs = list(tables)
        if not self.configs:
            raise SetupError("no dynamic tables given: pass one TableConfig per table to make dynamic")
        names = [c.name for c in self.configs]
        if len(set(names)) != len(names):
            raise SetupError(f"a table is given twice: {', '.join(names)}")
        self.model, self.start = model, start
        rows = _table_rows(model, names)
        for c in tables:
            have = rows[c.name].local_rows * dist.get_world_size()
            if c.capacity is not None and c.capacity != have:
                raise SetupError(
                    f"table {c.name}: TableConfig.capacity is {c.capacity:,} but the model's table has {have:,} rows "
                    f"(its num_embeddings): make them agree"
                )
        self.device = next(iter(rows.values())).weights.device
        self.schemas = {c.name: c.schema(rows[c.name].dim, rows[c.name].state_width, table_prefix) for c in tables}
        self._owns_store = not isinstance(store, RowStore)
        self.store = _open_store(store, ps_timeout_seconds)
        self.closed = False
        try:
            control = ensure_control_group()  # gloo beside NCCL, made here if the job made its NCCL group itself
            if start != "resume":
                schemas = list(self.schemas.values())
                agree(lambda: check_tables(schemas, self.store, start, dist.get_rank()), self.store, control)
            self.metrics = metrics or TrainerMetrics(dist.get_rank(), job=job)
            self.store.watch_calls(self.metrics.ps_calls)  # PS retries, failures and waits, as metrics
            if metrics_port:
                self.metrics.serve(metrics_port + int(os.environ.get("LOCAL_RANK", "0")))
            # The IDs' exchanges over groups of their own: the training thread's (inline
            # transforms, look-ups, hit rates) over one of the job's backend, a transform
            # thread's (wrap's prefetch) over a gloo one. So two threads never share a group,
            # and the transform thread drives no NCCL communicator while the training loop
            # drives its own, which NCCL does not allow (docs/design.md, "Communicators and
            # threads").
            group = dist.new_group(backend=dist.get_backend())
            thread_group = dist.new_group(backend="gloo")
            specs = [
                DynamicTableSpec(
                    c.name, _features(model, c.name), self.schemas[c.name], c.eviction(), c.admit_threshold, c.lifecycle
                )
                for c in tables
            ]
            self.tables = DynamicTables(
                rows, specs, self.store, self.metrics, group=group, device=self.device, thread_group=thread_group
            )
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self.names = names
        # the wraps under way, weakly: a loop left early (break) drops its generator, which
        # then ends (and releases its batches) at once; one still referenced is a loop that goes on
        self._training: weakref.ref[Generator[Any, None, None]] | None = None
        self._evaluating: weakref.ref[Generator[Any, None, None]] | None = None
        _open.add(self)

    # -- the loop ------------------------------------------------------------------------

    def wrap(
        self,
        batches: Iterable[B],
        *,
        train: bool = True,
        in_flight: int = 1,
        prefetch: int = 0,
        priority: str = "normal",
    ) -> Iterator[B]:
        """Collective: the batches with their KJT over slots, each batch's rows in place.

        A batch is a KeyedJaggedTensor of global IDs, or holds one (a tuple, list, dict,
        NamedTuple or dataclass member, e.g. TorchRec's Batch.sparse_features); it comes back
        as it came, that KJT over slots. Features of no dynamic table keep their values.

        Args:
            batches: this rank's batches.
            train: True: transformed (IDs admitted, evicted rows pushed, admitted rows pulled,
                slots pinned until the loop is done with the batch). False (evaluation): looked
                up, with nothing admitted, evicted, counted or pushed; IDs without a device row
                read their row from the store through a slot lent for the forward.
            in_flight: batches the loop holds at once: 1 for a plain loop (fetch, forward,
                backward, step), 3 for TorchRec's TrainPipelineSparseDist.
            prefetch: batches a thread transforms ahead of the loop (0: none); each costs a
                batch's IDs more pinned slots. That thread reads `batches`: their iterator must
                call no collective (docs/design.md, "Communicators and threads").
            priority: that thread's scheduling: "normal", "low" or "idle".

        Returns:
            An iterator of the batches; leaving it early (break) stops it cleanly.
        """
        if self.closed:
            raise SetupError("these DynamicEmbeddings are closed: make new ones to train on")
        if in_flight < 1 or prefetch < 0:
            raise ValueError(f"in_flight must be >= 1 and prefetch >= 0, got {in_flight} and {prefetch}")
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        training, evaluating = _under_way(self._training), _under_way(self._evaluating)
        if evaluating is not None:
            raise SetupError(
                "wrap() while an evaluation wrap's loop has not ended: finish that loop, break out of it, "
                "or close() its iterator first"
            )
        if training is not None and train:
            raise SetupError(
                "wrap() for training while another training wrap's loop has not ended: two training loops cannot "
                "share the tables; finish or break out of the first, or close() its iterator (an evaluation "
                "wrap, train=False, may run inside a training loop)"
            )
        if training is not None:  # evaluation inside a training loop: its batches stay in flight
            if self.tables.transforming_ahead:
                raise SetupError(
                    "wrap(train=False) inside a training wrap with prefetch: its thread moves rows while the "
                    "look-up would lend slots; evaluate between training wraps, or train with prefetch=0"
                )
            out = self._look_up(iter(batches))
            self._evaluating = weakref.ref(out)
            return out
        self._release_all()  # a new pass: the loop is done with the last one's batches
        if train:
            out = self._train(iter(batches), in_flight, prefetch, priority)
            self._training = weakref.ref(out)
        else:
            out = self._look_up(iter(batches))
            self._evaluating = weakref.ref(out)
        return out

    def _train(
        self, batches: Iterator[Any], in_flight: int, prefetch: int, priority: str
    ) -> Generator[Any, None, None]:
        tables = self.tables
        yielded = released = 0
        source: Iterator[Any]
        transformer = None
        if prefetch:
            source = transformer = TransformAhead(tables, batches, in_flight + prefetch, priority=priority)
        else:
            source = tables.wrap(batches, ahead=1 if in_flight > 1 else 0)

        def release_done() -> None:
            # before the next batch is asked for: all but the in_flight - 1 latest are done
            nonlocal released
            for _ in range(yielded - (in_flight - 1) - released):
                tables.release_oldest()  # with a transform thread: handed to it, applied in order
                released += 1

        try:
            while True:
                release_done()
                try:
                    batch = next(source)
                except StopIteration:
                    return
                yielded += 1
                yield batch
        finally:
            if transformer is not None:
                transformer.close()
            else:
                source.close()  # type: ignore[attr-defined]  # the generator of DynamicTables.wrap
            self._training = None
            # No batch is transformed until the next wrap, so every batch yielded may be released
            # now (a pipeline still training its last two holds no slot anyone else can take),
            # and a checkpoint taken here holds no pinned slot.
            self._release_all()

    def _look_up(self, batches: Iterator[Any]) -> Generator[Any, None, None]:
        from dynemb.tables.batches import find_kjt, get_kjt, with_kjt

        try:
            for batch in batches:
                where = find_kjt(batch)
                yield with_kjt(batch, where, self.tables.look_up_in_place(get_kjt(batch, where)))
        finally:
            self.tables.give_back_lent()  # the last batch's forward is done once the loop asks again
            self._evaluating = None

    def _release_all(self) -> None:
        """Every batch still pinned released (no wrapped iterator runs: wrap and close stop it
        first), every row move finished."""
        if self.tables.transforming_ahead:  # a transform thread that did not stop (prefetch.py's close)
            raise SetupError(
                "a transform thread that did not stop still holds these tables (see the error its wrap raised)"
            )
        while self.tables.in_flight:
            self.tables.release_oldest()
        self.tables.settle()

    # -- whole tables ----------------------------------------------------------------------

    def flush(self, changed_only: bool = False) -> int:
        """Push every resident row, with its optimizer state, to the store; rows stay resident.
        Not collective. Returns the rows pushed.

        Args:
            changed_only: only the rows looked up since the last flush, the ones training can
                have changed (what a publish needs: dynemb.publish.publish_tables).

        Raises:
            SetupError: a thread is transforming batches ahead (a wrap with prefetch still
                running): it moves rows while they would be read.
        """
        if self.tables.transforming_ahead:
            raise SetupError(
                "flush() while a thread transforms batches ahead (wrap(prefetch=...)) and moves rows: flush between "
                "wraps (once the wrapped batches have ended, or after closing them), or wrap with prefetch=0"
            )
        return self.tables.flush(changed_only)

    def resident_rows(self) -> int:
        """IDs with a row on this rank's devices, over every dynamic table."""
        return sum(int(t.local.resident) for t in self.tables.transformers.values())

    @property
    def last_hit_rate(self) -> float:
        """The share of the last training batch's IDs (this rank's own) found resident."""
        return self.tables.last_hit_rate

    @property
    def hit_rates(self) -> list[float]:
        """last_hit_rate of every training batch so far, in order."""
        return list(self.tables.hit_rates)

    def hit_rate(self) -> tuple[float, dict[str, float]]:
        """Collective: the share of the lookups that found their ID resident since the start,
        over every rank: of all lookups, and per table."""
        return self.tables.run_hit_rates()

    def close(self) -> None:
        """Stop any wrapped iterator, push every resident row to the store, close the store if
        these tables opened it. Not collective: rows are in the store once every rank's close()
        has returned (read them back after a barrier of your own). Closing twice does nothing."""
        if self.closed:
            return
        try:
            for wrapping in (self._evaluating, self._training):
                gen = wrapping() if wrapping is not None else None
                if gen is not None:
                    gen.close()
            self._release_all()
            self.tables.flush()
            self.tables.toucher.close()
        finally:
            self.closed = True
            _open.discard(self)
            if self._owns_store:
                self.store.close()
            # their own groups' gloo threads end with them, not with the process (their last
            # collective's work finishing in interpreter shutdown would abort the process)
            if dist.is_initialized():
                dist.destroy_process_group(self.tables.process_group)
                dist.destroy_process_group(self.tables.thread_group)

    def __enter__(self) -> DynamicEmbeddings:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the loop's own exception is the one to see; a failed push is logged beside it
            self.close()
        except Exception as exc:  # noqa: BLE001
            log.error("could not push the resident rows to %s after the loop failed: %s", self.store.where, exc)


def init_distributed(device: torch.device | str = "cpu") -> bool:
    """Join torchrun's process group, or make a group of one process (gloo on CPU, NCCL on
    CUDA); True if this call made it (destroy it with torch.distributed.destroy_process_group)."""
    from dynemb.tables.device import init_distributed as init

    return init(torch.device(device))


def _open_store(store: str | RowStore | None, timeout: float) -> RowStore:
    if isinstance(store, RowStore):
        return store
    if store is not None and (not isinstance(store, str) or not store.strip()):
        raise SetupError(
            f"store must be None (the embedded store), PS addresses 'host:port[,host:port]' or a RowStore, "
            f"not {store!r}"
        )
    return open_store(store, timeout=timeout, attempt_timeout=min(30.0, timeout))


def _sharding(model: nn.Module) -> dict[str, Any]:
    """{table name: its ParameterSharding} from the DMP model's plan."""
    plan = getattr(getattr(model, "plan", None), "plan", None) or {}
    return {table: p for module_plan in plan.values() for table, p in dict(module_plan).items()}


def _table_rows(model: nn.Module, names: list[str]) -> dict[str, TableRows]:
    """Each named table's rows on this rank, or a SetupError that says what is wrong with it."""
    from torchrec.distributed import DistributedModelParallel

    if not isinstance(model, DistributedModelParallel):
        raise SetupError(
            f"the model is a {type(model).__name__}, not a DistributedModelParallel: shard it first with "
            f"dynemb.tables.shard_model(model, tables, device)"
        )
    sharding = _sharding(model)
    world = dist.get_world_size()
    for name in names:
        p = sharding.get(name)
        if p is None:
            raise SetupError(
                f"the model has no table {name!r}; its tables: {', '.join(sharding) or 'none'} "
                f"(TableConfig.name is the TorchRec table's name, EmbeddingBagConfig.name)"
            )
        if p.sharding_type != "row_wise" or p.compute_kernel != "fused":
            raise SetupError(
                f"table {name} is sharded {p.sharding_type} with the {p.compute_kernel} kernel; dynamic tables need "
                f"row_wise and fused: shard with dynemb.tables.shard_model, or add dynemb.tables.constraints(tables) "
                f"to your planner's constraints and plan with dynemb.tables.sharders()"
            )
        shards = getattr(p.sharding_spec, "shards", None) or []
        total = sum(int(s.shard_sizes[0]) for s in shards)
        sizes = {int(s.shard_sizes[0]) for s in shards}
        if len(shards) != world or len(sizes) != 1:
            fit = -(-total // world) * world
            raise SetupError(
                f"table {name} has {total:,} rows, not a multiple of the {world} ranks: dynamic tables keep an equal "
                f"block on each rank; make its num_embeddings a multiple of {world} (e.g. {fit:,})"
            )
    found = find_tables(model)
    return {n: found[n] for n in names}


def _features(model: nn.Module, table: str) -> list[str]:
    """The KJT keys a table serves, from the model's embedding configs."""
    config = table_configs(model).get(table)
    if config is None:
        raise SetupError(f"found no feature names of table {table} in the model's embedding modules")
    return list(config.feature_names)


__all__ = ["DynamicEmbeddings", "SetupError", "init_distributed"]


def _under_way(wrapping: weakref.ref[Generator[Any, None, None]] | None) -> Generator[Any, None, None] | None:
    """The generator of a wrap whose loop has started and not ended, else None; one made but
    never started is closed here (it holds nothing yet)."""
    gen = wrapping() if wrapping is not None else None
    if gen is None:
        return None
    state = inspect.getgeneratorstate(gen)
    if state == inspect.GEN_CREATED:
        gen.close()
        return None
    return gen if state != inspect.GEN_CLOSED else None
