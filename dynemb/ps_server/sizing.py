"""How big a PS fleet over Redis Cluster a model needs, and a fleet of disk PSes beside it
(`dynemb ps plan`, docs/scale.md).

Every figure comes from the model (rows, dim, optimizer), the training rate (samples/s, IDs per
sample, hit rate of the trainers' device tables) and the measured constants below. The rows
are given, or worked out for tables whose rows expire (new IDs a day, a TTL, a row cap: see
plan()). The constants are the only numbers here that come from a machine: each names the
measurement it came from, so a new benchmark run changes them in this one place (then
regenerate the examples in docs/scale.md: `python tests/ps_server/test_scale_doc.py`).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict, dataclass

from dynemb.ps_server.backends.disk_config import MAX_CACHE_BYTES
from dynemb.ps_server.backends.redis_config import MAX_LISTPACK_VALUE, ROWS_PER_BUCKET
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.lifecycle import STAMP_BYTES
from dynemb.ps_server.schema import MAX_ROW_WIDTH, OPTIMIZERS, optimizer_state_width

# -- measured constants ---------------------------------------------------------------------

# Redis memory of a bucket beyond its listpack: its key's name, the keyspace's dict entry and
# the object header. Measured with redis-server 7.0.15 (jemalloc), 2026-11-26: 200,000 rows
# pushed by RedisStore into a table declaring them (12,500 listpack buckets, the PS's default
# layout), used_memory after less before, per row: 91.7 / 303.2 / 587.1 / 862.8 / 1,697.0 /
# 4,648.1 / 18,571.9 B for rows of 64 / 256 / 512 / 768 / 1,536 / 4,096 / 16,384 B;
# listpack_bytes_per_row() with 100 B a bucket is within 1 B of each up to 4 KiB rows, 3 B
# at 16 KiB. bench/RESULTS.md, redis_memory, agrees at 1M rows of 512 B: 586.4 B a row.
BUCKET_KEY_BYTES = 100
# Redis memory per row of a hashtable bucket (rows over MAX_LISTPACK_VALUE, which the PS leaves
# to hashtables) beyond the row's own allocation: the hash entry, the 8-byte id field and the
# hash table's share. Measured with redis-server 7.0.15: 200,000 rows in 4,096 hashtable
# buckets: 383 / 703 / 959 / 1,855 B for rows of 256 / 512 / 768 / 1,536 B, each exactly
# redis_row_allocation(row) + 63.
REDIS_ENTRY_OVERHEAD_BYTES = 63
# Redis CPU per row pulled or pushed: bench/RESULTS.md, ps_load (issue 24, final defaults),
# 2026-11-26, commit 8461573, 64 clients of 1,024-id batches, 30 s, the table declaring its
# 250,000 rows (15,625 listpack buckets, the default layout), a quiet 2-core box: Redis used
# 28.27 CPU s while the PS moved 235,382 rows/s for 30.25 s (3.97 us a row; 4.00 us in a
# loaded run of commit 52c27af, 3.67-4.53 with hashtable buckets before).
REDIS_CPU_SECONDS_PER_ROW = 3.97e-6
# Rows/s one PS process moves (pulls and pushes together): the same run, 235,382 rows/s, one PS
# over Redis on a 2-core machine shared with its Redis and the clients (167,941 in the loaded
# run). ps_bench's single client with 16,384-id batches reaches 0.83-0.88x of a client that
# does no work of its own (bench/RESULTS.md ps_bench 2026-11-26): not the figure to plan on.
PS_ROWS_PER_SECOND = 235_382
# PS CPU per row: the same run, the PS used 8.32 CPU s (1.17 us a row): a PS process is not the
# bottleneck, Redis is (0.29 PS CPU per Redis CPU).
PS_CPU_SECONDS_PER_ROW = 1.17e-6
# Resident memory of one PS process (it holds no rows over Redis): the same run, peak RSS.
PS_RSS_BYTES = int(151.4 * 2**20)

# -- the disk tier (disk:// backend: RocksDB on each PS's own local SSD), measured ---------------
# All from bench/RESULTS.md, disk_bench, 2026-11-29, "a pool of hot rows in the store" (runs 2
# and 3 at 579e90b, run 4 at 1b6b029): `bench/disk_bench.py --rows 10000000`, 10^7 rows of dim 16
# with row-wise Adagrad (68 B), random 64-bit ids, cache_bytes 64 MiB (10% of the rows' bytes),
# sync=ack, no compression, batches of 16,384 ids, three runs on a quiet 2-core box shared with
# the clients.
# The database (870 MB) fitted in the box's page cache: the disk's own read rate was not measured
# there (at 10^8 rows, partly out of the page cache, a disk PS alone pulled uniform ids at
# 23-41k rows/s and Zipf batches at 73-111k).

# Bytes on disk a row after the load's flush and full compaction: 87.3 B for a 68-byte row and
# its 8-byte id (1.15x, every run; 86.7 B at 10^8 rows loaded from ingested files). Taken as a
# ratio for every row size: RocksDB's overhead is mostly per key (12-byte key, sequence number,
# lengths), so bigger rows likely take less than 1.15x; not measured.
DISK_MEASURED_BYTES_PER_ROW = 87.3
DISK_MEASURED_ROW_BYTES = 68
DISK_BYTES_PER_RAW_BYTE = DISK_MEASURED_BYTES_PER_ROW / (DISK_MEASURED_ROW_BYTES + 8)
# Rows/s through one disk PS (the lowest of the three runs, each run 4's): pulls of uniformly
# random ids (cold: ~12% found in the PS's pool of rows) 353,719 (367,186 and 390,699 in the
# others); pulls of Zipf(1.05) batches (pool hit rate 0.81) 1,620,053 (1,659,121, 1,748,205);
# pushes of stored rows (uniform ids, mostly not pooled: each read to count the new ones)
# 194,187 (213,393, 238,988). A row not in the pool costs a
# RocksDB lookup of 2-5 us, a pooled one ~0.1 us: the PS's CPU, not the disk, set these rates.
DISK_PS_COLD_PULL_ROWS_PER_SECOND = 353_719
DISK_PS_HOT_PULL_ROWS_PER_SECOND = 1_620_053
DISK_PS_PUSH_ROWS_PER_SECOND = 194_187
# The one measured point of the DRAM cache: 10% of the rows' bytes (90% of it the pool: 4.7% of
# the rows, each with ~61 bytes of stamp, id and index besides its own) gave a pool hit rate of
# 0.81 on the Zipf(1.05) batches (~0.12 on uniform ones).
DISK_MEASURED_CACHE_FRACTION = 0.1
DISK_MEASURED_CACHE_HIT_RATE = 0.81
# Data block reads (4 KiB) a row of the uniform pulls, from RocksDB's statistics: 0.849-0.850.
DISK_BLOCK_READS_PER_COLD_ROW = 0.85
# RocksDB's index and bloom filter blocks, held in memory: 16 MiB at 10^7 rows of 68 B (one
# index entry per 4 KiB block, so rows of more bytes take more a row: not measured); ~160 MiB at
# 10^8 (a reopened PS's RSS against an idle one's).
DISK_INDEX_BYTES_PER_ROW = 16 * 2**20 / 10**7
# A disk PS's resident memory beyond its cache and its index and filters, with the PS's trim of
# freed memory (memory_trim.py; bench/RESULTS.md, "against a Redis PS", 2026-11-29): 217 MiB
# (the higher of two runs at 10^7 rows) less the 64 MiB cache and 16 MiB of index and filters
# is 137 MiB, of which memtables 42; at 10^8 rows with a 648 MiB cache and its pool full, 946
# less 648 and ~159: 139 MiB. The rest is the process (76 MiB idle) and buffers in use. Planned
# with the memtables at their cap (2 x 64 MiB, under pushes), not as measured: 223 MiB.
DISK_MEMTABLE_BYTES = 2 * 64 * 2**20
DISK_PS_RSS_BYTES_BEYOND_CACHE = (217 - 64 - 16 - 42) * 2**20 + DISK_MEMTABLE_BYTES

# -- fixed by the design, not measured ------------------------------------------------------

# Optimizer state per row: the PS schema's rule (schema.optimizer_state_width), the trainer's too.
# The trainer's PS tables are fp32 (dynemb/trainer/model.py ps_schema).
VALUE_BYTES = 4
ID_BYTES = 8
# The last-touched stamp each row's value carries on Redis, after the row (the TTL and the row
# cap pick the rows to delete by it): 4 bytes more of value a row.
LIFECYCLE_STAMP_BYTES = STAMP_BYTES
SECONDS_PER_DAY = 86_400
# Redis Cluster needs at least three masters to elect a failover.
MIN_MASTERS = 3
# The disk backend's largest cache_bytes (backends/disk_config.py): more cache needs more PSes.
DISK_MAX_CACHE_BYTES = MAX_CACHE_BYTES
TIB = 2**40


def _jemalloc_size_class(n: int) -> int:
    """The size jemalloc (Redis's allocator) hands out for a request of n bytes: multiples of 16
    up to 128, then four classes per doubling (e.g. 516 -> 640, 772 -> 896)."""
    if n <= 8:
        return 8
    if n <= 128:
        return -(-n // 16) * 16
    step = 1 << (n - 1).bit_length() - 3  # a quarter of the power of two below n
    return -(-n // step) * step


def listpack_bytes(rows: int, row_bytes: int) -> int:
    """Bytes of a listpack hash of `rows` fields of 8 bytes, each with a row of row_bytes: the
    listpack's header and end byte, and per field and value an entry of an encoding byte (or
    two, or five: by length), the bytes, and the entry's length backwards (1-3 bytes)."""
    encoding = 1 if row_bytes <= 63 else 2 if row_bytes <= 4095 else 5
    entry = encoding + row_bytes
    backlen = 1 if entry < 128 else 2 if entry < 16384 else 3
    return 7 + rows * ((1 + 8 + 1) + entry + backlen)


