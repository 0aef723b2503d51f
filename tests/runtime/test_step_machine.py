"""The step machine on its own, in virtual time: no gRPC, no threads, no sleeps.

A small simulator plays the workers the way the coordinator's real ones behave (each first stage leases one
micro-batch at a time and commits it, every worker answers a reduce with ``reduced`` and an apply with
``synced``) and ticks the machine after every batch of actions, 0.1 virtual seconds apart. Every call into the
machine is a numbered *point*; a run with no death lists them. Each test kills one participant right before
or right after one point (for every point and every participant) and checks:

* the commands: a dropped pipeline's survivors get a ``drop_step`` and its work a ``requeue`` event; apply goes
  out only after every member of the attempt reported ``reduced``;
* exactly-once accounting: every micro-batch is in the final commit record once, owned by a pipeline that was
  in the reduce and apply (never by one that lost a member before the apply went out);
* failure: with no pipeline intact the step fails with ReplanNeededError (DiLoCo, after the inner apply:
  OuterRoundFailedError carrying the inner step's report).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.lead.machine import Command, Done, Emit, Fail, Send, StepMachine
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.step import OuterInFlight, OuterRoundFailedError, ReplanNeededError, StepPhase
from tests.support.rosters import N_STAGES, ep, make_roster

pytestmark = pytest.mark.unit

N_MB = 4
TICK_S = 0.1


@dataclass
class Kill:
    point: int
    when: str  # "before" or "after"
    victim: str


@dataclass
class Sim:
    """Scripted workers around one machine; ``kills`` happen at numbered points."""

    n_pipelines: int
    step: int = 0
    sync_period: int = 1
    n_stages: int = N_STAGES
    kills: list[Kill] = field(default_factory=list)
    overlap: bool = False  # the machine's outer round overlaps the next step (StepMachine's ``overlap``)
    in_flight: OuterInFlight | None = None  # ... the round of the step before, landing in this one
    land_only: bool = False
    record: str = ""  # the leader's step record every start_step carries
    roster: Roster = field(init=False)
    machine: StepMachine = field(init=False)
    t: float = 0.0
    point: int = 0
    labels: list[str] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    alive: set[str] = field(init=False)
    feeding: set[int] = field(default_factory=set)
    held: dict[int, list[int]] = field(default_factory=dict)
    inbox: list[tuple[str, str, int, int]] = field(default_factory=list)  # (endpoint, report, attempt, step)
    reduced_by: dict[int, set[str]] = field(default_factory=dict)  # attempt -> who reported it
    outcome: Done | Fail | None = None
    killed_after: list[tuple[str, list[str]]] = field(default_factory=list)  # victim, ops sent before the death

    def __post_init__(self) -> None:
        self.roster = make_roster(self.n_pipelines, self.n_stages)
        self.alive = set(self.roster.assignments)
        self.machine = StepMachine(self.step, self.roster, N_MB, now=0.0, timeout_s=100.0, lease_timeout_s=50.0,
                                   sync_period=self.sync_period, overlap=self.overlap, in_flight=self.in_flight,
                                   land_only=self.land_only, record=self.record)

    # -- the workers' side ---------------------------------------------------------------------------------
    def _sent(self) -> list[str]:
        out = []
        for c in self.commands:
            if isinstance(c, Send):
                out.append(type(c.msg).__name__ + ("/outer" if getattr(c.msg, "outer", False) else ""))
                if getattr(c.msg, "apply", False):  # a DiLoCo inner step's reduce carries its apply
                    out.append("Apply")
        return out

    def _kill(self, when: str) -> None:
        for k in self.kills:
            if k.point == self.point and k.when == when and k.victim in self.alive:
                self.alive.discard(k.victim)
                self.killed_after.append((k.victim, self._sent()))
                self.machine.died(k.victim)  # what the coordinator's liveness reports

    def _at(self, label: str, call):  # noqa: ANN001, ANN202 - one numbered point around a machine call
        """Call the machine, carry out its commands, and count the point (deaths right before and after)."""
        self._kill("before")
        result = call()
        self._take(result if isinstance(result, list) else getattr(result, "commands", []))
        self._kill("after")
        self.labels.append(label)
        self.point += 1
        return result

    def _take(self, commands: list[Command]) -> None:
        for c in commands:
            self.commands.append(c)
            if isinstance(c, (Done, Fail)):
                self.outcome = c
            elif isinstance(c, Send):
                self._deliver(c)

    def _deliver(self, send: Send) -> None:
        msg = send.msg
        for e in send.endpoints:
            if e not in self.alive:
                continue
            replica = self.roster.assignments[e].replica
            if isinstance(msg, ctl.StartStep) and msg.feed:
                self.feeding.add(replica)
                self.held[replica] = []
            elif isinstance(msg, ctl.DropStep):
                self.feeding.discard(replica)
                self.held[replica] = []
            elif isinstance(msg, ctl.Reduce) and msg.apply:  # reduce and apply in one task: one report
                self.inbox.append((e, "synced", 0, msg.step))
            elif isinstance(msg, ctl.Reduce):
                self.inbox.append((e, "reduced", msg.attempt, msg.step))
            elif isinstance(msg, ctl.Apply):
                self.inbox.append((e, "synced", 0, msg.step))
        if send.then is not None:
            self._deliver(send.then)

    def _whole(self, pipeline: int) -> bool:
        return all(ep(s, pipeline) in self.alive for s in range(self.n_stages))

    def _act(self) -> None:
        m = self.machine
        while self.inbox:
            e, kind, attempt, step = self.inbox.pop(0)
            if e not in self.alive:
                continue
            if kind == "reduced":
                self.reduced_by.setdefault(attempt, set()).add(e)
                self._at("reduced", lambda e=e, attempt=attempt, step=step: m.reduced(e, attempt, step))
            else:
                self._at("synced", lambda e=e: m.synced(e, self.step + 1, "h"))
        for p in sorted(self.feeding):
            if not self._whole(p):
                continue  # a pipeline with a dead member finishes nothing
            if self.held[p]:
                mb = self.held[p].pop(0)
                m.loss(ep(self.n_stages - 1, p), p, mb, float(mb), self.t)
                answer = self._at("commit", lambda mb=mb, p=p: m.commit(mb, p, self.t))
            else:
                answer = self._at("lease", lambda p=p: m.lease(p, self.t))
                if answer.status is ctl.PoolStatus.LEASE:
                    self.held[p].append(answer.microbatch)
                elif answer.status is ctl.PoolStatus.DONE:
                    self.feeding.discard(p)

    def run(self) -> Sim:
        self._at("start", self.machine.start)
        return self.resume()

    def resume(self, until: StepPhase | None = None) -> Sim:
        """Act and tick until the step ends (or reaches phase ``until``)."""
        while self.outcome is None and self.t < 200 and self.machine.phase is not until:
            self._act()
            if self.outcome is not None:
                break
            self.t += TICK_S
            before = self.machine.phase
            self._at("tick", lambda: self.machine.tick(self.t))
            if self.machine.phase is not before:
                self.labels[-1] = f"tick:{before.value}->{self.machine.phase.value}"
        assert self.outcome is not None or self.machine.phase is until, "the step neither ended nor failed"
        return self

    # -- what happened -------------------------------------------------------------------------------------
    def sends(self, kind: type, outer: bool | None = None) -> list[Send]:
        return [c for c in self.commands if isinstance(c, Send) and isinstance(c.msg, kind)
                and (outer is None or getattr(c.msg, "outer", False) == outer)]

    def emitted(self, name: str) -> list[dict]:
        return [c.info for c in self.commands if isinstance(c, Emit) and c.name == name]


def inner_applies(sim: Sim) -> list[Send]:
    """The sends that carry the inner step's apply: ``Apply``, or a DiLoCo inner step's ``Reduce(apply=True)``."""
    return sim.sends(ctl.Apply, outer=False) + [r for r in sim.sends(ctl.Reduce, outer=False) if r.msg.apply]


def points(sim: Sim) -> list[tuple[int, str]]:
    """The points of a run worth a death: every call but the ticks that change nothing."""
    return [(i, label) for i, label in enumerate(sim.labels) if label != "tick"]


def cases(n_pipelines: int, step: int = 0, sync_period: int = 1) -> list:
    baseline = Sim(n_pipelines, step, sync_period).run()
    return [pytest.param(n_pipelines, i, when, id=f"{n_pipelines}p-{i}:{label}-{when}")
            for i, label in points(baseline) for when in ("before", "after")]


def test_a_step_without_deaths_goes_through_every_phase_in_order() -> None:
    sim = Sim(2).run()
    assert isinstance(sim.outcome, Done) and sim.outcome.check and sim.outcome.catch_up
    assert [label for label in sim.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:compute->reduce", "tick:reduce->apply", "tick:apply->done"]
    assert sim.sends(ctl.StartStep)[0].endpoints == (ep(1, 0), ep(1, 1)), "the other stages hear of it first"
    assert sim.sends(ctl.StartStep)[1].endpoints == (ep(0, 0), ep(0, 1))
    report = sim.machine.report()
    assert sorted(report.commits) == list(range(N_MB)) and report.applied == [0, 1]
    assert report.loss == pytest.approx(sum(range(N_MB)) / N_MB) and report.dropped_pipelines == []
    assert [r.msg.assignment for r in sim.sends(ctl.Reduce)] == [report.commits]


def check(sim: Sim, n_pipelines: int, victim: str, diloco: bool = False) -> None:
    """The invariants of every run with one death (module docstring)."""
    assert len(sim.killed_after) == 1
    pipeline = sim.roster.assignments[victim].replica
    sent = sim.killed_after[0][1]
    dropped = [i for i in sim.emitted("requeue") if i["pipeline"] == pipeline]
    if "StartStep" in sent and "Reduce" not in sent:  # it was computing: dropped, its work requeued, survivors told
        assert len(dropped) == 1
        survivors = tuple(e for e in sim.roster.members([pipeline]) if e != victim)
        assert any(s.endpoints == survivors for s in sim.sends(ctl.DropStep))
    if "Apply" in sent:
        assert not dropped and not sim.sends(ctl.DropStep), "nothing is dropped once apply went out"
    if isinstance(sim.outcome, Fail):
        error = sim.outcome.error
        if diloco and inner_applies(sim):  # the inner step was applied
            assert isinstance(error, OuterRoundFailedError) and n_pipelines == 1
            assert sorted(error.report.commits) == list(range(N_MB)), "the inner step stands"
            return
        assert type(error) is ReplanNeededError
        assert n_pipelines == 1 or ("StartStep" not in sent and not (diloco and sim.step % sim.sync_period)), \
            f"a pipeline was left, yet the step failed: {error}"
        return
    assert isinstance(sim.outcome, Done)
    report = sim.machine.report()
    assert sorted(report.commits) == list(range(N_MB)), "every micro-batch exactly once"
    assert set(report.commits.values()) <= set(report.applied)
    assert not set(report.commits.values()) & set(report.dropped_pipelines)
    last_reduce = [r for r in sim.sends(ctl.Reduce, outer=False)][-1]
    assert last_reduce.msg.assignment == report.commits, "the workers averaged the reported record"
    assert set(report.applied) == set(last_reduce.msg.participants)
    reported = sim.reduced_by.get(last_reduce.msg.attempt, set())
    assert last_reduce.msg.apply == diloco, "only a DiLoCo inner step's reduce carries its apply"
    if not diloco:
        assert set(sim.sends(ctl.Apply, outer=False)[0].endpoints) <= reported | {victim}, "apply before reduced"
    if pipeline in report.applied and "Apply" not in sent:  # it died after its average was in: apply goes on
        assert victim in reported and not dropped
    if pipeline not in report.applied:
        assert pipeline not in report.commits.values() and len(dropped) == 1
        assert "StartStep" in sent or dropped[0]["microbatches"] == [], "dead before the start: it held nothing"
    if "Apply" in sent:
        assert pipeline in report.applied
    if diloco:
        outer = report.outer
        assert outer is not None and sim.outcome.check and not sim.outcome.catch_up
        assert (pipeline in outer) == ("Apply/outer" in sent)


@pytest.mark.parametrize(("n_pipelines", "point", "when"), cases(2) + cases(1))
def test_a_death_before_or_after_each_transition(n_pipelines: int, point: int, when: str) -> None:
    for victim in sorted(make_roster(n_pipelines).assignments):  # each participant in turn
        sim = Sim(n_pipelines, kills=[Kill(point, when, victim)]).run()
        check(sim, n_pipelines, victim)


@pytest.mark.parametrize(("n_pipelines", "point", "when"), cases(2, 1, 2) + cases(1, 1, 2))
def test_a_death_before_or_after_each_transition_of_a_diloco_round(n_pipelines: int, point: int, when: str) -> None:
    # step 1 of sync_period 2: mid-round (a pipeline that lost a member sits it out) and the round's end (the
    # outer averaging and outer step follow the inner apply)
    for victim in sorted(make_roster(n_pipelines).assignments):
        sim = Sim(n_pipelines, step=1, sync_period=2, kills=[Kill(point, when, victim)]).run()
        check(sim, n_pipelines, victim, diloco=True)


def _restarted(record: str = "") -> Sim:
    """Three pipelines; pipeline 2 loses a member once the averaging started: the others compute again."""
    base = Sim(3).run()
    reduce_tick = base.labels.index("tick:compute->reduce")
    first = next(i for i in range(reduce_tick + 1, len(base.labels)) if base.labels[i] == "reduced")
    return Sim(3, kills=[Kill(first, "after", ep(1, 2))], record=record)


def test_every_start_step_of_every_attempt_carries_the_leaders_step_record() -> None:
    """The record of the steps trained so far reaches every worker before it can apply this step (a takeover's
    bound, peer.node.step_record), also with the restart of an attempt and the feed chained behind it."""
    sim = _restarted(record="signed record").run()
    starts = [s.msg for s in sim.sends(ctl.StartStep)]
    chained = [s.then.msg for s in sim.sends(ctl.StartStep) if s.then is not None]
    assert len({m.attempt for m in starts}) == 2 and chained, "the first attempt and the restart, with a feed"
    assert all(m.record == "signed record" for m in starts + chained)


def restart_cases() -> list:
    sim = _restarted().run()
    restart = sim.labels.index("tick:reduce->compute")
    return [pytest.param(i, when, id=f"{i}:{label}-{when}")
            for i, label in points(sim) if i >= restart for when in ("before", "after")]


def test_a_death_during_the_averaging_restarts_it_without_the_pipeline() -> None:
    sim = _restarted().run()
    assert "tick:reduce->compute" in sim.labels
    reduces = sim.sends(ctl.Reduce)
    assert [r.msg.participants for r in reduces] == [(0, 1, 2), (0, 1)]
    assert reduces[1].msg.attempt == reduces[0].msg.attempt + 2, "a new attempt for the restart, another for its reduce"
    refeed = [s for s in sim.sends(ctl.StartStep) if s.msg.attempt == reduces[0].msg.attempt + 1]
    assert refeed and refeed[0].endpoints == (ep(1, 0), ep(1, 1)) and refeed[0].then is not None
    assert refeed[0].then.endpoints == (ep(0, 0), ep(0, 1)) and refeed[0].then.msg.feed
    report = sim.machine.report()
    assert sorted(report.commits) == list(range(N_MB)) and set(report.commits.values()) <= {0, 1}
    assert report.dropped_pipelines == [2] and report.applied == [0, 1]


def test_a_death_as_the_averaging_starts_restarts_it_though_no_feeder_asked_again() -> None:
    """A member leaves right after the reduce went out, before any feeder asked for work again (so none was told
    the pool is complete): the averaging still restarts without its pipeline, or the others wait for its shard
    until their reduce's deadline."""
    sim = Sim(3)
    sim._at("start", sim.machine.start)
    sim.resume(until=StepPhase.REDUCE)
    sim.feeding.clear()  # every feeder committed its last micro-batch and has not asked again: in this simulator
    sim.machine.state.feeders_done = False  # one asks within the same round, on a real swarm it may come later
    sim.alive.discard(ep(1, 2))
    sim.machine.died(ep(1, 2))
    sim.resume()
    reduces = sim.sends(ctl.Reduce)
    assert [r.msg.participants for r in reduces] == [(0, 1, 2), (0, 1)]
    assert isinstance(sim.outcome, Done)
    assert sim.machine.report().dropped_pipelines == [2]


