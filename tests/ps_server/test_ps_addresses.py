"""PS addresses are checked when given: a malformed one is refused at once, naming it and the form
expected, where gRPC would have taken it and waited out the whole timeout for a PS never there."""

from __future__ import annotations

import time

import pytest

from dynemb.ps_server.addresses import ps_addresses, split_hostport
from dynemb.ps_server.client import PSClient
from dynemb.ps_server.errors import InvalidArgument


@pytest.mark.parametrize(
    "given, shards",
    [
        ("localhost:50051", ["localhost:50051"]),
        (" ps-0.example:1 , 10.0.0.2:65535 ,", ["ps-0.example:1", "10.0.0.2:65535"]),
        ("ps-a:50051|ps-b:50051", ["ps-a:50051|ps-b:50051"]),
        ("[::1]:50051", ["[::1]:50051"]),
        ("[fe80::1%eth0]:50051", ["[fe80::1%eth0]:50051"]),
        ("ps_0:50051", ["ps_0:50051"]),
        ("dynemb-ps.ml.svc.cluster.local.:50051", ["dynemb-ps.ml.svc.cluster.local.:50051"]),
        ("unix:/tmp/ps.sock", ["unix:/tmp/ps.sock"]),
        (["a:1", "b:2"], ["a:1", "b:2"]),
    ],
)
def test_the_forms_a_client_takes(given, shards):
    assert ps_addresses(given) == shards


@pytest.mark.parametrize(
    "given, problem",
    [
        ("localhost:35411x", r"'localhost:35411x' is not host:port \(port '35411x' is not a number from 1 to 65535\)"),
        ("localhost:0", r"port '0' is not a number from 1 to 65535"),
        ("localhost:65536", r"port '65536' is not a number from 1 to 65535"),
        ("localhost", r"'localhost' is not host:port \(no port\)"),
        (":50051", r"\(no host\)"),
        ("a b:1", r"host 'a b' is not a host name or an IP address"),
        ("::1:50051", r"write an IPv6 address in brackets"),
        ("[not v6]:1", r"'\[not v6\]' is not an IPv6 address"),
        ("a:1,b:x", r"'b:x' is not host:port"),
        ("a:1|", r"'a:1\|' has an empty replica"),
        ("redis://localhost:6379", r"a redis:// URL is a PS's store: serve it with `dynemb ps serve --backend"),
        ("http://ps:50051", r"a URL: give the PS's host:port, without a scheme"),
        ("unix:", r"names no socket"),
        (" , ", r"no PS address in"),
    ],
)
def test_a_malformed_address_is_refused_naming_it_and_the_form(given, problem):
    with pytest.raises(InvalidArgument, match=problem) as refused:
        ps_addresses(given)
    message = str(refused.value)
    assert "\n" not in message
    assert "expected" in message and ("host:port" in message or "unix:/path" in message), message


def test_split_hostport_gives_the_host_without_brackets():
    assert split_hostport("[::1]:7") == ("::1", 7)
    assert split_hostport("ps-0:50051") == ("ps-0", 50051)


def test_a_client_refuses_a_malformed_address_before_connecting():
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match="'localhost:35411x' is not host:port"):
        PSClient("localhost:35411x", timeout=30)
    assert time.monotonic() - started < 1.0
