"""The fault-injecting proxy itself (dynemb/testing/fault_proxy.py), against an echo server in
this process: what each fault does to bytes and connections, measured, in about a second."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from dynemb.testing.fault_proxy import FaultProxy


class Echo:
    """A TCP echo server on a free loopback port; counts the connections it accepted."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a reset (refuse()) ends it too
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


@pytest.fixture
def echo():
    server = Echo()
    yield server
    server.close()


@pytest.fixture
def proxy(echo):
    with FaultProxy("127.0.0.1", echo.port) as p:
        yield p


def connect(proxy: FaultProxy, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5, source_address=(source, 0))
    return sock


def round_trip(sock: socket.socket, data: bytes) -> float:
    """Seconds from sending `data` to reading it all back."""
    started = time.monotonic()
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        part = sock.recv(65536)
        assert part, "the connection closed"
        got += part
    assert got == data
    return time.monotonic() - started


def nothing_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the socket stays open and silent for `seconds` (no data, no EOF, no reset)."""
    sock.settimeout(seconds)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(5)
    return False


def test_it_forwards_both_ways_and_passes_a_close_on(proxy):
    with connect(proxy) as sock:
        round_trip(sock, b"x" * 300_000)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # the echo server saw the close and closed too
    assert proxy.connections == 1 and proxy.bytes_forwarded == 600_000


def test_a_cut_holds_bytes_and_new_connections_until_heal(proxy, echo):
    with connect(proxy) as sock:
        round_trip(sock, b"before")
        proxy.cut()
        sock.sendall(b"held")
        assert nothing_within(sock, 0.3)  # no reply, and no reset or close: a split, not a crash
        with connect(proxy) as late:  # accepted (the kernel does that), but not forwarded
            late.sendall(b"late")
            assert nothing_within(late, 0.2)
            assert echo.accepted == 1
            proxy.heal()
            assert late.recv(4) == b"late"  # connected on, and what it sent delivered
        assert sock.recv(4) == b"held"
        round_trip(sock, b"after")


def test_a_cut_of_one_peer_lets_the_others_through(proxy):
    with connect(proxy, "127.0.0.2") as cut_off, connect(proxy, "127.0.0.3") as other:
        round_trip(cut_off, b"a")
        proxy.cut(peers=["127.0.0.2"])
        cut_off.sendall(b"b")
        round_trip(other, b"passes")
        assert nothing_within(cut_off, 0.2)
        proxy.heal()
        assert cut_off.recv(1) == b"b"


def test_a_delay_is_added_each_way(proxy):
    with connect(proxy) as sock:
        fast = round_trip(sock, b"ping")
        proxy.delay(0.1)
        slow = round_trip(sock, b"ping")
    assert slow >= 0.2 and slow - fast >= 0.15 and slow < 1.0, (fast, slow)


def test_a_lost_chunk_comes_late_and_in_order(proxy):
    with connect(proxy) as sock:
        proxy.loss(1.0, rto=0.15)  # every chunk lost once: one RTO late each way
        took = round_trip(sock, b"first")
        proxy.loss(0.0)
        fast = round_trip(sock, b"second")
    assert 0.3 <= took < 1.0 and took - fast >= 0.25, (took, fast)


def test_refuse_resets_connections_until_heal(proxy):
    with connect(proxy) as sock:
        round_trip(sock, b"a")
        proxy.refuse()
        with pytest.raises(ConnectionResetError):
            sock.recv(1)
    # the reset may come before connect() returns, or at the send, or at the read
    with pytest.raises((ConnectionResetError, BrokenPipeError)), connect(proxy) as refused:
        refused.sendall(b"x")
        refused.recv(1)
    proxy.heal()
    with connect(proxy) as sock:
        round_trip(sock, b"again")


def test_bad_settings_are_refused(proxy):
    with pytest.raises(ValueError):
        proxy.delay(-1)
    with pytest.raises(ValueError):
        proxy.loss(1.5)


def test_a_lost_chunk_waits_a_round_trip_and_an_rto(proxy):
    with connect(proxy) as sock:
        proxy.delay(0.05)
        proxy.loss(1.0, rto=0.1)  # each way: 50 ms, then lost: a 100 ms round trip + 100 ms more
        took = round_trip(sock, b"x")
    assert 0.5 <= took < 1.2, took
