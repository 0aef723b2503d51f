"""A member that poisons the averaging is excluded before any replica applies its work.

Real worker processes on loopback (LocalSwarm), one of them started with a fault of peer.emulation.faults, as a
volunteer would run a modified client: ``scale-shard`` (an owner sends the others its summed shard x 1000 in the
all-gather) and ``noise-grad`` (gradient shards replaced by noise of the honest norm). Each run must end with
every honest worker alive, all steps trained, and parameters equal to single-process training of the honest work
(which, the cheater's work being refused and redone, is the undisturbed run) within 1e-5 of each tensor's scale.
The contribution record built from the run's step reports (as the leader builds it) gives the cheater nothing
for the step it poisoned and adds up to the micro-batches trained.
"""

from __future__ import annotations

import pytest

from tasklet.peer.emulation.local import LocalSwarm
from tasklet.peer.swarm.credit import CreditBook
from tests.support.fault_runs import FULL, SLOW, SPEC, STEPS, Reference, assert_matches_reference, flops, reference_run

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return reference_run(STEPS)


@pytest.mark.parametrize(("fault", "device", "why"), [
    ("scale-shard", 3, "summed shard 1"),  # stage 1 of pipeline 1: owns shard 1 of stage 1
    ("noise-grad", 1, "unrelated to the others' sum"),  # stage 1 of pipeline 0
])
def test_a_poisoning_member_is_excluded_and_the_model_is_the_honest_one(reference, fault: str, device: int,
                                                                       why: str) -> None:
    deaths: list[dict] = []
    with LocalSwarm(SPEC, 4, links=SLOW, forward_flops=flops, faults={device: fault}) as swarm:
        swarm.coordinator.on_event = lambda name, info: deaths.append(info) if name == "dead" else None
        result = swarm.train(FULL, STEPS)
        alive = sorted(d for d in swarm.workers.live() if d != device)
        cheater = swarm.workers.endpoints[device]
    print(f"{fault}: excluded {[(d['endpoint'], d['reason'][:160]) for d in deaths]}")
    assert_matches_reference(result, reference)
    assert deaths and all(d["endpoint"] == cheater for d in deaths), "only the cheater is excluded"
    assert why in deaths[0]["reason"]
    assert alive == [d for d in range(4) if d != device], "every honest worker is alive"
    assert result.reports[0].dropped_pipelines == [0 if device == 1 else 1]
    last = result.events.replans[-1]
    assert all(device not in p for p in last["pipelines"])
    # credit, as the leader keeps it (peer.node.leader_role.credit_step), from the real step reports
    book = CreditBook()
    for report in result.reports:
        plan = [p for p in result.events.replans if p["step"] <= report.step][-1]
        devices = [[f"device{d}" for d in pipe] for pipe in plan["pipelines"]]
        book.step(report.step, report.seconds, {r: report.microbatches_per_pipeline.get(r, 0)
                                                for r in report.applied}, devices)
    credit = book.to_record()
    assert credit["peers"].get(f"device{device}", {}).get("microbatches", 0) == 0, credit
    assert credit["total_microbatches"] == STEPS * SPEC.n_microbatches
    assert sum(p["microbatches"] for p in credit["peers"].values()) == len(FULL[0]) * credit["total_microbatches"]
