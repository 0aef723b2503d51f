"""The leader's training loop: plan, assign, train, and re-plan whenever membership changes.

What a re-plan keeps fixed, and why: the *layer split* of the stages is chosen once, by the first plan, and
kept for the whole run. Then any live replica of stage ``s`` holds everything a newcomer to stage ``s`` needs
(parameters and AdamW moments of exactly those layers), so a hand-over is one fetch. Re-plans only move
devices between (stage, replica) slots and change the number of replicas.

Where a tasklet's state comes from after a re-plan, in order of preference: the device already holds it at
the run's trained step (``keep``); a live replica of the stage at that step (``fetch``); otherwise the stage
is lost with every replica, and the whole run rolls back to the newest verified checkpoint, this leader's or
a copy a live peer holds (every stage ``fetch``es it from the coordinator), or to step 0 when there is none (the
seeded initial state, which every peer rebuilds), redoing the steps since — the log says how many. A wiped stage
never ends the run. The same roll-back undoes a cheater's work: when a spot check excludes a peer whose work no
check verified was applied (the ledger of ``peer.runtime.lead.verify.Verification``), the run goes back to the
newest verified checkpoint of at most the first such step (never forward), the peer is banned for good, and the
steps since are redone without it (``_discard_cheats``).

Checkpoints are written by the leader every ``checkpoint_every`` steps (and on request, e.g. SIGTERM); where they
are written, copied and found again is :class:`peer.runtime.lead.recovery.Recovery`'s. ``resume`` starts a run
from the newest one that verifies; a failed checkpoint is logged and counted, never fatal.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, MutableSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasklet.peer.compute.stage import flat_digest
from tasklet.peer.runtime.checkpoints import (
    DEFAULT_KEEP,
    CheckpointStore,
)
from tasklet.peer.runtime.control import SourceKind, StateSource
from tasklet.peer.runtime.lead.coordinator import (
    Coordinator,
    OuterRoundFailedError,
    ReplanNeededError,
    StepFailedError,
    StepReport,
)
from tasklet.peer.runtime.lead.recovery import Inherited, Recovery, RunEvents
from tasklet.peer.runtime.lead.resync import Digests
from tasklet.peer.runtime.lead.step import TooFewPeersError
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.timing import (
    BAN_MAX_S,
    BAN_S,
    CHECKPOINT_COPIES,
    REPLAN_WAIT_S,
    STEP_TIMEOUT_S,
    STRAGGLER_FACTOR,
    STRAGGLER_STEPS,
    now,
)

log = logging.getLogger(__name__)

Stages = list[tuple[int, int]]
Pipelines = list[list[int]]
# planner(live device ids, fixed stages or None) -> (stages, pipelines of device ids)
Planner = Callable[[list[int], Stages | None], tuple[Stages, Pipelines]]
# assignments_for(stages, pipelines, epoch) -> {endpoint: Assignment}
AssignmentBuilder = Callable[[Stages, Pipelines, int], dict[str, Assignment]]


class ExpiringBans(MutableSet[str]):
    """Endpoints left out of plans until their ban expires: ``BAN_S``, doubled for each new ban of the same
    endpoint up to ``BAN_MAX_S`` (a peer that keeps dying stays out longer; one that restarted comes back)."""

    def __init__(self, ban_s: float = BAN_S, max_s: float = BAN_MAX_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ban_s, self.max_s, self._clock = ban_s, max_s, clock
        self._until: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def _live(self) -> dict[str, float]:
        now = self._clock()
        for ep in [ep for ep, until in self._until.items() if until <= now]:
            del self._until[ep]
            log.info("the ban of %s expired; it may be planned again", ep)
        return self._until

    def add(self, value: str) -> None:
        if value in self._live():
            return
        n = self._count.get(value, 0)
        self._count[value] = n + 1
        self._until[value] = self._clock() + min(self.max_s, self.ban_s * 2**n)

    def forever(self, value: str) -> None:
        """Ban ``value`` for good (a peer a spot check caught cheating: it never comes back in this leadership)."""
        self._until[value] = math.inf

    def discard(self, value: str) -> None:
        self._until.pop(value, None)

    def __contains__(self, value: object) -> bool:
        return value in self._live()

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._live()))

    def __len__(self) -> int:
        return len(self._live())

    def __repr__(self) -> str:
        return f"ExpiringBans({sorted(self._live())})"


class StragglerJudge:
    """Which workers are stragglers, from each worker's cumulative (busy seconds, ops) after every step.

    A worker whose compute seconds per op in the step are more than ``factor`` x the median of its stage's
    other replicas is slow. It is a straggler after ``steps`` slow steps in a row, or after one when it is over
    ``factor`` squared x that median (e.g. 4x: no warm-up or pause makes a whole step that slow, and waiting
    for a second slow step costs a step at the straggler's pace). A step in which it computed nothing while
    it was slow (the task pool paced its pipeline out: it would not finish one micro-batch before the others
    finish the step) counts as slow with its last figure: being left idle is no sign of recovery. A compute op
    still running when the step ended (a sample's optional third and fourth fields: its seconds so far and the
    ops it will count) is a lower bound of that op's time: a 5x straggler whose pipeline was overtaken ends its
    slow op after the step, and waiting for it to end would judge it one step later."""

    def __init__(self, factor: float, steps: int) -> None:
        self.factor, self.steps = factor, steps
        self._samples: dict[str, tuple[float, int]] = {}  # endpoint -> (busy seconds, ops) at the last look
        self._slow_steps: dict[str, int] = {}  # endpoint -> slow steps in a row
        self._per_op: dict[str, float] = {}  # endpoint -> seconds per op in the last step it computed (or sat out)

    def observe(self, samples: dict[str, tuple[float, int] | tuple[float, int, float, int]],
                stage_of: dict[str, int]) -> list[tuple[str, float, float, int]]:
        """Take this step's counters; return the stragglers as (endpoint, seconds per op, stage median, slow
        steps in a row)."""
        per_op: dict[str, float] = {}
        for ep, sample in samples.items():
            busy, ops = sample[0], sample[1]
            running_s, running_ops = (sample[2], sample[3]) if len(sample) == 4 else (0.0, 0)  # type: ignore[misc]
            last_busy, last_ops = self._samples.get(ep, (0.0, 0))
            self._samples[ep] = (busy, ops)
            if ops > last_ops and busy >= last_busy:
                per_op[ep] = (busy - last_busy) / (ops - last_ops)
            elif ops == last_ops and ep in self._slow_steps and ep in self._per_op:
                per_op[ep] = self._per_op[ep]
            if running_ops > 0 and running_s > 0:  # the op in progress takes at least this long
                per_op[ep] = max(per_op.get(ep, 0.0), running_s / running_ops)
        self._per_op = per_op
        log.debug("compute seconds per op this step: %s", {ep: round(t, 4) for ep, t in sorted(per_op.items())})
        out = []
        for ep, t in per_op.items():
            others = [per_op[o] for o in per_op if o != ep and o in stage_of and stage_of[o] == stage_of.get(ep)]
            median = statistics.median(others) if others else 0.0
            if not others or t <= self.factor * median:
                self._slow_steps.pop(ep, None)
                continue
            self._slow_steps[ep] = self._slow_steps.get(ep, 0) + 1
            if self._slow_steps[ep] >= self.steps or t > self.factor**2 * median:
                out.append((ep, t, median, self._slow_steps[ep]))
        return out


@dataclass
class DriverConfig:
    steps: int
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # 0: only on request
    checkpoint_keep: int = DEFAULT_KEEP  # the newest this many checkpoints stay on disk
    checkpoint_copies: int = CHECKPOINT_COPIES  # other peers that get a copy of every checkpoint
    step_timeout_s: float = STEP_TIMEOUT_S
    max_replans: int = 50
    replan_wait_s: float = REPLAN_WAIT_S
    peers_wait_s: float = math.inf  # how long a plan waits for enough live peers to hold its stages
    ban_s: float = BAN_S
    straggler_factor: float = STRAGGLER_FACTOR  # 0: no straggler detection
    straggler_steps: int = STRAGGLER_STEPS


class PeerShortage:
    """A plan's wait for enough live peers to hold its stages: said once in the log and, through ``on_pause``, in
    the progress record; over after ``wait_s`` (math.inf: never)."""

    def __init__(self, wait_s: float, ban_s: float, on_pause: Callable[[dict[str, Any] | None], None] | None) -> None:
        self.wait_s, self.ban_s, self.on_pause = wait_s, ban_s, on_pause
        self.since: float | None = None

    def short(self, exc: TooFewPeersError) -> None:
        """Too few live peers now; raise StepFailedError once the wait is over."""
        if self.since is None:
            self.since = time.monotonic()
            log.warning("paused: %s; planning again as soon as enough peers are live (a peer left out as dead comes "
                        "back after %.0f s)", exc, self.ban_s)
            if self.on_pause is not None:
                self.on_pause({"reason": f"waiting for peers: {exc}", "since": now(), "until": None})
        if time.monotonic() - self.since > self.wait_s:
            raise StepFailedError(f"{exc} for {self.wait_s:.0f} s") from exc

    def over(self) -> None:
        """A plan was made: end the pause, if there was one."""
        if self.since is not None:
            log.info("enough live peers again after %.0f s: training on", time.monotonic() - self.since)
            if self.on_pause is not None:
                self.on_pause(None)


class RunDriver:
    """Runs ``cfg.steps`` steps of ``spec`` over whatever devices ``live_devices()`` reports."""

    def __init__(self, spec: RunSpec, coordinator: Coordinator, live_devices: Callable[[], dict[int, str]],
                 planner: Planner, build_assignments: AssignmentBuilder, cfg: DriverConfig,
                 on_step: Callable[[StepReport], None] | None = None, epoch: int = 0,
                 on_replan: Callable[[dict[str, Any]], None] | None = None,
                 on_pause: Callable[[dict[str, Any] | None], None] | None = None,
                 inherited: Inherited | None = None) -> None:
        """``on_pause(why or None)``: the run waits for peers (the leader publishes it for `peer status`), or goes
        on; ``inherited``: what the previous leader signed (a new leadership of a running run)."""
        self.spec, self.coordinator, self.live_devices, self.planner = spec, coordinator, live_devices, planner
        self.build_assignments, self.cfg, self.on_step = build_assignments, cfg, on_step
        self.events = RunEvents()
        self.stages: Stages | None = None
        self.pipelines: Pipelines = []
        self.trained = 0  # steps applied everywhere
        self.epoch = epoch  # the last epoch used; the next plan takes epoch + 1 (a new leader starts higher)
        self.on_replan = on_replan
        self.banned = ExpiringBans(cfg.ban_s)  # endpoints declared dead: left out of plans for a while
        self.slow = ExpiringBans(cfg.ban_s)  # stragglers the planner leaves out while a spare can stand in
        self.judge = StragglerJudge(cfg.straggler_factor, cfg.straggler_steps)
        self._fresh_status: tuple[int, dict[str, dict[str, Any] | None]] = (-1, {})  # (trained, answers)
        self.reports: list[StepReport] = []
        self.stop_event = threading.Event()  # set when this leader loses leadership: stop driving at once
        inherited = inherited or Inherited()
        store = None if cfg.checkpoint_dir is None else CheckpointStore(cfg.checkpoint_dir, cfg.checkpoint_keep)
        self.recovery = Recovery(spec, coordinator, store, cfg.checkpoint_copies, self.events, inherited,
                                 peers=self._unbanned_peers, earliest_unverified=self._earliest_unverified)
        # what a peer's claim to hold a stage must match: its replicas' agreed hash, or the previous leader's record
        self.digests = inherited.digests
        self._attempt = 0  # of the re-plan running now
        # a healed partition (peer.node.leader_role): the endpoints whose state the next plan keeps (None: any
        # holder at the trained step), and those whose state it never keeps (the discarded side's)
        self.keep_only: set[str] | None = None
        self.discard: set[str] = set()
        self.replan_on_join = False  # replan_when_a_peer_joins
        self.on_pause = on_pause

    def replan_when_a_peer_joins(self, wanted: bool) -> None:
        """The owner has news for the next plan (peers newly credited with work): re-plan when a peer joins, even
        one the plan will not use (a new identity must meet a plan that says whose testimony counts)."""
        self.replan_on_join = wanted

    def _unbanned_peers(self) -> list[str]:
        """The live peers not banned: where a checkpoint copy may be asked for."""
        return sorted({ep for ep in self.live_devices().values() if ep not in self.banned})

    def _earliest_unverified(self) -> int | None:
        """The first step of unverified work a live worker of the plan applied (its checkpoint must stay)."""
        c = self.coordinator
        return c.verification.earliest_unverified([ep for ep in c.assignments if ep not in c.dead])

    def _check_stopped(self) -> None:
        if self.stop_event.is_set():
            raise InterruptedError("the driver was stopped (leadership lost)")

    # ------------------------------------------------------------------------------------------------ run
    def run(self, resume: bool = False, takeover: tuple[int, Stages] | None = None) -> list[StepReport]:
        """Train to ``cfg.steps``. ``resume``: start from the latest checkpoint. ``takeover=(trained, stages)``:
        continue a run whose previous leader died, from the workers' own state."""
        restore = self.recovery.latest(ask_peers=self.cfg.checkpoint_copies > 0) if resume else None
        if restore is not None:
            skipped = self.recovery.skipped()
            self.events.resumed(restore, skipped)
            if skipped:
                log.warning("resuming from the checkpoint of step %d: the newer one(s) of step(s) %s are damaged",
                            restore, skipped)
            else:
                log.info("resuming from the checkpoint of step %d", restore)
            self._load_checkpoint_stages(restore)
        elif takeover is not None:
            self.trained, self.stages = takeover[0], [(int(a), int(b)) for a, b in takeover[1]]
        elif resume:
            log.warning("--resume: no usable checkpoint in %s; starting at step 0", self.cfg.checkpoint_dir)
        self._replan_until_done(reason="takeover" if takeover else "start", restore_step=restore)
        replans = 0
        while self.trained < self.cfg.steps:
            self._check_stopped()
            if self._at_round_start() and self._membership_changed():
                self._replan_until_done(reason="membership changed")
            self._fresh_status = (-1, {})  # what a step may change is asked again after it
            try:
                report = self.coordinator.run_step(self.trained, timeout_s=self.cfg.step_timeout_s,
                                                   overlap=self._overlaps(self.trained))
            except StepFailedError as exc:
                replans += 1
                if replans > self.cfg.max_replans:
                    raise
                if isinstance(exc, OuterRoundFailedError):  # DiLoCo: the inner step stands, the round goes on
                    self.trained += 1
                    self.reports.append(exc.report)
                    if self.on_step:
                        self.on_step(exc.report)
                log.warning("step %d did not finish (%s); re-planning", self.trained, exc)
                self._ban_dead()
                time.sleep(self.cfg.replan_wait_s)
                if not self._discard_cheats():
                    self._replan_until_done(reason=str(exc))
                continue
            self.trained += 1
            self.reports.append(report)
            if report.stage_hashes:
                self.digests = Digests(self.trained, dict(report.stage_hashes))
            if self.on_step:
                self.on_step(report)
            if self._discard_cheats():
                continue
            if self.trained < self.cfg.steps and self._at_round_start() and self._check_stragglers():
                self._replan_until_done(reason="straggler")
            if self.cfg.checkpoint_every and self.trained % self.cfg.checkpoint_every == 0 and self._at_round_start():
                self._land_outer()
                self.checkpoint()
        self._land_outer()
        if not self.coordinator.wait_in_sync():  # laggards reload in the background: the run's states are read next
            log.warning("some workers did not reload their stage after the last step: %s", self.coordinator.dead)
        return self.reports

    def _overlaps(self, step: int) -> bool:
        """Whether ``step``'s outer round lands one step late (``RunSpec.outer_overlap``): not the run's last
        step, whose round must land for the run's states to be read."""
        return self.spec.outer_overlap and (step + 1) % self.spec.sync_period == 0 and step + 1 < self.cfg.steps

    def _land_outer(self) -> None:
        """Land an overlapped outer round in flight now (before a re-plan, a checkpoint, the run's end): every
        replica then holds the new anchor, as after a round in step. One that cannot land fails as a round in step
        does: the next round covers it, and the swarm re-plans."""
        try:
            report = self.coordinator.land_outer(timeout_s=self.cfg.step_timeout_s)
        except StepFailedError as exc:
            log.warning("the outer round of step %d did not land (%s); re-planning", self.trained - 1, exc)
            self._replan_until_done(reason=str(exc))
            return
        if report is None:
            return
        self._fresh_status = (-1, {})  # the landing moved every participant's parameters: ask again
        if self.reports and self.reports[-1].step == report.step:
            self.reports[-1].outer = report.outer
        if report.stage_hashes:
            self.digests = Digests(self.trained, dict(report.stage_hashes))

    def _at_round_start(self) -> bool:
        """DiLoCo (``sync_period > 1``): whether the next step starts an outer round, where re-plans and
        checkpoints wait: only there do all replicas of a stage agree (peer.runtime.outer)."""
        return self.trained % self.spec.sync_period == 0

    def heal(self, step: int, epoch: int, keep: set[str] | None, discard: set[str]) -> None:
        """A partition healed (between steps, on the driver's thread): train on from ``step`` with the state
        of the peers in ``keep`` (None: this leader's own side), never keeping the state of ``discard`` (the
        losing side, whose work is dropped); the next plan's epoch is above ``epoch`` (the other side's)."""
        self.epoch = max(self.epoch, epoch)
        self.digests = Digests()  # the kept side's parameters were never compared with this side's record
        if step != self.trained:
            self.reports = [r for r in self.reports if r.step < min(step, self.trained)]
            self.coordinator.verification.rolled_back(min(step, self.trained))  # the work after it is not ours
            self.trained = step
        self.keep_only, self.discard = keep, set(discard)

    def _ban_dead(self) -> None:
        self.banned |= set(self.coordinator.dead)

    def _discard_cheats(self) -> bool:
        """After a step: when a spot check excluded a peer whose unverified work reached the model (the ledger of
        ``peer.runtime.lead.verify.Verification``), ban it for good and roll the run back to the newest verified
        checkpoint of at most its first unverified step (step 0 without one), redoing the steps since. True when
        it re-planned."""
        undo = self.coordinator.verification.take_rollback()
        if undo is None:
            return False
        first, culprits, why = undo
        for ep in culprits:
            self.banned.forever(ep)
        self._ban_dead()
        if first >= self.trained:  # a roll-back never goes forward: nothing it touched is applied
            return False
        self._replan_until_done(reason=f"spot check excluded {', '.join(culprits)}", undo=(first, why))
        return True

    # ------------------------------------------------------------------------------------------ stragglers
    def _check_stragglers(self) -> bool:
        """After a step: ask every worker for its compute counters; a straggler (:class:`StragglerJudge`) is
        reported (log, ``events.stragglers``) and, when a spare device can take its place, left out of the next
        plan. True when that calls for a re-plan."""
        if not self.cfg.straggler_factor:
            return False
        assignments = dict(self.coordinator.assignments)
        if max(Counter(a.stage for a in assignments.values()).values(), default=0) < 2:
            return False  # a straggler is slow against its stage's other replicas: no stage has two, ask nobody
        answers = dict(_ask_statuses(self.coordinator, sorted(assignments)))  # the unreachable: liveness's business
        self._fresh_status = (self.trained, answers)  # the re-plan that may follow need not ask again
        samples = {ep: sample for ep, st in answers.items() if st and (sample := _counters(st)) is not None}
        replan = False
        for ep, t, median, slow_steps in self.judge.observe(samples, {ep: a.stage for ep, a in assignments.items()}):
            if ep in self.slow:
                continue
            spare = self._spares()
            info = {"endpoint": ep, "step": self.trained, "seconds_per_op": t, "stage_median_s": median,
                    "replaced": bool(spare)}
            self.events.stragglers.append(info)
            log.warning("straggler %s: %.3f s per op against its stage's median %.3f s for %d step(s)%s",
                        ep, t, median, slow_steps,
                        "; the next plan puts a spare in its place" if spare else "; no spare to replace it")
            if spare:
                self.slow.add(ep)
                replan = True
        return replan

    def _spares(self) -> list[str]:
        """Live, usable devices the current plan leaves out."""
        planned = set(self.coordinator.assignments)
        return [ep for ep in self.live_devices().values()
                if ep not in planned and ep not in self.banned and ep not in self.slow]

    def _membership_changed(self) -> bool:
        """A worker died at a step boundary, or a new device joined."""
        live = {ep for ep in self.live_devices().values() if ep not in self.banned and ep not in self.slow}
        planned = set(self.coordinator.assignments)
        if self.keep_only is not None or self.discard:  # a healed partition (seen while reading ``live``)
            return True
        if self.replan_on_join and live - planned:
            self.replan_on_join = False
            return True
        if self.coordinator.dead:
            self._ban_dead()
            return True
        departed = planned - set(self.live_devices().values())  # left on purpose (a tombstone): no ban
        if departed:
            log.info("%d planned peer(s) left the swarm: re-planning without them", len(departed))
            return True
        # a newcomer matters only if it lets the plan grow by a replica (else it stays a spare)
        return bool(live - planned) and len(live) // len(self.stages or [()]) > len(self.pipelines)

    # --------------------------------------------------------------------------------------------- replan
    def _replan_until_done(self, reason: str, restore_step: int | None = None,
                           undo: tuple[int, str] | None = None) -> None:
        """Re-plan; when a worker fails to take its assignment (it died meanwhile), exclude it and try again;
        when too few peers are live to hold the stages, wait for more (:class:`PeerShortage`). ``undo=(step,
        why)``: roll back to a checkpoint of at most ``step`` (:meth:`_discard_cheats`)."""
        if undo is None:
            self._land_outer()  # the new plan starts with every replica at the anchor
        else:
            self.coordinator.drop_outer()  # a roll-back: the round's work is discarded with the rest
        attempt, shortage = 0, PeerShortage(self.cfg.peers_wait_s, self.cfg.ban_s, self.on_pause)
        while True:
            self._check_stopped()
            try:
                self._attempt = attempt  # a retry fetches from another holder (one may serve a fetcher other bytes)
                self._replan(reason=reason if attempt == 0 else f"{reason} (retry {attempt})",
                             restore_step=restore_step, undo=undo)
                return shortage.over()
            except TooFewPeersError as exc:
                self._ban_dead()
                shortage.short(exc)
            except ReplanNeededError as exc:
                attempt += 1
                if attempt >= self.cfg.max_replans:
                    raise StepFailedError(f"could not form a plan after {self.cfg.max_replans} attempts") from exc
                log.warning("re-plan failed: %s", exc)
                self._ban_dead()
            time.sleep(self.cfg.replan_wait_s)

    def _replan(self, reason: str = "start", restore_step: int | None = None,
                undo: tuple[int, str] | None = None) -> None:
        live = {d: ep for d, ep in self.live_devices().items() if ep not in self.banned and ep not in self.slow}
        stages, pipelines = self.planner(sorted(live), self.stages)
        predicted = getattr(self.planner, "last_predicted", None) or {}
        if isinstance(predicted.get("total_s"), int | float) and predicted["total_s"] > 0:
            # a micro-batch's lease-to-commit time is at most a step's: leases start from the plan's figure
            self.coordinator.pacing.predict(float(predicted["total_s"]))
        self.stages = stages
        self.epoch += 1
        assignments = self.build_assignments(stages, pipelines, self.epoch)
        # at step 0 every stage starts from the seeded initialiser: nobody needs to be asked
        why = "every replica of a stage is gone"
        if undo is not None and undo[0] < self.trained:
            # an excluded cheater's unverified work: the newest verified checkpoint from before it (never forward)
            sources, rollback = {}, self.recovery.rollback_point(undo[0])
            why = f"work of an excluded peer no spot check verified was applied from step {undo[0]} on ({undo[1]})"
        else:
            holders = self._holders(set(live.values())) if self.trained > 0 or restore_step is not None else {}
            sources, rollback = self._sources(assignments, holders, restore_step)
        if rollback is not None:
            redone = self.trained - rollback
            seeded = self.recovery.seeded(rollback)  # no checkpoint: the seeded initial state is step 0's
            log.warning(
                "%s; rolling back to %s, redoing %d step(s)", why,
                "step 0 (no checkpoint: the seeded initial state)" if seeded else f"the checkpoint of step {rollback}",
                redone,
            )
            self.events.rollbacks.append({"from_step": self.trained, "to_step": rollback, "redone": redone,
                                          "reason": why[:500]})
            self.coordinator.verification.rolled_back(rollback)
            if seeded:
                sources = {ep: StateSource.init() for ep in assignments}
            else:
                self._load_checkpoint_stages(rollback)
                sources = {ep: StateSource.fetch(self.coordinator.endpoint, rollback) for ep in assignments}
            self.trained = rollback
            self.reports = [r for r in self.reports if r.step < rollback]
        try:
            self.coordinator.assign(assignments, sources)  # a new plan: the coordinator forgets the dead
        except ReplanNeededError:  # a fetcher refused its source's state, maybe: was the source lying?
            _ban_lying_sources(self.coordinator, sources, self.banned)
            raise
        self.keep_only, self.discard = None, set()  # a healed partition's sides are one plan now
        self.pipelines = pipelines
        info = {
            "epoch": self.epoch,
            "reason": reason,
            "step": self.trained,
            "devices": sorted(live),
            "stages": [list(s) for s in stages],
            "pipelines": pipelines,
            "at": time.time(),
        }
        self.events.replans.append(info)
        if self.on_replan:
            self.on_replan(info)
        log.info("plan epoch %d (%s): stages %s, pipelines %s, continuing at step %d", self.epoch, reason, stages,
                 pipelines, self.trained)

    def _holders(self, live: set[str]) -> dict[int, list[str]]:
        """Stage index -> live endpoints holding that stage at the trained step (asked, not assumed)."""
        # answers the straggler check got just after this very step are reused once (a re-plan for a straggler
        # then costs no second set of status queries); anyone else is asked
        trained, fresh = self._fresh_status
        self._fresh_status = (-1, {})
        known = {ep: st for ep, st in fresh.items() if ep in live and st} if trained == self.trained else {}
        answers = [*known.items(), *_ask_statuses(self.coordinator, sorted(live - set(known)))]  # unreachable: none
        kept = [(ep, st) for ep, st in answers if ep not in self.discard  # a healed partition: the losing side's
                and (self.keep_only is None or ep in self.keep_only)]  # state is not kept
        return _stage_holders(kept, self.stages or [], self.trained, self.digests.at(self.trained),
                              majority=self._at_round_start())

    def _sources(
        self, assignments: dict[str, Assignment], holders: dict[int, list[str]], restore_step: int | None
    ) -> tuple[dict[str, StateSource], int | None]:
        """Where each assignee gets its state; the checkpoint step to roll back to when a stage is lost."""
        if restore_step is not None:
            return {ep: StateSource.fetch(self.coordinator.endpoint, restore_step) for ep in assignments}, None
        if self.trained == 0 and not holders:
            return {ep: StateSource.init() for ep in assignments}, None
        sources: dict[str, StateSource] = {}
        expected = self.digests.at(self.trained)
        for ep, a in assignments.items():
            have = holders.get(a.stage, [])
            if ep in have:
                sources[ep] = StateSource.keep(self.trained)
            elif have:
                src = have[self._attempt % len(have)]
                sources[ep] = StateSource.fetch(src, self.trained, expected.get(tuple(a.layers), ""))
            elif self.trained == 0:
                sources[ep] = StateSource.init()
            else:
                return {}, self.recovery.rollback_point(self.trained)  # a wiped stage never ends the run
        return sources, None

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint(self) -> Path | None:
        """Write every stage's state at the trained step (one replica each); return the folder
        (:meth:`Recovery.write`: a failure is logged and counted, never fatal)."""
        stages = list(self.stages or [])  # read once: another thread (a peer leaving) may call this
        return self.recovery.write(self.trained, stages, self.digests)

    def wait_for_copies(self, timeout_s: float | None = None) -> None:
        """Wait until the last checkpoint's copies were sent (tests; a leader leaving gracefully)."""
        self.recovery.wait_for_copies(timeout_s)

    def _load_checkpoint_stages(self, step: int) -> None:
        """Train on from the checkpoint of ``step`` (the coordinator serves it to the workers that fetch it)."""
        self.stages = self.recovery.load(step, self.stages)
        self.trained = step


