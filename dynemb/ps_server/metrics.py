"""Prometheus metrics of one PS, on a registry of its own (so tests can run several).

Every metric is listed, with its labels and meaning, in docs/metrics.md; the names follow
Prometheus' conventions (counters are exposed with `_total`, times in seconds)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from dynemb.protos import ps_pb2
from dynemb.ps_server.schema import TableSchema

# Latencies from 100 us (a small pull on the embedded store) to 30 s (a big import).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# A sweep pass over one table: from a small table's milliseconds to a big one's hour.
SWEEP_BUCKETS = (0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0)
# The `table` label of tables past --max-table-labels: not a valid table name, so no table's own.
OTHER_TABLES = "(other)"
DEFAULT_MAX_TABLE_LABELS = 1000

# The status codes that are failures of the PS, not of the caller (the alert DynembPSErrors and
# its recorded ratio select these, deploy/prometheus/rules): INTERNAL (a bug or an unexpected
# store failure), UNAVAILABLE (the store is away), DEADLINE_EXCEEDED (the PS took longer than the
# caller would wait), RESOURCE_EXHAUSTED (above all Redis at its maxmemory, refusing writes; also a
# request over the PS's message or shared-memory limits, a deployment's mismatch, not a typo).
# Left out, as the caller's doing: INVALID_ARGUMENT, NOT_FOUND (describe_table on a table that
# does not exist), ALREADY_EXISTS, FAILED_PRECONDITION (a segment the PS cannot use: the client
# sends bytes instead), UNAUTHENTICATED, CANCELLED.
SERVER_ERROR_CODES = ("INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
METHODS = tuple(m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods)


class PSMetrics:
    """Every metric of one PS (listed in docs/metrics.md).

    Args:
        registry: the registry to put them on; None makes a new one.
        max_table_labels: how many tables get a `table` label value of their own; the rows of
            tables beyond count under OTHER_TABLES. A dropped table's values are removed
            (forget_table), which frees its place.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, max_table_labels: int = DEFAULT_MAX_TABLE_LABELS
    ) -> None:
        if max_table_labels < 0:
            raise ValueError(f"max_table_labels must be >= 0, got {max_table_labels}")
        self.max_table_labels = max_table_labels
        self._labelled: set[str] = set()  # tables with label values of their own
        self._labels_lock = threading.Lock()
        # rows of forgotten tables, per method, so Stats' per-method totals never go down
        self.retired_rows: dict[str, float] = {}
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds...: what an operator
        # watches a long-lived service's memory and CPU by (a registry of our own has none)
        ProcessCollector(registry=r)
        self.requests = Counter(
            "dynemb_ps_requests", "RPCs handled, by method and final status code", ["method", "code"], registry=r
        )
        self.errors = Counter(
            "dynemb_ps_errors", "RPCs that ended in an error, by method and status code", ["method", "code"], registry=r
        )
        # every server-side failure a method can end in, at 0 from the start: a series that first
        # appears at 5 has no earlier sample to rate() or increase() against, so the first burst
        # of errors would go unseen by the alerts
        for method in METHODS:
            for code in SERVER_ERROR_CODES:
                self.errors.labels(method, code)
        self.rows = Counter(
            "dynemb_ps_rows",
            "Rows pulled, pushed, deleted, exported or imported, by method and table",
            ["method", "table"],
            registry=r,
        )
        self.missing_rows = Counter(
            "dynemb_ps_missing_rows",
            "Rows pulled that were never pushed (returned initialised), by table",
            ["table"],
            registry=r,
        )
        self.bytes = Counter(
            "dynemb_ps_bytes",
            "Payload bytes of ids and rows, by method and direction (in|out)",
            ["method", "direction"],
            registry=r,
        )
        self.latency = Histogram(
            "dynemb_ps_request_seconds", "RPC handling time, by method", ["method"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.backend_latency = Histogram(
            "dynemb_ps_backend_seconds",
            "Time spent in the store, by operation",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("dynemb_ps_inflight_requests", "RPCs being handled now", registry=r)
        self.serving = Gauge("dynemb_ps_serving", "1 while the PS accepts requests, 0 while draining", registry=r)
        self.backend_up = Gauge(
            "dynemb_ps_backend_up", "1 while the store (Redis) answers pings, 0 while it is away", registry=r
        )
        self.backend_lost_data = Gauge(
            "dynemb_ps_backend_lost_data",
            "1 once the store was found to have lost what this PS saw it hold (its marker gone: a Redis "
            "restarted empty); stays until the PS restarts",
            registry=r,
        )
        self.shm_segments = Gauge(
            "dynemb_ps_shm_segments", "Client memory segments attached for same-host row transfer", registry=r
        )
        self.shm_bytes = Gauge("dynemb_ps_shm_bytes", "Bytes of the attached segments", registry=r)
        self.info = Gauge(
            "dynemb_ps_info", "Constant 1, labelled with the backend and version", ["backend", "version"], registry=r
        )
        # rows that expire (lifecycle.py, sweeper.py); sweeps are this PS's, when it holds the lease
        self.rows_expired = Counter(
            "dynemb_ps_rows_expired",
            "Rows deleted by this PS's sweeps (TTL or row cap), by table",
            ["table"],
            registry=r,
        )
        self.expired_reads = Counter(
            "dynemb_ps_expired_reads",
            "Rows this PS's pulls found expired and not yet swept (served as never pushed), by table; "
            "counted at each of the PS's sweeps",
            ["table"],
            registry=r,
        )
        self.sweep_seconds = Histogram(
            "dynemb_ps_sweep_seconds", "Duration of a sweep pass over one table", buckets=SWEEP_BUCKETS, registry=r
        )
        self.oldest_row_age = Gauge(
            "dynemb_ps_oldest_row_age_seconds",
            "Age of the least recently used row, at the table's last sweep (dynemb_ps_last_sweep_timestamp_seconds)",
            ["table"],
            registry=r,
        )
        self.rows_over_cap = Gauge(
            "dynemb_ps_rows_over_cap",
            "Rows over the table's max_rows after its last sweep (all in use)",
            ["table"],
            registry=r,
        )
        # a pass over a table is due at least hourly, or every --sweep-every if longer (sweeper.py),
        # and may take hours over billions of rows: a time older than that means that sweeps
        # stopped. For the tables this PS has swept: its own last pass, or a later one of another
        # PS over the store (server.py reads the store's record).
        self.last_sweep = Gauge(
            "dynemb_ps_last_sweep_timestamp_seconds",
            "When the table's last sweep pass ended (Unix seconds), for tables this PS has swept",
            ["table"],
            registry=r,
        )
        self._swept_tables: set[str] = set()  # tables with sweep series of their own
        self._last_finished: dict[str, float] = {}  # the sweep the gauges show, by label
        self._sweeps_lock = threading.Lock()
        # tables against the rows they declared (TableSchema.expected_rows), counted every
        # server.TABLE_COUNT_EVERY_S; a table that declared none has neither series
        self.declared_rows = Gauge(
            "dynemb_ps_table_declared_rows",
            "Rows the table declared it expects (expected_rows), for tables that declared some",
            ["table"],
            registry=r,
        )
        self.rows_over_declared = Gauge(
            "dynemb_ps_rows_over_declared",
            "Rows the table holds beyond what it declared (expected_rows), for tables that declared some",
            ["table"],
            registry=r,
        )
        self._declared: set[str] = set()  # label values counted() set at its last call
        # a read-only PS (`dynemb ps serve --read-only`): the published version each table serves
        self.published_version = Gauge(
            "dynemb_ps_published_version",
            "The published version a read-only PS serves of the table (dynemb table apply)",
            ["table"],
            registry=r,
        )
        self.published_cut = Gauge(
            "dynemb_ps_published_cut_timestamp_seconds",
            "When the version a read-only PS serves of the table was cut (Unix seconds): its age is time() minus this",
            ["table"],
            registry=r,
        )
        self._expired_reads_seen: dict[str, int] = {}
        self._children: dict = {}
        # durable writes (redis_durable.py), counted by the store and read at each scrape
        self.replica_waits = _ReplicaWaits()
        r.register(self.replica_waits)
        # the disk store's RocksDB (Store.engine_stats), read at each scrape
        self.disk_engine = _DiskEngine()
        r.register(self.disk_engine)

    def swept(self, result, expired_reads: int) -> None:
        """Record a sweeper pass (sweeper.SweepResult) and the expired rows pulls found so far."""
        label = self.table_label(result.table)
        counter = self.child(self.expired_reads, label)
        counter.inc(max(0, expired_reads - self._expired_reads_seen.get(result.table, 0)))
        self._expired_reads_seen[result.table] = expired_reads
        self.child(self.rows_expired, label).inc(result.deleted)
        self.sweep_seconds.observe(result.seconds)
        with self._sweeps_lock:
            self._sweep_gauges(label, result.finished, result.rows_over_cap, result.oldest)
            if label == result.table:
                self._swept_tables.add(label)

    def _sweep_gauges(self, label: str, finished: float, rows_over_cap: int, oldest: int) -> None:
        if oldest:
            self.child(self.oldest_row_age, label).set(max(0.0, finished - oldest))
        self.child(self.rows_over_cap, label).set(rows_over_cap)
        self.child(self.last_sweep, label).set(finished)
        self._last_finished[label] = finished

    def sweep_seen(self, table: str, record: dict) -> None:
        """The latest sweep of a table this PS has swept, as the store recorded it (Store.last_sweep:
        by whichever PS over the store made it). The table's sweep gauges follow it where it is
        newer than theirs, so that a PS whose sweep lease passed to another shows no stale sweep."""
        finished = float(record.get("finished", 0.0))
        with self._sweeps_lock:
            if table in self._swept_tables and finished > self._last_finished.get(table, 0.0):
                self._sweep_gauges(table, finished, int(record.get("rows_over_cap", 0)), int(record.get("oldest", 0)))

    def swept_tables(self) -> set[str]:
        """The tables with sweep series of their own (swept by this PS, not forgotten since)."""
        with self._sweeps_lock:
            return set(self._swept_tables)

    def unswept(self, table: str) -> None:
        """Remove a table's sweep gauges (its rows no longer expire: no sweep is due, and its
        last sweep's time must not read as sweeps that stopped). Its counters stay."""
        with self._sweeps_lock:
            self._swept_tables.discard(table)
            self._last_finished.pop(table, None)
            for metric in (self.oldest_row_age, self.rows_over_cap, self.last_sweep):
                self._children.pop((metric, (table,)), None)
                with contextlib.suppress(KeyError):
                    metric.remove(table)

    def counted(self, tables: Iterable[tuple[TableSchema, int]]) -> None:
        """Set each table's declared rows and rows over them, from (TableSchema, rows stored)
        pairs of every table (Store.list_tables_with_rows): tables that declared none get no
        series; those past max_table_labels are summed under OTHER_TABLES."""
        sums: dict[str, tuple[int, int]] = {}
        for schema, rows in tables:
            if schema.expected_rows > 0:
                declared, over = sums.get(label := self.table_label(schema.name), (0, 0))
                sums[label] = (declared + schema.expected_rows, over + max(0, rows - schema.expected_rows))
        for label, (declared, over) in sums.items():
            self.child(self.declared_rows, label).set(declared)
            self.child(self.rows_over_declared, label).set(over)
        for label in self._declared - sums.keys():  # dropped (through any PS), or none under OTHER_TABLES now
            for metric in (self.declared_rows, self.rows_over_declared):
                self._children.pop((metric, (label,)), None)
                with contextlib.suppress(KeyError):
                    metric.remove(label)
        self._declared = set(sums)

    def watch_replica_waits(self, read: Callable[[], dict[str, int]]) -> None:
        """Have dynemb_ps_replica_waits_total{outcome} read at each scrape (Store.replica_waits:
        the store counts its durable writes by what WAIT said)."""
        self.replica_waits.read = read

    def watch_engine(self, read: Callable[[], dict[str, float]]) -> None:
        """Have the dynemb_ps_disk_* families read at each scrape (Store.engine_stats)."""
        self.disk_engine.read = read

    def published(self, versions: dict[str, tuple[int, float]]) -> None:
        """Each served table's (version, cut time), from a read-only PS's store."""
        for table, (number, cut) in versions.items():
            label = self.table_label(table)
            self.child(self.published_version, label).set(number)
            self.child(self.published_cut, label).set(cut)

    def child(self, metric, *labels):
        """metric.labels(*labels), remembered: labels() checks and locks on every call, and a
        PullMany of 26 tables made ~100 such calls."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def table_label(self, table: str) -> str:
        """The `table` label value for a table's rows: its name while fewer than
        max_table_labels tables have one, OTHER_TABLES after that."""
        if table in self._labelled:
            return table
        with self._labels_lock:
            if len(self._labelled) < self.max_table_labels:
                self._labelled.add(table)
                return table
        return OTHER_TABLES

    def forget_table(self, table: str) -> None:
        """Remove a table's label values (it was dropped): /metrics stops showing it and its
        place goes to the next table. Its rows still count in Stats' per-method totals."""
        with self._labels_lock:
            if table not in self._labelled:
                return
            self._labelled.discard(table)
            by_table: tuple[Counter | Gauge, ...] = (self.missing_rows, self.rows_expired, self.expired_reads)
            by_table += (self.oldest_row_age, self.rows_over_cap, self.last_sweep)
            by_table += (self.declared_rows, self.rows_over_declared)
            with self._sweeps_lock:
                self._swept_tables.discard(table)
                self._last_finished.pop(table, None)
            tabled = (self.rows, *by_table)
            # list(): a C-level copy, safe while request threads add children
            for key in [k for k in list(self._children) if k[0] in tabled and k[1][-1] == table]:
                self._children.pop(key, None)
            for metric in self.rows.collect():
                for s in metric.samples:
                    if s.name.endswith("_total") and s.labels["table"] == table:
                        method = s.labels["method"]
                        self.retired_rows[method] = self.retired_rows.get(method, 0.0) + s.value
                        self.rows.remove(method, table)
            for labelled in by_table:
                with contextlib.suppress(KeyError):
                    labelled.remove(table)
            self._expired_reads_seen.pop(table, None)

    def labelled_tables(self) -> set[str]:
        """The tables with label values of their own now."""
        with self._labels_lock:
            return set(self._labelled)


class _ReplicaWaits:
    """A collector of a store's durable writes by outcome (redis_durable.py), read at scrape time."""

    NAME = "dynemb_ps_replica_waits"

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, int]] = dict

    def label_names(self) -> dict[str, list[str]]:
        """{the family's name as documented: its labels} (tests/deploy_files.py)."""
        return {self.NAME + "_total": ["outcome"]}

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            self.NAME,
            "Durable writes (--redis-durable) by what waiting for Redis replicas said: acked, short "
            "(too few replicas had it in time: the write failed and is retried), unreplicated (no replica online)",
            labels=["outcome"],
        )
        for outcome, n in sorted(self.read().items()):
            family.add_metric([outcome], n)
        yield family


