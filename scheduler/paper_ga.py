"""Re-implementation of the paper's scheduler (Yuan et al. 2022, Sec. 3.3), from its description.

A candidate is a balanced partition of the devices into S data-parallel groups of D. Its fitness is the
``dtfm`` cost with the inner problem solved exactly: DP from the groups, PP from bottleneck matchings between
groups and an open-loop TSP over them (:func:`layout.best_pipelines`). The search is a memetic algorithm:
a population of random partitions; each offspring is made by a five-point crossover of two random parents
(five devices take their group from the first parent, the rest from the second, then sizes are repaired), is
improved by a local search on the partition driven by the paper's cheap surrogate gain (mean hop cost to
another group against the cheapest hop inside its own; balanced swaps only), and replaces the worst member if better.
The budget is the paper's: population 100 plus 4,900 offspring = 5,000 candidates evaluated. Memory (not in
the paper): a candidate whose pipelines put a stage on a device that cannot hold it pays a large penalty per
such tasklet, so the search ends on a layout that fits whenever it finds one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .cost_dtfm import DtfmPairs
from .layout import best_pipelines


@dataclass
class PaperGAConfig:
    population: int = 100
    offspring: int = 4900
    crossover_points: int = 5
    local_search_swaps: int = 8
    seed: int = 0
    time_limit_s: float | None = None


@dataclass
class PaperGAResult:
    matrix: np.ndarray
    total: float
    evaluations: int
    seconds: float


MEMORY_PENALTY = 1e6


def _fitness(pairs: DtfmPairs, labels: np.ndarray, n_st: int, n_rep: int, bad: np.ndarray | None = None
             ) -> tuple[float, np.ndarray]:
    groups = [np.flatnonzero(labels == g) for g in range(n_st)]
    dp = max(float(pairs.dp[np.ix_(g, g)].sum(axis=1).max()) for g in groups) if n_rep > 1 else 0.0
    pp, m = best_pipelines(pairs.pp, groups)
    pen = 0.0 if bad is None else MEMORY_PENALTY * float(bad[m, np.arange(n_st)[None, :]].sum())
    return dp + 2.0 * pp + pen, m


def _crossover(p1: np.ndarray, p2: np.ndarray, points: int, n_st: int, n_rep: int,
               rng: np.random.Generator) -> np.ndarray:
    child = p2.copy()
    idx = rng.choice(len(child), size=min(points, len(child)), replace=False)
    child[idx] = p1[idx]
    sizes = np.bincount(child, minlength=n_st)
    for i in range(len(child)):  # repair: move surplus devices to the first group with room
        g = child[i]
        if sizes[g] > n_rep:
            h = int(np.flatnonzero(sizes < n_rep)[0])
            sizes[g] -= 1
            sizes[h] += 1
            child[i] = h
    return child


def _local_search(pp: np.ndarray, labels: np.ndarray, n_st: int, swaps: int, rng: np.random.Generator
                  ) -> np.ndarray:
    """Balanced swaps driven by the paper's surrogate gain, which spreads close devices over the groups.

    A device's score in its own group is its cheapest hop to another member; in another group, its mean hop
    cost to that group's members. Moving a device where it is *far* from the members, away from a group where
    it has a close neighbour, puts the devices of one fast region into different data-parallel groups, so that
    consecutive groups can be matched along fast links (a pipeline inside a region).
    """
    lab = labels.copy()
    sym = 0.5 * (pp + pp.T)
    n = len(lab)
    for _ in range(swaps):
        onehot = np.eye(n_st)[lab]
        mean_to = sym @ onehot / np.maximum(onehot.sum(axis=0), 1)
        same = lab[:, None] == lab[None, :]
        np.fill_diagonal(same, False)
        own = np.where(same, sym, np.inf).min(axis=1)
        own = np.where(np.isfinite(own), own, 0.0)
        gain = mean_to - own[:, None]
        gain[np.arange(n), lab] = -np.inf
        i, g = np.unravel_index(int(gain.argmax()), gain.shape)
        members = np.flatnonzero(lab == g)
        back = mean_to[members, lab[i]] - own[members]
        j = int(members[back.argmax()])
        if gain[i, g] + back.max() <= 0:
            break
        lab[i], lab[j] = lab[j], lab[i]
    return lab


def paper_ga(pairs: DtfmPairs, n_devices: int, n_st: int, n_rep: int, cfg: PaperGAConfig,
             mem_bad: np.ndarray | None = None) -> PaperGAResult:
    """Run the memetic search; the devices used are the first S x D of a random order (N may exceed S x D).

    ``mem_bad`` (N, S): True where a device cannot hold a stage; devices that can hold some stage are
    preferred when N > S x D.
    """
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    perm = rng.permutation(n_devices)
    if mem_bad is not None:  # stable: devices that fit more stages first, random order among equals
        perm = perm[np.argsort(mem_bad[perm].sum(axis=1), kind="stable")]
    used = perm[: n_st * n_rep]
    sub = DtfmPairs(dp=pairs.dp[np.ix_(used, used)], pp=pairs.pp[np.ix_(used, used)])
    bad = None if mem_bad is None or not mem_bad.any() else mem_bad[used]
    k = n_st * n_rep
    pop, fit, mats = [], [], []
    for _ in range(cfg.population):
        lab = np.repeat(np.arange(n_st), n_rep)[rng.permutation(k)]
        f, m = _fitness(sub, lab, n_st, n_rep, bad)
        pop.append(lab)
        fit.append(f)
        mats.append(m)
    evals = cfg.population
    for _ in range(cfg.offspring):
        if cfg.time_limit_s is not None and time.perf_counter() - t0 > cfg.time_limit_s:
            break
        a, b = rng.integers(len(pop), size=2)
        child = _crossover(pop[a], pop[b], cfg.crossover_points, n_st, n_rep, rng)
        child = _local_search(sub.pp, child, n_st, cfg.local_search_swaps, rng)
        f, m = _fitness(sub, child, n_st, n_rep, bad)
        evals += 1
        worst = int(np.argmax(fit))
        if f < fit[worst]:
            pop[worst], fit[worst], mats[worst] = child, f, m
    best = int(np.argmin(fit))
    return PaperGAResult(matrix=used[mats[best]], total=float(fit[best]), evaluations=evals,
                         seconds=time.perf_counter() - t0)
