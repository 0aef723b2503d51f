"""The progress board: the leader's latest step, loss and state, for followers, `peer status` and its successor.

The leader publishes a progress record under ``f"{run_id}:progress"`` (signed, like every record of the run)
every control-loop tick and at every step. Each record says which leader wrote it and when (``at``, DHT
time), so a peer can tell a live leader from a dead one by the record's age (the takeover guard in
``peer.node.daemon``); the record lives ``PROGRESS_TTL_S`` (much longer than that guard, see
``peer.timing``) so a new leader and `peer status` still read the last step and the loss history after the
leader died. Readers take the newest record of any leader: highest plan epoch, then highest step.
"""

from __future__ import annotations

from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from peer.swarm.identity import Identity
from peer.swarm.records import RecordStore
from peer.timing import DHT_CALL_TIMEOUT_S, PROGRESS_TTL_S


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
        now = get_dht_time()
        body = {**payload, "leader": identity.peer_id, "at": now}
        return self.store.put("progress", body, now + self.ttl_s)

    def read(self) -> dict[str, Any] | None:
        """The newest progress record (highest epoch, then step) of any leader; None when there is none."""
        best: dict[str, Any] | None = None
        for record in self.store.get_all("progress") or []:
            p = record.payload
            if not isinstance(p.get("epoch"), int) or not isinstance(p.get("step"), int):
                continue
            if best is None or (p["epoch"], p["step"]) > (best["epoch"], best["step"]):
                best = dict(p)
        return best
