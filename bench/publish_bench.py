"""What publishing and applying cost (issue 33's goals), side by side in one run.

    .venv/bin/python bench/publish_bench.py                     # 10M rows, 1% changed
    .venv/bin/python bench/publish_bench.py --rows 1000000      # quicker
    .venv/bin/python bench/publish_bench.py --only apply

- publish: a PS (`dynemb ps serve`, embedded store, a process of its own) holding --rows rows
  of dim 16 + 16 optimizer-state floats. `dynemb table export`'s export_table of the whole
  table (to a folder on this disk), then the first version (full), then --changed of the rows
  pushed again and the next version (a delta: change log, deletion log, pulls, files). Prints
  the delta's seconds over the export's (goal: <= 1/20).
- apply: a full version of --apply-rows rows applied into a redis-server of its own, then a
  delta of --apply-changed of them: rows/s of the delta's apply (serving_redis.py's three
  steps), and of the seconds until readers see it (steps 1 and 2), against a raw redis-py
  pipeline (hiredis) writing the same rows' bytes as HSETs into the same buckets (goal: >= 0.8x).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.checkpoint.table_files import export_table  # noqa: E402
from dynemb.ps_server.backends.serving_redis import PENDING, bucket_key, encode_rows  # noqa: E402
from dynemb.ps_server.client import PSClient  # noqa: E402
from dynemb.ps_server.hashing import bucket_of  # noqa: E402
from dynemb.publish import PublishConfig, VersionWriter, apply_table, publish_table, serving_store  # noqa: E402
from dynemb.testing.local_ps import LocalPS  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402

DIM = STATE = 16
PUSH = 1 << 18


def bench_publish(rows: int, changed: float, work: Path) -> None:
    rng = np.random.default_rng(0)
    with LocalPS("--log-level", "WARNING", "--not-serving-seconds", "0") as ps:
        ps.start()
        with PSClient(ps.address, timeout=600) as client:
            client.create_table("t", dim=DIM, state_width=STATE)
            t0 = time.perf_counter()
            for lo in range(0, rows, PUSH):
                ids = np.arange(lo, min(rows, lo + PUSH), dtype=np.int64)
                client.push("t", ids, rng.standard_normal((len(ids), DIM + STATE), dtype=np.float32))
            print(f"filled: {rows:,} rows in {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            export_table(client, "t", work / "export" / "t", progress=False)
            export_s = time.perf_counter() - t0
            config = PublishConfig(work / "published", full_every=100)
            t0 = time.perf_counter()
            v1 = publish_table(client, "t", config)
            full_s = time.perf_counter() - t0
            n = int(rows * changed)
            ids = rng.choice(rows, n, replace=False).astype(np.int64)
            for lo in range(0, n, PUSH):
                part = ids[lo : lo + PUSH]
                client.push("t", part, rng.standard_normal((len(part), DIM + STATE), dtype=np.float32))
            t0 = time.perf_counter()
            v2 = publish_table(client, "t", config)
            delta_s = time.perf_counter() - t0
    print(f"export (dynemb table export): {rows:,} rows in {export_s:.2f} s")
    print(f"publish v{v1.number} ({v1.kind}): {v1.rows:,} rows in {full_s:.2f} s")
    print(f"publish v{v2.number} ({v2.kind}): {v2.rows:,} rows ({changed:.0%} changed) in {delta_s:.2f} s")
    print(f"delta / export: {delta_s / export_s:.4f} (goal <= 0.05)")


def bench_apply(rows: int, changed: int, work: Path, rounds: int) -> None:
    rng = np.random.default_rng(1)
    root = work / "apply"
    all_ids = np.arange(rows, dtype=np.int64)
    with VersionWriter(root, "t", 1, "full", None, 1, "fp32", DIM, 0) as w:
        w.write_rows(all_ids, rng.standard_normal((rows, DIM), dtype=np.float32))
    with RedisProcess([]) as proc:
        url = f"redis://127.0.0.1:{proc.port}/0"
        store = serving_store(url, "bench")
        t0 = time.perf_counter()
        apply_table(store, root, "t")
        print(f"apply v1 (full): {rows:,} rows in {time.perf_counter() - t0:.2f} s")
        head = store.raw_head("t")
        client = store.store.client
        for r in range(rounds):
            number = r + 2
            ids = rng.choice(rows, changed, replace=False).astype(np.int64)
            values = rng.standard_normal((changed, DIM), dtype=np.float32)
            with VersionWriter(root, "t", number, "delta", number - 1, 1, "fp32", DIM, 0) as w:
                w.write_rows(ids, values)
            # raw: the same rows' bytes, HSET into the same buckets (of another tag), one pipeline
            # per 16,384 ids, as the applier's pipelines are sized
            raw = encode_rows(values, None)
            fields = ids.astype("<i8").view("V8").tolist()
            t0 = time.perf_counter()
            b = bucket_of(ids, head.buckets)
            order = np.argsort(b, kind="stable")
            runs = np.split(order, np.flatnonzero(np.diff(b[order])) + 1)
            for lo in range(0, len(runs), 4096):  # ~16k ids a pipeline, as the applier's
                pipe = client.pipeline(transaction=False)
                for run in runs[lo : lo + 4096]:
                    pipe.hset(bucket_key("bench", "t", "raw", int(b[run[0]])), mapping={fields[i]: raw[i] for i in run})
                pipe.execute()
            raw_s = time.perf_counter() - t0
            visible: list[float] = []
            t0 = time.perf_counter()
            apply_table(store, root, "t", shown=lambda _, seen=visible: seen.append(time.perf_counter()))
            apply_s = time.perf_counter() - t0
            shown_s = visible[0] - t0
            print(
                f"round {r + 1}: {changed:,} rows: raw HSET {changed / raw_s:,.0f} rows/s; "
                f"apply {changed / apply_s:,.0f} rows/s (ratio {raw_s / apply_s:.2f}); "
                f"readers see it after {shown_s:.3f} s (ratio {raw_s / shown_s:.2f})"
            )
        leftover = sum(1 for _ in client.scan_iter(match=b"*" + PENDING, count=1000))
        assert leftover == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of the published table [10M]")
    p.add_argument("--changed", type=float, default=0.01, help="share of them changed before the delta [0.01]")
    p.add_argument("--apply-rows", type=int, default=1_000_000, help="rows of the table applied to Redis [1M]")
    p.add_argument("--apply-changed", type=int, default=200_000, help="rows of each applied delta [200k]")
    p.add_argument("--rounds", type=int, default=3, help="deltas applied, each against raw [3]")
    p.add_argument("--only", choices=("publish", "apply"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dynemb-publish-bench-"))
    try:
        if args.only in (None, "publish"):
            bench_publish(args.rows, args.changed, work)
        if args.only in (None, "apply"):
            bench_apply(args.apply_rows, args.apply_changed, work, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
