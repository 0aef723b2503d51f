"""Search: brute-force optimum on small instances, valid plans, determinism, spares, memory, heterogeneity."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tasklet.scheduler import Cluster, PlanningError, SearchConfig, Workload, plan
from tasklet.scheduler.baselines import random_plan, rank_order_plan
from tasklet.scheduler.cost_dtfm import DtfmPairs, evaluate
from tasklet.scheduler.layout import best_pipelines, bottleneck_matching, open_path_tsp
from tasklet.scheduler.paper_ga import PaperGAConfig, paper_ga


def random_cluster(seed: int, n: int, **extra: object) -> Cluster:
    rng = np.random.default_rng(seed)
    regions = rng.integers(0, 3, size=n)
    delay = np.where(regions[:, None] == regions[None, :], 1.0, rng.uniform(10, 100, size=(n, n)))
    bw = np.where(regions[:, None] == regions[None, :], 10.0, rng.uniform(0.3, 2.0, size=(n, n)))
    return Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": delay.tolist(),
                              "bandwidth_gbps": bw.tolist(), **extra})


def dtfm_workload(n_st: int, n_rep: int) -> Workload:
    return Workload.preset("gpt3-xl-dtfm").with_split(n_st, n_rep)


def assert_valid(p: object, n: int, n_st: int, n_rep: int) -> None:
    m = np.asarray(p.pipelines)  # type: ignore[attr-defined]
    assert m.shape == (n_rep, n_st)
    assert len(set(m.ravel().tolist())) == n_st * n_rep
    assert m.min() >= 0 and m.max() < n


@pytest.mark.parametrize(("seed", "n_st", "n_rep", "n"), [(0, 2, 3, 6), (1, 3, 2, 6), (2, 2, 2, 5), (3, 3, 2, 7)])
def test_search_finds_brute_force_optimum(seed: int, n_st: int, n_rep: int, n: int) -> None:
    c = random_cluster(seed, n)
    w = dtfm_workload(n_st, n_rep)
    pairs = DtfmPairs.build(c, w, n_st, n_rep)
    best = min(evaluate(pairs, np.array(perm).reshape(n_rep, n_st))[0]
               for perm in itertools.permutations(range(n), n_st * n_rep))
    p = plan(c, w, cost_model="dtfm", seed=seed, config=SearchConfig(max_evaluations=3000))
    assert_valid(p, n, n_st, n_rep)
    assert p.predicted["total_s"] == pytest.approx(best, rel=1e-9)


def test_bottleneck_matching_and_tsp_against_brute_force() -> None:
    rng = np.random.default_rng(7)
    for k in (2, 3, 5, 6):
        c = rng.integers(0, 9, size=(k, k)).astype(float)
        brute = min(max(c[i, p[i]] for i in range(k)) for p in itertools.permutations(range(k)))
        val, cols = bottleneck_matching(c)
        assert val == brute and sorted(cols.tolist()) == list(range(k))
        assert c[np.arange(k), cols].max() == val
        w = rng.random((k, k))
        brute_path = min(sum(w[a, b] for a, b in itertools.pairwise(o)) for o in itertools.permutations(range(k)))
        cost, order = open_path_tsp(w)
        assert cost == pytest.approx(brute_path) and sorted(order) == list(range(k))


def test_best_pipelines_is_optimal_for_fixed_groups() -> None:
    c = random_cluster(5, 6)
    pairs = DtfmPairs.build(c, dtfm_workload(3, 2), 3, 2)
    groups = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
    pp, m = best_pipelines(pairs.pp, groups)
    brute = np.inf
    for order in itertools.permutations(range(3)):
        for p1 in itertools.permutations(range(2)):
            for p2 in itertools.permutations(range(2)):
                cols = [groups[order[0]], groups[order[1]][list(p1)], groups[order[2]][list(p2)]]
                brute = min(brute, evaluate(pairs, np.stack(cols, axis=1))[2] / 2)
    assert pp == pytest.approx(brute)
    assert evaluate(pairs, m)[2] / 2 == pytest.approx(pp)


def test_same_seed_same_plan_and_validity_with_spares() -> None:
    c = random_cluster(11, 30)
    w = dtfm_workload(4, 5)  # 20 of 30 devices used, 10 idle
    cfg = SearchConfig(max_evaluations=4000)
    a = plan(c, w, cost_model="dtfm", seed=3, config=cfg)
    b = plan(c, w, cost_model="dtfm", seed=3, config=cfg)
    assert a.pipelines == b.pipelines
    assert_valid(a, 30, 4, 5)
    assert len(a.search["idle_devices"]) == 10
    assert set(a.search["idle_devices"]).isdisjoint(np.ravel(a.pipelines).tolist())


def test_search_beats_baselines() -> None:
    c = random_cluster(4, 24)
    w = dtfm_workload(4, 6)
    pairs = DtfmPairs.build(c, w, 4, 6)
    ours = plan(c, w, cost_model="dtfm", seed=0, config=SearchConfig(max_evaluations=5000)).predicted["total_s"]
    rand = np.mean([evaluate(pairs, random_plan(c, w, s).matrix())[0] for s in range(20)])
    rank = evaluate(pairs, rank_order_plan(c, w).matrix())[0]
    ga = paper_ga(pairs, 24, 4, 6, PaperGAConfig(population=10, offspring=40)).total
    assert ours < rand and ours <= rank and ours <= ga + 1e-9


def test_paper_ga_counts_its_budget() -> None:
    c = random_cluster(2, 12)
    pairs = DtfmPairs.build(c, dtfm_workload(3, 4), 3, 4)
    r = paper_ga(pairs, 12, 3, 4, PaperGAConfig(population=8, offspring=20, seed=1))
    assert r.evaluations == 28
    assert r.total == pytest.approx(evaluate(pairs, r.matrix)[0])
    assert sorted(r.matrix.ravel().tolist()) == list(range(12))


def test_full_model_gives_more_layers_to_faster_devices() -> None:
    n = 2
    c = Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": [[0.1] * n] * n,
                           "bandwidth_gbps": [[100.0] * n] * n, "tflops": [100.0, 20.0]})
    w = Workload.gpt(12, 256, 4, 128, 1000, 2, 16, stages=2, replicas=1)
    p = plan(c, w, cost_model="full", seed=0, config=SearchConfig(max_evaluations=50))
    assert_valid(p, n, 2, 1)
    layers = {p.pipelines[0][s]: b - a for s, (a, b) in enumerate(p.stages)}
    assert sum(layers.values()) == 12
    assert layers[0] > layers[1]  # device 0 is five times faster


def test_chooses_split_when_not_given() -> None:
    c = random_cluster(9, 12)
    w = Workload.gpt(6, 128, 4, 64, 500, 2, 12)
    p = plan(c, w, cost_model="full", seed=0, config=SearchConfig(max_evaluations=200))
    assert p.n_stages * p.n_replicas <= 12
    assert_valid(p, 12, p.n_stages, p.n_replicas)


def test_memory_errors_are_clear() -> None:
    c = random_cluster(1, 8, memory_gb=[0.001] * 8)
    with pytest.raises(PlanningError) as e:
        plan(c, Workload.preset("gpt3-xl-dtfm").with_split(2, 4), cost_model="dtfm")
    assert e.value.field == "memory_gb"
    # only some devices can hold the stages: the plan uses those
    mem = [100.0] * 4 + [0.001] * 4
    c2 = random_cluster(1, 8, memory_gb=mem)
    p = plan(c2, Workload.gpt(4, 128, 4, 64, 500, 1, 4, stages=2, replicas=2), cost_model="dtfm",
             config=SearchConfig(max_evaluations=2000))
    assert set(np.ravel(p.pipelines).tolist()) <= {0, 1, 2, 3}


def test_too_few_devices() -> None:
    with pytest.raises(PlanningError) as e:
        plan(random_cluster(0, 5), dtfm_workload(2, 3), cost_model="dtfm")
    assert e.value.field == "replicas"