def _stage_holders(answers: list[tuple[str, dict[str, Any] | None]], stages: Stages, trained: int,
                   expected: dict[tuple[int, int], str] | None = None,
                   majority: bool = False) -> dict[int, list[str]]:
    """Stage index -> the endpoints whose Status reply names a stage of the run at the ``trained`` step. A reply is
    a claim: anything else (another step, layers no stage has, no reply) holds nothing. Where ``expected`` has the
    stage's parameters hash (what its replicas agreed on, or the previous leader recorded), only a claim carrying
    that hash holds it; otherwise, with ``majority`` (the replicas must agree: exact training or a DiLoCo round's
    start), a hash a strict majority of the claims share excludes the others."""
    claims: dict[int, list[tuple[str, Any]]] = {}
    for ep, st in answers:
        layers = st.get("layers") if st else None
        if st and st.get("trained_steps") == trained and isinstance(layers, list) and tuple(layers) in stages:
            claims.setdefault(stages.index(tuple(layers)), []).append((ep, st.get("params_hash")))
    out: dict[int, list[str]] = {}
    for stage, group in claims.items():
        want = (expected or {}).get(stages[stage])
        if want is None and majority:
            tally = Counter(h for _, h in group if isinstance(h, str) and h)
            top = tally.most_common(1)
            want = top[0][0] if top and 2 * top[0][1] > len(group) else None
        kept = [ep for ep, h in group if want is None or h == want]
        for ep, h in group:
            if ep not in kept:
                log.warning("%s claims stage %s at step %d with parameters hashing %r, not %s: it holds nothing",
                            ep, list(stages[stage]), trained, h if isinstance(h, str) else None, want)
        if kept:
            out[stage] = kept
    return out


