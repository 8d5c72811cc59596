"""The client side of bench/ps_load.py: one process running several PS clients as threads.

Each client is its own PSClient (its own lanes, as each trainer rank has its own) driven by
one thread that pulls or pushes one batch after another, as fast as the PS answers, until
the run's end. Every call is timed; every failure is counted by its gRPC status code.

Rows are a pure function of the id (`expected_rows`): every push of an id writes the same
values, so whatever order concurrent pushes land in, a pull must return them exactly. A pull
that does not is counted as an error (WRONG_ROWS, or MISSING_ROWS for ids the prefill wrote).

With a TTL (`LoadSpec.ttl_s`, bench/ps_load.py --ttl) a client pushes only ids never pushed
before in the run (client k's are (k + 1) << 40 upwards, a batch of consecutive ones at a time)
and pulls ids drawn from its own batches pushed in the last `pull_window_s` seconds, timed from
before each push was sent: rows that cannot have expired, so a missing one is LIVE_ROW_LOST.
With `push_every_s` a client pushes at most once that often (it waits for its turn; its pulls
keep their share of its calls), else as fast as the PS answers.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from dynemb.ps_server.client import PSClient, RetryPolicy
from dynemb.ps_server.errors import PSError

# Slots per client in the shared live counters the parent reads for its progress display.
PULLS, PUSHES, ROWS, ERRORS = range(4)
COUNTER_SLOTS = 4
# With a TTL, client k's new ids start at (k + 1) << NEW_ID_SHIFT: no two clients' ever meet.
NEW_ID_SHIFT = 40


@dataclass(frozen=True)
class LoadSpec:
    address: str
    table: str
    ids: np.ndarray  # the id space: every id a batch may draw
    patterns: np.ndarray  # (k, width): an id's row is patterns[id % k]
    batch: int
    pull_fraction: float
    timeout: float
    duration: float
    seed: int
    ttl_s: int = 0  # 0: pull and push the prefilled id space; else new ids only (module doc)
    pull_window_s: float = 0.0  # with a TTL: pulls draw from the ids pushed this recently
    push_every_s: float = 0.0  # with a TTL: the least time between one client's pushes (0: none)


def expected_rows(patterns: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return patterns[ids % len(patterns)]


class ClientStats:
    """One thread's results; only that thread writes them."""

    def __init__(self) -> None:
        self.latencies = {"pull": [], "push": []}
        self.errors: Counter = Counter()  # (method, code) -> count
        self.first_error: dict[str, str] = {}  # code -> the first message seen


