"""The disk store (RocksDB) against the embedded RAM store on the same batches (issue 46's
goals): load, pull of Zipf(1.05) batches with a cache of 10% of the rows' bytes, pull of
uniformly random batches (rows/s and block reads a row, from RocksDB's statistics), push of
stored rows, bytes on disk against the raw rows, and memory. First the stores in this process
(the stores' own cost), then through a PS each (what a trainer sees: the disk PS reopens the
database the first part wrote, and its resident memory is read from /proc).

    .venv/bin/python bench/disk_bench.py --rows 10000000          # a few minutes on 2 cores
    .venv/bin/python bench/disk_bench.py --rows 1000000 --compression lz4

Ids are random 64-bit values (hashes, as a trainer's are), Zipf ranks mapped onto them, so hot
rows are scattered over the key space as they are in production, not packed into a few blocks.
Tables are dim 16 with row-wise Adagrad: 17 fp32 values, 68 bytes a row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynemb.ps_server.backends.disk import DiskStore  # noqa: E402
from dynemb.ps_server.backends.disk_cache import SLOT_OVERHEAD  # noqa: E402
from dynemb.ps_server.backends.disk_config import POOL_SHARE  # noqa: E402
from dynemb.ps_server.backends.embedded import EmbeddedStore  # noqa: E402
from dynemb.ps_server.client import PSClient  # noqa: E402
from dynemb.ps_server.memory_trim import TRIM_SECONDS  # noqa: E402
from dynemb.ps_server.schema import TableSchema, optimizer_state_width  # noqa: E402
from dynemb.testing.local_ps import LocalPS  # noqa: E402
from dynemb.testing.local_redis import RedisProcess  # noqa: E402
from dynemb.trainer.zipf import BoundedZipf  # noqa: E402

DIM = 16
SCHEMA = TableSchema("t", DIM, optimizer_state_width("rowwise_adagrad", DIM))


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory, MiB (from /proc: no psutil needed)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rows_for(ids: np.ndarray) -> np.ndarray:
    """Random rows (random floats: the worst case for compression)."""
    return np.random.default_rng(int(ids[0]) & 0xFFFF).standard_normal((len(ids), SCHEMA.width)).astype(np.float32)


def cache_bytes(url: str) -> str:
    """The cache_bytes setting of a disk:// URL."""
    return url.split("cache_bytes=", 1)[1].split("&", 1)[0]


