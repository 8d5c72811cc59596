"""Run the PS: gRPC server with health, reflection, auth, TLS and a Prometheus endpoint.

    server = PSServer(ServeConfig(address="127.0.0.1:0")).start()
    ... server.port ...
    server.stop()

`dynemb ps serve` wraps this and drains on SIGTERM: health turns NOT_SERVING at once
(so load balancers stop sending), after `not_serving_seconds` new RPCs are refused with
UNAVAILABLE (which clients retry), in-flight ones get up to `drain_seconds` to finish, the
store is closed (the embedded one saves its rows), then the process exits.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from dynemb.common.version import __version__
from dynemb.protos import ps_pb2
from dynemb.ps_server import shm
from dynemb.ps_server.auth import TokenAuthInterceptor
from dynemb.ps_server.backend_watch import BackendWatch, LossWatch
from dynemb.ps_server.backends import Store, open_store
from dynemb.ps_server.backends.redis_durable import DEFAULT_TIMEOUT_MS, Durability
from dynemb.ps_server.entries import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_IDS
from dynemb.ps_server.errors import InvalidArgument, PSError, TableNotFound
from dynemb.ps_server.memory_trim import MemoryTrim
from dynemb.ps_server.metrics import DEFAULT_MAX_TABLE_LABELS, PSMetrics
from dynemb.ps_server.schema import MAX_ROW_WIDTH
from dynemb.ps_server.service import DEFAULT_MAX_ROW_WIDTH, ParameterServerService, add_to_server
from dynemb.ps_server.shm import SegmentTable
from dynemb.ps_server.sweeper import Sweeper, SweepResult

log = logging.getLogger("dynemb.ps")

SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
# A health service name that says only "this process is alive": SERVING from start to exit, the
# store's state and draining aside. A liveness probe checks it; readiness checks "" (which
# follows the store), so an outage of Redis makes PS pods unready, not restarted.
LIVENESS_SERVICE = "liveness"
# How often the PS counts every table's rows against what it declared (dynemb_ps_rows_over_declared):
# one listing of the tables with their row counts (two commands on Redis, whatever their number);
# every second while the store holds no table, so the first tables show at once.
TABLE_COUNT_EVERY_S = 30.0


@dataclass
class ServeConfig:
    """Everything `dynemb ps serve` takes (flags and DYNEMB_PS_* variables)."""

    address: str = "0.0.0.0:50051"
    backend: str = ""  # "" or embedded:// → the in-process store; redis://, rediss://, redis+cluster://
    namespace: str = "dynemb"  # Redis key prefix, so several models share one Redis
    max_message_bytes: int = 64 << 20
    # Bounds on what one request makes the PS do: the widest rows a new table may have, and the
    # most bytes of rows one pull or push may ask for or carry (messages and shared memory).
    max_row_width: int = DEFAULT_MAX_ROW_WIDTH
    max_request_bytes: int = 64 << 20
    # ...and the most entries one PullMany or PushMany may have, and ids one request may carry
    max_request_entries: int = DEFAULT_MAX_ENTRIES
    max_request_ids: int = DEFAULT_MAX_IDS
    workers: int = 16
    auth_token: str | None = field(default=None, repr=False)  # never in a repr, so never in a log
    auth_health: bool = False  # health checks need the token too (default: open, for probes)
    tls_cert: str | None = None  # PEM file paths; both or neither
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: clients must show a certificate this CA signed
    metrics_port: int | None = 9090  # None: no /metrics endpoint; 0: any free port
    metrics_address: str = "0.0.0.0"
    drain_seconds: float = 30.0
    # After SIGTERM, how long health says NOT_SERVING while requests are still taken,
    # so load balancers and probes see it before the port closes.
    not_serving_seconds: float = 1.0
    redis_buckets: int = 4096  # hashes per new table that declares no expected rows (fixed once created)
    redis_rows_per_bucket: int = 16  # rows a hash is sized for, in a table that declares its expected rows
    redis_listpack: str = "auto"  # auto: raise Redis's listpack limits as tables need them; off: leave them
    # writes acknowledged once replicas have them (redis_durable.py): auto, off or a count of replicas
    redis_durable: str = "auto"
    redis_durable_timeout_ms: int = DEFAULT_TIMEOUT_MS
    backend_check_seconds: float = 1.0  # how often health re-checks that the store answers
    # Passes of the sweeper over a table whose rows expire: at most one per this many seconds
    # (and per ttl / 8, up to an hour apart); 0: this PS sweeps nothing (others over the store may).
    sweep_every_seconds: float = 60.0
    # Same-host row transfer (shm.py): how much client memory may be attached at once (0: none
    # taken; clients then send rows as bytes) and how long an unused segment stays attached.
    shm_max_bytes: int = 4 << 30
    shm_idle_seconds: float = 300.0
    backend_options: dict = field(default_factory=dict)
    max_table_labels: int = DEFAULT_MAX_TABLE_LABELS  # tables with /metrics label values of their own
    # Serve published tables (dynemb table apply) read only: a Redis backend's namespace of them,
    # or an embedded store's files, reloaded every follow_seconds when a newer save is there.
    read_only: bool = False
    follow_seconds: float = 1.0

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError(
                "mutual TLS (--tls-client-ca) needs the PS's own certificate and key (--tls-cert, --tls-key)"
            )
        if self.auth_health and not self.auth_token:
            raise ValueError("--auth-health closes health checks to callers without the token: set --auth-token")
        if self.max_message_bytes < 64 << 10:
            raise ValueError(f"max message size {self.max_message_bytes} is below the 64 KiB minimum")
        if not 1 <= self.max_row_width <= MAX_ROW_WIDTH:
            raise ValueError(f"--max-row-width must be in [1, {MAX_ROW_WIDTH}], got {self.max_row_width}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-mb must be > 0, got {self.max_request_bytes} bytes")
        if self.max_request_entries < 1 or self.max_request_ids < 1:
            raise ValueError(
                f"--max-request-entries and --max-request-ids must be > 0, got {self.max_request_entries} and "
                f"{self.max_request_ids}"
            )
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.shm_max_bytes < 0 or self.shm_idle_seconds <= 0:
            raise ValueError("--shm-max-mb must be >= 0 and --shm-idle-seconds > 0")
        if self.max_table_labels < 0:
            raise ValueError(f"--max-table-labels must be >= 0, got {self.max_table_labels}")
        if self.redis_listpack not in ("auto", "off"):
            raise ValueError(f"--redis-listpack must be auto or off, got {self.redis_listpack!r}")
        Durability.parse(self.redis_durable, self.redis_durable_timeout_ms)  # its error names the limits
        if not 1 <= self.redis_rows_per_bucket <= 1 << 16:
            raise ValueError(f"--redis-rows-per-bucket must be in [1, 65536], got {self.redis_rows_per_bucket}")
        if self.backend_check_seconds <= 0:
            raise ValueError(f"backend check interval must be > 0 seconds, got {self.backend_check_seconds}")
        if self.sweep_every_seconds < 0:
            raise ValueError(f"--sweep-every must be >= 0 seconds (0: no sweeps), got {self.sweep_every_seconds}")


class PSServer:
    """One PS: the gRPC service over a store, with health, reflection, auth, TLS and metrics.

    Args:
        config: how to serve.
        store: the store to serve; None opens config.backend.
    """

    def __init__(self, config: ServeConfig, store: Store | None = None) -> None:
        self.config = config
        self.metrics = PSMetrics(max_table_labels=config.max_table_labels)
        if store is None:
            options = dict(config.backend_options)
            if config.backend and not config.backend.startswith(("embedded", "memory", "disk")):
                options.setdefault("num_buckets", config.redis_buckets)
                options.setdefault("rows_per_bucket", config.redis_rows_per_bucket)
                options.setdefault("listpack", config.redis_listpack)
                options.setdefault("durable", Durability.parse(config.redis_durable, config.redis_durable_timeout_ms))
            else:
                _warn_of_redis_settings(config)
            store = open_store(config.backend, namespace=config.namespace, **options)
            if config.read_only:
                store = _read_only(store, config.namespace)
        self.store = store
        self.metrics.watch_replica_waits(store.replica_waits)
        self.metrics.watch_engine(store.engine_stats)
        self.health = health.HealthServicer()
        self.loss = LossWatch(store, self._store_lost)
        self.backend_watch = BackendWatch(store, config.backend_check_seconds, self._backend_changed, self.loss)
        self._table_count = threading.Thread(target=self._count_tables_loop, name="ps-table-count", daemon=True)
        self.memory_trim = MemoryTrim()  # freed request buffers back to the OS (memory_trim.py)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http: WSGIServer | None = None
        self._stopped = threading.Event()  # set once draining: health stays NOT_SERVING
        self._drained: int | None = None  # drain()'s result, once drained
        self._closed = False
        self._health_lock = threading.Lock()  # the store watch's updates against the drain's
        interceptors = (
            [TokenAuthInterceptor(config.auth_token, open_health=not config.auth_health, on_deny=self._count_refusal)]
            if config.auth_token
            else []
        )
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="ps"),
            interceptors=interceptors,
            options=opts,
        )
        self.segments = SegmentTable(config.shm_max_bytes if shm.available() else 0, config.shm_idle_seconds)
        self.metrics.shm_segments.set_function(lambda: len(self.segments))
        self.metrics.shm_bytes.set_function(lambda: self.segments.bytes)
        self.service = ParameterServerService(
            store,
            self.metrics,
            config.max_message_bytes,
            self.segments,
            max_row_width=config.max_row_width,
            max_request_bytes=config.max_request_bytes,
            max_request_entries=config.max_request_entries,
            max_request_ids=config.max_request_ids,
            read_only=config.read_only,
            store_away=self._store_away,
            loss=self.loss,
        )
        add_to_server(self.service, self._grpc)
        sweeps = config.sweep_every_seconds and not config.read_only
        self.sweeper = Sweeper(store, config.sweep_every_seconds, on_result=self._swept) if sweeps else None
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc,
        )

    def start(self) -> PSServer:
        """Listen and serve; returns self.

        Raises:
            OSError: the address could not be bound.
            ValueError: TLS is set up with a certificate but no key.
        """
        cfg = self.config
        if cfg.tls_cert:
            if not cfg.tls_key:  # __post_init__ refuses this; the config was changed since
                raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
            with open(cfg.tls_cert, "rb") as f:
                cert = f.read()
            with open(cfg.tls_key, "rb") as f:
                key = f.read()
            client_ca = None
            if cfg.tls_client_ca:
                with open(cfg.tls_client_ca, "rb") as f:
                    client_ca = f.read()
            creds = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
            )
            self.port = self._grpc.add_secure_port(cfg.address, creds)
        else:
            self.port = self._grpc.add_insecure_port(cfg.address)
        if not self.port:
            raise OSError(f"could not listen on {cfg.address}")
        if cfg.metrics_port is not None:
            metrics_http, _ = start_http_server(cfg.metrics_port, cfg.metrics_address, registry=self.metrics.registry)
            self._metrics_http = metrics_http
            self.metrics_port = metrics_http.server_port
        self._grpc.start()
        self.metrics.info.labels(self.store.kind, __version__).set(1)
        self.metrics.serving.set(1)
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        # Start even when the store is away: NOT_SERVING (and UNAVAILABLE per request) until it is back.
        self.backend_watch.check()
        self.backend_watch.start()
        if self.sweeper is not None:
            self.sweeper.start()
        self._table_count.start()
        self.memory_trim.start()
        if self.config.read_only:
            threading.Thread(target=self._follow_loop, name="ps-follow", daemon=True).start()
        # the store's settings for the tables already there, off the start path (it may be away)
        threading.Thread(target=self._check_store_config, name="ps-store-config", daemon=True).start()
        log.info(
            "PS serving %s on port %d (%s backend, %s, auth %s)%s",
            SERVICE_NAME,
            self.port,
            self.store.kind,
            ("mutual TLS" if cfg.tls_client_ca else "TLS") if cfg.tls_cert else "plaintext",
            "on" if cfg.auth_token else "off",
            f", metrics on :{self.metrics_port}/metrics" if self.metrics_port else "",
        )
        return self

    def _swept(self, result: SweepResult) -> None:
        """A sweeper pass (the sweeper records it in the store for every PS): into the metrics."""
        self.metrics.swept(result, self.store.expired_reads(result.table))

    def _follow_loop(self) -> None:
        """Read only: load a newer save of the store's files when one is there (embedded)."""
        while not self._stopped.wait(self.config.follow_seconds):
            try:
                self.store.reload_if_newer()
            except Exception:  # noqa: BLE001 - a bad save is logged; the one loaded stays served
                log.exception("could not load the newer save of the embedded store")

    def _count_tables_loop(self) -> None:
        wait = 0.0
        while not self._stopped.wait(wait):
            try:
                wait = TABLE_COUNT_EVERY_S if self.count_tables() else 1.0
            except Exception:  # noqa: BLE001 - a thread that dies would leave the gauges stale
                log.exception("could not count the tables' rows")
                wait = TABLE_COUNT_EVERY_S

    def count_tables(self) -> bool:
        """Every table's rows against what it declared, into the metrics; for the tables this PS
        has swept, the store's record of their last sweep (whichever PS made it), and out of
        the metrics their sweep gauges once their rows no longer expire or they were dropped
        (through any PS). Returns whether the store holds any table."""
        try:
            tables = self.store.list_tables_with_rows()
        except PSError as exc:  # the store away (BackendWatch says so): next time
            log.debug("could not count the tables' rows: %s", exc)
            return False
        self.metrics.counted(tables)
        if self.config.read_only:
            self.metrics.published(self.store.published_versions())
        for table in self.metrics.swept_tables():
            try:
                if not self.store.lifecycle(table).active:
                    self.metrics.unswept(table)
                elif record := self.store.last_sweep(table):
                    self.metrics.sweep_seen(table, record)
            except TableNotFound:
                self.metrics.unswept(table)
            except PSError as exc:
                log.debug("could not read the lifecycle of table %r: %s", table, exc)
        return bool(tables)

    def _check_store_config(self) -> None:
        try:
            self.store.check_config()
        except Exception as exc:  # noqa: BLE001 - the store away or refusing: logged, serving goes on
            log.warning("could not check the store's settings for its tables: %s", exc)

    def drain(self, grace: float | None = None) -> int:
        """NOT_SERVING at once (load balancers stop sending), calls still served for
        not_serving_seconds; then every new call is refused with UNAVAILABLE (clients retry it)
        and those in flight get what is left of `grace` seconds to finish.

        Returns:
            How many calls were still in flight when the time ran out (0: none).
        """
        if self._drained is not None:
            return self._drained
        self._stopped.set()
        self.backend_watch.stop()
        grace = self.config.drain_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        self.metrics.serving.set(0)
        with self._health_lock:  # the served services NOT_SERVING; LIVENESS_SERVICE stays SERVING
            for service in ("", SERVICE_NAME):
                self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: NOT_SERVING, up to %.1fs for in-flight requests", grace)
        if self.config.not_serving_seconds > 0:
            time.sleep(min(self.config.not_serving_seconds, grace))
        left = self.service.drain(max(0.0, deadline - time.monotonic()))
        if left:
            log.warning("%d calls still in flight after %gs of draining (--drain-seconds)", left, grace)
        else:
            log.info("drained: no call in flight, new ones refused with UNAVAILABLE")
        self._drained = left
        return left

    def stop(self, grace: float | None = None, close_port: bool = True) -> None:
        """Drain (see drain), then stop serving and close the store.

        Args:
            grace: seconds in-flight calls may take [default: config.drain_seconds].
            close_port: stop the gRPC server too. A process about to exit passes False and
                leaves its connections to the exit: grpc's own shutdown cancels, with CANCELLED
                (which clients do not retry), any call that reaches it while it says GOAWAY,
                where an exiting process's connections close under their calls, which clients
                see as UNAVAILABLE and retry.
        """
        if self._closed:
            return
        self._closed = True
        if self.sweeper is not None:
            self.sweeper.stop()
        self.memory_trim.stop()
        self.drain(grace)
        if self._table_count.is_alive():
            self._table_count.join(timeout=15)
        if close_port:
            self._grpc.stop(0).wait()  # after the drain, only refusals can be in flight
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self.store.close()
        self.segments.close()
        self.service.exported.close()
        self.service.imported.close()
        log.info("stopped")

    def _count_refusal(self, method: str) -> None:
        self.metrics.requests.labels(method, "UNAUTHENTICATED").inc()
        self.metrics.errors.labels(method, "UNAUTHENTICATED").inc()

    def _store_away(self) -> str:
        """Why the store counts as away now (BackendWatch), for the calls refused meanwhile; ""
        while it answers."""
        if self.backend_watch.up is not False:
            return ""
        where = getattr(self.store, "address", "")
        store = f"the {self.store.kind} store" + (f" at {where}" if where else "")
        return f"{store} is away (health NOT_SERVING): {self.backend_watch.reason}"

    def _store_lost(self, reason: str) -> None:
        """The store lost its data (LossWatch logged it): the metric the alert reads."""
        self.metrics.backend_lost_data.set(1)

    def _backend_changed(self, up: bool) -> None:
        self.metrics.backend_up.set(1 if up else 0)
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        with self._health_lock:
            if not self._stopped.is_set():  # a draining PS stays NOT_SERVING
                self.health.set("", status)
                self.health.set(SERVICE_NAME, status)

    def wait(self) -> None:
        """Block until the server has stopped."""
        self._grpc.wait_for_termination()


