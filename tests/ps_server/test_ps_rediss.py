"""A `dynemb ps serve` process over a TLS-only redis-server (rediss://, the CA given in the URL):
rows round-trip and outlive the PS; a CA that did not sign Redis' certificate, or a CA file
that is not there, fails with an error that names the problem."""

from __future__ import annotations

from urllib.parse import quote

import numpy as np
import pytest
import trustme

from dynemb.ps_server.client import PSClient, RetryPolicy
from dynemb.ps_server.errors import Unavailable
from dynemb.ps_server.schema import TableSchema


def with_ca(url: str, ca_file: str) -> str:
    return f"{url}?ssl_ca_certs={quote(ca_file)}"


@pytest.mark.slow
def test_rows_round_trip_through_a_ps_over_tls_redis(redis_tls, redis_namespace, make_ps):
    backend = with_ca(redis_tls.url, redis_tls.ca_file)
    assert backend.startswith("rediss://")
    ps = make_ps("--backend", backend, "--namespace", redis_namespace)
    rng = np.random.default_rng(7)
    ids = rng.choice(1 << 40, size=3000, replace=False).astype(np.int64)
    rows = rng.standard_normal((3000, 6)).astype(np.float16)
    with PSClient(ps.address) as client:
        assert client.stats()[0].backend == "redis"
        client.create_table_from_schema(TableSchema("tls_rows", dim=4, state_width=2, dtype="fp16"))
        assert client.push("tls_rows", ids, rows) == 3000
        got = client.pull("tls_rows", ids)
        assert not got.missing.any() and np.array_equal(got.rows, rows)
    ps.stop()
    # the rows are in Redis: another PS (the URL from the environment this time) finds them
    again = make_ps(env={"DYNEMB_PS_BACKEND": backend, "DYNEMB_NAMESPACE": redis_namespace})
    with PSClient(again.address) as client:
        assert client.describe_table("tls_rows").num_rows == 3000
        exported = dict(zip(*(np.concatenate(part) for part in zip(*client.export("tls_rows")))))
        assert len(exported) == 3000
        assert all(np.array_equal(exported[i], r) for i, r in zip(ids.tolist(), rows))


@pytest.mark.parametrize("ca", ["another CA", "the system's"])
def test_an_untrusted_redis_certificate_is_named(redis_tls, redis_namespace, make_ps, tmp_path, ca):
    if ca == "another CA":
        other = str(tmp_path / "other-ca.pem")
        trustme.CA().cert_pem.write_to_path(other)
        backend = with_ca(redis_tls.url, other)
    else:
        backend = redis_tls.url  # no ssl_ca_certs: the system's CAs, which never signed the test's certificate
    ps = make_ps("--backend", backend, "--namespace", redis_namespace)
    # the PS starts (Redis may come back) and says at once what is wrong
    log = ps.log()
    assert "unreachable: NOT_SERVING" in log and "CERTIFICATE_VERIFY_FAILED" in log
    assert "ssl_ca_certs=" in log and redis_tls.proc.address in log
    with PSClient(ps.address, timeout=5, retry=RetryPolicy(attempts=1)) as client:
        with pytest.raises(Unavailable) as err:
            client.create_table("never", dim=2)
    message = str(err.value)
    assert message.startswith("UNAVAILABLE") and "CERTIFICATE_VERIFY_FAILED" in message
    assert redis_tls.proc.address in message and "give that CA in the backend URL" in message


def test_a_missing_ca_file_stops_the_ps_at_start(redis_tls, make_ps, tmp_path):
    missing = str(tmp_path / "no-such-ca.pem")
    ps = make_ps("--backend", with_ca(redis_tls.url, missing), start=False)
    with pytest.raises(RuntimeError, match="exit 2"):
        ps.start()
    assert f"cannot start the PS: Redis TLS CA certificate ssl_ca_certs='{missing}': no such file" in ps.log()