class NewIds:
    """With a TTL: one client's ids, each pushed once, and the batches it pushed recently."""

    def __init__(self, k: int, spec: LoadSpec) -> None:
        self.next = (k + 1) << NEW_ID_SHIFT
        self.batch = spec.batch
        self.window = spec.pull_window_s
        self.recent: deque[tuple[float, int]] = deque()  # (when sent, first id) of batches written

    def fresh(self) -> np.ndarray:
        """The next batch of ids never pushed (taken even if its push fails: never sent twice)."""
        ids = np.arange(self.next, self.next + self.batch, dtype=np.int64)
        self.next += self.batch
        return ids

    def live(self, rng: np.random.Generator) -> np.ndarray | None:
        """A batch drawn from the ids pushed in the last `window` seconds; None if there are none."""
        horizon = time.monotonic() - self.window
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        if not self.recent:
            return None
        firsts = np.fromiter((first for _, first in self.recent), dtype=np.int64, count=len(self.recent))
        picks = rng.integers(0, len(firsts) * self.batch, self.batch)
        return firsts[picks // self.batch] + picks % self.batch


def _drive(k: int, client: PSClient, spec: LoadSpec, stop_at: float, stats: ClientStats, live) -> None:
    rng = np.random.default_rng([spec.seed, k])
    base = k * COUNTER_SLOTS
    new = NewIds(k, spec) if spec.ttl_s else None
    # clients' turns to push spread over the interval (the golden ratio's fractions)
    next_push = time.monotonic() + spec.push_every_s * ((k * 0.6180339887) % 1.0)
    while time.monotonic() < stop_at:
        method = "pull" if rng.random() < spec.pull_fraction else "push"
        if new is None:
            ids = spec.ids[rng.integers(0, len(spec.ids), spec.batch)]
        else:
            pulled = new.live(rng) if method == "pull" else None
            method = "pull" if pulled is not None else "push"  # nothing pushed recently yet: push
            ids = pulled if pulled is not None else new.fresh()
        code = None
        if method == "push" and spec.push_every_s:
            wait = next_push - time.monotonic()
            if time.monotonic() + wait >= stop_at:
                break
            time.sleep(max(0.0, wait))
            # a client that fell behind pushes at once, but does not make up for more than one turn
            next_push = max(next_push + spec.push_every_s, time.monotonic() - spec.push_every_s)
        if method == "push":
            rows = expected_rows(spec.patterns, ids)  # built before the clock starts
        sent = time.monotonic()
        start = time.perf_counter()
        try:
            if method == "pull":
                got = client.pull(spec.table, ids, timeout=spec.timeout)
            else:
                client.push(spec.table, ids, rows, timeout=spec.timeout)
            elapsed = time.perf_counter() - start
            if method == "pull":
                if got.missing.any() and new is not None:
                    code, message = (
                        "LIVE_ROW_LOST",
                        f"{int(got.missing.sum())} of {len(ids)} ids pushed in the last "
                        f"{spec.pull_window_s:g} s came back missing (e.g. id {int(ids[got.missing][0])})",
                    )
                elif got.missing.any():
                    code, message = (
                        "MISSING_ROWS",
                        f"{int(got.missing.sum())} of {len(ids)} prefilled ids came back missing",
                    )
                elif not np.array_equal(got.rows, expected_rows(spec.patterns, ids)):
                    code, message = "WRONG_ROWS", "a pull returned values no push wrote"
        except PSError as exc:
            code, message = exc.code.name, str(exc)
        except Exception as exc:  # anything else is still this run's error, never a silent stop
            code, message = type(exc).__name__, str(exc)
        if code is None:
            if new is not None and method == "push":
                new.recent.append((sent, int(ids[0])))  # pullable from now on, aged from `sent`
            stats.latencies[method].append(elapsed)
            live[base + (PULLS if method == "pull" else PUSHES)] += 1
            live[base + ROWS] += len(ids)
        else:
            stats.errors[(method, code)] += 1
            stats.first_error.setdefault(code, message)
            live[base + ERRORS] += 1


def client_process(first_client: int, n_clients: int, spec: LoadSpec, live, barrier, results) -> None:
    """Run clients first_client .. first_client + n_clients - 1 and put one result dict on `results`.

    Waits at `barrier` (with the parent and the other client processes) once every client
    is connected, so all start together; the run lasts spec.duration from there.
    """
    clients: list[PSClient] = []
    try:
        # No retries: a load test counts every failed call; a trainer would retry UNAVAILABLE.
        # (spec.timeout applies to the timed calls only, each given it explicitly.)
        clients = [PSClient(spec.address, timeout=60, retry=RetryPolicy(attempts=1)) for _ in range(n_clients)]
        for c in clients:
            c.wait_ready(timeout=60)
            c.schema(spec.table)  # describe once now, not inside the first timed call
    except Exception:
        barrier.abort()
        results.put({"setup_error": traceback.format_exc()})
        for c in clients:
            c.close()
        return
    try:
        barrier.wait(timeout=300)
    except threading.BrokenBarrierError:
        results.put({"setup_error": "another client process failed to start"})
        return
    # CLOCK_MONOTONIC is system-wide on Linux: the parent can compare these times with its own.
    started, cpu_started = time.monotonic(), time.process_time()
    stop_at = started + spec.duration
    stats = [ClientStats() for _ in clients]
    threads = [
        threading.Thread(target=_drive, args=(first_client + i, c, spec, stop_at, s, live), daemon=True)
        for i, (c, s) in enumerate(zip(clients, stats))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ended, cpu_seconds = time.monotonic(), time.process_time() - cpu_started
    for c in clients:
        c.close()
    errors: Counter = Counter()
    first_error: dict[str, str] = {}
    for s in stats:
        errors.update(s.errors)
        for code, msg in s.first_error.items():
            first_error.setdefault(code, msg)
    results.put(
        {
            "started": started,
            "ended": ended,
            "cpu_seconds": cpu_seconds,
            "latencies": {m: np.concatenate([np.asarray(s.latencies[m]) for s in stats]) for m in ("pull", "push")},
            "errors": dict(errors),
            "first_error": first_error,
        }
    )
