"""The plan board: plans ordered by (epoch, leader id), signed by the leader that made them.

A leader publishes each plan under ``f"{run_id}:plans"`` with the subkey ``owner_tag + epoch``, signed by the
leader, so nobody can forge or overwrite another leader's plan. Plans are ordered by ``(epoch, leader id)``
(the same order the workers use to refuse an older leader's assignment, ``peer.runtime.stage``): at equal
epochs the larger leader id wins, so every reader settles on the same plan.

What a reader accepts (:meth:`PlanBoard.latest`):

* only a well-formed plan whose ``leader`` is its signer, with ``1 <= epoch <= MAX_EPOCH``;
* only from the leader the reader elects now (``elector``, see ``peer.swarm.election``): a plan from any
  other peer, however high its epoch, is a forged leader claim and is ignored;
* only a plan newer than the one it follows, and at most ``MAX_EPOCH_STEP`` epochs above it: epochs grow by
  bounded steps, so a plan of epoch 2**62 cannot push the swarm to where no leader can follow;
* only a plan that a quorum of the previous plan's members still backs (:func:`has_quorum`: more than half
  of them are among the new plan's members, or exactly half including the previous leader). A leader checks
  that before it publishes (``peer.node.leader_role``), so the minority side of a partition pauses instead
  of training on its own. With two members, losing the leader pauses the survivor, losing the other peer
  does not; with four, a 2 + 2 split keeps the side of the previous leader. The pause is bounded: after
  ``[swarm] quorum_wait_s`` the leader publishes a plan that says it waives the quorum and fences the plan
  followed (:func:`waives`), and readers accept it (``peer.node.leader_role``; docs/architecture.md).

A board remembers the plan it follows, so epochs never go back even after old plans expire from the DHT;
the leader renews its current plan with :meth:`PlanBoard.republish` well within ``plan_ttl_s``
(``peer.timing.PLAN_TTL_S`` and ``PLAN_RENEW_TICKS``). A fresh board (``peer status``, a joiner) takes the
elected leader's newest plan as it is.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import hivemind

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import check_peer_id
from tasklet.peer.swarm.records import RecordStore
from tasklet.peer.timing import DHT_CALL_TIMEOUT_S, PLAN_TTL_S, now

logger = logging.getLogger(__name__)

MAX_EPOCH = 2**31 - 1
MAX_EPOCH_STEP = 64  # a plan is at most this many epochs above the one its readers follow
MAX_MEMBERS = 4096
MAX_STAGES = 1024  # layer ranges one plan may name
MAX_LAYERS = 1 << 20
_SUFFIX_RE = re.compile(rb"^\|epoch=(\d{1,10})$")
_FIELDS = {"epoch", "leader", "plan", "members", "at"}


class NoQuorumError(ValueError):
    """A plan that a quorum of the previous plan's members does not back (see :func:`has_quorum`)."""


class PlanRecord(NamedTuple):
    """A published plan; unpacks as ``epoch, leader_id, plan, members`` (the live workers it counted)."""

    epoch: int
    leader_id: str
    plan: dict
    members: tuple[str, ...] = ()

    @property
    def order(self) -> tuple[int, str]:
        return self.epoch, self.leader_id


def has_quorum(previous: PlanRecord | None, present: Iterable[str]) -> bool:
    """Whether ``present`` peers may move on from ``previous``: more than half of its members (the leader
    included), or exactly half when the previous leader is among them. True when there was no plan yet."""
    if previous is None:
        return True
    members = set(previous.members) | {previous.leader_id}
    here = members & set(present)
    return 2 * len(here) > len(members) or (2 * len(here) == len(members) and previous.leader_id in here)


def waives(record: PlanRecord, current: PlanRecord | None) -> bool:
    """Whether ``record`` goes on without a quorum of ``current``'s members by the bounded-pause rule: its plan
    says so (``quorum_waived``: the epoch it fences, the seconds its leader waited) and fences exactly the plan
    followed. Only the elected leader's plans get this far (:meth:`PlanBoard._accepts`)."""
    waived = record.plan.get("quorum_waived")
    return (current is not None and isinstance(waived, dict) and waived.get("fenced_epoch") == current.epoch
            and record.epoch > current.epoch)


