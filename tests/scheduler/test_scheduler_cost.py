"""Cost models: hand-computed cases, the paper's reference numbers, and ``full`` against the simulator."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tasklet.scheduler import Cluster, Plan, Workload, cost_dtfm, cost_full
from tasklet.scheduler.plan import even_stages
from tasklet.scheduler.schedule import Timing
from tasklet.scheduler.simulate import simulate, simulate_timing

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(os.environ.get("TASKLET_SCENARIOS", REPO.parent / "shared" / "scenarios" / "dtfm_scenarios.json"))
if not SCENARIOS.exists():
    SCENARIOS = REPO / "scheduler" / "data" / "dtfm_scenarios.json"

# shared/scenarios/README.md: consecutive (total, DP, 2PP) and stage-major (total, DP, 2PP)
REFERENCE = {
    "datacenter_on_demand": ((3.4398, 2.9120, 0.5278), (16.9806, 0.0910, 16.8896)),
    "datacenter_spot": ((49.5039, 7.2800, 42.2239), (49.5039, 7.2800, 42.2239)),
    "multi_universities": ((16.0868, 5.5169, 10.5700), (17.6481, 1.8340, 15.8141)),
    "regional_geo_distributed": ((34.8020, 8.3421, 26.4600), (39.9826, 4.6200, 35.3626)),
    "worldwide_geo_distributed": ((49.2184, 22.7584, 26.4600), (75.2937, 4.6200, 70.6737)),
}


def device_scenario(delay_ms: list[list[float]], gbps: list[list[float]], **extra: object) -> Cluster:
    return Cluster.from_dict({"devices": len(delay_ms), "matrix_level": "device", "delay_ms": delay_ms,
                              "bandwidth_gbps": gbps, **extra})


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_dtfm_reproduces_reference_numbers(name: str) -> None:
    cluster = Cluster.from_scenario(SCENARIOS, name)
    w = Workload.preset("gpt3-xl-dtfm")
    consecutive = np.arange(64).reshape(8, 8)
    for layout, ref in ((consecutive, REFERENCE[name][0]), (consecutive.T.copy(), REFERENCE[name][1])):
        got = cost_dtfm.cost(cluster, w, Plan(even_stages(24, 8), layout.tolist()))
        assert (round(got["total_s"], 4), round(got["dp_s"], 4), round(got["pp_s"], 4)) == ref


def test_dtfm_hand_computed_two_by_two() -> None:
    # 4 devices, 2 stages x 2 replicas; G = 1e9 B per stage (2e9 model bytes / 2), A = 0.5e9 B.
    delay = [[0, 10, 20, 30], [10, 0, 40, 50], [20, 40, 0, 60], [30, 50, 60, 0]]
    bw = [[1, 1, 2, 4], [1, 1, 8, 1], [2, 8, 1, 2], [4, 1, 2, 1]]
    c = device_scenario(delay, bw)
    w = Workload.preset("tiny").with_split(2, 2)
    w.dtfm_model_bytes, w.dtfm_activation_bytes = 2e9, 0.5e9
    plan = Plan([(0, 2), (2, 4)], [[0, 1], [2, 3]])  # groups {0, 2} and {1, 3}
    got = cost_dtfm.cost(c, w, plan)
    # DP: group {0,2}: 2 (0.020 + 8 * 1 / (2 * 2)) = 4.04; group {1,3}: 2 (0.050 + 8 / (1 * 2)) = 8.1
    assert got["dp_s"] == pytest.approx(8.1)
    # PP: hop max(pp[0,1], pp[2,3]) = max(0.010 + 4 / 1, 0.060 + 4 / 2) = 4.01; total = 8.1 + 2 * 4.01
    assert got["pp_s"] == pytest.approx(8.02)
    assert got["total_s"] == pytest.approx(16.12)


def test_workload_formulas() -> None:
    w = Workload.gpt(n_layers=2, d_model=8, n_heads=2, seq_len=4, vocab=10, micro_batch=3, n_microbatches=2)
    layer = 24 * 3 * 4 * 64 + 4 * 3 * 16 * 8
    assert w.stage_forward_flops(0, 1) == layer + 2 * 3 * 4 * 8
    assert w.stage_forward_flops(1, 2) == layer + 2 * 3 * 4 * 8 * 10 + 10 * 3 * 4 * 8
    assert w.stage_params(1, 2) == 12 * 64 + 13 * 8 + 10 * 8 + 16
    assert w.stage_param_bytes(0, 2) == 4 * w.total_params
    assert w.activation_bytes() == 3 * 4 * 8 * 4


def test_full_single_device_is_compute_only() -> None:
    c = device_scenario([[0.0]], [[1.0]], tflops=[2.0])
    w = Workload.preset("tiny").with_split(1, 1)
    plan = Plan([(0, 4)], [[0]])
    f = w.stage_forward_flops(0, 4) / 2e12
    expected = w.n_microbatches * 3 * f
    assert cost_full.predict(c, w, plan)["total_s"] == pytest.approx(expected)
    assert simulate(c, w, plan).total_s == pytest.approx(expected)


def test_uniform_pipeline_matches_1f1b_formula() -> None:
    """Equal stages, free links: iteration = (S + M - 1)(f + b), the 1F1B makespan, in both models."""
    n = 4
    c = device_scenario([[0.0] * n for _ in range(n)], [[1e9] * n for _ in range(n)])
    f = 1e-3
    t = Timing(m=np.array([[0, 1, 2, 3]]), fwd=np.full((1, 4), f), bwd=np.full((1, 4), 2 * f),
               hop_fwd=np.zeros((1, 3)), hop_bwd=np.zeros((1, 3)), xfer_fwd=np.zeros((1, 3)),
               xfer_bwd=np.zeros((1, 3)), sync=np.zeros(4), n_microbatches=12,
               window=4, activation_bytes=0.0)
    expected = (4 + 12 - 1) * 3 * f
    assert cost_full.predict_timing(t)["total_s"] == pytest.approx(expected)
    assert simulate_timing(t, c).total_s == pytest.approx(expected, rel=1e-6)


def _random_cluster(rng: np.random.Generator, n: int) -> Cluster:
    delay = rng.uniform(0.1, 80.0, size=(n, n))
    bw = rng.uniform(0.2, 20.0, size=(n, n))
    return device_scenario(delay.tolist(), bw.tolist(), tflops=rng.uniform(5, 120, size=n).tolist())


@pytest.mark.parametrize("case", range(12))
def test_full_model_agrees_with_simulation(case: int) -> None:
    """Varied plans (heterogeneous devices and links, compute- or network-bound): within 5 %."""
    rng = np.random.default_rng(case)
    n_st, n_rep = [(2, 2), (3, 2), (4, 3), (6, 2), (4, 4), (8, 2)][case % 6]
    n = n_st * n_rep + int(rng.integers(0, 3))
    c = _random_cluster(rng, n)
    mb = int(rng.integers(1, 5))
    w = Workload.gpt(12, int(rng.choice([256, 1024, 2048])), 8, 512, 8000, mb, int(rng.integers(2, 6)) * n_st * n_rep,
                     stages=n_st, replicas=n_rep, act_bytes=2)
    m = rng.permutation(n)[: n_st * n_rep].reshape(n_rep, n_st)
    plan = Plan(even_stages(12, n_st), m.tolist())
    pred = cost_full.predict(c, w, plan)
    sim = simulate(c, w, plan)
    assert pred["total_s"] == pytest.approx(sim.total_s, rel=0.05)
    assert sum(pred["microbatches"]) == w.n_microbatches == sum(sim.microbatches)


def test_faster_pipeline_pulls_more_microbatches() -> None:
    n = 4
    c = device_scenario([[0.0] * n for _ in range(n)], [[100.0] * n for _ in range(n)],
                        tflops=[100.0, 100.0, 10.0, 10.0])
    w = Workload.preset("tiny").with_split(2, 2)
    w.n_microbatches = 40
    plan = Plan(even_stages(4, 2), [[0, 1], [2, 3]])
    sim = simulate(c, w, plan)
    pred = cost_full.predict(c, w, plan)
    assert sim.microbatches[0] > sim.microbatches[1]
    assert pred["microbatches"][0] > pred["microbatches"][1]


def test_packaged_scenarios_match_shared_copy() -> None:
    packaged = json.loads((REPO / "scheduler" / "data" / "dtfm_scenarios.json").read_text())
    assert json.loads(SCENARIOS.read_text()) == packaged
