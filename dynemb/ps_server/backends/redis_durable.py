"""Durable writes on replicated Redis: a push or delete is acknowledged only once replicas have it.

Redis replicates asynchronously: a master answers a write before its replicas have it, so a
write the PS acknowledged can be gone after a failover (Cluster or Sentinel promotes a replica
that had not received it). With durable writes the row path appends `WAIT <replicas> <timeout>`
to each master's pipeline, on the same connection: WAIT answers once that many replicas have
every write the connection sent (Redis's replication stream is ordered), and the PS acknowledges
the call only then. A failover then loses no acknowledged row, as long as the promoted replica
is one that had it: Cluster and Sentinel both promote the replica with the most data.

The setting, per PS (`dynemb ps serve --redis-durable`):
- "auto" (the default): wait for 1 replica on each master that has any online (INFO
  replication: a replica still loading its first copy cannot acknowledge; read again every
  REFRESH_S and whenever a WAIT comes short).
  A master without replicas (none configured, or its replica lost: the old master after a
  failover) is written as before: nothing could keep its writes through a failover.
- N >= 1: wait for N replicas on every master; a write that fewer have within the timeout fails
  (UNAVAILABLE, so the trainer's client retries it), as `min-replicas-to-write` would refuse it.
- "off": never wait (the cost is one round trip to a replica per pipeline; bench/ps_bench.py).

Under "auto" a WAIT that comes short while the master still counts a connected replica (one
that hangs or lags) fails the write too: the replica may still be promoted.

What is not waited for: the table's row count (a statistic, changed after the write by its own
script) and the change and deletion logs' entries, which live on one master each; a failover of
that master can lose the last entries (a publish then misses those ids until they change again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dynemb.common.errors import shown
from dynemb.ps_server.errors import BackendUnavailable, InvalidArgument

AUTO = "auto"
OFF = "off"
# how long a master's count of connected replicas is trusted under "auto"
REFRESH_S = 5.0
DEFAULT_TIMEOUT_MS = 2000
MAX_REPLICAS = 16


class ReplicasShort(BackendUnavailable):
    """Too few replicas had a write in time: it is in Redis and counted, not acknowledged."""


@dataclass(frozen=True)
class Durability:
    """How writes wait for replicas.

    Attributes:
        replicas: replicas each master's writes wait for; None: "auto" (1 where a master has any).
        timeout_ms: the longest a write waits for them (WAIT's timeout).
    """

    replicas: int | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @classmethod
    def parse(cls, text: str | int, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> Durability:
        """ "auto", "off" (0) or a count of replicas, as `--redis-durable` takes it.

        Raises:
            InvalidArgument: neither, a count out of [0, MAX_REPLICAS], or a timeout below 1 ms.
        """
        if not isinstance(timeout_ms, int) or not 1 <= timeout_ms <= 600_000:
            raise InvalidArgument(f"the durable writes' timeout must be 1..600000 ms, got {shown(timeout_ms)}")
        word = str(text).strip().lower()
        if word == AUTO:
            return cls(None, timeout_ms)
        if word == OFF:
            return cls(0, timeout_ms)
        if word.isdigit() and int(word) <= MAX_REPLICAS:
            return cls(int(word), timeout_ms)
        raise InvalidArgument(
            f"durable writes must be 'auto', 'off' or a count of replicas 0..{MAX_REPLICAS}, got {shown(text)}"
        )

    @property
    def off(self) -> bool:
        return self.replicas == 0

    def __str__(self) -> str:
        if self.replicas is None:
            return AUTO
        return OFF if self.replicas == 0 else str(self.replicas)


class ReplicaWaits:
    """Per master, how many replicas a write waits for, and the check of WAIT's answer.

    Args:
        durability: the setting.
        connected_replicas: a master's connected replicas now (INFO replication), given the
            master's key (a connection pool: one per master).
    """

    def __init__(self, durability: Durability, connected_replicas: Callable[[object], int]) -> None:
        self.durability = durability
        self._connected = connected_replicas
        self._known: dict[int, tuple[float, int]] = {}  # id(pool) -> (read at, connected replicas)
        self._lock = threading.Lock()
        # writes by what their WAIT said: enough replicas, too few (failed), none to wait for
        self.counts = {"acked": 0, "short": 0, "unreplicated": 0}

    def wanted(self, pool: object) -> int:
        """Replicas a write on pool's master waits for now (0: no WAIT)."""
        fixed = self.durability.replicas
        if fixed is not None:
            return fixed
        connected = self._replicas(pool, fresh=False)
        if connected == 0:
            self._count("unreplicated")
        return min(1, connected)

    def check(self, pool: object, wanted: int, acked: int, where: str) -> None:
        """Raise unless acked (WAIT's answer) replicas are enough for a write that waited for
        wanted; under "auto" a master that has lost its replicas meanwhile is let through.

        Raises:
            BackendUnavailable: too few replicas acknowledged the write in time.
        """
        if acked >= wanted:
            self._count("acked")
            return
        if self.durability.replicas is None and self._replicas(pool, fresh=True) == 0:
            self._count("unreplicated")
            return
        self._count("short")
        raise ReplicasShort(
            f"{where}: {acked} of {wanted} replicas had the write after {self.durability.timeout_ms} ms "
            f"(durable writes, --redis-durable {self.durability}): not acknowledged, retry it"
        )

    def _replicas(self, pool: object, fresh: bool) -> int:
        now = time.monotonic()
        with self._lock:
            known = self._known.get(id(pool))
        if known is not None and not fresh and now - known[0] < REFRESH_S:
            return known[1]
        connected = self._connected(pool)
        with self._lock:
            self._known[id(pool)] = (now, connected)
        return connected

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1


def wait_command(replicas: int, timeout_ms: int) -> bytes:
    """WAIT as protocol bytes, to append to a pipeline."""
    args = (b"WAIT", b"%d" % replicas, b"%d" % timeout_ms)
    return b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def last_integer(buf: bytearray, end: int) -> int:
    """The integer reply that ends buf[:end] (WAIT's, after a pipeline's other replies).

    Raises:
        ValueError: the last reply is not an integer.
    """
    before = buf.rfind(b"\r\n", 0, end - 2)  # the end of the reply before it; -1: it is the only one
    start = before + 2 if before >= 0 else 0
    line = bytes(buf[start : end - 2])
    if line[:1] != b":":
        raise ValueError(f"expected WAIT's integer reply, got {line[:80]!r}")
    return int(line[1:])
