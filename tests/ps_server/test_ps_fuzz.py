"""Fuzz a running PS (`dynemb ps serve`, embedded store and Redis) with over 10,000 hostile
requests (tests/ps_fuzz_requests.py): random bytes in every field, huge and negative sizes,
unknown enums, undecodable messages, oversized ones, import streams cut or inconsistent,
exports abandoned. The PS must keep serving, answer each with OK or a clear status (never
UNKNOWN or INTERNAL) whose details name the problem, and keep the victim tables' rows bit
for bit."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from ps_fuzz_requests import MAX_MESSAGE, Probe, Tables, probes

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.schema import Initializer, TableSchema

pytestmark = pytest.mark.slow

C = grpc.StatusCode
# hostile requests per run: the suite's count, and --soak's (the release check, docs/development.md)
MIN_REQUESTS, SOAK_REQUESTS = 2_000, 10_000
BATCH = 25  # probes per hypothesis example
CALL_TIMEOUT = 60.0
SERVICE = "/dynemb.ps.v1.ParameterServer/"

VICTIMS = [
    TableSchema("victim_fp32", dim=4, state_width=2, dtype="fp32", initializer=Initializer("uniform", -1.0, 1.0, 7)),
    TableSchema(
        "victim_fp16",
        dim=3,
        state_width=1,
        dtype="fp16",
        initializer=Initializer("normal", 0.0, 0.1, 3, state_init=0.5),
    ),
    TableSchema("victim_bf16", dim=8, dtype="bf16"),
]


def victim_rows(schema: TableSchema, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids the fuzzer also uses (small ones, extremes) and rows of random bits (NaN payloads too)."""
    rng = np.random.default_rng(seed)
    ids = np.unique(
        np.concatenate(
            [np.arange(0, 300, 2), [-(1 << 63), (1 << 63) - 1, -1, 42, 43], rng.integers(-(1 << 62), 1 << 62, 100)]
        )
    ).astype(np.int64)
    raw = rng.bytes(len(ids) * schema.row_bytes)
    return ids, np.frombuffer(raw, dtype=schema.np_dtype).reshape(len(ids), schema.width)


def snapshot(client: PSClient) -> dict:
    """Each victim's schema, row count, and every (id, row) it holds as bytes, sorted by id."""
    out = {}
    for v in VICTIMS:
        info = client.describe_table(v.name)
        parts = list(client.export(v.name, rows_per_chunk=97))
        ids = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts])
        order = np.argsort(ids)
        out[v.name] = (info.schema, info.num_rows, ids[order].tobytes(), rows[order].tobytes())
    return out


def outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        call.result()
        return C.OK, ""
    except grpc.FutureCancelledError:
        return C.CANCELLED, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