def redis_bytes_per_row(row_bytes: int, rows_per_bucket: int = ROWS_PER_BUCKET) -> float:
    """Redis memory per stored row of a table at its declared rows (the PS's default layout).

    Rows up to MAX_LISTPACK_VALUE: ids hash evenly over the buckets, so a bucket holds a
    Poisson number of rows around rows_per_bucket; each bucket is one listpack allocation
    (rounded up to jemalloc's size class) and BUCKET_KEY_BYTES for its key. Longer rows are
    left to hashtables: each row's own allocation and REDIS_ENTRY_OVERHEAD_BYTES.
    """
    if row_bytes > MAX_LISTPACK_VALUE:
        return redis_row_allocation(row_bytes) + REDIS_ENTRY_OVERHEAD_BYTES
    lam = rows_per_bucket
    chance = math.exp(-lam)  # of an empty bucket (no key: costs nothing)
    per_bucket = 0.0
    for n in range(1, 8 * lam + 32):  # far into the tail
        chance *= lam / n
        per_bucket += chance * (_jemalloc_size_class(listpack_bytes(n, row_bytes)) + BUCKET_KEY_BYTES)
    return per_bucket / lam


def redis_row_allocation(row_bytes: int) -> int:
    """What Redis allocates for one row's value: an sds string (header + the bytes + NUL),
    rounded up to jemalloc's size class."""
    header = 3 if row_bytes < 256 else 5 if row_bytes < 65536 else 9
    return _jemalloc_size_class(header + row_bytes + 1)


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": SECONDS_PER_DAY}


