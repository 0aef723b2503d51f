"""This peer's standing in the run's leadership: the organiser's policy, the role machine, the leader's claims.

The daemon's control loop hands each tick's election to :meth:`Leadership.step` and carries out the actions the
role machine (``peer.node.roles``) returns. What a leader orders that this peer can check on its own is checked
here: a "done" counts only at the run's signed last step, and where the organiser opted in to elected leaders
(``leaders = "any"``) a leader whose orders this peer refused is deposed (``SwarmView.depose``) for
``ORDER_DEPOSE_HEARTBEATS``, so the members elect another. A steward is the organiser's choice: its refused
orders are refused, and it keeps the lead (deposing it could leave the swarm with nobody allowed to lead).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from tasklet.peer.net.endpoint import EndpointError, with_route
from tasklet.peer.node.roles import Action, Observed, State, transition
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.charter import LeaderPolicy, waiting_line
from tasklet.peer.swarm.election import elect
from tasklet.peer.swarm.membership import Membership
from tasklet.peer.swarm.view import SwarmView

log = logging.getLogger(__name__)

ORDER_DEPOSE_HEARTBEATS = 600  # an elected leader whose orders were refused stays out of the election this long
# an elected leader whose beat (epoch, step, state) has not changed for this long, or for this many of its slowest
# steps seen, whichever is longer, makes no progress: it is deposed
NO_PROGRESS_MIN_S = 600.0
NO_PROGRESS_STEPS = 10


class Leadership:
    """The organiser's policy (kept current from its signed stewards records), this peer's role state, and the
    checks of a leader's claims. ``last_step``: the signed run's last step; ``leaders``: its ``[swarm] leaders``;
    ``guard``: told who may write the leader's records each time the policy changes (the DHT node's storage)."""

    def __init__(self, me: str, last_step: int, heartbeat_s: float, leaders: object, view: SwarmView,
                 membership: Membership, live_adverts: Callable[[], list[Advert]] = list,
                 clock: Callable[[], float] = time.monotonic,
                 guard: Callable[[tuple[str, ...] | None], object] = lambda writers: None) -> None:
        self.me, self.last_step, self.heartbeat_s, self.leaders = me, last_step, heartbeat_s, leaders
        self.view, self.membership, self.live_adverts, self.clock = view, membership, live_adverts, clock
        self.guard = guard
        self._moved: tuple[str, object, object, object, float] | None = None  # leader, epoch, step, state, since
        self._slowest_step_s = 0.0
        self.state = State.FOLLOWER
        self.run_done = False  # the followed leader reported "done" at the signed last step
        self._refused: set[tuple[str, str]] = set()  # (leader, what) refusals already logged
        self._followed: str | None = None  # the leader this follower's log last named

    @property
    def policy(self) -> LeaderPolicy | None:
        return self.view.policy

    def adopt(self, organiser: str) -> None:
        """The run this peer takes part in is ``organiser``'s: who may lead is its signed choice."""
        policy = LeaderPolicy.from_record(organiser, self.leaders)
        self.view.adopt_policy(policy)
        self.guard(policy.writers())
        log.info("run of organiser %s; who may lead: %s", organiser, policy.describe())

    def step(self, leader: str | None, may_lead: bool, role_finished: bool, role_failed: bool,
             role_stopped: bool = False) -> tuple[Action, ...]:
        """One tick of the role machine; the actions for the daemon, in order."""
        seen = Observed(me=self.me, leader=leader, waiting=self.view.waiting_for_steward(), may_lead=may_lead,
                        role_finished=role_finished, role_failed=role_failed, run_done=self.run_done,
                        role_stopped=role_stopped)
        state, actions = transition(self.state, seen)
        # a follower whose leader changed logs it too: the log's last role line names whom it follows now
        moved = state is State.FOLLOWER and leader is not None and leader != self._followed
        if state is not self.state or moved:
            log.info("role: %s -> %s%s", self.state.value, state.value, self._reason(state, leader))
            self.state = state
        if state is not State.FOLLOWER:
            self._followed = None
        elif leader is not None:
            self._followed = leader
        return actions

    def _reason(self, state: State, leader: str | None) -> str:
        if state is State.WAITING and self.policy is not None:
            return f" ({waiting_line(self.policy)})"
        if state is State.FOLLOWER and leader:
            return f" (leader {leader})"
        return ""

    def on_progress(self, progress: dict[str, Any] | None) -> None:
        """A leader's beat, read once a heartbeat: its "done" ends this peer's run only at the signed last step;
        any other "done" is refused (a leader ordering everyone home early is stopping the run, not ending it)."""
        if self.run_done or not progress:
            return
        self._watch_progress(progress)
        if progress.get("state") != "done":
            return
        step = progress.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step == self.last_step:
            log.info("the run is done (step %s); leaving", step)
            self.run_done = True
            return
        leader = str(progress.get("leader", ""))[:64]
        self.refuse(leader, f"it reported the run done at step {str(step)[:32]}, not at the signed step "
                    f"{self.last_step}")

    def _watch_progress(self, progress: dict[str, Any]) -> None:
        """An elected leader whose beat moves no step, and says nothing new, for long is stalling the run: deposed
        (one that waits for peers or a quorum waits long under it too, and another leader would wait as well)."""
        leader = str(progress.get("leader", ""))[:64]
        mark = (leader, progress.get("epoch"), progress.get("step"), progress.get("state"))
        step_s = progress.get("step_s")
        if isinstance(step_s, (int, float)) and not isinstance(step_s, bool) and math.isfinite(step_s):
            self._slowest_step_s = max(self._slowest_step_s, min(float(step_s), 86400.0))
        at = self.clock()
        if self._moved is None or self._moved[:4] != mark or progress.get("state") in ("done", "resigned"):
            self._moved = (*mark, at)
            return
        limit = max(NO_PROGRESS_MIN_S, NO_PROGRESS_STEPS * self._slowest_step_s)
        if at - self._moved[4] >= limit and self.policy is not None and self.policy.any:
            self.refuse(leader, f"no step for {at - self._moved[4]:.0f} s (it says it is {str(mark[3])[:16]})")
            self._moved = (*mark, at)

    def refuse(self, leader: str, why: str) -> None:
        """An order of ``leader`` this peer refused (logged once per kind); an elected leader is deposed."""
        if not leader or leader == self.me:
            return
        key = (leader, why[:80])
        if key not in self._refused and len(self._refused) < 4096:
            self._refused.add(key)
            log.warning("refused an order of the leader %s: %s", leader, why)
        if self.policy is not None and self.policy.any:
            self.view.depose(leader, self.heartbeat_s * ORDER_DEPOSE_HEARTBEATS, f"its orders were refused: {why}")

    def may_assign(self, caller: str) -> bool:
        """Assignments come from the leader this peer elects (before its first complete read, the leader it
        derives from the adverts it reads now; never just any member). An assignment from another peer may mean
        the election moved (a healed partition): look again."""
        elected = self.view.elected()
        if elected is not None:
            if caller != elected:
                self.view.suspect_leader(f"peer {caller} sent an assignment, but {elected} is the elected leader")
            return caller == elected
        entries = self.membership.live_entries()
        if not any(e.advert.peer_id == self.me for e in entries):
            return False  # a read without our own advert is incomplete: it elects nobody
        return caller == elect(entries, (), self.policy)

    def may_dial(self, endpoint: str, peer_id: str) -> bool:
        """Whether an order may make the worker dial ``endpoint`` (named for ``peer_id``, "" for none): a live
        advert of the run holds it, and its peer (so its certificate) is the one named. A peer the last read
        missed (a joiner of the plan) is looked up once more before the order is refused."""
        try:
            base = with_route(endpoint, "")  # a server mounted under a route (the leader's /coordinator) is its peer's
        except EndpointError:
            return False

        def known(adverts: list[Advert]) -> bool:
            return any(a.endpoint == base and (not peer_id or a.peer_id == peer_id) for a in adverts)

        return known(self.live_adverts()) or known([e.advert for e in self.membership.live_entries()])

    def read_stewards(self) -> None:
        """The stewards the organiser added while the run goes on (``peer stewards``)."""
        policy = self.policy
        if policy is None or policy.any:
            return
        added = self.membership.read_stewards(policy.organiser)
        if added is None:
            return
        new = LeaderPolicy.from_record(policy.organiser, self.leaders, added)
        if new != policy:
            log.info("the organiser's stewards: %s", ", ".join(new.stewards))
            self.view.adopt_policy(new)
            self.guard(new.writers())

    def summary(self) -> dict[str, Any] | None:
        """Who may lead and whether the swarm waits for a steward (the dashboard, /metrics)."""
        policy = self.policy
        if policy is None:
            return None
        waiting = self.view.waiting_for_steward()
        return {"organiser": policy.organiser, "leaders": "any" if policy.any else list(policy.stewards),
                "waiting": waiting_line(policy) if waiting else None}
