"""Run by torchrun from tests/tables/test_communicators.py: 2 gloo ranks set up as a NCCL job is
(a gloo control group of its own beside the default group, device.add_control_group), an own
model behind DynamicEmbeddings over each rank's embedded store, and every torch.distributed
collective noted: its group, the thread that called it, and whether another thread was inside a
collective of the same group at the time. The phases:

train: a loop with a transform thread (prefetch=1), hit_rate() called mid-loop (a collective of
    the training thread while the transform thread exchanges IDs).
evaluate: held-out batches looked up (wrap(train=False)).
break: a loop left early on both ranks after the same step, rank 0's transform thread held up
    right after handing over that step's batch until the loop has closed the iterator (so it
    sees the stop at once, while rank 1's thread has gone on); then more training.
checkpoint: a full and an incremental checkpoint, training past them, a restore and the same
    batches trained again, the tables exported; during save, restore and export any collective
    on a group other than the control group raises (the default group is NCCL in a GPU job, the
    tables' groups belong to the tables).

Each rank writes OUT/rank{r}.json."""

from __future__ import annotations

import faulthandler
import functools
import inspect
import itertools
import json
import os
import sys
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tables"))

from helpers import leave_process_groups  # noqa: E402
from tables_models import CONFIGS, FEATURES, UNIVERSE, build, train_step  # noqa: E402
from torchrec import KeyedJaggedTensor  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402

import dynemb.tables.device as device  # noqa: E402
import dynemb.tables.embeddings as embeddings_module  # noqa: E402
from dynemb import tables as dt  # noqa: E402
from dynemb.checkpoint import Checkpointer, CheckpointSettings, export_tables  # noqa: E402
from dynemb.tables.prefetch import TransformAhead  # noqa: E402

CAPACITY = 160  # 80 rows a rank, of the 400 IDs a table sees: rows are evicted and pulled
SIZE = 12  # samples a batch
HOLD = 4  # the break phase's loop leaves after this step

COLLECTIVES = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
]


class Recorder:
    """Every collective called through torch.distributed: which group (by the names given in
    `groups`), which thread; overlaps of two threads in one group's collectives; and, while
    `only` names a group, a call on any other group raises."""

    def __init__(self) -> None:
        self.groups: dict[str, object] = {}
        self.uses: dict[str, set[str]] = {}
        self.calls: dict[str, int] = {}
        self.overlaps: list[str] = []
        self.violations: list[str] = []
        self.only: tuple[str, str] | None = None  # (the one group allowed, the phase)
        self._inside: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def label(self, group) -> str:
        group = dist.group.WORLD if group is None else group
        return next((name for name, g in self.groups.items() if g is group), f"unnamed group {id(group)}")

    def install(self) -> None:
        for name in COLLECTIVES:
            fn = getattr(dist, name)
            setattr(dist, name, self._wrap(name, fn, inspect.signature(fn)))

    def _wrap(self, name, fn, signature):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            label = self.label(bound.arguments.get("group"))
            thread = threading.current_thread()
            role = "main" if thread is threading.main_thread() else thread.name
            with self._lock:
                self.uses.setdefault(label, set()).add(role)
                self.calls[label] = self.calls.get(label, 0) + 1
                others = self._inside.setdefault(label, set()) - {thread.ident}
                if others:
                    self.overlaps.append(f"{name} on the {label} group from {role} while another thread is in one")
                self._inside[label].add(thread.ident)  # type: ignore[arg-type]
            try:
                if self.only is not None and label != self.only[0]:
                    said = f"{name} on the {label} group during {self.only[1]} (only the {self.only[0]} group may be)"
                    self.violations.append(said)
                    raise RuntimeError(said)
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._inside[label].discard(thread.ident)  # type: ignore[arg-type]

        return recorded

    @contextmanager
    def allowing_only(self, group: str, phase: str):
        self.only = (group, phase)
        try:
            yield
        finally:
            self.only = None


def batches(rank: int, n: int, seed: int):
    """Batches whose dense features hold their number in the stream (the model reads only the KJT)."""
    gen = torch.Generator().manual_seed(seed + rank)
    for k in range(n):
        lengths = torch.randint(0, 4, (2 * SIZE,), generator=gen)
        values = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * UNIVERSE).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths)
        yield Batch(torch.full((SIZE, 1), float(k)), kjt, (torch.rand(SIZE, generator=gen) < 0.5).float())


