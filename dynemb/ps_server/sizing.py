"""How big a PS fleet over Redis Cluster a model needs (`dynemb ps plan`, docs/scale.md).

Every figure comes from the model (rows, dim, optimizer), the training rate (samples/s, IDs per
sample, hit rate of the trainers' device tables) and the measured constants below. The
constants are the only numbers here that come from a machine: each names the measurement it
came from, so a new benchmark run changes them in this one place (then regenerate the
examples in docs/scale.md: `python tests/ps_server/test_scale_doc.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dynemb.ps_server.backends.redis_config import MAX_LISTPACK_VALUE, ROWS_PER_BUCKET
from dynemb.ps_server.errors import InvalidArgument
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

# -- fixed by the design, not measured ------------------------------------------------------

# Optimizer state per row: the PS schema's rule (schema.optimizer_state_width), the trainer's too.
# The trainer's PS tables are fp32 (dynemb/trainer/model.py ps_schema).
VALUE_BYTES = 4
ID_BYTES = 8
# Redis Cluster needs at least three masters to elect a failover.
MIN_MASTERS = 3


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


@dataclass(frozen=True)
class Plan:
    """What a model needs, for the inputs given (see plan())."""

    rows: int
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

    @property
    def rows_per_s(self) -> float:
        return self.pulls_per_s + self.pushes_per_s

    def as_dict(self) -> dict:
        return {**asdict(self), "rows_per_s": self.rows_per_s}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def plan(
    rows: int,
    dim: int,
    optimizer: str,
    samples_per_s: float,
    ids_per_sample: float,
    hit_rate: float,
    *,
    utilisation: float = 0.5,
    redis_gib_per_master: float = 32.0,
    replicas: int = 1,
) -> Plan:
    """Size the Redis Cluster and the PS processes for one model.

    Args:
        rows: rows stored over all tables (every ID ever admitted, until evicted from the PS).
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

    Returns:
        The Plan.

    Raises:
        InvalidArgument: an input out of its range (the message names it and the range).
    """
    _check(isinstance(rows, int) and rows >= 1, f"rows (--rows) must be a whole number >= 1, got {rows!r}")
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

    row_bytes = (dim + state_width) * VALUE_BYTES
    per_row = redis_bytes_per_row(row_bytes)
    redis_bytes = math.ceil(rows * per_row)
    # rounded, so 1e6 * 40 * (1 - 0.9) is 4e6, not a hair below (and ceil() gives no surprises)
    misses = round(samples_per_s * ids_per_sample * (1 - hit_rate), 6)
    rows_per_s = 2 * misses  # each missed row pulled, and about as many evicted rows pushed
    redis_cores = rows_per_s * REDIS_CPU_SECONDS_PER_ROW
    for_memory = math.ceil(redis_bytes / (redis_gib_per_master * 2**30))
    # a master runs its commands on one core
    for_rate = math.ceil(redis_cores / utilisation)
    return Plan(
        rows=rows,
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
        redis_bytes_per_row=per_row,
        redis_bytes=redis_bytes,
        pulls_per_s=misses,
        pushes_per_s=misses,
        masters_for_memory=for_memory,
        masters_for_rate=for_rate,
        masters=max(MIN_MASTERS, for_memory, for_rate),
        ps_processes=max(1, math.ceil(rows_per_s / (PS_ROWS_PER_SECOND * utilisation))),
        ps_cores=rows_per_s * PS_CPU_SECONDS_PER_ROW,
        redis_cores=redis_cores,
        network_bytes_per_s=rows_per_s * (row_bytes + ID_BYTES),
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
        "",
        f"row:            {p.row_bytes:,} B (fp32), {p.redis_bytes_per_row:,.0f} B on Redis "
        f"({p.redis_bytes_per_row / (p.row_bytes + ID_BYTES):.2f}x the row and its id)",
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
    ]
    return "\n".join(lines)
