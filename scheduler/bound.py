"""Lower bounds on the cost of *any* plan of a scenario, so that every plan can report its optimality gap.

``dtfm`` (``total = DP + 2 PP``), proved term by term:

* DP. A device i in a group of D has a row sum of at least the sum of its D - 1 cheapest ``dp[i, j]``. For a
  threshold T, the devices that can sit in a group whose row sums are all <= T are contained in the fixed
  point of: drop every device whose D - 1 cheapest partners *among the devices left* sum to more than T.
  If fewer than S x D devices survive, every plan has DP > T; bisection on T gives the bound.
* PP. A hop carries D vertex-disjoint links, so its max is at least the bottleneck value of a size-D matching
  in the bipartite graph of all links (sources and targets relaxed to two copies); D pipelines start on D
  distinct devices, so ``sum_hops max_r >= max_r path_r`` is at least the D-th smallest cheapest (S - 1)-link
  walk from a device. PP >= the larger of (S - 1) x the first and the second.
* Per device. Device i's D - 1 group mates and its pipeline neighbour j are distinct, and DP is at least i's
  row sum while PP is at least ``pp(i, j)`` plus the bound of each of the other S - 2 hops; so every used
  device's cheapest such choice bounds the total, and at least S x D devices are used (this is the bound that
  sees a fast cluster cannot hold both a group and a pipeline).
* Together. A plan whose DP is T uses only devices of the fixed point F(T), so its PP is bounded on the links
  inside F(T); over a grid T_0 < ... < T_K, ``min_k T_k + 2 PP(F(T_{k+1}))`` bounds every plan (F grows with T).

``full``: the pipeline phase must run 3 M x (forward FLOPs of the whole model) on at most S x D devices, so it
lasts at least that work over the S x D fastest devices' summed speed (communication and sync taken as free).
Both are relaxations: valid, not tight; the gap they give is an upper bound on how far a plan is from optimal.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from .cluster import Cluster
from .cost_dtfm import DtfmPairs
from .workload import Workload

MATCHING_MAX_DEVICES = 320  # above this, the per-hop bound uses cheapest in / out links instead of a matching
GRID = 12
BISECT_STEPS = 40


def _cheapest_sum(dp: np.ndarray, alive: np.ndarray, k: int) -> np.ndarray:
    """For every alive device, the sum of its k cheapest entries to other alive devices."""
    sub = dp[np.ix_(alive, alive)].copy()
    np.fill_diagonal(sub, np.inf)
    if k >= sub.shape[1]:
        return np.full(len(alive), np.inf)
    return np.partition(sub, k - 1, axis=1)[:, :k].sum(axis=1)


def dp_feasible(dp: np.ndarray, n_rep: int, t: float) -> np.ndarray:
    """Devices that may belong to a data-parallel group all of whose row sums are <= t (a superset)."""
    alive = np.arange(dp.shape[0])
    while len(alive) >= n_rep:
        keep = _cheapest_sum(dp, alive, n_rep - 1) <= t
        if keep.all():
            return alive
        alive = alive[keep]
    return alive[:0]


def dp_lower_bound(dp: np.ndarray, n_st: int, n_rep: int) -> float:
    """Every plan's DP term exceeds this (0 with one replica)."""
    if n_rep < 2:
        return 0.0
    need = n_st * n_rep
    first = np.sort(_cheapest_sum(dp, np.arange(dp.shape[0]), n_rep - 1))
    lo = float(first[need - 1]) * (1.0 - 1e-12)  # below this fewer than S x D devices pass even the first cut
    hi = float(np.sort(dp, axis=1)[:, -(n_rep - 1):].sum(axis=1).max())
    if len(dp_feasible(dp, n_rep, lo)) >= need:
        return lo
    for _ in range(BISECT_STEPS):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        if len(dp_feasible(dp, n_rep, mid)) >= need:
            hi = mid
        else:
            lo = mid
    return lo


def _hop_bound(pp: np.ndarray, n_rep: int) -> float:
    """Min over size-``n_rep`` matchings (sources and targets as two copies) of the max matched link."""
    n = pp.shape[0]
    off = ~np.eye(n, dtype=bool)
    cheap = max(float(np.sort(np.where(off, pp, np.inf).min(axis=1))[n_rep - 1]),
                float(np.sort(np.where(off, pp, np.inf).min(axis=0))[n_rep - 1]))
    if n > MATCHING_MAX_DEVICES:
        return cheap
    vals = np.unique(pp[off & (pp >= cheap)])
    lo, hi = 0, len(vals) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        adj = csr_matrix(off & (pp <= vals[mid]))
        if int((maximum_bipartite_matching(adj, perm_type="column") >= 0).sum()) >= n_rep:
            hi = mid
        else:
            lo = mid + 1
    return float(vals[lo])


