"""A fault-injecting TCP proxy for tests: put it between two processes (a trainer and its PS, a
PS and Redis, two Redis Cluster nodes) and cut, delay or slow the link from the test.

    with FaultProxy("127.0.0.1", redis.port) as link:      # the PS gets redis://{link.address}/0
        ...
        link.cut()        # a network split: connections stay open, nothing gets through
        link.heal()       # what was held is delivered, in order, and traffic flows again
        link.delay(0.2)   # 200 ms more each way
        link.loss(0.05)   # 5% of chunks retransmitted after an RTO (TCP never shows a loss)

It runs in the test's own process (threads: one accepting, two per direction of each
connection), needs no privileges and no other binary, so it runs unprivileged in CI on 2 cores.
Network namespaces with `ip netns` and `tc netem` would be closer to a real network but need
root (or user namespaces that CI containers often forbid) and a process per namespace.

Why written here: no maintained library on PyPI does this in-process. toxiproxy, the usual
tool, is a Go server; its Python packages (toxiproxy-python 0.1.1, 2019; chaostoolkit-toxiproxy)
are clients of that server, whose binary is on no registry this project installs from and
would have to be built from source in every CI run. The in-process proxies there are
(maproxy 2016, tcp-proxy-server 2021, pproxy) forward without faults, and
pytest-asyncio-network-simulator (0.1.0a2, 2018) simulates asyncio transports, not sockets
that other processes connect to.

How each fault looks to the two ends, as a real network's would:
- cut(): a split. TCP keeps connections open through one (nothing is sent to end them, no RST),
  so the proxy keeps them open too and holds what either end sends; new connections are
  accepted (the kernel completes the handshake before the proxy sees it) but not forwarded.
  heal() delivers what was held, as TCP's retransmissions would once the path is back.
  `peers` cuts only the connections that come from those source IPs (every 127.0.0.0/8 address
  is this host on Linux, so processes bound to 127.0.0.2, 127.0.0.3... are told apart).
- refuse(): the far end's port is closed: current connections are reset and new ones are reset
  as soon as accepted (a client sees ECONNRESET where a closed port gives ECONNREFUSED; gRPC and
  redis-py treat both as the server being unreachable).
- delay(s): each chunk read is forwarded s seconds later, each way (latency, not bandwidth: chunks
  behind it are not held up further).
- loss(f): TCP retransmits a lost segment, so an application never sees bytes go missing: it sees
  them late. A chunk (one read, up to 64 KiB) is "lost" with probability f and then held one
  retransmission timeout longer: Linux's, the round trip (2 x the delay set) plus `rto` (its
  minimum of 200 ms), and the chunks behind it wait for it (TCP delivers in order). Per chunk,
  not per 1.5 KB segment: a big chunk is no likelier to be hit than a small one.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Iterable

log = logging.getLogger("dynemb.testing.fault_proxy")

CHUNK = 64 * 1024  # bytes read at a time from either end
WINDOW = 4 << 20  # bytes held per direction before the proxy stops reading (as a full TCP window)
CONNECT_TIMEOUT = 5.0  # seconds to reach the target once a connection may be forwarded


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a host whose port is closed answers."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)  # wakes a thread blocked reading it; sends nothing
    with contextlib.suppress(OSError):
        sock.close()


class _Pipe:
    """One direction of a connection: chunks read from src, held until due, written to dst."""

    def __init__(self, link: _Link, src: socket.socket, dst: socket.socket, name: str) -> None:
        self.link = link
        self.src, self.dst = src, dst
        self.name = name
        self.chunks: collections.deque[tuple[float, bytes]] = collections.deque()  # (due, data); b"": EOF
        self.held = 0  # bytes in chunks
        self.last_due = 0.0

    def read(self) -> None:
        proxy = self.link.proxy
        while True:
            with proxy._cond:
                # a cut end's bytes stay in its kernel buffers, as a far end that hears nothing
                while not self.link.done and (proxy._is_cut(self.link.peer) or self.held >= WINDOW):
                    proxy._cond.wait()
                if self.link.done:
                    return
            try:
                data = self.src.recv(CHUNK)
            except OSError:
                data = b""
            with proxy._cond:
                due = time.monotonic() + proxy._delay
                if data and proxy._loss and proxy._rng.random() < proxy._loss:
                    due += 2 * proxy._delay + proxy._rto  # sent again a round trip + RTO later
                self.last_due = due = max(due, self.last_due)  # in order: none overtakes a held one
                self.chunks.append((due, data))
                self.held += len(data)
                proxy._cond.notify_all()
            if not data:
                return

    def write(self) -> None:
        proxy = self.link.proxy
        while True:
            with proxy._cond:
                while True:
                    if self.link.done:
                        return
                    wait: float | None = None
                    if self.chunks and not proxy._is_cut(self.link.peer):
                        wait = self.chunks[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                    proxy._cond.wait(wait)
                _, data = self.chunks.popleft()
                self.held -= len(data)
                proxy._cond.notify_all()
            try:
                if not data:  # the source closed its side: pass the half-close on
                    self.dst.shutdown(socket.SHUT_WR)
                    self.link.half_closed()
                    return
                self.dst.sendall(data)
            except OSError:
                self.link.close()
                return
            with proxy._cond:
                proxy.bytes_forwarded += len(data)


class _Link:
    """One accepted connection and its connection to the target."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, peer: str) -> None:
        self.proxy = proxy
        self.client = client
        self.peer = peer
        self.upstream: socket.socket | None = None
        self.done = False
        self._open_directions = 2
        self._lock = threading.Lock()

    def run(self) -> None:
        """Wait until the link may carry traffic, connect to the target, and pump both ways."""
        proxy = self.proxy
        with proxy._cond:
            while not self.done and proxy._is_cut(self.peer):
                proxy._cond.wait()
            if self.done:
                return
        try:
            upstream = socket.create_connection(proxy.target, timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            log.debug("fault proxy %s: target %s:%d unreachable: %s", proxy.address, *proxy.target, exc)
            self.close(reset=True)
            return
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self.done:
                upstream.close()
                return
            self.upstream = upstream
        pipes = [_Pipe(self, self.client, upstream, "up"), _Pipe(self, upstream, self.client, "down")]
        for pipe in pipes:
            for work in (pipe.read, pipe.write):
                threading.Thread(target=work, name=f"fault-proxy-{pipe.name}", daemon=True).start()

    def half_closed(self) -> None:
        """One direction has ended; once both have, the link is closed."""
        with self._lock:
            self._open_directions -= 1
            last = self._open_directions == 0
        if last:
            self.close()

    def close(self, reset: bool = False) -> None:
        """End the link: its threads stop, both sockets close (with RST if reset)."""
        with self._lock:
            if self.done:
                return
            self.done = True
            socks = [s for s in (self.client, self.upstream) if s is not None]
        for sock in socks:
            if reset:
                _reset(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        with self.proxy._cond:
            self.proxy._links.discard(self)
            self.proxy._cond.notify_all()


class FaultProxy:
    """A TCP proxy on a free port of `host` that forwards to target_host:target_port, with faults
    switched on and off from the test (module doc).

    Args:
        target_host: where connections are forwarded.
        target_port: its port.
        host: the loopback address to listen on (another 127.x.y.z keeps nodes apart).
        port: the port to listen on; 0 picks a free one.
        seed: seed of the losses' random draws (a test that counts them can repeat itself).

    Faults last until heal() (which ends them all) or until set again; close() (or the `with`
    block's end) stops the proxy and closes every connection through it.
    """

    def __init__(
        self, target_host: str, target_port: int, *, host: str = "127.0.0.1", port: int = 0, seed: int = 0
    ) -> None:
        self.target = (target_host, target_port)
        self._cond = threading.Condition()
        self._cut_all = False
        self._cut_peers: frozenset[str] = frozenset()
        self._refusing = False
        self._delay = 0.0
        self._loss = 0.0
        self._rto = 0.2
        self._rng = random.Random(seed)
        self._links: set[_Link] = set()
        self._closed = False
        self.connections = 0  # accepted so far
        self.bytes_forwarded = 0  # written to either end so far
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self.host, self.port = self._listener.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        """host:port that clients connect to instead of the target."""
        return f"{self.host}:{self.port}"

    # -- faults -----------------------------------------------------------------------

    def cut(self, peers: Iterable[str] | None = None) -> None:
        """Hold every byte either way (and forward no new connection) until heal().

        Args:
            peers: source IPs whose connections are cut (others pass); None: every connection.
        """
        with self._cond:
            if peers is None:
                self._cut_all = True
            else:
                self._cut_peers = frozenset(str(ipaddress.ip_address(p)) for p in peers)
            self._cond.notify_all()

    def refuse(self) -> None:
        """Reset every connection now and each new one as it comes, until heal()."""
        with self._cond:
            self._refusing = True
            links = list(self._links)
        for link in links:
            link.close(reset=True)

    def delay(self, seconds: float) -> None:
        """Forward each chunk `seconds` after it was read, each way (0: no delay).

        Raises:
            ValueError: seconds is negative.
        """
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds}")
        with self._cond:
            self._delay = float(seconds)
            self._cond.notify_all()

    def loss(self, fraction: float, rto: float = 0.2) -> None:
        """Hold a `fraction` of chunks one retransmission timeout longer: the round trip (2 x the
        delay) + `rto` seconds (module doc).

        Raises:
            ValueError: fraction outside [0, 1] or rto negative.
        """
        if not 0.0 <= fraction <= 1.0 or rto < 0:
            raise ValueError(f"loss needs 0 <= fraction <= 1 and rto >= 0, got {fraction}, {rto}")
        with self._cond:
            self._loss, self._rto = float(fraction), float(rto)
            self._cond.notify_all()

    def heal(self) -> None:
        """End every fault: held bytes are delivered (in order), new connections forwarded."""
        with self._cond:
            self._cut_all, self._cut_peers, self._refusing = False, frozenset(), False
            self._delay = self._loss = 0.0
            self._cond.notify_all()

    def _is_cut(self, peer: str) -> bool:
        return self._cut_all or peer in self._cut_peers

    # -- running ----------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, (peer, _) = self._listener.accept()
            except OSError:
                return  # closed
            with self._cond:
                if self._closed:
                    _reset(client)
                    return
                self.connections += 1
                if self._refusing:
                    _reset(client)
                    continue
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                link = _Link(self, client, peer)
                self._links.add(link)
            threading.Thread(target=link.run, name="fault-proxy-link", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and close every connection (their held bytes are dropped)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            links = list(self._links)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        self._listener.close()
        for link in links:
            link.close()
        self._acceptor.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultProxy({self.address} -> {self.target[0]}:{self.target[1]})"
