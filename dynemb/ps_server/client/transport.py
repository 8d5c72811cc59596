"""The client's connection to its PSes: one gRPC channel per shard address, TLS and the token, and calls made
with retries inside a deadline (retry.py).

- An address `a|b` names replicas of one shard (replicas.py): one channel that fails over between them.
- Pull and PullMany replies are read in place and Push and PushMany requests go out pre-serialized (wire.py): the
  stubs' methods for them are replaced by ones that take and give bytes, the same RPCs without protobuf's copies
  of the rows.
- `fanout` sends one request to each of several PSes at once and waits for all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynemb.protos import ps_pb2, ps_pb2_grpc
from dynemb.ps_server.auth import bearer_metadata
from dynemb.ps_server.client.retry import Attempts, CallWatch, RetryPolicy
from dynemb.ps_server.errors import DeadlineExceeded, InvalidArgument, PSError, SegmentUnusable, from_rpc_error
from dynemb.ps_server.replicas import channel_target

log = logging.getLogger("dynemb.ps.client")

# How often a channel to a PS that is away tries to connect again: a PS back is used within it
RECONNECT_BACKOFF_MS = 1000
# The stub methods that carry bytes (wire.py): name -> (request serializer, response deserializer)
_BYTES_METHODS = {
    "Pull": (ps_pb2.PullRequest.SerializeToString, None),
    "PullMany": (ps_pb2.PullManyRequest.SerializeToString, None),
    "Push": (bytes, ps_pb2.PushResponse.FromString),
    "PushMany": (bytes, ps_pb2.PushManyResponse.FromString),
}


def read_pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes, read from the file when given a path.

    Args:
        value: a file path, the PEM bytes themselves, or None.

    Returns:
        The PEM bytes, or None.

    Raises:
        InvalidArgument: the file cannot be read.
    """
    if isinstance(value, str):
        try:
            with open(value, "rb") as f:
                return f.read()
        except OSError as exc:
            raise InvalidArgument(f"cannot read TLS file {value}: {exc.strerror}") from None
    return value


def tls_credentials(
    tls: bool | None, tls_ca: str | bytes | None, tls_cert: str | bytes | None, tls_key: str | bytes | None
) -> tuple[grpc.ChannelCredentials | None, str | None]:
    """The channel credentials for these TLS settings (see PSClient), and what to check when a call fails over TLS.

    Returns:
        (credentials, hint), both None without TLS.

    Raises:
        InvalidArgument: a client certificate without its key or the other way round, or a file that cannot be read.
    """
    if bool(tls_cert) != bool(tls_key):
        raise InvalidArgument(
            "a client certificate (tls_cert) needs its private key (tls_key), and the other way round"
        )
    if not (tls if tls is not None else (tls_ca is not None or tls_cert is not None)):
        return None, None
    hint = (
        "over TLS: check that the PS's certificate is signed by the CA given (tls_ca) and names the address used, "
        "and whether the PS wants a client certificate (mutual TLS: "
        + ("is this one signed by the CA it trusts?)" if tls_cert else "give tls_cert and tls_key)")
    )
    creds = grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls_ca), private_key=read_pem(tls_key), certificate_chain=read_pem(tls_cert)
    )
    return creds, hint


def _channel(address: str, creds, options: list, tls_server_name: str | None) -> grpc.Channel:
    """One shard's channel; `a|b` (replicas) fails over between them."""
    target, authority = channel_target(address)
    if authority is not None and creds is not None and not tls_server_name:
        options = [*options, ("grpc.ssl_target_name_override", authority)]
    if creds is not None:
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def _how_long_retried(tries: Attempts) -> str:
    """For the log line of a call's first retry: until when it is tried again."""
    left = max(tries.deadline - time.monotonic(), 0.0)
    if tries.policy.attempts is None:
        return f"until its deadline, {left:.0f} s from now"
    return f"up to {tries.policy.attempts - 1} times within {left:.0f} s"


def _what_was_tried(tries: Attempts) -> str:
    """For a call's final error: its tries, their time, and what ended them."""
    n = tries.tries()
    ended = (
        f"the retry policy's limit of {tries.policy.attempts}"
        if tries.policy.attempts is not None and n >= tries.policy.attempts
        else "the call's deadline"
    )
    return f"{n} {'try' if n == 1 else 'tries'} over {tries.seconds():.1f} s, until {ended}"


def _stub(channel: grpc.Channel) -> ps_pb2_grpc.ParameterServerStub:
    """The channel's ParameterServer stub, its row-carrying methods taking and giving bytes."""
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    for name, (serializer, deserializer) in _BYTES_METHODS.items():
        rpc = channel.unary_unary(
            f"/dynemb.ps.v1.ParameterServer/{name}", request_serializer=serializer, response_deserializer=deserializer
        )
        setattr(stub, name, rpc)
    return stub


