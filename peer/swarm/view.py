"""What a peer reads of the swarm, and when: O(1) DHT reads per heartbeat for a worker that follows a live leader.

Reading every advert is O(N) bytes for one reader and O(N^2) for the swarm when every peer does it every
tick; that is what kept 32 daemons from forming on one machine. Only the peers that need the whole candidate
set read it (``Membership.live_entries``):

* the **leader**, every tick: it plans from the adverts and must notice joins, deaths and a healed partition;
* a peer **without a confirmed leader** (just joined, or the election is still settling), every tick;
* a peer that **suspects the leader**: its coordinator could not be reached for ``COORDINATOR_LOST_HEARTBEATS``
  (the daemon deposes it: :meth:`SwarmView.depose` elects without it for ``DEPOSE_HEARTBEATS``, so a leader that
  beats but does not coordinate, e.g. one that failed while taking over, is replaced like a dead one), or the
  leader's beat (``peer.swarm.progress``) was missing, older than
  one advert lifetime or "resigned" (it stepped down) at the last look, or a peer other than the one it
  elected tried to assign it work
  (:meth:`SwarmView.suspect_leader`; the election may have moved, e.g. a partition healed), every tick;
* a peer that **deposed a leader** (below), while the deposition lasts: it must see that leader's advert and
  certificate come back to notice it answers again;
* a peer **without an assignment** (forming, or a newcomer the leader has not planned yet), once a heartbeat:
  it needs the adverts to know whom to probe and whose TLS certificate to trust.

A worker holding an assignment and following a live leader reads one small record a heartbeat: the leader's
beat (plan epoch, step, state, DHT time). The plan itself is read only when the beat names a newer epoch; the
full progress record (loss history) only on demand (`peer status`, the dashboard, a new leader); the
certificates it needs are those its assignment names (``peer.runtime.stage``). The election is the same
everywhere (``peer.swarm.election``): a pure function of the live records and the followed plan's credited
peers, acted on only once it has been stable
for ``LEADER_CONFIRM_TICKS`` full reads, and plans and progress are accepted only from the elected leader
(``peer.swarm.plans``), so the fencing by (epoch, leader id) and the quorum rule hold as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from tasklet.peer.swarm.charter import LeaderPolicy
from tasklet.peer.swarm.election import bootstrap_credited, credited_of, elect
from tasklet.peer.swarm.membership import EndpointHints, Membership, PeerEntry
from tasklet.peer.swarm.plans import PlanBoard, PlanRecord
from tasklet.peer.swarm.progress import ProgressBoard
from tasklet.peer.timing import LEADER_CONFIRM_TICKS, TICKS_PER_HEARTBEAT, now

logger = logging.getLogger(__name__)

MAX_PINNED = 65536  # peers whose first-seen testimony one reader remembers
WATCHED_STEWARDS = 4  # stewards whose beats a peer waiting for one reads for the run's end


@dataclass(frozen=True)
class Tick:
    """What one tick learned: ``entries`` when it read every advert (else None), and the confirmed leader (None
    while the election settles, or when the read was incomplete)."""

    entries: list[PeerEntry] | None
    leader: str | None


# elect(live entries, credited peers, policy, incumbent) -> the leader (``peer.swarm.election.elect``)
Elect = Callable[[list[PeerEntry], Collection[str], LeaderPolicy | None, str | None], str | None]

class SwarmView:
    """One peer's reading policy over its membership, plan board and progress board (see the module docstring).

    The owner tells it whether its worker holds an assignment (``note_holding_plan``) and who may lead
    (``adopt_policy``). ``elect``: the election (``peer.swarm.election.elect``; a simulator passes one that
    shares work between its peers). Thread-safe enough for its use: ``suspect_leader`` may be called from a gRPC
    thread, it only sets a flag.
    """

    def __init__(self, membership: Membership, plans: PlanBoard, progress: ProgressBoard, *,
                 confirm_ticks: int = LEADER_CONFIRM_TICKS, ticks_per_heartbeat: int = TICKS_PER_HEARTBEAT,
                 elect: Elect = elect) -> None:
        self.membership, self.plans, self.progress = membership, plans, progress
        self._elect_leader = elect
        self.confirm_ticks, self.ticks_per_heartbeat = confirm_ticks, ticks_per_heartbeat
        self.candidate: str | None = None  # the leader elected at the last complete full read
        self.streak = 0  # full reads in a row that elected the candidate
        self.suspect = True  # read everything until a confirmed leader is seen beating
        self.holding_plan = False
        self.beat: dict[str, Any] | None = None  # the last beat of the leader whose progress counts
        self.elected_beat: dict[str, Any] | None = None  # the last beat of the leader elected (before it plans)
        self.ticks = 0
        self.full_reads = 0
        self._bootstrap: frozenset[str] | None = None  # the credited set while no plan is followed
        membership.use_endpoint_hints(self.endpoint_hints)
        self.deposed: dict[str, float] = {}  # peer id -> until when (monotonic) the election leaves it out
        self.policy: LeaderPolicy | None = None  # who may lead (the organiser's signed choice: adopt_policy)
        self.live_ids: frozenset[str] = frozenset()  # the live workers at the last complete read
        self._pinned: dict[str, frozenset[str]] = {}  # peer id -> its testimony (found) as first seen

    def note_holding_plan(self, holding: bool) -> None:
        """Whether this peer's worker holds an assignment (a holder reads fewer adverts between heartbeats)."""
        self.holding_plan = holding

    def adopt_policy(self, policy: LeaderPolicy) -> None:
        """Who may lead from now on: the organiser's signed choice."""
        self.policy = policy

    @property
    def me(self) -> str:
        return self.membership.peer_id

    def elected(self) -> str | None:
        """The leader this peer elects now (not yet confirmed): the only peer whose plans it accepts."""
        return self.candidate

    def confirmed(self) -> str | None:
        return self.candidate if self.streak >= self.confirm_ticks else None

    def suspect_leader(self, why: str) -> None:
        """Read the whole candidate set again from the next tick on (until the leader is seen beating)."""
        if not self.suspect:
            logger.info("reading every advert again: %s", why)
        self.suspect = True

    def depose(self, peer_id: str, for_s: float, why: str) -> None:
        """Elect without ``peer_id`` for ``for_s`` seconds (its coordinator cannot be reached: a leader that
        beats but does not lead must not hold the run), and read every advert again."""
        if self.deposed.get(peer_id, 0.0) <= time.monotonic() and why and for_s > 0:
            logger.warning("electing a leader without %s for %.0f s: %s", peer_id, for_s, why)
        self.deposed[peer_id] = time.monotonic() + for_s
        if why:  # a renewal ("") changes nothing else; a lift (0 s) looks again, it may be elected again
            self.suspect_leader(why)

    def is_deposed(self, peer_id: str) -> bool:
        return self.deposed.get(peer_id, 0.0) > time.monotonic()

    def needs_full_read(self, leading: bool) -> bool:
        if leading or self.suspect or self.confirmed() is None or self.candidate == self.me:
            return True
        if any(self.is_deposed(pid) for pid in self.deposed):
            return True  # while it elects without someone: its advert (and certificate) must stay in view
        return not self.holding_plan and self.ticks % self.ticks_per_heartbeat == 0

    def tick(self, leading: bool) -> Tick:
        """One control-loop tick: a full read when needed (see the module docstring), the leader's beat once a
        heartbeat."""
        entries: list[PeerEntry] | None = None
        complete = True
        if self.needs_full_read(leading):
            entries = self.membership.live_entries()
            self.full_reads += 1
            complete = self._elect(entries)
        if self.ticks % self.ticks_per_heartbeat == 0:
            self._look_at_leader()
        self.ticks += 1
        return Tick(entries, self.confirmed() if complete else None)

    def _elect(self, entries: list[PeerEntry]) -> bool:
        """Count a full read toward the election; False (and nothing changed) for a read without our own advert:
        such a read is incomplete, and acting on it could make a follower believe it leads."""
        if not any(e.advert.peer_id == self.me for e in entries):
            return False
        deposed = {pid for pid in self.deposed if self.is_deposed(pid)}
        kept = [self._pin(e) for e in entries if e.advert.peer_id not in deposed]
        self.live_ids = frozenset(e.advert.peer_id for e in entries if e.advert.role == "worker")
        candidate = self._elect_leader(kept, self.credited(entries), self.policy, self._incumbent(deposed))
        if candidate == self.candidate:
            self.streak += 1
        else:
            self.candidate, self.streak = candidate, 1
        return True

    def _pin(self, entry: PeerEntry) -> PeerEntry:
        """The entry with its writer's testimony as this reader first saw it: ``found`` is fixed for a peer's
        lifetime, so a later change is a lie aimed at the election (bounded: one set per peer id read)."""
        pid = entry.advert.peer_id
        if pid not in self._pinned and len(self._pinned) < MAX_PINNED:
            self._pinned[pid] = entry.found
        pinned = self._pinned.get(pid, entry.found)
        return entry if pinned == entry.found else replace(entry, found=pinned)

    def _incumbent(self, deposed: set[str]) -> str | None:
        """The leader of the plan this peer follows, unless deposed or resigned: it keeps the lead."""
        plan = self.plans.followed()
        if plan is None or plan.leader_id in deposed:
            return None
        beat = self.beat
        if beat is not None and beat.get("leader") == plan.leader_id and beat.get("state") in ("resigned", "done"):
            return None
        return plan.leader_id

    def waiting_for_steward(self) -> bool:
        """True while the organiser's stewards are the only ones who may lead and none is live."""
        policy = self.policy
        return policy is not None and not policy.any and not (self.live_ids & set(policy.stewards)) \
            and bool(self.live_ids)

    def endpoint_hints(self) -> EndpointHints:
        """Who holds an endpoint first seen with several claimants: the followed plan's leader and workers, and
        the peers its leader credits with accepted work (peer.swarm.membership.EndpointBinding)."""
        plan = self.plans.followed()
        if plan is None:
            return EndpointHints(credit=dict.fromkeys(self._bootstrap or (), 1))
        workers = {pid for row in plan.plan.get("pipelines") or [] for pid in row}
        return EndpointHints(frozenset({plan.leader_id, *plan.members, *workers}),
                             dict.fromkeys(credited_of(plan.plan), 1))

    def credited(self, entries: list[PeerEntry]) -> frozenset[str]:
        """Whose testimony counts in the election (``peer.swarm.election``): the peers the followed plan credits
        with accepted work; without a plan, those of the newest self-consistent plan in the DHT (read once a
        heartbeat)."""
        plan = self.plans.followed()
        if plan is not None:
            return credited_of(plan.plan)
        if self._bootstrap is None or self.ticks % self.ticks_per_heartbeat == 0:
            self._bootstrap = bootstrap_credited(entries, [(p.leader_id, p.plan) for p in self.plans.plans()])
        return self._bootstrap

    def _look_at_leader(self) -> None:
        """Read the elected leader's beat: fresh clears suspicion, missing or stale raises it; a newer epoch
        than the plan followed (or a new leader) makes us read the plan."""
        leader = self.candidate
        if leader is None:
            self._look_for_an_end()
            return
        beat = self.progress.read_beat(leader)
        self.elected_beat = beat
        if beat is None or now() - float(beat["at"]) >= self.membership.ttl_s or beat.get("state") == "resigned":
            if leader != self.me:
                self.suspect_leader(f"no fresh beat from the leader {leader}")
        elif self.confirmed() == leader:
            self.suspect = False
        plan = self.plans.followed()
        if beat is not None and (plan is None or beat["epoch"] > plan.epoch or plan.leader_id != leader):
            plan = self.plans.latest()
        counted = leader if plan is None else plan.leader_id  # progress counts only from the plan's leader
        # in a takeover the plan's leader is not (yet) the one we elect: its "done" still ends the run
        self.beat = beat if counted == leader else self.progress.read_beat(counted)

    def _look_for_an_end(self) -> None:
        """While no steward is live: the run may be over (a peer that joined as the last leader left), so the first
        stewards' beats are read for a "done" (the daemon believes it only at the signed last step)."""
        policy = self.policy
        if policy is None or policy.any or not self.live_ids:
            return
        for steward in policy.stewards[:WATCHED_STEWARDS]:
            beat = self.progress.read_beat(steward)
            if beat is not None and beat.get("state") == "done":
                self.beat = beat
                return

    def followed_plan(self) -> PlanRecord | None:
        """The plan this peer follows, without reading the DHT."""
        return self.plans.followed()
