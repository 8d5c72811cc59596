"""The id -> slot map of the triton backend: an open-addressing hash table in Triton kernels.

Layout: one int64 entry per position, `tag << 32 | slot` (tag = the top 32 bits of
fmix64(id ^ seed), the kernel's; home = fastrange(tag, size), the kernel's too), at most half
full; EMPTY (-1) and TOMB (-2) are entries no real one can equal (a slot is < 2^31, so the low
word of a real entry is never 0xFFFFFFFF or 0xFFFFFFFE). Linear probing from the home.
- insert claims an EMPTY or TOMB entry with one 64-bit tl.atomic_cas (the IDs inserted are
  absent and distinct, so no two lanes insert one ID); a lane that loses the race re-reads the
  same position;
- find reads entries until its tag's (confirmed on the slot's record: the ID lives once, in
  the transformer's records) or an EMPTY one;
- erase overwrites its entry with TOMB; the host rebuilds the table when tombstones pile up
  (it knows their number from the counts each batch copies back anyway).

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

import torch
import triton
import triton.language as tl

from dynemb.idtransformer.slot_map import MAP_SEED, map_size

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
def _find_kernel(entries, record_ids, ids_ptr, out_ptr, count_ptr, n, size, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < _limit(count_ptr, n)
    key = tl.load(ids_ptr + offs, mask=live, other=0)
    tag, pos = _tag_home(key, seed, size)
    found = tl.full([BLOCK], -1, tl.int64)
    todo = live
    while tl.max(todo.to(tl.int32), 0) > 0:
        e = tl.load(entries + pos, mask=todo, other=-1)
        slot = e & 0xFFFFFFFF
        real = (e != -1) & (e != -2)
        maybe = todo & real & (lsr(e, 32) == tag)
        held = tl.load(record_ids + 2 * slot, mask=maybe, other=0)
        hit = maybe & (held == key)
        found = tl.where(hit, slot, found)
        todo = todo & ~hit & (e != -1)
        pos = tl.where(pos + 1 == size, 0, pos + 1)
    tl.store(out_ptr + offs, found, mask=offs < n)


@triton.jit
def _insert_kernel(
    entries,
    record_ids,
    slots_ptr,
    occupied_ptr,
    count_ptr,
    reused_ptr,
    n,
    size,
    seed,
    REBUILD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < _limit(count_ptr, n)
    if not REBUILD:
        slot = tl.load(slots_ptr + offs, mask=live, other=0)
    else:  # every slot whose record is occupied (last access != -1); slots_ptr is unused
        slot = offs
        last = tl.load(occupied_ptr + 4 * offs, mask=live, other=-1)
        live = live & (last != -1)
    key = tl.load(record_ids + 2 * slot, mask=live, other=0)
    tag, pos = _tag_home(key, seed, size)
    entry = (tag << 32) | slot
    scratch = entries + size  # where lanes with nothing to claim aim their CAS
    reused = tl.zeros([BLOCK], tl.int64)
    todo = live
    while tl.max(todo.to(tl.int32), 0) > 0:
        e = tl.load(entries + pos, mask=todo, other=0)
        open_ = todo & ((e == -1) | (e == -2))
        old = tl.atomic_cas(tl.where(open_, entries + pos, scratch), e, entry)
        won = open_ & (old == e)
        reused += (won & (e == -2)).to(tl.int64)
        todo = todo & ~won
        # a lane that lost a race for an open entry reads it again; the others move on
        step = todo & ~open_
        pos = tl.where(step, tl.where(pos + 1 == size, 0, pos + 1), pos)
    tl.atomic_add(reused_ptr, tl.sum(reused, 0))


@triton.jit
def _erase_kernel(entries, record_ids, slots_ptr, count_ptr, n, size, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < _limit(count_ptr, n)
    slot = tl.load(slots_ptr + offs, mask=live, other=0)
    key = tl.load(record_ids + 2 * slot, mask=live, other=0)
    tag, pos = _tag_home(key, seed, size)
    entry = (tag << 32) | slot
    todo = live
    while tl.max(todo.to(tl.int32), 0) > 0:
        e = tl.load(entries + pos, mask=todo, other=-1)
        here = todo & (e == entry)
        tl.store(entries + pos, tl.full([BLOCK], -2, tl.int64), mask=here)
        todo = todo & ~here & (e != -1)  # (an EMPTY: it was not there)
        pos = tl.where(pos + 1 == size, 0, pos + 1)


def _grid(n: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, _BLOCK)),)


class TritonSlotMap:
    """The triton backend's map (see the module doc); the IDs are read from `records`, the
    transformer's (capacity, 2) int64 (id, meta) rows. find / insert / erase take host-sized
    tensors; the batched pass uses the *_upto forms, whose live length is a device count.

    Args:
        capacity: slots of the table.
        records: the transformer's records (on the map's device).
    """

    def __init__(self, capacity: int, records: torch.Tensor) -> None:
        self.capacity = capacity
        self.records = records
        self.size = map_size(capacity, load=0.5)
        # one spare entry past the end: the target of CASes of lanes with nothing to claim
        self.entries = torch.full((self.size + 1,), EMPTY, dtype=torch.int64, device=records.device)
        self.tombs = 0  # tombstones, at most (the host's count: erases less reuses)

    @property
    def nbytes(self) -> int:
        """Bytes the entries take."""
        return self.entries.numel() * 8

    @property
    def _ids(self) -> torch.Tensor:
        return self.records.view(-1)

    def _all(self, n: int) -> torch.Tensor:
        """A device count of n (a fill, not a copy from the host)."""
        return torch.full((1,), n, dtype=torch.int64, device=self.entries.device)

    def find_upto(self, ids: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        """The slot of each of ids' first `count` (a device int64 scalar; all if None), -1 where
        absent or past the count."""
        n = ids.numel()
        out = torch.empty(n, dtype=torch.int64, device=ids.device)
        if n:
            count = self._all(n) if count is None else count
            _find_kernel[_grid(n)](self.entries, self._ids, ids, out, count, n, self.size, MAP_SEED, BLOCK=_BLOCK)
        return out

    def insert_upto(self, slots: torch.Tensor, count: torch.Tensor | None, reused: torch.Tensor | None) -> None:
        """Enter the IDs the records hold at slots' first `count` (absent, distinct; all if None);
        adds the tombstones they took over to `reused` (a 1-element device int64 tensor)."""
        n = slots.numel()
        if n:
            count = self._all(n) if count is None else count
            reused = torch.zeros(1, dtype=torch.int64, device=slots.device) if reused is None else reused
            _insert_kernel[_grid(n)](
                self.entries, self._ids, slots, self.entries, count, reused, n, self.size, MAP_SEED, False, _BLOCK
            )

    def erase_upto(self, slots: torch.Tensor, count: torch.Tensor | None) -> None:
        """Remove the IDs held at slots' first `count` (their records still hold them; all if None)."""
        n = slots.numel()
        if n:
            count = self._all(n) if count is None else count
            _erase_kernel[_grid(n)](self.entries, self._ids, slots, count, n, self.size, MAP_SEED, BLOCK=_BLOCK)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it is not in the map."""
        return self.find_upto(ids.contiguous())

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Enter ids (absent, distinct) at slots; their records must already hold them."""
        self.insert_upto(slots.to(torch.int64).contiguous(), None, None)

    def erase(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Remove the ids held in slots (their records still hold them)."""
        self.erase_upto(slots.to(torch.int64).contiguous(), None)
        self.tombs += slots.numel()

    def rebuild_if_needed(self) -> bool:
        """Rebuild when tombstones take a quarter of the entries (so with at most half of them
        live, probes stay short and an EMPTY entry always ends a chain); True if it did."""
        if self.tombs * 4 < self.size:
            return False
        self.rebuild()
        return True

    def rebuild(self) -> None:
        """Clear the entries and insert every occupied slot's ID again (no tombstones left)."""
        self.entries.fill_(EMPTY)
        meta = self.records.view(torch.int32)  # last access: int32 2 of each 4-int32 record
        c, spare = self.capacity, torch.zeros(1, dtype=torch.int64, device=self.entries.device)
        every = self._all(c)
        _insert_kernel[_grid(c)](
            self.entries, self._ids, self.entries, meta[:, 2:], every, spare, c, self.size, MAP_SEED, True, _BLOCK
        )
        self.tombs = 0