class PlanBoard:
    """Publish plans (as leader) and follow the newest accepted one (as everyone).

    ``elector`` returns the leader this peer elects now; plans from anyone else are ignored. None accepts any
    signer (benchmarks and tests that have one writer only).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        identity: Identity | None,
        secret: str | None = None,
        plan_ttl_s: float = PLAN_TTL_S,
        timeout_s: float = DHT_CALL_TIMEOUT_S,
        elector: Callable[[], str | None] | None = None,
    ):
        if plan_ttl_s <= 0:
            raise ValueError(f"plan_ttl_s must be positive, got {plan_ttl_s}")
        self.store = RecordStore(dht, run_id, identity, secret, timeout_s)
        self.plan_ttl_s = plan_ttl_s
        self.elector = elector
        self._latest: PlanRecord | None = None  # the plan this board follows; only ever replaced by a newer one
        self._published: PlanRecord | None = None

    @property
    def highest_epoch(self) -> int:
        """The epoch of the plan this board follows (0 before any); never decreases."""
        return 0 if self._latest is None else self._latest.epoch

    def publish(self, epoch: int, leader_id: str, plan: dict, members: Iterable[str] = (),
                waive_quorum: bool = False) -> bool:
        """Publish ``plan`` at ``epoch`` signed by us; ValueError unless it is newer than the plan we follow.
        ``waive_quorum``: the leader waited ``[swarm] quorum_wait_s`` for a quorum in vain; the plan must say so
        (``plan["quorum_waived"]``, see :func:`waives`)."""
        identity = self.store.identity
        if identity is None:
            raise ValueError("a read-only plan board cannot publish")
        if leader_id != identity.peer_id:
            raise ValueError(f"leader_id {leader_id!r} is not this peer {identity.peer_id!r}")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 1 <= epoch <= MAX_EPOCH:
            raise ValueError(f"epoch must be an integer in 1..{MAX_EPOCH}, got {epoch!r}")
        if self._latest is not None and (epoch, leader_id) <= self._latest.order:
            seen = self._latest
            raise ValueError(f"epoch {epoch} is older than the highest epoch seen, {seen.epoch} (by {seen.leader_id})")
        if self._latest is not None and epoch > self._latest.epoch + MAX_EPOCH_STEP:
            raise ValueError(f"epoch {epoch} is more than {MAX_EPOCH_STEP} above the followed {self.highest_epoch}")
        if not isinstance(plan, dict):
            raise ValueError(f"plan must be a dict, got {type(plan).__name__}")
        record = PlanRecord(epoch, leader_id, plan, tuple(sorted(set(members) | {leader_id})))
        if not has_quorum(self._latest, record.members) and not (waive_quorum and waives(record, self._latest)):
            raise NoQuorumError(f"plan epoch {epoch} lacks a quorum of plan {self.highest_epoch}'s members")
        stored = self._store(record)
        if stored:
            self._published = record
            self._latest = record
        return stored

    def republish(self) -> bool:
        """Renew our last plan's expiry, unless a newer plan has replaced it (then False)."""
        if self._published is None or self._published != self._latest:
            return False
        return self._store(self._published)

    def _store(self, record: PlanRecord) -> bool:
        at = now()
        payload = {"epoch": record.epoch, "leader": record.leader_id, "plan": record.plan,
                   "members": list(record.members), "at": at}
        suffix = b"|epoch=%d" % record.epoch
        return self.store.put("plans", payload, at + self.plan_ttl_s, suffix=suffix)

    def plans(self) -> list[PlanRecord]:
        """Every well-formed plan in the DHT, newest first (whoever signed it); ``[]`` also when the DHT timed out."""
        plans = []
        for record in self.store.get_all("plans") or []:
            try:
                plans.append(_parse_plan(record.owner, record.suffix, record.payload))
            except ValueError as error:
                logger.warning("ignoring a plan record from %s: %s", record.owner, error)
        plans.sort(key=lambda plan: plan.order, reverse=True)
        return plans

    def latest(self) -> PlanRecord | None:
        """The newest plan this board accepts (see the module docstring), or the one it followed before."""
        leader = self.elector() if self.elector is not None else None
        for record in self.plans():
            if self._accepts(record, leader):
                self._latest = record
                break
        return self._latest

    def _accepts(self, record: PlanRecord, leader: str | None) -> bool:
        current = self._latest
        if current is not None and record.order <= current.order:
            return False
        if self.elector is not None and record.leader_id != leader:
            logger.debug("ignoring plan %s from %s: not the elected leader %s", record.order, record.leader_id, leader)
            return False
        if current is not None and record.epoch > current.epoch + MAX_EPOCH_STEP:
            logger.warning("ignoring plan epoch %d from %s: more than %d above epoch %d", record.epoch,
                           record.leader_id, MAX_EPOCH_STEP, current.epoch)
            return False
        if not has_quorum(current, record.members) and not waives(record, current):
            logger.warning("ignoring plan epoch %d from %s: it lacks a quorum of plan %d's members", record.epoch,
                           record.leader_id, current.epoch)
            return False
        return True

    def followed(self) -> PlanRecord | None:
        """The plan this board follows, without reading the DHT (None before any)."""
        return self._latest

    def next_epoch(self) -> int:
        """The epoch a new leader should publish: one above the plan followed."""
        self.latest()
        return self.highest_epoch + 1


