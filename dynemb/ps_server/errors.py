"""Errors the parameter server raises, each tied to the gRPC status it travels as.

Backends and validation raise these; the service turns them into a status with the
message intact, so the client sees exactly what was wrong.
"""

from __future__ import annotations

import grpc


class PSError(Exception):
    """Base of every error the PS reports to a client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(PSError, ValueError):
    """A request the PS refuses as it is: a bad name, shape, dtype, size or value, named."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class TableNotFound(PSError, KeyError):
    """No table of that name on the PS."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "table not found"


class TableExists(PSError):
    """A table of that name exists with another schema (creating it again with the same one is fine)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(PSError):
    """Over a limit of the PS (message size, rows per request, shared memory); the message names it."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class BackendUnavailable(PSError):
    """The store behind the PS (Redis) is down or refused us; retrying may help."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PSError):
    """Raised by the client when a call did not succeed within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Abandoned(PSError):
    """The client gave up on the call (deadline passed, cancelled) before it was written."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(PSError):
    """A call without the PS's token, or with another one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class SegmentUnusable(PSError):
    """Same-host row transfer (shm.py) cannot use this memory: a segment the PS cannot map
    (another host, not a sealed memfd, a wrong token) or one it no longer has attached."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(PSError):
    """Raised by the client when a PS stayed unreachable through every retry."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: TableNotFound,
    grpc.StatusCode.ALREADY_EXISTS: TableExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: SegmentUnusable,
}


def from_rpc_error(err: grpc.RpcError, address: str = "") -> PSError:
    """The client-side exception for a failed call, keeping the server's message."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    where = f" (PS {address})" if address else ""
    cls = _BY_CODE.get(code, PSError)
    exc = cls(f"{code.name}: {details}{where}")
    exc.code = code
    return exc
