"""A run driver over real in-process stage workers and a real coordinator (gRPC on loopback), with a fake planner
that records what it was asked: shared by the driver's and the checkpoints' tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.lead.coordinator import Coordinator, StepReport
from tasklet.peer.runtime.lead.driver import DriverConfig, Pipelines, RunDriver, Stages
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.worker import StageWorker

SPEC = RunSpec(run_id="driver", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=4)
WHOLE_MODEL: Stages = [(0, 2)]


class FakePlanner:
    """One one-stage pipeline per live device; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], Stages | None]] = []

    def __call__(self, live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
        self.calls.append((list(live), None if stages is None else list(stages)))
        return list(stages or WHOLE_MODEL), [[d] for d in live]


@pytest.fixture(name="workers")
def workers_fixture() -> Iterator[list[StageWorker]]:
    torch.set_num_threads(1)
    started = [StageWorker(peer_id=f"w{i}") for i in range(3)]
    try:
        for w in started:
            w.start()
        yield started
    finally:
        for w in started:
            w.stop()


def make_driver(
    workers: list[StageWorker],
    planner: FakePlanner,
    cfg: DriverConfig,
    on_step: Callable[[StepReport], None] | None = None,
    live: dict[int, str] | None = None,
) -> tuple[RunDriver, Coordinator]:
    """A driver over ``workers`` (device i = workers[i]); ``live``: the membership it sees (default: all)."""
    # liveness checks far apart: a death is noticed by the failed start_step of the next step, deterministically
    coordinator = Coordinator(SPEC, liveness_interval_s=60.0)
    coordinator.start()
    endpoints = [w.server.endpoint for w in workers]

    def assignments(stages: Stages, pipelines: Pipelines, epoch: int) -> dict[str, Assignment]:
        return build_assignments(SPEC, stages, pipelines, endpoints, coordinator.endpoint, epoch)

    members = dict(enumerate(endpoints)) if live is None else live
    driver = RunDriver(SPEC, coordinator, lambda: dict(members), planner, assignments, cfg, on_step=on_step)
    return driver, coordinator