def parse_duration(text: str) -> float:
    """Seconds of a duration written as seconds (3600, 1e5) or a number and a unit: s, m, h or d
    (90s, 15m, 12h, 30d, 1.5d).

    Raises:
        InvalidArgument: not such a number, or not > 0 (the message shows the forms it takes).
    """
    body = text.strip()
    scale = DURATION_UNITS.get(body[-1:], 1)
    if body[-1:] in DURATION_UNITS:
        body = body[:-1].strip()
    try:
        value = float(body) * scale
    except ValueError:
        value = math.nan
    _check(
        math.isfinite(value) and value > 0,
        f"a duration must be seconds > 0, or a number > 0 with s, m, h or d (3600, 90m, 12h, 30d); got {text!r}",
    )
    return value


def format_duration(seconds: float) -> str:
    """A duration as parse_duration reads it, in the largest unit that divides it: 30d, 36h, 90s."""
    for unit, size in sorted(DURATION_UNITS.items(), key=lambda kv: -kv[1]):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def disk_ps_rows_per_second(pull_rows_per_s: float = DISK_PS_COLD_PULL_ROWS_PER_SECOND) -> float:
    """Rows/s one disk PS moves when half are pulls at pull_rows_per_s and half pushes (as in
    training: a row missed is pulled, and about as many evicted rows pushed): a row's time is
    the mean of a pull's and a push's."""
    return 2 / (1 / pull_rows_per_s + 1 / DISK_PS_PUSH_ROWS_PER_SECOND)


@dataclass(frozen=True)
class DiskTier:
    """The same model on disk PSes (disk:// backend), no Redis: see plan()."""

    disk_tib_per_ps: float  # --disk-tib-per-ps: rows' bytes one PS's disk holds
    cache_fraction: float  # --disk-cache-fraction: the DRAM cache over the rows' bytes
    value_bytes: int  # the row, and its stamp where rows expire (a TTL or a cap given)
    bytes_per_row: float  # on disk: DISK_BYTES_PER_RAW_BYTE x (id + value)
    disk_bytes: int  # over all disks, after compaction
    rows_per_tb: float  # rows one TB (10^12 B) of disk holds
    ps_rows_per_s: float  # one disk PS: cold pulls and pushes, half each, at full capacity
    processes_for_size: int
    processes_for_rate: int
    processes_for_cache: int  # the backend's cache_bytes is at most DISK_MAX_CACHE_BYTES a PS
    processes: int  # disk PSes, each with its own disk
    processes_at_hot_pulls: int  # as many, were every pull as fast as the Zipf batches' (cache hit 0.80)
    cache_bytes: int  # all PSes together
    cache_bytes_per_ps: int
    ps_memory_bytes: int  # one PS: its cache, index and filters, the rest as measured, memtables at their cap
    memory_bytes: int  # all PSes together
    block_reads_per_s_per_disk: float  # by the pulls, at the cold pulls' measured reads a row
    redis_memory_bytes: int  # the Redis tier's RAM to compare: masters, replicas, PS processes
    redis_processes: int  # the Redis tier's: masters, replicas and PS processes
    pick: str  # "disk" or "redis"
    why: str  # the reason, in one sentence


