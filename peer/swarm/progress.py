"""The progress board: the leader's latest step, loss and state, for followers, `peer status` and its successor.

The leader publishes a progress record under ``f"{run_id}:progress"`` (signed, like every record of the run)
every control-loop tick and at every step. Each record says which leader wrote it and when (``at``, DHT
time), so a peer can tell a live leader from a dead one by the record's age (the takeover guard in
``peer.node.daemon``); the record lives ``PROGRESS_TTL_S`` (much longer than that guard, see
``peer.timing``) so a new leader and `peer status` still read the last step and the loss history after the
leader died.

Readers accept progress only from the leader of the plan they follow (``peer.swarm.plans``), or, before the
first plan, from the leader they elect: a "done" written by any other peer is a forgery and ends nothing.
Like every record, progress is sealed to its writer and expiry (``peer.swarm.records``), so a copy of an old
record cannot be replayed under another peer's name or with a new lifetime. Among the accepted leader's
records the newest wins: highest plan epoch, then highest step.
"""

from __future__ import annotations

from typing import Any

import hivemind

from peer.swarm.identity import Identity
from peer.swarm.records import RecordStore
from peer.timing import DHT_CALL_TIMEOUT_S, PROGRESS_TTL_S, now


class ProgressBoard:
    """Publish progress (as leader) and read the newest (as anyone); ``identity`` None = read-only."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        identity: Identity | None,
        secret: str | None = None,
        ttl_s: float = PROGRESS_TTL_S,
        timeout_s: float = DHT_CALL_TIMEOUT_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.store = RecordStore(dht, run_id, identity, secret, timeout_s)
        self.ttl_s = ttl_s

    def publish(self, payload: dict[str, Any]) -> bool:
        """Store ``payload`` stamped with our peer id (``leader``) and the DHT time (``at``)."""
        identity = self.store.identity
        if identity is None:
            raise ValueError("a read-only progress board cannot publish")
        at = now()
        body = {**payload, "leader": identity.peer_id, "at": at}
        return self.store.put("progress", body, at + self.ttl_s)

    def read(self, leader: str | None) -> dict[str, Any] | None:
        """The newest progress record (highest epoch, then step) written by ``leader``; None when there is none
        (or when ``leader`` is None: nobody is accepted)."""
        if leader is None:
            return None
        best: dict[str, Any] | None = None
        for record in self.store.get_all("progress") or []:
            p = record.payload
            if record.owner != leader or p.get("leader") != leader:
                continue
            if not isinstance(p.get("epoch"), int) or not isinstance(p.get("step"), int):
                continue
            if isinstance(p.get("at"), bool) or not isinstance(p.get("at"), (int, float)):
                continue
            if best is None or (p["epoch"], p["step"]) > (best["epoch"], best["step"]):
                best = dict(p)
        return best
