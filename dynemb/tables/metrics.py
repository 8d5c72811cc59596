"""Prometheus metrics of one trainer rank, on a registry of its own; served on /metrics at
metrics_port + local rank when the port is set (so every machine's, or pod's, ranks use the
same ports). Every metric carries `rank` (the global rank) and `train_job` (the job's name, so
several jobs can share one Prometheus); per-table ones `table` too, the PS table's name (as the
PS's own metrics name it). Every metric is listed in docs/metrics.md."""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from dynemb.ps_server.client import CallWatch
from dynemb.ps_server.metrics import LATENCY_BUCKETS

# the per-table counters, in the column order of TableStats.count's rows
TABLE_COUNTERS = (
    ("lookups", "IDs looked up in the ID transformer"),
    ("hits", "IDs found resident on the device"),
    ("misses", "IDs not resident when looked up"),
    ("admissions", "IDs given a device row"),
    ("evictions", "IDs evicted from the device"),
    ("rejections", "IDs below the admission threshold"),
    ("rows_pulled", "Rows pulled from the PS"),
    ("rows_pushed", "Rows pushed to the PS"),
)
OPS = ("pull", "push")  # the `op` label of dynemb_trainer_ps_request_seconds
# on every metric of a rank; `train_job`, not `job`: Prometheus sets `job` to the scrape job
RANK_LABELS = ("rank", "train_job")


class TableStats:
    """The per-table metrics (counters, occupancy, PS latency) of a rank, kept in numpy arrays
    and turned into metric families when scraped (a custom collector). A step updates every
    table at once with one array add; labelled prometheus_client children would take 9 calls
    per table and step, each behind a lock of its own (26 tables: ~0.3 ms of a ~25 ms step on
    the transform thread, which shares the cores with training)."""

    def __init__(self, rank: str, registry: CollectorRegistry, buckets=LATENCY_BUCKETS, job: str = "dynemb") -> None:
        self.rank = rank
        self.job = job
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self.bounds = np.asarray(buckets, dtype=np.float64)  # upper bounds; +Inf after them
        self.counts = np.zeros((0, len(TABLE_COUNTERS)), dtype=np.int64)
        self.occupancy = np.zeros(0)
        self.latency_counts = np.zeros((len(OPS), 0, len(buckets) + 1), dtype=np.int64)  # per bucket, not cumulative
        self.latency_sums = np.zeros((len(OPS), 0))
        self._lock = threading.Lock()  # an update is whole when scraped
        registry.register(self)

    def add_tables(self, names: list[str]) -> np.ndarray:
        """Row numbers of these tables (added where new; a table already here keeps its counts)."""
        with self._lock:
            for name in names:
                if name not in self._index:
                    self._index[name] = len(self.names)
                    self.names.append(name)
            n = len(self.names) - self.counts.shape[0]
            if n:
                self.counts = np.concatenate([self.counts, np.zeros((n, self.counts.shape[1]), np.int64)])
                self.occupancy = np.concatenate([self.occupancy, np.zeros(n)])
                self.latency_counts = np.concatenate(
                    [self.latency_counts, np.zeros((len(OPS), n, self.latency_counts.shape[2]), np.int64)], axis=1
                )
                self.latency_sums = np.concatenate([self.latency_sums, np.zeros((len(OPS), n))], axis=1)
        return np.array([self._index[name] for name in names], dtype=np.int64)

    def count(self, rows: np.ndarray, counts: np.ndarray, occupancy: np.ndarray) -> None:
        """counts: (len(rows), len(TABLE_COUNTERS)) increments; occupancy: each table's now."""
        with self._lock:
            self.counts[rows] += counts
            self.occupancy[rows] = occupancy

    def observe(self, op: str, rows: np.ndarray, seconds: float) -> None:
        """One PS call's time, for each of the tables it carried."""
        bucket = int(np.searchsorted(self.bounds, seconds))  # le: the first bound >= seconds
        k = OPS.index(op)
        with self._lock:
            self.latency_counts[k, rows, bucket] += 1
            self.latency_sums[k, rows] += seconds

    def collect(self):
        """The metric families, from a copy of the arrays (prometheus_client's collector interface)."""
        with self._lock:
            names = list(self.names)
            counts, occupancy = self.counts.copy(), self.occupancy.copy()
            latency, sums = np.cumsum(self.latency_counts, axis=2), self.latency_sums.copy()
        labels = ["table", *RANK_LABELS]
        for j, (name, help_text) in enumerate(TABLE_COUNTERS):
            family = CounterMetricFamily(f"dynemb_trainer_{name}", help_text, labels=labels)
            for t, table in enumerate(names):
                family.add_metric([table, self.rank, self.job], float(counts[t, j]))
            yield family
        family = GaugeMetricFamily(
            "dynemb_trainer_table_occupancy_ratio", "Resident share of this rank's rows", labels=labels
        )
        for t, table in enumerate(names):
            family.add_metric([table, self.rank, self.job], float(occupancy[t]))
        yield family
        family = HistogramMetricFamily(
            "dynemb_trainer_ps_request_seconds",
            "PS pull or push time as the trainer sees it, from the call to its reply",
            labels=["op", *labels],
        )
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for k, op in enumerate(OPS):
            for t, table in enumerate(names):
                family.add_metric(
                    [op, table, self.rank, self.job], list(zip(les, latency[k, t].astype(float))), float(sums[k, t])
                )
        yield family

    def label_names(self) -> dict[str, list[str]]:
        """{family name as documented (counters with _total): its label names} (tests/deploy_files.py)."""
        labels = ["table", *RANK_LABELS]
        out = {f"dynemb_trainer_{name}_total": labels for name, _ in TABLE_COUNTERS}
        out["dynemb_trainer_table_occupancy_ratio"] = labels
        out["dynemb_trainer_ps_request_seconds"] = ["op", *labels]
        return out


