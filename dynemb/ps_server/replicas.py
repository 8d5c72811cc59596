"""Replicas: one shard served by several PS processes over the same store (Redis).

A client address `host1:50051|host2:50051` names the replicas of one shard. They become one
gRPC channel whose target lists every replica's IP addresses (`ipv4:a:p,b:p`); gRPC's
pick_first policy keeps to the first replica that answers and, when it goes away, connects
to the next by itself, so the client's retries on UNAVAILABLE land on a live replica. (A
Kubernetes Service in front of the replicas does the same with one address.)

Host names are resolved once, when the client is made.
"""

from __future__ import annotations

import socket

from dynemb.common.errors import shown
from dynemb.ps_server.addresses import REPLICAS, split_hostport
from dynemb.ps_server.errors import InvalidArgument


def channel_target(address: str) -> tuple[str, str | None]:
    """(gRPC target, authority to present for TLS or None) of one shard's address."""
    replicas = [a.strip() for a in address.split(REPLICAS) if a.strip()]
    if len(replicas) <= 1:
        return (replicas[0] if replicas else address), None
    ipv4: list[str] = []
    ipv6: list[str] = []
    for replica in replicas:
        host, port = split_hostport(replica)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise InvalidArgument(
                f"PS replica {shown(replica)} of {shown(address)} does not resolve: {exc.strerror}"
            ) from None
        for family, _, _, _, sockaddr in infos:
            if family == socket.AF_INET and f"{sockaddr[0]}:{port}" not in ipv4:
                ipv4.append(f"{sockaddr[0]}:{port}")
            elif family == socket.AF_INET6 and f"[{sockaddr[0]}]:{port}" not in ipv6:
                ipv6.append(f"[{sockaddr[0]}]:{port}")
    # one target lists one address family; IPv4 where every replica has one
    target = "ipv4:" + ",".join(ipv4) if ipv4 else "ipv6:" + ",".join(ipv6)
    # TLS checks the certificate against the first replica's name (replicas share a certificate)
    return target, split_hostport(replicas[0])[0]
