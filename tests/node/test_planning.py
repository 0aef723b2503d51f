"""The leader's planner over daemon device ids: the first plan picks the split, re-plans keep it and start from
the current plan, so a departure moves few tasklets."""

from __future__ import annotations

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.node.planning import ClusterView, make_planner
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler.cluster import load_scenario

SPEC = RunSpec(run_id="planning", model=ModelConfig(n_layers=8, d_model=64, n_heads=4, seq_len=32), micro_batch=4,
               n_microbatches=16)
WORLD = load_scenario("worldwide_geo_distributed")
IDS = list(range(100, 116))  # daemon device ids are not scenario indices


def view_of(live: list[int]) -> ClusterView:
    cluster = WORLD.subset([IDS.index(d) for d in live])
    return ClusterView(cluster=cluster, peers=[], measured_pairs=len(live) ** 2 - len(live), estimated_pairs=0)


def moved(before: list[list[int]], after: list[list[int]]) -> int:
    """Tasklets whose device did not hold that stage before: each needs the stage's state sent to it."""
    stage_of = {dev: s for row in before for s, dev in enumerate(row)}
    return sum(1 for row in after for s, dev in enumerate(row) if stage_of.get(dev) != s)


def test_replan_after_a_departure_keeps_the_split_and_moves_few_tasklets() -> None:
    planner = make_planner(SPEC, view_of, stages_hint=4, time_limit_s=1.0, seed=3)
    stages, pipelines = planner(list(IDS), None)
    assert len(stages) == 4 and len(pipelines) == 4
    assert sorted(d for row in pipelines for d in row) == IDS
    gone = pipelines[1][2]
    live = [d for d in IDS if d != gone]
    stages2, pipelines2 = planner(live, stages)
    assert stages2 == stages
    assert gone not in {d for row in pipelines2 for d in row}
    assert all(len(row) == len(stages) for row in pipelines2)
    # 15 devices hold 3 pipelines of 4: the 3 intact pipelines can stay as they are
    assert moved(pipelines, pipelines2) <= 4, (pipelines, pipelines2)