def train(model, dense, data) -> list[float]:
    return [train_step(model, dense, b.sparse_features, b.labels) for b in data]


class _HoldAfter:
    """The transform thread's hand-over queue, holding the thread right after it hands over
    batch number `at` until the loop has stopped it."""

    def __init__(self, queue, at: int, stop: threading.Event) -> None:
        self.queue, self.at, self.stop = queue, at, stop

    def put(self, item) -> None:
        self.queue.put(item)
        if isinstance(item, tuple) and int(item[0].dense_features[0, 0]) == self.at:
            self.stop.wait(30)

    def get(self):
        return self.queue.get()


class HeldOnRank0(TransformAhead):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if dist.get_rank() == 0:
            self._ready = _HoldAfter(self._ready, HOLD - 1, self._stop)  # type: ignore[assignment]


def phases(out: str, rank: int, recorder: Recorder, result: dict) -> None:
    model, dense = build(CAPACITY)
    with dt.DynamicEmbeddings(model, CONFIGS, table_prefix="comm_") as dyn:
        recorder.groups.update(tables=dyn.tables.process_group, transform=dyn.tables.thread_group)

        for step, b in enumerate(dyn.wrap(batches(rank, 6, seed=1), prefetch=1), start=1):
            train_step(model, dense, b.sparse_features, b.labels)
            if step == 3:
                dyn.hit_rate()  # collective, on the training thread, while the transform thread runs
        result["phases"].append("train")

        with torch.no_grad():
            for b in dyn.wrap(batches(rank, 3, seed=50), train=False):
                model(b.sparse_features)
        result["phases"].append("evaluate")

        embeddings_module.TransformAhead = HeldOnRank0  # type: ignore[misc]
        try:
            data = dyn.wrap(batches(rank, 100, seed=7), prefetch=1)
            for step, b in enumerate(data, start=1):
                train_step(model, dense, b.sparse_features, b.labels)
                if step == HOLD:
                    break
            data.close()  # type: ignore[attr-defined]  # a generator: its transform thread stops
        finally:
            embeddings_module.TransformAhead = TransformAhead  # type: ignore[misc]
        train(model, dense, dyn.wrap(batches(rank, 3, seed=9), prefetch=1))
        dyn.hit_rate()
        result["phases"].append("break")

        settings = CheckpointSettings(batch_size=SIZE, directory=os.path.join(out, "ck"), full_every=2, progress=False)
        ckpt = Checkpointer.of(dyn, dense, settings)
        stream = ckpt.tap(batches(rank, 11, seed=20))
        train(model, dense, dyn.wrap(itertools.islice(stream, 4), prefetch=1))
        with recorder.allowing_only("control", "checkpoint save"):
            ckpt.save(4)
        train(model, dense, dyn.wrap(itertools.islice(stream, 4), prefetch=1))
        with recorder.allowing_only("control", "checkpoint save"):
            ckpt.save(8)  # incremental: the IDs touched since step 4, gathered over the ranks
        after = list(stream)
        result["losses_on"] = train(model, dense, dyn.wrap(iter(after), prefetch=1))
        with recorder.allowing_only("control", "restore"):
            result["restored_step"] = Checkpointer.of(dyn, dense, settings).restore("latest")
        result["losses_again"] = train(model, dense, dyn.wrap(iter(after), prefetch=1))
        with recorder.allowing_only("control", "export"):
            manifests = export_tables(dyn, os.path.join(out, "export"), progress=False)
        result["exported_rows"] = {name: m.num_rows for name, m in manifests.items()}
        result["phases"].append("checkpoint")


def main() -> None:
    out = sys.argv[1]
    faulthandler.dump_traceback_later(120, exit=True)  # a hung collective prints its stacks
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    recorder = Recorder()
    # the gloo group that init_distributed makes beside NCCL's default group
    recorder.groups.update(default=dist.group.WORLD, control=device.add_control_group())
    recorder.install()
    result: dict = {"phases": []}
    try:
        phases(out, rank, recorder, result)
    finally:
        result["uses"] = {label: sorted(roles) for label, roles in recorder.uses.items()}
        result["calls"] = recorder.calls
        result["overlaps"], result["violations"] = recorder.overlaps, recorder.violations
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
    # no reference left to a group, so that destroying them all ends their gloo threads
    recorder.groups.clear()
    device._control = None
    leave_process_groups()


if __name__ == "__main__":
    main()
