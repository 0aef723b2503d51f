"""The step machine: one training step's state and phases, as events in and commands out.

A step (docs/architecture.md, "One step") goes compute -> reduce -> apply -> [outer -> outer apply] -> done:

* compute: ``start`` tells every worker of an intact pipeline the step (the other stages first, then the
  first stages, which start leasing). ``lease`` and ``commit`` answer the feeders from the task pool.
* reduce: once the pool is complete, the commit record goes to every live worker of an intact pipeline and the
  machine waits for each one's ``reduced`` of that attempt.
* apply: then ``apply``, and the machine waits for every live one's ``synced``. A DiLoCo inner step's reduce is
  local (each pipeline applies its own share), so it goes to every worker of every live pipeline as one round
  with its apply (``Reduce(apply=True)``): the machine goes straight to apply and waits for ``synced``.
* outer (DiLoCo, the last inner step of a round): the live pipelines average their pseudo-gradients (a death
  restarts the averaging without that pipeline), then the outer step, as a second reduce and apply.
* overlap (``RunSpec.outer_overlap``): the round-end step sends the outer reduce and ends at once, handing the
  round on (:class:`OuterInFlight`, ``carry``); the next step's machine gets it as ``in_flight``, restarts it
  without a pipeline that lost a member while it computes, and after its own apply lands it (outer, outer
  apply of the earlier step). A machine made with ``land_only`` does only that (a re-plan, a checkpoint or the
  run's end wants every replica at the anchor first).

A death (``died``), a lease past its deadline or a micro-batch a speculative copy won drops that pipeline from
the step: the pool requeues its work, its survivors are told to drop the step, and when the feeders had already
been told the pool was complete, the intact pipelines get a new attempt (a restarted averaging goes back to
compute). A death is accounted before the pool's completeness is judged, so a commit record never names a
pipeline that lost a member. No pipeline intact: the step fails and the driver re-plans.

The machine does no I/O, starts no thread and reads no clock: every event carries ``now`` (seconds on the
caller's monotonic clock), and the task pool reads the same ``now``. That is what lets every transition be
tested in virtual time (tests/runtime/test_step_machine.py). Its owner (peer.runtime.lead.coordinator) serialises the
calls, carries out the commands in order, and calls ``tick`` whenever it wakes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.lead.pool import CommitResult, TaskPool
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.spot import Finding, SpotChecks
from tasklet.peer.runtime.lead.step import (
    OuterInFlight,
    OuterRoundFailedError,
    ReplanNeededError,
    StepFailedError,
    StepPhase,
    StepReport,
    StepState,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to each of ``endpoints``. ``wait``: the owner waits for every answer before its next command
    (a worker that does not answer is checked for death); else it is sent in the background, then ``then`` (the
    feeders' ``start_step`` after the other stages'). ``rejoin``: once answered, the owner reports
    :meth:`StepMachine.rejoined` for that pipeline and ``msg``'s attempt."""

    endpoints: tuple[str, ...]
    msg: ctl.Message
    wait: bool = False
    then: Send | None = None
    rejoin: int | None = None


@dataclass(frozen=True)
class Emit:
    """Tell the observer (``Coordinator.on_event``) ``name`` with ``info``."""

    name: str
    info: dict[str, Any]


@dataclass(frozen=True)
class Fail:
    """The step is over without being applied (or, :class:`OuterRoundFailedError`, without its outer step)."""

    error: StepFailedError


@dataclass(frozen=True)
class Done:
    """The step is applied by ``members`` (the live workers it was applied on). ``check``: compare the replicas'
    parameters hashes now; ``catch_up``: the live workers of pipelines left out reload their stage."""

    members: tuple[str, ...]
    check: bool
    catch_up: bool


@dataclass(frozen=True)
class Spot:
    """A spot check's finding (``peer.runtime.lead.spot``) for the owner to act on: credit, exclusion, a report to
    the referee, probation. The machine has already set the pipelines it names aside where the step needs it."""

    finding: Finding