def _ban_lying_sources(coordinator: Coordinator, sources: dict[str, StateSource], banned: ExpiringBans) -> set[str]:
    """After a plan failed: the fetch sources whose state does not hash to what the leader expected for it (its
    fetcher would have refused it). The fetcher's refusal is a claim too, so the leader fetches and hashes the
    source's state itself; a source that serves it other parameters than it claimed is banned for good."""
    liars: set[str] = set()
    for src in {s.endpoint for s in sources.values() if s.kind is SourceKind.FETCH and s.params_hash} - {None}:
        want = next(s.params_hash for s in sources.values() if s.endpoint == src)
        try:
            params = coordinator.fetch_state(src)["params"]  # type: ignore[index]
        except Exception as exc:  # unreachable or refusing: the re-plan's own checks handle that
            log.info("could not check the state %s serves: %s", src, exc)
            continue
        got = flat_digest(params)
        if got != want:
            log.error("%s serves stage parameters hashing %s, not the %s it claimed: banned for good", src, got, want)
            banned.forever(src)  # type: ignore[arg-type]
            liars.add(src)  # type: ignore[arg-type]
    return liars


def _counters(status: dict[str, Any]) -> tuple[float, int, float, int] | None:
    """A worker's compute counters from its Status reply (busy seconds, ops, the running op's seconds and op
    count), or None when they are not finite non-negative numbers: the reply is the worker's claim."""
    names = ("busy_s", "forward", "backward", "running_s", "running_ops")
    values = [status.get(k, 0) for k in names]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values):
        log.warning("status of %s carries counters that are not numbers; ignored", status.get("peer_id", "a worker"))
        return None
    busy, fwd, bwd, running, ops = values
    return float(busy), int(fwd) + int(bwd), float(running), int(ops)


def _ask_statuses(coordinator: Coordinator, endpoints: list[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """Every endpoint's Status reply (a claim, checked by the caller), asked in parallel; None when unreachable."""

    def ask(ep: str) -> tuple[str, dict[str, Any] | None]:
        try:
            return ep, coordinator.worker_status(ep)
        except Exception as exc:
            log.info("status of %s: %s", ep, exc)
            return ep, None

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(ask, endpoints))