def _parse_plan(owner: str, suffix: bytes, payload: dict) -> PlanRecord:
    match = _SUFFIX_RE.match(suffix)
    if match is None or set(payload) != _FIELDS:
        raise ValueError("malformed plan record")
    epoch = payload["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch != int(match.group(1)):
        raise ValueError("its epoch does not match its key")
    if not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch {epoch} out of 1..{MAX_EPOCH}")
    if payload["leader"] != owner or not isinstance(payload["plan"], dict):
        raise ValueError("wrong leader or no plan")
    members = payload["members"]
    if not isinstance(members, list) or len(members) > MAX_MEMBERS:
        raise ValueError(f"members: expected a list of at most {MAX_MEMBERS} peer ids")
    check_plan_body(payload["plan"])
    return PlanRecord(epoch, owner, payload["plan"], tuple(check_peer_id(m, "members[]") for m in members))


def _int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an integer in {low}..{high}")
    return value


def check_plan_body(plan: dict) -> None:
    """The fields a plan's readers use, each of the type and size they expect (ValueError otherwise): a leader's
    malformed plan is refused at the door, never a crash in a follower or in the leader that takes over from it.
    ``stages`` are contiguous layer ranges from 0; ``pipelines`` rows of at most one peer id per stage."""
    stages = plan.get("stages", [])
    if not isinstance(stages, list) or len(stages) > MAX_STAGES:
        raise ValueError(f"stages: expected a list of at most {MAX_STAGES} layer ranges")
    end = 0
    for i, layers in enumerate(stages):
        if not isinstance(layers, list) or len(layers) != 2:
            raise ValueError(f"stages[{i}]: expected [first, last)")
        first, last = _int(layers[0], f"stages[{i}]", 0, MAX_LAYERS), _int(layers[1], f"stages[{i}]", 1, MAX_LAYERS)
        if first != end or last <= first:
            raise ValueError(f"stages[{i}]: {layers} does not follow the stage before it")
        end = last
    pipelines = plan.get("pipelines", [])
    if not isinstance(pipelines, list) or len(pipelines) > MAX_MEMBERS:
        raise ValueError(f"pipelines: expected a list of at most {MAX_MEMBERS} rows")
    for r, row in enumerate(pipelines):
        if not isinstance(row, list) or (stages and len(row) != len(stages)) or len(row) > MAX_STAGES:
            raise ValueError(f"pipelines[{r}]: expected one peer id per stage")
        for pid in row:
            check_peer_id(pid, f"pipelines[{r}][]")
    if "step" in plan:
        _int(plan["step"], "step", 0, MAX_EPOCH)
    for key, limit in (("reason", 1000), ("coordinator", 400)):
        if key in plan and not (isinstance(plan[key], str) and len(plan[key]) <= limit):
            raise ValueError(f"{key}: expected a string of at most {limit} characters")
    if "credited" in plan and not isinstance(plan["credited"], list):
        raise ValueError("credited: expected a list")
    if "quorum_waived" in plan and not isinstance(plan["quorum_waived"], dict):
        raise ValueError("quorum_waived: expected a table")
