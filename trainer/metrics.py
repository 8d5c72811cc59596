"""Prometheus metrics of one trainer rank, on a registry of its own; served on /metrics at
metrics_port + local rank when the port is set (so every machine's, or pod's, ranks use the
same ports). Per-table metrics carry `table` and `rank` (the global rank) labels; the rest `rank`.
Every metric is listed in docs/metrics.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ps_server.metrics import LATENCY_BUCKETS


class TrainerMetrics:
    def __init__(self, rank: int, registry: CollectorRegistry | None = None) -> None:
        self.rank = str(rank)
        self.registry = r = registry or CollectorRegistry()
        t = ["table", "rank"]
        self.lookups = Counter("dynemb_trainer_lookups", "IDs looked up in the ID transformer", t, registry=r)
        self.hits = Counter("dynemb_trainer_hits", "IDs found resident on the device", t, registry=r)
        self.misses = Counter("dynemb_trainer_misses", "IDs not resident when looked up", t, registry=r)
        self.admissions = Counter("dynemb_trainer_admissions", "IDs given a device row", t, registry=r)
        self.evictions = Counter("dynemb_trainer_evictions", "IDs evicted from the device", t, registry=r)
        self.rejections = Counter("dynemb_trainer_rejections", "IDs below the admission threshold", t, registry=r)
        self.rows_pulled = Counter("dynemb_trainer_rows_pulled", "Rows pulled from the PS", t, registry=r)
        self.rows_pushed = Counter("dynemb_trainer_rows_pushed", "Rows pushed to the PS", t, registry=r)
        self.occupancy = Gauge("dynemb_trainer_table_occupancy_ratio", "Resident share of this rank's rows", t,
                               registry=r)
        self.ps_latency = Histogram("dynemb_trainer_ps_request_seconds",
                                    "PS pull or push time as the trainer sees it, from the call to its reply",
                                    ["op", "table", "rank"], buckets=LATENCY_BUCKETS, registry=r)
        self.samples = Counter("dynemb_trainer_samples", "Training samples processed", ["rank"], registry=r)
        self.samples_per_second = Gauge("dynemb_trainer_samples_per_second",
                                        "This rank's mean training throughput since the job started", ["rank"],
                                        registry=r)
        self.loss = Gauge("dynemb_trainer_loss", "Recent training loss (mean over the last steps)", ["rank"], registry=r)
        self.steps = Counter("dynemb_trainer_steps", "Training steps done", ["rank"], registry=r)

    def serve(self, port: int, address: str = "127.0.0.1"):
        """Serve /metrics; returns the HTTP server (its `shutdown()` stops it)."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        return server
