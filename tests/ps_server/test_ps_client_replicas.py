"""Replica addresses (`a|b`): one shard, several PS processes over the same store."""

from __future__ import annotations

import numpy as np
import pytest

from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument
from dynemb.ps_server.replicas import channel_target


def test_a_single_address_is_left_alone():
    assert channel_target("ps-0.example:50051") == ("ps-0.example:50051", None)


def test_replicas_become_one_target_of_their_ip_addresses():
    target, authority = channel_target("localhost:7001|127.0.0.1:7002")
    assert target.startswith(("ipv4:", "ipv6:"))
    assert target.endswith(":7002") and ":7001," in target
    assert authority == "localhost"  # the name TLS checks the certificate against


@pytest.mark.parametrize("bad", ["127.0.0.1|127.0.0.1:7002", "127.0.0.1:x|127.0.0.1:7002"])
def test_a_replica_without_a_port_is_refused(bad):
    with pytest.raises(InvalidArgument, match="not host:port"):
        channel_target(bad)


def test_a_replica_that_does_not_resolve_is_refused():
    with pytest.raises(InvalidArgument, match="does not resolve"):
        channel_target("127.0.0.1:7001|no-such-host.invalid:7002")


def test_calls_go_to_a_live_replica_when_the_first_is_gone(redis_url, redis_namespace, make_ps):
    first = make_ps("--backend", redis_url, "--namespace", redis_namespace)
    second = make_ps("--backend", redis_url, "--namespace", redis_namespace)
    ids = np.arange(100, dtype=np.int64)
    rows = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    with PSClient(f"{first.address}|{second.address}", timeout=30) as ps:
        ps.create_table("t", dim=4)
        ps.push("t", ids, rows)
        first.close()
        np.testing.assert_array_equal(ps.pull("t", ids).rows, rows)  # served by the second
        ps.push("t", ids, rows + 1)
    with PSClient(second.address) as ps:
        np.testing.assert_array_equal(ps.pull("t", ids).rows, rows + 1)
