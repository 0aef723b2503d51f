"""Memetic search, lower bound, uneven layer splits and re-planning with moves."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tasklet.scheduler import Cluster, MemeticConfig, Plan, PlanningError, SearchConfig, Workload, plan
from tasklet.scheduler.baselines import random_plan, rank_order_plan
from tasklet.scheduler.bench import synthetic
from tasklet.scheduler.bound import dtfm_lower_bound, full_lower_bound
from tasklet.scheduler.cluster import PACKAGED_SCENARIOS
from tasklet.scheduler.cost_dtfm import DtfmPairs, evaluate
from tasklet.scheduler.layers import LayerTable, fits_memory
from tasklet.scheduler.paper_ga import PaperGAConfig, paper_ga
from tasklet.scheduler.replan import move_costs, objective_of, replan
from tasklet.scheduler.search import DtfmObjective
from tasklet.scheduler.sweep import trial_all
from tasklet.scheduler.synthetic import hetero_scenario

FAST = MemeticConfig(generations=6, population=4)


def random_cluster(seed: int, n: int, **extra: object) -> Cluster:
    rng = np.random.default_rng(seed)
    regions = rng.integers(0, 3, size=n)
    delay = np.where(regions[:, None] == regions[None, :], 1.0, rng.uniform(10, 100, size=(n, n)))
    bw = np.where(regions[:, None] == regions[None, :], 10.0, rng.uniform(0.3, 2.0, size=(n, n)))
    return Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": delay.tolist(),
                              "bandwidth_gbps": bw.tolist(), **extra})


def dtfm(n_st: int, n_rep: int) -> Workload:
    return Workload.preset("gpt3-xl-dtfm").with_split(n_st, n_rep)


def brute_force(pairs: DtfmPairs, n: int, n_st: int, n_rep: int) -> float:
    return min(evaluate(pairs, np.array(p).reshape(n_rep, n_st))[0]
               for p in itertools.permutations(range(n), n_st * n_rep))


@pytest.mark.parametrize(("n_st", "n_rep"), [(4, 5), (1, 6), (6, 1), (3, 3), (5, 6)])
def test_batched_swaps_equal_single_trials(n_st: int, n_rep: int) -> None:
    c = Cluster.from_dict(hetero_scenario(30, seed=1))  # asymmetric links, spares
    pairs = DtfmPairs.build(c, dtfm(n_st, n_rep), n_st, n_rep)
    rng = np.random.default_rng(0)
    obj = DtfmObjective(pairs, n_st, n_rep, slot_cost=rng.random((30, n_st)))
    obj.reset(rng.permutation(30))
    for _ in range(15):
        p = int(rng.integers(n_st * n_rep))
        totals, softs = trial_all(obj, p)
        for q in range(30):
            if q != p:
                assert obj.trial(p, q) == pytest.approx((totals[q], softs[q]), rel=1e-9)
        q = int(np.argmin(totals))
        obj.trial(p, q)
        obj.commit()
        fresh = DtfmObjective(pairs, n_st, n_rep, slot_cost=obj.slot_cost)
        fresh.reset(obj.x)
        assert (obj.total, obj.soft) == pytest.approx((fresh.total, fresh.soft), rel=1e-9)


@pytest.mark.parametrize(("seed", "n_st", "n_rep", "n"), [(0, 2, 3, 6), (1, 3, 2, 6), (2, 2, 2, 5), (3, 3, 2, 7),
                                                         (4, 2, 3, 7), (5, 1, 4, 6), (6, 4, 1, 6)])
def test_bound_never_above_brute_force_and_memetic_reaches_it(seed: int, n_st: int, n_rep: int, n: int) -> None:
    c = random_cluster(seed, n)
    w = dtfm(n_st, n_rep)
    pairs = DtfmPairs.build(c, w, n_st, n_rep)
    best = brute_force(pairs, n, n_st, n_rep)
    bound = dtfm_lower_bound(pairs, n_st, n_rep)
    assert 0 < bound <= best + 1e-9
    p = plan(c, w, cost_model="dtfm", seed=seed, config=FAST)
    assert p.predicted["total_s"] == pytest.approx(best, rel=1e-9)
    assert p.search["lower_bound"] == pytest.approx(bound, rel=1e-5)
    assert 0.0 <= p.search["gap"] < 1.0


def test_bound_below_the_best_known_costs_of_the_paper_scenarios() -> None:
    # our best layouts (docs/scheduler.md, rounded to 4 decimals); the bound must not pass them
    best = {"datacenter_on_demand": 3.4398, "datacenter_spot": 31.6342, "multi_universities": 16.0868,
            "regional_geo_distributed": 34.8020, "worldwide_geo_distributed": 49.2184}
    w = dtfm(8, 8)
    for name, cost in best.items():
        pairs = DtfmPairs.build(Cluster.from_scenario(PACKAGED_SCENARIOS, name), w, 8, 8)
        assert 0 < dtfm_lower_bound(pairs, 8, 8) <= cost + 5e-5


def test_memetic_is_deterministic_per_seed() -> None:
    c = Cluster.from_dict(hetero_scenario(40, seed=3))
    w = dtfm(4, 8)  # 32 of 40 devices
    a = plan(c, w, cost_model="dtfm", seed=5, config=FAST)
    b = plan(c, w, cost_model="dtfm", seed=5, config=FAST)
    assert a.pipelines == b.pipelines and a.search["evaluations"] == b.search["evaluations"]
    assert a.search["algorithm"] == "tasklet-memetic" and a.search["generations"] >= 1
    assert len(a.search["idle_devices"]) == 8
    ils = plan(c, w, cost_model="dtfm", seed=5, config=SearchConfig(max_evaluations=2000))
    assert ils.search["algorithm"] == "tasklet-ils"


def test_memetic_beats_the_baselines() -> None:
    c = random_cluster(4, 24)
    w = dtfm(4, 6)
    pairs = DtfmPairs.build(c, w, 4, 6)
    ours = plan(c, w, cost_model="dtfm", seed=0, config=FAST).predicted["total_s"]
    rand = np.mean([evaluate(pairs, random_plan(c, w, s).matrix())[0] for s in range(20)])
    rank = evaluate(pairs, rank_order_plan(c, w).matrix())[0]
    ga = paper_ga(pairs, 24, 4, 6, PaperGAConfig(population=10, offspring=40)).total
    assert ours < rand and ours <= rank and ours <= ga + 1e-9


def test_layer_split_is_optimal_and_fits_memory() -> None:
    w = Workload.gpt(9, 256, 4, 128, 1000, 2, 8, stages=3, replicas=1)
    table = LayerTable(w, 3)
    rng = np.random.default_rng(0)
    for _ in range(20):
        speed = rng.uniform(1.0, 10.0, size=3)
        cap = rng.uniform(0.3, 1.5, size=3) * w.stage_memory_bytes(0, 3, 3)
        got = table.split(speed, cap)
        best, best_split = np.inf, None
        for a, b in itertools.combinations(range(1, 9), 2):
            sp = [(0, a), (a, b), (b, 9)]
            if all(w.stage_memory_bytes(x, y, 3 - s) <= cap[s] for s, (x, y) in enumerate(sp)):
                v = max(w.stage_forward_flops(x, y) / speed[s] for s, (x, y) in enumerate(sp))
                if v < best:
                    best, best_split = v, sp
        if best_split is None:
            assert got is None
            continue
        assert got is not None
        assert max(w.stage_forward_flops(x, y) / speed[s] for s, (x, y) in enumerate(got)) == pytest.approx(best)
        assert all(w.stage_memory_bytes(x, y, 3 - s) <= cap[s] for s, (x, y) in enumerate(got))


def test_uneven_splits_never_exceed_memory() -> None:
    """Small-memory devices force short stages on them; every plan of the full model must still fit."""
    w = Workload.gpt(12, 1024, 8, 256, 8000, 2, 16, stages=4, replicas=2)
    even_need = w.stage_memory_bytes(3, 6, in_flight=3)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        n = 10
        mem = rng.choice([0.7, 1.0, 4.0], size=n) * even_need / 1e9
        c = random_cluster(seed, n, tflops=rng.uniform(10, 120, size=n).tolist(), memory_gb=mem.tolist())
        try:
            p = plan(c, w, cost_model="full", seed=seed, config=MemeticConfig(generations=3, population=3,
                                                                              max_evaluations=600))
        except PlanningError as exc:  # acceptable only as a clear memory error
            assert exc.field == "memory_gb"
            continue
        assert fits_memory(c, w, p.stages, p.matrix())
        assert sum(b - a for a, b in p.stages) == 12
        assert p.search["lower_bound"] <= p.predicted["total_s"]


def test_full_bound_is_below_the_predicted_cost() -> None:
    c = random_cluster(2, 8, tflops=[30.0, 60.0, 90.0, 120.0] * 2)
    w = Workload.gpt(8, 512, 8, 256, 4000, 2, 16, stages=2, replicas=4)
    p = plan(c, w, cost_model="full", seed=0, config=MemeticConfig(generations=2, population=2,
                                                                   max_evaluations=300))
    assert 0 < full_lower_bound(c, w, 2, 4) <= p.predicted["total_s"]


def test_baselines_respect_memory() -> None:
    w = Workload.gpt(4, 128, 4, 64, 500, 1, 4, stages=2, replicas=2)
    mem = [100.0] * 4 + [0.001] * 4
    c = random_cluster(1, 8, memory_gb=mem)
    for p in [rank_order_plan(c, w)] + [random_plan(c, w, s) for s in range(5)]:
        assert fits_memory(c, w, p.stages, p.matrix())
    pairs = DtfmPairs.build(c, w, 2, 2)
    bad = ~np.array([[m > 1.0] * 2 for m in mem])
    r = paper_ga(pairs, 8, 2, 2, PaperGAConfig(population=6, offspring=10), mem_bad=bad)
    assert set(r.matrix.ravel().tolist()) <= {0, 1, 2, 3}


def _depart(cluster: Cluster, first: Plan, gone: int) -> tuple[Cluster, Plan]:
    live = [d for d in range(cluster.n) if d != gone]
    index = {d: i for i, d in enumerate(live)}
    return cluster.subset(live), Plan(first.stages, [[index.get(d, -1) for d in r] for r in first.pipelines])


def test_replan_after_one_departure_moves_few_tasklets() -> None:
    cluster = synthetic("hetero64_0")
    w = dtfm(8, 7)  # 56 of 64 devices busy, 8 idle
    cfg = MemeticConfig(generations=4, population=4)
    first = plan(cluster, w, cost_model="dtfm", seed=0, config=cfg)
    gone = first.pipelines[2][3]
    sub, current = _depart(cluster, first, gone)
    new = replan(sub, w, current, cost_model="dtfm", seed=0, config=cfg)
    moves = new.predicted["moves"]
    assert 1 <= moves["moved_tasklets"] <= 4  # the empty slot must be filled; little else pays
    assert moves["transfer_s"] > 0 and moves["transfer_parallel_s"] <= moves["transfer_s"]
    assert new.n_replicas == 7 and new.stages == first.stages
    scratch = plan(sub, w, cost_model="dtfm", seed=0, config=cfg, stages=first.stages)
    ours = objective_of(sub, w, current, new, "dtfm")
    assert ours == pytest.approx(new.predicted["objective_s"])
    assert ours <= objective_of(sub, w, current, scratch, "dtfm") + 1e-9
    # a device that keeps its stage costs nothing to keep; one that gets a new stage pays a transfer
    move = move_costs(sub, w, first.stages, current.pipelines)
    assert move[current.pipelines[0][0], 0] == 0.0 and move[current.pipelines[0][0], 1] > 0.0


def test_replan_drops_a_replica_when_devices_run_short_and_rejects_bad_plans() -> None:
    c = random_cluster(7, 12)
    w = dtfm(3, 4)
    first = plan(c, w, cost_model="dtfm", seed=0, config=FAST)
    sub, current = _depart(c, first, first.pipelines[1][1])
    new = replan(sub, w, current, cost_model="dtfm", seed=0, config=FAST)
    assert new.n_replicas == 3
    kept = Plan(first.stages, [r for r in current.pipelines if -1 not in r])  # drop the broken replica, no move
    kept_cost = objective_of(sub, w, current, kept, "dtfm")
    assert kept_cost == pytest.approx(evaluate(DtfmPairs.build(sub, dtfm(3, 3), 3, 3), kept.matrix())[0])
    assert new.predicted["objective_s"] <= kept_cost + 1e-9
    bad = Plan(first.stages, [[0, 1, 99]] + first.pipelines[1:])
    with pytest.raises(PlanningError) as e:
        replan(sub, w, bad, cost_model="dtfm")
    assert e.value.field.startswith("current.pipelines")
    with pytest.raises(PlanningError):
        replan(sub, w, Plan(first.stages, [[0, 0, 1]]), cost_model="dtfm")
