"""Lower bounds against exhaustive search: every plan of small instances is enumerated, for both cost models.

The instances are drawn to exercise every part of the bounds: fast clusters (the segment bound), slow access
links (the access bound), uneven device speeds and delay-bound pipelines (the ``full`` phase bound) and groups
of different link speeds (the sync bound). A bound above one enumerated plan fails the test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tasklet.scheduler import Cluster, Workload
from tasklet.scheduler.bound import (
    _partitions,
    _window_finish,
    _window_spread,
    access_pp_bound,
    dtfm_lower_bound,
    full_lower_bound,
)
from tasklet.scheduler.cost_dtfm import DtfmPairs
from tasklet.scheduler.cost_full import predict
from tasklet.scheduler.plan import Plan


def clustered(seed: int, n: int, tflops: bool = False) -> Cluster:
    """Devices in 1-3 regions (fast inside), some with a slow access link, optionally uneven speeds."""
    rng = np.random.default_rng(seed)
    regions = rng.integers(0, int(rng.integers(1, 4)), size=n)
    same = regions[:, None] == regions[None, :]
    delay = np.where(same, rng.uniform(0.05, 2.0), rng.uniform(5, 100, size=(n, n)))
    bw = np.where(same, rng.choice([5.0, 40.0, 100.0]), rng.uniform(0.3, 2.0, size=(n, n)))
    access = np.where(rng.random(n) < 0.3, rng.uniform(0.05, 0.5, size=n), np.inf)
    bw = np.minimum(bw, np.minimum(access[:, None], access[None, :]))
    extra: dict[str, object] = {}
    if tflops:
        extra = {"tflops": rng.choice([10.0, 40.0, 120.0], size=n).tolist()}
    return Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": delay.tolist(),
                              "bandwidth_gbps": bw.tolist(), **extra})


def all_plans(n: int, n_st: int, n_rep: int) -> np.ndarray:
    """Every plan matrix (replicas x stages) of S x D distinct devices out of n, stacked."""
    perms = np.array(list(itertools.permutations(range(n), n_st * n_rep)), dtype=int)
    return perms.reshape(-1, n_rep, n_st)


def dtfm_costs(pairs: DtfmPairs, plans: np.ndarray) -> np.ndarray:
    """``DP + 2 PP`` of every plan at once (the same formula as ``cost_dtfm.evaluate``)."""
    g = plans.transpose(0, 2, 1)  # (P, S, D)
    dp = pairs.dp[g[..., :, None], g[..., None, :]].sum(axis=3).max(axis=(1, 2)) if plans.shape[1] > 1 else 0.0
    if plans.shape[2] < 2:
        return dp + 0.0 * plans[:, 0, 0]
    pp = pairs.pp[plans[:, :, :-1], plans[:, :, 1:]].max(axis=1).sum(axis=1)
    return dp + 2.0 * pp


SHAPES = [(2, 2, 4), (2, 2, 5), (2, 3, 6), (3, 2, 6), (4, 1, 5), (1, 4, 5), (3, 2, 7)]


@pytest.mark.parametrize("seed", range(12))
def test_dtfm_bound_never_above_the_exhaustive_optimum(seed: int) -> None:
    n_st, n_rep, n = SHAPES[seed % len(SHAPES)]
    c = clustered(seed, n)
    w = Workload.preset("gpt3-xl-dtfm").with_split(n_st, n_rep)
    pairs = DtfmPairs.build(c, w, n_st, n_rep)
    costs = dtfm_costs(pairs, all_plans(n, n_st, n_rep))
    bound = dtfm_lower_bound(pairs, n_st, n_rep)
    assert 0 < bound <= costs.min() * (1 + 1e-12)
    assert 0 < dtfm_lower_bound(pairs, n_st, n_rep, quick=True) <= bound
    if n_st > 1:  # the access bound alone is a bound on PP
        pp_only = pairs.pp[all_plans(n, n_st, n_rep)[:, :, :-1], all_plans(n, n_st, n_rep)[:, :, 1:]]
        assert access_pp_bound(pairs.pp, n_st, n_rep) <= pp_only.max(axis=1).sum(axis=1).min() * (1 + 1e-12)


def test_dtfm_bound_is_tight_on_clustered_instances() -> None:
    """Not only valid: on clustered instances it often equals the optimum (a bound of 0 would pass the test
    above)."""
    hits = 0
    for seed in range(12):
        n_st, n_rep, n = SHAPES[seed % len(SHAPES)]
        c = clustered(seed, n)
        pairs = DtfmPairs.build(c, Workload.preset("gpt3-xl-dtfm").with_split(n_st, n_rep), n_st, n_rep)
        best = dtfm_costs(pairs, all_plans(n, n_st, n_rep)).min()
        hits += dtfm_lower_bound(pairs, n_st, n_rep) >= best * (1 - 1e-9)
    assert hits >= 4


def test_segment_bound_proves_the_datacenter_optimum() -> None:
    """Four 4-GPU machines, 4 x 4 plan: either groups or pipelines can be inside the machines, not both; the
    bound sees it and equals the best plan's cost (found by exhaustive search over the two shapes' costs)."""
    n = 16
    machine = np.arange(n) // 4
    same = machine[:, None] == machine[None, :]
    c = Cluster.from_dict({"devices": n, "matrix_level": "device",
                           "delay_ms": np.where(same, 0.05, 5.0).tolist(),
                           "bandwidth_gbps": np.where(same, 100.0, 1.0).tolist()})
    w = Workload.preset("gpt3-xl-dtfm").with_split(4, 4)
    pairs = DtfmPairs.build(c, w, 4, 4)
    pipes_inside = np.arange(n).reshape(4, 4)  # pipeline r = machine r
    groups_inside = pipes_inside.T.copy()  # group s = machine s
    cost = min(dtfm_costs(pairs, np.stack([pipes_inside, groups_inside])))
    assert dtfm_lower_bound(pairs, 4, 4) == pytest.approx(cost, rel=1e-9)


def test_partitions_are_all_enumerated() -> None:
    assert len(_partitions(8)) == 22 and len(_partitions(12)) == 77
    assert all(sum(p) == 8 and list(p) == sorted(p, reverse=True) for p in _partitions(8))


def full_costs(c: Cluster, w: Workload, n_st: int, n_rep: int, splits: list[list[tuple[int, int]]]) -> float:
    best = np.inf
    for m in all_plans(c.n, n_st, n_rep):
        for stages in splits:
            best = min(best, predict(c, w, Plan(stages, m.tolist()))["total_s"])
    return float(best)


def layer_splits(n_layers: int, n_st: int) -> list[list[tuple[int, int]]]:
    out = []
    for cuts in itertools.combinations(range(1, n_layers), n_st - 1):
        b = [0, *cuts, n_layers]
        out.append(list(itertools.pairwise(b)))
    return out


FULL_CASES = [(0, 2, 2, 4, 4), (1, 2, 2, 5, 2), (2, 1, 3, 4, 4), (3, 3, 1, 4, 1), (4, 2, 2, 4, 16),
              (5, 2, 2, 5, 8)]


@pytest.mark.parametrize(("seed", "n_st", "n_rep", "n", "n_mb"), FULL_CASES)
def test_full_bound_never_above_the_exhaustive_optimum(seed: int, n_st: int, n_rep: int, n: int, n_mb: int
                                                       ) -> None:
    """Over every placement and every layer split (the ``full`` model may choose any), and for a fixed split."""
    c = clustered(100 + seed, n, tflops=True)
    w = Workload.gpt(4, 256, 4, 128, 2000, 2, n_mb, stages=n_st, replicas=n_rep)
    splits = layer_splits(4, n_st)
    best = full_costs(c, w, n_st, n_rep, splits)
    bound = full_lower_bound(c, w, n_st, n_rep)
    assert 0 < bound <= best * (1 + 1e-12)
    assert 0 < full_lower_bound(c, w, n_st, n_rep, quick=True) <= bound
    fixed = splits[len(splits) // 2]
    assert full_lower_bound(c, w, n_st, n_rep, fixed) <= full_costs(c, w, n_st, n_rep, [fixed]) * (1 + 1e-12)


def test_full_bound_sees_the_slow_hop_two_gpu_machines_force() -> None:
    """Two 2-GPU machines, a 4-stage pipeline: one hop must cross machines, and the bound charges it."""
    machine = np.arange(4) // 2
    same = machine[:, None] == machine[None, :]
    c = Cluster.from_dict({"devices": 4, "matrix_level": "device", "delay_ms": np.where(same, 0.05, 40.0).tolist(),
                           "bandwidth_gbps": np.where(same, 100.0, 1.0).tolist()})
    w = Workload.gpt(4, 256, 4, 128, 2000, 2, 4, stages=4, replicas=1)
    best = full_costs(c, w, 4, 1, layer_splits(4, 4))
    bound = full_lower_bound(c, w, 4, 1)
    assert bound <= best * (1 + 1e-12)
    assert bound >= 2 * 0.040  # at least the crossing hop's delay out and back


def paired_regions(seed: int, n: int, size: int) -> Cluster:
    """Regions of ``size`` devices (fast inside), the regions at uneven distances from each other."""
    rng = np.random.default_rng(seed)
    region = np.arange(n) // size
    where = rng.uniform(0, 100, size=(n // size + 1, 2))[region]
    far = np.sqrt(((where[:, None, :] - where[None, :, :]) ** 2).sum(axis=2))
    same = region[:, None] == region[None, :]
    delay = np.where(same, 0.5, 5.0 + far)
    bw = np.where(same, 40.0, 20.0 / (1.0 + far / 10.0))
    return Cluster.from_dict({"devices": n, "matrix_level": "device", "delay_ms": delay.tolist(),
                              "bandwidth_gbps": bw.tolist()})


@pytest.mark.parametrize("seed", range(6))
def test_dtfm_bound_below_the_optimum_when_pipelines_must_leave_small_regions(seed: int) -> None:
    """Regions of 2-3 devices, 4-stage pipelines: every pipeline is cut into segments, of several lengths (the
    segment bound's DP counts the members of every segment at least l long)."""
    n_st, n_rep, n = (4, 2, 8) if seed % 2 == 0 else (2, 4, 8)
    c = paired_regions(seed, n, 2 + seed % 2)
    pairs = DtfmPairs.build(c, Workload.preset("gpt3-xl-dtfm").with_split(n_st, n_rep), n_st, n_rep)
    best = dtfm_costs(pairs, all_plans(n, n_st, n_rep)).min()
    assert 0 < dtfm_lower_bound(pairs, n_st, n_rep) <= best * (1 + 1e-12)


REGION_CASES = [(0, 2, 2, 6, 8, 2), (1, 3, 2, 6, 16, 3), (2, 2, 3, 6, 32, 3), (3, 3, 2, 6, 4, 2),
                (4, 2, 2, 5, 64, 2), (5, 3, 2, 6, 128, 3)]


@pytest.mark.parametrize(("seed", "n_st", "n_rep", "n", "n_mb", "size"), REGION_CASES)
def test_full_bound_below_the_optimum_on_regions_and_uneven_splits(seed: int, n_st: int, n_rep: int, n: int,
                                                                    n_mb: int, size: int) -> None:
    """Regions of 2-3 devices and six layers: the split classes (largest stage, smallest stage's bytes), the link
    occupancy in the period and the crossings of groups kept inside regions are all exercised."""
    c = paired_regions(seed, n, size)
    w = Workload.gpt(6, 256, 4, 128, 2000, 2, n_mb, stages=n_st, replicas=n_rep)
    splits = layer_splits(6, n_st)
    bound = full_lower_bound(c, w, n_st, n_rep)
    assert 0 < bound <= full_costs(c, w, n_st, n_rep, splits) * (1 + 1e-12)
    fixed = splits[seed % len(splits)]
    assert full_lower_bound(c, w, n_st, n_rep, fixed) <= full_costs(c, w, n_st, n_rep, [fixed]) * (1 + 1e-12)


def test_full_bound_proves_the_optimum_when_groups_inside_regions_force_a_thin_crossing() -> None:
    """Regions of 4 and 2 devices joined by a thin link, 3 stages x 2 replicas: groups inside the regions make
    every pipeline cross once, and the crossing's link occupancy bounds every pipeline's period; the bound reaches
    the optimum (a bound that charged the crossing only in the round trip stayed 27 % below it)."""
    region = np.array([0, 0, 0, 0, 1, 1])
    same = region[:, None] == region[None, :]
    c = Cluster.from_dict({"devices": 6, "matrix_level": "device", "delay_ms": np.where(same, 0.1, 5.0).tolist(),
                           "bandwidth_gbps": np.where(same, 100.0, 0.05).tolist()})
    w = Workload.gpt(4, 256, 4, 128, 2000, 2, 16, stages=3, replicas=2)
    best = full_costs(c, w, 3, 2, layer_splits(4, 3))
    assert best * (1 - 1e-9) <= full_lower_bound(c, w, 3, 2) <= best * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_window_spread_never_above_the_best_assignment_of_micro_batches(seed: int) -> None:
    """Pipelines of given round trips, every split of M micro-batches among them (each >= 1): the least phase
    over the splits is never below the bound from the round trips' least value and sum."""
    rng = np.random.default_rng(seed)
    n_rep, window = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    n_mb = int(rng.integers(n_rep, 13))
    period = float(rng.uniform(0.1, 1.0))
    rtt = rng.uniform(0.2, 8.0, size=n_rep) * (1.0 if seed % 2 else rng.choice([1.0, 5.0], size=n_rep))

    def end(c: int, x: float) -> float:
        return max(_window_finish(c, x, period, window), x + (c - 1) * period)

    best = min(max(end(c, x) for c, x in zip(split, rtt, strict=True))
               for split in itertools.product(range(1, n_mb + 1), repeat=n_rep) if sum(split) == n_mb)
    bound = _window_spread(n_mb, n_rep, window, float(rtt.min()), float(rtt.sum()), period)
    assert float(rtt.mean()) <= bound <= best * (1 + 1e-9)
