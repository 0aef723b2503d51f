"""A patient cheater's applied work is rolled back, with real worker processes on loopback.

The cheater (``late-wrong-activations`` of peer.emulation.faults: stage 0 of pipeline 0, honest in step 0, then
sending its activations x 1.1 with sketches that hide it from its own pipeline) is checked on every micro-batch
of step 0 (its probation) and passes; its corrupted micro-batches of step 1 are applied unchecked (the worst
case of a low ``spot_check``). In step 2 every micro-batch of its pipeline is drawn for a check, as some draw
eventually is: a shadow copy disagrees, a third copy decides, the cheater is excluded, and the leader's ledger
says from which step its unverified work reached the model (step 1; step 0 if one of its probation
micro-batches went unchecked: a speculative copy is not drawn). The draws are scripted by the test (the leader's
own are unpredictable by design) so that the run is short and always has applied corrupted work to undo. The
run rolls back to the checkpoint of that step (the one of step 1 was written after step 0, before any corrupted
work), or to the seeded step 0, and redoes the steps without it: the saved parameters equal single-process
training within 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest

from tasklet.peer.emulation.local import LocalSwarm
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.spot import SpotChecks
from tests.support.fault_runs import SLOW, SPEC, STAGES, flops, reference_run, worst_error

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

STEPS = 3
CATCH = 2  # the step in which every micro-batch of the cheater's pipeline is drawn for a check
# until the cheater is caught, each step's draws: all of step 0 (its probation), none of step 1, the cheater's
# pipeline's in step 2
RATES = {0: lambda pipeline: 1.0, 1: lambda pipeline: 0.0, CATCH: lambda pipeline: 1.0 if pipeline == 0 else 0.0}
PATIENT = dataclasses.replace(SPEC, spot_check=0.0, probation_check=1.0, probation_microbatches=1)
CHEATER = 0  # stage 0 of pipeline 0


def test_a_patient_cheaters_applied_work_is_rolled_back_to_single_process_training(tmp_path) -> None:
    reference = reference_run(STEPS)
    seen: list[tuple[str, dict]] = []

    def watch(name: str, info: dict) -> None:
        if name in ("dead", "commit", "apply"):
            seen.append((name, info))

    with LocalSwarm(PATIENT, 6, links=SLOW, forward_flops=flops, faults={CHEATER: "late-wrong-activations"}) as swarm:
        verification, cheater = swarm.coordinator.verification, swarm.workers.endpoints[CHEATER]
        draw = verification.checks

        def checks(step: int, roster: Roster, lease_timeout_s: float) -> SpotChecks | None:
            spot = draw(step, roster, lease_timeout_s)
            if spot is not None and not any(name == "dead" for name, _ in seen):  # the draws, as scripted
                spot.rate_of = RATES.get(step, spot.rate_of)
            return spot

        verification.checks = checks  # type: ignore[method-assign]
        swarm.coordinator.on_event = watch
        result = swarm.train((STAGES, [[0, 1], [2, 3], [4, 5]]), STEPS, checkpoint_dir=tmp_path, checkpoint_every=1)
        alive = sorted(d for d in swarm.workers.live() if d != CHEATER)
    deaths = [info for name, info in seen if name == "dead"]
    print(f"excluded {[(d['endpoint'], d['reason'][:160]) for d in deaths]}; roll-backs {result.events.rollbacks}; "
          f"checkpoints {result.events.checkpoints}")
    assert deaths and all(d["endpoint"] == cheater for d in deaths), "only the cheater is excluded"
    assert f"(step {CATCH})" in deaths[0]["reason"], "caught in the step where every micro-batch is checked"
    before = seen[:seen.index(("dead", deaths[0]))]
    applied_unchecked = [i for name, i in before if name == "commit" and i["step"] == 1 and i["pipeline"] == 0
                         and i["result"] == "committed"]
    assert applied_unchecked and ("apply", {"step": 1}) in before, "its corrupted work of step 1 was applied"
    assert len(result.events.rollbacks) == 1, "rolled back once"
    back = result.events.rollbacks[0]
    # from the end of the catching step, or from its start when it failed (no intact pipeline left)
    assert back["from_step"] in (CATCH, CATCH + 1) and back["to_step"] in (0, 1), "to before its corrupted work"
    assert back["redone"] == back["from_step"] - back["to_step"] >= 1
    assert f"applied from step {back['to_step']} on" in back["reason"]
    assert alive == [d for d in range(6) if d != CHEATER], "every honest worker is alive"
    assert all(CHEATER not in p for p in result.events.replans[-1]["pipelines"]), "never planned again"
    assert [r.step for r in result.reports] == list(range(STEPS))
    err = worst_error(result, reference, STEPS)
    assert err < 1e-5, f"{err:.2e} of a tensor's scale off single-process training of the honest work"
