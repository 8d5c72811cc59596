"""Batches transformed ahead of the training loop, by a thread of their own.

A dynamic step's transform (the IDs' exchange between ranks, the ID transformer, the rows'
push and pull) takes ~8 ms of CPU and ~15 ms of a ~50 ms step on 2 CPU cores, the rest
waiting on the other rank's exchange or on the PS. Here a thread transforms batch j while the
loop trains earlier ones, and the loop takes j ready, its rows in place. The thread's waits do
not stall training, and it runs while the training thread waits in TorchRec's own collectives.
The cost: one more batch pinned per batch ahead, so a table needs room for that many more
batches' IDs (a batch refused for want of room says so).
The thread sends the batches through DynamicTables.transform_stream: one exchange between the
ranks per batch instead of three (dynemb/idtransformer/stream.py), since it knows the next batch.

    batches = TransformAhead(tables, raw_batches, window=4)
    for batch in batches:       # transformed, rows in place
        ...train...
        tables.release_oldest()  # handed to the thread, which applies it in order
    batches.close()

What keeps it exact and reproducible:
- Only the thread touches the tables' state while it runs. The loop's releases are counted
  and applied by the thread before the transform that needs their slots, and no earlier:
  before batch j is transformed, just enough releases are applied to leave window - 1
  batches in flight (pinned), waiting for the loop to ask for them if need be. So what is
  pinned at each transform, and with it the eviction order, depends on the batches alone,
  not on the threads' timing.
- The thread's collectives use a process group of their own (DynamicTables.thread_group, a
  gloo one from DynamicEmbeddings), which the loop never uses, so they never interleave with
  the loop's (TorchRec's input and output dists, DDP's all-reduce, look-ups, checkpoints) on
  one group, and the thread drives no NCCL communicator beside the loop's (docs/design.md,
  "Communicators and threads").
- The thread stops, when the loop closes it, at the same exchange on every rank: only where it
  must wait for a release that has not come (make_room). Every rank's loop has then taken the
  same batches and released the same ones, so every rank's thread stops after the same
  exchange, whichever saw the stop first; a thread that stopped as soon as it saw the stop
  could leave the other ranks' threads inside an exchange it never joins.
- Rows moved by the thread are never rows a batch in flight uses (those slots are pinned),
  so the loop's forward, backward and fused optimizer touch other rows of the same tables.
- On a GPU the thread has a CUDA stream of its own (RowMoves.thread_stream), and hands each
  batch over with the event after its rows' copy in: the loop's stream waits on that event
  (not the host, not the device) before it computes on the batch (dynemb/tables/row_moves.py).

priority: how the operating system schedules the thread against the training threads.
"normal" (the trainer's default): as any other thread. "idle" (Linux's SCHED_IDLE): it runs on cores the training
threads leave free, and never takes a core from them; on 2 cores, 2 ranks, it raised
train_bench's ratio from 0.71-0.73 to 0.80-0.86 of plain TorchRec (bench/RESULTS.md): a normal thread
competes for the same cores, delays the training thread that is the step's critical path,
and that one rank's delay holds every rank up at the next collective. The thread is ahead of
the loop by design, so it needs the cores only between the loop's waits (collectives,
the other rank). Where other busy processes share the machine, an idle thread may get no
core for long stretches and the loop then waits for its batches (with two busy loops on
the machine, 300 steps took more than 150 s instead of 16 s): a default may not depend on the
machine being otherwise idle, so "idle" is only asked for. "low" (nice 19) is the milder choice.

window: a batch is transformed once at most window - 1 earlier batches are in flight
(transformed, not yet released). TorchRec's TrainPipelineSparseDist fetches batch i + 2
while batches i and i + 1 are in flight (it released i - 1 at the end of the step before):
window 3 is what it does inline, and window 4 lets the thread transform a batch one step
before the pipeline asks for it. A plain loop (fetch, train, release) has none in flight when
it fetches: window 1 inline, 2 a step ahead.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable, Iterator

from dynemb.tables.batches import find_kjt, get_kjt
from dynemb.tables.jagged import Batch

log = logging.getLogger("dynemb.trainer")

_END = object()  # the thread is done
PRIORITIES = ("normal", "low", "idle")


def set_thread_priority(priority: str) -> None:
    """The calling thread's scheduling (see the module's docstring); on a system without
    SCHED_IDLE or per-thread nice values it stays as it is, with a warning."""
    if priority not in PRIORITIES:
        raise ValueError(f"transform thread priority must be one of {PRIORITIES}, got {priority!r}")
    try:
        if priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux)
        elif priority == "low":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as e:
        log.warning("could not give the transform thread %s priority (%s): it runs at normal priority", priority, e)


class TransformAhead(Iterator[Batch]):
    """The batches, transformed by a thread ahead of the loop (see the module doc).

    Args:
        tables: the DynamicTables the batches are transformed by.
        batches: the raw batches.
        window: at most window - 1 batches are in flight when one is transformed; >= 1.
        join_seconds: how long close() waits for the thread.
        priority: "normal", "idle" or "low": how the thread is scheduled.
    """

    def __init__(
        self, tables, batches: Iterable[Batch], window: int, join_seconds: float = 60.0, priority: str = "normal"
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (batches in flight at a transform, plus one), got {window}")
        if priority not in PRIORITIES:
            raise ValueError(f"transform thread priority must be one of {PRIORITIES}, got {priority!r}")
        self.priority = priority
        self.native_id: int | None = None  # the thread's, once it runs
        self.tables = tables
        self.window = window
        self.join_seconds = join_seconds
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._done = False
        tables.defer_releases()
        self._thread = threading.Thread(target=self._run, args=(iter(batches),), name="dynemb-transform", daemon=True)
        self._thread.start()

    def _run(self, batches: Iterator[Batch]) -> None:
        tables = self.tables
        self.native_id = threading.get_native_id()
        set_thread_priority(self.priority)
        try:
            with tables.moves.thread_stream():
                # tables.ahead is 0: each batch's rows are in place when it is handed over (on a GPU:
                # once the event handed with it has passed: its rows are in, its KJT over slots made)
                # no return here when the loop has closed the batches: the thread stops in make_room
                # alone (see the module's docstring: at the same exchange on every rank)
                for batch in tables.transform_stream(batches, lambda: tables.make_room(self.window - 1, self._stop)):
                    self._ready.put((batch, tables.moves.handed_over()))
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, raised there in order
            self._ready.put(exc)
        finally:
            tables.end_deferred_releases()
            self._ready.put(_END)

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        item = self._ready.get()
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        batch, ready = item
        if ready is not None:  # on a GPU: the loop's stream waits for the batch's rows and KJT
            self.tables.moves.wait(ready)
            kjt = get_kjt(batch, find_kjt(batch))  # made on the thread's stream, used on the loop's
            self.tables.moves.adopt([kjt.values(), kjt.lengths(), kjt.weights_or_none()])
        return batch

    def _finish(self) -> None:
        self._done = True
        self._thread.join()

    def close(self) -> None:
        """Stop transforming: batches transformed but not taken stay in flight (release them
        with release_oldest as usual). Waits for the transform under way, if any: the thread
        may first finish the exchange it is in, and any the window leaves room for.

        Raises:
            RuntimeError: the thread did not stop within join_seconds (inside an exchange that
                another rank has not joined: its loop took other batches, or it failed). Its
                group and the tables are the thread's still: nothing can use them safely.
        """
        if self._done:
            return
        self._done = True
        self._stop.set()
        self._thread.join(self.join_seconds)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the transform thread did not stop within {self.join_seconds:.0f} s: it is inside an exchange with "
                f"the other ranks that one of them has not joined (its loop took other batches than this rank's, or "
                f"it failed); these dynamic tables cannot be used any more"
            )
