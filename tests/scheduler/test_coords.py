"""Sampled link measurement: Vivaldi coordinates, link estimates, probe targets, and plans from sampled links
against plans from the full matrix on the bundled scenarios."""

from __future__ import annotations

import numpy as np
import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.emulation.cpsim.sampling import PlanInputs, compare_on_truth, compare_sampled_plan
from tasklet.peer.node.planning import build_cluster, probe_targets_for
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.scheduler import Cluster, Workload
from tasklet.scheduler.cluster import load_scenario
from tasklet.scheduler.coords import Sample, estimate_links, fit_vivaldi, plan_neighbours, probe_targets

SCENARIOS = ["datacenter_on_demand", "datacenter_spot", "multi_universities", "regional_geo_distributed",
             "worldwide_geo_distributed", "homogeneous_tc"]


def metric_space(n: int, seed: int) -> np.ndarray:
    """RTTs of points in a 100 ms square plus per-node access heights: a space Vivaldi can embed exactly."""
    rng = np.random.default_rng(seed)
    pts, heights = rng.uniform(0, 0.1, size=(n, 2)), rng.uniform(0, 0.005, n)
    rtt = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1)) + heights[:, None] + heights[None]
    np.fill_diagonal(rtt, 0.0)
    return rtt


def sample_pairs(n: int, per_node: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(i, int(j)) for i in range(n) for j in rng.choice([x for x in range(n) if x != i], per_node, replace=False)]


def test_vivaldi_converges_on_a_metric_space_from_a_sparse_sample() -> None:
    n = 120
    rtt = metric_space(n, seed=1)
    pairs = sample_pairs(n, 8, seed=2)  # 8 of 119 peers each: 7 % of the pairs
    coords = fit_vivaldi(n, [Sample(i, j, float(rtt[i, j]), 1e9) for i, j in pairs], seed=0)
    est = coords.rtt_matrix()
    unmeasured = ~np.eye(n, dtype=bool)
    for i, j in pairs:
        unmeasured[i, j] = unmeasured[j, i] = False
    rel = np.abs(est - rtt)[unmeasured] / rtt[unmeasured]
    assert np.median(rel) < 0.05, np.median(rel)
    assert np.percentile(rel, 90) < 0.25, np.percentile(rel, 90)
    assert float(np.median(coords.errors)) < 0.1  # the nodes' own error estimates agree


def test_vivaldi_is_deterministic_for_a_seed() -> None:
    n = 40
    rtt = metric_space(n, seed=3)
    samples = [Sample(i, j, float(rtt[i, j]), 1e9) for i, j in sample_pairs(n, 5, seed=4)]
    a, b = fit_vivaldi(n, samples, seed=7), fit_vivaldi(n, samples, seed=7)
    assert np.array_equal(a.points, b.points) and np.array_equal(a.heights, b.heights)
    assert not np.array_equal(a.points, fit_vivaldi(n, samples, seed=8).points)