@pytest.mark.parametrize(("point", "when"), restart_cases())
@pytest.mark.parametrize("victim", [ep(0, 0), ep(1, 1)])
def test_a_second_death_around_each_transition_of_a_restarted_attempt(point: int, when: str, victim: str) -> None:
    sim = _restarted()
    sim.kills.append(Kill(point, when, victim))
    sim.run()
    assert isinstance(sim.outcome, Done), sim.outcome
    report = sim.machine.report()
    lost = sim.roster.assignments[victim].replica
    assert sorted(report.commits) == list(range(N_MB))
    assert set(report.commits.values()) <= set(report.applied) and 2 not in report.applied
    last_attempt = sim.sends(ctl.Reduce)[-1].msg.attempt
    in_before_death = "Apply" in sim.killed_after[1][1] or victim in sim.reduced_by.get(last_attempt, set())
    assert (lost in report.applied) == in_before_death, "applied only when its average was in before it died"


def test_an_error_during_averaging_is_judged_after_its_delay_and_fails_the_step() -> None:
    sim = Sim(2)
    m = sim.machine
    m.judge_after_s = 1.0
    sim._at("start", m.start)
    sim.resume(until=StepPhase.REDUCE)
    assert m.error(ep(0, 0), 0, "reduce", "boom", sim.t)
    assert m.tick(sim.t + 0.5) == [], "not judged before its delay"
    [fail] = m.tick(sim.t + 1.0)
    assert isinstance(fail, Fail) and "boom" in str(fail.error) and "gradient averaging" in str(fail.error)