class PSCallStats:
    """The rank's PS calls as its PS client's CallWatch counts them, read when scraped (a custom
    collector): retries and failures, and how long the oldest call in flight has waited, so a
    rank blocked on a PS that is away shows while it waits (the latency histograms record a
    call only once it ends)."""

    def __init__(self, rank: str, job: str, registry: CollectorRegistry) -> None:
        self.labels = [rank, job]
        self.watch = CallWatch()
        registry.register(self)

    def collect(self):
        """The metric families (prometheus_client's collector interface)."""
        watch = self.watch
        families = (
            (CounterMetricFamily, "dynemb_trainer_ps_retries", "PS call tries tried again", watch.retries),
            (CounterMetricFamily, "dynemb_trainer_ps_errors", "PS calls failed after their retries", watch.failures),
            (
                GaugeMetricFamily,
                "dynemb_trainer_ps_blocked_seconds",
                "How long the oldest PS call in flight has waited for its reply (0: none in flight)",
                watch.blocked_seconds(),
            ),
        )
        for kind, name, help_text, value in families:
            family = kind(name, help_text, labels=list(RANK_LABELS))
            family.add_metric(self.labels, float(value))
            yield family

    def label_names(self) -> dict[str, list[str]]:
        """{family name as documented: its label names} (tests/deploy_files.py)."""
        names = (
            "dynemb_trainer_ps_retries_total",
            "dynemb_trainer_ps_errors_total",
            "dynemb_trainer_ps_blocked_seconds",
        )
        return {name: list(RANK_LABELS) for name in names}


class TrainerMetrics:
    """Every metric of one trainer rank (listed in docs/metrics.md). The per-rank ones are the
    children of this rank's labels, made here: they are exposed (at 0) from the start, so an
    alert sees a rank that never makes its first step.

    Args:
        rank: the global rank, the `rank` label.
        registry: the registry to put them on; None makes a new one.
        job: the job's name, the `train_job` label (TrainConfig.metrics_job()).
    """

    def __init__(self, rank: int, registry: CollectorRegistry | None = None, job: str = "dynemb") -> None:
        self.rank = str(rank)
        self.job = job
        self.registry = r = registry or CollectorRegistry()
        self.tables = TableStats(self.rank, r, job=job)
        mine = (self.rank, job)
        self.samples = Counter("dynemb_trainer_samples", "Training samples processed", RANK_LABELS, registry=r).labels(
            *mine
        )
        self.samples_per_second = Gauge(
            "dynemb_trainer_samples_per_second",
            "This rank's mean training throughput since the job started",
            RANK_LABELS,
            registry=r,
        ).labels(*mine)
        self.loss = Gauge(
            "dynemb_trainer_loss", "Recent training loss (mean over the last steps)", RANK_LABELS, registry=r
        ).labels(*mine)
        self.steps = Counter("dynemb_trainer_steps", "Training steps done", RANK_LABELS, registry=r).labels(*mine)
        # 1 once the rank's job is done (trained, evaluated, rows flushed): an alert tells a rank
        # that ended from one that went down while its job ran
        self.finished = Gauge(
            "dynemb_trainer_finished",
            "1 once this rank finished its job cleanly, 0 while it runs",
            RANK_LABELS,
            registry=r,
        ).labels(*mine)
        self.ps_stats = PSCallStats(self.rank, job, r)

    @property
    def ps_calls(self) -> CallWatch:
        """What the rank's PS client tells of its calls (RowStore.watch_calls)."""
        return self.ps_stats.watch

    def serve(self, port: int, address: str = "127.0.0.1"):
        """Serve /metrics; returns the HTTP server (its `shutdown()` stops it)."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        return server
