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

Beside the store, on the same redis-server and the same table's bucket keys, its writes are
measured against what Redis needs at least to do them (issue 32): a "plain HSET" (one
pipeline of one HSET per touched bucket, that bucket's field-value pairs, nothing else) writes
the values the store stored for the same ids (read back after a store push, so they stay
the store's own whatever it adds to a row's bytes), and a "plain HDEL" (one HDEL per bucket)
deletes the same present ids store.delete does (re-pushed between). Up to half the rows, in
batches of 16,384 ids, store and plain by turns (--runs each, means printed, as the machine is
noisy). The ratio store / plain of Redis CPU per row is what the store's way of writing
(a Lua script per batch that checks the table's metadata and keeps its row count) costs Redis
over the bare commands: issue 32's goals are <= 1.2x for a pushed row (vs HSET) and for a
deleted row (vs HDEL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.ps_server.backends.redis_keys import _group_by_bucket, id_fields  # noqa: E402
from dynemb.ps_server.backends.redis_store import RedisStore  # noqa: E402
from dynemb.ps_server.schema import TableSchema  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402

BATCH = 16384

# The plain-command comparison writes at most this many bytes of rows a pass over its ids, and
# a run makes passes over them until it has written (or deleted) at least this many rows, so
# that /proc's 10 ms ticks of CPU time are small beside a run's.
PLAIN_MAX_BYTES = 128 << 20
PLAIN_ROWS_A_RUN = 400_000


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    rows: int, num_buckets: int | None, config: list[str], seed: int = 0, values: int = 128, runs: int = 5
) -> dict:
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
        result |= vs_plain(store, client, proc.proc.pid, "mem", ids, rng, runs)
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


def vs_plain(store: RedisStore, client, pid: int, table: str, ids: np.ndarray, rng, runs: int) -> dict:
    """Redis CPU per row of the store's push and delete and of plain pipelined HSET and HDEL of
    the same ids in the same bucket keys, the plain HSET writing the values the store stored
    (read back), `runs` of each by turns (module doc). Leaves the table's rows and row count
    as they were (new values for some ids)."""
    meta = store._meta(table)
    width = meta.schema.width
    n = min(len(ids) // 2, max(BATCH, PLAIN_MAX_BYTES // meta.schema.row_bytes))
    chosen = ids[rng.choice(len(ids), n, replace=False)]  # distinct, present
    chunks = [chosen[lo : lo + BATCH] for lo in range(0, n, BATCH)]
    data = [rng.random((len(c), width), dtype=np.float32) for c in chunks]
    for c, d in zip(chunks, data):
        store.push(table, c, d)
    # The plain HSET writes what the store stored for these ids, read back: whatever the store
    # adds to a row's bytes, both write values of the same length. Per chunk, per touched
    # bucket: its key, its ids' fields, and field, value, field, value...
    plain: list[list[tuple[bytes, list[bytes], list[bytes]]]] = []
    for c in chunks:
        g = _group_by_bucket(c, meta.num_buckets)
        fields = id_fields(c[g.order])
        keys = [meta.key(b) for b in g.buckets]
        pipe = client.pipeline(transaction=False)
        for key, lo, hi in zip(keys, g.starts, g.ends):
            pipe.hmget(key, fields[lo:hi])
        cmds = []
        for key, lo, hi, stored in zip(keys, g.starts, g.ends, pipe.execute()):
            assert all(v is not None for v in stored), "a pushed id is missing from its bucket"
            cmds.append((key, fields[lo:hi], [x for pair in zip(fields[lo:hi], stored) for x in pair]))
        plain.append(cmds)
    # One bucket as a whole: every value is as long as the one the store wrote for a known id.
    key0, fields0, _ = plain[0][0]
    stored_len = len(client.hget(key0, fields0[0]))
    lengths = {len(v) for v in client.hgetall(key0).values()}
    assert lengths == {stored_len}, f"values of {sorted(lengths)} bytes in {key0!r}, {stored_len} for a pushed id"

    def plain_write(command: str) -> int:
        done = 0
        for cmds in plain:
            pipe = client.pipeline(transaction=False)
            for key, fields, pairs in cmds:
                pipe.execute_command(command, key, *(pairs if command == "HSET" else fields))
            done += sum(pipe.execute())
        return done

    def plain_push() -> None:
        assert plain_write("HSET") == 0  # every id present: values replaced

    def plain_delete() -> None:
        assert plain_write("HDEL") == n  # every one present

    def plain_restore() -> None:
        assert plain_write("HSET") == n  # every one new again

    def store_push() -> None:
        for c, d in zip(chunks, data):
            store.push(table, c, d)

    def store_delete() -> None:
        assert sum(store.delete(table, c) for c in chunks) == n  # every one present

    passes = -(-PLAIN_ROWS_A_RUN // n)

    def redis_us(fn, then=None) -> float:
        """Redis CPU per row of `passes` calls of fn (each over the n ids), then() after each, unmeasured."""
        cpu = 0.0
        for _ in range(passes):
            c0 = cpu_seconds(pid)
            fn()
            cpu += cpu_seconds(pid) - c0
            if then is not None:
                then()
        return cpu / (passes * n) * 1e6

    us: dict[str, list[float]] = {k: [] for k in ("push", "hset", "delete", "hdel")}
    for run in range(runs):
        us["push"].append(redis_us(store_push))
        if run == 0:  # the store writes values as long as plain HSET's (a store may stamp its rows)
            for key, fields, pairs in plain[0]:
                got = [len(v) for v in client.hmget(key, fields)]
                assert got == [len(v) for v in pairs[1::2]], f"the store's values changed length in {key!r}"
        us["hset"].append(redis_us(plain_push))
    for _ in range(runs):
        us["delete"].append(redis_us(store_delete, then=store_push))  # back, row count too
        us["hdel"].append(redis_us(plain_delete, then=plain_restore))  # the store's count never saw either
    mean = {k: sum(v) / len(v) for k, v in us.items()}
    return {
        "plain_rows_per_pass": n,
        "plain_passes_per_run": passes,
        "plain_runs": runs,
        "stored_value_bytes": stored_len,
        "push_store_redis_us_per_row": mean["push"],
        "push_plain_hset_redis_us_per_row": mean["hset"],
        "push_vs_plain_hset": mean["push"] / mean["hset"],
        "delete_store_redis_us_per_row": mean["delete"],
        "delete_plain_hdel_redis_us_per_row": mean["hdel"],
        "delete_vs_plain_hdel": mean["delete"] / mean["hdel"],
        "redis_us_per_row_runs": us,
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
    parser.add_argument(
        "--runs", type=int, default=5, help="runs each of the store and plain HSET/HDEL, by turns [default %(default)s]"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here, one object a layout and row size")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
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
    results = []
    for name, buckets, config in layouts:
        for values in args.values or [128]:
            r = measure(args.rows, buckets, config, values=values, runs=args.runs)
            results.append({"layout": name, "values": values, **r})
            print(
                f"{name:<9} {r['raw'] - 8:>6} {r['buckets']:>7} {r['encoding']:<9} {r['bytes_per_row']:>8.1f} "
                f"{r['vs_raw']:>6.3f} "
                f"{r['pull_rows_per_s']:>12,.0f} {r['pull_redis_us_per_row']:>7.2f} "
                f"{r['push_rows_per_s']:>12,.0f} {r['push_redis_us_per_row']:>7.2f}"
            )
            print(f"          Redis's limits then: {r['limits']}")
            print(
                f"          Redis CPU us/row, store vs plain (same rows, buckets, value bytes): "
                f"push {r['push_store_redis_us_per_row']:.2f} vs HSET {r['push_plain_hset_redis_us_per_row']:.2f} "
                f"= {r['push_vs_plain_hset']:.2f}x; delete {r['delete_store_redis_us_per_row']:.2f} vs HDEL "
                f"{r['delete_plain_hdel_redis_us_per_row']:.2f} = {r['delete_vs_plain_hdel']:.2f}x"
            )
            print(
                f"          (means of {r['plain_runs']} runs each, store and plain by turns, "
                f"{r['plain_passes_per_run']} x {r['plain_rows_per_pass']:,} rows a run; "
                f"stored value {r['stored_value_bytes']} B)"
            )
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "cpus": os.cpu_count(), "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