class _DiskFamily(NamedTuple):
    """One dynemb_ps_disk_* family: its name, type, help, {label values: engine_stats key}, labels."""

    name: str
    kind: str
    doc: str
    keys: dict[tuple[str, ...], str]
    labels: list[str]


_DISK_FAMILIES = (
    _DiskFamily(
        "dynemb_ps_disk_cache_lookups",
        "counter",
        "Lookups in the disk store's DRAM caches by cache (row: its pools of hot rows; block: RocksDB's "
        "block cache) and result (hit, miss): hit rate = hits / lookups",
        {
            ("row", "hit"): "row_cache_hit",
            ("row", "miss"): "row_cache_miss",
            ("block", "hit"): "block_cache_hit",
            ("block", "miss"): "block_cache_miss",
        },
        ["cache", "result"],
    ),
    _DiskFamily("dynemb_ps_disk_bytes", "gauge", "Bytes of the disk store's files", {(): "disk_bytes"}, []),
    _DiskFamily(
        "dynemb_ps_disk_pending_compaction_bytes",
        "gauge",
        "Bytes RocksDB estimates its compactions still have to rewrite (writes stall past a limit)",
        {(): "pending_compaction_bytes"},
        [],
    ),
    _DiskFamily(
        "dynemb_ps_disk_running_compactions",
        "gauge",
        "RocksDB compactions running now",
        {(): "running_compactions"},
        [],
    ),
    _DiskFamily(
        "dynemb_ps_disk_compaction_bytes",
        "counter",
        "Bytes RocksDB's compactions read and wrote, by direction (read, write)",
        {("read",): "compaction_read_bytes", ("write",): "compaction_write_bytes"},
        ["direction"],
    ),
    _DiskFamily(
        "dynemb_ps_disk_write_stall_seconds",
        "counter",
        "Time writes to the disk store waited on RocksDB's stalls (L0 files, memtables, pending compaction)",
        {(): "write_stall_seconds"},
        [],
    ),
)


class _DiskEngine:
    """The disk store's RocksDB figures (Store.engine_stats), read at scrape time; no samples for
    another store."""

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, float]] = dict

    def label_names(self) -> dict[str, list[str]]:
        """{each family's name as documented: its labels} (tests/deploy_files.py)."""
        return {f.name + ("_total" if f.kind == "counter" else ""): f.labels for f in _DISK_FAMILIES}

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.read()
        for f in _DISK_FAMILIES:
            family = (CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily)(f.name, f.doc, labels=f.labels)
            for label_values, key in f.keys.items():
                if key in stats:
                    family.add_metric(list(label_values), stats[key])
            yield family
