"""The leader acts on members' claims only with evidence it computed itself (unit tests, no processes).

Bad-peer reports are testimony: they never exclude and never roll the run back, they cost at most the current
step (``peer.runtime.lead.referee``). Replica hashes after an apply rewrite a replica only by the leader's own
replica or by hashes the leader computed from the served bytes, with a strict majority of at least 3; colluders
that report one false hash neither rewrite the honest replica nor go unnoticed (``peer.runtime.lead.resync``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tasklet.peer.runtime.lead.coordinator import Coordinator
from tasklet.peer.runtime.lead.machine import StepMachine
from tasklet.peer.runtime.lead.referee import Referee
from tasklet.peer.runtime.lead.resync import Resync, judge_stage
from tasklet.peer.runtime.spec import RunSpec
from tests.support.rosters import ep, make_roster

pytestmark = pytest.mark.unit

GOOD, BAD = "a" * 32, "b" * 32


# ------------------------------------------------------------------------------------------------ the referee
@pytest.mark.parametrize("witnesses", [1, 2, 3])
def test_no_report_excludes_however_many_name_the_accused(witnesses: int) -> None:
    ref = Referee()
    verdicts = [ref.report(f"r{k}", "honest", witnesses=witnesses, step=k) for k in range(5)]
    assert all(v.exclude == () for v in verdicts), verdicts
    # what it costs instead: pipelines set aside for the step, nothing beyond it
    assert all(v.sideline or v.set_aside for v in verdicts)
    assert verdicts[1].sideline == ("honest",), "corroborated: left out of the plan for a ban, nothing rolled back"


def test_a_lone_witness_sidelines_the_accused_without_a_roll_back() -> None:
    v = Referee().report("receiver", "sender", witnesses=1, step=4)
    assert v.exclude == () and v.sideline == ("sender",) and v.drop == () and v.set_aside == ()
    assert v.suspects == ("sender",), "back on probation when it returns: the spot checks look at it"


def test_the_leaders_own_worker_is_evidence_for_and_against() -> None:
    ref = Referee(own="leader")
    assert ref.report("leader", "cheat", witnesses=1, step=0).exclude == ("cheat",)
    v = ref.report("liar", "leader", witnesses=1, step=1)
    assert v.exclude == () and v.drop == ("liar",) and ref.contradicted == {"liar": 1}
    ref.report("liar", "leader", witnesses=2, step=2)
    assert ref.false_reporters == {"liar"}
    assert ref.report("liar", "other", witnesses=1, step=3).drop == (), "a false reporter is ignored"


@pytest.fixture
def coordinator() -> Iterator[Coordinator]:
    """A coordinator (never started: no port, no workers) over 2 stages x 3 pipelines, with a step running."""
    c = Coordinator(RunSpec(run_id="evidence", n_microbatches=4, probation_microbatches=1), liveness_interval_s=30)
    roster = make_roster(3)
    with c._cond:
        c.roster = roster
        c.liveness.reset(roster.assignments)
        c._machine = StepMachine(0, roster, 4, now=time.monotonic(), timeout_s=100.0, lease_timeout_s=50.0)
        c._machine.start()
    try:
        yield c
    finally:
        c.close()


def test_a_false_report_costs_the_step_and_a_ban_never_a_roll_back(coordinator: Coordinator) -> None:
    c, machine = coordinator, coordinator._machine
    assert machine is not None
    c.verification.ledger.applied(0, [ep(1, 2), ep(1, 1)])  # unverified applied work an exclusion would roll back
    c.verification.probation.credit([ep(0, 1), ep(0, 2), ep(1, 2)])
    # a group of three: the lone reporter waits for corroboration, a second reporter sets the accused aside
    c._refer(c.roster, ep(1, 0), ep(1, 1), 0, "refused")
    machine.tick(time.monotonic())
    assert machine.intact() == [0, 1, 2]
    c._refer(c.roster, ep(1, 2), ep(1, 1), 0, "refused")
    machine.tick(time.monotonic() + 10.0)  # past the grace: the corroborated reporter's pipeline was kept
    assert 1 not in machine.intact() and {0, 2} <= set(machine.intact())
    # a pipeline neighbour: the only witness of the accused's activation gradients
    c._refer(c.roster, ep(0, 2), ep(1, 2), 0, "refused")
    machine.tick(time.monotonic())
    assert machine.intact() == [0], "the step is redone by the pipeline nobody named"
    assert c.dead == {ep(1, 1), ep(1, 2)}, "the accused are left out of the plan for a ban's time"
    assert c.verification.take_rollback() is None, "testimony rolls nothing back"
    assert c.verification.probation.on_probation(ep(1, 2)), "back on probation: the spot checks look at it"
    assert not c.verification.probation.on_probation(ep(0, 2)), "a reporter loses nothing"


def test_a_refusal_by_the_leaders_own_worker_excludes_and_rolls_back(coordinator: Coordinator) -> None:
    c = coordinator
    c.referee.own = ep(0, 1)  # identities are endpoints in a plan without certificates
    c.verification.ledger.applied(3, [ep(1, 1)])
    c._refer(c.roster, ep(0, 1), ep(1, 1), 4, "refused")
    assert c.dead == {ep(1, 1)} and "leader's own worker" in c.dead_reasons[ep(1, 1)]
    assert c.verification.take_rollback() is not None and c.verification.take_rollback() is None


# -------------------------------------------------------------------------------------- replica hashes
def served_by(held: dict[str, str]) -> Callable[[str], str | None]:
    """What the leader computes from the bytes each replica serves it (None: not fetched)."""
    return lambda endpoint: held.get(endpoint)


def test_colluders_reporting_one_false_hash_neither_rewrite_the_third_nor_go_unnoticed() -> None:
    reported = {"c1": (5, BAD), "c2": (5, BAD), "honest": (5, GOOD)}
    j = judge_stage(reported, served=served_by({"c1": GOOD, "c2": GOOD, "honest": GOOD}))
    assert j.resync == {} and sorted(j.liars) == ["c1", "c2"] and j.agreed == (5, GOOD)
    # the same colluders where the leader could not fetch their bytes: nobody is rewritten by counting
    j = judge_stage(reported, served=served_by({"honest": GOOD}))
    assert j.how == "disputed" and j.resync == {} and j.agreed is None


def test_the_leaders_own_replica_decides_against_a_majority() -> None:
    reported = {"c1": (5, BAD), "c2": (5, BAD), "mine": (5, GOOD)}
    asked: list[str] = []
    j = judge_stage(reported, own="mine", served=lambda e: asked.append(e) or None)
    assert j.how == "own" and j.resync == {"c1": "mine", "c2": "mine"} and j.agreed == (5, GOOD)
    assert asked == [], "its own apply decides: nothing is fetched"


def test_a_verified_strict_majority_of_three_rewrites_the_odd_one() -> None:
    reported = {"a": (5, GOOD), "b": (5, GOOD), "odd": (5, BAD)}
    j = judge_stage(reported, served=served_by({"a": GOOD, "b": GOOD, "odd": BAD}))
    assert j.how == "majority" and j.resync == {"odd": "a"} and j.liars == {}


@pytest.mark.parametrize("reported", [
    {"a": (5, GOOD), "b": (5, BAD)},  # two replicas
    {"a": (5, GOOD), "b": (5, GOOD), "c": (5, BAD), "d": (5, BAD)},  # a tie
])
def test_two_replicas_or_a_tie_are_not_decided_by_counting(reported: dict[str, tuple[int, str]]) -> None:
    j = judge_stage(reported, served=served_by({ep: h for ep, (_, h) in reported.items()}))
    assert j.how == "disputed" and j.resync == {} and j.agreed is None and j.liars == {}
    assert judge_stage(reported, own="a").resync == {ep: "a" for ep, v in reported.items() if v[1] == BAD}


class FakeLiveness:
    """The liveness Resync asks (who is dead, declare, one ping)."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.reasons: dict[str, str] = {}

    def declare(self, endpoint: str, reason: str) -> None:
        self.dead.add(endpoint)
        self.reasons[endpoint] = reason

    def alive(self, endpoint: str) -> bool:
        return True

    def is_dead(self, endpoint: str) -> bool:
        return endpoint in self.dead