@dataclass(frozen=True)
class Plan:
    """What a model needs, for the inputs given (see plan())."""

    rows: int  # stored at steady state: plan() says how they follow from the inputs
    long_lived_rows: int  # --rows: rows in use, that no TTL removes
    new_ids_per_day: float | None
    ttl_s: float | None
    max_rows: int | None
    rows_alive: int | None  # long-lived rows + the IDs first seen within a TTL, before the cap; None: no TTL
    days_to_steady: float | None  # from the first new ID until `rows` are stored (a rate given)
    growth_bytes_per_day: float | None  # Redis memory the new IDs add a day until then (a rate given)
    dim: int
    optimizer: str
    samples_per_s: float
    ids_per_sample: float
    hit_rate: float
    utilisation: float
    redis_gib_per_master: float
    replicas: int
    state_width: int
    row_bytes: int
    value_bytes: int  # on Redis: the row and its LIFECYCLE_STAMP_BYTES
    redis_bytes_per_row: float
    redis_bytes: int  # used_memory of the rows over all masters, replicas not counted
    pulls_per_s: float
    pushes_per_s: float
    masters_for_memory: int
    masters_for_rate: int
    masters: int
    ps_processes: int
    ps_cores: float
    redis_cores: float
    network_bytes_per_s: float  # each way of trainers <-> PS, and again PS <-> Redis
    disk: DiskTier  # the same model on disk PSes instead

    @property
    def rows_per_s(self) -> float:
        return self.pulls_per_s + self.pushes_per_s

    @property
    def rows_derivation(self) -> str:
        """How `rows` follow from the inputs, in one line."""
        if self.new_ids_per_day is None:
            given = f"{_count(self.long_lived_rows)} given (--rows"
            if self.ttl_s is not None:
                given += f": rows in use, which a TTL of {format_duration(self.ttl_s)} never deletes"
            return given + ")" + self._cap_text(self.long_lived_rows)
        long_lived = f"{_count(self.long_lived_rows)} long-lived + " if self.long_lived_rows else ""
        new = f"{long_lived}{_count(self.new_ids_per_day)} new IDs a day"
        if self.ttl_s is None:
            return f"{new}, no TTL: held at the --max-rows cap of {_count(self.rows)}"
        alive = f"{new} x TTL {_count(self.ttl_s / SECONDS_PER_DAY)} days = {_count(self.rows_alive or 0)}"
        return alive + self._cap_text(self.rows_alive or 0)

    def _cap_text(self, rows: int) -> str:
        if self.max_rows is None:
            return ""
        if rows > self.max_rows:
            return f", held at the --max-rows cap of {_count(self.max_rows)}"
        return f", under the --max-rows cap of {_count(self.max_rows)}"

    def as_dict(self) -> dict:
        return {**asdict(self), "rows_per_s": self.rows_per_s, "rows_derivation": self.rows_derivation}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def plan(
    rows: int | None,
    dim: int,
    optimizer: str,
    samples_per_s: float,
    ids_per_sample: float,
    hit_rate: float,
    *,
    utilisation: float = 0.5,
    redis_gib_per_master: float = 32.0,
    replicas: int = 1,
    new_ids_per_day: float | None = None,
    ttl: float | None = None,
    max_rows: int | None = None,
    disk_tib_per_ps: float = 2.5,
    disk_cache_fraction: float = DISK_MEASURED_CACHE_FRACTION,
) -> Plan:
    """Size the Redis Cluster and the PS processes for one model, and a disk tier beside it.

    The rows stored are `rows`, or, for tables whose rows expire, their steady state:

        rows alive = rows + new_ids_per_day x ttl / 1 day
        rows       = min(max_rows, rows alive)

    A row is deleted once neither written nor read for `ttl`. An ID seen once lives a TTL, so
    at steady state the table holds the IDs first seen during the last TTL: the new IDs a day
    times the TTL in days. Rows re-used all along never reach their TTL: `rows` given with a
    rate count these long-lived rows, on top. (The formula counts an ID on the day it is first
    seen: one that comes back after it expired is stored again, so count such returns in
    new_ids_per_day, or the figure comes out low.) The row cap holds the table at `max_rows`
    whatever the rest. New IDs with neither a TTL nor a cap would grow the rows without end, so
    they are refused. The steady state comes `ttl` after the first new ID, or when the cap is
    reached if that is sooner: Plan.days_to_steady, Plan.growth_bytes_per_day until then.

    The disk tier (Plan.disk) is the same rows and rows/s on disk PSes, each with its own disk
    and no Redis: bytes on disk at the measured 1.15x of each row and its id; PSes for the
    bytes at disk_tib_per_ps a disk, for the rows/s at `utilisation` of one disk PS's measured
    rate (pulls of cold rows and pushes, half each: the rows the trainers miss are their
    coldest), and for the cache at the backend's 1 TiB a PS; a DRAM cache of
    disk_cache_fraction of the rows' bytes (only 0.1 was measured).

    Args:
        rows: rows stored over all tables (every ID ever admitted, until evicted from the PS);
            with new_ids_per_day, the long-lived rows on top of the expiring ones. None: none
            (new_ids_per_day must then be given).
        dim: embedding values per row.
        optimizer: sgd, adagrad, rowwise_adagrad or adam (sets the optimizer state per row).
        samples_per_s: training samples per second, all trainers together.
        ids_per_sample: IDs looked up per sample, all features together.
        hit_rate: share of IDs found in the trainers' device tables; the rest are pulled from
            the PS, and about as many rows are pushed back as evicted (steady state).
        utilisation: share of a PS process's or Redis master's measured rows/s to plan for;
            the rest is headroom for peaks, resharding and persistence.
        redis_gib_per_master: row data (used_memory) one master should hold.
        replicas: replicas per master (memory on replicas is reported apart).
        new_ids_per_day: IDs seen for the first time a day, all tables together (None: the rows
            are `rows`, no new ones).
        ttl: seconds a row lives unread and unwritten (None: rows never expire).
        max_rows: the row cap: the most rows stored (None: no cap).
        disk_tib_per_ps: rows' bytes (after compaction) one disk PS's disk holds, in TiB; the
            default is ~70% of a 3.84 TB (3.49 TiB) NVMe drive, room for compactions and the log.
        disk_cache_fraction: each disk PS's DRAM cache over the bytes of the rows it holds.

    Returns:
        The Plan.

    Raises:
        InvalidArgument: an input out of its range (the message names it and the range).
    """
    _check(
        rows is not None or new_ids_per_day is not None,
        "give the rows stored (--rows), or the new IDs a day (--new-ids-per-day) with a TTL (--ttl) or a "
        "row cap (--max-rows), or both",
    )
    _check(
        rows is None or (isinstance(rows, int) and rows >= 1),
        f"rows (--rows) must be a whole number >= 1, got {rows!r}",
    )
    _check(
        new_ids_per_day is None or (math.isfinite(new_ids_per_day) and new_ids_per_day > 0),
        f"new IDs a day (--new-ids-per-day) must be > 0, got {new_ids_per_day!r}",
    )
    _check(
        ttl is None or (math.isfinite(ttl) and ttl > 0),
        f"TTL (--ttl) must be > 0 seconds, got {ttl!r}",
    )
    _check(
        max_rows is None or (isinstance(max_rows, int) and max_rows >= 1),
        f"row cap (--max-rows) must be a whole number >= 1, got {max_rows!r}",
    )
    _check(
        optimizer in OPTIMIZERS, f"optimizer (--optimizer) must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}"
    )
    state_width = optimizer_state_width(optimizer, dim) if isinstance(dim, int) else 0
    _check(
        isinstance(dim, int) and dim >= 1 and dim + state_width <= MAX_ROW_WIDTH,
        f"dim (--dim) must be a whole number from 1 with dim + optimizer state <= {MAX_ROW_WIDTH} values a row "
        f"({optimizer}: dim <= {_max_dim(optimizer)}); got {dim!r}",
    )
    _check(
        math.isfinite(samples_per_s) and samples_per_s > 0,
        f"samples/s (--samples-per-s) must be > 0, got {samples_per_s!r}",
    )
    _check(
        math.isfinite(ids_per_sample) and ids_per_sample > 0,
        f"IDs per sample (--ids-per-sample) must be > 0, got {ids_per_sample!r}",
    )
    _check(
        0 <= hit_rate <= 1,
        f"hit rate (--hit-rate) must be from 0 to 1 (0.9: 90% of IDs found on the device), got {hit_rate!r}",
    )
    _check(0 < utilisation <= 1, f"utilisation (--utilisation) must be > 0 and <= 1, got {utilisation!r}")
    _check(
        math.isfinite(redis_gib_per_master) and redis_gib_per_master > 0,
        f"GiB per Redis master (--redis-gib-per-master) must be > 0, got {redis_gib_per_master!r}",
    )
    _check(
        isinstance(replicas, int) and replicas >= 0,
        f"replicas (--replicas) must be a whole number >= 0, got {replicas!r}",
    )

    _check(
        math.isfinite(disk_tib_per_ps) and disk_tib_per_ps > 0,
        f"TiB per disk PS (--disk-tib-per-ps) must be > 0, got {disk_tib_per_ps!r}",
    )
    _check(
        math.isfinite(disk_cache_fraction) and 0 < disk_cache_fraction <= 1,
        f"disk cache fraction (--disk-cache-fraction) must be > 0 and <= 1 (0.1: a cache of 10% of the "
        f"rows' bytes), got {disk_cache_fraction!r}",
    )

    row_bytes = (dim + state_width) * VALUE_BYTES
    value_bytes = row_bytes + LIFECYCLE_STAMP_BYTES
    per_row = redis_bytes_per_row(value_bytes)
    long_lived = rows or 0
    rows_alive: int | None = None
    days_to_steady: float | None = None
    growth: float | None = None
    if new_ids_per_day is not None:
        growth = new_ids_per_day * per_row
        _check(
            ttl is not None or max_rows is not None,
            f"new IDs a day (--new-ids-per-day) need a TTL (--ttl) or a row cap (--max-rows): without either "
            f"the rows grow without end, by {_count(new_ids_per_day)} rows = {_bytes(growth)} a day on the Redis "
            f"masters ({per_row:,.0f} B a row)",
        )
        if ttl is not None:
            # rounded, so 1e9 x 30 days is 3e10, not a hair above (and ceil() gives no surprises)
            rows_alive = long_lived + math.ceil(round(new_ids_per_day * ttl / SECONDS_PER_DAY, 6))
        stored = min(max_rows or math.inf, rows_alive or math.inf)
        days_to_steady = min(
            ttl / SECONDS_PER_DAY if ttl is not None else math.inf,
            max(0, max_rows - long_lived) / new_ids_per_day if max_rows is not None else math.inf,
        )
    else:
        stored = min(long_lived, max_rows or long_lived)
    steady_rows = int(stored)
    redis_bytes = math.ceil(steady_rows * per_row)
    # rounded, so 1e6 * 40 * (1 - 0.9) is 4e6, not a hair below (and ceil() gives no surprises)
    misses = round(samples_per_s * ids_per_sample * (1 - hit_rate), 6)
    rows_per_s = 2 * misses  # each missed row pulled, and about as many evicted rows pushed
    redis_cores = rows_per_s * REDIS_CPU_SECONDS_PER_ROW
    for_memory = math.ceil(redis_bytes / (redis_gib_per_master * 2**30))
    # a master runs its commands on one core
    for_rate = math.ceil(redis_cores / utilisation)
    masters = max(MIN_MASTERS, for_memory, for_rate)
    ps_processes = max(1, math.ceil(rows_per_s / (PS_ROWS_PER_SECOND * utilisation)))
    disk = _disk_tier(
        steady_rows,
        row_bytes + (LIFECYCLE_STAMP_BYTES if ttl is not None or max_rows is not None else 0),
        misses,
        utilisation,
        disk_tib_per_ps,
        disk_cache_fraction,
        redis_memory_bytes=redis_bytes * (1 + replicas) + ps_processes * PS_RSS_BYTES,
        redis_processes=masters * (1 + replicas) + ps_processes,
    )
    return Plan(
        rows=steady_rows,
        long_lived_rows=long_lived,
        new_ids_per_day=new_ids_per_day,
        ttl_s=ttl,
        max_rows=max_rows,
        rows_alive=rows_alive,
        days_to_steady=days_to_steady,
        growth_bytes_per_day=growth,
        dim=dim,
        optimizer=optimizer,
        samples_per_s=samples_per_s,
        ids_per_sample=ids_per_sample,
        hit_rate=hit_rate,
        utilisation=utilisation,
        redis_gib_per_master=redis_gib_per_master,
        replicas=replicas,
        state_width=state_width,
        row_bytes=row_bytes,
        value_bytes=value_bytes,
        redis_bytes_per_row=per_row,
        redis_bytes=redis_bytes,
        pulls_per_s=misses,
        pushes_per_s=misses,
        masters_for_memory=for_memory,
        masters_for_rate=for_rate,
        masters=masters,
        ps_processes=ps_processes,
        ps_cores=rows_per_s * PS_CPU_SECONDS_PER_ROW,
        redis_cores=redis_cores,
        network_bytes_per_s=rows_per_s * (row_bytes + ID_BYTES),
        disk=disk,
    )


