"""Shared-token authentication: every RPC must carry `authorization: Bearer <token>`.

Server reflection needs the token too (it describes the service to whoever asks). Health
checking stays open by default, so load balancers and kubelet probes, which carry no token,
can still check the PS; `open_health=False` (`--auth-health`) closes it as well.
The token is never logged: a refusal names what was missing, not what was sent.
"""

from __future__ import annotations

import hmac

import grpc

OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries token; empty when there is no token."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every RPC that does not carry the token (see the module doc).

    Args:
        token: the shared token; must not be empty.
        open_health: let health checks through without the token.
        on_deny: on_deny(method) is told of each refused call (the PS counts them in its metrics).
    """

    def __init__(self, token: str, open_health: bool = True, on_deny=None) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._open_prefix = OPEN_METHODS_PREFIX if open_health else None
        self._on_deny = on_deny

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this PS requires a token: send metadata 'authorization: Bearer <token>' "
                "(PSClient(auth_token=...), or --auth-token / DYNEMB_PS_AUTH_TOKEN)",
            )

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        """The method's handler if the call carries the token, else one that refuses it."""
        if self._open_prefix and handler_call_details.method.startswith(self._open_prefix):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
                break
        handler = continuation(handler_call_details)
        if handler is None:
            # an unknown method is refused like a known one: without the token, nobody
            # learns which methods exist
            return grpc.unary_unary_rpc_method_handler(self._deny)
        if self._on_deny is not None:
            self._on_deny(handler_call_details.method.rsplit("/", 1)[-1])
        # Answer in the shape the method expects (unary or streaming request).
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self._deny(req, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)