def timed(fn, batches) -> float:
    """Seconds fn takes over every batch."""
    start = time.perf_counter()
    for b in batches:
        fn(b)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=16_384, help="ids a pull or push")
    p.add_argument("--batches", type=int, default=40, help="timed batches per case")
    p.add_argument(
        "--warm-batches",
        type=int,
        default=40,
        help="Zipf batches pulled before the timed ones, in process and through the PS (the pool's warm-up)",
    )
    p.add_argument(
        "--redis", action="store_true", help="through a PS over redis-server too, on the same batches (its RAM)"
    )
    p.add_argument("--cache-share", type=float, default=0.10, help="cache_bytes as a share of the rows' raw bytes")
    p.add_argument("--compression", default="none", choices=["none", "lz4"])
    p.add_argument("--sync", default="ack", help="the disk store's sync setting")
    p.add_argument("--no-ps", action="store_true", help="the stores in this process only")
    p.add_argument("--dir", default="", help="where the database goes (default: a temporary folder on /tmp)")
    p.add_argument(
        "--disk-ps-only",
        action="store_true",
        help="load the disk store with load_sorted (table files ingested) and measure a disk PS alone: "
        "for 10^8 rows, where the embedded store would not fit beside it (ratios come from 10^7)",
    )
    p.add_argument(
        "--import-only",
        action="store_true",
        help="import --rows rows in shuffled chunks through a disk PS: into an empty table (loaded in bulk) "
        "and into one holding a row (pushed)",
    )
    args = p.parse_args()
    if args.disk_ps_only:
        disk_ps_only(args)
        return
    if args.import_only:
        import_through_ps(args)
        return

    n, rb = args.rows, SCHEMA.row_bytes
    raw_bytes = n * (8 + rb)  # what an export carries: the id and the row
    cache = max(1 << 20, int(args.cache_share * n * rb))
    folder = Path(args.dir or tempfile.mkdtemp(prefix="disk_bench_"))
    shutil.rmtree(folder / "db", ignore_errors=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
    print(
        f"{n:,} rows of {rb} B (dim {DIM}, row-wise Adagrad), cache_bytes {cache >> 20} MiB "
        f"({args.cache_share:.0%} of the rows' bytes), sync={args.sync}, compression={args.compression}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    base_rss = rss_mib()

    disk = DiskStore(f"disk://{folder}/db?cache_bytes={cache}&sync={args.sync}&compression={args.compression}")
    disk.create_table(SCHEMA)
    start = time.perf_counter()
    for s in range(0, n, args.batch):
        disk.push("t", ids[s : s + args.batch], rows_for(ids[s : s + args.batch]))
        if s and s % (n // 10 // args.batch * args.batch or args.batch) == 0:
            print(f"  disk load {s / n:.0%}: {s / (time.perf_counter() - start):,.0f} rows/s", flush=True)
    disk_load_s = time.perf_counter() - start
    start = time.perf_counter()
    disk.compact()
    compact_s = time.perf_counter() - start
    on_disk = disk.disk_bytes()
    disk_rss = rss_mib() - base_rss
    print(f"disk load: {n / disk_load_s:,.0f} rows/s; flush + compaction {compact_s:.1f} s; RSS +{disk_rss:.0f} MiB")
    print(
        f"bytes on disk: {on_disk / n:.1f} B a row = {on_disk / raw_bytes:.2f}x the raw id + row bytes "
        f"({on_disk / (n * rb):.2f}x the row bytes alone)"
    )

    emb = EmbeddedStore()
    emb.create_table(SCHEMA)
    start = time.perf_counter()
    for s in range(0, n, args.batch):
        emb.push("t", ids[s : s + args.batch], rows_for(ids[s : s + args.batch]))
    emb_load_s = time.perf_counter() - start
    print(f"embedded load: {n / emb_load_s:,.0f} rows/s (disk / embedded {emb_load_s / disk_load_s:.2f})")

    out = np.empty((args.batch, SCHEMA.width), np.float32)
    rank_to_id = ids[rng.permutation(n)]  # Zipf rank r is a random id: hot rows scattered

    # bounded Zipf over the n rows (numpy's unbounded draws clipped to n - 1 put ~39% of a batch
    # on one row, which flattered both stores)
    draw_rank = BoundedZipf(1.05, n)

    def zipf_batch() -> np.ndarray:
        return rank_to_id[draw_rank(rng, args.batch) - 1]

    warm = [zipf_batch() for _ in range(args.warm_batches)]
    zipf = [zipf_batch() for _ in range(args.batches)]
    uniform = [ids[rng.integers(0, n, args.batch)] for _ in range(args.batches)]
    print(
        f"draws of the timed Zipf batches whose id no earlier batch drew: {first_seen(warm, zipf):.3f} "
        f"(after {len(warm)} batches to warm the pool: no cache of rows seen before can hit them)"
    )
    for b in warm:
        disk.pull_into("t", b, out)
    got = np.empty_like(out)
    for b in zipf[:3] + uniform[:3]:  # the same rows from both
        disk.pull_into("t", b, out)
        emb.pull_into("t", b, got)
        assert np.array_equal(out, got), "the disk store's rows differ from the embedded store's"

    results = {}
    for name, batches in (("zipf", zipf), ("uniform", uniform)):
        before = {**disk.statistics(), **disk.engine_stats()}
        t_disk = timed(lambda b: disk.pull_into("t", b, out), batches)
        after = {**disk.statistics(), **disk.engine_stats()}
        t_emb = timed(lambda b: emb.pull_into("t", b, got), batches)
        rows = len(batches) * args.batch

        def delta(key: str, a=after, b=before) -> int:
            return a.get(key, 0) - b.get(key, 0)

        hits, misses = delta("row_cache_hit"), delta("row_cache_miss")  # the store's pool of rows
        reads = delta("rocksdb.block.cache.data.miss")
        results[name] = (rows / t_disk, rows / t_emb)
        print(
            f"pull {name}: disk {rows / t_disk:,.0f} rows/s, embedded {rows / t_emb:,.0f} rows/s, "
            f"ratio {t_emb / t_disk:.2f}; pool hit rate {hits / max(1, hits + misses):.3f}, "
            f"data block reads {reads / rows:.3f} a row"
        )

    updates = [ids[rng.integers(0, n, args.batch)] for _ in range(args.batches)]
    upd_rows = [rows_for(b) for b in updates]
    t_disk = timed(lambda k: disk.push("t", updates[k], upd_rows[k]), range(len(updates)))
    t_emb = timed(lambda k: emb.push("t", updates[k], upd_rows[k]), range(len(updates)))
    rows = len(updates) * args.batch
    print(
        f"push of stored rows: disk {rows / t_disk:,.0f} rows/s, embedded {rows / t_emb:,.0f} rows/s, "
        f"ratio {t_emb / t_disk:.2f}"
    )
    # rows a trainer pushes back are mostly ones it pulled: the Zipf batches, pooled or not
    zipf_rows = [rows_for(b) for b in zipf]
    t_disk = timed(lambda k: disk.push("t", zipf[k], zipf_rows[k]), range(len(zipf)))
    t_emb = timed(lambda k: emb.push("t", zipf[k], zipf_rows[k]), range(len(zipf)))
    print(
        f"push of the Zipf batches: disk {rows / t_disk:,.0f} rows/s, embedded {rows / t_emb:,.0f} rows/s, "
        f"ratio {t_emb / t_disk:.2f}"
    )
    memtables = disk._rows.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
    readers = disk._rows.property_int_value("rocksdb.estimate-table-readers-mem") or 0
    cache_use = sum(c.get_usage() for c in disk._caches)
    pools = sum(t.pool.nbytes() for t in disk._tables.values())
    print(
        f"pools of rows {pools >> 20} MiB ({sum(len(t.pool) for t in disk._tables.values()):,} rows); "
        f"RocksDB memory: block cache {cache_use >> 20} MiB, memtables {memtables >> 20} MiB, "
        f"index and filters {readers >> 20} MiB; process RSS {rss_mib():.0f} MiB with the embedded store's "
        f"{emb.nbytes() >> 20} MiB beside it"
    )
    url = disk.config
    disk.close()
    if not args.no_ps:
        backend = f"disk://{url.path}?cache_bytes={url.cache_bytes}&sync={url.sync}"
        through_ps(args, backend, ids, warm, zipf, uniform)
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)


def print_idle_disk_ps_rss(cache: int | str) -> None:
    """Print the resident memory of a disk PS with this cache_bytes and one empty table: what a
    PS costs before any row (the baseline its RSS after the work is read against)."""
    with tempfile.TemporaryDirectory(prefix="disk_bench_empty_") as empty:
        with LocalPS("--backend", f"disk://{empty}/db?cache_bytes={cache}", "--log-level", "WARNING") as ps:
            with PSClient(ps.address) as c:
                c.create_table_from_schema(SCHEMA)
            time.sleep(1)
            print(f"an idle disk PS with an empty table: RSS {rss_mib(ps.proc.pid):.0f} MiB")


def first_seen(warm: list[np.ndarray], timed: list[np.ndarray]) -> float:
    """The share of the timed batches' draws whose id no earlier batch (warm or timed) drew."""
    seen = np.unique(np.concatenate(warm)) if warm else np.zeros(0, np.int64)
    new = 0
    for b in timed:
        new += int((~np.isin(b, seen)).sum())
        seen = np.union1d(seen, b)
    return new / sum(len(b) for b in timed)


def pool_lookups(ps: LocalPS) -> tuple[float, float]:
    """(hits, misses) of a disk PS's pools so far, from its /metrics."""
    got = {"hit": 0.0, "miss": 0.0}
    for line in ps.metrics_text().splitlines():
        if line.startswith("dynemb_ps_disk_cache_lookups_total") and 'cache="row"' in line:
            got["hit" if 'result="hit"' in line else "miss"] = float(line.rsplit(" ", 1)[1])
    return got["hit"], got["miss"]


def disk_ps_only(args) -> None:
    """Load with load_sorted, then a disk PS alone: its RSS idle and empty, after reopening the
    rows, and after Zipf and uniform pulls."""
    n = args.rows
    cache = max(1 << 20, int(args.cache_share * n * SCHEMA.row_bytes))
    folder = Path(args.dir or tempfile.mkdtemp(prefix="disk_bench_"))
    shutil.rmtree(folder / "db", ignore_errors=True)
    rng = np.random.default_rng(0)
    ids = np.sort(rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64))
    ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]  # np.unique's hash table takes minutes at 10^8
    n = len(ids)
    url = f"disk://{folder}/db?cache_bytes={cache}&sync={args.sync}&compression={args.compression}"
    print(f"{n:,} rows, cache_bytes {cache >> 20} MiB, load average {os.getloadavg()[0]:.1f}", flush=True)
    step = 1 << 20

    def chunks():
        for s in range(0, n, step):
            if s and s % (step * 8) == 0:
                print(f"  load {s / n:.0%}: {s / (time.perf_counter() - start):,.0f} rows/s", flush=True)
            yield ids[s : s + step], rng.standard_normal((len(ids[s : s + step]), SCHEMA.width)).astype(np.float32)

    disk = DiskStore(url)
    disk.create_table(SCHEMA)
    start = time.perf_counter()
    disk.load_sorted("t", chunks())
    load_s = time.perf_counter() - start
    on_disk = disk.disk_bytes()
    disk.close()
    print(
        f"load_sorted: {n / load_s:,.0f} rows/s ({load_s:.0f} s); bytes on disk {on_disk / n:.1f} B a row "
        f"= {on_disk / (n * (8 + SCHEMA.row_bytes)):.2f}x the raw id + row bytes; load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rank_to_id = ids[rng.permutation(n)]
    draw_rank = BoundedZipf(1.05, n)
    warm = [rank_to_id[draw_rank(rng, args.batch) - 1] for _ in range(args.warm_batches)]
    zipf = [rank_to_id[draw_rank(rng, args.batch) - 1] for _ in range(args.batches)]
    uniform = [ids[rng.integers(0, n, args.batch)] for _ in range(args.batches)]
    print_idle_disk_ps_rss(cache)
    start = time.perf_counter()
    with LocalPS("--backend", url, "--log-level", "WARNING") as ps, PSClient(ps.address, timeout=600) as c:
        print(
            f"disk PS up in {time.perf_counter() - start:.1f} s serving {c.describe_table('t').num_rows:,} rows "
            f"(RSS {rss_mib(ps.proc.pid):.0f} MiB)",
            flush=True,
        )
        for b in warm:
            c.pull("t", b)
        print(f"  after {len(warm)} Zipf batches to warm its pool: RSS {rss_mib(ps.proc.pid):.0f} MiB", flush=True)
        for name, batches in (("zipf", zipf), ("uniform", uniform)):
            before = pool_lookups(ps)
            t = timed(lambda b: c.pull("t", b), batches)
            hits, misses = (a - b for a, b in zip(pool_lookups(ps), before))
            print(
                f"PS pull {name}: {len(batches) * args.batch / t:,.0f} rows/s, pool hit rate "
                f"{hits / max(1, hits + misses):.3f}; RSS {rss_mib(ps.proc.pid):.0f} MiB; "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        # the pool's rows at its budget (disk_cache.py's accounting), then the RSS of a full pool
        pool_rows = int(cache * POOL_SHARE) // (SCHEMA.row_bytes + SLOT_OVERHEAD)
        start = time.perf_counter()
        for _ in range(pool_rows // args.batch + 1):
            c.pull("t", ids[rng.integers(0, n, args.batch)])
        print(
            f"after {pool_rows // args.batch + 1} uniform batches more ({pool_rows:,} rows fill its pool; "
            f"{time.perf_counter() - start:.0f} s): RSS {rss_mib(ps.proc.pid):.0f} MiB",
            flush=True,
        )
        time.sleep(TRIM_SECONDS + 1)
        print(f"after {TRIM_SECONDS + 1:.0f} s idle (a trim of freed memory): RSS {rss_mib(ps.proc.pid):.0f} MiB")
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)


def import_through_ps(args) -> None:
    """An import of args.rows rows in shuffled chunks of 65,536 through a disk PS: into an empty
    table (DiskStore.import_rows loads it in bulk) and into one that holds a row (pushes), in turn."""
    rng = np.random.default_rng(0)
    ids = rng.integers(-(1 << 63), (1 << 63) - 1, args.rows, dtype=np.int64)
    chunk = 65_536
    starts = rng.permutation(np.arange(0, args.rows, chunk))  # any order: the chunks of a checkpoint's shards
    cache = max(1 << 20, int(args.cache_share * args.rows * SCHEMA.row_bytes))
    with tempfile.TemporaryDirectory(prefix="disk_bench_import_", dir=args.dir or None) as folder:
        with (
            LocalPS("--backend", f"disk://{folder}/db?cache_bytes={cache}", "--log-level", "WARNING") as ps,
            PSClient(ps.address, timeout=3600) as c,
        ):
            for name in ("bulk", "pushed"):
                schema = dataclasses.replace(SCHEMA, name=name)
                c.create_table_from_schema(schema)
                if name == "pushed":
                    c.push(name, ids[:1], rows_for(ids[:1]))
                start = time.perf_counter()
                c.import_rows(schema, ((ids[s : s + chunk], rows_for(ids[s : s + chunk])) for s in starts))
                took = time.perf_counter() - start
                assert c.describe_table(name).num_rows == args.rows, "an import lost or added rows"
                print(
                    f"import of {args.rows:,} rows, {name}: {args.rows / took:,.0f} rows/s ({took:.1f} s); "
                    f"load average {os.getloadavg()[0]:.1f}",
                    flush=True,
                )


def through_ps(args, backend: str, ids: np.ndarray, warm: list, zipf: list, uniform: list) -> None:
    """The same pulls and pushes through a disk PS (reopening the database), an embedded PS and,
    with --redis, a PS over redis-server (both loaded by pushes)."""
    print_idle_disk_ps_rss(cache_bytes(backend))
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        disk_ps = stack.enter_context(LocalPS("--backend", backend, "--log-level", "WARNING"))
        emb_ps = stack.enter_context(LocalPS("--log-level", "WARNING"))
        dc = stack.enter_context(PSClient(disk_ps.address, timeout=600))
        clients = {"embedded PS": stack.enter_context(PSClient(emb_ps.address, timeout=600))}
        rows = dc.describe_table("t").num_rows
        print(
            f"disk PS and embedded PS up in {time.perf_counter() - start:.1f} s; the disk PS serves "
            f"{rows:,} rows at once (RSS {rss_mib(disk_ps.proc.pid):.0f} MiB)"
        )
        redis_proc = None
        if args.redis:
            redis_proc = stack.enter_context(RedisProcess())
            redis_ps = stack.enter_context(LocalPS("--backend", redis_proc.url, "--log-level", "WARNING"))
            clients["Redis PS"] = stack.enter_context(PSClient(redis_ps.address, timeout=600))
        for c in clients.values():
            c.create_table_from_schema(SCHEMA)
            for s in range(0, len(ids), 1 << 18):
                c.push("t", ids[s : s + (1 << 18)], rows_for(ids[s : s + (1 << 18)]))
        for b in warm:  # the batches that warmed the pool in process: the reopened PS's pool is empty
            dc.pull("t", b)
        for c in clients.values():
            for b in zipf[:5]:  # connections and buffers
                c.pull("t", b)

        def compare(what: str, fn, batches) -> None:
            before = pool_lookups(disk_ps)
            t_disk = timed(lambda b: fn(dc, b), batches)
            hits, misses = (a - b for a, b in zip(pool_lookups(disk_ps), before))
            n = len(batches) * args.batch
            line = f"PS {what}: disk PS {n / t_disk:,.0f} rows/s"
            for name, c in clients.items():
                t = timed(lambda b, c=c: fn(c, b), batches)
                line += f", {name} {n / t:,.0f} rows/s (disk / it {t / t_disk:.2f})"
            if hits + misses:  # pulls (a push's check for stored rows is not counted as a lookup)
                line += f"; disk PS pool hit rate {hits / (hits + misses):.3f}"
            print(line, flush=True)

        compare("pull zipf", lambda c, b: c.pull("t", b), zipf)
        compare("pull uniform", lambda c, b: c.pull("t", b), uniform)
        pushes = [ids[np.random.default_rng(k).integers(0, len(ids), args.batch)] for k in range(args.batches)]
        compare("push of stored rows", lambda c, b: c.push("t", b, rows_for(b)), pushes)
        compare("push of the Zipf batches", lambda c, b: c.push("t", b, rows_for(b)), zipf)
        line = f"disk PS RSS {rss_mib(disk_ps.proc.pid):.0f} MiB, embedded PS RSS {rss_mib(emb_ps.proc.pid):.0f} MiB"
        if redis_proc is not None:
            line += f", redis-server RSS {rss_mib(redis_proc.proc.pid):.0f} MiB"
        print(line)
        time.sleep(TRIM_SECONDS + 1)
        print(
            f"disk PS RSS after {TRIM_SECONDS + 1:.0f} s idle (a trim of freed memory): "
            f"{rss_mib(disk_ps.proc.pid):.0f} MiB"
        )


if __name__ == "__main__":
    main()
