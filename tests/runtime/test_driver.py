"""The run driver on its own: real stage workers and a real coordinator in this process (gRPC on loopback),
a fake planner that records what it was asked, and a membership list the test controls.

What is checked is the driver's part: re-planning after a death with the dead worker banned and the
survivors keeping or handing over their state, checkpoints written and a run resumed from one bit-exactly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import flat_digest
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.checkpoints import CheckpointStore
from tasklet.peer.runtime.control import SourceKind
from tasklet.peer.runtime.lead.coordinator import StepFailedError, StepReport
from tasklet.peer.runtime.lead.driver import DriverConfig, Pipelines, RunDriver, Stages, StragglerJudge, _stage_holders
from tasklet.peer.runtime.lead.spot import Finding
from tasklet.peer.runtime.lead.step import TooFewPeersError
from tasklet.peer.runtime.stage.step import Work
from tests.support.driver import SPEC, WHOLE_MODEL, FakePlanner, make_driver


def assert_reference(params: torch.Tensor, steps: int) -> None:
    """A stage state's parameters (the whole model) equal single-process training of ``steps`` steps within 1e-5."""
    ref, _ = train_reference(SPEC.model, SPEC.optim, Corpus.load(SPEC.corpus), SPEC.seed, steps, SPEC.n_microbatches,
                             SPEC.micro_batch)
    for name, got in unflatten_stage(SPEC.model, 0, 2, params).items():
        err = float((got - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-12))
        assert err < 1e-5, f"{name}: {err:.2e} off single-process training"


def death_then_join(workers, live: dict[int, str], at_death: Callable[[], None] = lambda: None,
                    at_join: Callable[[], None] = lambda: None) -> Callable[[StepReport], None]:
    """The churn of a run over devices 0 and 1: worker 1 dies after step 1 (its advert stays: the membership still
    lists it) and device 2 joins after step 2; ``at_death`` / ``at_join`` run just before each."""

    def churn(report: StepReport) -> None:
        if report.step == 1:
            at_death()
            workers[1].stop()
        if report.step == 2:
            at_join()
            live[2] = workers[2].server.endpoint

    return churn


def test_death_is_replanned_without_the_dead_worker_and_state_is_handed_over(workers) -> None:
    planner = FakePlanner()
    live = {0: workers[0].server.endpoint, 1: workers[1].server.endpoint}
    churn = death_then_join(workers, live)
    driver, coordinator = make_driver(workers, planner, DriverConfig(steps=4, step_timeout_s=60), churn, live)
    try:
        reports = driver.run()
        states = coordinator.live_states(every_replica=True)
    finally:
        coordinator.close()
    dead = workers[1].server.endpoint
    assert [r.step for r in reports] == [0, 1, 2, 3]
    assert reports[2].dropped_pipelines == [1], "the step during which it died went on without its pipeline"
    assert reports[2].microbatches_per_pipeline == {0: SPEC.n_microbatches}
    assert planner.calls == [([0, 1], None), ([0, 2], WHOLE_MODEL)], "re-planned once, dead device left out"
    assert driver.banned == {dead}
    assert [p["reason"] for p in driver.events.replans] == ["start", "membership changed"]
    assert driver.events.replans[1]["step"] == 3 and driver.events.replans[1]["pipelines"] == [[0], [2]]
    # the newcomer fetched the survivor's state and both trained on in lockstep
    assert sorted(states) == [(0, 0), (0, 1)]
    a, b = states[(0, 0)], states[(0, 1)]
    assert a["step"] == b["step"] == 4
    for name in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(a[name], b[name]), f"{name}: the replicas drifted apart"


