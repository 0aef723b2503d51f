"""Typed errors of the wire protocol and the transport.

Two families:

* raised by code that *receives* a message (decoders, request handlers): `BadMessage` (the message is
  malformed: wrong dtype, shape, size, version, non-finite values), `Rejected` (well-formed but not
  acceptable in the receiver's current state, e.g. an unknown step), `Unavailable` (the receiver cannot take
  it right now, try later). The transport server turns them into gRPC status codes INVALID_ARGUMENT,
  FAILED_PRECONDITION and UNAVAILABLE.
* raised to code that *sends* (the transport client): `Refused` (the peer answered and said no; carries the
  peer's message and the gRPC code) and `PeerUnreachable` (no answer in time, or the peer is down or busy).

Every message is one line that names the offending field, so it can be shown to a user as is.
"""

from __future__ import annotations


class BadMessage(ValueError):  # noqa: N818 - names fixed by the API contract
    """A message from the network is malformed; `field` names the offending field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Rejected(Exception):  # noqa: N818 - names fixed by the API contract
    """A well-formed message that the receiver cannot accept in its current state (unknown step, stale
    epoch, duplicate commit, ...)."""


class Forbidden(Exception):  # noqa: N818 - named like its siblings
    """The authenticated caller may not do this (wrong role in the current plan): PERMISSION_DENIED."""


class Unauthenticated(Exception):  # noqa: N818 - named like its siblings
    """The caller's identity is not (or no longer) trusted here: UNAUTHENTICATED."""


class Unavailable(Exception):  # noqa: N818 - names fixed by the API contract
    """The receiver cannot accept the message right now (not ready yet, shutting down); retrying may work."""


class TransportError(Exception):
    """Base of the errors a transport client raises."""


class Refused(TransportError):  # noqa: N818 - names fixed by the API contract
    """The peer received the call and refused it. `code` is the gRPC status code name (e.g.
    "INVALID_ARGUMENT"), `detail` the peer's own one-line explanation."""

    def __init__(self, code: str, detail: str, endpoint: str = "") -> None:
        where = f" by {endpoint}" if endpoint else ""
        super().__init__(f"refused{where} ({code}): {detail}")
        self.code = code
        self.detail = detail
        self.endpoint = endpoint


class PeerUnreachable(TransportError):  # noqa: N818 - names fixed by the API contract
    """The peer did not answer in time, is down, or is too busy to take the call."""

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"peer {endpoint} unreachable: {detail}")
        self.endpoint = endpoint
        self.detail = detail


class Backpressure(PeerUnreachable):
    """Too many pushes to this peer are still in flight and none finished before the caller's deadline."""
