"""Same-host row transfer: the rows of a pull or push go through memory that the client and
the PS both map, and only the ids travel in the gRPC message.

Why: on one host, grpcio's Python layer is the bound. It copies a message's bytes several
times on each side and carries ~1.5M rows of 512 B a second with no PS work at all
(bench/RESULTS.md, raw gRPC). Through shared memory the PS gathers a pull's rows straight
into the client's memory and reads a push's rows from it.

How:
- The client makes a memfd, sized and allocated up front (posix_fallocate: a full
  memory limit is an error now, not a SIGBUS later). It seals it against shrinking, so
  no access through either mapping can ever fault. It writes a random token at its
  start and asks the PS to attach /proc/<client pid>/fd/<fd>.
- The PS opens that path, which only works on the same host and pid namespace for a
  user allowed to read the client's /proc. It checks the fd is a memfd sealed against
  shrinking, of the size claimed, and carrying the token (so a guessed path reaches no
  other process's memory). Then it maps it and answers a random segment id.
- A PullRequest's `rows_to`, or a PushRequest's `rows_from`, is then (segment, offset).
- A segment is dropped on DetachSegment, after `idle_seconds` unused, or when the PS
  exits. Its memory goes when both sides have unmapped it; there is no file to clean up.

The client (SegmentPool) gives each call in flight a segment of its own. A call that fails
drops its segments rather than reusing them: a PS still working on an abandoned try could
otherwise write into memory a later call reads.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from dynemb.common.errors import shown
from dynemb.ps_server.errors import InvalidArgument, PSError, ResourceExhausted, SegmentUnusable

log = logging.getLogger("dynemb.ps.shm")

TOKEN_BYTES = 16
ROWS_START = 64  # rows begin after the token, on a cache line
_ALIGN = 64  # every piece's rows start on a cache line
_PATH = re.compile(r"/proc/[0-9]{1,10}/fd/[0-9]{1,10}")
# Seals that make a writable shared mapping fail (linux/fcntl.h; the fcntl module may lack the second).
F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def available() -> bool:
    """Whether this platform has what same-host transfer needs (Linux memfd with seals)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


# -- the PS's side ------------------------------------------------------------------


@dataclass(slots=True)
class _Attached:
    view: np.ndarray  # uint8 over the whole mapping; keeps it mapped while any slice lives
    size: int
    last_used: float


class SegmentTable:
    """The segments attached to one PS, by id.

    A detached segment's mapping stays until the last request using it lets go of its slice:
    the mmap object is never closed by hand, only dropped."""

    def __init__(self, max_bytes: int, idle_seconds: float) -> None:
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self._by_id: dict[int, _Attached] = {}
        self._lock = threading.Lock()
        self._swept = time.monotonic()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def attach(self, path: str, size: int, token: bytes) -> int:
        """Map a client's segment after checking its path, size and token; returns its new id.

        Raises:
            SegmentUnusable: this PS takes no segments, or the file cannot be mapped safely.
            InvalidArgument: a malformed path, token or size.
            ResourceExhausted: the segment would go over max_bytes.
        """
        if not self.max_bytes:
            raise SegmentUnusable("this PS does not take shared-memory segments (--shm-max-mb 0)")
        if not _PATH.fullmatch(path):
            raise InvalidArgument(f"segment path {shown(path)} is not of the form /proc/<pid>/fd/<fd>")
        if len(token) != TOKEN_BYTES:
            raise InvalidArgument(f"a segment's token is {TOKEN_BYTES} bytes, got {len(token)}")
        if size <= ROWS_START:
            raise InvalidArgument(f"a segment of {size} bytes has no room for rows after its {ROWS_START}-byte head")
        with self._lock:
            self._expire(time.monotonic())
            if self.bytes + size > self.max_bytes:
                raise ResourceExhausted(
                    f"attaching a {size}-byte segment would map {self.bytes + size} bytes, over this PS's "
                    f"{self.max_bytes} (--shm-max-mb); {len(self._by_id)} segments are attached"
                )
        view = _map_checked(path, size, token)
        segment = secrets.randbits(63) or 1  # random: a restarted PS knows none of its old ids
        with self._lock:
            if self.bytes + size > self.max_bytes:  # another attach got there first
                raise ResourceExhausted(f"no room for a {size}-byte segment under --shm-max-mb")
            self._by_id[segment] = _Attached(view, size, time.monotonic())
            self.bytes += size
        log.debug("attached segment %x: %s, %d bytes", segment, path, size)
        return segment

    def rows(self, segment: int, offset: int, nbytes: int) -> np.ndarray:
        """The uint8 slice [offset, offset + nbytes) of a segment."""
        now = time.monotonic()
        found = self._by_id.get(segment)
        if found is None:
            raise SegmentUnusable(
                f"segment {segment:x} is not attached to this PS (detached, unused for over "
                f"{self.idle_seconds:g} s, or the PS restarted): attach one again"
            )
        if offset % 8 or offset < ROWS_START or offset + nbytes > found.size:
            raise InvalidArgument(
                f"rows at bytes [{offset}, {offset + nbytes}) do not lie 8-byte aligned inside segment "
                f"{segment:x}'s rows [{ROWS_START}, {found.size})"
            )
        found.last_used = now
        if now - self._swept > min(self.idle_seconds, 60.0):
            with self._lock:
                self._expire(now)
        return found.view[offset : offset + nbytes]

    def detach(self, segment: int) -> bool:
        """Forget a segment; False if it was not attached."""
        with self._lock:
            found = self._by_id.pop(segment, None)
            if found is not None:
                self.bytes -= found.size
        return found is not None

    def _expire(self, now: float) -> None:
        """Drop segments idle too long: their client died or forgot them. (Holding the lock.)"""
        self._swept = now
        for segment in [s for s, a in self._by_id.items() if now - a.last_used > self.idle_seconds]:
            self.bytes -= self._by_id.pop(segment).size
            log.info("dropped segment %x: unused for over %g s", segment, self.idle_seconds)

    def close(self) -> None:
        """Forget every segment."""
        with self._lock:
            self._by_id.clear()
            self.bytes = 0