Command = Send | Emit | Fail | Done | Spot


@dataclass
class PoolAnswer:
    """The answer to a lease or commit: the pool's status, the micro-batch leased, whether it is a speculative
    copy, a commit's lease-to-commit seconds (when it counted), and the commands it caused."""

    status: ctl.PoolStatus
    microbatch: int | None = None
    speculative: bool = False
    seconds: float | None = None
    commands: list[Command] = field(default_factory=list)


class StepMachine:
    """One step of a plan (module docstring). ``dead``: the plan's workers already dead; ``syncing``: pipelines
    left out until they reloaded their stage; ``speculate_after``: the pool's thresholds (TaskPool.lease);
    ``judge_after_s``: how long a worker's error waits before it is judged (a dying sender is noticed first)."""

    def __init__(self, step: int, roster: Roster, n_microbatches: int, *, now: float, timeout_s: float,
                 lease_timeout_s: float, sync_period: int = 1, dead: Sequence[str] = (),
                 syncing: set[int] | None = None, service_s: dict[int, float] | None = None,
                 speculate_after: tuple[float | None, float | None] = (None, None),
                 judge_after_s: float = 0.0, spot: SpotChecks | None = None, overlap: bool = False,
                 in_flight: OuterInFlight | None = None, land_only: bool = False, record: str = "") -> None:
        if land_only and in_flight is None:
            raise ValueError("land_only needs an outer round in flight")
        step = in_flight.step if land_only and in_flight else step
        self.step, self.roster, self.sync_period = step, roster, sync_period
        self.overlap, self.in_flight, self.land_only = overlap, in_flight, land_only
        self.carry: OuterInFlight | None = None  # overlap: the outer round this step started and hands on
        self._outer_step = step  # the step whose outer round the outer phases act on
        self._landed: list[int] | None = None  # the in-flight round's participants, once it landed here
        self.now = self.started = now
        self.deadline = now + timeout_s
        self.dead: set[str] = set(dead)
        self.speculate_after, self.judge_after_s = speculate_after, judge_after_s
        pool = TaskPool(step, n_microbatches, lease_timeout_s=lease_timeout_s, clock=lambda: self.now,
                        service_s=service_s)
        self.state = StepState(pool=pool, syncing=set(syncing or ()))
        self._outer: list[int] = []
        self.spot = spot  # spot checks of this step (None: off)
        self.record = record  # the leader's signed record of the steps trained before this one, in every start_step

    @property
    def phase(self) -> StepPhase:
        return self.state.phase

    @property
    def pool(self) -> TaskPool:
        return self.state.pool

    def intact(self) -> list[int]:
        """Pipelines whose every member is alive and that are neither dropped from this step nor syncing."""
        broken = self.roster.pipelines_of(self.dead) | self.state.dropped | self.state.syncing
        return [r for r in range(self.roster.n_pipelines) if r not in broken]

    # ------------------------------------------------------------------------------------------ events
    def start(self) -> list[Command]:
        """The step's first commands: ``start_step`` to the intact pipelines, or a failure."""
        if self.land_only:
            out: list[Command] = []
            try:
                self._land(out)
            except StepFailedError as exc:
                out.extend(self._fail(exc))
            return out
        mid_round = self.sync_period > 1 and self.step % self.sync_period != 0
        if self.dead and not (mid_round and self.roster.alive_pipelines(self.dead)):
            # DiLoCo mid-round: the pipelines that lost a member sit out the rest of the round (peer.runtime.outer)
            return self._fail(ReplanNeededError(
                f"step {self.step}: workers died since the plan was made: {sorted(self.dead)}"))
        intact = self.intact()
        if not intact:
            return self._fail(ReplanNeededError(
                f"step {self.step}: no pipeline in sync (syncing: {sorted(self.state.syncing)})"))
        start = ctl.StartStep(self.step, 0, record=self.record)
        return [Send(tuple(self.roster.members(intact, self.dead, first=False)), start, True),
                Send(tuple(self.roster.members(intact, self.dead, first=True)),
                     replace(start, feed=True), True)]

    def lease(self, pipeline: int, now: float) -> PoolAnswer:
        """A first stage of ``pipeline`` asks for a micro-batch."""
        self.now = now
        st, pool = self.state, self.state.pool
        if st.phase is StepPhase.FAILED:
            return PoolAnswer(ctl.PoolStatus.WAIT)
        if (shadow := self._shadow(pipeline)) is not None:
            return shadow
        if pool.complete():
            if self.spot is not None and not self.spot.settled(pool.assignment()):
                return PoolAnswer(ctl.PoolStatus.WAIT)  # a check may still want a copy: the feeders stay
            st.stop_feeders()
            return PoolAnswer(ctl.PoolStatus.DONE)
        if pipeline in st.syncing:  # not in sync (a start_step of before it was dropped): no work
            return PoolAnswer(ctl.PoolStatus.WAIT)
        mb = pool.lease(pipeline, *self.speculate_after)
        out: list[Command] = []
        if pool.losers():  # a pipeline given up on (TaskPool.abandoned): its work goes back to the pool now
            self._drop_broken(out)
            if mb is None:
                mb = pool.lease(pipeline, *self.speculate_after)
        if mb is None:
            return PoolAnswer(ctl.PoolStatus.WAIT, commands=out)
        speculative = pool.is_speculative(mb, pipeline)
        if speculative:
            log.info("step %d: micro-batch %d copied to pipeline %d (a straggler holds it)", self.step, mb, pipeline)
        elif self.spot is not None:
            self.spot.sample(mb, pipeline)
        st.leased_at[(mb, pipeline)] = now
        out.append(Emit("lease", {"step": self.step, "microbatch": mb, "pipeline": pipeline,
                                  "speculative": speculative}))
        return PoolAnswer(ctl.PoolStatus.LEASE, mb, speculative, commands=out)

    def commit(self, microbatch: int, pipeline: int, now: float) -> PoolAnswer:
        """``pipeline`` finished ``microbatch`` on every stage (the first commit wins)."""
        self.now = now
        st = self.state
        if self.spot is not None and self.spot.is_copy(microbatch, pipeline):
            self.spot.commit(microbatch, pipeline, now)  # a shadow: compared, never summed
            return PoolAnswer(ctl.PoolStatus.DUPLICATE, microbatch, commands=[Emit("commit", {
                "step": self.step, "microbatch": microbatch, "pipeline": pipeline, "result": "shadow"})])
        result = st.pool.commit(microbatch, pipeline)
        if self.spot is not None and result is CommitResult.COMMITTED:
            self.spot.commit(microbatch, pipeline, now)
        leased = st.leased_at.get((microbatch, pipeline))
        seconds = now - leased if result is CommitResult.COMMITTED and leased is not None else None
        out: list[Command] = [Emit("commit", {"step": self.step, "microbatch": microbatch, "pipeline": pipeline,
                                              "result": result.value})]
        if st.pool.losers():  # the original holder of a micro-batch a copy won has it in its sum: drop it now,
            self._drop_broken(out)  # before the pool can look complete with its commits in it
        return PoolAnswer(ctl.PoolStatus(result.value), microbatch, seconds=seconds, commands=out)

    def loss(self, sender: str, pipeline: int, microbatch: int, loss: float, now: float) -> None:
        self.now = now
        self.state.losses[(microbatch, pipeline)] = loss
        if self.spot is not None and 0 <= microbatch < self.pool.n_microbatches:
            self.spot.loss(microbatch, pipeline, loss)
        if self.roster.is_last(sender):
            self.state.pool.progress(microbatch, pipeline)  # its forward crossed every stage (stragglers)

    def sketch(self, pipeline: int, stage: int, microbatch: int, points: dict[str, tuple[float, ...]]) -> bool:
        """A stage's sketches of a micro-batch (spot checks); False when they were not taken."""
        if not (0 <= microbatch < self.pool.n_microbatches and 0 <= pipeline < self.roster.n_pipelines):
            return False  # bounded: nothing is kept for a micro-batch or pipeline the step does not have
        return self.spot is not None and self.spot.sketch(microbatch, pipeline, stage, points)

    def _shadow(self, pipeline: int) -> PoolAnswer | None:
        """A shadow copy of a checked micro-batch for ``pipeline``'s feeder, before any free work (spot checks)."""
        st, pool, spot = self.state, self.state.pool, self.spot
        if spot is None or st.phase is not StepPhase.COMPUTE or pipeline not in self.intact():
            return None
        mb = spot.shadow_for(pipeline, lambda m: pipeline not in pool.held_by(m), self.now)
        if mb is None:
            return None
        pool.hold(mb, pipeline)
        log.info("step %d: micro-batch %d shadowed on pipeline %d (spot check)", self.step, mb, pipeline)
        return PoolAnswer(ctl.PoolStatus.LEASE, mb, True, commands=[Emit("lease", {
            "step": self.step, "microbatch": mb, "pipeline": pipeline, "speculative": True, "shadow": True})])

    def _spot_judge(self, out: list[Command]) -> None:
        """Decide what the spot checks can decide now; set aside the pipelines a finding puts out of the step
        before anything else is judged (so a pipeline to be excluded never reaches the reduce)."""
        spot, pool = self.spot, self.state.pool
        if spot is None or self.state.phase is not StepPhase.COMPUTE:
            return
        intact = self.intact()
        free = lambda mb, copies: any(p not in copies and p not in pool.held_by(mb) for p in intact)  # noqa: E731
        for f in spot.judge(self.now, pool.assignment(), free):
            if f.kind == "verified":
                for p in f.pipelines:
                    pool.backup(f.microbatch, p)
            else:
                for p in f.pipelines:
                    self.set_aside(p, self.now)
            out.append(Spot(f))

    def reduced(self, sender: str, attempt: int, step: int | None = None) -> None:
        """``sender`` averaged ``attempt`` (of ``step``: this one's, or an overlapped outer round's)."""
        fl = self._travelling()
        if fl is not None and step == fl.step:
            if attempt == fl.attempt:
                fl.reduced.add(sender)
            return
        if attempt == self.state.attempt:
            self.state.reduced.add(sender)

    def _travelling(self) -> OuterInFlight | None:
        """The overlapped outer round whose reports are kept apart: the one this step handed on, or the one in
        flight here until it lands (from then on its reports are the step's own)."""
        if self.carry is not None:
            return self.carry
        fl = self.in_flight
        return fl if fl is not None and self._outer_step != fl.step else None

    def carries(self, step: int) -> bool:
        """Whether reports of ``step`` belong here: this step's, or an overlapped outer round's."""
        return step == self.step or any(f is not None and f.step == step for f in (self.carry, self.in_flight))

    def synced(self, sender: str, trained_steps: int, params_hash: str) -> None:
        self.state.synced.add(sender)
        if params_hash:
            self.state.hashes[sender] = (trained_steps, params_hash)

    def died(self, endpoint: str) -> None:
        """A worker of the plan is dead; its pipeline is dropped at the next ``tick``."""
        if endpoint in self.roster.assignments:
            self.dead.add(endpoint)

    def set_aside(self, pipeline: int, at: float) -> None:
        """Drop ``pipeline`` from this step at the first ``tick`` from ``at`` on, without declaring anyone dead (a
        reporter whose report nobody corroborated yet, ``peer.runtime.lead.referee``): the intact pipelines redo its
        work, and its workers catch up after the apply like an overtaken pipeline's."""
        if 0 <= pipeline < self.roster.n_pipelines:
            self.state.aside.setdefault(pipeline, at)

    def keep(self, pipeline: int) -> None:
        """Cancel a set-aside that has not taken effect (its report was corroborated meanwhile)."""
        if pipeline not in self.state.dropped:
            self.state.aside.pop(pipeline, None)

    def error(self, sender: str, pipeline: int, what: str, error: str, now: float, step: int | None = None) -> bool:
        """A worker's task failed. Judged ``judge_after_s`` later (``tick``): an error during averaging or apply
        with the sender still alive fails the step; anything else shows up as a death or finishes. False: ignored
        (its pipeline is out of the step, or it is dead)."""
        st = self.state
        if sender in self.dead:
            return False
        fl = self._travelling()
        if fl is not None and step == fl.step:  # the overlapped round, before it lands: judged there
            fl.judging.append((now + self.judge_after_s, sender, error))
            return True
        if pipeline in st.dropped or pipeline in st.syncing:
            return False
        st.judging.append((now + self.judge_after_s, sender, what, error))
        return True

    def rejoin(self, pipeline: int) -> list[Command]:
        """Every member of syncing ``pipeline`` reloaded its stage: it gets the step (every member first, so that
        a reduce sent later is not dropped by a member still in the step before), then ``rejoined``."""
        st = self.state
        if st.phase is not StepPhase.COMPUTE or pipeline not in st.syncing:
            return []
        return [Send(tuple(self.roster.members([pipeline], self.dead)), ctl.StartStep(self.step, st.attempt,
                                                                                       record=self.record),
                     rejoin=pipeline)]

    def rejoined(self, pipeline: int, attempt: int) -> list[Command]:
        """Every member of ``pipeline`` has attempt ``attempt`` of the step: its feeders start, unless too late."""
        st = self.state
        if st.phase is not StepPhase.COMPUTE or st.attempt != attempt or pipeline not in st.syncing:
            return []  # too late for this step: it joins the next one
        st.syncing.discard(pipeline)
        log.info("step %d: pipeline %d is in sync again and joins the step", self.step, pipeline)
        firsts = tuple(ep for ep in self.roster.members([pipeline], self.dead, first=True))
        return [Send(firsts, ctl.StartStep(self.step, attempt, feed=True, record=self.record))]

    def tick(self, now: float) -> list[Command]:
        """Time passed, or something changed: judge errors, drop broken pipelines, move on when the phase's
        condition holds, fail at the deadline."""
        self.now = now
        out: list[Command] = []
        if self.state.phase in (StepPhase.DONE, StepPhase.FAILED):
            return out
        try:
            self._judge()
            self._spot_judge(out)
            self._restart_in_flight(out)
            while self._advance(out):
                pass
        except StepFailedError as exc:
            out.extend(self._fail(exc))
        return out

    # --------------------------------------------------------------------------------------- transitions
    def _advance(self, out: list[Command]) -> bool:
        """One phase's check; True when the phase changed (check again)."""
        st, what = self.state, self._what()
        if st.phase in (StepPhase.COMPUTE, StepPhase.REDUCE):
            if st.phase is StepPhase.REDUCE and st.reduced >= st.expected:
                self._begin_apply(out)
                return True
            if st.errors:
                raise StepFailedError(f"{what}: {st.errors[0]}")
            if st.phase is StepPhase.COMPUTE and (stuck := st.pool.unleasable(set(self.intact()) | st.syncing)):
                raise ReplanNeededError(f"{what}: micro-batches {stuck} were held by every pipeline left, whose "
                                        "stages refuse a repeat")
            if st.phase is StepPhase.COMPUTE and (idle := st.pool.idle_s(set(self.intact()))) >= \
                    st.pool.lease_timeout_s:  # a stall: free work nobody leases, nothing in flight, for a lease's time
                raise ReplanNeededError(f"{what}: nothing leased, committed or in flight for {idle:.0f} s while "
                                        "pipelines that could take the free micro-batches were in the step")
            broken = self._drop_broken(out)
            if not self.intact():  # also when a lease or commit dropped the last
                raise ReplanNeededError(f"{what}: no intact pipeline left (dead: {sorted(self.dead)})")
            if st.phase is StepPhase.COMPUTE and st.pool.complete() and (
                    self.spot is None or self.spot.settled(st.pool.assignment())):
                self._begin_reduce(out)
                return True
            # the feeders had stopped, or the averaging began (the pool was complete either way, nothing is in
            # flight): a new attempt restarts them; an averaging that counted a dropped pipeline never ends
            if broken and (st.feeders_done or st.phase is StepPhase.REDUCE):
                restarted = st.phase is StepPhase.REDUCE
                st.restart_feeders()
                self._refeed(out)
                if restarted:
                    return True
        elif st.phase in (StepPhase.APPLY, StepPhase.OUTER_APPLY):
            live = {m for m in st.members if m not in self.dead}
            if st.synced >= live:
                self._end_apply(out, live)
                return True
            if st.errors:
                raise StepFailedError(f"{what}: {st.errors[0]}")
        elif st.phase is StepPhase.OUTER:
            if st.errors:
                raise StepFailedError(f"{what}: {st.errors[0]}")
            if st.expected & self.dead:
                log.warning("step %d: a member of the outer round died; averaging again without its pipeline",
                            self.step)
                self._begin_outer(out)
                return True
            if st.reduced >= st.expected:
                st.synced.clear()
                st.hashes.clear()
                self._begin_apply(out)
                return True
        if self.now >= self.deadline:
            raise StepFailedError(f"{what}: timed out")
        return False

    def _what(self) -> str:
        return f"step {self.step}: " + {StepPhase.COMPUTE: "micro-batches", StepPhase.REDUCE: "gradient averaging",
                                         StepPhase.APPLY: "optimizer step", StepPhase.OUTER: "outer round",
                                         StepPhase.OUTER_APPLY: "outer step"}.get(self.state.phase, "")

    def _begin_reduce(self, out: list[Command]) -> None:
        st = self.state
        st.pool.end_speculation()  # the stages settle what they hold apart: copies count no more
        # DiLoCo inner step: every live pipeline applies its own share (maybe none)
        participants = self.intact() if self.sync_period == 1 else self.roster.alive_pipelines(self.dead)
        st.new_round(StepPhase.REDUCE, self.roster.members(participants, self.dead), participants,
                     st.pool.assignment())
        out.append(Emit("reduce", {"step": self.step, "attempt": st.attempt, "participants": st.participants}))
        # a DiLoCo inner step (each pipeline's update is its own: nothing crosses replicas), or an exact step whose
        # one member holds the whole model alone (nothing to average, no other stage to wait for): the reduce and
        # the apply are one round, a control round trip less; from here the commit record is final, as once an
        # apply went out
        merged = self.sync_period > 1 or (len(st.participants) == 1 and len(st.members) == 1)
        if merged:
            st.enter(StepPhase.APPLY)
            st.synced.clear()
            out.append(Emit("apply", {"step": self.step, "merged": True}))
        out.append(Send(tuple(st.members), ctl.Reduce(self.step, st.attempt, tuple(st.participants), st.commits,
                                                      apply=merged), True))

    def _begin_apply(self, out: list[Command]) -> None:
        st = self.state
        outer = st.phase is StepPhase.OUTER
        st.enter(StepPhase.OUTER_APPLY if outer else StepPhase.APPLY)
        step = self._outer_step if outer else self.step
        out.append(Emit("apply", {"step": step, "outer": True} if outer else {"step": step}))
        out.append(Send(tuple(st.members), ctl.Apply(step, outer=outer), True))

    def _end_apply(self, out: list[Command], live: set[str]) -> None:
        st = self.state
        members = tuple(m for m in st.members if m in live)
        if st.phase is StepPhase.APPLY and self._round_end():
            self._begin_outer(out)
            if self.overlap:  # the round travels while the next step computes: this step ends now
                self.carry = OuterInFlight(self.step, st.attempt, list(self._outer), list(st.members))
                st.done(None)
                out.append(Done(members, check=False, catch_up=False))
            return
        if st.phase is StepPhase.APPLY and self.in_flight is not None:
            self._land(out)  # the round of the step before lands after this step's own apply
            return
        outer = st.phase is StepPhase.OUTER_APPLY
        if outer and self._outer_step != self.step:  # landed late: each replica keeps its own progress on top
            self._landed = list(self._outer)
            st.done(None)
            out.append(Done(members, check=False, catch_up=False))
            return
        st.done(self._outer if outer else None)
        out.append(Done(members, check=self.sync_period == 1 or outer, catch_up=self.sync_period == 1))

    def _land(self, out: list[Command]) -> None:
        """The outer round in flight lands: its averaging is awaited (restarted without a pipeline that lost a
        member), then its outer step, as a round-end step's own."""
        fl, st = self.in_flight, self.state
        assert fl is not None
        self._outer_step, self._outer = fl.step, list(fl.participants)
        st.land(fl)
        if not self._outer:
            raise StepFailedError(f"step {fl.step}: no pipeline left for the outer round")
        out.append(Emit("outer", {"step": fl.step, "attempt": fl.attempt, "participants": self._outer,
                                  "landing": self.step}))

    def _restart_in_flight(self, out: list[Command]) -> None:
        """Before it lands: a member of the round in flight died, so it averages again without that pipeline
        (none left: it fails where it lands)."""
        fl = self.in_flight
        if fl is None or self._outer_step == fl.step or not set(fl.members) & self.dead:
            return
        alive = set(self.roster.alive_pipelines(self.dead))
        parts = [p for p in fl.participants if p in alive]
        fl.restart(parts, self.roster.members(parts, self.dead))
        if not parts:
            return
        log.warning("step %d: a member of the outer round of step %d died; averaging it again without its "
                    "pipeline", self.step, fl.step)
        out.append(Emit("outer", {"step": fl.step, "attempt": fl.attempt, "participants": fl.participants}))
        out.append(Send(tuple(fl.members), ctl.Reduce(fl.step, fl.attempt, tuple(fl.participants), {}, outer=True),
                        True))

    def _round_end(self) -> bool:
        """DiLoCo: whether this inner step is the last of its round (an outer round follows). The same rule as
        the workers' (peer.runtime.outer.is_round_end), stated here so the leader side imports no worker code."""
        return self.sync_period > 1 and (self.step + 1) % self.sync_period == 0

    def _begin_outer(self, out: list[Command]) -> None:
        """DiLoCo's outer round (peer.runtime.outer): the live pipelines' replicas average their pseudo-gradients;
        only when every stage holds its average does anyone take the outer step (two-phase, as an apply)."""
        st = self.state
        restart = st.phase is StepPhase.OUTER
        st.enter(StepPhase.OUTER)
        alive = self.roster.alive_pipelines(self.dead)
        self._outer = [p for p in alive if p in self._outer] if restart else alive
        if not self._outer:
            raise ReplanNeededError(f"step {self._outer_step}: no pipeline left for the outer round")
        st.new_round(StepPhase.OUTER, self.roster.members(self._outer, self.dead))
        out.append(Emit("outer", {"step": self._outer_step, "attempt": st.attempt, "participants": self._outer}))
        out.append(Send(tuple(st.members), ctl.Reduce(self._outer_step, st.attempt, tuple(self._outer), {},
                                                      outer=True), True))

    def _drop_broken(self, out: list[Command]) -> list[int]:
        """Drop from the step the pipelines with a dead member, a lease past its deadline, a micro-batch a
        speculative copy won, or that the referee set aside; return them."""
        st, pool = self.state, self.state.pool
        pool.expire()
        dead = self.roster.pipelines_of(self.dead)
        aside = {r for r, at in st.aside.items() if at <= self.now}
        broken = sorted((dead | pool.failed() | set(pool.losers()) | aside) - st.dropped)
        before = pool.assignment() if broken and self.spot is not None else {}  # to see a backup take a commit
        for r in broken:
            why = ("lost a member" if r in dead else "was set aside by the referee" if r in aside
                   else "is late with nothing committed; its work goes to the others" if r in pool.abandoned
                   else "was overtaken by a speculative copy" if r in pool.losers()
                   else "held a lease past its deadline")
            lost = pool.fail_pipeline(r)
            if self.spot is not None:  # a finished shadow of a lost micro-batch counts instead of a redo
                for mb, p in pool.assignment().items():  # a backup copy took over a commit: its links are checked
                    if before.get(mb) not in (None, p):
                        self.spot.commit(mb, p, self.now)
                for mb in lost:
                    adopter = next((p for p in self.spot.done_copies(mb) if p not in broken and p in self.intact()),
                                   None)
                    if adopter is not None and pool.adopt(mb, adopter):
                        self.spot.commit(mb, adopter, self.now)
                self.spot.forget(r)
            out.append(Emit("requeue", {"step": self.step, "pipeline": r, "microbatches": lost}))
            st.dropped.add(r)
            log.warning("step %d: pipeline %d %s; %d micro-batches go back to the pool", self.step, r, why, len(lost))
            survivors = self.roster.members([r], self.dead)
            if survivors:
                out.append(Send(tuple(survivors), ctl.DropStep(self.step)))
        return broken

    def _refeed(self, out: list[Command]) -> None:
        """A new attempt for the intact pipelines: abort their averaging, restart their feeders. Only when no
        micro-batch is in flight (the pool had been complete), so the feeders' in-flight counts may be reset.
        The other stages are told first, as at the start of a step."""
        st = self.state
        st.next_attempt()
        intact = self.intact()
        start = ctl.StartStep(self.step, st.attempt, record=self.record)
        feed = Send(tuple(self.roster.members(intact, self.dead, first=True)), replace(start, feed=True))
        out.append(Send(tuple(self.roster.members(intact, self.dead, first=False)), start, then=feed))

    def _judge(self) -> None:
        """Errors whose wait is over: one from a live sender during averaging or apply fails the step."""
        st = self.state
        for _, sender, what, error in st.due_errors(self.now):
            if sender not in self.dead and what in ("reduce", "apply") and st.phase is not StepPhase.COMPUTE:
                st.errors.append(f"{sender}: {error}")

    def _fail(self, exc: StepFailedError) -> list[Command]:
        st = self.state
        if st.phase in (StepPhase.OUTER, StepPhase.OUTER_APPLY):
            # DiLoCo: the inner step was applied everywhere; the round's failure does not undo it
            wrapped = OuterRoundFailedError(f"step {self.step}: the outer round failed: {exc}", self.report())
            wrapped.__cause__ = exc
            exc = wrapped
        st.enter(StepPhase.FAILED)
        return [Fail(exc)]

    # ------------------------------------------------------------------------------------------- report
    def report(self) -> StepReport:
        """What the step did, as of ``now``."""
        st = self.state
        losses = [st.losses.get((mb, p), math.nan) for mb, p in sorted(st.commits.items())]
        counts: dict[int, int] = {}
        for p in st.commits.values():
            counts[p] = counts.get(p, 0) + 1
        landed = self._landed is not None
        return StepReport(self.step, sum(losses) / len(losses) if losses else math.nan, self.now - self.started,
                          counts, st.pool.requeued, sorted(st.dropped), st.pool.speculated, st.pool.speculation_won,
                          dict(st.commits), sorted(st.participants), self._landed if landed else st.outer,
                          self._outer_step if landed else None,
                          self.spot.sampled if self.spot else 0, self.spot.verified if self.spot else 0)