def _disk_tier(
    rows: int,
    value_bytes: int,
    misses: float,
    utilisation: float,
    disk_tib_per_ps: float,
    cache_fraction: float,
    *,
    redis_memory_bytes: int,
    redis_processes: int,
) -> DiskTier:
    """The disk tier of plan(): `misses` rows/s pulled and as many pushed."""
    per_row = DISK_BYTES_PER_RAW_BYTE * (ID_BYTES + value_bytes)
    disk_bytes = math.ceil(rows * per_row)
    rows_per_s = 2 * misses
    cache_bytes = math.ceil(cache_fraction * rows * value_bytes)
    for_size = math.ceil(disk_bytes / (disk_tib_per_ps * TIB))
    for_rate = math.ceil(rows_per_s / (utilisation * disk_ps_rows_per_second()))
    for_cache = math.ceil(cache_bytes / DISK_MAX_CACHE_BYTES)
    processes = max(1, for_size, for_rate, for_cache)
    hot_rate = utilisation * disk_ps_rows_per_second(DISK_PS_HOT_PULL_ROWS_PER_SECOND)
    hot = max(1, for_size, for_cache, math.ceil(rows_per_s / hot_rate))
    cache_per_ps = math.ceil(cache_bytes / processes)
    ps_memory = math.ceil(cache_per_ps + DISK_INDEX_BYTES_PER_ROW * rows / processes + DISK_PS_RSS_BYTES_BEYOND_CACHE)
    memory = processes * ps_memory
    if processes > redis_processes:
        pick, why = (
            "redis",
            f"the rate sets the disk PSes: {processes:,} against the Redis tier's {redis_processes:,} "
            f"processes (a disk PS moves {_count(disk_ps_rows_per_second())} rows/s, measured, "
            f"{_count(PS_ROWS_PER_SECOND)} over Redis), "
            + (
                f"to save {_bytes(redis_memory_bytes - memory)} of RAM"
                if memory < redis_memory_bytes
                else "and it would save no RAM"
            ),
        )
    elif memory >= redis_memory_bytes:
        pick, why = "redis", "the rows fit in RAM: the disk tier would save no RAM"
    else:
        pick, why = (
            "disk",
            f"{_bytes(memory)} of RAM against {_bytes(redis_memory_bytes)}, on {processes:,} processes "
            f"against {redis_processes:,} (Redis masters, replicas and PS processes)",
        )
    return DiskTier(
        disk_tib_per_ps=disk_tib_per_ps,
        cache_fraction=cache_fraction,
        value_bytes=value_bytes,
        bytes_per_row=per_row,
        disk_bytes=disk_bytes,
        rows_per_tb=1e12 / per_row,
        ps_rows_per_s=disk_ps_rows_per_second(),
        processes_for_size=for_size,
        processes_for_rate=for_rate,
        processes_for_cache=for_cache,
        processes=processes,
        processes_at_hot_pulls=hot,
        cache_bytes=cache_bytes,
        cache_bytes_per_ps=cache_per_ps,
        ps_memory_bytes=ps_memory,
        memory_bytes=memory,
        block_reads_per_s_per_disk=misses / processes * DISK_BLOCK_READS_PER_COLD_ROW,
        redis_memory_bytes=redis_memory_bytes,
        redis_processes=redis_processes,
        pick=pick,
        why=why,
    )