def _map_checked(path: str, size: int, token: bytes) -> np.ndarray:
    """Map the client's memfd after checking it can never fault and is the one meant."""
    where = shown(path)  # checked against _PATH already; quoted the one way every error quotes input
    try:
        # only a regular file is ever opened: opening a device or a pipe can block or act
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SegmentUnusable(f"{where} is not a memory file")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise SegmentUnusable(
            f"cannot open {where} ({e.strerror}): the client is on another host or in another pid "
            f"namespace, or this PS's user may not read its /proc"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise SegmentUnusable(f"{where} is not a {size}-byte memory file (size {st.st_size})")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise SegmentUnusable(f"{where} is not a memfd (it takes no seals)") from None
        if not seals & fcntl.F_SEAL_SHRINK:  # a shrunk file would fault (SIGBUS) the PS
            raise SegmentUnusable(f"{where} is not sealed against shrinking")
        if seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):  # the kernel refuses a writable mapping
            raise SegmentUnusable(
                f"{where} is sealed against writes: the PS writes pulled rows into a segment, so it must stay writable"
            )
        if st.st_blksize != mmap.PAGESIZE:  # a hugetlb memfd faults when huge pages run out
            raise SegmentUnusable(f"{where} is not a memfd of ordinary pages (block size {st.st_blksize})")
        try:
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # what the checks above did not foresee: refused, not a server fault
            raise SegmentUnusable(f"cannot map {where} for reading and writing ({e.strerror})") from None
    finally:
        os.close(fd)
    view = np.frombuffer(mapping, dtype=np.uint8)
    if view[:TOKEN_BYTES].tobytes() != token:
        raise SegmentUnusable(f"{where} does not carry the token the client sent (another process's memory)")
    return view


# -- the client's side --------------------------------------------------------------


