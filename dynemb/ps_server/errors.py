"""Errors the parameter server raises, each tied to the gRPC status it travels as.

Backends and validation raise these; the service turns them into a status with the
message intact, so the client sees exactly what was wrong.
"""

from __future__ import annotations

import grpc


class PSError(Exception):
    """Base of every error the PS reports to a client.

    `code` is the gRPC status it travels as; a subclass names its own in the class statement:
    `class TableExists(PSError, code=grpc.StatusCode.ALREADY_EXISTS)`.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code


class InvalidArgument(PSError, ValueError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """A request the PS refuses as it is: a bad name, shape, dtype, size or value, named."""


class TableNotFound(PSError, KeyError, code=grpc.StatusCode.NOT_FOUND):
    """No table of that name on the PS."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "table not found"


class TableExists(PSError, code=grpc.StatusCode.ALREADY_EXISTS):
    """A table of that name exists with another schema (creating it again with the same one is fine)."""


class ResourceExhausted(PSError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """Over a limit of the PS (message size, rows per request, shared memory); the message names it."""


class BackendUnavailable(PSError, code=grpc.StatusCode.UNAVAILABLE):
    """The store behind the PS (Redis) is down or refused us; retrying may help."""


class ShuttingDown(PSError, code=grpc.StatusCode.UNAVAILABLE):
    """The PS is draining (SIGTERM) and takes no new calls; the client retries them, on this
    address once the PS is back or on another replica."""


class DeadlineExceeded(PSError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    """A call did not succeed within its deadline (raised by the client; by the PS for work it stopped)."""


class Abandoned(PSError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    """The client gave up on the call (deadline passed, cancelled) before it was written."""


class Unauthenticated(PSError, code=grpc.StatusCode.UNAUTHENTICATED):
    """A call without the PS's token, or with another one."""


class SegmentUnusable(PSError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """Same-host row transfer (shm.py) cannot use this memory: a segment the PS cannot map
    (another host, not a sealed memfd, a wrong token) or one it no longer has attached."""


class ReadOnly(PSError, code=grpc.StatusCode.PERMISSION_DENIED):
    """A write to a PS that serves published tables read only (`dynemb ps serve --read-only`)."""


class Contended(PSError, code=grpc.StatusCode.UNAVAILABLE):
    """The store kept changing under a call (other PSes creating, dropping or publishing the same
    table) for the few tries the PS makes itself: UNAVAILABLE, so that the client tries again
    until its own deadline rather than give up at once."""


class DataLoss(PSError, code=grpc.StatusCode.DATA_LOSS):
    """The store lost what this PS saw it hold (a Redis restarted empty, an empty replica
    promoted): the PS refuses to serve it, or to create tables anew in it, until restarted."""


class Unavailable(PSError, code=grpc.StatusCode.UNAVAILABLE):
    """Raised by the client when a PS stayed unreachable through every retry."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: TableNotFound,
    grpc.StatusCode.ALREADY_EXISTS: TableExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: SegmentUnusable,
    grpc.StatusCode.PERMISSION_DENIED: ReadOnly,
    grpc.StatusCode.DATA_LOSS: DataLoss,
}


def from_rpc_error(err: grpc.RpcError, address: str = "") -> PSError:
    """The client-side exception for a failed call, keeping the server's message.

    Args:
        err: the failed call's error.
        address: the PS called, named in the message where given.

    Returns:
        The PSError subclass for the call's status (PSError itself for others), its `code` the status.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    where = f" (PS {address})" if address else ""
    cls = _BY_CODE.get(code, PSError)
    exc = cls(f"{code.name}: {details}{where}")
    exc.code = code
    return exc