def test_an_error_from_a_sender_that_died_meanwhile_is_not_held_against_the_step() -> None:
    sim = Sim(2)
    m = sim.machine
    m.judge_after_s = 1.0
    sim._at("start", m.start)
    sim.resume(until=StepPhase.REDUCE)
    assert m.error(ep(1, 1), 1, "reduce", "peer gone", sim.t)
    sim.inbox = [m for m in sim.inbox if m[0] != ep(1, 1)]  # it never reports reduced
    m.died(ep(1, 1))
    sim.resume()
    assert isinstance(sim.outcome, Done), sim.outcome
    report = sim.machine.report()
    assert report.dropped_pipelines == [1] and report.applied == [0] and sorted(report.commits) == [0, 1, 2, 3]


def test_a_lease_past_its_deadline_drops_its_pipeline_and_the_step_still_ends() -> None:
    m = StepMachine(0, make_roster(2), N_MB, now=0.0, timeout_s=100.0, lease_timeout_s=5.0)
    m.start()
    assert m.lease(1, 0.0).microbatch == 0  # pipeline 1 leases and goes silent
    commands = m.tick(6.0)
    assert [c.info["pipeline"] for c in commands if isinstance(c, Emit) and c.name == "requeue"] == [1]
    assert m.pool.requeued == 1 and m.state.dropped == {1}
    assert any(isinstance(c, Send) and isinstance(c.msg, ctl.DropStep) for c in commands)
    assert [m.lease(0, 6.0).microbatch for _ in range(N_MB)] == [0, 1, 2, 3]


