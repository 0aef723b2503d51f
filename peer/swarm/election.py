"""Leader election without messages, and plans whose epochs only grow.

**Election.** Every peer reads the same live adverts from the DHT, so a pure function of them picks the same
leader everywhere: the worker that started earliest (ties by peer id). The oldest peer is the one most
likely to stay (peer lifetimes are heavy-tailed: having lasted predicts lasting), and a newcomer never
displaces a working leader, so joins do not cause leader churn. Views can differ briefly while an advert
propagates or expires; that is what epochs are for.

**Plans.** A leader publishes each plan under ``f"{run_id}:plans"`` with the subkey ``owner_tag + epoch``,
signed by the leader, so nobody can forge or overwrite another leader's plan. Everyone follows the plan with
the highest epoch, ties by smallest leader id. A new leader publishes ``highest epoch seen + 1``. If two
peers briefly both believe they lead and publish epochs 3 and 4, every reader ends on 4, and the loser
sees 4 at its next read and stops publishing (its ``publish`` of anything older raises). A board remembers the
highest epoch it has seen, so epochs never go back even after old plans expire from the DHT; the leader
renews its current plan with :meth:`PlanBoard.republish` well within ``plan_ttl_s``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import NamedTuple

import hivemind
from hivemind.utils import get_dht_time

from peer.swarm.adverts import Advert
from peer.swarm.identity import Identity
from peer.swarm.records import RecordStore

logger = logging.getLogger(__name__)

MAX_EPOCH = 2**62
_SUFFIX_RE = re.compile(rb"^\|epoch=(\d{1,19})$")


def elect_leader(adverts: Iterable[Advert]) -> str | None:
    """The peer id of the worker with the earliest ``started_at`` (ties: smallest id); None if no worker."""
    workers = [advert for advert in adverts if advert.role == "worker"]
    if not workers:
        return None
    return min(workers, key=lambda advert: (advert.started_at, advert.peer_id)).peer_id


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
        plan_ttl_s: float = 600.0,
        timeout_s: float = 5.0,
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

