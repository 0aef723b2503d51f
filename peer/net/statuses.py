"""How a peer answers a refused call: the protocol's typed errors as gRPC status codes (peer.net.server's
docstring lists them). Shared by the gRPC server and the bulk lane (peer.net.bulk_server), so that a refusal
reads the same on both."""

from __future__ import annotations

import logging

import grpc

from tasklet.protocol.errors import (
    BadMessage,
    Forbidden,
    PeerUnreachable,
    Refused,
    Rejected,
    TransportError,
    Unauthenticated,
    Unavailable,
)

logger = logging.getLogger(__name__)

ERROR_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (BadMessage, grpc.StatusCode.INVALID_ARGUMENT),
    (Rejected, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
]


class SlotRefusedError(Exception):
    """No stream slot for an admitted stream: the status to answer with (UNAVAILABLE or RESOURCE_EXHAUSTED)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def refusal_of(what: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status answering an exception of a call body: a typed error's code (module docstring), else INTERNAL
    (logged with its traceback). Shared by gRPC calls and the bulk lane (peer.net.bulk_server)."""
    if isinstance(exc, SlotRefusedError):
        return exc.code, str(exc)
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            logger.info("%s refused (%s): %s", what, code.name, exc)
            return code, str(exc)
    logger.error("%s: handler failed", what, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{what}: internal error ({type(exc).__name__}: {exc})"[:500]


UNREACHABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def error_of_status(code: grpc.StatusCode, detail: str, endpoint: str) -> TransportError:
    """The client's typed error for a peer's status: PeerUnreachable when it could not take the call (busy,
    deadline passed, cancelled), Refused (with the peer's message) when it said no."""
    if code in UNREACHABLE_CODES:
        return PeerUnreachable(endpoint, f"{code.name}: {detail}")
    return Refused(code.name, detail, endpoint)