def test_the_step_times_out_at_its_deadline() -> None:
    m = StepMachine(0, make_roster(1), N_MB, now=0.0, timeout_s=10.0, lease_timeout_s=50.0)
    m.start()
    assert m.tick(9.9) == []
    [fail] = m.tick(10.0)
    assert isinstance(fail, Fail) and str(fail.error) == "step 0: micro-batches: timed out"


def test_a_step_where_nothing_moves_for_a_lease_time_is_re_planned_not_left_to_its_deadline() -> None:
    """Free work, nothing leased or in flight, a pipeline able to take it: a stall (a feeder that stopped
    asking, or a pool that kept refusing it) ends with a re-plan after one lease time, not the step's deadline."""
    m = StepMachine(0, make_roster(2), N_MB, now=0.0, timeout_s=100.0, lease_timeout_s=5.0)
    m.start()
    assert m.lease(0, 1.0).microbatch == 0 and m.commit(0, 0, 2.0).status is ctl.PoolStatus.COMMITTED
    assert m.tick(6.9) == [], "idle counts from the last commit, not from the step's start"
    [fail] = m.tick(7.0)
    assert isinstance(fail, Fail) and type(fail.error) is ReplanNeededError
    assert "nothing leased, committed or in flight for 5 s" in str(fail.error)
    # work in flight is no stall, however long (its lease's deadline is the judge of that)
    busy = StepMachine(0, make_roster(2), N_MB, now=0.0, timeout_s=100.0, lease_timeout_s=5.0)
    busy.start()
    assert busy.lease(0, 0.0).microbatch == 0 and busy.tick(4.9) == []