def _walk_bound(pp: np.ndarray, n_st: int, n_rep: int) -> float:
    """D-th smallest over start devices of the cheapest walk of S - 1 links (no link from a device to itself)."""
    w = pp.copy()
    np.fill_diagonal(w, np.inf)
    cost = np.zeros(pp.shape[0])
    for _ in range(n_st - 1):
        cost = (w + cost[None, :]).min(axis=1)
    return float(np.sort(cost)[n_rep - 1])


def pp_lower_bound(pp: np.ndarray, n_st: int, n_rep: int) -> float:
    """Every plan's PP term (one direction, sum over hops of the slowest pipeline) is at least this."""
    if n_st < 2:
        return 0.0
    return max((n_st - 1) * _hop_bound(pp, n_rep), _walk_bound(pp, n_st, n_rep))


def device_lower_bound(pairs: DtfmPairs, n_st: int, n_rep: int, hop: float) -> float:
    """S x D-th smallest over devices of min_j [D - 1 cheapest mates other than j] + 2 (pp(i, j) + (S - 2) hop)."""
    n = pairs.dp.shape[0]
    dp = pairs.dp.copy()
    np.fill_diagonal(dp, np.inf)
    near = np.minimum(pairs.pp, pairs.pp.T).astype(float)
    np.fill_diagonal(near, np.inf)
    k = n_rep - 1
    if k == 0:
        mates = np.zeros((n, n))
    else:
        if k + 1 > n - 1:
            return float("inf")
        part = np.partition(dp, k, axis=1)
        kth = part[:, k - 1: k].max(axis=1)  # the k-th cheapest value of each row
        sum_k = part[:, :k].sum(axis=1)
        sum_k1 = sum_k + part[:, k]
        # j among the k cheapest (value below the k-th, or tied): the mates are the k + 1 cheapest minus j
        mates = np.where(dp <= kth[:, None], sum_k1[:, None] - dp, sum_k[:, None])
    per = (mates + 2.0 * (near + (n_st - 2) * hop)).min(axis=1)
    return float(np.sort(per)[n_st * n_rep - 1])


def dtfm_lower_bound(pairs: DtfmPairs, n_st: int, n_rep: int) -> float:
    """A lower bound on ``DP + 2 PP`` over every plan of S stages x D replicas on these devices."""
    need = n_st * n_rep
    if pairs.dp.shape[0] < need:
        return float("inf")
    dp_lb = dp_lower_bound(pairs.dp, n_st, n_rep)
    pp_all = pp_lower_bound(pairs.pp, n_st, n_rep)
    if n_rep < 2 or n_st < 2:
        return dp_lb + 2.0 * pp_all
    per_device = device_lower_bound(pairs, n_st, n_rep, _hop_bound(pairs.pp, n_rep))
    hi = float(np.sort(pairs.dp, axis=1)[:, -(n_rep - 1):].sum(axis=1).max())
    if hi <= dp_lb:
        return dp_lb + 2.0 * pp_all
    grid = np.linspace(dp_lb, hi, GRID)
    best = grid[-1] + 2.0 * pp_all
    prev_alive: np.ndarray | None = None
    prev_pp = pp_all
    for k in range(len(grid) - 1, 0, -1):  # from the loosest threshold down; PP only grows as F shrinks
        alive = dp_feasible(pairs.dp, n_rep, float(grid[k]))
        if len(alive) < need:
            break
        if prev_alive is None or len(alive) != len(prev_alive):
            prev_pp = max(prev_pp, pp_lower_bound(pairs.pp[np.ix_(alive, alive)], n_st, n_rep))
            prev_alive = alive
        best = min(best, float(grid[k - 1]) + 2.0 * prev_pp)
    return max(dp_lb + 2.0 * pp_all, best, per_device)


def full_lower_bound(cluster: Cluster, workload: Workload, n_st: int, n_rep: int) -> float:
    """Compute-only bound of the ``full`` model: the whole batch's FLOPs over the S x D fastest devices."""
    flops = 3.0 * workload.n_microbatches * workload.stage_forward_flops(0, workload.n_layers)
    fastest = np.sort(cluster.tflops)[::-1][: n_st * n_rep].sum() * 1e12
    return float(flops / fastest)


def lower_bound(cluster: Cluster, workload: Workload, n_st: int, n_rep: int, cost_model: str,
                pairs: DtfmPairs | None = None) -> float:
    """The bound of ``cost_model`` for this split (see the module doc)."""
    if cost_model == "dtfm":
        return dtfm_lower_bound(pairs or DtfmPairs.build(cluster, workload, n_st, n_rep), n_st, n_rep)
    return full_lower_bound(cluster, workload, n_st, n_rep)


def gap(cost: float, bound: float) -> float:
    """Relative optimality gap (cost - bound) / cost, 0 when the bound is reached."""
    if not np.isfinite(bound) or cost <= 0:
        return 0.0 if cost <= bound else 1.0
    return max(0.0, (cost - bound) / cost)
