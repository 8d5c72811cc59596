"""PS throughput: pull and push rows/s through the PS, against baselines measured in the same run.

    .venv/bin/python bench/ps_bench.py                 # the issue's setting: 1M rows, 16k-id batches
    .venv/bin/python bench/ps_bench.py --rows 200000 --rounds 10   # quicker

Rows are dim 64 + 64 optimizer-state floats (fp32, 512 bytes). Each batch is 16,384
ids drawn uniformly from the stored ids; PS and baselines see the very same batches.

- Redis backend: PS (client → gRPC → PS process → Redis) against raw redis-py with
  hiredis doing the same work on the same data (HMGET / HSET of the same fields in
  the same bucket hashes, one pipeline per batch, decoded into the same numpy array).
  Goal: PS >= 0.75x raw. And against what Redis serves when the client does no work at all
  (bench/raw_redis.py's RedisLimit: the PS's own requests for each batch, built beforehand,
  sent on a plain socket, the replies read whole and never decoded): goal PS >= 0.8x, the two
  timed batch by batch alternately.
- Durable pushes (`--only durable`): a Redis master with one replica, and two PSes over it, one
  with `--redis-durable auto` (each push waits until the replica has it: WAIT 1) and one with
  `--redis-durable off`; the same batches pushed through each alternately. Prints push rows/s
  with and without, and their ratio.
- Embedded backend: PS rows/s on loopback (goal 2M rows/s), the client as it comes: on
  one host the rows go through shared memory and only the ids through gRPC
  (dynemb/ps_server/shm.py). Next to it, measured in the same run: the PS with the rows inside
  the gRPC messages (shared_memory=False), the store alone in-process, and raw gRPC
  moving the same bytes with no PS code (a server in its own process that answers as many
  rows as asked), which bounds the rows-in-messages path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.ps_server.backends.embedded import EmbeddedStore  # noqa: E402
from dynemb.ps_server.client import PSClient  # noqa: E402
from dynemb.ps_server.schema import TableSchema  # noqa: E402
from dynemb.testing.local_ps import LocalPS  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402

TABLE = "bench"


def timed(fn, batches) -> float:
    """rows/s of fn over the batches (best of the run's steady state: total rows / total time)."""
    fn(batches[0])  # warm-up
    start = time.perf_counter()
    for b in batches:
        fn(b)
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def timed_alternating(fn_a, fn_b, batches) -> tuple[float, float]:
    """rows/s of fn_a and of fn_b over the batches, each batch through one then the other, so
    both see the same moments of a noisy machine."""
    fn_a(batches[0])
    fn_b(batches[0])
    spent = [0.0, 0.0]
    for b in batches:
        for i, fn in enumerate((fn_a, fn_b)):
            start = time.perf_counter()
            fn(b)
            spent[i] += time.perf_counter() - start
    rows = sum(len(b) for b in batches)
    return rows / spent[0], rows / spent[1]


def load(ps: PSClient, schema: TableSchema, ids: np.ndarray, rng, desc: str) -> None:
    step = 65536
    for lo in tqdm(range(0, len(ids), step), desc=desc, unit="chunk", leave=False):
        chunk = ids[lo : lo + step]
        ps.push(schema.name, chunk, rng.random((len(chunk), schema.width), dtype=np.float32))


def used_memory(url: str) -> int:
    """Redis's used_memory (INFO memory), in bytes."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def bench_redis(args, schema, ids, batches, rows) -> dict:
    from bench.raw_redis import RawRedisRows, RedisLimit

    out = {}
    with (
        RedisProcess() as redis_proc,
        LocalPS("--backend", redis_proc.url, "--namespace", "bench", "--log-level", "WARNING") as ps_proc,
    ):
        rng = np.random.default_rng(1)
        with PSClient(ps_proc.address) as ps:
            ps.wait_ready()
            before = used_memory(redis_proc.url)
            ps.create_table_from_schema(schema)
            load(ps, schema, ids, rng, "load 1/2: rows into Redis through the PS")
            # Redis's own accounting (INFO memory), per stored row, against the row's raw bytes
            out["redis_bytes_per_row"] = (used_memory(redis_proc.url) - before) / len(ids)
            out["raw_bytes_per_row"] = 8 + schema.row_bytes  # the id and the row (values + state)
            raw = RawRedisRows(redis_proc.url, "bench", schema)
            # Same data, same answers: the baseline must read exactly what the PS reads.
            assert np.array_equal(raw.pull(batches[0]), ps.pull(TABLE, batches[0]).rows)
            out["ps_pull"] = timed(lambda b: ps.pull(TABLE, b), batches)
            out["raw_pull"] = timed(raw.pull, batches)
            out["ps_push"] = timed(lambda b: ps.push(TABLE, b, rows[: len(b)]), batches)
            out["raw_push"] = timed(lambda b: raw.push(b, rows[: len(b)]), batches)
            raw.close()
            # the same requests the PS sends, prepared beforehand: only Redis works while timed
            limit = RedisLimit(redis_proc.url, "bench", schema)
            pulls = {id(b): limit.pull_request(b) for b in batches}
            pushes = {id(b): limit.push_request(b, rows[: len(b)]) for b in batches}
            # batch by batch alternately with the PS: the ratio is the figure, and the machine's
            # speed drifts between separate timed loops
            out["ps_pull_alt"], out["limit_pull"] = timed_alternating(
                lambda b: ps.pull(TABLE, b), lambda b: limit.exchange(pulls[id(b)]), batches
            )
            out["ps_push_alt"], out["limit_push"] = timed_alternating(
                lambda b: ps.push(TABLE, b, rows[: len(b)]), lambda b: limit.exchange(pushes[id(b)]), batches
            )
            limit.close()
    out["pull_ratio"] = out["ps_pull"] / out["raw_pull"]
    out["push_ratio"] = out["ps_push"] / out["raw_push"]
    out["pull_vs_limit"] = out["ps_pull_alt"] / out["limit_pull"]
    out["push_vs_limit"] = out["ps_push_alt"] / out["limit_push"]
    return out


def bench_durable(args, schema, ids, batches, rows) -> dict:
    """Push rows/s through a PS that waits for a replica (--redis-durable auto) and one that
    does not (off), over the same replicated Redis, batch by batch alternately."""
    master = RedisProcess(["repl-diskless-sync-delay 0"]).start()
    replica = RedisProcess([f"replicaof {master.host} {master.port}"])
    try:
        replica.start().wait_synced(time.monotonic() + 60)
        flags = ("--backend", master.url, "--namespace", "bench", "--log-level", "WARNING")
        with (
            LocalPS(*flags, "--redis-durable", "auto") as durable_proc,
            LocalPS(*flags, "--redis-durable", "off") as plain_proc,
            PSClient(durable_proc.address) as durable,
            PSClient(plain_proc.address) as plain,
        ):
            durable.wait_ready()
            plain.wait_ready()
            durable.create_table_from_schema(schema)
            load(durable, schema, ids, np.random.default_rng(1), "load: rows into replicated Redis")
            out = {}
            out["durable_push"], out["plain_push"] = timed_alternating(
                lambda b: durable.push(TABLE, b, rows[: len(b)]),
                lambda b: plain.push(TABLE, b, rows[: len(b)]),
                batches,
            )
            waits = master.client().info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
            out["wait_calls"] = int(waits)
    finally:
        replica.close()
        master.close()
    out["durable_ratio"] = out["durable_push"] / out["plain_push"]
    return out


def raw_grpc_rows_per_s(schema, batches, chunk_bytes: int) -> tuple[float, float]:
    """Raw gRPC, no PS code (bench/raw_grpc.py, its server in its own process as the PS is):
    replies of a pull's size, requests of a push's, the same number of concurrent messages
    per batch as PSClient sends."""
    import tempfile

    from bench.raw_grpc import RawGrpc

    pull_per_msg = max(1, chunk_bytes // (schema.row_bytes + 1))  # as PSClient cuts them
    push_per_msg = max(1, chunk_bytes // (schema.row_bytes + 8))

    def fan(method, n, per_msg, id_bytes, row_bytes):
        sizes = [min(per_msg, n - lo) for lo in range(0, n, per_msg)]
        calls = [method.future(b"\0" * (k * (id_bytes + row_bytes))) for k in sizes]
        for c in calls:
            c.result()

    with tempfile.TemporaryDirectory() as tmp, RawGrpc(schema.row_bytes, Path(tmp)) as raw:
        pull_rate = timed(lambda b: fan(raw.pull, len(b), pull_per_msg, 8, 0), batches)
        push_rate = timed(lambda b: fan(raw.push, len(b), push_per_msg, 8, schema.row_bytes), batches)
    return pull_rate, push_rate


def bench_embedded(args, schema, ids, batches, rows) -> dict:
    out = {}
    with LocalPS("--log-level", "WARNING") as ps_proc:
        rng = np.random.default_rng(2)
        with PSClient(ps_proc.address) as ps, PSClient(ps_proc.address, shared_memory=False) as as_bytes:
            ps.wait_ready()
            ps.create_table_from_schema(schema)
            load(ps, schema, ids, rng, "load 2/2: rows into the embedded PS")
            out["ps_pull"] = timed(lambda b: ps.pull(TABLE, b), batches)
            out["ps_push"] = timed(lambda b: ps.push(TABLE, b, rows[: len(b)]), batches)
            out["shared_memory"] = ps._pools[0] is not None and bool(ps._pools[0]._free)
            out["ps_bytes_pull"] = timed(lambda b: as_bytes.pull(TABLE, b), batches)
            out["ps_bytes_push"] = timed(lambda b: as_bytes.push(TABLE, b, rows[: len(b)]), batches)
            chunk_bytes = ps.chunk_bytes
    if args.shards > 1:
        # The same batches over several embedded PS processes on this host (client-side sharding).
        procs = [LocalPS("--log-level", "WARNING").start() for _ in range(args.shards)]
        try:
            with PSClient([p.address for p in procs]) as ps:
                ps.wait_ready()
                ps.create_table_from_schema(schema)
                load(ps, schema, ids, rng, f"load: rows into {args.shards} embedded PS shards")
                out["sharded_pull"] = timed(lambda b: ps.pull(TABLE, b), batches)
                out["sharded_push"] = timed(lambda b: ps.push(TABLE, b, rows[: len(b)]), batches)
        finally:
            for p in procs:
                p.close()
    store = EmbeddedStore()
    store.create_table(schema)
    for lo in range(0, len(ids), 65536):
        chunk = ids[lo : lo + 65536]
        store.push(TABLE, chunk, rng.random((len(chunk), schema.width), dtype=np.float32))
    out["store_pull"] = timed(lambda b: store.pull(TABLE, b), batches)
    out["store_push"] = timed(lambda b: store.push(TABLE, b, rows[: len(b)]), batches)
    out["raw_grpc_pull"], out["raw_grpc_push"] = raw_grpc_rows_per_s(schema, batches, chunk_bytes)
    out["pull_vs_raw_grpc"] = out["ps_bytes_pull"] / out["raw_grpc_pull"]
    out["push_vs_raw_grpc"] = out["ps_bytes_push"] / out["raw_grpc_push"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows stored [default %(default)s]")
    parser.add_argument("--batch", type=int, default=16384, help="ids per pull/push [default %(default)s]")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--state-width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20, help="timed batches per measurement [default %(default)s]")
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="also run the embedded part over this many PS processes [default %(default)s: no]",
    )
    parser.add_argument("--only", choices=("redis", "durable", "embedded"), help="run one part")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "ps_bench.json")
    args = parser.parse_args(argv)

    # the table declares its rows, as a user's would: the PS sizes its Redis layout by them
    schema = TableSchema(TABLE, args.dim, args.state_width, "fp32", expected_rows=args.rows)
    rng = np.random.default_rng(0)
    ids = rng.choice(1 << 62, size=args.rows, replace=False).astype(np.int64)
    batches = [ids[rng.integers(0, len(ids), args.batch)] for _ in range(args.rounds)]
    rows = rng.random((args.batch, schema.width), dtype=np.float32)
    print(
        f"ps_bench: {args.rows:,} rows of {schema.width} fp32 ({schema.row_bytes} B), "
        f"batches of {args.batch:,} ids, {args.rounds} timed batches each, {os.cpu_count()} CPUs"
    )

    results = {"config": vars(args) | {"json": str(args.json)}}
    if args.only in (None, "redis"):
        r = results["redis"] = bench_redis(args, schema, ids, batches, rows)
        print("\nRedis backend (rows/s)          pull          push")
        print(f"  PS (gRPC + PS + Redis)   {r['ps_pull']:>12,.0f}  {r['ps_push']:>12,.0f}")
        print(f"  raw redis-py + hiredis   {r['raw_pull']:>12,.0f}  {r['raw_push']:>12,.0f}")
        print(f"  PS, alternating with:    {r['ps_pull_alt']:>12,.0f}  {r['ps_push_alt']:>12,.0f}")
        print(f"  Redis alone (no client work) {r['limit_pull']:>8,.0f}  {r['limit_push']:>12,.0f}")
        print(f"  ratio PS / raw           {r['pull_ratio']:>12.2f}  {r['push_ratio']:>12.2f}   (goal >= 0.75)")
        print(f"  ratio PS / Redis alone   {r['pull_vs_limit']:>12.2f}  {r['push_vs_limit']:>12.2f}   (goal >= 0.8)")
        per_row, raw_row = r["redis_bytes_per_row"], r["raw_bytes_per_row"]
        print(
            f"  Redis memory per row     {per_row:>12,.0f} B = {per_row / raw_row:.2f}x the {raw_row} raw bytes "
            f"(goal <= 1.2x: listpack buckets, README 'Redis memory'; at 1M rows: bench/redis_memory.py)"
        )
    if args.only in (None, "durable"):
        d = results["durable"] = bench_durable(args, schema, ids, batches, rows)
        print("\nDurable pushes, Redis with 1 replica (push rows/s)")
        print(f"  --redis-durable auto (WAIT 1)  {d['durable_push']:>12,.0f}")
        print(f"  --redis-durable off            {d['plain_push']:>12,.0f}")
        print(
            f"  ratio durable / off            {d['durable_ratio']:>12.2f}   ({d['wait_calls']:,} WAITs on the master)"
        )
    if args.only in (None, "embedded"):
        e = results["embedded"] = bench_embedded(args, schema, ids, batches, rows)
        print("\nEmbedded backend (rows/s)       pull          push")
        how = "rows through shared memory" if e["shared_memory"] else "NO shared memory here"
        print(f"  PS on loopback           {e['ps_pull']:>12,.0f}  {e['ps_push']:>12,.0f}   (goal >= 2,000,000; {how})")
        print(f"  PS, rows in the messages {e['ps_bytes_pull']:>12,.0f}  {e['ps_bytes_push']:>12,.0f}")
        if "sharded_pull" in e:
            print(f"  PS, {args.shards} shards on loopback {e['sharded_pull']:>10,.0f}  {e['sharded_push']:>12,.0f}")
        print(f"  store alone, in-process  {e['store_pull']:>12,.0f}  {e['store_push']:>12,.0f}")
        print(f"  raw gRPC, same bytes     {e['raw_grpc_pull']:>12,.0f}  {e['raw_grpc_push']:>12,.0f}")
        print(f"  ratio PS in messages / raw gRPC {e['pull_vs_raw_grpc']:>5.2f}  {e['push_vs_raw_grpc']:>12.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
