"""The leader's host dies together with its disk: a new leader on another host resumes from a checkpoint copy.

Used by ``tests/test_checkpoint_copies.py`` and ``python -m bench.recovery`` (``leader_disk_resume_s``).

The swarm: five stage workers in this process (real gRPC over loopback with mutual TLS, real torch), each
keeping checkpoint copies in its own folder. Leader 1 (a coordinator and a run driver, checkpoint folder D1)
trains 2 stages x 2 pipelines ``[[w0, w1], [w2, w3]]``, checkpoints every 2 steps and copies each checkpoint to
``copies`` other workers. Then its host dies: its coordinator and worker w0 stop and D1 is deleted; w2, the
other replica of stage 0, dies with it, so stage 0 has no replica left. Leader 2, on another host with an empty
checkpoint folder, takes over the run at the step leader 1 reached: no live peer holds stage 0, so it fetches
the newest copy from the live peers, rolls the run back to it (the log says how many steps are redone) and
trains to the end on ``[[w4, w1]]``. ``resume_s`` is the time from leader 2's start to its first finished step.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peer.compute.data import Corpus
from peer.compute.model import ModelConfig, unflatten_stage
from peer.compute.reference import train_reference
from peer.emulation.local import chunk_planner
from peer.runtime.assign import build_assignments
from peer.runtime.coordinator import Coordinator
from peer.runtime.driver import DriverConfig, Pipelines, RunDriver, RunEvents, Stages
from peer.runtime.spec import Assignment, RunSpec
from peer.runtime.worker import StageWorker

SPEC = RunSpec(run_id="leader-loss", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=4)
STAGES: Stages = [(0, 1), (1, 2)]


@dataclass
class LeaderLossResult:
    first_run_steps: int  # steps leader 1 finished before its host died
    events: RunEvents  # leader 2's
    resume_s: float  # leader 2's start to its first finished step
    states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    max_param_rel_diff: float = 0.0  # against single-process training of the same steps


def _driver(workers: dict[int, StageWorker], planner: Any, cfg: DriverConfig,
            epoch: int = 0) -> tuple[RunDriver, Coordinator]:
    coordinator = Coordinator(SPEC, liveness_interval_s=60.0)
    coordinator.start()
    endpoints = {d: w.server.endpoint for d, w in workers.items()}
    n = max(endpoints) + 1
    table = [endpoints.get(d, "127.0.0.1:1") for d in range(n)]

    def assignments(stages: Stages, pipelines: Pipelines, epoch: int) -> dict[str, Assignment]:
        return build_assignments(SPEC, stages, pipelines, table, coordinator.endpoint, epoch)

    return RunDriver(SPEC, coordinator, lambda: dict(endpoints), planner, assignments, cfg, epoch=epoch), coordinator


def run_leader_loss(root: Path, steps: int = 5, die_after: int = 3, checkpoint_every: int = 2,
                    copies: int = 3) -> LeaderLossResult:
    """Run the scenario in ``root`` (workers' copy folders and the leaders' checkpoint folders)."""
    torch.set_num_threads(1)
    workers = {d: StageWorker(peer_id=f"w{d}", checkpoint_copies=root / f"w{d}-copies") for d in range(5)}
    for w in workers.values():
        w.start()
    try:
        first = {d: workers[d] for d in range(4)}
        plan1 = [[0, 1], [2, 3]]
        driver1, coordinator1 = _driver(first, lambda live, stages: (list(STAGES), plan1),
                                        DriverConfig(steps=die_after, checkpoint_dir=root / "leader1",
                                                     checkpoint_every=checkpoint_every, checkpoint_copies=copies))
        try:
            driver1.run()
            driver1.wait_for_copies(60.0)
        finally:
            coordinator1.close()
        # the leader's host dies with its disk, and with it the other replica of stage 0
        workers[0].stop()
        workers[2].stop()
        shutil.rmtree(root / "leader1")
        survivors = {d: workers[d] for d in (1, 3, 4)}

        def planner(live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
            # stage 0 on the newcomer w4, stage 1 on w1 (which still holds it)
            order = [4, 1] + [d for d in live if d not in (4, 1)]
            return chunk_planner([d for d in order if d in live], stages or STAGES, SPEC.model.n_layers, 2)

        # a new leader plans above its predecessor's epoch (the daemon reads it from the plan board)
        driver2, coordinator2 = _driver(survivors, planner, DriverConfig(steps=steps, checkpoint_dir=root / "leader2",
                                                                         checkpoint_copies=copies), epoch=driver1.epoch)
        started = time.monotonic()
        first_done: list[float] = []
        driver2.on_step = lambda report: first_done.append(time.monotonic()) if not first_done else None
        try:
            driver2.run(takeover=(die_after, STAGES))
            states = coordinator2.live_states(every_replica=True)
        finally:
            coordinator2.close()
        result = LeaderLossResult(die_after, driver2.events, first_done[0] - started, states)
        result.max_param_rel_diff = max_rel_diff(states, steps)
        return result
    finally:
        for w in workers.values():
            w.stop()


def max_rel_diff(states: dict[tuple[int, int], dict[str, Any]], steps: int) -> float:
    reference, _ = train_reference(SPEC.model, SPEC.optim, Corpus.load(SPEC.corpus), SPEC.seed, steps,
                                   SPEC.n_microbatches, SPEC.micro_batch)
    worst = 0.0
    for (stage, _), state in states.items():
        a, b = STAGES[stage]
        for name, got in unflatten_stage(SPEC.model, a, b, state["params"]).items():
            ref = reference[name]
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst
