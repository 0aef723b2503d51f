"""A stage's sketch reports after a re-plan (peer.runtime.stage.loop.SketchReporter).

A step redone after a re-plan can move a peer to another stage. Its tensors kept for the old stage must not join
the new stage's report: the coordinator refuses a report whose points are not its stage's
(``spot.expected_points``), and the pipeline was then set aside for sketches that "did not arrive" (seen in
tests/swarms/test_spot_swarm.py: a second re-plan, 11 s -> 45 s).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tasklet.peer.runtime.lead.spot import expected_points
from tasklet.peer.runtime.stage.loop import SketchReporter

pytestmark = pytest.mark.unit


class Outbox:
    def __init__(self) -> None:
        self.reports: list[Any] = []

    def submit(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def report(self, t: Any, msg: Any) -> None:
        self.reports.append(msg)


def tasklet(epoch: int, stage: int) -> SimpleNamespace:
    return SimpleNamespace(spec=SimpleNamespace(sketches=True, run_id="run"),
                           assignment=SimpleNamespace(epoch=epoch, stage=stage))


def test_a_stage_changed_by_a_re_plan_reports_only_its_new_stages_points() -> None:
    outbox = Outbox()
    reporter = SketchReporter(outbox)  # type: ignore[arg-type]
    x = torch.ones(2, 3)
    first = tasklet(epoch=1, stage=0)  # step 0 as stage 0 of 2: its forward ran, then the pipeline was dropped
    reporter.keep(first, 0, 3, "act_out", x)
    second = tasklet(epoch=2, stage=1)  # the re-plan made it the last stage; step 0 and micro-batch 3 again
    reporter.keep(second, 0, 3, "act_in", x)
    reporter.keep(second, 0, 3, "grad_out", x)
    reporter.send(second, 0, 3)
    [msg] = outbox.reports
    assert set(msg.points) == expected_points(1, 2) == {"act_in", "grad_out"}
    reporter.send(first, 0, 3)
    assert len(outbox.reports) == 1, "the old plan's leftovers were dropped, not sent later"


def test_the_same_plan_and_stage_keep_every_point_of_a_micro_batch() -> None:
    outbox = Outbox()
    reporter = SketchReporter(outbox)  # type: ignore[arg-type]
    t = tasklet(epoch=1, stage=0)
    reporter.keep(t, 5, 0, "act_out", torch.ones(4))
    reporter.keep(t, 5, 1, "act_out", torch.ones(4))  # another micro-batch of the same step stays
    reporter.keep(t, 5, 0, "grad_in", torch.ones(4))
    reporter.send(t, 5, 0)
    reporter.send(t, 5, 1)
    assert [set(m.points) for m in outbox.reports] == [{"act_out", "grad_in"}, {"act_out"}]