def test_checkpoint_then_resume_matches_an_uninterrupted_run(workers, tmp_path) -> None:
    planner = FakePlanner()
    # uninterrupted: 3 steps on worker 0
    driver, coordinator = make_driver(workers[:1], planner, DriverConfig(steps=3))
    try:
        driver.run()
        straight = coordinator.live_states()[(0, 0)]
    finally:
        coordinator.close()
    # interrupted: 2 steps on worker 1 with a checkpoint every 2, then a new leader resumes on worker 2
    driver, coordinator = make_driver(workers[1:2], planner,
                                      DriverConfig(steps=2, checkpoint_dir=tmp_path, checkpoint_every=2))
    try:
        driver.run()
    finally:
        coordinator.close()
    assert driver.events.checkpoints == [2]
    assert (tmp_path / "latest").read_text().strip() == "step-000002"
    assert (tmp_path / "step-000002" / "stage-0.pt").exists() and (tmp_path / "step-000002" / "run.json").exists()
    driver, coordinator = make_driver(workers[2:], planner, DriverConfig(steps=3, checkpoint_dir=tmp_path))
    try:
        reports = driver.run(resume=True)
        resumed = coordinator.live_states()[(0, 0)]
    finally:
        coordinator.close()
    assert [r.step for r in reports] == [2], "the resumed run redoes nothing before its checkpoint"
    assert resumed["step"] == straight["step"] == 3
    for name in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(resumed[name], straight[name]), f"{name} differs from the uninterrupted run"


def test_a_far_slower_worker_is_a_straggler_at_once_a_mildly_slower_one_after_two_steps() -> None:
    judge = StragglerJudge(factor=2.0, steps=2)
    stage_of = {"a": 0, "b": 0, "c": 0, "x": 1, "y": 1, "z": 1}
    busy = dict.fromkeys(stage_of, 0.0)
    ops = dict.fromkeys(stage_of, 0)

    def step(per_op: dict[str, float], n_ops: int = 4) -> list[str]:
        """One step: each worker in ``per_op`` does ``n_ops`` ops at that many seconds each; the rest idle."""
        for ep, t in per_op.items():
            busy[ep] += n_ops * t
            ops[ep] += n_ops
        return [ep for ep, *_ in judge.observe({ep: (busy[ep], ops[ep]) for ep in stage_of}, stage_of)]

    normal = dict.fromkeys(stage_of, 0.1)
    # 5x its stage's median: over 2^2 = 4x, no warm-up makes a whole step that slow: reported after one step
    assert step({**normal, "a": 0.5, "x": 0.3}) == ["a"], "3x is only slow: it must be so twice in a row"
    assert step({**normal, "a": 0.5, "x": 0.3}) == ["a", "x"]
    assert step(normal) == [], "back to normal: no straggler, and the count starts again"
    assert step({**normal, "x": 0.3}) == []
    # x computes nothing the next step (the pool paced its pipeline out): that is no recovery
    assert step({ep: t for ep, t in normal.items() if ep != "x"}) == ["x"]
    # a worker that idles without having been slow is not judged on its idleness
    assert step({ep: t for ep, t in normal.items() if ep != "y"}) == []
    # b's pipeline was overtaken while b's slow op (2 ops) ran: it completed nothing in the step, but its op has
    # run 1.0 s, at least 0.5 s an op, 5x the median: reported without waiting for the op to end
    samples = {ep: (busy[ep], ops[ep]) for ep in stage_of}
    for ep in stage_of:
        if ep != "b":
            busy[ep] += 0.4
            ops[ep] += 4
    running = {ep: (busy[ep], ops[ep], 1.0, 2) if ep == "b" else (busy[ep], ops[ep], 0.0, 0) for ep in samples}
    assert [ep for ep, *_ in judge.observe(running, stage_of)] == ["b"]