def _max_dim(optimizer: str) -> int:
    """The largest dim whose row (embedding + optimizer state, linear in dim) fits MAX_ROW_WIDTH."""
    base = optimizer_state_width(optimizer, 0)
    return (MAX_ROW_WIDTH - base) // (1 + optimizer_state_width(optimizer, 1) - base)


def _bytes(n: float) -> str:
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _count(x: float) -> str:
    """A count to read: 12,500,000 (whole numbers with separators, else 3 significant digits)."""
    return f"{x:,.0f}" if x >= 100 or x == int(x) else f"{x:.3g}"


def _plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


def format_plan(p: Plan) -> str:
    """The plan as `dynemb ps plan` prints it."""
    rate_cap = p.utilisation / REDIS_CPU_SECONDS_PER_ROW
    ps_cap = p.utilisation * PS_ROWS_PER_SECOND
    lines = [
        f"model:          {_count(p.rows)} rows, dim {p.dim}, {p.optimizer} "
        f"({p.state_width} optimizer-state values a row)",
        f"training:       {_count(p.samples_per_s)} samples/s x {_count(p.ids_per_sample)} IDs, "
        f"hit rate {p.hit_rate:g}",
    ]
    if p.new_ids_per_day is not None or p.ttl_s is not None or p.max_rows is not None:
        how = p.rows_derivation
        if p.days_to_steady is not None and p.growth_bytes_per_day is not None:
            how += (
                f"; steady after {_count(p.days_to_steady)} days of new IDs, the masters growing "
                f"{_bytes(p.growth_bytes_per_day)} a day until then"
            )
        lines += textwrap.wrap(how, 100, initial_indent="rows:           ", subsequent_indent=" " * 16)
    lines += [
        "",
        f"row:            {p.row_bytes:,} B (fp32) + {LIFECYCLE_STAMP_BYTES} B last-touched stamp, "
        f"{p.redis_bytes_per_row:,.0f} B on Redis ({p.redis_bytes_per_row / (p.row_bytes + ID_BYTES):.2f}x "
        "the row and its id)",
        f"Redis memory:   {_bytes(p.redis_bytes)} on the masters"
        + (", as much again on each replica" if p.replicas else ""),
        f"PS rows/s:      {_count(p.pulls_per_s)} pulled + {_count(p.pushes_per_s)} pushed = {_count(p.rows_per_s)}",
        f"Redis masters:  {p.masters:,}"
        + (
            f", each with {p.replicas} {_plural(p.replicas, 'replica')}: {p.masters * (1 + p.replicas):,} nodes"
            if p.replicas
            else ""
        ),
        f"                (memory: {p.masters_for_memory:,} at {p.redis_gib_per_master:g} GiB each; "
        f"rate: {p.masters_for_rate:,} at {_count(rate_cap)} rows/s each; at least {MIN_MASTERS})",
        f"PS processes:   {p.ps_processes:,} (at {_count(ps_cap)} rows/s each)",
        f"CPU cores:      {p.ps_cores:,.1f} PS, {p.redis_cores:,.1f} Redis (busy, at the measured CPU per row)",
        f"PS memory:      {_bytes(p.ps_processes * PS_RSS_BYTES)} "
        f"({_bytes(PS_RSS_BYTES)} a process; the rows live in Redis)",
        f"network:        {_bytes(p.network_bytes_per_s)}/s trainers <-> PS, the same PS <-> Redis",
        "",
        f"planned at {p.utilisation:g} of measured capacity: {PS_ROWS_PER_SECOND:,} rows/s a PS process,",
        f"{_count(1 / REDIS_CPU_SECONDS_PER_ROW)} rows/s a Redis master (docs/scale.md says where each comes from)",
        "",
        *format_disk_tier(p),
    ]
    return "\n".join(lines)


