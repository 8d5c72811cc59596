"""Security of a running PS (a subprocess started through the CLI): the auth token on every
RPC (reflection included; health optionally), tokens never in logs or metrics, mutual TLS
with certificates the test makes (Redis over TLS behind the PS: test_ps_rediss.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import dynemb

from dynemb.protos import ps_pb2
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument, PSError
from dynemb.testing.local_ps import REPO

TOKEN = "tok-SECRET-7f3a9c"
SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]


def every_ps_rpc(channel: grpc.Channel, metadata) -> dict[str, grpc.StatusCode]:
    """Each RPC of the PS service (from the proto, so a new one is covered too) with an empty
    request: the status it gets."""
    codes = {}
    for method in SERVICE.methods:
        request = getattr(ps_pb2, method.input_type.name)()
        response = getattr(ps_pb2, method.output_type.name)
        path = f"/{SERVICE.full_name}/{method.name}"
        kind = "_".join(
            "stream" if streaming else "unary" for streaming in (method.client_streaming, method.server_streaming)
        )
        call = getattr(channel, kind)(
            path, request_serializer=type(request).SerializeToString, response_deserializer=response.FromString
        )
        arg = iter([request]) if method.client_streaming else request
        try:
            reply = call(arg, timeout=10, metadata=metadata)
            if method.server_streaming:
                list(reply)
            codes[method.name] = grpc.StatusCode.OK
        except grpc.RpcError as err:
            codes[method.name] = err.code()
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                assert "Bearer" in err.details() and TOKEN not in err.details()
    return codes


def reflection_code(channel: grpc.Channel, metadata) -> grpc.StatusCode:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    try:
        replies = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10, metadata=metadata
            )
        )
        assert any(s.name == SERVICE.full_name for r in replies for s in r.list_services_response.service)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def health_code(channel: grpc.Channel, metadata) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


@pytest.mark.parametrize("auth_health", [False, True])
def test_every_rpc_needs_the_token(make_ps, auth_health):
    proc = make_ps("--auth-token", TOKEN, *(["--auth-health"] if auth_health else []))
    channel = grpc.insecure_channel(proc.address)
    for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:  # the last: no "Bearer"
        codes = every_ps_rpc(channel, metadata)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        assert reflection_code(channel, metadata) == grpc.StatusCode.UNAUTHENTICATED
        want = grpc.StatusCode.UNAUTHENTICATED if auth_health else grpc.StatusCode.OK
        assert health_code(channel, metadata) == want
    unknown = channel.unary_unary(f"/{SERVICE.full_name}/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as info:  # no hint of which methods exist
        unknown(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", f"Bearer {TOKEN}"),)
    with PSClient(proc.address, auth_token=TOKEN) as ps:  # the client's own health check sends the token
        assert ps.health() == ["SERVING"]
        ps.wait_ready(timeout=10)
    if auth_health:
        with PSClient(proc.address, auth_token="wrong") as ps, pytest.raises(PSError, match="UNAUTHENTICATED"):
            ps.wait_ready(timeout=60)  # at once, not after a minute
    with pytest.raises(grpc.RpcError) as info:
        unknown(b"", timeout=10, metadata=good)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    codes = every_ps_rpc(channel, good)  # empty requests: refused for what they lack, not for the token
    assert grpc.StatusCode.UNAUTHENTICATED not in codes.values() and codes["ListTables"] == grpc.StatusCode.OK
    assert reflection_code(channel, good) == grpc.StatusCode.OK
    assert health_code(channel, good) == grpc.StatusCode.OK
    channel.close()


def test_auth_health_without_a_token_is_refused_at_start():
    run = subprocess.run(
        [
            sys.executable,
            *("-m dynemb.cli ps serve --address 127.0.0.1:0 --metrics-port -1 --auth-health").split(),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2 and "--auth-health" in run.stderr and "--auth-token" in run.stderr


def test_a_password_in_a_bad_backend_url_is_not_echoed():
    run = subprocess.run(
        [
            sys.executable,
            *(
                "-m dynemb.cli ps serve --address 127.0.0.1:0 --metrics-port -1 --backend "
                "rediz://admin:hunter2pw@redis:6379/0"
            ).split(),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert run.returncode == 2 and "rediz" in run.stderr and "admin:***@redis" in run.stderr
    assert "hunter2pw" not in run.stderr + run.stdout


@pytest.mark.slow
def test_tokens_never_reach_logs_or_metrics(make_ps, redis_auth, tmp_path):
    """A PS at DEBUG level over a password-protected Redis, good and bad calls; then a training
    job and its checkpoint against it: neither secret shows anywhere."""
    password = redis_auth.default_password
    proc = make_ps(
        "--auth-token",
        TOKEN,
        "--log-level",
        "DEBUG",
        "--backend",
        redis_auth.url_for(None, password),
        "--namespace",
        "secrets",
    )
    with PSClient(proc.address, auth_token=TOKEN) as ps:
        ps.create_table("t", dim=4)
        ps.push("t", [1, 2], np.ones((2, 4), np.float32))
        ps.pull("t", [1, 2, 3])
        with pytest.raises(PSError):
            ps.pull("nope", [1])
    with PSClient(proc.address, auth_token="wrong-" + TOKEN) as bad, pytest.raises(PSError) as info:
        bad.list_tables()
    assert TOKEN not in str(info.value)
    out = tmp_path / "r.json"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynemb.trainer",
            "--ps",
            proc.address,
            *(
                "--steps 4 --batch-size 16 --universe 500 --capacity-fraction 0.3 "
                "--num-sparse 2 --dim 4 --dense-arch 8,4 --eval-batches 1 --no-progress "
                "--checkpoint-dir"
            ).split(),
            str(tmp_path / "ck"),
            "--checkpoint-at-end",
            "--result-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "DYNEMB_PS_AUTH_TOKEN": TOKEN},
    )
    assert job.returncode == 0, job.stderr[-3000:]
    metrics = proc.metrics_text()
    manifests = "".join(p.read_text() for p in (tmp_path / "ck").glob("*/manifest.json"))
    assert json.loads(out.read_text())["losses"] and manifests
    help_text = dynemb("ps", "serve", "--help", env={"DYNEMB_PS_AUTH_TOKEN": TOKEN}).stdout
    assert "DEBUG" in proc.log() and "UNAUTHENTICATED" in metrics  # it did log, and count the refusal
    for where, text in [
        ("PS log", proc.log()),
        ("metrics", metrics),
        ("trainer output", job.stdout + job.stderr),
        ("checkpoint manifest", manifests),
        ("serve --help", help_text),
    ]:
        assert TOKEN not in text, f"the auth token is in the {where}"
        assert password not in text, f"the Redis password is in the {where}"


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    """A CA that signs the PS's and a client's certificate, and a client certificate from another CA."""
    folder = tmp_path_factory.mktemp("mtls")
    ca, other_ca = trustme.CA(), trustme.CA()
    files = {"ca": folder / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, issuer, identity in [
        ("server", ca, "localhost"),
        ("client", ca, "trainer-0"),
        ("stranger", other_ca, "trainer-0"),
    ]:
        cert = issuer.issue_cert(identity)
        files[name] = folder / f"{name}.pem"
        files[f"{name}_key"] = folder / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(str(files[name]))
        cert.private_key_pem.write_to_path(str(files[f"{name}_key"]))
    return {k: str(v) for k, v in files.items()}


@pytest.mark.slow
def test_mutual_tls_accepts_only_clients_the_ca_signed(make_ps, mtls, tmp_path):
    proc = make_ps("--tls-cert", mtls["server"], "--tls-key", mtls["server_key"], "--tls-client-ca", mtls["ca"])
    address = f"localhost:{proc.port}"
    with PSClient(address, tls_ca=mtls["ca"], tls_cert=mtls["client"], tls_key=mtls["client_key"], timeout=10) as ps:
        ps.create_table("m", dim=2)
        ps.push("m", [7], np.full((1, 2), 7.0, np.float32))
        assert ps.pull("m", [7]).rows.tolist() == [[7.0, 7.0]]
    from dynemb.ps_server.client import RetryPolicy

    for cert, key in [(None, None), (mtls["stranger"], mtls["stranger_key"])]:
        with (
            PSClient(
                address, tls_ca=mtls["ca"], tls_cert=cert, tls_key=key, timeout=5, retry=RetryPolicy(attempts=1)
            ) as ps,
            pytest.raises(PSError) as info,
        ):
            ps.list_tables()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "mutual TLS" in str(info.value)  # the handshake failed: the error says what to check
    with pytest.raises(InvalidArgument, match="needs its private key"):
        PSClient(address, tls_ca=mtls["ca"], tls_cert=mtls["client"])
    # the CLI and the trainer take the same files
    cli = subprocess.run(
        [
            sys.executable,
            *"-m dynemb.cli ps tables --ps".split(),
            address,
            "--tls-ca",
            mtls["ca"],
            "--tls-cert",
            mtls["client"],
            "--tls-key",
            mtls["client_key"],
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert cli.returncode == 0 and "m " in cli.stdout, cli.stderr
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynemb.trainer",
            "--ps",
            address,
            "--ps-tls-ca",
            mtls["ca"],
            "--ps-tls-cert",
            mtls["client"],
            "--ps-tls-key",
            mtls["client_key"],
            *(
                "--steps 3 --batch-size 16 --universe 500 --num-sparse 2 --dim 4 "
                "--dense-arch 8,4 --eval-batches 1 --no-progress"
            ).split(),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "mutual TLS" in proc.log()


def test_mutual_tls_needs_the_ps_certificate(make_ps, mtls):
    proc = make_ps("--tls-client-ca", mtls["ca"], start=False)
    with pytest.raises(RuntimeError, match="needs the PS's own certificate"):
        proc.start(timeout=30)
