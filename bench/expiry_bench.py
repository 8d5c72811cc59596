"""What expiry and deletes cost on Redis: a sweep's Redis CPU, deletes' time, and what either does
to concurrent pulls' latency (issue 32's goals).

    .venv/bin/python bench/expiry_bench.py                     # 1M rows of 512 B, 10% expired
    .venv/bin/python bench/expiry_bench.py --rows 200000       # quicker
    PYTHONPATH=<older checkout> .venv/bin/python bench/expiry_bench.py --only delete
                                                               # deletes alone: runs on code without expiry too

Each part gets its own redis-server (started here, no persistence) and a table declaring its
rows (the PS's default layout), rows of dim 64 + 64 optimizer-state floats (512 B):
- sweep: the table's rows pushed, 10% of them stamped 2 hours ago (this process's clock moved
  back while they are pushed), TTL 1 hour; one sweeper pass (dynemb/ps_server/sweeper.py, its
  default slices, no pauses) deletes them alone: Redis CPU-seconds of the pass (from /proc) per
  row scanned and per row deleted, and its seconds. Then the expired rows are pushed again as
  old, and a pass as the PS makes it (its default duty: pauses between slices) runs beside a
  thread of pulls of 1,024 live ids: their p50/p99, against the same pulls for as long with no
  sweep, just after.
- delete: Delete of `--delete-present` present ids (200,000: issue 32's case), then of 8,388,608
  ids of which as many present; each time and Redis CPU; and pulls' p50/p99 while the first
  runs, against none running.
- drops: --tables tables created, each empty or with 16 rows, then dropped one by one (the
  PS's default table, 4,096 buckets): drops a second of each kind; the tables of 16 rows are
  cleared first (clears a second).
The store runs in this process (the PS's gRPC costs are ps_bench's and ps_load's).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.ps_server.backends.redis_store import RedisStore  # noqa: E402
from dynemb.ps_server.schema import TableSchema  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402

BATCH = 16384
PULL_IDS = 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Puller:
    """A thread pulling PULL_IDS random ids of `live` in a loop, each pull's seconds kept."""

    def __init__(self, store: RedisStore, table: str, live: np.ndarray, seed: int = 7) -> None:
        self.store, self.table, self.live = store, table, live
        self.rng = np.random.default_rng(seed)
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        out = np.empty((PULL_IDS, self.store.schema(self.table).width), np.float32)
        while not self.stop.is_set():
            ids = self.live[self.rng.integers(0, len(self.live), PULL_IDS)]
            t0 = time.perf_counter()
            self.store.pull_into(self.table, ids, out)
            self.times.append(time.perf_counter() - t0)

    def __enter__(self) -> Puller:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def quantiles(self) -> tuple[float, float, int]:
        """(p50, p99) in ms, and the pulls made."""
        t = np.array(self.times) * 1e3
        return float(np.percentile(t, 50)), float(np.percentile(t, 99)), len(t)


def quiet_pulls(store: RedisStore, table: str, live: np.ndarray, seconds: float) -> Puller:
    with Puller(store, table, live) as p:
        time.sleep(seconds)
    return p


def fill(store: RedisStore, table: str, ids: np.ndarray, rng) -> None:
    for lo in range(0, len(ids), BATCH):
        part = ids[lo : lo + BATCH]
        store.push(table, part, rng.random((len(part), 128), dtype=np.float32))


def bench_sweep(rows: int, expired_share: float) -> dict:
    from dynemb.ps_server import lifecycle as lifecycle_mod
    from dynemb.ps_server.lifecycle import Lifecycle
    from dynemb.ps_server.sweeper import DUTY, sweep_table

    rng = np.random.default_rng(0)
    ids = rng.choice(1 << 62, size=rows, replace=False).astype(np.int64)
    n_old = int(rows * expired_share)
    with RedisProcess([]) as proc:
        assert proc.proc is not None
        store = RedisStore.from_url(proc.url, namespace="exp")
        store.create_table(TableSchema("t", 64, 64, "fp32", expected_rows=rows))

        class TwoHoursAgo:
            @staticmethod
            def time() -> float:
                return time.time() - 7200

        def push_old(first: bool) -> None:
            real = lifecycle_mod.time
            lifecycle_mod.time = TwoHoursAgo  # type: ignore[assignment]
            try:
                if first:
                    store.set_lifecycle("t", Lifecycle(ttl_s=3600))  # since: 2 hours ago
                fill(store, "t", ids[:n_old], rng)
            finally:
                lifecycle_mod.time = real

        push_old(first=True)
        fill(store, "t", ids[n_old:], rng)
        live = ids[n_old:]
        c0 = cpu_seconds(proc.proc.pid)
        result = sweep_table(store, "t")
        redis_cpu = cpu_seconds(proc.proc.pid) - c0
        assert result.deleted == n_old and store.num_rows("t") == rows - n_old, result
        push_old(first=False)
        with Puller(store, "t", live) as during:
            paced = sweep_table(store, "t", duty=DUTY)
        quiet = quiet_pulls(store, "t", live, paced.seconds)
        assert paced.deleted == n_old, paced
        store.close()
    p50, p99, n = during.quantiles()
    q50, q99, qn = quiet.quantiles()
    return {
        "rows": rows,
        "deleted": result.deleted,
        "seconds": result.seconds,
        "redis_cpu_s": redis_cpu,
        "redis_us_per_row_scanned": redis_cpu / rows * 1e6,
        "redis_us_per_row_deleted": redis_cpu / max(1, result.deleted) * 1e6,
        "paced_seconds": paced.seconds,
        "duty": DUTY,
        "pull_p50_ms": p50,
        "pull_p99_ms": p99,
        "pulls": n,
        "quiet_p50_ms": q50,
        "quiet_p99_ms": q99,
        "quiet_pulls": qn,
    }