class Transport:
    """Channels and stubs to each shard's PS, and calls to them.

    Args:
        addresses: one per shard, `host:port` or replicas `host:port|host:port`.
        retry: how a failed unary call is tried again.
        auth_token: sent as `authorization: Bearer <token>` on every call, health checks included.
        tls, tls_ca, tls_cert, tls_key, tls_server_name: as PSClient's.
        max_message_bytes: the largest message sent or received.
        watch: told of every unary call's start, retries and end (a trainer's metrics read it).

    Raises:
        InvalidArgument: unusable TLS settings, or replicas that do not resolve.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        retry: RetryPolicy,
        auth_token: str | None = None,
        tls: bool | None = None,
        tls_ca: str | bytes | None = None,
        tls_cert: str | bytes | None = None,
        tls_key: str | bytes | None = None,
        tls_server_name: str | None = None,
        max_message_bytes: int = 64 << 20,
        watch: CallWatch | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.retry = retry
        self.watch = watch
        self.metadata = bearer_metadata(auth_token)
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC's reconnect backoff grows to 120 s while a PS is away, and calls fail at once
            # without trying to connect until it has passed: a PS back after 90 s was answered
            # 19 s later (issue 34 saw ~50 s). Tries to connect once a second at most instead (not
            # min_reconnect_backoff_ms: that is also how long one connect may take, 20 s, kept
            # for slow links).
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        creds, self._tls_hint = tls_credentials(tls, tls_ca, tls_cert, tls_key)
        self.channels = [_channel(a, creds, options, tls_server_name) for a in self.addresses]
        # a stub's methods are looked up at each call, not bound once: one can be swapped (tests watch calls so)
        self.stubs = [_stub(c) for c in self.channels]

    def error(self, err: grpc.RpcError, shard: int) -> PSError:
        """The PSError for a failed call to a shard's PS, naming its address."""
        exc = from_rpc_error(err, self.addresses[shard])
        # a failed TLS handshake reaches gRPC's Python side as a bare "socket closed"
        if self._tls_hint and err.code() == grpc.StatusCode.UNAVAILABLE:
            exc.args = (f"{exc.args[0]}; {self._tls_hint}",)
        return exc

    def _final(self, last: grpc.RpcError, cause: grpc.RpcError | None, shard: int, tries: Attempts) -> PSError:
        """The error of a call whose tries ran out: the last try's, and where that one only ran
        out of time, the reason an earlier try gave (a PS that answered "Redis is away" before
        it stopped answering in time), and what the call did, so the one line says what failed."""
        exc = self.error(last, shard)
        if cause is not None and cause is not last and last.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            exc.args = (f"{exc.args[0]}; the try before: {self.error(cause, shard).args[0]}",)
        if tries.retryable(last.code()) or tries.retries:
            exc.args = (f"{exc.args[0]}; {_what_was_tried(tries)}",)
        return exc

    def back_off(self, tries: Attempts, err: grpc.RpcError, what: str, shard: int, doing: str) -> bool:
        """After a try that failed with err: False if the retry policy says to stop; else the retry
        counted (watch), its first logged (one line per call, not per try: "<what> PS <address>:
        <code>; <doing> <until when>"), and the backoff slept, then True."""
        delay = tries.next_delay(err.code())
        if delay is None:
            return False
        if self.watch is not None:
            self.watch.retried()
        if tries.retries == 1:
            log.warning(
                "%s PS %s: %s; %s %s", what, self.addresses[shard], err.code().name, doing, _how_long_retried(tries)
            )
        time.sleep(delay)
        return True

    def call(
        self,
        shard: int,
        method: str,
        request,
        deadline: float,
        *,
        tries: Attempts | None = None,
        sent: grpc.Future | None = None,
    ):
        """One unary RPC to one PS, tried again as the retry policy says until the deadline.

        Args:
            shard: which PS.
            method: the RPC's name (Pull, CreateTable...).
            request: its request message (bytes for Push and PushMany).
            deadline: when the call must be done, in time.monotonic() seconds.
            tries: the call's Attempts when already started (fanout), else a new one.
            sent: a try already sent (a grpc future), whose outcome counts as the first.

        Returns:
            The RPC's response.

        Raises:
            PSError: the PS's error, or the last try's when none succeeded (DeadlineExceeded when time ran out).
        """
        if tries is None:
            tries = self.retry.start(deadline)
        if self.watch is None:
            return self._call(shard, method, request, deadline, tries, sent)
        self.watch.started(tries)
        failed = True
        try:
            reply = self._call(shard, method, request, deadline, tries, sent)
            failed = False
            return reply
        except SegmentUnusable:  # tried again by the caller (rows.py), with a new segment or as bytes
            failed = False
            self.watch.retried()
            raise
        finally:
            self.watch.ended(tries, failed)

    def _call(self, shard: int, method: str, request, deadline: float, tries: Attempts, sent: grpc.Future | None):
        """`call`'s tries."""
        last: grpc.RpcError | None = None
        cause: grpc.RpcError | None = None  # the last try that failed with a reason of its own
        while True:
            try:
                if sent is not None:
                    attempt, sent = sent, None
                    return attempt.result()
                if tries.expired():
                    if last is not None:  # a wait between tries overran the deadline: the last try says why
                        raise self._final(last, cause, shard, tries)
                    raise DeadlineExceeded(
                        f"DEADLINE_EXCEEDED: {method} to PS {self.addresses[shard]} did not succeed in time; "
                        f"{_what_was_tried(tries)}"
                    )
                rpc = getattr(self.stubs[shard], method)
                return rpc(request, timeout=tries.timeout(), metadata=self.metadata)
            except grpc.RpcError as err:
                last = err
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    cause = err
                if not self.back_off(tries, err, f"{method} to", shard, "retrying"):
                    raise self._final(err, cause, shard, tries) from None

    def fanout(self, method: str, calls: Sequence[tuple[int, object]], deadline: float) -> list:
        """Several unary RPCs of one method, all sent at once, each retried as `call` does.

        Args:
            method: the RPC's name.
            calls: (shard, request) pairs.
            deadline: when every call must be done, in time.monotonic() seconds.

        Returns:
            The responses, in the order of calls.

        Raises:
            PSError: the first failed call's error, in the order of calls.
        """
        if len(calls) == 1:
            shard, request = calls[0]
            return [self.call(shard, method, request, deadline)]
        tries = [self.retry.start(deadline) for _ in calls]
        sent = [
            getattr(self.stubs[shard], method).future(request, timeout=t.timeout(), metadata=self.metadata)
            for (shard, request), t in zip(calls, tries)
        ]
        return [
            self.call(shard, method, request, deadline, tries=t, sent=f)
            for (shard, request), t, f in zip(calls, tries, sent)
        ]

    def to_every_shard(self, method: str, request, deadline: float) -> list:
        """The same request to every PS at once (`fanout`); the responses in shard order."""
        return self.fanout(method, [(shard, request) for shard in range(len(self.addresses))], deadline)

    def send_once(self, shard: int, method: str, request, timeout: float) -> grpc.Future:
        """A unary RPC sent and not waited on, nor retried; its grpc future."""
        return getattr(self.stubs[shard], method).future(request, timeout=timeout, metadata=self.metadata)

    def stream_to(self, shard: int, method: str, requests: Iterable, timeout: float | None) -> grpc.Future:
        """A client-streaming RPC fed from requests, sent once (an iterator cannot be replayed: streaming.py
        reopens an Import itself); its future.

        Its outcome is read with `result`.
        """
        return getattr(self.stubs[shard], method).future(requests, timeout=timeout or None, metadata=self.metadata)

    def stream_from(
        self, shard: int, method: str, request, timeout: float | None, retry_seconds: float = 0.0
    ) -> Iterator:
        """The responses of a server-streaming RPC. A stream that fails as a unary call is retried (UNAVAILABLE)
        before its first response is opened again, after the same backoffs, until its deadline, or for
        retry_seconds where it has none; one that fails later is not: what it gave cannot be taken back, and a new
        stream (no resume point in the protocol) would give it again.

        Raises:
            PSError: the call failed, at the start (after its retries) or part way through.
        """
        deadline = time.monotonic() + timeout if timeout else None
        tries: Attempts | None = None
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            call = getattr(self.stubs[shard], method)(request, timeout=left, metadata=self.metadata)
            given = 0
            try:
                for response in call:
                    given += 1
                    yield response
                return
            except grpc.RpcError as err:
                if given:
                    exc = self.error(err, shard)
                    exc.args = (
                        f"{exc.args[0]}; the {method} stream failed after {given} responses and is not opened again "
                        f"(a new one would repeat them): call it again",
                    )
                    raise exc from None
                if tries is None:
                    tries = self.retry.start(deadline if deadline is not None else time.monotonic() + retry_seconds)
                if not self.back_off(tries, err, f"{method} stream from", shard, "opening it again"):
                    raise self._final(err, err, shard, tries) from None
            finally:
                call.cancel()  # a no-op once it ended; a reader that stopped early ends it here

    def health(self, timeout: float, service: str = "") -> list[str]:
        """Each PS's health status name (SERVING, NOT_SERVING...) for `service`, or the error reaching it."""
        out = []
        for address, channel in zip(self.addresses, self.channels):
            try:
                # with the token: a PS run with --auth-health wants it on health checks too
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self.metadata
                )
                out.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.RpcError as err:
                out.append(f"{err.code().name}: {err.details()} ({address})")
        return out

    def close(self) -> None:
        """Close every channel."""
        for channel in self.channels:
            channel.close()
