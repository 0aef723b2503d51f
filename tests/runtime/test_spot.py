"""Spot checks on their own: the sketches and their tolerance, the sampling and probation, the comparison along
the data's path, the majority of three, and the step machine running a shadow copy to an exclusion (virtual
time, no processes)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
import torch

from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.lead import spot as spot_module
from tasklet.peer.runtime.lead.machine import Emit, Spot, StepMachine
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.spot import (
    Finding,
    Ledger,
    Probation,
    SpotChecks,
    broken_link,
    first_difference,
    majority,
    path,
)
from tasklet.peer.runtime.lead.step import ReplanNeededError
from tasklet.peer.runtime.lead.verify import Verification
from tasklet.peer.runtime.sketch import PER_POINT, agree, seed_of, sketch, tolerance
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.protocol.errors import BadMessage

pytestmark = pytest.mark.unit

N_STAGES = 2


# ------------------------------------------------------------------------------------------------ sketches
def test_a_sketch_sees_a_ten_per_cent_change_and_passes_honest_round_off() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 32, 32)
    seed = seed_of("run", 0, 3, "act_out", 0)
    tol = tolerance("fp32")
    assert agree(sketch(x, seed), sketch(x.clone(), seed), 0.0)
    assert not agree(sketch(x, seed), sketch(x * 1.1, seed), tol)
    assert not agree(sketch(x, seed), sketch(x + 0.05 * torch.randn_like(x), seed), tol)
    # the same computation in another order and precision: a small MLP in float32 and float64
    w1, w2 = torch.randn(32, 128) / 6, torch.randn(128, 32) / 11
    y32 = torch.relu(x @ w1) @ w2
    y64 = (torch.relu(x.double() @ w1.double()) @ w2.double()).float()
    assert agree(sketch(y32, seed), sketch(y64, seed), tol)
    assert not agree(sketch(y32, seed), sketch(y64, seed), 1e-9), "the round-off is there, and tolerated"


def test_the_sender_and_the_receiver_of_one_tensor_share_the_projections() -> None:
    assert seed_of("r", 1, 2, "act_out", 0) == seed_of("r", 1, 2, "act_in", 1)
    assert seed_of("r", 1, 2, "grad_out", 1) == seed_of("r", 1, 2, "grad_in", 0)
    assert seed_of("r", 1, 2, "act_out", 0) != seed_of("r", 1, 3, "act_out", 0)
    assert seed_of("r", 1, 2, "act_out", 0) != seed_of("r", 2, 2, "act_out", 0)


def test_a_sketch_message_that_does_not_fit_is_refused() -> None:
    good = ctl.Sketch(0, 1, ("act_out", "grad_in"), tuple(float(i) for i in range(2 * PER_POINT)))
    assert set(good.parsed()) == {"act_out", "grad_in"}
    for bad in (ctl.Sketch(0, 1, ("act_out",), (1.0,) * (PER_POINT + 1)),
                ctl.Sketch(0, 1, ("act_out", "act_out"), (1.0,) * (2 * PER_POINT)),
                ctl.Sketch(0, 1, ("weights",), (1.0,) * PER_POINT),
                ctl.Sketch(0, 1, ("act_out",), (float("nan"),) + (1.0,) * (PER_POINT - 1))):
        with pytest.raises(BadMessage):
            bad.parsed()


# ---------------------------------------------------------------------------------------- sampling
def test_sampling_follows_the_rate_and_probation_raises_it() -> None:
    for rate, lo, hi in ((0.0, 0, 0), (1.0, 4000, 4000), (0.05, 150, 250), (0.25, 900, 1100)):
        spot = SpotChecks(0, N_STAGES, lambda p, r=rate: r, rng=random.Random(7))
        assert lo <= sum(spot.sample(mb, 0) for mb in range(4000)) <= hi, rate
    probation = Probation(rate=1.0, needed=2)
    assert probation.on_probation("a")
    probation.credit(["a"])
    assert probation.on_probation("a")
    probation.credit(["a", "b"])
    assert not probation.on_probation("a") and probation.on_probation("b")
    probation.suspect(["a"])
    assert probation.on_probation("a"), "a suspect starts its probation again"


def test_a_micro_batch_is_shadowed_once_on_a_pipeline_that_never_held_it() -> None:
    spot = SpotChecks(0, N_STAGES, lambda p: 1.0, rng=random.Random(1))
    assert spot.sample(5, pipeline=0)
    assert spot.shadow_for(0, lambda mb: True, 0.0) is None, "never on its own pipeline"
    assert spot.shadow_for(1, lambda mb: False, 0.0) is None, "never where it was held"
    assert spot.shadow_for(1, lambda mb: True, 0.0) == 5
    assert spot.is_copy(5, 1) and not spot.is_copy(5, 0)
    assert spot.shadow_for(2, lambda mb: True, 0.0) is None, "one copy until the two disagree"


# ------------------------------------------------------------------------------------ comparison
def honest(mb: int, scale: float = 1.0) -> dict[tuple[int, str], tuple[float, ...]]:
    """One copy's sketches of ``mb`` over two stages (a 4-value tensor per point), stage 0's output x ``scale``."""
    torch.manual_seed(mb)
    tensors = {"act": torch.randn(4), "grad": torch.randn(4), "grad_back": torch.randn(4)}
    act = tensors["act"] * scale
    s = {(0, "act_out"): sketch(act, 1), (1, "act_in"): sketch(act, 1),
         (1, "loss"): (2.0 * scale, 2.0 * scale),
         (1, "grad_out"): sketch(tensors["grad"] * scale, 2), (0, "grad_in"): sketch(tensors["grad"] * scale, 2)}
    return s


def test_the_path_runs_forward_then_back() -> None:
    assert path(2) == [(0, "act_out"), (1, "act_in"), (1, "loss"), (1, "grad_out"), (0, "grad_in")]
    assert path(3)[:4] == [(0, "act_out"), (1, "act_in"), (1, "act_out"), (2, "act_in")]


def test_the_first_difference_names_the_stage_and_the_majority_names_the_copy() -> None:
    tol = tolerance("fp32")
    good, bad = honest(0), honest(0, scale=1.1)
    assert first_difference(good, honest(0), N_STAGES, tol) is None
    assert first_difference(good, bad, N_STAGES, tol) == 0  # stage 0's output
    assert majority([bad, good, honest(0)], N_STAGES, tol) == (0, 0)
    assert majority([good, bad, honest(0)], N_STAGES, tol) == (1, 0)
    assert majority([good, bad, honest(0, scale=0.8)], N_STAGES, tol) is None, "three different copies"


def test_a_link_whose_ends_disagree_names_sender_and_receiver() -> None:
    tol = tolerance("fp32")
    copy = honest(0)
    assert broken_link(copy, N_STAGES, tol) is None
    copy[(1, "act_in")] = honest(0, scale=1.1)[(1, "act_in")]
    assert broken_link(copy, N_STAGES, tol) == (0, 1)
    copy = honest(0)
    copy[(0, "grad_in")] = honest(0, scale=1.1)[(0, "grad_in")]
    assert broken_link(copy, N_STAGES, tol) == (1, 0)


# -------------------------------------------------------------------------------- in the step machine
def ep(stage: int, pipeline: int) -> str:
    return f"s{stage}p{pipeline}"


def make_machine(n_pipelines: int, cheater: int | None,
                 own: Callable[[int, int], bool] | None = None) -> tuple[StepMachine, SpotChecks]:
    assignments = {ep(s, r): Assignment(
        epoch=1, stage=s, replica=r, n_stages=N_STAGES, n_replicas=n_pipelines, layers=(s, s + 1),
        group=tuple(ep(s, q) for q in range(n_pipelines)), coordinator="lead",
        prev=ep(s - 1, r) if s > 0 else None, next=ep(s + 1, r) if s < N_STAGES - 1 else None)
        for r in range(n_pipelines) for s in range(N_STAGES)}
    spot = SpotChecks(0, N_STAGES, lambda p: 1.0 if p == 0 else 0.0, rng=random.Random(3), own=own)
    machine = StepMachine(0, Roster(assignments), 2, now=0.0, timeout_s=600.0, lease_timeout_s=60.0, spot=spot)
    machine.start()
    return machine, spot


def run_copy(machine: StepMachine, mb: int, pipeline: int, wrong: bool, now: float) -> None:
    """``pipeline`` runs ``mb`` through both stages: its sketches, its loss, its commit."""
    copy = honest(mb, scale=1.1 if wrong else 1.0)
    for stage in range(N_STAGES):
        points = {name: v for (s, name), v in copy.items() if s == stage and name != "loss"}
        assert machine.sketch(pipeline, stage, mb, points)
    machine.loss(ep(1, pipeline), pipeline, mb, copy[(1, "loss")][0], now)
    machine.commit(mb, pipeline, now)


def test_a_shadow_copy_a_third_copy_and_the_cheater_is_excluded() -> None:
    machine, spot = make_machine(3, cheater=0)
    assert machine.lease(0, 0.1).microbatch == 0  # sampled (pipeline 0 is on probation)
    shadow = machine.lease(1, 0.2)
    assert (shadow.microbatch, shadow.speculative) == (0, True), "the shadow goes first and is held apart"
    assert machine.lease(2, 0.3).microbatch == 1
    run_copy(machine, 0, 0, wrong=True, now=1.0)
    answer = machine.commit(0, 1, 1.1)  # the shadow's commit is never summed
    assert answer.status is ctl.PoolStatus.DUPLICATE
    run_copy(machine, 0, 1, wrong=False, now=1.1)
    run_copy(machine, 1, 2, wrong=False, now=1.2)
    assert not [c for c in machine.tick(1.3) if isinstance(c, Spot)], "two copies differ: a third decides"
    third = machine.lease(2, 1.4)
    assert (third.microbatch, third.speculative) == (0, True)
    run_copy(machine, 0, 2, wrong=False, now=2.0)
    findings = [c.finding for c in machine.tick(2.1) if isinstance(c, Spot)]
    excluded = [f for f in findings if f.kind == "exclude"]
    assert len(excluded) == 1 and excluded[0].pipelines == (0,) and excluded[0].stage == 0
    assert "disagreed with the two other copies" in excluded[0].reason
    assert 0 in machine.state.dropped, "the cheater's pipeline is out of the step at once"
    assert machine.pool.assignment().get(0) == 1, "the verified shadow's gradient counts instead of a redo"
    assert spot.verified == 1


@pytest.mark.parametrize("leader_at", [None, (1, 0), (1, 1)])
def test_two_pipelines_that_differ_are_decided_by_the_leaders_own_copy_else_set_aside(leader_at) -> None:
    """Pipeline 0 corrupts micro-batch 0 from stage 0 on; pipeline 1 is the only other. Where the leader's own worker
    is pipeline 1's stage 0 (the first stage whose output differs), its copy decides: pipeline 0's stage-0 peer is
    excluded at once. Where the leader is elsewhere (pipeline 1's stage 1, or not in the plan), nobody can
    decide and both pipelines are set aside for the step."""
    own = None if leader_at is None else (lambda p, s: (p, s) == leader_at)
    machine, spot = make_machine(2, cheater=0, own=own)
    assert machine.lease(0, 0.1).microbatch == 0
    assert machine.lease(1, 0.2).speculative, "the shadow of micro-batch 0"
    run_copy(machine, 0, 0, wrong=True, now=1.0)
    run_copy(machine, 0, 1, wrong=False, now=1.1)
    findings = [c.finding for c in machine.tick(1.2) if isinstance(c, Spot)]
    if leader_at == (1, 0):
        assert [(f.kind, f.pipelines, f.stage) for f in findings] == [("exclude", (0,), 0), ("verified", (1,), -1)]
        assert "disagreed with the leader's own copy (pipeline 1)" in findings[0].reason
        assert 0 in machine.state.dropped and spot.passed == {(0, 1)}
    else:
        assert [(f.kind, f.pipelines) for f in findings] == [("aside", (0, 1))]
        assert "no third pipeline can decide" in findings[0].reason


def test_agreeing_copies_verify_and_the_reduce_waits_for_them() -> None:
    machine, spot = make_machine(3, cheater=None)
    machine.lease(0, 0.1)
    machine.lease(1, 0.2)  # the shadow of micro-batch 0
    assert machine.lease(2, 0.3).microbatch == 1
    run_copy(machine, 0, 0, wrong=False, now=1.0)
    run_copy(machine, 1, 2, wrong=False, now=1.0)
    assert machine.pool.complete()
    assert not any(isinstance(c, Emit) and c.name == "reduce" for c in machine.tick(1.1)), "the check is open"
    run_copy(machine, 0, 1, wrong=False, now=1.5)
    commands = machine.tick(1.6)
    assert [c.finding.kind for c in commands if isinstance(c, Spot)] == ["verified"]
    assert any(isinstance(c, Emit) and c.name == "reduce" for c in commands)
    assert machine.state.commits == {0: 0, 1: 2}, "the shadow is not in the commit record"


def test_with_two_pipelines_a_disagreement_sets_both_aside_and_the_step_is_replanned() -> None:
    machine, _ = make_machine(2, cheater=0)
    machine.lease(0, 0.1)
    machine.lease(1, 0.2)  # the shadow
    run_copy(machine, 0, 0, wrong=True, now=1.0)
    run_copy(machine, 0, 1, wrong=False, now=1.0)
    commands = machine.tick(1.1)
    asides = [c.finding for c in commands if isinstance(c, Spot) and c.finding.kind == "aside"]
    assert asides and asides[0].pipelines == (0, 1)
    failed = [c for c in commands if not isinstance(c, (Spot, Emit)) and hasattr(c, "error")]
    assert failed and isinstance(failed[0].error, ReplanNeededError)


def test_a_check_the_excluded_cheater_shadowed_is_decided_by_the_honest_copies_not_set_aside() -> None:
    """Pipeline 0 corrupts. It shadows micro-batch 1, whose original (pipeline 2) is honest: the two differ, so a
    third copy is wanted. Then pipeline 0 is excluded through micro-batch 0's check. Its copy of micro-batch 1 is
    forgotten, and what is left are honest copies: they must be compared with each other and verified, not set
    aside as "two copies differ" (they never did; the difference was the cheater's)."""
    assignments = make_machine(3, cheater=0)[0].roster.assignments
    spot = SpotChecks(0, N_STAGES, lambda p: 1.0, rng=random.Random(3))  # every lease is checked
    machine = StepMachine(0, Roster(assignments), 3, now=0.0, timeout_s=600.0, lease_timeout_s=60.0, spot=spot)
    machine.start()
    assert machine.lease(0, 0.1).microbatch == 0  # original on the cheater
    assert machine.lease(1, 0.2).microbatch == 0  # its shadow
    assert machine.lease(2, 0.3).microbatch == 1  # original on an honest pipeline
    shadow = machine.lease(0, 0.4)
    assert (shadow.microbatch, shadow.speculative) == (1, True), "the cheater shadows micro-batch 1"
    run_copy(machine, 0, 0, wrong=True, now=1.0)
    run_copy(machine, 0, 1, wrong=False, now=1.0)
    run_copy(machine, 1, 2, wrong=False, now=1.0)
    run_copy(machine, 1, 0, wrong=True, now=1.0)
    assert not [c for c in machine.tick(1.1) if isinstance(c, Spot)], "both checks want a third copy"
    third = machine.lease(2, 1.2)
    assert (third.microbatch, third.speculative) == (0, True)
    run_copy(machine, 0, 2, wrong=False, now=2.0)
    findings = [c.finding for c in machine.tick(2.1) if isinstance(c, Spot)]
    assert [(f.kind, f.pipelines) for f in findings if f.kind == "exclude"] == [("exclude", (0,))]
    assert 0 in machine.state.dropped
    copy = machine.lease(1, 2.2)
    assert (copy.microbatch, copy.speculative) == (1, True), "micro-batch 1 still wants a second honest copy"
    run_copy(machine, 1, 1, wrong=False, now=3.0)
    findings = [c.finding for c in machine.tick(3.1) if isinstance(c, Spot)]
    assert [(f.kind, f.pipelines) for f in findings] == [("verified", (2, 1))], findings
    assert set(machine.state.aside) == {0} and machine.state.dropped == {0}, "only the cheater is out"


def test_missing_sketches_set_the_pipeline_aside_after_the_wait() -> None:
    machine, _ = make_machine(3, cheater=None)
    assert machine.lease(2, 0.1).microbatch == 0  # pipeline 2 is not on probation: not sampled
    machine.commit(0, 2, 1.0)  # no sketches sent
    assert not machine.tick(5.0) or 2 not in machine.state.dropped
    findings = [c.finding for c in machine.tick(12.0) if isinstance(c, Spot)]
    assert [f.kind for f in findings] == ["late"] and 2 in machine.state.dropped


def test_sketches_of_micro_batches_or_pipelines_the_step_does_not_have_are_not_kept() -> None:
    machine, spot = make_machine(3, cheater=None)
    points = {name: v for (s, name), v in honest(0).items() if s == 0}
    assert not machine.sketch(0, 0, 10**9, points)
    assert not machine.sketch(7, 0, 0, points)
    assert not machine.sketch(0, 0, 0, {"act_out": points["act_out"]}), "stage 0 reports act_out and grad_in"
    assert machine.sketch(0, 0, 0, points)
    assert list(spot.sketches) == [(0, 0)]


def test_link_tolerance_covers_the_wire_codecs_error_and_skips_the_integer_codecs() -> None:
    from tasklet.peer.runtime.sketch import link_tolerance
    from tasklet.protocol.codec import decode_tensor, encode_tensor

    torch.manual_seed(0)
    x = torch.randn(2, 32, 32) * 3 + 0.5
    for codec in ("none", "fp16"):
        sent = decode_tensor(encode_tensor("h", x, codec))
        assert agree(sketch(x, 5), sketch(sent, 5), link_tolerance("fp32", codec)), codec
    assert link_tolerance("fp32", "int4") == float("inf")


# ------------------------------------------------------------------------------------- the roll-back ledger
def test_the_ledger_records_only_unverified_applied_work_and_an_exclusion_asks_for_a_roll_back() -> None:
    machine, spot = make_machine(3, cheater=None)
    machine.lease(0, 0.1)
    machine.lease(1, 0.2)  # the shadow of micro-batch 0
    machine.lease(2, 0.3)
    run_copy(machine, 0, 0, wrong=False, now=1.0)
    run_copy(machine, 1, 2, wrong=False, now=1.0)
    run_copy(machine, 0, 1, wrong=False, now=1.5)
    machine.tick(1.6)
    assert spot.passed == {(0, 0), (0, 1)} and machine.state.commits == {0: 0, 1: 2}
    excluded: list[str] = []
    v = Verification(RunSpec(spot_check=0.1), lambda e: f"id-{e}", lambda e, why: excluded.append(e),
                     lambda *a: None)
    v.applied(4, machine.roster, machine.state.commits, spot)
    v.applied(6, machine.roster, {0: 0, 1: 1}, spot)  # a later step: pipeline 1 with unverified work
    assert v.ledger.first == {"id-s0p2": 4, "id-s1p2": 4, "id-s0p1": 6, "id-s1p1": 6}, \
        "pipeline 0's verified copy does not count; the first unverified step is kept"
    assert v.earliest_unverified([ep(0, 0), ep(1, 1)]) == 6 and v.earliest_unverified([ep(0, 0)]) is None
    v.act(machine.roster, 7, Finding("exclude", 1, (0,), "stage 0 disagreed", stage=0))
    assert excluded == [ep(0, 0)] and v.take_rollback() is None, "nothing of its reached the model unverified"
    v.act(machine.roster, 7, Finding("exclude", 1, (2,), "stage 1 disagreed", stage=1))
    assert excluded[-1] == ep(1, 2)
    assert v.take_rollback() == (4, [ep(1, 2)], f"{ep(1, 2)}: stage 1 disagreed")
    assert v.take_rollback() is None, "taken once"
    # the referee's exclusion (a disputed link, judged by witnesses) discards the same way
    v.discard(ep(0, 1), "sent data its receiver refused")
    assert v.take_rollback() == (6, [ep(0, 1)], f"{ep(0, 1)}: sent data its receiver refused")
    v.rolled_back(5)  # the checkpoint of step 5: step 6's work is gone, step 4's stays
    assert v.ledger.first == {"id-s0p2": 4, "id-s1p2": 4}


def test_the_ledger_goes_to_the_next_leader_through_the_record_folded_never_less() -> None:
    ledger = Ledger()
    ledger.applied(3, ["a", "b"])
    ledger.applied(5, ["c"])
    ledger.applied(7, ["d"])
    record = json.loads(json.dumps(ledger.to_record(limit=2)))  # through JSON, as the record is published
    assert record == {"first": {"a": 3, "b": 3}, "overflow": 5}, "the later entries are folded into overflow"
    again = Ledger.from_record(record)
    assert [again.first_unverified(w) for w in "abcde"] == [3, 3, 5, 5, 5], "c and d roll back further, never less"
    assert Ledger.from_record(ledger.to_record()).first == ledger.first
    hostile = Ledger.from_record({"first": {"x": -1, "y": "3", "z": True, "": 2, "k" * 200: 1, "ok": 4},
                                  "overflow": "0"})
    assert (hostile.first, hostile.overflow) == ({"ok": 4}, None)
    assert Ledger.from_record([1, 2]).first == {} and Ledger.from_record({"first": [1]}).first == {}


def test_a_full_ledger_rolls_back_further_never_less(monkeypatch) -> None:
    monkeypatch.setattr(spot_module, "MAX_PROBATION_RECORDS", 2)
    ledger = Ledger()
    ledger.applied(3, ["a", "b"])
    ledger.applied(5, ["c"])
    ledger.applied(4, ["d", "a"])
    assert ledger.first == {"a": 3, "b": 3} and ledger.overflow == 4
    assert ledger.first_unverified("c") == 4 and ledger.first_unverified("a") == 3
    assert ledger.earliest(["c", "zz"]) == 4
    ledger.rolled_back(4)
    assert ledger.overflow is None and ledger.first_unverified("c") is None and ledger.first == {"a": 3, "b": 3}


def test_a_backup_copy_that_takes_over_a_commit_is_linked_and_the_step_reduces() -> None:
    """Pipeline 0 commits micro-batch 0 before pipeline 2's speculative copy of it, which becomes its backup; then
    pipeline 0 loses a member, so the backup's gradient counts. The spot checks must take the backup's commit as
    checked like any other, or the reduce waits for a link that is never checked (a swarm stalled this way after
    a healed partition, until its step deadline)."""
    n = 3
    assignments = {ep(s, r): Assignment(
        epoch=1, stage=s, replica=r, n_stages=N_STAGES, n_replicas=n, layers=(s, s + 1),
        group=tuple(ep(s, q) for q in range(n)), coordinator="lead",
        prev=ep(s - 1, r) if s > 0 else None, next=ep(s + 1, r) if s < N_STAGES - 1 else None)
        for r in range(n) for s in range(N_STAGES)}
    spot = SpotChecks(0, N_STAGES, lambda p: 0.0, rng=random.Random(3))  # no shadows: only the backup path
    machine = StepMachine(0, Roster(assignments), 4, now=0.0, timeout_s=600.0, lease_timeout_s=60.0, spot=spot,
                          speculate_after=(1.0, None))
    machine.start()
    assert [machine.lease(p, 0.1).microbatch for p in range(n)] == [0, 1, 2]
    run_copy(machine, 2, 2, wrong=False, now=0.5)
    assert machine.lease(2, 0.6).microbatch == 3
    run_copy(machine, 3, 2, wrong=False, now=0.7)
    copy = machine.lease(2, 2.0)  # pipelines 0 and 1 are overdue: a copy of the oldest lease
    assert (copy.microbatch, copy.speculative) == (0, True)
    run_copy(machine, 0, 0, wrong=False, now=2.1)  # the original wins ...
    run_copy(machine, 0, 2, wrong=False, now=2.2)  # ... and the copy is its backup
    machine.died(ep(1, 0))
    run_copy(machine, 1, 1, wrong=False, now=2.5)
    emitted = [c.name for t in (2.6, 3.0) for c in machine.tick(t) if isinstance(c, Emit)]
    assert machine.pool.assignment() == {0: 2, 1: 1, 2: 2, 3: 2}, "the backup counts, nothing is redone"
    assert "reduce" in emitted, f"the step stalled in {machine.phase}: {emitted}"