def bench_delete(rows: int, present: int) -> dict:
    rng = np.random.default_rng(1)
    ids = rng.choice(1 << 62, size=rows, replace=False).astype(np.int64)
    out: dict = {}
    with RedisProcess([]) as proc:
        assert proc.proc is not None
        store = RedisStore.from_url(proc.url, namespace="del")
        store.create_table(TableSchema("t", 64, 64, "fp32", expected_rows=rows))
        fill(store, "t", ids, rng)
        gone, live = ids[:present], ids[present:]
        c0, t0 = cpu_seconds(proc.proc.pid), time.perf_counter()
        with Puller(store, "t", live) as during:
            assert store.delete("t", gone) == present
        out["present_seconds"] = time.perf_counter() - t0
        out["present_redis_cpu_s"] = cpu_seconds(proc.proc.pid) - c0
        quiet = quiet_pulls(store, "t", live, max(1.0, out["present_seconds"]))
        out["pull_p50_ms"], out["pull_p99_ms"], out["pulls"] = during.quantiles()
        out["quiet_p50_ms"], out["quiet_p99_ms"], out["quiet_pulls"] = quiet.quantiles()
        fill(store, "t", gone, rng)  # back, then a delete of 8.39M ids of which `present` are stored
        many = np.concatenate([gone, rng.integers(1 << 62, (1 << 63) - 1, (1 << 23) - present, dtype=np.int64)])
        c0, t0 = cpu_seconds(proc.proc.pid), time.perf_counter()
        assert store.delete("t", many) == present
        out["many_ids"] = len(many)
        out["many_seconds"] = time.perf_counter() - t0
        out["many_redis_cpu_s"] = cpu_seconds(proc.proc.pid) - c0
        store.close()
    return out


def bench_drops(tables: int) -> dict:
    out = {}
    with RedisProcess([]) as proc:
        store = RedisStore.from_url(proc.url, namespace="drops")
        for kind, rows in (("empty", 0), ("16 rows", 16)):
            names = [f"{kind[:1]}{k}" for k in range(tables)]
            for name in names:
                store.create_table(TableSchema(name, 64, 64, "fp32"))
                if rows:
                    store.push(name, np.arange(rows, dtype=np.int64), np.ones((rows, 128), np.float32))
            if rows:  # cleared (each row logged as deleted first), then written again to be dropped
                t0 = time.perf_counter()
                for name in names:
                    store.clear(name)
                out[f"clears of {kind} tables"] = tables / (time.perf_counter() - t0)
                for name in names:
                    store.push(name, np.arange(rows, dtype=np.int64), np.ones((rows, 128), np.float32))
            t0 = time.perf_counter()
            for name in names:
                store.drop_table(name)
            out[f"drops of {kind} tables"] = tables / (time.perf_counter() - t0)
        store.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows stored [default %(default)s]")
    parser.add_argument("--expired", type=float, default=0.1, help="share of them expired [default %(default)s]")
    parser.add_argument("--delete-present", type=int, default=200_000, help="present ids deleted [default %(default)s]")
    parser.add_argument("--tables", type=int, default=200, help="tables of each kind dropped [default %(default)s]")
    parser.add_argument("--only", choices=("sweep", "delete", "drops"))
    args = parser.parse_args(argv)
    print(f"expiry_bench: {args.rows:,} rows of 512 B, {os.cpu_count()} CPUs")
    if args.only in (None, "drops"):
        d = bench_drops(args.tables)
        print("drops: " + ", ".join(f"{what} {per_s:,.0f} a second" for what, per_s in d.items()))
    if args.only in (None, "sweep"):
        s = bench_sweep(args.rows, args.expired)
        print(
            f"sweep: {s['deleted']:,} of {s['rows']:,} rows expired, deleted in {s['seconds']:.2f} s; Redis CPU "
            f"{s['redis_cpu_s']:.2f} s = {s['redis_us_per_row_scanned']:.2f} us a row scanned, "
            f"{s['redis_us_per_row_deleted']:.2f} us a row deleted"
        )
        print(
            f"  as the PS sweeps (duty {s['duty']}: {s['paced_seconds']:.2f} s), pulls of {PULL_IDS} ids meanwhile: "
            f"p50 {s['pull_p50_ms']:.2f} ms, p99 {s['pull_p99_ms']:.2f} ms "
            f"({s['pulls']} pulls); with no sweep: p50 {s['quiet_p50_ms']:.2f}, p99 {s['quiet_p99_ms']:.2f} "
            f"({s['quiet_pulls']}): p99 x{s['pull_p99_ms'] / s['quiet_p99_ms']:.2f}"
        )
    if args.only in (None, "delete"):
        d = bench_delete(max(args.rows, args.delete_present * 2), args.delete_present)
        print(
            f"delete: {args.delete_present:,} present ids in {d['present_seconds']:.3f} s (Redis CPU "
            f"{d['present_redis_cpu_s']:.2f} s); {d['many_ids']:,} ids ({args.delete_present:,} present) in "
            f"{d['many_seconds']:.2f} s (Redis CPU {d['many_redis_cpu_s']:.2f} s)"
        )
        print(
            f"  pulls of {PULL_IDS} ids during the first: p50 {d['pull_p50_ms']:.2f} ms, p99 {d['pull_p99_ms']:.2f} ms "
            f"({d['pulls']} pulls); with none: p50 {d['quiet_p50_ms']:.2f}, p99 {d['quiet_p99_ms']:.2f} "
            f"({d['quiet_pulls']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