class _NeedsTwo(FakePlanner):
    """Two replicas or nothing: fewer live devices cannot hold the plan."""

    def __call__(self, live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
        if len(live) < 2:
            self.calls.append((list(live), None))
            raise TooFewPeersError(f"{len(live)} live peer(s) cannot hold 2 replicas")
        return super().__call__(live, stages)


def test_a_plan_short_of_peers_pauses_until_one_comes_back_instead_of_failing(workers) -> None:
    planner = _NeedsTwo()
    live = {0: workers[0].server.endpoint}
    driver, coordinator = make_driver(workers, planner, DriverConfig(steps=2, step_timeout_s=60, replan_wait_s=0.05),
                                      live=live)
    pauses: list[dict | None] = []
    driver.on_pause = pauses.append
    joiner = threading.Timer(0.6, lambda: live.__setitem__(1, workers[1].server.endpoint))
    joiner.start()
    try:
        reports = driver.run()
    finally:
        joiner.cancel()
        coordinator.close()
    assert [r.step for r in reports] == [0, 1]
    assert len(planner.calls) > 3, "it asked again while it waited"
    assert pauses[0] is not None and "waiting for peers: 1 live peer(s) cannot hold 2 replicas" in pauses[0]["reason"]
    assert pauses[0]["until"] is None and pauses[-1] is None and len(pauses) == 2, "one pause, then training on"
    assert driver.events.replans[0]["devices"] == [0, 1]


def test_a_plan_short_of_peers_for_longer_than_peers_wait_s_fails_with_the_reason(workers) -> None:
    planner = _NeedsTwo()
    cfg = DriverConfig(steps=2, step_timeout_s=60, replan_wait_s=0.05, peers_wait_s=0.3)
    driver, coordinator = make_driver(workers, planner, cfg, live={0: workers[0].server.endpoint})
    try:
        with pytest.raises(StepFailedError, match="1 live peer.s. cannot hold 2 replicas for 0 s"):
            driver.run()
    finally:
        coordinator.close()
    assert driver.events.replans == []


@pytest.mark.parametrize("checkpoints", [True, False], ids=["to-the-pinned-checkpoint", "to-step-0"])
def test_a_cheater_excluded_by_a_spot_check_has_its_unverified_work_rolled_back(workers, tmp_path,
                                                                                 checkpoints) -> None:
    """Worker 2 had unverified work applied from step 1 on (the ledger, filled by hand: the spot checks' own tests
    fill it for real) and is excluded by a spot check after step 3: the run goes back to the checkpoint of step 1
    (kept although ``checkpoint_keep`` is 1, because a live worker's work since is unverified), or to the seeded
    step 0 without checkpoints, redoes the steps without worker 2, and ends where single-process training does."""
    planner = FakePlanner()
    cfg = DriverConfig(steps=5, step_timeout_s=60, replan_wait_s=0.05, checkpoint_copies=0,
                       checkpoint_dir=tmp_path if checkpoints else None, checkpoint_every=1, checkpoint_keep=1)
    cheater = workers[2].server.endpoint
    caught: list[int] = []

    def cheat(report: StepReport) -> None:
        v = coordinator.verification
        if report.step == 1 and not caught:
            v.ledger.applied(1, [v.who(cheater)])
        if report.step == 3 and not caught:
            caught.append(report.step)
            pipeline = coordinator.roster.assignments[cheater].replica
            v.act(coordinator.roster, 3, Finding("exclude", 0, (pipeline,), "its stage 0 disagreed", stage=0))

    driver, coordinator = make_driver(workers, planner, cfg, cheat)
    try:
        reports = driver.run()
        states = coordinator.live_states(every_replica=True)
    finally:
        coordinator.close()
    to = 1 if checkpoints else 0
    assert [{k: v for k, v in r.items() if k != "reason"} for r in driver.events.rollbacks] == [
        {"from_step": 4, "to_step": to, "redone": 4 - to}]
    assert "no spot check verified was applied from step 1 on (" in driver.events.rollbacks[0]["reason"]
    assert [r.step for r in reports] == [0, 1, 2, 3, 4], "the discarded steps' reports are trimmed"
    assert cheater in driver.banned and planner.calls[-1] == ([0, 1], WHOLE_MODEL), "never planned again"
    assert driver.events.replans[-1]["step"] == to and "spot check excluded" in driver.events.replans[-1]["reason"]
    assert coordinator.verification.ledger.first == {}, "the discarded work is forgotten"
    if checkpoints:
        assert driver.events.checkpoints[:3] == [1, 2, 3]
    assert sorted(states) == [(0, 0), (0, 1)]
    for state in states.values():
        assert state["step"] == 5
        assert_reference(state["params"], 5)


def test_a_holder_is_a_claim_that_matches_the_agreed_parameters_hash() -> None:
    stages = [(0, 1), (1, 2)]

    def st(layers: tuple[int, int], h: object, trained: int = 5) -> dict:
        return {"layers": list(layers), "trained_steps": trained, "params_hash": h}

    answers = [("a", st((0, 1), "x")), ("b", st((0, 1), "y")), ("c", st((0, 1), "x")), ("d", st((1, 2), "z")),
               ("e", st((1, 2), None)), ("f", st((1, 2), "z", trained=4)), ("g", None)]
    # what the replicas agreed on (or the previous leader recorded) decides, for the stages it names
    assert _stage_holders(answers, stages, 5, {(0, 1): "y"}) == {0: ["b"], 1: ["d", "e"]}
    # without a record, a strict majority of the claims decides where the replicas must agree
    assert _stage_holders(answers, stages, 5, {}, majority=True) == {0: ["a", "c"], 1: ["d", "e"]}
    assert _stage_holders(answers[:2], stages, 5, {}, majority=True) == {0: ["a", "b"]}, "1 against 1: no majority"
    # a DiLoCo replica mid-round holds its own parameters: no majority is asked for
    assert _stage_holders(answers, stages, 5) == {0: ["a", "b", "c"], 1: ["d", "e"]}


def test_a_survivor_whose_status_does_not_match_the_agreed_hash_holds_nothing(workers) -> None:
    """Worker 0 survives worker 1's death but its Status names parameters its stage's replicas never agreed on:
    it is no holder of the stage (its claim is not believed), so the run goes back to the seeded step 0 instead of
    keeping or handing over that state, and still ends where single-process training does."""
    planner = FakePlanner()
    live = {0: workers[0].server.endpoint, 1: workers[1].server.endpoint}
    honest = workers[0].status
    churn = death_then_join(workers, live, at_death=lambda: workers[0].server.set_status_provider(
        lambda: {**honest(), "params_hash": "f" * 32}))
    cfg = DriverConfig(steps=4, step_timeout_s=60, replan_wait_s=0.05, checkpoint_copies=0)
    driver, coordinator = make_driver(workers, planner, cfg, churn, live)
    try:
        reports = driver.run()
        states = coordinator.live_states(every_replica=True)
    finally:
        coordinator.close()
    assert driver.digests.step == 4 and set(driver.digests.by_layers) == {(0, 2)}
    assert [{k: v for k, v in r.items() if k != "reason"} for r in driver.events.rollbacks] == [
        {"from_step": 3, "to_step": 0, "redone": 3}]
    assert "every replica of a stage is gone" in driver.events.rollbacks[0]["reason"]
    assert [r.step for r in reports] == [0, 1, 2, 3]
    assert sorted(states) == [(0, 0), (0, 1)]
    for state in states.values():
        assert_reference(state["params"], 4)


def test_a_source_that_serves_other_parameters_than_it_claims_is_refused_and_banned(workers) -> None:
    """Worker 0, the last holder of the stage, changes its parameters after the replicas agreed on them while its
    Status still names the agreed hash (a patched client). The newcomer fetching from it refuses what it serves;
    the leader fetches and hashes that state itself, bans worker 0 for good, and the run goes back to the seeded
    step 0 with the newcomer alone, ending where single-process training does: the poisoned state never loads."""
    planner = FakePlanner()
    live = {0: workers[0].server.endpoint, 1: workers[1].server.endpoint}

    def poison() -> None:
        compute = workers[0].compute
        assert compute is not None and compute.known_digest is not None
        compute._master.mul_(1.01)  # the cached digest stays: the Status reply goes on naming the agreed one

    churn = death_then_join(workers, live, at_join=poison)
    cfg = DriverConfig(steps=4, step_timeout_s=60, replan_wait_s=0.05, checkpoint_copies=0)
    driver, coordinator = make_driver(workers, planner, cfg, churn, live)
    poisoner = workers[0].server.endpoint
    try:
        reports = driver.run()
        states = coordinator.live_states(every_replica=True)
    finally:
        coordinator.close()
    assert poisoner in driver.banned and planner.calls[-1] == ([2], WHOLE_MODEL)
    assert [{k: v for k, v in r.items() if k != "reason"} for r in driver.events.rollbacks] == [
        {"from_step": 3, "to_step": 0, "redone": 3}]
    assert [r.step for r in reports] == [0, 1, 2, 3]
    assert sorted(states) == [(0, 0)]
    assert_reference(states[(0, 0)]["params"], 4)


def test_a_checkpoint_passes_over_a_replica_that_serves_other_parameters(workers, tmp_path) -> None:
    """Replica 0 (worker 0) changes its parameters after the last step's replicas agreed on them: the checkpoint
    of that step takes the stage from replica 1, whose parameters hash to the agreed value."""
    planner = FakePlanner()

    def poison(report: StepReport) -> None:
        if report.step == 1:
            compute = workers[0].compute
            assert compute is not None
            compute._master.mul_(1.01)

    cfg = DriverConfig(steps=2, step_timeout_s=60, checkpoint_dir=tmp_path, checkpoint_every=2, checkpoint_copies=0)
    driver, coordinator = make_driver(workers, planner, cfg, poison, {0: workers[0].server.endpoint,
                                                                        1: workers[1].server.endpoint})
    try:
        driver.run()
    finally:
        coordinator.close()
    assert driver.events.checkpoints == [2] and driver.recovery.checkpoint_digests == {2: driver.digests.at(2)}
    saved = CheckpointStore(tmp_path).load(2).states[0]["params"]
    honest = workers[1].compute
    assert honest is not None and torch.equal(saved, honest.flat_params())
    assert flat_digest(saved) == driver.digests.at(2)[(0, 2)]


def test_a_retried_plan_fetches_from_another_holder() -> None:
    """A holder may serve one fetcher other bytes than it serves the leader (the fetcher refuses, the leader's own
    check passes): each retry of the plan takes the next holder of the stage as the source."""
    endpoints = ["h0:1", "h1:1", "new:1"]
    assignments = build_assignments(SPEC, WHOLE_MODEL, [[0], [1], [2]], endpoints, "lead:1", 1)
    driver = RunDriver(SPEC, None, dict, FakePlanner(), lambda *a: {}, DriverConfig(steps=4))  # type: ignore[arg-type]
    driver.trained = 3
    picked = []
    for attempt in range(3):
        driver._attempt = attempt
        sources, rollback = driver._sources(assignments, {0: ["h0:1", "h1:1"]}, None)
        assert rollback is None and sources["h0:1"].kind is SourceKind.KEEP
        picked.append(sources["new:1"].endpoint)
    assert picked == ["h0:1", "h1:1", "h0:1"]


def test_a_pipeline_whose_reloads_outlast_steps_is_in_sync_when_the_run_ends(workers) -> None:
    """Worker 1 turns slow at step 1, so its pipeline is overtaken and dropped, and each of its reloads takes longer
    than the steps the other pipeline runs meanwhile: it is told newer and newer steps, runs each (not dropped as
    stale, however far behind it is), and the last one, after the run's last step, leaves it in sync: the run ends
    without waiting out the resync limit (150 s)."""
    loop = workers[1].loop
    forward, resync = loop._handlers[Work.FORWARD], loop._handlers[Work.RESYNC]
    told: list[int] = []

    def slow_forward(t, step, *args) -> None:  # noqa: ANN001
        if step >= 1:
            time.sleep(0.4)
        forward(t, step, *args)

    def slow_resync(t, step, *args) -> None:  # noqa: ANN001
        told.append(step)
        time.sleep(1.0)
        resync(t, step, *args)

    loop._handlers[Work.FORWARD], loop._handlers[Work.RESYNC] = slow_forward, slow_resync
    driver, coordinator = make_driver(workers[:2], FakePlanner(), DriverConfig(steps=5, straggler_factor=0))
    in_sync: list[bool] = []
    wait = coordinator.wait_in_sync
    coordinator.wait_in_sync = lambda timeout_s=20.0: in_sync.append(wait(timeout_s=20.0)) or in_sync[-1]
    try:
        reports = driver.run()
        pending = coordinator.resync.laggards()
        states = coordinator.live_states(every_replica=True)
    finally:
        coordinator.close()
    dropped = [r.step for r in reports if 1 in r.dropped_pipelines]
    assert dropped and dropped[0] == 1, [r.dropped_pipelines for r in reports]
    assert len(told) >= 2 and told[-1] == 4, f"resyncs run for steps {told}: the newer ones were dropped"
    assert in_sync == [True] and not pending, f"still reloading when the run ended: {pending}"
    assert states[(0, 0)]["step"] == states[(0, 1)]["step"] == 5
    assert torch.equal(states[(0, 0)]["params"], states[(0, 1)]["params"])
