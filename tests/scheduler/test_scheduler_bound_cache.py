"""Reuse of the lower bound after a departure, the spanning-tree components the bounds sweep, memoised syncs.

A reused bound must still be below every plan of the smaller cluster (checked against exhaustive search), and
must not be reused for a cluster that is not part of the cached one (a changed figure, a join, another split).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from tasklet.scheduler import Cluster, Workload
from tasklet.scheduler.bound import ThresholdComponents, lower_bound
from tasklet.scheduler.bound_cache import BOUNDS, BoundCache
from tasklet.scheduler.cost_dtfm import DtfmPairs, evaluate
from tasklet.scheduler.cost_full import predict
from tasklet.scheduler.layers import fixed_split_cost
from tasklet.scheduler.plan import Plan


def region_cluster(seed: int, n: int) -> Cluster:
    rng = np.random.default_rng(seed)
    regions = rng.integers(0, 3, size=n)
    same = regions[:, None] == regions[None, :]
    delay = np.where(same, 0.5, rng.uniform(5, 80, size=(n, n)))
    bw = np.where(same, 40.0, rng.uniform(0.3, 2.0, size=(n, n)))
    return Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": delay.tolist(),
                              "bandwidth_gbps": bw.tolist(),
                              "tflops": rng.choice([10.0, 40.0, 120.0], size=n).tolist()})


def plans(n: int, n_st: int, n_rep: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(n), n_st * n_rep)), dtype=int).reshape(-1, n_rep, n_st)


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(((a[:, None] == a[None, :]) == (b[:, None] == b[None, :])).all())


@pytest.mark.parametrize("seed", range(4))
def test_threshold_components_equal_the_dense_graphs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 30
    raw = rng.choice([1.0, 2.0, 3.0, 5.0, 8.0, np.inf], size=(n, n)) if seed % 2 else rng.uniform(0, 1, (n, n))
    sym = np.minimum(raw, raw.T)
    comps = ThresholdComponents(sym)
    off = ~np.eye(n, dtype=bool)
    for t in [*np.unique(sym[off]).tolist(), 0.0, 100.0]:
        for strict in (False, True):
            adj = off & ((sym < t) if strict else (sym <= t))
            want = connected_components(csr_matrix(adj), directed=False)[1]
            assert same_partition(comps.labels(t, strict), want), (t, strict)


@pytest.mark.parametrize(("cost_model", "seed"), [("dtfm", 0), ("dtfm", 1), ("full", 2)])
def test_a_departures_reused_bound_is_below_every_plan_of_the_smaller_cluster(cost_model: str, seed: int) -> None:
    n, n_st, n_rep = 7, 2, 2
    whole = region_cluster(seed, n)
    w = Workload.gpt(4, 256, 4, 128, 2000, 2, 4, stages=n_st, replicas=n_rep)
    cache = BoundCache()
    full_bound = cache.get(whole, w, n_st, n_rep, cost_model, None,
                           lambda: lower_bound(whole, w, n_st, n_rep, cost_model, reuse=False))
    for gone in range(n):
        live = [d for d in range(n) if d != gone]
        part = whole.subset(live[::-1])  # renumbered too
        got = cache.lookup(part, w, n_st, n_rep, cost_model, None)
        assert got == full_bound
        own = lower_bound(part, w, n_st, n_rep, cost_model, reuse=False)
        assert got <= own * (1 + 1e-12)  # the part cannot do better than the whole
        if cost_model == "dtfm":
            pairs = DtfmPairs.build(part, w, n_st, n_rep)
            best = min(evaluate(pairs, m)[0] for m in plans(part.n, n_st, n_rep))
        else:
            best = min(predict(part, w, Plan([(0, 2), (2, 4)], m.tolist()))["total_s"]
                       for m in plans(part.n, n_st, n_rep))
        assert 0 < got <= best * (1 + 1e-12)
    assert cache.hits == n


def test_a_bound_is_not_reused_for_what_is_not_part_of_the_cached_cluster() -> None:
    whole = region_cluster(3, 8)
    w = Workload.gpt(4, 256, 4, 128, 2000, 2, 4, stages=2, replicas=2)
    cache = BoundCache()
    cache.store(whole, w, 2, 2, "full", [(0, 1), (1, 4)], 1.0)
    part = whole.subset(list(range(7)))
    assert cache.lookup(part, w, 2, 2, "full", [(0, 1), (1, 4)]) == 1.0
    assert cache.lookup(part, w, 2, 2, "full", [(0, 2), (2, 4)]) is None  # another split
    assert cache.lookup(part, w, 2, 2, "full", None) is None  # every split: the cached one holds for one
    assert cache.lookup(part, w, 2, 2, "dtfm", [(0, 1), (1, 4)]) is None
    assert cache.lookup(part, w.with_split(2, 3), 2, 3, "full", [(0, 1), (1, 4)]) is None
    slower = whole.subset(list(range(7)))
    slower.bandwidth_bps[0, 1] *= 0.5  # a link got slower: no longer the same devices
    assert cache.lookup(slower, w, 2, 2, "full", [(0, 1), (1, 4)]) is None
    joined = region_cluster(4, 9)  # a device the cache never saw
    assert cache.lookup(joined, w, 2, 2, "full", [(0, 1), (1, 4)]) is None
    twice = Cluster.from_dict({"devices": 2, "matrix_level": "device", "delay_ms": [[0, 1], [1, 0]],
                               "bandwidth_gbps": [[1, 1], [1, 1]]})
    twice.labels = ["a", "a"]  # ambiguous labels are never cached
    cache.store(twice, w, 1, 1, "full", None, 5.0)
    assert cache.lookup(twice, w, 1, 1, "full", None) is None


def test_replan_after_a_departure_reuses_the_bound() -> None:
    from tasklet.scheduler import plan, replan

    whole = region_cluster(5, 20)
    w = Workload.preset("gpt3-xl-dtfm").with_split(4, 4)
    BOUNDS.clear()
    first = plan(whole, w, cost_model="full", seed=0, gap=0.5)
    gone = first.pipelines[0][1]
    live = [d for d in range(whole.n) if d != gone]
    index = {d: i for i, d in enumerate(live)}
    current = Plan(first.stages, [[index.get(d, -1) for d in row] for row in first.pipelines])
    hits = BOUNDS.hits
    new = replan(whole.subset(live), w, current, cost_model="full")
    assert BOUNDS.hits == hits + 1
    assert new.search["lower_bound"] == first.search["lower_bound"] <= new.predicted["total_s"]


def test_memoised_group_syncs_give_the_same_cost() -> None:
    c = region_cluster(6, 24)
    w = Workload.preset("gpt3-xl-dtfm").with_split(4, 5)
    stages = [(0, 6), (6, 12), (12, 18), (18, 24)]
    f = fixed_split_cost(c, w, stages)
    rng = np.random.default_rng(0)
    m = rng.permutation(24)[:20].reshape(5, 4)
    for _ in range(30):
        a, b = rng.integers(0, 5, size=2), rng.integers(0, 4, size=2)
        m[a[0], b[0]], m[a[1], b[1]] = m[a[1], b[1]], m[a[0], b[0]]
        assert f(m) == pytest.approx(predict(c, w, Plan(stages, m.tolist()))["total_s"], rel=1e-12)


def test_a_warm_replan_after_a_join_computes_the_quick_bound_for_quick_requests_only() -> None:
    from tasklet.scheduler import plan, replan

    whole = region_cluster(7, 21)
    w = Workload.preset("gpt3-xl-dtfm").with_split(4, 4)
    before = whole.subset(list(range(1, whole.n)))  # device 0 joins later
    BOUNDS.clear()
    first = plan(before, w, cost_model="dtfm", seed=0, gap=0.5)
    current = Plan(first.stages, [[d + 1 for d in row] for row in first.pipelines])
    new = replan(whole, w, current, cost_model="dtfm")
    assert BOUNDS.misses == 2 and BOUNDS.hits == 0  # the first plan's and the join's lookups
    split = [tuple(s) for s in first.stages]
    assert BOUNDS.lookup(whole, w, 4, 4, "dtfm", split) is None  # a plan from scratch computes the full bound
    assert BOUNDS.lookup(whole.subset(list(range(1, 21))), w, 4, 4, "dtfm", split, quick=True) == \
        new.search["lower_bound"]  # the next warm re-plan (a departure) reuses the quick one
    quick = lower_bound(whole, w, 4, 4, "dtfm", reuse=False, quick=True)
    assert new.search["lower_bound"] == quick <= lower_bound(whole, w, 4, 4, "dtfm", reuse=False)
    assert quick <= new.predicted["total_s"]
