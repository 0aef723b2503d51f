"""The plan board: plans whose epochs only grow, signed by the leader that made them.

A leader publishes each plan under ``f"{run_id}:plans"`` with the subkey ``owner_tag + epoch``, signed by the
leader, so nobody can forge or overwrite another leader's plan. Everyone follows the plan with the highest
epoch, ties by smallest leader id. A new leader publishes ``highest epoch seen + 1``. If two peers briefly
both believe they lead (``peer.swarm.election``) and publish epochs 3 and 4, every reader ends on 4, and the
loser sees 4 at its next read and stops publishing (its ``publish`` of anything older raises). A board
remembers the highest epoch it has seen, so epochs never go back even after old plans expire from the DHT;
the leader renews its current plan with :meth:`PlanBoard.republish` well within ``plan_ttl_s``
(``peer.timing.PLAN_TTL_S`` and ``PLAN_RENEW_TICKS``).
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import hivemind
from hivemind.utils import get_dht_time

from peer.swarm.identity import Identity
from peer.swarm.records import RecordStore
from peer.timing import DHT_CALL_TIMEOUT_S, PLAN_TTL_S

logger = logging.getLogger(__name__)

MAX_EPOCH = 2**62
_SUFFIX_RE = re.compile(rb"^\|epoch=(\d{1,19})$")


class PlanRecord(NamedTuple):
    """A published plan; unpacks as ``epoch, leader_id, plan``."""

    epoch: int
    leader_id: str
    plan: dict


class PlanBoard:
    """Publish plans (as leader) and follow the highest epoch (as everyone)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        identity: Identity | None,
        secret: str | None = None,
        plan_ttl_s: float = PLAN_TTL_S,
        timeout_s: float = DHT_CALL_TIMEOUT_S,
    ):
        if plan_ttl_s <= 0:
            raise ValueError(f"plan_ttl_s must be positive, got {plan_ttl_s}")
        self.store = RecordStore(dht, run_id, identity, secret, timeout_s)
        self.plan_ttl_s = plan_ttl_s
        self.highest_epoch = 0  # highest epoch ever seen or published here; never decreases
        self._latest: PlanRecord | None = None
        self._published: PlanRecord | None = None

    def publish(self, epoch: int, leader_id: str, plan: dict) -> bool:
        """Publish ``plan`` at ``epoch`` signed by us; ValueError for an epoch older than one already seen."""
        identity = self.store.identity
        if identity is None:
            raise ValueError("a read-only plan board cannot publish")
        if leader_id != identity.peer_id:
            raise ValueError(f"leader_id {leader_id!r} is not this peer {identity.peer_id!r}")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 1 <= epoch <= MAX_EPOCH:
            raise ValueError(f"epoch must be an integer in 1..{MAX_EPOCH}, got {epoch!r}")
        if epoch < self.highest_epoch:
            raise ValueError(f"epoch {epoch} is older than the highest epoch seen, {self.highest_epoch}")
        if not isinstance(plan, dict):
            raise ValueError(f"plan must be a dict, got {type(plan).__name__}")
        record = PlanRecord(epoch, leader_id, plan)
        stored = self._store(record)
        if stored:
            self._published = record
            self._see(record)
        return stored

    def republish(self) -> bool:
        """Renew our last plan's expiry, unless a higher epoch has replaced it (then False)."""
        if self._published is None or self._published.epoch < self.highest_epoch:
            return False
        return self._store(self._published)

    def _store(self, record: PlanRecord) -> bool:
        now = get_dht_time()
        payload = {"epoch": record.epoch, "leader": record.leader_id, "plan": record.plan, "at": now}
        suffix = b"|epoch=%d" % record.epoch
        return self.store.put("plans", payload, now + self.plan_ttl_s, suffix=suffix)

    def _see(self, record: PlanRecord) -> None:
        latest = self._latest
        if (
            latest is None
            or record.epoch > latest.epoch
            or (record.epoch == latest.epoch and record.leader_id < latest.leader_id)
        ):
            self._latest = record
        self.highest_epoch = max(self.highest_epoch, record.epoch)

    def plans(self) -> list[PlanRecord]:
        """Every valid plan in the DHT, highest epoch first; ``[]`` also when the DHT timed out."""
        records = self.store.get_all("plans") or []
        plans = []
        for record in records:
            match = _SUFFIX_RE.match(record.suffix)
            payload = record.payload
            if match is None or set(payload) != {"epoch", "leader", "plan", "at"}:
                logger.warning("ignoring a malformed plan record from %s", record.owner)
                continue
            epoch = payload["epoch"]
            if isinstance(epoch, bool) or epoch != int(match.group(1)) or not 1 <= epoch <= MAX_EPOCH:
                logger.warning("ignoring a plan from %s whose epoch does not match its key", record.owner)
                continue
            if payload["leader"] != record.owner or not isinstance(payload["plan"], dict):
                logger.warning("ignoring a plan from %s: wrong leader or no plan", record.owner)
                continue
            plans.append(PlanRecord(epoch, record.owner, payload["plan"]))
        plans.sort(key=lambda plan: (-plan.epoch, plan.leader_id))
        return plans

    def latest(self) -> PlanRecord | None:
        """The plan with the highest epoch seen so far (in the DHT now, or earlier by this board)."""
        for record in self.plans()[:1]:
            self._see(record)
        return self._latest

    def next_epoch(self) -> int:
        """The epoch a new leader should publish: one above anything seen."""
        self.latest()
        return self.highest_epoch + 1

