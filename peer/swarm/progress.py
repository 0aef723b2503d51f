"""The progress board: the leader's latest step, loss and state, for followers, `peer status` and its successor.

The leader publishes two records (signed, like every record of the run), both on every call of
:meth:`ProgressBoard.publish` (every control-loop tick, and at re-plans, pauses, new checkpoints and the run's
end; not after every step: a takeover's bound travels with the steps instead, ``peer.node.step_record``):

* the **beat** under ``f"{run_id}:beat"``: the progress without the loss history, a few hundred bytes. Every
  worker reads it once a heartbeat (``peer.swarm.view``): it tells a live leader from a dead one by its age
  (``at``, DHT time), carries the plan epoch (a newer one makes the worker read the plan) and "done". Its
  size does not grow with the run or the swarm, so a worker's reads per heartbeat stay O(1).
* the **full record** under ``f"{run_id}:progress"``, with the loss history and the contribution record
  (``peer.swarm.credit``): stored only when it changed or every ``FULL_RENEW_S``, read on demand (`peer status`,
  the dashboard, a new leader adopting the history and the credit).

Both live ``PROGRESS_TTL_S`` (much longer than the takeover guard, see ``peer.timing``) so a new leader and
`peer status` still read the last step and the loss history after the leader died.

Readers accept progress only from the leader of the plan they follow (``peer.swarm.plans``), or, before the
first plan, from the leader they elect: a "done" written by any other peer is a forgery and ends nothing.
Like every record, progress is sealed to its writer and expiry (``peer.swarm.records``), so a copy of an old
record cannot be replayed under another peer's name or with a new lifetime. Among the accepted leader's
records the newest wins: highest plan epoch, then highest step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import hivemind

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.records import RecordStore
from tasklet.peer.timing import DHT_CALL_TIMEOUT_S, PROGRESS_TTL_S, now

# what only the full record carries: the loss history and the contribution record (peer.swarm.credit), which grow
# with the run and the swarm, so a beat stays a few hundred bytes
FULL_ONLY = frozenset({"history", "credit"})
FULL_RENEW_S = 20.0  # an unchanged full record is stored again this often (it lives PROGRESS_TTL_S)
RETRY_S = 0.5  # read_patiently's pause between lookups
MAX_SEEN_LEADERS = 16  # the leaders whose newest record read_patiently keeps


def publishable(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (at any depth): a record is strict JSON, and a
    step whose loss is unknown is published as one without a loss rather than failing the whole record."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: publishable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [publishable(v) for v in value]
    return value


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
        self._last: dict[str, Any] = {}  # the last payload published (what a resignation repeats)
        self._full: tuple[dict[str, Any], float] | None = None  # the last full payload stored, when (DHT time)
        self._seen: dict[str, dict[str, Any]] = {}  # leader -> the newest record read_patiently returned

    def publish(self, payload: dict[str, Any]) -> bool:
        """Store ``payload`` stamped with our peer id (``leader``) and the DHT time (``at``): the beat always,
        the full record when the payload changed or its last store is ``FULL_RENEW_S`` old."""
        identity = self.store.identity
        if identity is None:
            raise ValueError("a read-only progress board cannot publish")
        at = now()
        payload = publishable(dict(payload))
        self._last = dict(payload)
        body = {**payload, "leader": identity.peer_id, "at": at}
        beat = {k: v for k, v in body.items() if k not in FULL_ONLY}
        stored = self.store.put("beat", beat, at + self.ttl_s)
        if self._full is None or self._full[0] != payload or now() - self._full[1] > FULL_RENEW_S:
            if self.store.put("progress", body, at + self.ttl_s):
                self._full = (dict(payload), now())
            else:
                stored = False
        return stored

    def resign(self) -> bool:
        """A leader stepping down (not at the end of the run) says so in its beat, state "resigned": its
        followers read every advert again at once instead of waiting for the beat to age (peer.swarm.view)."""
        identity = self.store.identity
        if identity is None or not self._last:
            return False
        at = now()
        beat = {k: v for k, v in self._last.items() if k not in FULL_ONLY}
        return self.store.put("beat", {**beat, "state": "resigned", "leader": identity.peer_id, "at": at},
                              at + self.ttl_s)

    def read(self, leader: str | None) -> dict[str, Any] | None:
        """The newest progress record (highest epoch, then step) written by ``leader``, with the loss history;
        None when there is none (or when ``leader`` is None: nobody is accepted)."""
        return self._newest("progress", leader)

    def read_patiently(self, leader: str | None, patience_s: float,
                       wait: Callable[[float], bool]) -> dict[str, Any] | None:
        """:meth:`read`, tried again every ``RETRY_S`` for up to ``patience_s`` while a lookup finds nothing, and
        never older than a record of ``leader`` this method returned before: right after a leader's death one
        lookup can miss its record and the next one find it, and a takeover must not go on without it.
        ``wait(s)`` sleeps (True: stop now)."""
        seen = self._seen.get(leader) if leader is not None else None
        deadline = time.monotonic() + patience_s
        found = self.read(leader)
        while found is None and seen is None and time.monotonic() < deadline and not wait(RETRY_S):
            found = self.read(leader)
        if seen is not None and (found is None or (seen["epoch"], seen["step"]) > (found["epoch"], found["step"])):
            return dict(seen)
        if found is not None and leader is not None:
            self._seen.pop(leader, None)
            self._seen[leader] = dict(found)
            while len(self._seen) > MAX_SEEN_LEADERS:
                self._seen.pop(next(iter(self._seen)))
        return found

    def read_beat(self, leader: str | None) -> dict[str, Any] | None:
        """The newest beat of ``leader``: its progress without the history, ``at`` renewed on every publish."""
        return self._newest("beat", leader)

    def _newest(self, name: str, leader: str | None) -> dict[str, Any] | None:
        if leader is None:
            return None
        best: dict[str, Any] | None = None
        for record in self.store.get_all(name) or []:
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
