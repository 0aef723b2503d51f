"""Who may send a worker or the coordinator what: authorization by role in the current plan.

The transport authenticates every caller (mutual TLS, peer.net.tls) and hands handlers the caller's peer id
in ``Envelope.sender`` / ``FetchRequest.sender``. This module maps the endpoints of an assignment to peer ids
(from the certificates the assignment carries) and answers "is this caller the peer that plays that role?".
A refusal is protocol.errors.Forbidden (gRPC PERMISSION_DENIED) naming the role and the caller; the handler
raises it before touching any state.

An endpoint the assignment gives no certificate for can only be this process itself (in-process tests and
tools, which share one identity): never "anyone".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from tasklet.peer.net.tls import TlsContext, peer_ids
from tasklet.peer.runtime.spec import Assignment
from tasklet.protocol.errors import Forbidden

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Roles:
    """The peer ids behind an assignment's endpoints, as seen by the peer ``me``."""

    me: str
    ids: dict[str, str]  # endpoint -> peer id
    plan: dict[str, tuple[int, int]]  # worker endpoint -> layers, for the whole plan

    @classmethod
    def of(cls, assignment: Assignment, tls: TlsContext | None) -> Roles:
        return cls(tls.peer_id if tls else "", peer_ids(assignment.peers), dict(assignment.plan))

    def peer(self, endpoint: str | None) -> str | None:
        """The peer id at ``endpoint`` (this process's own when the plan names no certificate for it)."""
        if endpoint is None:
            return None
        return self.ids.get(endpoint, self.me)

    def endpoints_of(self, peer_id: str) -> list[str]:
        return [ep for ep in self.plan if self.peer(ep) == peer_id]

    def require(self, caller: str, endpoints: Iterable[str | None], role: str, what: str) -> None:
        """Raise Forbidden unless ``caller`` is the peer at one of ``endpoints`` (``role`` names them)."""
        if not self.me:  # a plaintext transport: nobody is authenticated (benchmark baselines only)
            return
        if caller and any(self.peer(ep) == caller for ep in endpoints if ep is not None):
            return
        raise Forbidden(f"{what} is taken only from {role}; peer {caller or '(unauthenticated)'} is not")

    def require_holder(self, caller: str, layers: tuple[int, int], coordinator: str, what: str) -> None:
        """Raise Forbidden unless the plan gives ``caller`` these layers, or it is the coordinator."""
        holders = [ep for ep, held in self.plan.items() if held == layers]
        self.require(caller, [coordinator, *holders], f"the coordinator or a peer the plan gives layers {list(layers)}",
                     what)