# ServeConfig's settings that only a Redis backend reads, with their flags
_REDIS_SETTINGS = {
    "redis_buckets": "--redis-buckets",
    "redis_rows_per_bucket": "--redis-rows-per-bucket",
    "redis_listpack": "--redis-listpack",
    "redis_durable": "--redis-durable",
    "redis_durable_timeout_ms": "--redis-durable-timeout-ms",
}


def _warn_of_redis_settings(config: ServeConfig) -> None:
    """Log the Redis settings given other than their defaults to a PS whose store is not Redis:
    they change nothing there (a disk PS's durability is its URL's sync=)."""
    defaults = ServeConfig()
    given = [flag for name, flag in _REDIS_SETTINGS.items() if getattr(config, name) != getattr(defaults, name)]
    if given:
        log.warning(
            "%s set, but the backend %s is not Redis: ignored%s",
            ", ".join(given),
            config.backend or "embedded://",
            " (the disk store's durability is its URL's sync=ack|<ms>)" if config.backend.startswith("disk") else "",
        )


def _read_only(store: Store, namespace: str) -> Store:
    """The store of a read-only PS: published tables in Redis, or the embedded store's files
    (never saved back, reloaded when an applier saved a newer generation)."""
    from dynemb.ps_server.backends.embedded import EmbeddedStore

    if store.kind == "disk":
        store.close()
        raise InvalidArgument(
            "--read-only serves published tables (from Redis, or an embedded store's folder); a disk:// backend "
            "holds a training PS's rows: serve it without --read-only"
        )
    if isinstance(store, EmbeddedStore):
        store.read_only = True
        return store
    from dynemb.ps_server.backends.serving import ServingStore
    from dynemb.ps_server.backends.serving_redis import ServingRedis

    return ServingStore(ServingRedis(store, namespace))
