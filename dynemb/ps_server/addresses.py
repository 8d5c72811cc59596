"""PS addresses as a client takes them, checked when given.

    host:port                   one PS: a host name, an IPv4 address or an [IPv6] one, and a port 1-65535
    host:port,host:port         one PS per shard of the ids
    host:port|host:port         replicas of one shard, over the same store (replicas.py)
    unix:/path/to/socket        one PS on this host, by its socket

Why check here: gRPC takes any string as a channel's target and only fails to connect, so a
mistyped address (`localhost:35411x`) looked like a PS that is down and cost the whole wait for
it; refused here, it costs nothing and the error names it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dynemb.common.errors import shown
from dynemb.ps_server.errors import InvalidArgument

SHARDS, REPLICAS = ",", "|"
UNIX = "unix:"
FORM = "host:port, comma-separated for shards, 'a:port|b:port' for replicas of one shard, or unix:/path"
MAX_PORT = 65535

# a name (a fully qualified one may end in a dot) or an IPv4 address
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?\.?")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")  # inside brackets, with an optional zone


def ps_addresses(given: str | Sequence[str]) -> list[str]:
    """Each shard's address, checked.

    Args:
        given: one string, shards comma-separated, or one string per shard.

    Returns:
        The shards' addresses, stripped (empty ones between commas left out).

    Raises:
        InvalidArgument: no address, or one that is not of the forms above (named, with the form expected).
    """
    parts = given.split(SHARDS) if isinstance(given, str) else list(given)
    shards = [p.strip() for p in parts if p.strip()]
    if not shards:
        raise InvalidArgument(f"no PS address in {shown(given)}: expected {FORM}")
    for shard in shards:
        check_shard(shard)
    return shards


def check_shard(address: str) -> None:
    """Refuse one shard's address unless it is host:port, replicas of it, or unix:/path.

    Raises:
        InvalidArgument: naming the address and what is wrong with it.
    """
    if address.startswith(UNIX) and "://" not in address:
        if not address[len(UNIX) :].strip("/"):
            raise InvalidArgument(f"PS address {shown(address)} names no socket: expected unix:/path/to/socket")
        return
    for replica in address.split(REPLICAS):
        if not replica.strip():
            raise InvalidArgument(f"PS address {shown(address)} has an empty replica: expected {FORM}")
        split_hostport(replica.strip())


def split_hostport(address: str) -> tuple[str, int]:
    """(host, port) of "host:port" ("[v6]:port" too; the host comes without brackets).

    Raises:
        InvalidArgument: not host:port with a host and a port from 1 to 65535, naming what is wrong.
    """
    host, sep, port = address.rpartition(":")
    problem = _problem(address, host if sep else "", port if sep else "")
    if problem:
        raise InvalidArgument(f"PS address {shown(address)} is not host:port ({problem}); expected {FORM}")
    return host.strip("[]"), int(port)


def _problem(address: str, host: str, port: str) -> str:
    """What is wrong with an address split into host and port, or "" for nothing."""
    if "://" in address:
        scheme = address.split("://", 1)[0]
        if scheme.lower().startswith("redis"):
            return (
                f"a {scheme}:// URL is a PS's store: serve it with `dynemb ps serve --backend {scheme}://...` and "
                "give that PS's host:port"
            )
        return "a URL: give the PS's host:port, without a scheme"
    if not host and not port:
        return "no port"
    if not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        return f"port {shown(port)} is not a number from 1 to {MAX_PORT}"
    if host.startswith("[") and host.endswith("]"):
        return "" if _IPV6.fullmatch(host[1:-1]) else f"{shown(host)} is not an IPv6 address"
    if not host:
        return "no host"
    if ":" in host:
        return f"host {shown(host)} has a ':': write an IPv6 address in brackets, [::1]:port"
    return "" if _HOST_NAME.fullmatch(host) else f"host {shown(host)} is not a host name or an IP address"