def format_disk_tier(p: Plan) -> list[str]:
    """The disk tier's lines of format_plan."""
    d = p.disk
    sizes = [
        f"size: {d.processes_for_size:,} at {d.disk_tib_per_ps:g} TiB a disk",
        f"rate: {d.processes_for_rate:,} at {_count(p.utilisation * d.ps_rows_per_s)} rows/s each",
    ]
    if d.processes_for_cache > 1:
        sizes.append(f"cache: {d.processes_for_cache:,} at most {_bytes(DISK_MAX_CACHE_BYTES)} each")
    stamp = f" + {LIFECYCLE_STAMP_BYTES} B stamp" if d.value_bytes > p.row_bytes else ""
    pick = "disk" if d.pick == "disk" else "Redis"
    lines = [
        "disk tier (the same rows on disk:// PSes, RocksDB on each one's own local SSD, no Redis):",
        f"row on disk:    {d.bytes_per_row:,.0f} B ({DISK_BYTES_PER_RAW_BYTE:.2f}x the row{stamp} and its id, "
        f"as measured at {DISK_MEASURED_ROW_BYTES} B rows); {_count(float(f'{d.rows_per_tb:.3g}'))} rows a TB",
        f"bytes on disk:  {_bytes(d.disk_bytes)} after compaction",
        f"disk PSes:      {d.processes:,}, each with its own disk ({'; '.join(sizes)})",
        f"                ({d.processes_at_hot_pulls:,} if every pull were as fast as the Zipf batches', pool "
        f"hit rate {DISK_MEASURED_CACHE_HIT_RATE:g})",
        f"DRAM cache:     {_bytes(d.cache_bytes)} in all, {_bytes(d.cache_bytes_per_ps)} a PS: "
        f"{d.cache_fraction:g} of the rows' bytes (--disk-cache-fraction)",
        f"                (measured: {DISK_MEASURED_CACHE_FRACTION:g} gave a pool hit rate of "
        f"{DISK_MEASURED_CACHE_HIT_RATE:g} on Zipf(1.05) batches,",
        "                ~0.12 on uniform ones; other fractions, and the trainers' misses, were not measured)",
        f"PS memory:      {_bytes(d.memory_bytes)} ({_bytes(d.ps_memory_bytes)} a process: its cache, index and "
        f"filters, {_bytes(DISK_PS_RSS_BYTES_BEYOND_CACHE)} more: the process as measured, memtables at "
        "their cap)",
        f"disk reads:     {_count(d.block_reads_per_s_per_disk)} blocks/s a disk for the pulls "
        f"({DISK_BLOCK_READS_PER_COLD_ROW:g} a cold row, measured; the disk's own rate was not)",
    ]
    lines += textwrap.wrap(
        f"{pick}: {d.why}. A disk PS has no replica: a lost disk loses its rows since the last checkpoint.",
        100,
        initial_indent="pick:           ",
        subsequent_indent=" " * 16,
    )
    lines += [
        "",
        f"planned at {p.utilisation:g} of measured capacity: {_count(d.ps_rows_per_s)} rows/s a disk PS (pulls of cold",
        f"rows at {DISK_PS_COLD_PULL_ROWS_PER_SECOND:,}, pushes at {DISK_PS_PUSH_ROWS_PER_SECOND:,}, half each: "
        "bench/RESULTS.md, disk_bench)",
    ]
    return lines
