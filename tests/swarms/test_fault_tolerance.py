"""Training survives peers that vanish, join or misbehave — and every micro-batch counts exactly once.

Real worker processes on loopback, killed with SIGKILL at chosen moments (the coordinator's event hook says
when a step is forwarding, back-propagating or averaging). Each run must end with the same parameters as
plain single-process training on the same data (up to float summation order, 1e-5 of each tensor's scale):
a micro-batch lost or counted twice would show up as a difference far above that.

Compute is emulated slow (a few tens of ms per op) so that "mid-forward" really is mid-forward.
"""

from __future__ import annotations

import threading

import pytest

from tasklet.peer.emulation.local import LocalSwarm
from tests.support.fault_runs import (
    FULL,
    SLOW,
    SPEC,
    STAGES,
    STEPS,
    Reference,
    assert_matches_reference,
    flops,
    reference_run,
)

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return reference_run(STEPS)


def kill_on(swarm: LocalSwarm, event: str, step: int, devices: list[int]) -> threading.Event:
    """Kill ``devices`` the first time the coordinator emits ``event`` during ``step``."""
    fired = threading.Event()

    def hook(name: str, info: dict) -> None:
        if name == event and info.get("step") == step and not fired.is_set():
            fired.set()
            for d in devices:
                threading.Thread(target=swarm.workers.kill, args=(d,), daemon=True).start()

    swarm.coordinator.on_event = hook
    return fired


@pytest.mark.parametrize(("moment", "victim"), [("lease", 1), ("commit", 2), ("reduce", 3)],
                         ids=["mid-forward", "mid-backward", "mid-gradient-sync"])
def test_killed_peer_run_matches_undisturbed(reference, moment: str, victim: int) -> None:
    with LocalSwarm(SPEC, 4, links=SLOW, forward_flops=flops, heartbeat_s=1.0) as swarm:
        fired = kill_on(swarm, moment, 2, [victim])
        result = swarm.train(FULL, STEPS)
    assert fired.is_set()
    assert_matches_reference(result, reference)
    step2 = result.reports[2]
    if moment != "reduce":  # a death during compute: the step went on without that pipeline
        assert step2.dropped_pipelines, "the victim's pipeline should have been dropped from step 2"
        assert step2.requeued >= 1
    assert len(result.events.replans) >= 2, "the leader re-plans after a death"
    last = result.events.replans[-1]
    assert all(victim not in p for p in last["pipelines"])


def test_joining_peer_gets_a_stage_and_run_matches(reference) -> None:
    with LocalSwarm(SPEC, 2, links=SLOW, forward_flops=flops) as swarm:
        def grow(report) -> None:
            if report.step == 1:
                swarm.workers.add()
                swarm.workers.add()

        result = swarm.train((STAGES, [[0, 1]]), STEPS, on_step=grow)
    assert_matches_reference(result, reference)
    last = result.events.replans[-1]
    assert len(last["pipelines"]) == 2 and {2, 3} <= {d for p in last["pipelines"] for d in p}
    assert last["step"] == 2
    assert set(result.reports[-1].microbatches_per_pipeline) == {0, 1}, "the newcomers' pipeline trained"


def test_all_replicas_of_a_stage_killed_resumes_from_checkpoint(reference, tmp_path) -> None:
    with LocalSwarm(SPEC, 4, links=SLOW, forward_flops=flops, heartbeat_s=1.0) as swarm:
        kill_on(swarm, "lease", 3, [1, 3])  # both replicas of stage 1, during step 3
        result = swarm.train(FULL, STEPS, checkpoint_dir=tmp_path, checkpoint_every=2)
    assert_matches_reference(result, reference)
    assert result.events.rollbacks == [{"from_step": 3, "to_step": 2, "redone": 1,
                                        "reason": "every replica of a stage is gone"}]
    assert (tmp_path / "step-000002" / "stage-1.pt").exists()
    assert (tmp_path / "latest").read_text().strip() == "step-000004"


def test_peer_sending_nan_is_excluded(reference) -> None:
    with LocalSwarm(SPEC, 4, links=SLOW, forward_flops=flops, faults={3: "nan-grad"}) as swarm:
        result = swarm.train(FULL, STEPS)
        reasons = dict(swarm.driver.events.replans[-1]) if swarm.driver else {}
        dead_reason = " ".join(swarm.driver.banned) if swarm.driver else ""
    assert_matches_reference(result, reference)
    assert result.reports[0].dropped_pipelines == [1]
    assert "127.0.0.5" in dead_reason  # device 3 listens on 127.0.0.5
    assert all(3 not in p for p in reasons["pipelines"])
