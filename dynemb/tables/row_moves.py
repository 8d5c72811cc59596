"""Rows between the device's tables and the host, for the PS: read out (evicted) and written in
(admitted). On CPU that is RowGroup's read and write, nothing more. On a GPU:

- read out: the rows are gathered on the device (the calling thread's stream, after the
  training stream's step of the batch that last released them: `released()`), copied into a
  pinned host buffer on a side stream, and the host waits for that copy's event alone (never
  a device-wide sync) before the rows go to the PS;
- written in: the pulled rows are put in a pinned buffer, copied to the device and scattered
  into their slots on the side stream; the event recorded after them (`rows_in`) is what the
  training stream waits on (`wait`) before a batch that reads those rows computes.

Pinned buffers are kept and reused (a buffer goes back once its push is done, or its copy
in has completed), so a step allocates none once they have grown to its size. Rows moved
are never rows of a batch in flight (pins, see dynamic.py), so the side stream's writes and
the training stream's reads and updates touch different rows of the same tables.

    moves = RowMoves(group, device)
    rows, held = moves.read_out(slots, counts)   # per table, host rows (numpy)
    ...push rows...; moves.give_back(held)       # once the push no longer needs them
    moves.write_in(slots, counts, pulled)        # per table, host rows or None
    moves.wait()                                  # this thread's stream waits for them
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from dynemb.tables.row_group import RowGroup

Event = torch.cuda.Event


class _PinnedPool:
    """Flat float32 pinned host buffers, reused: one is taken whole (by a move) and given back
    with the event after which it is free again (None: free now)."""

    KEEP = 8  # buffers kept at most (the batches whose moves overlap, plus a few)

    def __init__(self) -> None:
        self.free: list[tuple[torch.Tensor, Event | None]] = []
        self.allocated = 0  # buffers made, for tests

    def take(self, n: int) -> torch.Tensor:
        """A buffer of at least n floats, no longer in use."""
        for i, (buf, done) in enumerate(self.free):
            if buf.numel() >= n and (done is None or done.query()):
                del self.free[i]
                return buf
        self.allocated += 1
        size = 1 << max(n - 1, 1023).bit_length()  # powers of 2 from 1024: a slightly larger batch reuses it
        return torch.empty(size, dtype=torch.float32, pin_memory=True)

    def give(self, buf: torch.Tensor, done: Event | None = None) -> None:
        self.free.append((buf, done))
        if len(self.free) > self.KEEP:  # the smallest goes
            self.free.remove(min(self.free, key=lambda f: f[0].numel()))


class RowMoves:
    """Reads and writes of a RowGroup's rows for the PS (see the module doc).

    Args:
        group: the tables' rows.
        device: where they live; on "cpu" every method is RowGroup's or does nothing.
    """

    def __init__(self, group: RowGroup, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.rows_in: Event | None = None  # after the latest write_in's copies and scatter
        self._released: Event | None = None  # after the training stream's latest released step
        if self.cuda:
            self._side = torch.cuda.Stream(self.device)
            self._pool = _PinnedPool()

    def released(self) -> None:
        """The calling (training) thread has queued the step of a batch whose rows may now be
        moved: what read_out gathers from here on waits for that step on the device."""
        if self.cuda:
            self._released = torch.cuda.Event()
            self._released.record(torch.cuda.current_stream(self.device))

    def wait(self, event: Event | None = None) -> None:
        """The calling thread's current stream waits for `event` (default: rows_in) on the
        device; the host goes on."""
        event = event or self.rows_in
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def handed_over(self) -> Event | None:
        """An event past everything the calling thread's stream and the side stream have queued
        (a batch's KJT over slots, its rows): what the loop's stream waits for before it uses a
        batch that another thread made (None on CPU)."""
        if not self.cuda:
            return None
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def adopt(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Tensors made on another thread's stream, now used on the calling thread's: their
        memory is not reused before this stream's work on them is done (record_stream)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(current)

    @contextlib.contextmanager
    def thread_stream(self) -> Iterator[None]:
        """For a thread of its own (the transform thread): the device current there, and a
        stream of its own, so its work never queues behind the training stream's."""
        if not self.cuda:
            yield
            return
        torch.cuda.set_device(self.device)  # per thread: a new thread starts on GPU 0
        with torch.cuda.stream(torch.cuda.Stream(self.device)):
            yield

    def read_out(self, slots: torch.Tensor, counts: list[int]) -> tuple[list[np.ndarray], torch.Tensor | None]:
        """Per table, the (counts[t], dim + state width) rows at its slots (RowGroup.read's
        order), on the host, and what to give_back once they are no longer read (None on CPU)."""
        if not self.cuda:
            return [d.numpy() for d in self.group.read(slots, counts)], None
        current = torch.cuda.current_stream(self.device)
        if self._released is not None:
            current.wait_event(self._released)
        data = self.group.read(slots.to(self.device), counts)
        buf = self._pool.take(sum(d.numel() for d in data))
        host, at = [], 0
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            for d in data:
                view = buf[at : at + d.numel()].view(d.shape)
                view.copy_(d, non_blocking=True)
                d.record_stream(self._side)  # made on `current`: not reused before the copy is done
                host.append(view.numpy())
                at += d.numel()
        copied = torch.cuda.Event()
        copied.record(self._side)
        copied.synchronize()  # this copy alone, not the device
        return host, buf

    def give_back(self, held: torch.Tensor | None) -> None:
        """A read_out's buffer is free again (its rows are pushed)."""
        if held is not None:
            self._pool.give(held)

    def write_in(self, slots: torch.Tensor, counts: list[int], rows: list[np.ndarray | torch.Tensor | None]) -> None:
        """Write rows[t] (None where counts[t] is 0) at table t's slots; on a GPU, through a
        pinned buffer and the side stream, done at rows_in."""
        if not self.cuda:
            self.group.write(slots, counts, rows)
            return
        given = [torch.as_tensor(np.ascontiguousarray(r, np.float32)) if n else None for r, n in zip(rows, counts)]
        buf = self._pool.take(sum(g.numel() for g in given if g is not None))
        views: list[torch.Tensor | None] = []
        at = 0
        for g in given:
            if g is None:
                views.append(None)
                continue
            view = buf[at : at + g.numel()].view(g.shape)
            view.copy_(g)  # host to pinned host
            views.append(view)
            at += g.numel()
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)  # the slots, and the gather of their evicted rows, come first
        with torch.cuda.stream(self._side):
            on_device: list[np.ndarray | torch.Tensor | None] = [
                None if v is None else v.to(self.device, non_blocking=True) for v in views
            ]
            where = slots.to(self.device, non_blocking=True)
            self.group.write(where, counts, on_device)
        if slots.is_cuda:
            slots.record_stream(self._side)
        self.rows_in = torch.cuda.Event()
        self.rows_in.record(self._side)
        self._pool.give(buf, self.rows_in)
