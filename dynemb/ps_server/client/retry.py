"""When a failed PS call is tried again: `RetryPolicy`, and `Attempts`, one call's tries under it.

A call is retried on UNAVAILABLE (a PS down, restarting, or its replicas failing over) and, with
`RetryPolicy.attempt_timeout`, on a try that took longer than that: a PS that hangs, paused or cut off, is tried
again rather than waited on to the end. Every try fits in the call's one deadline, after an exponential backoff
with jitter. Every PS call is idempotent (push overwrites, delete of a deleted id is a no-op, create of the same
schema succeeds), so a retry never duplicates a write.

A call is tried until its deadline, not a number of times: a count of tries ends a call after however long its
backoffs add up to (8 tries gave up after 3-4 s of a 60 s deadline while a PS restarted, issue 44), and a channel
in TRANSIENT_FAILURE fails each try at once. `attempts` caps the tries only where a caller asks for fewer (1: no
retry).

These are not gRPC's own retries (a `retryPolicy` in the channel's `grpc.service_config`), because in grpcio
1.85: it clamps maxAttempts at 5, where a trainer's client retries for its whole deadline (attempts=None) to
outlast a PS restart; it never retries a request bigger than its per-call retry buffer
(`grpc.per_rpc_retry_buffer_size`, 256 KiB), where pushes go in messages of up to chunk_bytes (16 MiB); and its
per-try timeout (perAttemptRecvTimeout) is ignored without the experimental hedging flag.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """How a PS call that failed is tried again.

    Attributes:
        attempts: tries in all, the first included; None (the default): as many as the deadline allows.
        initial_backoff: seconds before the first retry (jittered down to half of it).
        max_backoff: the longest wait between two tries, in seconds.
        multiplier: how much each wait grows over the one before.
        attempt_timeout: seconds one try may take; None: the call's whole deadline.
    """

    attempts: int | None = None
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    attempt_timeout: float | None = None

    def backoffs(self) -> Iterator[float]:
        """The waits before the second, third... try: one fewer than `attempts`, or endless.

        Returns:
            An iterator of seconds, exponentially growing up to max_backoff, each jittered.
        """
        delay = self.initial_backoff
        tries = 1
        while self.attempts is None or tries < self.attempts:
            tries += 1
            yield delay * random.uniform(0.5, 1.0)  # jitter: clients that failed together retry apart
            delay = min(delay * self.multiplier, self.max_backoff)

    def start(self, deadline: float) -> Attempts:
        """One call's tries under this policy.

        Args:
            deadline: when the call must be done, in time.monotonic() seconds.

        Returns:
            The call's Attempts.
        """
        return Attempts(self, deadline)


class Attempts:
    """One call's tries: how long each may take, and after one failed, whether and when to try again."""

    def __init__(self, policy: RetryPolicy, deadline: float) -> None:
        self.policy = policy
        self.deadline = deadline
        self.started = time.monotonic()
        self.retries = 0
        self._backoffs = policy.backoffs()

    def tries(self) -> int:
        """Tries made so far, the one under way included."""
        return self.retries + 1

    def seconds(self) -> float:
        """Seconds since the call started."""
        return time.monotonic() - self.started

    def expired(self) -> bool:
        """Whether the call's deadline has passed."""
        return self.deadline - time.monotonic() <= 0

    def timeout(self) -> float:
        """Seconds the next try may take: what is left of the deadline, at most the policy's attempt_timeout."""
        remaining = max(self.deadline - time.monotonic(), 0.001)
        return remaining if self.policy.attempt_timeout is None else min(remaining, self.policy.attempt_timeout)

    def retryable(self, code: grpc.StatusCode) -> bool:
        """Whether a try that failed with this status may be tried again, tries left and time aside."""
        # DEADLINE_EXCEEDED: only the try's own limit, never the call's
        return code in RETRYABLE or (
            code == grpc.StatusCode.DEADLINE_EXCEEDED
            and self.policy.attempt_timeout is not None
            and time.monotonic() < self.deadline
        )

    def next_delay(self, code: grpc.StatusCode) -> float | None:
        """After a try failed with this status: the seconds to wait before the next one.

        Args:
            code: the failed try's status.

        Returns:
            Seconds to sleep, or None when the failure is final: not retryable, no tries left, or the next try
            would start past the deadline.
        """
        if not self.retryable(code):
            return None
        delay = next(self._backoffs, None)
        if delay is None or time.monotonic() + delay >= self.deadline:
            return None
        self.retries += 1
        return delay


class CallWatch:
    """What a client's calls are doing, for its owner's metrics (a trainer's: dynemb/tables/metrics.py): tries
    retried, calls that failed, and the calls waiting now. The client tells it (Transport.call); the owner reads it
    when scraped. A call blocked on a PS that is away shows while it waits, not only once it ends.

    Attributes:
        retries: tries tried again (after UNAVAILABLE, a try over its time, or a segment the PS no longer knew).
        failures: calls that ended in an error, after their retries.
    """

    def __init__(self) -> None:
        self.retries = 0
        self.failures = 0
        self._waiting: dict[int, float] = {}  # id of a call's Attempts: when the call started
        self._lock = threading.Lock()

    def started(self, tries: Attempts) -> None:
        """A call under these tries is in flight (since tries.started)."""
        with self._lock:
            self._waiting[id(tries)] = tries.started

    def ended(self, tries: Attempts, failed: bool) -> None:
        """The call under these tries returned, or (failed) raised its error."""
        with self._lock:
            self._waiting.pop(id(tries), None)
            self.failures += failed

    def retried(self) -> None:
        """A try failed and is tried again."""
        with self._lock:
            self.retries += 1

    def blocked_seconds(self) -> float:
        """How long the oldest call in flight has been waiting for its reply; 0 when none is."""
        with self._lock:
            oldest = min(self._waiting.values(), default=None)
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)
