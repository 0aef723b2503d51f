"""The scheduler chooses compression and sync period with the placement (scheduler/compression.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasklet.scheduler import Cluster, Plan, Workload, cost_full
from tasklet.scheduler.api import plan
from tasklet.scheduler.compression import (
    CODEC_S_PER_ELEMENT,
    EXACT,
    OUTER_CODEC_PASSES,
    PENALTY_PATH,
    Choice,
    CompressedCost,
    CompressionSpace,
    PenaltyTable,
    SyncOption,
    bytes_per_element,
    bytes_per_step,
    predict,
    timing_for,
)
from tasklet.scheduler.errors import PlanningError
from tasklet.scheduler.memetic import MemeticConfig
from tasklet.scheduler.schedule import CONTROL_S_PER_WORKER
from tasklet.scheduler.simulate import simulate_timing

QUICK = MemeticConfig(generations=4, max_evaluations=400, population=2)  # 4 devices: a tiny search space

PENALTIES = PenaltyTable(
    activation={"fp16": 0.0005, "int8": 0.002, "int4": 0.008, "int2": 0.05},
    sync={"diloco-H8-none": 0.004, "diloco-H8-int8": 0.005, "diloco-H8-topk": 0.012,
          "diloco-H32-none": 0.015, "diloco-H32-int8": 0.016, "diloco-H32-topk": 0.03},
    # measured together (here: more than the sum, as on real runs)
    joint={f"{a}+diloco-H{h}-{c}": 1.5 * (act + sync) for a, act in
           (("fp16", 0.0005), ("int8", 0.002), ("int4", 0.008), ("int2", 0.05))
           for h, c, sync in ((8, "none", 0.004), (8, "int8", 0.005), (8, "topk", 0.012),
                              (32, "none", 0.015), (32, "int8", 0.016), (32, "topk", 0.03))},
)


def uniform_cluster(n: int, gbps: float, delay_ms: float = 1.0) -> Cluster:
    delay = [[0.0 if i == j else delay_ms for j in range(n)] for i in range(n)]
    bw = [[gbps] * n for _ in range(n)]
    return Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": delay, "bandwidth_gbps": bw,
                              "tflops": [20.0] * n, "memory_gb": [80.0] * n})


def workload() -> Workload:
    return Workload.gpt(n_layers=8, d_model=1024, n_heads=8, seq_len=512, vocab=32000, micro_batch=4,
                        n_microbatches=8, stages=2, replicas=2)


def test_slow_links_get_a_compressing_plan_fast_links_the_exact_one() -> None:
    space = CompressionSpace(PENALTIES, max_loss_penalty=0.02)
    slow = plan(uniform_cluster(4, 0.05), workload(), compression=space, seed=0, config=QUICK)
    choice = slow.predicted["choice"]
    assert choice["activation"] != ["none"] and choice["sync"] != "exact", choice
    assert slow.predicted["loss_penalty"] <= 0.02
    exact_same = predict(uniform_cluster(4, 0.05), workload(), slow, Choice.exact(2))
    assert slow.predicted["total_s"] < exact_same["total_s"] / 3
    assert slow.predicted["bytes_per_step"]["total"] < exact_same["bytes_per_step"]["total"] / 10

    # NVLink-class links: the sync costs under 1 % of the step (min_gain), so nothing is worth its penalty
    fast = plan(uniform_cluster(4, 1600.0, delay_ms=0.005), workload(), compression=space, seed=0, config=QUICK)
    assert fast.predicted["choice"]["activation"] == ["none"]
    assert fast.predicted["choice"]["sync"] == "exact"
    assert fast.predicted["loss_penalty"] == 0.0


@pytest.mark.parametrize("limit", [0.0, 0.001, 0.006, 0.02, 0.05])
def test_the_penalty_limit_is_respected(limit: float) -> None:
    space = CompressionSpace(PENALTIES, max_loss_penalty=limit)
    p = plan(uniform_cluster(4, 0.02), workload(), compression=space, seed=1, config=QUICK)
    assert p.predicted["loss_penalty"] <= limit + 1e-12
    if limit == 0.0:
        assert p.predicted["choice"]["sync"] == "exact" and p.predicted["choice"]["activation"] == ["none"]
    if limit == 0.05:  # room for more compression: at least as fast as under a tighter limit
        tighter = plan(uniform_cluster(4, 0.02), workload(), compression=CompressionSpace(PENALTIES, 0.006),
                       seed=1, config=QUICK)
        assert p.predicted["total_s"] <= tighter.predicted["total_s"] * (1 + 1e-9)


def test_unmeasured_options_are_never_chosen() -> None:
    table = PenaltyTable(activation={"int8": 0.001}, sync={"diloco-H8-int8": 0.001})
    p = plan(uniform_cluster(4, 0.01), workload(), compression=CompressionSpace(table, 0.5), seed=0,
             config=QUICK)
    assert set(p.predicted["choice"]["activation"]) <= {"none", "int8"}
    assert p.predicted["choice"]["sync"] in ("exact", "diloco-H8-int8")
    assert p.predicted["choice"]["sync"] == "diloco-H8-int8"  # the slow links make it worth it


def test_penalties_are_looked_up_never_summed() -> None:
    table = PenaltyTable(activation={"int8": 0.001, "int4": 0.01}, sync={"diloco-H8-int8": 0.001},
                         joint={"int8+diloco-H8-int8": 0.004})
    h8 = SyncOption(8, "int8")
    # a per-boundary mix is bounded by its most aggressive codec measured on every boundary
    assert table.penalty(Choice(("none", "int8", "int4"), EXACT)) == 0.01
    assert table.penalty(Choice(("int8", "none", "fp16"), EXACT)) == 0.001  # fp16 unmeasured, int8 bounds it
    assert table.penalty(Choice(("fp16",), EXACT)) == float("inf")
    assert table.penalty(Choice(("none", "int8", "none"), h8)) == 0.004  # the joint measurement, not 0.001 + 0.001
    assert table.penalty(Choice(("none",) * 3, h8)) == 0.001
    # a combination without its joint measurement is never chosen, whatever its parts cost alone
    assert table.penalty(Choice(("int4",) * 3, h8)) == float("inf")
    space = CompressionSpace(table, 0.5)
    p = plan(uniform_cluster(4, 0.01), workload(), compression=space, seed=0, config=QUICK)
    assert p.predicted["loss_penalty"] <= 0.004 + 1e-12
    assert "int4" not in p.predicted["choice"]["activation"] or p.predicted["choice"]["sync"] == "exact"
    # the round trip keeps the joint entries and the per-period outer settings
    table.outer = {"diloco-H8-int8": {"outer_lr": 0.5, "outer_momentum": 0.8}}
    again = PenaltyTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert again.joint == table.joint and again.outer_for(h8) == {"outer_lr": 0.5, "outer_momentum": 0.8}
    assert Choice(("int8",), h8).to_dict(again)["outer_momentum"] == 0.8


def test_exact_choice_is_the_plain_full_model_and_the_leaders_three_rounds() -> None:
    c, w = uniform_cluster(4, 1.0), workload()
    p = Plan([(0, 4), (4, 8)], [[0, 1], [2, 3]])
    got = predict(c, w, p, Choice.exact(2))
    rounds = 3 * 4 * CONTROL_S_PER_WORKER  # start, reduce, apply; each over the plan's 4 workers
    assert got["control_s"] == pytest.approx(rounds)
    assert got["total_s"] == pytest.approx(cost_full.predict(c, w, p)["total_s"] + rounds, rel=1e-12)


def test_diloco_control_counts_its_rounds_and_the_outer_codec_per_step() -> None:
    c, w = uniform_cluster(4, 0.1), workload()
    p = Plan([(0, 4), (4, 8)], [[0, 1], [2, 3]])
    elems = max(w.stage_params(a, b) for a, b in p.stages)
    for h in (2, 8):
        for comp, codec in (("none", 0.0), ("int8", OUTER_CODEC_PASSES * elems * CODEC_S_PER_ELEMENT["int8"])):
            got = predict(c, w, p, Choice(("none",), SyncOption(h, comp)))
            # start and the merged inner reduce-and-apply every step; the outer reduce and apply once per round
            want = (2 + 2 / h) * 4 * CONTROL_S_PER_WORKER + codec / h
            assert got["control_s"] == pytest.approx(want)
            assert got["total_s"] == pytest.approx(got["pipeline_s"] + got["dp_s"] + want)
    # the simulator charges the same rounds
    t = timing_for(c, w, p, Choice(("none",), SyncOption(2, "int8")))
    assert simulate_timing(t, c).total_s == pytest.approx(cost_full.predict_timing(t)["total_s"], rel=0.05)


def test_sync_period_amortises_the_compressed_dp_term() -> None:
    c, w = uniform_cluster(4, 0.1), workload()
    p = Plan([(0, 4), (4, 8)], [[0, 1], [2, 3]])
    exact = predict(c, w, p, Choice.exact(2))
    for comp in ("none", "int8", "topk", "topk2", "topk4"):
        h8 = predict(c, w, p, Choice(("none",), SyncOption(8, comp)))
        assert h8["pipeline_s"] == pytest.approx(exact["pipeline_s"])
        # per stage 2 (delay + 8 f P_s / (D bw)) / H; a sparse all-gather sends the 2 members' sum exactly
        gather = 2 * 8 / 64 if comp.startswith("topk") else bytes_per_element(comp, 4)
        f = (bytes_per_element(comp, 4) + gather) / 2 / 4
        want = max(2 * (0.001 + 8 * f * w.stage_param_bytes(a, b) / 2 / 0.1e9) / 8 for a, b in p.stages)
        assert h8["dp_s"] == pytest.approx(want)
    # activation bytes per boundary follow the codec's bytes per element
    int4 = predict(c, w, p, Choice(("int4",), EXACT))
    elems = w.micro_batch * w.seq_len * w.d_model
    assert int4["bytes_per_step"]["pipeline"] == pytest.approx(2 * 8 * elems * (0.5 + 4 / 64))
    assert int4["pipeline_s"] < exact["pipeline_s"]


def test_uniform_search_objective_matches_the_prediction_of_its_choice() -> None:
    c, w = uniform_cluster(4, 0.05), workload()
    stages = [(0, 4), (4, 8)]
    cost = CompressedCost(c, w, stages, CompressionSpace(PENALTIES, 0.02))
    m = np.array([[0, 1], [2, 3]])
    total, choice = cost.best(m)
    # the objective leaves out exact training's control rounds, a constant of the split (the bound stays tight)
    exact_rounds = 3 * m.size * CONTROL_S_PER_WORKER
    got = predict(c, w, Plan(stages, m.tolist()), choice)
    assert total + exact_rounds == pytest.approx(got["total_s"], rel=1e-9)


def test_bytes_per_step_counts_both_phases() -> None:
    w = workload()
    p = Plan([(0, 4), (4, 8)], [[0, 1], [2, 3]])
    b = bytes_per_step(w, p, Choice.exact(2))
    assert b["sync"] == pytest.approx(2 * 1 * w.total_params * 4)
    b32 = bytes_per_step(w, p, Choice(("none",), SyncOption(32, "int8")))
    assert b32["sync"] == pytest.approx(b["sync"] / 32 * (1 + 4 / 64) / 4)
    # sparse: contributions as coded, the 2 members' summed shard as an exact top-k (2 entries per 64, 8 B each)
    for comp, scatter in (("topk", 8 / 64), ("topk2", 1.25 / 64 + 4 / 4096), ("topk4", 1.5 / 64 + 4 / 4096)):
        sparse = bytes_per_step(w, p, Choice(("none",), SyncOption(32, comp)))
        assert sparse["sync"] == pytest.approx(b["sync"] / 32 * (scatter + 2 * 8 / 64) / 2 / 4)


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanningError):
        SyncOption(1, "int8")
    with pytest.raises(PlanningError):
        SyncOption(0)
    with pytest.raises(PlanningError):
        SyncOption.parse("diloco-8-int8")
    assert SyncOption.parse("diloco-H32-topk") == SyncOption(32, "topk")
    with pytest.raises(PlanningError):
        CompressionSpace(PENALTIES, max_loss_penalty=-1)
    with pytest.raises(PlanningError):
        PenaltyTable(activation={"int4": float("nan")}, sync={})
    with pytest.raises(PlanningError):
        PenaltyTable(activation={}, sync={}, joint={"int4+diloco-H8-none": "small"})  # type: ignore[dict-item]
    with pytest.raises(PlanningError):
        PenaltyTable.from_dict({"activation": {}, "sync": {}, "joint": [1]})
    bad = tmp_path / "p.json"
    bad.write_text("{")
    with pytest.raises(PlanningError):
        PenaltyTable.load(bad)
    with pytest.raises(PlanningError):
        plan(uniform_cluster(4, 1.0), workload(), cost_model="dtfm", compression=CompressionSpace(PENALTIES))



def test_shipped_table_is_a_measurement() -> None:
    doc = json.loads(PENALTY_PATH.read_text())
    table = PenaltyTable.load()
    assert "bench.bandwidth" in doc["meta"]["produced_by"]
    assert set(table.activation) >= {"none", "fp16", "int8", "int4", "int2"}
    assert any(k.startswith("diloco-") for k in table.sync)


def test_default_space_offers_only_what_the_table_measured() -> None:
    table = PenaltyTable(activation={"int8": 0.0}, sync={"diloco-H2-int8": 0.01, "diloco-H16-topk": 0.3},
                         joint={"int8+diloco-H32-int8": 0.04})
    assert table.measured_syncs() == (SyncOption(2, "int8"), SyncOption(16, "topk"), SyncOption(32, "int8"))
    space = CompressionSpace.default()
    shipped = PenaltyTable.load()
    assert space.sync[0] == EXACT and set(space.sync[1:]) == set(shipped.measured_syncs())
    assert all(shipped.penalty(Choice(("none",), s)) < float("inf") or any(
        k.endswith("+" + s.name) for k in shipped.joint) for s in space.sync)
    # fp32 pseudo-gradients and H = 128 are not in the option space: nothing measures them
    assert not any(s.period == 128 or (s.period > 1 and s.pseudo_grad_compression == "none") for s in space.sync)


def test_an_overlapped_round_is_hidden_behind_one_inner_step_and_chosen_only_where_measured() -> None:
    c, w = uniform_cluster(4, 0.1), workload()
    p = Plan([(0, 4), (4, 8)], [[0, 1], [2, 3]])
    elems = max(w.stage_params(a, b) for a, b in p.stages)
    codec = OUTER_CODEC_PASSES * elems * CODEC_S_PER_ELEMENT["int8"]
    assert SyncOption.parse("diloco-H16-int8-late") == SyncOption(16, "int8", overlap=True)
    assert SyncOption(16, "int8", overlap=True).name == "diloco-H16-int8-late"
    with pytest.raises(PlanningError, match="overlap"):
        SyncOption(1, "none", overlap=True)
    for h in (2, 16):
        sync = predict(c, w, p, Choice(("none",), SyncOption(h, "int8")))
        late = predict(c, w, p, Choice(("none",), SyncOption(h, "int8", overlap=True)))
        assert late["pipeline_s"] == pytest.approx(sync["pipeline_s"])
        # the round (its bytes and its codec) takes the time of one inner step away, never less than nothing
        per_round = sync["dp_s"] * h + codec
        assert late["dp_s"] == pytest.approx(max(0.0, per_round - sync["pipeline_s"]) / h)
        assert late["control_s"] == pytest.approx(sync["control_s"] - codec / h)
        assert late["total_s"] < sync["total_s"]
        assert late["choice"]["outer_overlap"] is True and sync["choice"]["outer_overlap"] is False
    # the search's objective agrees with the prediction of the late choice
    late_table = PenaltyTable(activation={}, sync={"diloco-H16-int8": 0.01, "diloco-H16-int8-late": 0.01})
    cost = CompressedCost(c, w, p.stages, CompressionSpace(late_table, 0.02, activation=("none",), sync=(
        EXACT, SyncOption(16, "int8"), SyncOption(16, "int8", overlap=True))))
    m = np.array(p.pipelines)
    total, choice = cost.best(m)
    assert choice.sync == SyncOption(16, "int8", overlap=True)
    got = predict(c, w, Plan(p.stages, m.tolist()), choice)
    assert total + 3 * m.size * CONTROL_S_PER_WORKER == pytest.approx(got["total_s"], rel=1e-9)
    # unmeasured (or over the limit): never chosen
    for table in (PenaltyTable(activation={}, sync={"diloco-H16-int8": 0.01}),
                  PenaltyTable(activation={}, sync={"diloco-H16-int8": 0.01, "diloco-H16-int8-late": 0.05})):
        cost = CompressedCost(c, w, p.stages, CompressionSpace(table, 0.02, activation=("none",), sync=(
            EXACT, SyncOption(16, "int8"), SyncOption(16, "int8", overlap=True))))
        assert not cost.best(m)[1].sync.overlap