def test_a_syncing_pipeline_gets_no_work_and_rejoins_only_while_the_step_computes() -> None:
    m = StepMachine(0, make_roster(2), N_MB, now=0.0, timeout_s=100.0, lease_timeout_s=50.0, syncing={1})
    [others, firsts] = m.start()
    assert isinstance(others, Send) and others.endpoints == (ep(1, 0),) and firsts.endpoints == (ep(0, 0),)
    assert m.lease(1, 0.0).status is ctl.PoolStatus.WAIT
    [start] = m.rejoin(1)
    assert start.endpoints == (ep(0, 1), ep(1, 1)) and start.rejoin == 1 and not start.msg.feed
    [feed] = m.rejoined(1, start.msg.attempt)
    assert feed.endpoints == (ep(0, 1),) and feed.msg.feed
    assert m.lease(1, 0.0).status is ctl.PoolStatus.LEASE
    assert m.rejoined(1, start.msg.attempt) == [], "only once"


def test_a_diloco_inner_step_reduces_and_applies_in_one_round() -> None:
    """A DiLoCo inner step's reduce is local: one round (``Reduce(apply=True)``, answered by ``synced``) instead
    of a reduce and an apply; the round's end still averages and applies the outer step in two."""
    mid = Sim(2, step=0, sync_period=2).run()
    assert isinstance(mid.outcome, Done) and not mid.outcome.check
    assert [label for label in mid.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:compute->apply", "tick:apply->done"]
    (reduce,) = mid.sends(ctl.Reduce)
    assert reduce.msg.apply and not mid.sends(ctl.Apply) and not mid.reduced_by
    assert reduce.msg.assignment == mid.machine.report().commits and mid.machine.report().applied == [0, 1]
    end = Sim(2, step=1, sync_period=2).run()
    assert [label for label in end.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:compute->apply", "tick:apply->outer", "tick:outer->outer_apply", "tick:outer_apply->done"]
    assert [r.msg.apply for r in end.sends(ctl.Reduce)] == [True, False]
    assert [a.msg.outer for a in end.sends(ctl.Apply)] == [True]
    exact = Sim(2).run()
    assert [r.msg.apply for r in exact.sends(ctl.Reduce)] == [False], "an exact step keeps its two phases"


def test_an_exact_step_of_one_pipeline_of_one_stage_reduces_and_applies_in_one_round() -> None:
    """The one member holds the whole model alone: nothing to average, no other stage to wait for, so the apply
    comes with the reduce; one pipeline of two stages, or two pipelines of one, keep both phases."""
    lone = Sim(1, n_stages=1).run()
    assert isinstance(lone.outcome, Done) and lone.outcome.check
    assert [label for label in lone.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:compute->apply", "tick:apply->done"]
    (reduce,) = lone.sends(ctl.Reduce)
    assert reduce.msg.apply and not lone.sends(ctl.Apply) and not lone.reduced_by
    assert lone.machine.report().applied == [0]
    for two in (Sim(1).run(), Sim(2, n_stages=1).run()):
        assert isinstance(two.outcome, Done)
        assert [r.msg.apply for r in two.sends(ctl.Reduce)] == [False] and len(two.sends(ctl.Apply)) == 1


# ---------------------------------------------------------------------------------------------- overlap
def _overlapped(kills: list[Kill] | None = None) -> tuple[Sim, Sim]:
    """Step 1 of sync period 2 hands its outer round on; step 2 computes while its reports come in, then lands
    it (the reports of step 1's workers reach step 2's machine, as the coordinator routes them)."""
    first = Sim(2, step=1, sync_period=2, overlap=True).run()
    second = Sim(2, step=2, sync_period=2, in_flight=first.machine.carry, kills=kills or [])
    second.inbox = list(first.inbox)  # the round's "reduced" reports, still travelling
    return first, second.run()


def test_an_overlapped_round_ends_its_step_at_once_and_lands_after_the_next_steps_apply() -> None:
    first, second = _overlapped()
    assert [label for label in first.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:compute->apply", "tick:apply->done"]
    assert isinstance(first.outcome, Done) and not first.outcome.check
    (outer,) = first.sends(ctl.Reduce, outer=True)
    assert outer.msg.step == 1 and first.machine.report().outer is None
    assert first.machine.carry is not None and first.machine.carry.participants == [0, 1]
    # every replica had averaged while step 2 computed: straight from step 2's apply to the outer step's
    assert [label for label in second.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:compute->apply", "tick:apply->outer_apply", "tick:outer_apply->done"]
    (apply,) = second.sends(ctl.Apply, outer=True)
    assert apply.msg.step == 1, "the outer step is the round's, sent after step 2's own apply"
    report = second.machine.report()
    assert report.step == 2 and report.outer == [0, 1] and report.outer_of == 1
    assert isinstance(second.outcome, Done) and not second.outcome.check  # each replica keeps its own progress


def test_a_death_while_the_round_travels_restarts_it_without_that_pipeline() -> None:
    first, second = _overlapped([Kill(1, "after", ep(1, 0))])  # a member of pipeline 0, as step 2 starts
    restarted = [s.msg for s in second.sends(ctl.Reduce, outer=True)]
    assert [(m.step, m.participants) for m in restarted] == [(1, (1,))]
    assert restarted[0].attempt > first.machine.carry.attempt - 1  # a later attempt than the one abandoned
    report = second.machine.report()
    assert report.outer == [1] and report.outer_of == 1 and 0 in report.dropped_pipelines
    (apply,) = second.sends(ctl.Apply, outer=True)
    assert set(apply.endpoints) == {ep(s, 1) for s in range(N_STAGES)}


def test_a_round_in_flight_lands_alone_before_a_re_plan() -> None:
    first = Sim(2, step=1, sync_period=2, overlap=True).run()
    land = Sim(2, step=99, sync_period=2, in_flight=first.machine.carry, land_only=True)
    land.inbox = list(first.inbox)
    land.run()
    assert [label for label in land.labels if label.startswith(("start", "tick:"))] == [
        "start", "tick:outer->outer_apply", "tick:outer_apply->done"]
    assert land.machine.step == 1 and land.machine.report().outer == [0, 1]
    assert isinstance(land.outcome, Done) and land.outcome.check  # at the anchor: the replicas must agree
    assert not land.sends(ctl.StartStep)


def test_a_round_in_flight_with_no_pipeline_left_fails_where_it_lands() -> None:
    first = Sim(2, step=1, sync_period=2, overlap=True).run()
    carry = first.machine.carry
    land = Sim(2, step=1, sync_period=2, in_flight=carry, land_only=True,
               kills=[Kill(0, "before", ep(0, 0)), Kill(0, "before", ep(0, 1))])
    land.run()
    assert isinstance(land.outcome, Fail) and isinstance(land.outcome.error, OuterRoundFailedError)
