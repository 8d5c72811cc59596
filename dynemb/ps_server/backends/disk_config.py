"""The disk backend's settings: `disk:///path/to/dir?cache_bytes=...&sync=...&compression=...`,
parsed and checked, and the RocksDB options they make.

The engine is RocksDB through the PyPI binding `rocksdict` (pinned in pyproject.toml): it is
maintained, ships a manylinux wheel with RocksDB compiled in (no compiler, no system library, the
same RocksDB on every machine), and exposes what the store needs: column families, WriteBatch,
multi-get, iterators with bounds, WAL sync, table files to ingest, bloom filters and statistics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from dynemb.common.errors import shown
from dynemb.ps_server.errors import InvalidArgument

# The DRAM cache of rows and blocks, in bytes: 256 MiB unless set; 1 MiB to 1 TiB.
DEFAULT_CACHE_BYTES = 256 << 20
MIN_CACHE_BYTES = 1 << 20
MAX_CACHE_BYTES = 1 << 40
# Of the cache, the share that holds single rows in the store's own pools (disk_cache.py); the
# rest is RocksDB's block cache. Why rows, and in the store: ids are hashes, so a 4 KiB block
# holds ~50 rows of which few are hot, and a row read through RocksDB costs 1-3 us even from its
# row cache. The blocks a miss reads come from the OS's page cache as well.
POOL_SHARE = 0.9
# sync=<ms>: a background WAL fsync every 1 ms to 60 s.
MIN_SYNC_MS = 1
MAX_SYNC_MS = 60_000
COMPRESSIONS = ("none", "lz4")
SETTINGS = ("cache_bytes", "sync", "compression")
# Bits per key of the rows' bloom filters: ~1% false positives, so a pull of a never-pushed id
# costs no disk read 99 times in 100.
BLOOM_BITS_PER_KEY = 10
_SIZE = re.compile(r"^(\d+)\s*(|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)$", re.IGNORECASE)
_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


@dataclass(frozen=True)
class DiskConfig:
    """A disk store's settings.

    Attributes:
        path: the RocksDB directory (made if missing).
        cache_bytes: DRAM for hot rows and blocks (POOL_SHARE of it the store's pools of rows).
        sync_ms: 0: every write's WAL is fsynced before it is acknowledged (sync=ack); N > 0: a
            background thread fsyncs the WAL every N ms (a power loss may lose the last N ms of
            acknowledged writes; a killed process loses nothing: each write reached the OS).
        compression: "none" or "lz4", for the rows' files.
    """

    path: str
    cache_bytes: int = DEFAULT_CACHE_BYTES
    sync_ms: int = 0
    compression: str = "none"

    @property
    def sync(self) -> str:
        """The sync setting as the URL writes it: "ack" or the milliseconds."""
        return str(self.sync_ms) if self.sync_ms else "ack"


def parse_size(text: str, what: str) -> int:
    """Bytes of a size such as 268435456, 256MiB, 256M or 1g (binary units); InvalidArgument if not one."""
    m = _SIZE.match(text.strip())
    if not m:
        raise InvalidArgument(f"{what} {shown(text)} is not a size: use bytes, or a number with KiB, MiB, GiB or TiB")
    return int(m.group(1)) << _UNITS[m.group(2)[:1].lower()]


def parse_disk_url(url: str) -> DiskConfig:
    """The settings of a `disk://` backend URL.

    Args:
        url: `disk:///abs/dir` or `disk://rel/dir`, then optionally
            `?cache_bytes=256MiB&sync=ack|<ms>&compression=none|lz4`.

    Returns:
        The checked settings.

    Raises:
        InvalidArgument: no directory, an unknown setting, or a value out of its range (named, with the range).
    """
    rest = url.split("://", 1)[1] if "://" in url else ""
    path, _, query = rest.partition("?")
    if not path:
        raise InvalidArgument(f"backend URL {shown(url)}: disk:// needs a directory, e.g. disk:///var/lib/dynemb/rows")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidArgument(
            f"backend URL {shown(url)}: settings {shown(query)} are not name=value pairs joined by &"
        ) from None
    settings: dict[str, str] = {}
    for name, value in pairs:
        if name not in SETTINGS:
            raise InvalidArgument(
                f"backend URL {shown(url)}: setting {shown(name)} is not one of {', '.join(SETTINGS)}"
            )
        settings[name] = value
    cache = DEFAULT_CACHE_BYTES
    if "cache_bytes" in settings:
        cache = parse_size(settings["cache_bytes"], "disk backend cache_bytes")
        if not MIN_CACHE_BYTES <= cache <= MAX_CACHE_BYTES:
            raise InvalidArgument(
                f"disk backend cache_bytes {cache} is out of range: use 1 MiB ({MIN_CACHE_BYTES}) to "
                f"1 TiB ({MAX_CACHE_BYTES})"
            )
    sync_ms = 0
    sync = settings.get("sync", "ack").strip().lower()
    if sync != "ack":
        if not sync.isdigit() or not MIN_SYNC_MS <= int(sync) <= MAX_SYNC_MS:
            raise InvalidArgument(
                f"disk backend sync {shown(sync)} is not ack or a whole number of ms from {MIN_SYNC_MS} "
                f"to {MAX_SYNC_MS}"
            )
        sync_ms = int(sync)
    compression = settings.get("compression", "none").strip().lower()
    if compression not in COMPRESSIONS:
        raise InvalidArgument(f"disk backend compression {shown(compression)} is not one of {', '.join(COMPRESSIONS)}")
    return DiskConfig(path=path, cache_bytes=cache, sync_ms=sync_ms, compression=compression)


MAX_WAL_BYTES = 256 << 20

# The column families: table records, counts and the drops log (default); rows; the id logs.
ROWS_CF = "rows"
LOGS_CF = "logs"


def rocksdb_options(config: DiskConfig) -> tuple[Any, dict[str, Any], list[Any]]:
    """(the DB's options, {column family: its options}, the caches they use) for config.

    The caches are returned so the store keeps them alive as long as the DB.
    """
    import rocksdict as rd

    block_cache = rd.Cache(max(MIN_CACHE_BYTES // 2, config.cache_bytes - int(config.cache_bytes * POOL_SHARE)))

    def base() -> rd.Options:
        o = rd.Options(raw_mode=True)
        o.create_if_missing(True)
        o.create_missing_column_families(True)
        o.set_max_background_jobs(2)
        # one level-style tree whose levels grow with the data: the least space over the live rows
        o.set_level_compaction_dynamic_level_bytes(True)
        return o

    db = base()
    # what the metrics and the bench read (cache hits, block reads, stalls); no cost seen: 2M rows,
    # alternated twice, pulls and pushes within 5% with and without
    db.enable_statistics()
    db.set_keep_log_file_num(5)
    # every write's batch touches the default family (row counts): without a bound its memtable
    # would pin every WAL file since its last flush; past this, RocksDB flushes what pins the oldest
    db.set_max_total_wal_size(MAX_WAL_BYTES)
    rows = base()
    table = rd.BlockBasedOptions()
    table.set_block_cache(block_cache)
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
    # not the data blocks' hash index: tried on 2M rows, pulls were no faster (Zipf 520-584k
    # against 538-548k rows/s, uniform 174-180k against 188-196k) and files 1.6% bigger
    rows.set_block_based_table_factory(table)
    # memtables: RocksDB's 64 MiB, two at most (16 MiB ones loaded 2M rows at 148k rows/s here
    # against 222k: more flushes and compactions on 2 cores)
    rows.set_max_write_buffer_number(2)
    # a bloom filter over the memtable's keys too: a new id's lookup skips its skip list
    rows.set_memtable_whole_key_filtering(True)
    rows.set_memtable_prefix_bloom_ratio(0.02)
    rows.set_compression_type(
        rd.DBCompressionType.lz4() if config.compression == "lz4" else rd.DBCompressionType.none()
    )
    logs = base()
    logs.set_compression_type(rd.DBCompressionType.lz4())  # ids of a log share their high bytes
    return db, {ROWS_CF: rows, LOGS_CF: logs}, [block_cache]
