"""The paper's inner problem: given the data-parallel groups, the best pipeline through them.

For a fixed partition of the devices into S groups of D, the DP cost is fixed and the PP cost depends only on
(1) the order in which the groups form the pipeline and (2) which device of group a feeds which device of the
next group b. For (2) the hop cost is ``max_r pp[x_r, y_r]``, so the best pairing is a *bottleneck* perfect
matching ``B[a, b]``; for (1) the best order is an open-loop travelling-salesman path over the groups with
edge weights ``B``. Both are solved exactly here (Held-Karp for up to ``EXACT_TSP_MAX`` groups, otherwise
nearest-neighbour starts polished by 2-opt).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
from scipy.optimize import linear_sum_assignment

EXACT_TSP_MAX = 13


def bottleneck_matching(c: np.ndarray) -> tuple[float, np.ndarray]:
    """Min over perfect matchings of the max matched entry of square ``c``; returns (value, col per row).

    A threshold t is feasible iff the bipartite graph of entries <= t has a perfect matching. Every row and
    column needs some edge, so ``max(max_i min_j c, max_j min_i c)`` is a lower bound; from there we binary
    search the sorted distinct entries, testing feasibility with one assignment solve on the 0/1 matrix.
    """
    n = c.shape[0]
    if n == 1:
        return float(c[0, 0]), np.zeros(1, dtype=int)
    lb = max(c.min(axis=1).max(), c.min(axis=0).max())
    vals = np.unique(c[c >= lb])
    lo, hi = 0, len(vals) - 1
    best_cols = None
    # Try the lower bound first: with clustered links it is usually feasible.
    while lo <= hi:
        mid = lo if best_cols is None and lo == 0 else (lo + hi) // 2
        rows, cols = linear_sum_assignment(c > vals[mid])
        if not (c[rows, cols] > vals[mid]).any():
            best_cols, best = cols, mid
            hi = mid - 1
        else:
            lo = mid + 1
        if best_cols is not None and hi < lo:
            break
    assert best_cols is not None
    return float(vals[best]), best_cols


def open_path_tsp(w: np.ndarray) -> tuple[float, list[int]]:
    """Cheapest Hamiltonian path (any start, any end) through ``w`` (k x k)."""
    k = w.shape[0]
    if k == 1:
        return 0.0, [0]
    if k <= EXACT_TSP_MAX:
        return _held_karp_path(w)
    return _two_opt_path(w)


@functools.lru_cache(maxsize=16)
def _masks_by_popcount(k: int) -> list[np.ndarray]:
    masks = np.arange(1 << k)
    pc = np.array([bin(x).count("1") for x in range(1 << k)])
    return [masks[pc == c] for c in range(k + 1)]


def _held_karp_path(w: np.ndarray) -> tuple[float, list[int]]:
    """dp[mask, i] = cheapest path visiting exactly ``mask`` and ending at i, layer by layer of |mask|.

    dp[mask, i] = min_j dp[mask without i, j] + w[j, i]; each layer is k vectorised updates. The path is
    recovered backwards by finding the j that attains each minimum, so no parent table is kept.
    """
    k = w.shape[0]
    full = 1 << k
    dp = np.full((full, k), np.inf)
    for j in range(k):
        dp[1 << j, j] = 0.0
    layers = _masks_by_popcount(k)
    for c in range(2, k + 1):
        ms = layers[c]
        for i in range(k):
            sel = ms[(ms >> i) & 1 == 1]
            prev = sel ^ (1 << i)
            dp[sel, i] = (dp[prev] + w[:, i][None, :]).min(axis=1)
    mask = full - 1
    last = int(dp[mask].argmin())
    cost = float(dp[mask, last])
    order = [last]
    while mask != 1 << last:
        prev = mask ^ (1 << last)
        j = int((dp[prev] + w[:, last]).argmin())
        order.append(j)
        mask, last = prev, j
    return cost, order[::-1]


def _path_cost(w: np.ndarray, order: list[int]) -> float:
    return float(sum(w[a, b] for a, b in itertools.pairwise(order)))


def _two_opt_path(w: np.ndarray) -> tuple[float, list[int]]:
    k = w.shape[0]
    best_cost, best_order = np.inf, list(range(k))
    for start in range(k):
        order, left = [start], set(range(k)) - {start}
        while left:
            nxt = min(left, key=lambda x: w[order[-1], x])
            order.append(nxt)
            left.remove(nxt)
        improved = True
        while improved:
            improved = False
            for i in range(k - 1):
                for j in range(i + 1, k):
                    cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                    if _path_cost(w, cand) < _path_cost(w, order) - 1e-12:
                        order, improved = cand, True
        c = _path_cost(w, order)
        if c < best_cost:
            best_cost, best_order = c, order
    return best_cost, best_order


def best_pipelines(pp: np.ndarray, groups: list[np.ndarray]) -> tuple[float, np.ndarray]:
    """Optimal (PP, plan matrix) for the given groups: bottleneck matchings + open-path TSP over groups."""
    k = len(groups)
    d = len(groups[0])
    if k == 1:
        return 0.0, np.asarray(groups[0], dtype=int).reshape(d, 1)
    b = np.zeros((k, k))
    match: dict[tuple[int, int], np.ndarray] = {}
    symmetric = bool(np.array_equal(pp, pp.T))
    for a in range(k):
        for c in range(k):
            if a == c or (symmetric and c < a):
                continue
            b[a, c], match[a, c] = bottleneck_matching(pp[np.ix_(groups[a], groups[c])])
            if symmetric:  # the transposed matching is optimal for the reverse direction
                b[c, a], match[c, a] = b[a, c], np.argsort(match[a, c])
    cost, order = open_path_tsp(b)
    m = np.empty((d, k), dtype=int)
    m[:, 0] = groups[order[0]]
    # follow the matchings along the path: row r continues with the partner of its current device
    pos = np.arange(d)  # index within the current group of pipeline r's device
    for s in range(1, k):
        cols = match[order[s - 1], order[s]]
        pos = cols[pos]
        m[:, s] = np.asarray(groups[order[s]])[pos]
    return cost, m