class Fuzzer:
    """Sends probes over one channel and checks every answer."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", 8 * MAX_MESSAGE), ("grpc.max_receive_message_length", 64 << 20)],
        )
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        # no serializers: bytes go out as they are
        self.raw_unary = {
            m: self.channel.unary_unary(SERVICE + m)
            for m in (
                "CreateTable",
                "DescribeTable",
                "ListTables",
                "DropTable",
                "Pull",
                "Push",
                "Delete",
                "PullMany",
                "PushMany",
                "Stats",
                "Import",
                "AttachSegment",
                "DetachSegment",
                "SetLifecycle",
                "Touch",
                "ReadDeletions",
                "ReadDrops",
                "SetChangeLog",
                "ReadChanges",
            )
        }
        self.raw_export = self.channel.unary_stream(SERVICE + "Export")
        self.raw_import = self.channel.stream_unary(SERVICE + "Import")
        self.sent = 0
        self.codes: dict[str, int] = {}

    def check(self, probe: Probe, code: grpc.StatusCode, details: str) -> None:
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        assert code in probe.codes, f"{probe} was answered {code.name}: {details!r}"
        if code in (C.OK, C.CANCELLED):
            return
        assert details.strip(), f"{probe} was answered {code.name} with no details"
        # the transport's words, not the server's: its message was too big to arrive
        assert "metadata size" not in details, f"{probe}: the server's error did not arrive: {details!r}"
        if probe.words_for is None or code == probe.words_for:
            for word in probe.words:
                assert word.lower() in details.lower(), f"{probe}: {code.name} {details!r} does not mention {word!r}"

    def start_unary(self, probe: Probe):
        self.sent += 1
        if probe.kind == "raw":
            return self.raw_unary[probe.method].future(probe.payload, timeout=CALL_TIMEOUT)
        return getattr(self.stub, probe.method).future(probe.payload, timeout=CALL_TIMEOUT)

    def run_export(self, probe: Probe) -> tuple[grpc.StatusCode, str]:
        self.sent += 1
        call = (self.raw_export if probe.kind == "raw" else self.stub.Export)(probe.payload, timeout=CALL_TIMEOUT)
        try:
            if probe.cancel_after != 0:
                for read, _ in enumerate(call, 1):
                    if probe.cancel_after is not None and read >= probe.cancel_after:
                        break
        except grpc.RpcError:
            return call.code(), call.details() or ""
        if probe.cancel_after is not None:
            call.cancel()  # abandoned half-way (no effect where the stream had ended)
        return call.code(), call.details() or ""

    def run_import(self, probe: Probe) -> tuple[grpc.StatusCode, str]:
        self.sent += 1
        method = self.raw_import if probe.kind == "raw_import" else self.stub.Import
        chunks = probe.payload
        if probe.cancel_after is None:
            return outcome(method.future(iter(chunks), timeout=CALL_TIMEOUT))
        reached, release = threading.Event(), threading.Event()

        def cut_stream():
            yield from chunks[: probe.cancel_after]
            reached.set()
            release.wait(CALL_TIMEOUT)  # hold the stream open until it is cancelled

        call = method.future(cut_stream(), timeout=CALL_TIMEOUT)
        while not reached.wait(0.002) and not call.done():
            pass
        call.cancel()
        release.set()
        return outcome(call)

    def run(self, batch: list[Probe | None]) -> None:
        batch = [p for p in batch if p is not None]
        unary = [p for p in batch if p.kind == "unary" or (p.kind == "raw" and p.method != "Export")]
        # every unary probe of the batch in flight at once, the streams beside them
        calls = [(p, self.start_unary(p)) for p in unary]
        for p in batch:
            if p.kind in ("export", "raw") and p.method == "Export":
                self.check(p, *self.run_export(p))
            elif p.kind in ("import", "raw_import"):
                self.check(p, *self.run_import(p))
        for p, call in calls:
            self.check(p, *outcome(call))

    def drop_scratch(self) -> None:
        """Drop every table but the victims, so memory stays bounded (not counted as fuzz)."""
        listing = self.stub.ListTables(ps_pb2.ListTablesRequest(), timeout=CALL_TIMEOUT)
        for t in listing.tables:
            if t.spec.name not in {v.name for v in VICTIMS}:
                self.stub.DropTable(ps_pb2.DropTableRequest(table=t.spec.name, missing_ok=True), timeout=CALL_TIMEOUT)


def metric_codes(metrics_port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "dynemb_ps_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["method"], s.labels["code"])] = s.value
    return out


@pytest.fixture(params=["embedded", "redis"])
def fuzzed_ps(request, make_ps):
    """A PS with a 1 MiB message limit (so oversized messages are cheap to send)."""
    args = ["--max-message-mb", "1"]
    if request.param == "redis":
        url, ns = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace")
        args += ["--backend", url, "--namespace", ns, "--redis-buckets", "64"]
    return make_ps(*args)


def test_fuzz_keeps_serving_and_victims_intact(fuzzed_ps, soak):
    ps = fuzzed_ps
    min_requests = SOAK_REQUESTS if soak else MIN_REQUESTS
    client = PSClient(ps.address, timeout=CALL_TIMEOUT, max_message_bytes=MAX_MESSAGE)
    stored = {}
    for seed, v in enumerate(VICTIMS):
        client.create_table_from_schema(v)
        stored[v.name] = victim_rows(v, seed)
        client.push(v.name, *stored[v.name])
    before = snapshot(client)
    assert all(before[v.name][1] == len(stored[v.name][0]) for v in VICTIMS)

    fuzzer = Fuzzer(ps.address)
    tables = Tables(VICTIMS)
    started = time.monotonic()

    @settings(
        max_examples=min_requests // BATCH + 20,  # a few probes are dropped as unsafe (see raw_probe)
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(st.lists(probes(tables), min_size=BATCH, max_size=BATCH))
    def fuzz(batch):
        fuzzer.run(batch)
        assert ps.proc.poll() is None, f"the PS died:\n{ps.log()[-3000:]}"
        fuzzer.drop_scratch()
        for v in VICTIMS:  # after every batch, so a failure points at the batch that did it
            ids, rows = stored[v.name]
            got = client.pull(v.name, ids)
            changed = np.flatnonzero(
                got.missing
                | (got.rows.view(np.uint8).reshape(len(ids), -1) != rows.view(np.uint8).reshape(len(ids), -1)).any(
                    axis=1
                )
            )
            assert not len(changed), (
                f"victim {v.name}: the rows of {len(changed)} ids changed or went, e.g. ids {ids[changed[:5]]}"
            )

    fuzz()
    elapsed = time.monotonic() - started
    print(f"\n{fuzzer.sent} requests in {elapsed:.1f}s; answers: {dict(sorted(fuzzer.codes.items()))}")
    assert fuzzer.sent >= min_requests
    # every kind of answer came up: the probes reach past validation as well as into it
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "CANCELLED"} <= set(
        fuzzer.codes
    )

    assert ps.proc.poll() is None
    assert client.health() == ["SERVING"]
    assert snapshot(client) == before
    # nothing the PS handled ended as a server fault, cancelled streams included
    faults = {k: n for k, n in metric_codes(ps.metrics_port).items() if k[1] in ("INTERNAL", "UNKNOWN") and n}
    assert not faults, f"server faults in /metrics: {faults}"
    assert "Traceback" not in ps.log(), ps.log()[-5000:]
    client.close()
    fuzzer.channel.close()