def two_sites(n_per_site: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Two LANs (10 Gbit/s, 0.2 ms) joined by a 200 Mbit/s, 40 ms path; peer 0 has a 50 Mbit/s uplink."""
    site = np.repeat([0, 1], n_per_site)
    same = site[:, None] == site[None, :]
    rtt = np.where(same, 2e-4, 0.04)
    bw = np.where(same, 10e9, 200e6)
    bw[0, :] = bw[:, 0] = np.minimum(bw[0, :], 50e6)
    np.fill_diagonal(rtt, 0.0)
    return rtt, bw


def test_estimates_use_sites_capacities_and_the_reverse_direction() -> None:
    rtt, bw = two_sites()
    # a chain of fast links through each LAN, one slow path between them, peer 0 on one link only
    pairs = [(1, 2), (2, 3), (3, 4), (4, 5), (6, 7), (7, 8), (8, 9), (9, 10), (10, 11), (5, 6), (0, 1)]
    est = estimate_links(12, [Sample(i, j, float(rtt[i, j]), float(bw[i, j])) for i, j in pairs], seed=0)
    assert len(set(est.sites[1:6].tolist())) == 1 and len(set(est.sites[6:].tolist())) == 1
    assert est.sites[1] != est.sites[6] and est.sites[0] != est.sites[1]  # peer 0's link is slow: not in the LAN
    assert est.bandwidth_bps[1, 5] == pytest.approx(10e9)  # never measured: inside a site
    assert est.bandwidth_bps[2, 9] == pytest.approx(200e6)  # never measured: the measured path between the sites
    assert est.bandwidth_bps[2, 1] == pytest.approx(10e9) and not est.measured[2, 1]  # the reverse direction
    assert est.bandwidth_bps[0, 9] <= 50e6  # capped by peer 0's capacity
    assert est.measured[0, 1] and est.bandwidth_bps[0, 1] == pytest.approx(50e6)  # measured values are kept
    assert est.delay_s[1, 4] < 1e-3 < 0.01 < est.delay_s[3, 8]  # coordinates: LAN pairs close, sites apart


def test_probe_targets_are_plan_neighbours_first_then_random_and_deterministic() -> None:
    peers = [f"p{i:02d}" for i in range(30)]
    pipelines = [["p00", "p01", "p02"], ["p03", "p04", "p05"], ["p06", "p07", "p08"]]
    assert plan_neighbours(pipelines, "p04") == ["p03", "p05", "p01", "p07"]
    first = probe_targets("p04", peers, 4, pipelines=pipelines, n_random=2, seed=1)
    assert first[:4] == ["p03", "p05", "p01", "p07"] and len(first) == 6 and len(set(first)) == 6
    assert first == probe_targets("p04", peers, 4, pipelines=pipelines, n_random=2, seed=1)
    assert "p04" not in first
    later = probe_targets("p04", peers, 4, pipelines=pipelines, exclude=set(first), n_random=2, seed=1)
    assert not set(later) & set(first) and len(later) == 6  # measured peers are not probed again
    other_seed = {tuple(probe_targets("p04", peers, 0, n_random=5, seed=s)) for s in range(5)}
    assert len(other_seed) > 1  # the random part depends on the seed
    # the daemon's call: peer ids and a plan record
    record = {"pipelines": pipelines, "stages": [[0, 1], [1, 2], [2, 3]]}
    assert probe_targets_for("p04", peers, record, {"p03"}, k=3, n_random=1)[:3] == ["p05", "p01", "p07"]
    assert len(probe_targets_for("p04", peers, None, set(), k=3, n_random=1)) == 4


def advert(i: int) -> Advert:
    device = DeviceInfo(name="sim", kind="cpu", memory_bytes=32 * 2**30, tflops=50.0, measured=False, emulated=True)
    return Advert(peer_id=f"peer{i:03d}", endpoint=f"10.0.0.{i + 1}:5000", device=device, started_at=1.0)


def test_build_cluster_estimates_the_unmeasured_pairs_from_link_reports() -> None:
    rtt, bw = two_sites()
    peers = [advert(i) for i in range(12)]
    pairs = [(1, 2), (2, 3), (3, 4), (4, 5), (6, 7), (7, 8), (8, 9), (9, 10), (10, 11), (5, 6), (0, 1)]
    links = [LinkReport(peers[i].peer_id, peers[j].peer_id, float(rtt[i, j]), float(bw[i, j]), True, 1.0)
             for i, j in pairs]
    view = build_cluster(peers, links)
    assert view.measured_pairs == len(pairs) and view.estimated_pairs == 12 * 11 - len(pairs)
    assert view.cluster.bandwidth_bps[1, 5] == pytest.approx(10e9)
    assert view.cluster.bandwidth_bps[2, 9] == pytest.approx(200e6)
    assert np.isinf(view.cluster.bandwidth_bps[3, 3]) and view.cluster.delay_s[3, 3] == 0.0
    nothing = build_cluster(peers, [])
    assert nothing.measured_pairs == 0 and np.isfinite(nothing.cluster.bandwidth_bps[0, 1])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_plan_from_sampled_links_costs_at_most_5_percent_more(scenario: str) -> None:
    """Each peer probes 6 relevant + 2 random peers per round for 3 rounds; both plans are costed on the
    scenario's true matrix with the paper's cost model (its GPT3-XL workload, 8 x 8)."""
    result = compare_sampled_plan(load_scenario(scenario), Workload.preset("gpt3-xl-dtfm"), cost_model="dtfm",
                                  k=6, n_random=2, rounds=3, seed=0, max_evaluations=20_000)
    assert result.measured_fraction < 0.45  # far from the full matrix: 24 of 63 peers each at most
    assert result.ratio <= 1.05, (result.sampled_cost_s, result.full_cost_s)


def test_the_seeded_comparison_pairs_plans_by_seed_and_costs_both_on_the_truth() -> None:
    """An estimate equal to the truth gives the same plan per seed (ratio 1 for each); a badly distorted one
    (delays scaled 0.2-5x, bandwidths shuffled between devices) gives a best plan that costs more on the truth."""
    truth = load_scenario("multi_universities")
    workload = Workload.preset("gpt3-xl-dtfm")
    same = compare_on_truth(PlanInputs(truth, truth, workload), seeds=(0, 1), evaluations=2000)
    assert same.seed_ratios == [1.0, 1.0] and same.ratio == 1.0 and same.full_spread >= 1.0
    rng = np.random.default_rng(0)
    noisy = Cluster(delay_s=truth.delay_s * rng.uniform(0.2, 5.0, truth.delay_s.shape),
                    bandwidth_bps=truth.bandwidth_bps[rng.permutation(truth.n)][:, rng.permutation(truth.n)],
                    tflops=truth.tflops, memory_bytes=truth.memory_bytes, regions=truth.regions, name="noisy")
    worse = compare_on_truth(PlanInputs(truth, noisy, workload), seeds=(0, 1), evaluations=2000)
    assert worse.full_costs_s == same.full_costs_s  # the truth's plans do not depend on the estimate
    assert worse.ratio > 1.0 and len(worse.seed_ratios) == 2


def test_an_unmeasured_path_is_rated_by_the_lower_quartile_of_its_rtt_neighbours() -> None:
    """Six peers, each its own site, four wide-area links measured at 10-40 Mbit/s with one RTT: the unmeasured path
    0 -> 3 takes the lower quartile of those (17.5 Mbit/s), not their median (25), since a plan search seeks out the
    links an estimate rates highest and a median overrates half of them."""
    from tasklet.scheduler.coords import UNMEASURED_PERCENTILE, _path_bandwidth

    n = 6
    bw = np.full((n, n), np.nan)
    rtt = np.full((n, n), np.nan)
    for (i, j), mbit in {(0, 1): 10, (1, 2): 20, (3, 4): 30, (4, 5): 40}.items():
        bw[i, j] = bw[j, i] = mbit * 1e6
        rtt[i, j] = rtt[j, i] = 0.05
    known = ~np.isnan(bw)
    est = _path_bandwidth(n, bw, known, rtt, np.full((n, n), 0.05), np.arange(n), np.full(n, np.inf))
    values = [10e6, 10e6, 20e6, 20e6, 30e6, 30e6, 40e6, 40e6]
    assert UNMEASURED_PERCENTILE == 25.0
    assert est[0, 3] == pytest.approx(float(np.percentile(values, 25))) == pytest.approx(17.5e6)
    assert est[0, 3] < float(np.median(values))
    assert est[0, 1] == pytest.approx(10e6)  # a measured path keeps its own measurement
