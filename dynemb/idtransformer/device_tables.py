"""DeviceTables: the state of many triton-backend ID transformers in one allocation each, so
that one pass (device_transform.py) serves every table of a batch in a fixed number of launches.

    space = DeviceTables.of(tables)    # joins them (copying their state) unless they share one
    space.records                      # (rows + 1, 2) int64: every table's records, a spare row last
    space.entries                      # every table's map entries, a scratch entry last
    space.sketch                       # every admission sketch's counters, a dummy counter last

Table k's records are rows [first, first + capacity) of its region, a whole number of
triton_select.ROWS_PER_BLOCK rows (the rest padding, always free and never used), and its
IDTransformer's `records`, `slot_id`, `last_access`, `freq`, `pins`, its map (TritonSlotMap)
and its sketch's counters are views of these tensors: the single-table API works on them as
before. A table belongs to one space at a time; joining it to another copies its state there
(the old space keeps a stale copy, used by no one once every table has left it).

`free_count` keeps each block's free rows (the pass's free-row scan reads only the blocks it
needs); whoever changes `last_access` outside the pass calls recount_free().
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dynemb.idtransformer.admission import MAX_DEPTH, multipliers
from dynemb.idtransformer.slot_map import map_size
from dynemb.idtransformer.triton_map import EMPTY, TritonSlotMap
from dynemb.idtransformer.triton_select import ROWS_PER_BLOCK

if TYPE_CHECKING:
    from dynemb.idtransformer.transformer import IDTransformer

_FREE_META = 0xFFFFFFFF  # last access -1 (free), freq 0, pins 0


class DeviceTables:
    """One allocation for the records, map entries and sketches of triton tables (see the module).

    Args:
        tables: IDTransformers on the triton backend, all on one device, each once.
    """

    def __init__(self, tables: list[IDTransformer]) -> None:
        if not tables:
            raise ValueError("DeviceTables needs at least one table")
        if len({id(t) for t in tables}) != len(tables):
            raise ValueError("a table is listed twice")
        devices = {t.device for t in tables}
        if len(devices) != 1 or any(t.backend != "triton" for t in tables):
            raise ValueError("DeviceTables holds triton tables on one device")
        self.device = dev = next(iter(devices))
        self.tables = list(tables)
        self.capacities = [t.capacity for t in tables]
        regions = [-(-c // ROWS_PER_BLOCK) * ROWS_PER_BLOCK for c in self.capacities]
        firsts = [sum(regions[:k]) for k in range(len(tables))]
        sizes = [map_size(c, load=0.5) for c in self.capacities]
        starts = [sum(sizes[:k]) for k in range(len(tables))]
        self.rows = sum(regions)
        self.geometry_rows = list(zip(starts, sizes, firsts))
        # (map start, map size, first row) per table: the map kernels' geometry of one table
        self.geometry = torch.tensor(self.geometry_rows, dtype=torch.int64, device=dev)
        self.records = torch.zeros(self.rows + 1, 2, dtype=torch.int64, device=dev)
        self.records[:, 1] = _FREE_META
        self.entries = torch.full((sum(sizes) + 1,), EMPTY, dtype=torch.int64, device=dev)
        blocks = [r // ROWS_PER_BLOCK for r in regions]
        self.block_table = torch.repeat_interleave(
            torch.arange(len(tables), device=dev), torch.tensor(blocks, device=dev), output_size=sum(blocks)
        )
        first_blocks = torch.tensor([f // ROWS_PER_BLOCK for f in firsts], dtype=torch.int64, device=dev)
        self.first_block = first_blocks[self.block_table]
        # admission sketches: (first counter, log2 width, depth) per table, depth 0 without one
        self.sketch_rows = []
        at = 0
        for t in tables:
            s = t.sketch
            if s is None:
                self.sketch_rows.append((0, 0, 0))
            else:
                self.sketch_rows.append((at, s.width.bit_length() - 1, s.depth))
                at += s.width * s.depth
        self.sketch = torch.zeros(at + 1, dtype=torch.int32, device=dev)
        # made here, not per pass: a tensor from host values is a copy that waits for the device
        self.sketch_multipliers = multipliers(MAX_DEPTH, dev)
        self.index = {id(t): k for k, t in enumerate(tables)}
        for k, t in enumerate(tables):
            self._move_in(k, t)
        self.free_count = torch.zeros(self.block_table.numel(), dtype=torch.int32, device=dev)
        self.recount_free()

    @staticmethod
    def of(tables: list[IDTransformer]) -> DeviceTables:
        """The space all the tables are in, or a new one that they join."""
        space = tables[0].space if tables else None
        if space is not None and all(t.space is space for t in tables):
            return space
        return DeviceTables(tables)

    def _move_in(self, k: int, t: IDTransformer) -> None:
        """Copy t's state here (if it has any yet) and make its views point here."""
        start, size, first = self.geometry_rows[k]
        cap = t.capacity
        old = t.space
        records = self.records[first : first + cap]
        tombs = 0
        if old is not None:
            records.copy_(t.records)
            self.entries[start : start + size].copy_(t.triton_map.entries)
            tombs = t.triton_map.tombs
        sketch_at, bits, depth = self.sketch_rows[k]
        if t.sketch is not None:
            counts = self.sketch[sketch_at : sketch_at + depth * (1 << bits)].view(depth, 1 << bits)
            counts.copy_(t.sketch.counts)
            t.sketch.counts = counts
        t.bind(self, records, TritonSlotMap(self, k, tombs))

    def recount_free(self) -> None:
        """Count each block's free rows again (after last_access changed outside the pass)."""
        last = self.records[: self.rows].view(torch.int32)[:, 2]
        row = torch.arange(self.rows, device=self.device)
        first = self.geometry[:, 2][self.block_table].repeat_interleave(ROWS_PER_BLOCK)
        cap = torch.tensor(self.capacities, device=self.device)[self.block_table].repeat_interleave(ROWS_PER_BLOCK)
        free = (last == -1) & (row - first < cap)
        self.free_count.copy_(free.view(-1, ROWS_PER_BLOCK).sum(1))

    def spare_row(self) -> int:
        """The row past every region: where the pass sends its masked-off writes."""
        return self.rows
