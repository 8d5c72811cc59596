"""The id -> slot maps of the triton backend: open-addressing hash tables in Triton kernels,
one per table, each in its region of one int64 allocation (DeviceTables, device_tables.py), so
that one launch finds, inserts or erases the IDs of every table of a batch: each lane carries
its table's index and reads the table's map region (start, size) and first record row from a
small per-table array (`geometry`, one (map start, map size, first row) triple per table).

Layout: one int64 entry per position, `tag << 32 | slot` (tag = the top 32 bits of
fmix64(id ^ seed), the kernel's; home = fastrange(tag, size), the kernel's too; slot: the
table's own), at most half full; EMPTY (-1) and TOMB (-2) are entries no real one can equal (a
slot is < 2^31, so the low word of a real entry is never 0xFFFFFFFF or 0xFFFFFFFE). Linear
probing from the home, within the table's region.
- insert claims an EMPTY or TOMB entry with one 64-bit tl.atomic_cas (the IDs inserted are
  absent and distinct, so no two lanes insert one ID); a lane that loses the race re-reads the
  same position; lanes with nothing to claim aim at a scratch entry past every region;
- find reads entries until its tag's (confirmed on the slot's record: the ID lives once, in
  the transformer's records) or an EMPTY one;
- erase overwrites its entry with TOMB; the host rebuilds a table's map when tombstones pile
  up (it knows their number from the counts each batch copies back anyway).

Why this layout and not another: HierarchicalKV (and NVIDIA dynamicemb's ScoredHashTable)
keep keys in buckets of 128 with a byte digest and a score per key and evict within a bucket
when it is full; fbgemm's faster_hash (TorchRec MPZCH) probes an identity tensor whose
position is the output slot and evicts on the probe path. Both tie a victim to where its key
hashes, while this table's results must equal the CPU kernel's: a global lowest-score victim
choice and the lowest free slot for each admitted ID. So slots and their scores stay in the
transformer's records (chosen over the whole capacity, triton_select.py) and the map only
answers id -> slot: 8 bytes an entry, one CAS to claim, a 32-bit digest that spares most
record reads on a probe miss, and neighbouring probes on one cache line (coalesced loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from dynemb.idtransformer.slot_map import MAP_SEED

if TYPE_CHECKING:
    from dynemb.idtransformer.device_tables import DeviceTables

EMPTY = -1
TOMB = -2
_BLOCK = 128


@triton.jit
def lsr(x, k: tl.constexpr):
    """x >> k with zeros shifted in (int64's >> shifts the sign in), for 0 <= k <= 64. Shifted as
    uint64, with k == 64 apart (a shift by the whole width is undefined on the GPU); an if/else,
    not an early return: Triton 3.6 compiles the code after a constexpr-true `return` too."""
    if k >= 64:
        return x * 0
    else:
        return (x.to(tl.uint64, bitcast=True) >> k).to(tl.int64, bitcast=True)


@triton.jit
def fmix64(x):
    """MurmurHash3's 64-bit finalizer on int64 lanes (wrapping products, as slot_map.fmix64)."""
    x = x ^ lsr(x, 33)
    # (the multipliers 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53 as signed int64: Triton refuses
    # constants >= 2^63; the products wrap alike)
    x = x * -49064778989728563
    x = x ^ lsr(x, 33)
    x = x * -4265267296055464877
    return x ^ lsr(x, 33)


@triton.jit
def _tag_home(ids, seed, size):
    tag = lsr(fmix64(ids ^ seed), 32)
    return tag, (tag * size) >> 32


@triton.jit
def _limit(count_ptr, n):
    """How many lanes are live: n, or fewer when count_ptr holds a smaller device count."""
    return tl.minimum(tl.load(count_ptr).to(tl.int64), n)


@triton.jit
def _table(tab_ptr, offs, live, ONE: tl.constexpr):
    """Each lane's table (an index into geometry): 0 for every lane with ONE."""
    if ONE:
        return offs * 0
    else:
        return tl.load(tab_ptr + offs, mask=live, other=0)


@triton.jit
def _geometry(geo_ptr, stride, tab, live):
    """(map start, map size, first record row) of each lane's table: the first three int64 of
    its row of `stride` in geo_ptr."""
    start = tl.load(geo_ptr + stride * tab, mask=live, other=0)
    size = tl.load(geo_ptr + stride * tab + 1, mask=live, other=1)
    first = tl.load(geo_ptr + stride * tab + 2, mask=live, other=0)
    return start, size, first


@triton.jit
def _find_kernel(
    entries,
    records,
    ids_ptr,
    tab_ptr,
    geo_ptr,
    stride,
    out_ptr,
    count_ptr,
    n,
    seed,
    ONE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < _limit(count_ptr, n)
    key = tl.load(ids_ptr + offs, mask=live, other=0)
    start, size, first = _geometry(geo_ptr, stride, _table(tab_ptr, offs, live, ONE), live)
    tag, pos = _tag_home(key, seed, size)
    found = tl.full([BLOCK], -1, tl.int64)
    todo = live
    while tl.max(todo.to(tl.int32), 0) > 0:
        e = tl.load(entries + start + pos, mask=todo, other=-1)
        slot = e & 0xFFFFFFFF
        real = (e != -1) & (e != -2)
        maybe = todo & real & (lsr(e, 32) == tag)
        held = tl.load(records + 2 * (first + slot), mask=maybe, other=0)
        hit = maybe & (held == key)
        found = tl.where(hit, slot, found)
        todo = todo & ~hit & (e != -1)
        pos = tl.where(pos + 1 == size, 0, pos + 1)
    tl.store(out_ptr + offs, found, mask=offs < n)


@triton.jit
def _insert_kernel(
    entries,
    records,
    meta32,
    rows_ptr,
    tab_ptr,
    geo_ptr,
    stride,
    count_ptr,
    reused_ptr,
    n,
    scratch_at,
    seed,
    REBUILD: tl.constexpr,
    ONE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < _limit(count_ptr, n)
    tab = _table(tab_ptr, offs, live, ONE)
    start, size, first = _geometry(geo_ptr, stride, tab, live)
    if not REBUILD:  # the records' rows (of the whole allocation) whose IDs to enter
        row = tl.load(rows_ptr + offs, mask=live, other=0)
    else:  # every occupied row of the one table (last access != -1); rows_ptr is unused
        row = first + offs
        last = tl.load(meta32 + 4 * row + 2, mask=live, other=-1)
        live = live & (last != -1)
    key = tl.load(records + 2 * row, mask=live, other=0)
    tag, pos = _tag_home(key, seed, size)
    entry = (tag << 32) | (row - first)
    reused = tl.zeros([BLOCK], tl.int64)
    todo = live
    while tl.max(todo.to(tl.int32), 0) > 0:
        e = tl.load(entries + start + pos, mask=todo, other=0)
        open_ = todo & ((e == -1) | (e == -2))
        old = tl.atomic_cas(tl.where(open_, entries + start + pos, entries + scratch_at), e, entry)
        won = open_ & (old == e)
        reused += (won & (e == -2)).to(tl.int64)
        todo = todo & ~won
        # a lane that lost a race for an open entry reads it again; the others move on
        step = todo & ~open_
        pos = tl.where(step, tl.where(pos + 1 == size, 0, pos + 1), pos)
    tl.atomic_add(reused_ptr + tab, reused, mask=reused > 0)  # per table: the host counts its tombstones


@triton.jit
def _erase_kernel(
    entries, records, rows_ptr, tab_ptr, geo_ptr, stride, count_ptr, n, seed, ONE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < _limit(count_ptr, n)
    start, size, first = _geometry(geo_ptr, stride, _table(tab_ptr, offs, live, ONE), live)
    row = tl.load(rows_ptr + offs, mask=live, other=0)
    key = tl.load(records + 2 * row, mask=live, other=0)
    tag, pos = _tag_home(key, seed, size)
    entry = (tag << 32) | (row - first)
    todo = live
    while tl.max(todo.to(tl.int32), 0) > 0:
        e = tl.load(entries + start + pos, mask=todo, other=-1)
        here = todo & (e == entry)
        tl.store(entries + start + pos, tl.full([BLOCK], -2, tl.int64), mask=here)
        todo = todo & ~here & (e != -1)  # (an EMPTY: it was not there)
        pos = tl.where(pos + 1 == size, 0, pos + 1)


def _grid(n: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, _BLOCK)),)


def _count(n: int, count: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A device count of n where none is given (a fill, not a copy from the host)."""
    return torch.full((1,), n, dtype=torch.int64, device=device) if count is None else count


def find_many(
    entries: torch.Tensor,
    records: torch.Tensor,
    geometry: torch.Tensor,
    ids: torch.Tensor,
    tables: torch.Tensor | None,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slot (the table's own) of each of ids' first `count` (a device int64; all if None)
    in the map of its table (tables[i], an index into geometry's rows; None: geometry holds one
    table), -1 where absent or past the count.

    Args:
        entries: every map's entries, one scratch entry past them all.
        records: the (rows, 2) int64 records of every table.
        geometry: (tables, k >= 3) int64, contiguous: each row starts with the table's map
            start, map size and first record row.
    """
    n = ids.numel()
    out = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n:
        _find_kernel[_grid(n)](
            entries, records, ids, ids if tables is None else tables, geometry, geometry.shape[-1], out,
            _count(n, count, ids.device), n, MAP_SEED, tables is None, _BLOCK,
        )  # fmt: skip
    return out


def insert_many(
    entries: torch.Tensor,
    records: torch.Tensor,
    geometry: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor | None,
    count: torch.Tensor | None,
    reused: torch.Tensor,
) -> None:
    """Enter the IDs that the records hold at rows' first `count` (absent, distinct; all if
    None), each in its table's map; adds the tombstones they took over to reused[table]."""
    n = rows.numel()
    if n:
        _insert_kernel[_grid(n)](
            entries, records, records, rows, rows if tables is None else tables, geometry, geometry.shape[-1],
            _count(n, count, rows.device), reused, n, entries.numel() - 1, MAP_SEED, False, tables is None, _BLOCK,
        )  # fmt: skip


def erase_many(
    entries: torch.Tensor,
    records: torch.Tensor,
    geometry: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor | None,
    count: torch.Tensor | None,
) -> None:
    """Remove the IDs held at rows' first `count` (their records still hold them; all if None)
    from their tables' maps."""
    n = rows.numel()
    if n:
        _erase_kernel[_grid(n)](
            entries, records, rows, rows if tables is None else tables, geometry, geometry.shape[-1],
            _count(n, count, rows.device), n, MAP_SEED, tables is None, _BLOCK,
        )  # fmt: skip


class TritonSlotMap:
    """One table's map in a DeviceTables allocation (see the module doc): find / insert / erase
    by the table's own slots, the host's count of its tombstones, and its rebuild.

    Args:
        space: the DeviceTables that holds it.
        k: the table's index there.
    """

    def __init__(self, space: DeviceTables, k: int, tombs: int = 0) -> None:
        self.space, self.k = space, k
        self.start, self.size, self.first = space.geometry_rows[k]
        self.capacity = space.capacities[k]
        self.tombs = tombs  # tombstones, at most (the host's count: erases less reuses)

    @property
    def entries(self) -> torch.Tensor:
        """This table's entries (a view of the allocation's)."""
        return self.space.entries[self.start : self.start + self.size]

    @property
    def nbytes(self) -> int:
        """Bytes the entries take."""
        return self.size * 8

    def _args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.space
        return s.entries, s.records, s.geometry[self.k]

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it is not in the map."""
        return find_many(*self._args(), ids.to(torch.int64).contiguous(), None)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Enter ids (absent, distinct) at slots; their records must already hold them."""
        spare = torch.zeros(1, dtype=torch.int64, device=self.space.device)
        insert_many(*self._args(), slots.to(torch.int64) + self.first, None, None, spare)

    def erase(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Remove the ids held in slots (their records still hold them)."""
        erase_many(*self._args(), slots.to(torch.int64) + self.first, None, None)
        self.tombs += slots.numel()

    def rebuild_if_needed(self) -> bool:
        """Rebuild when tombstones take a quarter of the entries (so with at most half of them
        live, probes stay short and an EMPTY entry always ends a chain); True if it did."""
        if self.tombs * 4 < self.size:
            return False
        self.rebuild()
        return True

    def clear(self) -> None:
        """Every entry EMPTY (the records unchanged)."""
        self.entries.fill_(EMPTY)
        self.tombs = 0

    def rebuild(self) -> None:
        """Clear the entries and insert every occupied slot's ID again (no tombstones left)."""
        self.clear()
        entries, records, geometry = self._args()
        c, dev = self.capacity, self.space.device
        spare = torch.zeros(1, dtype=torch.int64, device=dev)
        meta = records.view(torch.int32).view(-1)
        _insert_kernel[_grid(c)](
            entries, records, meta, entries, entries, geometry, 3, _count(c, None, dev), spare, c,
            entries.numel() - 1, MAP_SEED, True, True, _BLOCK,
        )  # fmt: skip