def resync_over(held: dict[str, str], events: list[tuple[str, dict[str, Any]]],
                told: list[str]) -> tuple[Resync, FakeLiveness]:
    liveness = FakeLiveness()
    client = lambda endpoint: type("C", (), {"push": lambda self, env, timeout_s: told.append(endpoint)})()  # noqa: E731
    resync = Resync("evidence", threading.Condition(), liveness, client, lambda fn, *a: fn(*a),  # type: ignore[arg-type]
                    events.extend, fetch=lambda endpoint: {"params": held[endpoint]})
    return resync, liveness


def test_check_replicas_excludes_the_liars_and_signs_the_honest_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    import tasklet.peer.runtime.lead.resync as resync_module
    monkeypatch.setattr(resync_module, "flat_digest", lambda params: params)  # the served "bytes" are the hash
    roster = make_roster(3)
    stage1 = [ep(1, r) for r in range(3)]
    held = {e: GOOD for e in roster.assignments}
    hashes = {e: (5, GOOD) for e in roster.assignments} | {ep(1, 0): (5, BAD), ep(1, 1): (5, BAD)}
    events: list[tuple[str, dict[str, Any]]] = []
    told: list[str] = []
    resync, liveness = resync_over(held, events, told)
    digests = resync.check_replicas(roster, 1, 4, list(roster.assignments), hashes, time.monotonic() + 1)
    assert told == [], "nobody is told to reload"
    assert liveness.dead == {ep(1, 0), ep(1, 1)} and "served the leader" in liveness.reasons[ep(1, 0)]
    assert [(n, i["how"], i["liars"]) for n, i in events] == [("disputed", "agree", stage1[:2])]
    assert digests[(1, 2)] == GOOD


def test_check_replicas_leaves_a_two_replica_dispute_unsigned_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import tasklet.peer.runtime.lead.resync as resync_module
    monkeypatch.setattr(resync_module, "flat_digest", lambda params: params)
    roster = make_roster(2)
    held = {e: GOOD for e in roster.assignments} | {ep(0, 1): BAD}
    hashes = {e: (5, h) for e, h in held.items()}
    events: list[tuple[str, dict[str, Any]]] = []
    told: list[str] = []
    resync, liveness = resync_over(held, events, told)
    digests = resync.check_replicas(roster, 1, 4, list(roster.assignments), hashes, time.monotonic() + 1)
    assert told == [] and liveness.dead == set()
    assert [n for n, _ in events] == ["disputed", "divergent"] and events[0][1]["how"] == "disputed"
    assert (0, 1) not in digests and digests[(1, 2)] == GOOD, "a disputed stage's hash is not signed"