class Segment:
    """A memfd of the client's, mapped; `segment` is its id on the PS once attached."""

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("dynemb-rows", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # out of memory now, as an error, not as SIGBUS later
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.view = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # open until the PS has opened it too
        self.size = size
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.view[:TOKEN_BYTES] = np.frombuffer(self.token, dtype=np.uint8)
        self.segment = 0

    @property
    def path(self) -> str:
        """Where the PS opens this segment: /proc/<our pid>/fd/<fd>."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close_fd(self) -> None:
        """Close the file descriptor (the mapping stays); the PS must have opened it by then."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def rows(self, offset: int, n: int, width: int, dtype: np.dtype) -> np.ndarray:
        """The (n, width) array of dtype at offset."""
        nbytes = n * width * dtype.itemsize
        return self.view[offset : offset + nbytes].view(dtype).reshape(n, width)


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of pieces of these byte sizes in one segment, and the segment size needed."""
    offsets, end = [], ROWS_START
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGN) * _ALIGN
    return offsets, end


class SegmentPool:
    """One client's segments on one PS. A call takes a segment big enough for its rows and
    gives it back when done, or drops it when the call failed (see the module docstring).

    attach(path, size, token, deadline) -> segment id is an RPC; detach(segment id) sends one
    and returns its future (nothing waits on it: a PS that is away drops idle segments
    itself). When the PS cannot map our memory (another host) the pool turns itself off; when
    it is out of room, off for `retry_seconds`; when it cannot be reached, the call goes as
    bytes (and retries as such within its deadline) and the next one tries again. Up to
    `keep` idle segments are kept for reuse: as many as the client has calls in flight at
    once, so none is made afresh per call."""

    MIN_SIZE = 1 << 20
    MAX_SIZE = 1 << 30  # a call with more rows than this for one PS goes as bytes

    def __init__(
        self,
        attach: Callable[[str, int, bytes, float], int],
        detach: Callable[[int], grpc.Future],
        name: str,
        keep: int = 4,
        retry_seconds: float = 30.0,
    ) -> None:
        self._attach, self._detach, self.name = attach, detach, name
        self.keep = keep
        self._free: list[Segment] = []
        self._detaching: set = set()  # detach calls in flight
        self._lock = threading.Lock()
        self.retry_seconds = retry_seconds
        self._off_until = 0.0  # inf: never (the PS cannot map our memory)

    def take(self, nbytes: int, deadline: float) -> Segment | None:
        """A segment with at least nbytes, attached; None: send the rows as bytes this time."""
        if nbytes > self.MAX_SIZE or time.monotonic() < self._off_until:
            return None
        with self._lock:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                return seg
        size = max(self.MIN_SIZE, 1 << (nbytes - 1).bit_length())
        try:
            seg = Segment(size)
        except OSError as e:
            self._turn_off(f"cannot make a {size}-byte memory segment here ({e.strerror})", self.retry_seconds)
            return None
        try:
            seg.segment = self._attach(seg.path, size, seg.token, deadline)
        except (SegmentUnusable, InvalidArgument) as e:  # another host, a PS that takes none or disagrees
            self._turn_off(str(e), float("inf"))
            return None
        except ResourceExhausted as e:
            self._turn_off(str(e), self.retry_seconds)
            return None
        except PSError as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED:  # a PS from before shared memory
                self._turn_off(str(e), float("inf"))
            return None  # away or slow: this call goes as bytes, the next tries again
        finally:
            seg.close_fd()
        return seg

    def give_back(self, seg: Segment) -> None:
        """Return a segment after a call succeeded; beyond `keep` idle ones, the smallest is dropped."""
        with self._lock:
            self._free.append(seg)
            if len(self._free) <= self.keep:
                return
            seg = min(self._free, key=lambda s: s.size)  # the smallest is the least useful
            self._free.remove(seg)
        self.drop(seg)

    def drop(self, seg: Segment):
        """Detach (without waiting) and let go; the detach's future, or None."""
        try:
            sent = self._detach(seg.segment)
        except Exception:  # noqa: BLE001 - best effort: the PS drops idle segments by itself
            return None
        # held until done: grpc cancels a call whose future is garbage-collected
        with self._lock:
            self._detaching.add(sent)
        sent.add_done_callback(self._detached)
        return sent

    def _detached(self, sent) -> None:
        with self._lock:
            self._detaching.discard(sent)

    def reset(self) -> list:
        """Drop every idle segment (the PS no longer knew one: it restarted or expired ours)."""
        with self._lock:
            free, self._free = self._free, []
        return [self.drop(seg) for seg in free]

    def close(self, wait: float = 2.0) -> None:
        """Detach the idle segments, waiting up to `wait` seconds for the PS to confirm."""
        deadline = time.monotonic() + wait
        for sent in self.reset():
            if sent is None:
                continue
            try:
                sent.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - away, or too slow: it drops them when idle
                pass

    def _turn_off(self, why: str, seconds: float) -> None:
        self._off_until = time.monotonic() + seconds
        log.info(
            "PS %s: rows go as bytes%s: %s", self.name, "" if seconds == float("inf") else f" for {seconds:g} s", why
        )


class Leases:
    """The segments one call holds: `with Leases(pools, deadline) as leases`, given back to their pools
    when the call succeeds, dropped when it fails (and a pool whose PS no longer knows its
    segments forgets its idle ones too)."""

    def __init__(self, pools: list[SegmentPool | None], deadline: float) -> None:
        self.pools = pools
        self.deadline = deadline
        self.held: list[tuple[SegmentPool, Segment]] = []

    def place(self, pieces: list[tuple[int, int]]) -> list[tuple[Segment, int] | None]:
        """For each (shard, bytes of rows) piece: (segment, offset) where its rows go, or None
        where they go as bytes. A shard's pieces share one segment."""
        out: list[tuple[Segment, int] | None] = [None] * len(pieces)
        by_shard: dict[int, list[int]] = {}
        for k, (shard, nbytes) in enumerate(pieces):
            if nbytes and self.pools[shard] is not None:
                by_shard.setdefault(shard, []).append(k)
        for shard, ks in by_shard.items():
            pool = self.pools[shard]
            assert pool is not None  # by_shard holds only shards with a pool
            offsets, size = layout([pieces[k][1] for k in ks])
            seg = pool.take(size, self.deadline)
            if seg is None:
                continue
            self.held.append((pool, seg))
            for k, offset in zip(ks, offsets):
                out[k] = (seg, offset)
        return out

    def __enter__(self) -> Leases:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for pool, seg in self.held:
            if exc_type is None:
                pool.give_back(seg)
            else:
                pool.drop(seg)
                if isinstance(exc, SegmentUnusable):
                    pool.reset()
        self.held.clear()
