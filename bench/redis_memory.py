"""Redis memory per stored row, and Redis's CPU per row, for bucket layouts side by side.

    .venv/bin/python bench/redis_memory.py                       # 1M rows: the default layout and hashtables
    .venv/bin/python bench/redis_memory.py --rows 200000         # quicker
    .venv/bin/python bench/redis_memory.py --rows 200000 --layout default:declared --values 16 --values 1024
                                                                 # the default layout, rows of 64 B and 4 KiB

Each layout gets its own redis-server (started here, no persistence): a table of rows of
dim 64 + 64 optimizer-state floats (fp32, 512 B) is written through RedisStore, 16,384 ids
per push, and `INFO memory`'s used_memory after the writes less before is divided by the
rows. The row's raw bytes are its 8-byte id and its values (the state is in the values).
Then 8 pulls and 8 pushes of 16,384 ids drawn uniformly from the stored ones give the
Redis CPU-seconds per row (from /proc) and the rows/s, the store in this process.

Layouts (num_buckets, then redis.conf lines):
- default: what a user gets: the table declares its rows (expected_rows), so it has rows / 16
  buckets (--redis-rows-per-bucket), and the store raises Redis's hash-max-listpack-value to
  the row's bytes (--redis-listpack auto) on a redis-server of Redis's own config: each bucket
  a listpack (each row in place with a few bytes of framing).
- hashtable: 4096 buckets, a table that declares nothing, Redis's config left alone (a
  512-byte row is over hash-max-listpack-value's 64, so each bucket is a hashtable: a dict
  entry, an sds for the field and one for the row, rounded up to jemalloc's size classes).
--layout NAME:BUCKETS[:CONF;...] measures others (the config left as given; BUCKETS "declared":
the default layout, on a server of that config); fewer rows a
bucket cost Redis less CPU (a listpack finds a field by walking it), up to where the per-key
overhead of more buckets outweighs it (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.ps_server.backends.redis_store import RedisStore  # noqa: E402
from dynemb.ps_server.schema import TableSchema  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402

BATCH = 16384


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(rows: int, num_buckets: int | None, config: list[str], seed: int = 0, values: int = 128) -> dict:
    """One layout: num_buckets None is the default (the table declares its rows, the store
    raises the listpack limits); a number, that many buckets and Redis's config as given.
    Rows of `values` fp32 (half embedding, half optimizer state)."""
    declared = num_buckets is None
    schema = TableSchema("mem", values - values // 2, values // 2, "fp32", expected_rows=rows if declared else 0)
    rng = np.random.default_rng(seed)
    ids = rng.choice(1 << 62, size=rows, replace=False).astype(np.int64)
    with RedisProcess(config) as proc:
        assert proc.proc is not None
        client = proc.client()
        before = client.info("memory")["used_memory"]
        store = RedisStore.from_url(
            proc.url, namespace="mem", num_buckets=num_buckets or 4096, listpack="auto" if declared else "off"
        )
        store.create_table(schema)
        buckets = store.num_buckets_of("mem")
        for lo in range(0, rows, BATCH):
            part = ids[lo : lo + BATCH]
            store.push("mem", part, rng.random((len(part), schema.width), dtype=np.float32))
        used = client.info("memory")["used_memory"] - before
        encoding = client.object("encoding", store._meta("mem").key(0))
        limits = client.config_get("hash-max-listpack-*")
        batches = [ids[rng.integers(0, rows, BATCH)] for _ in range(8)]
        out = np.empty((BATCH, schema.width), np.float32)
        result = {}
        for op in ("pull", "push"):
            c0, t0 = cpu_seconds(proc.proc.pid), time.perf_counter()
            for b in batches:
                if op == "pull":
                    store.pull_into("mem", b, out)
                else:
                    store.push("mem", b, out)
            result[f"{op}_rows_per_s"] = len(batches) * BATCH / (time.perf_counter() - t0)
            result[f"{op}_redis_us_per_row"] = (cpu_seconds(proc.proc.pid) - c0) / (len(batches) * BATCH) * 1e6
        assert store.num_rows("mem") == rows
        store.close()
        client.close()
    raw = 8 + schema.row_bytes
    return {
        "bytes_per_row": used / rows,
        "vs_raw": used / rows / raw,
        "raw": raw,
        "encoding": encoding.decode() if isinstance(encoding, bytes) else str(encoding),
        "buckets": buckets,
        "limits": "; ".join(f"{_text(k)} {_text(v)}" for k, v in sorted(limits.items())),
        **result,
    }


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows stored [default %(default)s]")
    parser.add_argument(
        "--values",
        type=int,
        action="append",
        help="fp32 values a row (repeatable: each measured) [default 128: 512 B, dim 64 + 64 of state]",
    )
    parser.add_argument(
        "--layout",
        action="append",
        metavar="NAME:BUCKETS[:CONF;CONF...]",
        help="measure this layout instead (repeatable), e.g. 'lp256:8192:hash-max-listpack-value 1024;"
        "hash-max-listpack-entries 256'",
    )
    args = parser.parse_args(argv)
    layouts: list[tuple[str, int | None, list[str]]] = [("default", None, []), ("hashtable", 4096, [])]
    if args.layout:
        layouts = []
        for spec in args.layout:
            name, buckets, *conf = spec.split(":", 2)
            count = None if buckets == "declared" else int(buckets)  # "declared": the default layout
            layouts.append((name, count, [c.strip() for c in conf[0].split(";")] if conf else []))
    print(f"redis_memory: {args.rows:,} rows + an 8-byte id each, {os.cpu_count()} CPUs")
    print(f"{'layout':<9} {'row B':>6} {'buckets':>7} {'encoding':<9} {'B/row':>8} {'x raw':>6} {'pull rows/s':>12} "
          f"{'us/row':>7} {'push rows/s':>12} {'us/row':>7}   (us/row: Redis CPU)")  # fmt: skip
    for name, buckets, config in layouts:
        for values in args.values or [128]:
            r = measure(args.rows, buckets, config, values=values)
            print(
                f"{name:<9} {r['raw'] - 8:>6} {r['buckets']:>7} {r['encoding']:<9} {r['bytes_per_row']:>8.1f} "
                f"{r['vs_raw']:>6.3f} "
                f"{r['pull_rows_per_s']:>12,.0f} {r['pull_redis_us_per_row']:>7.2f} "
                f"{r['push_rows_per_s']:>12,.0f} {r['push_redis_us_per_row']:>7.2f}"
            )
            print(f"          Redis's limits then: {r['limits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
