"""Shared-token authentication: every RPC must carry `authorization: Bearer <token>`.

The health service stays open so load balancers and kubelet probes, which carry no
token, can still check the PS.
"""

from __future__ import annotations

import hmac

import grpc

OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this PS requires a token: send metadata 'authorization: Bearer <token>' "
                "(PSClient(auth_token=...), or --auth-token / DYNEMB_PS_AUTH_TOKEN)",
            )

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHODS_PREFIX):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
                break
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        # Answer in the shape the method expects (unary or streaming request).
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(lambda it, ctx: self._deny(None, ctx))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self._deny(req, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)
