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

* Access. Every used device touches a hop: as a source (its cheapest out-link ``a_i``) or a target (its
  cheapest in-link ``b_i``), so with ``v_i = min(a_i, b_i)`` hop h's max is at least max(M_h, M_{h+1}), M_s
  the largest v of group s. On a path, the sum of max(M_h, M_{h+1}) over edges is at least the sum of all M
  but the smallest (charge every edge to its endpoint farther from the smallest node), and the k-th largest
  group maximum is at least the ((k - 1) D + 1)-th largest v of the used devices, hence of the S x D devices
  with the smallest v. This is the bound that sees slow access links (home connections) that must be used.
* Segments. For a link threshold theta, call a hop fast when all its D links cost <= theta. The k slow hops
  cost at least the next link value theta' each; the fast ones cut the S stages into k + 1 segments, and in a
  segment of L stages every pipeline's L devices are joined by links <= theta, so they lie in one connected
  component (of the graph of links <= theta, either direction) of c devices, which holds at most floor(c / L)
  such pieces. So (i) the segment lengths must pack into the components (for every l: D x the summed length
  of segments >= l is at most the devices of components of size >= l, and D x their number at most
  sum floor(c / l)), and (ii) a group of a stage in a segment of length L has at most floor(c / L)
  members in a component of size c: a member's row sum is at least its D - 1 cheapest partners with at most
  floor(c / l) from each component (one fewer from its own) for every l <= L, and the D x (summed length of the
  segments >= l) devices of those segments are distinct such members, so DP(parts) is the largest over l of
  that-many-th smallest capped row. Minimising DP(parts) + 2 max(PP, k theta' + (S - 1 - k) hop) over the
  partitions of S that pass (i) bounds every plan; every theta gives a bound and the largest is kept. The same
  holds with the hops cut where some link joins two components (instead of where some link exceeds theta):
  the segments are coarser and each cut hop costs at least the cheapest link between components.
  This is the bound that sees that the fast clusters of a
  datacenter can hold either the groups or the pipelines, and how many slow hops a set of small clusters forces.

``full`` (``total = pipeline phase + max_s sync_s``), the two parts bounded separately:

* Phase. Every device does its stage's forward and backward of every micro-batch of its pipeline, so the phase
  lasts at least 3 M x (forward FLOPs of the whole model) over the S x D fastest devices' summed speed. A
  pipeline's round trip is at least 3 F / (fastest device) plus the cheapest (S - 1)-hop walk out and back
  (``rtt``); its period is at least its slowest stage, at least 3 F over its devices' summed speed; its c-th
  micro-batch ends no sooner than ``rtt + (c - 1) period`` and than ``ceil(c / S) rtt`` (window of S). The
  period is also at least 3 x (the smallest possible largest stage's FLOPs: a linear-partition DP over the
  layers, or the given split's) over the fastest device's speed, ``p``. With sum c = M over at most D
  pipelines: phase >= rtt + (M - D) max(3 F / (summed speed of the S x D fastest), p / D), and the busiest
  pipeline (c >= ceil(M / D)) gives phase >= (floor((c - 1) / S) + 1) rtt + ((c - 1) mod S) p.
* Pieces. For a threshold theta on a hop's round trip (link out + link back), a pipeline's hops of round trip
  <= theta join devices of one connected component of the graph of such links; a component of c devices holds
  pieces with at most c - ceil(c / S) such hops in all, and one pipeline needs ceil(S / c_max) - 1 slower hops
  (each >= theta', the next value). So the D_a active pipelines' round trips sum to at least D_a x compute +
  (slow hops) theta' + (the rest) x the cheapest round trip, and since each active pipeline r ends no sooner than
  rtt_r + (c_r - 1) p, phase >= (that sum + (M - D_a) p) / D_a for the worst case D_a <= D; the busiest pipeline
  gives the window bound with its own round trip. The same sum is also at least D_a x compute + the access
  bound: device i's hops cost at least v_i, its cheapest round trip; a pipeline's hops sum to at least its
  devices' v but the smallest (the path lemma above), and the k-th largest pipeline minimum is at most the
  (k S)-th largest v, so on the D_a S devices with the smallest v the sum is at least their v less every S-th.
  With M >= D every pipeline starts a micro-batch at time 0 (the pull takes the M earliest starts), so D_a = D
  and the phase is at least the round trip of the pipeline holding the used device of largest v. Then also, with
  the D round trips' least value and sum bounded, the phase T must let them end M micro-batches: pipeline r ends
  at most cap(T, rtt_r) of them by T (its window finish and its period), and the sum of cap over the pipelines is
  at most D x the least concave majorant of cap(T, .) at their mean round trip (Jensen; it is non-increasing),
  so the least T where that reaches M bounds the phase. The compute
  in those summed round trips is at least 3 (f_min x the S x D_a fastest devices' summed 1 / speed + the rest of
  the model's FLOPs x the D_a fastest devices'): the split is shared, so every stage runs on D_a devices.
* Sync and pipelines together. For a threshold t on the pair cost at the smallest stage's bytes: either some
  group has a pair >= t (sync >= 2 t), or every group lies inside a component of the graph of pairs < t. Then
  every pipeline's stage-s device lies in group s's component, so all pipelines visit the same components, at
  least k of them (the fewest that hold S groups, a component of c devices holding floor(c / D)); their crossing
  hops join those k, so they contain a spanning tree of them, and by the greedy property of spanning trees its
  i-th cheapest edge is at least the i-th cheapest edge of a minimum spanning forest of all components that can
  hold a group (an edge weighing the cheapest pair between two components). So every pipeline's hops cost at
  least the k - 1 cheapest forest edges (round trips) plus S - k cheapest round trips, and its period is at least
  the (k - 1)-th cheapest forest edge of link occupancy (bits / bandwidth, the larger direction); the phase
  bounds above apply to that round trip and period. The smaller of the two cases bounds every plan, for every t.
* Periods. Every pipeline's period is at least its slowest hop's link occupancy, so at least the cheapest
  pair's (the larger direction).
* Split classes. Without a fixed split, the plans are classed by their largest stage's FLOPs phi (every
  distinct value of a layer range, from the least a split allows): a plan of class phi has period >= 3 phi over
  the fastest device, and its smallest stage holds at least the fewest bytes of a stage of any split whose
  stages are all <= phi (a range is such a stage iff the layers before and after it split into the remaining
  stage counts, each <= phi). The bound is the least over the classes: computed for the class where that
  smallest stage shrinks (a class of smaller phi and no larger smallest stage already bounds the others'
  plans), stopped once the phase alone reaches the least so far, and the classes after the first 12 bounded
  together (their least phi, any split's smallest stage).
* Sync. A group's sync is twice its slowest pair's ``delay + 8 (P_s / D) / bw``; every group is a D-set whose
  pairs all cost <= its max, so its members keep D - 1 partners in the fixed point of "drop devices with fewer
  than D - 1 partners at cost <= t". All S groups need S x D such devices at the smallest stage's bytes, and
  the largest stage (at least ceil(L / S) layers, or the given split's) needs D at its bytes. An exact step
  then waits for the digest round, the group's largest one-way delay: at least the same fixed point's threshold
  on the delays alone, for any one group, so it adds to every sync term.

All are relaxations: valid by construction, exact only on some instances; ``gap`` is an upper bound on how far
a plan is from optimal. ``tests/scheduler/test_scheduler_bound.py`` checks every bound against exhaustive search.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components, maximum_bipartite_matching

from .bound_cache import BOUNDS
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


def dp_feasible(dp: np.ndarray, n_rep: int, t: float, first: np.ndarray | None = None) -> np.ndarray:
    """Devices that may belong to a data-parallel group all of whose row sums are <= t (a superset).

    ``first``: ``_cheapest_sum`` over all devices when the caller has it (the first cut of every threshold).
    """
    alive = np.arange(dp.shape[0])
    while len(alive) >= n_rep:
        if first is not None and len(alive) == dp.shape[0]:
            keep = first <= t
        else:
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
    cut = _cheapest_sum(dp, np.arange(dp.shape[0]), n_rep - 1)
    first = np.sort(cut)
    lo = float(first[need - 1]) * (1.0 - 1e-12)  # below this fewer than S x D devices pass even the first cut
    hi = float(np.sort(dp, axis=1)[:, -(n_rep - 1):].sum(axis=1).max())
    if len(dp_feasible(dp, n_rep, lo, cut)) >= need:
        return lo
    for _ in range(BISECT_STEPS):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        if len(dp_feasible(dp, n_rep, mid, cut)) >= need:
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


def dtfm_lower_bound(pairs: DtfmPairs, n_st: int, n_rep: int, quick: bool = False) -> float:
    """A lower bound on ``DP + 2 PP`` over every plan of S stages x D replicas on these devices.

    ``quick``: without the segment bound (most of the time above a few hundred devices; a warm re-plan's).
    """
    need = n_st * n_rep
    if pairs.dp.shape[0] < need:
        return float("inf")
    dp_lb = dp_lower_bound(pairs.dp, n_st, n_rep)
    pp_all = max(pp_lower_bound(pairs.pp, n_st, n_rep), access_pp_bound(pairs.pp, n_st, n_rep))
    if n_rep < 2 or n_st < 2:
        return dp_lb + 2.0 * pp_all
    coupled = _coupled_bound(pairs, n_st, n_rep, dp_lb, pp_all)
    if quick:
        return coupled
    return max(coupled, segment_bound(pairs, n_st, n_rep, dp_lb, pp_all, _hop_bound(pairs.pp, n_rep)))


def _coupled_bound(pairs: DtfmPairs, n_st: int, n_rep: int, dp_lb: float, pp_all: float) -> float:
    """The per-device bound and the DP-threshold grid (see the module doc)."""
    need = n_st * n_rep
    per_device = device_lower_bound(pairs, n_st, n_rep, _hop_bound(pairs.pp, n_rep))
    hi = float(np.sort(pairs.dp, axis=1)[:, -(n_rep - 1):].sum(axis=1).max())
    if hi <= dp_lb:
        return dp_lb + 2.0 * pp_all
    grid = np.linspace(dp_lb, hi, GRID)
    best = grid[-1] + 2.0 * pp_all
    prev_alive: np.ndarray | None = None
    prev_pp = pp_all
    cut = _cheapest_sum(pairs.dp, np.arange(pairs.dp.shape[0]), n_rep - 1)
    for k in range(len(grid) - 1, 0, -1):  # from the loosest threshold down; PP only grows as F shrinks
        alive = dp_feasible(pairs.dp, n_rep, float(grid[k]), cut)
        if len(alive) < need:
            break
        if prev_alive is None or len(alive) != len(prev_alive):
            sub = pairs.pp[np.ix_(alive, alive)]
            prev_pp = max(prev_pp, pp_lower_bound(sub, n_st, n_rep), access_pp_bound(sub, n_st, n_rep))
            prev_alive = alive
        best = min(best, float(grid[k - 1]) + 2.0 * prev_pp)
    return max(dp_lb + 2.0 * pp_all, best, per_device)


def access_pp_bound(pp: np.ndarray, n_st: int, n_rep: int) -> float:
    """PP >= the sum of the S - 1 largest group maxima of v_i = cheapest link in or out of i (module doc)."""
    if n_st < 2:
        return 0.0
    w = pp.astype(float).copy()
    np.fill_diagonal(w, np.inf)
    v = np.minimum(w.min(axis=1), w.min(axis=0))
    used = np.sort(v)[: n_st * n_rep][::-1]  # the S x D smallest, largest first
    return float(used[np.arange(n_st - 1) * n_rep].sum())


SEGMENT_MAX_STAGES = 20  # partitions of S are enumerated (627 for S = 20); above, the segment bound is skipped
SEGMENT_THRESHOLDS = 24  # link thresholds tried (all distinct values when there are fewer) ...
SEGMENT_THRESHOLDS_LARGE = 8  # ... and above 256 devices, where each costs O(N^2 log N)


class ThresholdComponents:
    """Connected components of the graph of pairs costing <= t (or < t), for many t, from one spanning tree.

    Why: the bounds sweep thresholds, and the components of every such graph are those of a minimum spanning
    tree's edges <= t (every pair is an edge, so the tree spans all devices), so one O(N^2) tree (Prim's, dense)
    replaces a dense graph per t. ``sym`` must be symmetric; its diagonal is ignored.
    """

    def __init__(self, sym: np.ndarray) -> None:
        n = sym.shape[0]
        self.n = n
        w = np.asarray(sym, dtype=float)
        inside = np.zeros(n, dtype=bool)
        inside[0] = True
        best, parent = w[0].copy(), np.zeros(n, dtype=int)
        rows, cols, cost = np.zeros(n - 1, dtype=int), np.zeros(n - 1, dtype=int), np.zeros(n - 1)
        for k in range(n - 1):
            j = int(np.argmin(np.where(inside, np.inf, best)))
            if inside[j]:  # every remaining candidate costs inf: the cheapest edge to one is still an edge
                j = int(np.flatnonzero(~inside)[0])
            rows[k], cols[k], cost[k] = j, parent[j], best[j]
            inside[j] = True
            closer = ~inside & (w[j] < best)
            best = np.where(closer, w[j], best)
            parent = np.where(closer, j, parent)
        self.rows, self.cols, self.cost = rows, cols, cost

    def labels(self, t: float, strict: bool = False) -> np.ndarray:
        """Component label of every device in the graph of pairs ``< t`` (strict) or ``<= t``."""
        keep = self.cost < t if strict else self.cost <= t
        graph = csr_matrix((np.ones(int(keep.sum())), (self.rows[keep], self.cols[keep])), shape=(self.n, self.n))
        return connected_components(graph, directed=False)[1]


def _partitions(n: int, most: int | None = None) -> list[tuple[int, ...]]:
    """Every partition of n into non-increasing parts <= most."""
    most = n if most is None else most
    if n == 0:
        return [()]
    out = []
    for first in range(min(n, most), 0, -1):
        out.extend((first, *rest) for rest in _partitions(n - first, first))
    return out


def _packs(parts: tuple[int, ...], n_rep: int, sizes: np.ndarray) -> bool:
    """Necessary condition for D copies of every segment to lie in components of these sizes (module doc)."""
    for length in sorted(set(parts)):
        if length < 2:
            continue
        long_ = [x for x in parts if x >= length]
        big = sizes[sizes >= length]
        if n_rep * sum(long_) > big.sum() or n_rep * len(long_) > (big // length).sum():
            return False
    return True


def _capped_rows(dp: np.ndarray, labels: np.ndarray, sizes: np.ndarray, n_rep: int, length: int) -> np.ndarray:
    """Row sum bounds of members of groups inside segments of ``length`` stages, sorted ascending.

    Such a group has at most floor(c / L) members in a component of c devices, so a member's D - 1 mates are
    at most that many from each other component and one fewer from its own: the cheapest D - 1 under these
    caps (greedy is exact for caps per part) bound its row sum.
    """
    n = dp.shape[0]
    cap = sizes // length  # members one component may give such a group
    d = dp.astype(float).copy()
    np.fill_diagonal(d, np.inf)
    rank = np.zeros((n, n), dtype=int)  # rank of dp[i, j] among i's entries to j's component
    for comp in np.flatnonzero(sizes > 1):
        cols = np.flatnonzero(labels == comp)
        rank[:, cols] = np.argsort(np.argsort(d[:, cols], axis=1, kind="stable"), axis=1, kind="stable")
    limit = cap[labels][None, :] - (labels[:, None] == labels[None, :])
    d = np.where(rank < limit, d, np.inf)
    k = n_rep - 1
    row = np.partition(d, k - 1, axis=1)[:, :k].sum(axis=1) if k < n else np.full(n, np.inf)
    row = np.where(cap[labels] >= 1, row, np.inf)
    return np.sort(row)


def segment_bound(pairs: DtfmPairs, n_st: int, n_rep: int, dp_lb: float, pp_all: float, hop: float) -> float:
    """Max over link thresholds of the min over packable segmentations of DP(L) + 2 PP (see the module doc)."""
    if n_st < 2 or n_rep < 2 or n_st > SEGMENT_MAX_STAGES:
        return 0.0
    pp, n = pairs.pp, pairs.pp.shape[0]
    off = ~np.eye(n, dtype=bool)
    every = np.unique(pp[off])
    vals = every
    tries = SEGMENT_THRESHOLDS if n <= 256 else SEGMENT_THRESHOLDS_LARGE
    if len(vals) > tries:
        vals = np.unique(np.quantile(vals, np.linspace(0.0, 1.0, tries), method="lower"))
    parts_all = _partitions(n_st)
    comps = ThresholdComponents(np.minimum(pp, pp.T))  # a pair is joined when either direction is <= theta
    best = 0.0
    for theta in vals[:-1]:  # at the largest value every hop is fast: nothing new
        nxt = float(every[np.searchsorted(every, theta, side="right")])
        labels = comps.labels(float(theta))
        sizes = np.bincount(labels)
        apart = labels[:, None] != labels[None, :]
        cross = float(pp[apart].min()) if apart.any() else float("inf")
        rows_of: dict[int, np.ndarray] = {}
        # slow hops (some link > theta) cost >= the next value; cut hops (some link between components) cost
        # >= the cheapest link between components: either cuts the stages into segments (see the module doc)
        for slow in (nxt, cross):
            lo = float("inf")
            for parts in parts_all:
                k = len(parts) - 1
                pp_lb = max(pp_all, k * slow + (n_st - 1 - k) * hop)
                if max(dp_lb, 0.0) + 2.0 * pp_lb >= lo or not _packs(parts, n_rep, sizes):
                    continue
                dp_seg = dp_lb
                for length in set(parts) - {1}:  # members of segments >= l long obey the caps of length l
                    if length not in rows_of:
                        rows_of[length] = _capped_rows(pairs.dp, labels, sizes, n_rep, length)
                    members = n_rep * sum(x for x in parts if x >= length)
                    dp_seg = max(dp_seg, float(rows_of[length][members - 1]))
                lo = min(lo, dp_seg + 2.0 * pp_lb)
            best = max(best, lo)
    return best


def _clique_threshold(cost: np.ndarray, size: int, need: int) -> float:
    """Smallest t at which >= ``need`` devices keep >= size - 1 partners at symmetric cost <= t (fixed point)."""
    n = cost.shape[0]
    if size < 2:
        return 0.0
    sym = np.maximum(cost, cost.T)
    off = ~np.eye(n, dtype=bool)
    vals = np.unique(sym[np.triu_indices(n, 1)])  # symmetric: the upper triangle holds every value

    def ok(t: float) -> bool:
        adj = off & (sym <= t)
        alive = np.ones(n, dtype=bool)
        while True:
            deg = (adj & alive[None, :]).sum(axis=1)
            keep = alive & (deg >= size - 1)
            if keep.sum() == alive.sum():
                return int(alive.sum()) >= need
            alive = keep

    lo, hi = 0, len(vals) - 1
    if not ok(float(vals[hi])):
        return float("inf")
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(float(vals[mid])):
            hi = mid
        else:
            lo = mid + 1
    return float(vals[lo])


def _min_max_stage_flops(workload: Workload, n_st: int) -> float:
    """Min over contiguous splits into S stages of the largest stage's forward FLOPs (linear partition DP)."""
    n_lay = workload.n_layers
    flops = np.full((n_lay + 1, n_lay + 1), np.inf)
    for a in range(n_lay):
        for b in range(a + 1, n_lay + 1):
            flops[a, b] = workload.stage_forward_flops(a, b)
    best = np.full(n_lay + 1, np.inf)
    best[0] = 0.0
    for _ in range(n_st):
        best = np.maximum(best[:, None], flops).min(axis=0)
    return float(best[n_lay])


def _window_finish(c: int, rtt: float, period: float, window: int) -> float:
    """Earliest end of a pipeline's c-th micro-batch: ``done_k >= done_{k-1} + period`` and ``>= done_{k-W} + rtt``."""
    q, r = divmod(c - 1, window)
    return (q + 1) * rtt + r * period


def _piece_phase(sym: np.ndarray, n_st: int, n_rep: int, n_mb: int, compute: float, period: float,
                 work: np.ndarray | None = None) -> float:
    """Phase bound from how many slow hops the fast clusters force on the pipelines (see the module doc).

    ``work[a - 1]``: the least compute time a pipelines' round trips hold together (``compute`` x a without it).
    """
    if work is None:
        work = compute * np.arange(1, n_rep + 1)
    n = sym.shape[0]
    off = ~np.eye(n, dtype=bool)
    every = vals = np.unique(sym[np.triu_indices(n, 1)])  # symmetric: the upper triangle holds every value
    fast_min = float(vals[0])
    if len(vals) > SEGMENT_THRESHOLDS:
        vals = np.unique(np.quantile(vals, np.linspace(0.0, 1.0, SEGMENT_THRESHOLDS), method="lower"))
    # access: device i's hops cost at least v_i (its cheapest round trip); per pipeline the hops sum to at least
    # its devices' v but the smallest (path lemma), and the k-th largest pipeline minimum is at most the
    # (k S)-th largest v: so D_a pipelines' hops cost >= the D_a S smallest v minus their chunk minima
    trip = np.where(off, sym, np.inf)
    v = np.sort(np.minimum(trip.min(axis=1), trip.min(axis=0)))
    access = []
    for active in range(1, n_rep + 1):
        used = v[: active * n_st][::-1]
        access.append(float(work[active - 1]) + float(used.sum() - used[n_st - 1:: n_st].sum()))
    best = 0.0
    if n_mb >= n_rep and len(v) >= n_st * n_rep:
        # every pipeline starts a micro-batch at time 0, so all D are active and the phase is at least the round
        # trip of the one holding the used device with the largest v (at least the (S x D)-th smallest)
        best = compute + float(v[n_st * n_rep - 1]) + (n_st - 2) * float(v[0])
    busiest = math.ceil(n_mb / n_rep)
    comps = ThresholdComponents(sym)
    for theta in vals[:-1]:
        slow = float(every[np.searchsorted(every, theta, side="right")])
        labels = comps.labels(float(theta))
        sizes = np.bincount(labels)
        own = math.ceil(n_st / int(sizes.max())) - 1  # slow hops of any one pipeline
        rtt_one = compute + own * slow + (n_st - 1 - own) * fast_min
        lo = _window_finish(busiest, rtt_one, period, n_st)
        fast_cap = int((sizes - np.ceil(sizes / n_st)).sum())  # fast hops all pipelines together may have
        mean = float("inf")  # the D_a active pipelines: phase >= (sum of their rtt + (M - D_a) period) / D_a
        for active in (range(1, n_rep + 1) if n_mb < n_rep else (n_rep,)):
            hops = active * (n_st - 1)
            n_slow = max(active * own, hops - fast_cap)
            rtts = max(float(work[active - 1]) + n_slow * slow + (hops - n_slow) * fast_min, access[active - 1])
            mean = min(mean, (rtts + max(0, n_mb - active) * period) / active)
        lo = max(lo, mean)
        if n_mb >= n_rep:  # rtts: the D pipelines' round trips, summed
            lo = max(lo, _window_spread(n_mb, n_rep, n_st, rtt_one, rtts, period))
        best = max(best, lo)
    return best


def _window_spread(n_mb: int, n_rep: int, window: int, rtt_min: float, rtt_sum: float, period: float) -> float:
    """Least phase T at which D active pipelines, round trips >= ``rtt_min`` summing to >= ``rtt_sum``, can end
    all M micro-batches.

    Pipeline r ends its c_r-th micro-batch no sooner than ``W(c_r, rtt_r)`` = max(window finish, rtt_r + (c_r - 1)
    period), so c_r <= cap(T, rtt_r) = max{c : x_c >= rtt_r}, x_c the largest round trip with W(c, x) <= T; and
    rtt_r <= T (every pipeline has a micro-batch). cap(T, .) is non-increasing, so its least concave majorant g is
    too, and sum_r cap(T, rtt_r) <= D g(mean rtt) <= D g(max(rtt_sum / D, rtt_min)) (Jensen). T is feasible only
    if that reaches M; feasibility grows with T, so bisection finds the least such T.
    """
    mean = max(rtt_sum / n_rep, rtt_min)
    c = np.arange(1, n_mb + 1)
    q, r = np.divmod(c - 1, window)

    def capacity(t: float) -> float:
        if mean > t:
            return 0.0
        x = np.minimum((t - r * period) / (q + 1), t - (c - 1) * period)
        keep = x >= rtt_min
        if not keep.any():
            return 0.0
        xs, cs = x[keep], c[keep].astype(float)
        pts = sorted({(float(rtt_min), float(cs.max()))} | set(zip(xs.tolist(), cs.tolist(), strict=True)))
        hull: list[tuple[float, float]] = []  # upper hull, x ascending
        for pt in pts:
            while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (pt[1] - hull[-2][1])
                                      - (hull[-1][1] - hull[-2][1]) * (pt[0] - hull[-2][0])) >= 0:
                hull.pop()
            hull.append(pt)
        hx = np.array([h[0] for h in hull])
        hy = np.array([h[1] for h in hull])
        if mean >= hx[-1]:
            return n_rep * float(hy[-1]) if mean == hx[-1] else 0.0
        return n_rep * float(np.interp(mean, hx, hy))

    lo = mean
    hi = _window_finish(math.ceil(n_mb / n_rep), mean, period, window) + (math.ceil(n_mb / n_rep) - 1) * period
    if capacity(lo) >= n_mb:
        return lo
    for _ in range(BISECT_STEPS):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        if capacity(mid) >= n_mb:
            hi = mid
        else:
            lo = mid
    return lo


def _pipeline_work(workload: Workload, n_st: int, n_rep: int, speed: np.ndarray,
                   stages: list[tuple[int, int]] | None) -> np.ndarray:
    """Per a = 1..D: the least summed compute (forward + backward of all stages) of a pipelines' round trips.

    The split is shared by all pipelines: stage s's layers (f_s FLOPs, at least f_min) run once on each of the
    a pipelines' stage-s devices, so the sum is 3 sum_s f_s Q_s with Q_s the summed 1 / speed of those devices.
    With Q_s >= the a fastest devices' and sum_s Q_s >= the S x a fastest devices', it is at least
    3 (f_min sum_{S a fastest} 1 / speed + (F - S f_min) sum_{a fastest} 1 / speed).
    """
    n_lay = workload.n_layers
    flops = workload.stage_forward_flops(0, n_lay)
    f_min = (min(workload.stage_forward_flops(a, b) for a, b in stages) if stages is not None
             else min(workload.stage_forward_flops(a, a + 1) for a in range(n_lay)))
    inv = np.cumsum(1.0 / speed)
    active = np.arange(1, n_rep + 1)
    return 3.0 * (f_min * inv[active * n_st - 1] + (flops - n_st * f_min) * inv[active - 1])


PHI_MAX_TRIES = 12  # split classes (largest stage's FLOPs) bounded one by one; the rest are bounded together


def _split_tables(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Forward FLOPs and parameter bytes of every layer range [a, b) (inf / nan where b <= a)."""
    n_lay = workload.n_layers
    flops = np.full((n_lay + 1, n_lay + 1), np.inf)
    size = np.full((n_lay + 1, n_lay + 1), np.inf)
    for a in range(n_lay):
        for b in range(a + 1, n_lay + 1):
            flops[a, b] = workload.stage_forward_flops(a, b)
            size[a, b] = workload.stage_param_bytes(a, b)
    return flops, size


def _smallest_stage_bytes(flops: np.ndarray, size: np.ndarray, n_st: int, phi: float) -> float:
    """Least parameter bytes of a stage of any contiguous split into S stages of at most ``phi`` FLOPs each.

    A range [a, b) is a stage of such a split iff the a layers before it split into s1 stages and the layers
    after it into S - 1 - s1, each <= phi: a prefix of a layers splits into any count from the fewest (a DP)
    to a (splitting a stage never raises its FLOPs), and likewise a suffix.
    """
    n_lay = flops.shape[0] - 1
    ok = flops <= phi
    pre = np.full(n_lay + 1, n_lay + 1)
    pre[0] = 0
    for b in range(1, n_lay + 1):
        cand = pre[:b][ok[:b, b]]
        pre[b] = cand.min() + 1 if len(cand) else n_lay + 1
    suf = np.full(n_lay + 1, n_lay + 1)
    suf[n_lay] = 0
    for a in range(n_lay - 1, -1, -1):
        cand = suf[a + 1:][ok[a, a + 1:]]
        suf[a] = cand.min() + 1 if len(cand) else n_lay + 1
    a_idx, b_idx = np.nonzero(ok)
    lo = np.maximum(pre[a_idx], n_st - 1 - (n_lay - b_idx))
    hi = np.minimum(a_idx, n_st - 1 - suf[b_idx])
    fit = lo <= hi
    return float(size[a_idx[fit], b_idx[fit]].min()) if fit.any() else float("inf")


def full_lower_bound(cluster: Cluster, workload: Workload, n_st: int, n_rep: int,
                     stages: list[tuple[int, int]] | None = None, quick: bool = False) -> float:
    """Bound of the ``full`` model: pipeline phase (work, round trip, window) + the largest sync (module doc).

    ``stages``: the layer split when it is fixed; otherwise the bound is the least over the split classes
    (largest stage's FLOPs phi, which sets the period, and the smallest stage's bytes such splits allow, which
    prices the sync), so it holds for every split. ``quick``: without the sync split (a threshold sweep).
    """
    need = n_st * n_rep
    if cluster.n < need:
        return float("inf")
    n_lay, n_mb = workload.n_layers, workload.n_microbatches
    f3 = 3.0 * workload.stage_forward_flops(0, n_lay)  # forward FLOPs add up over any split
    speed = np.sort(cluster.tflops)[::-1] * 1e12
    link = cluster.transfer_s(workload.activation_bytes())
    xfer = 8.0 * workload.activation_bytes() / cluster.bandwidth_bps
    np.fill_diagonal(xfer, 0.0)
    trip, xsym = link + link.T, np.maximum(xfer, xfer.T)
    work = _pipeline_work(workload, n_st, n_rep, speed, stages) if n_st > 1 else None
    if stages is not None:
        classes = [(max(workload.stage_forward_flops(a, b) for a, b in stages),
                    min(workload.stage_param_bytes(a, b) for a, b in stages))]
        large = max(workload.stage_param_bytes(a, b) for a, b in stages)
    else:
        ftab, btab = _split_tables(workload)
        phi0 = _min_max_stage_flops(workload, n_st)
        phis = np.unique(ftab[np.isfinite(ftab) & (ftab >= phi0 * (1 - 1e-12))])
        classes = [(float(p), _smallest_stage_bytes(ftab, btab, n_st, float(p))) for p in phis[:PHI_MAX_TRIES]]
        if len(phis) > PHI_MAX_TRIES:  # every larger phi together: its least period, any split's smallest stage
            classes.append((float(phis[PHI_MAX_TRIES]), float(np.nanmin(np.where(np.isfinite(ftab), btab, np.nan)))))
        width = -(-n_lay // n_st)
        large = min(workload.stage_param_bytes(a, a + width) for a in range(n_lay - width + 1))

    def pair_cost(nbytes: float) -> np.ndarray:
        return cluster.delay_s + 8.0 * (nbytes / n_rep) / cluster.bandwidth_bps

    sync_large = _clique_threshold(pair_cost(large), n_rep, n_rep) if n_rep > 1 else 0.0
    # an exact step's digest round: every group waits for its largest one-way delay (schedule.sync_times)
    digest = _clique_threshold(cluster.delay_s, n_rep, n_rep) if n_rep > 1 else 0.0
    walk = _walk_bound(trip, n_st, 1) if n_st > 1 else 0.0
    hop_x = float(xsym[~np.eye(cluster.n, dtype=bool)].min()) if n_st > 1 else 0.0
    best, covered = float("inf"), float("inf")
    for phi, small in classes:  # ascending phi: the phase only grows, so stop once it alone reaches the best
        if small >= covered:  # a class of smaller phi and no larger smallest stage already bounds these plans
            continue
        covered = small
        # every pipeline's period is at least its slowest stage (>= 3 phi on the fastest device) and its
        # slowest hop's link occupancy
        period = max(3.0 * phi / speed[0], hop_x)
        phase = _phase_bound(f3, speed, need, n_mb, n_rep, n_st, f3 / speed[0] + walk, period)
        if phase + 2.0 * sync_large + digest >= best:
            break
        if n_st > 1:
            phase = max(phase, _piece_phase(trip, n_st, n_rep, n_mb, f3 / speed[0], period, work))
        if n_rep < 2:
            best = min(best, phase)
            continue
        sync = max(_clique_threshold(pair_cost(small), n_rep, need), sync_large)
        out = phase + 2.0 * sync + digest
        if n_st > 1 and not quick:  # every sync term of the split's bound pays the same digest round
            out = max(out, digest + _sync_split(pair_cost(small), trip, xsym, n_st, n_rep, n_mb, f3 / speed[0],
                                                period, phase, sync, work))
        best = min(best, out)
    return float(best)


def _phase_bound(f3: float, speed: np.ndarray, need: int, n_mb: int, n_rep: int, n_st: int, rtt: float,
                 period: float) -> float:
    """Work over the S x D fastest devices; round trip + (M - D) periods shared; the busiest pipeline's window."""
    total_speed = speed[:need].sum()
    extra = max(0, n_mb - n_rep)
    return max(f3 * n_mb / total_speed, rtt + extra * max(f3 / total_speed, period / n_rep),
               _window_finish(math.ceil(n_mb / n_rep), rtt, period, n_st))


def _component_tree(labels: np.ndarray, hosts: np.ndarray, weights: list[np.ndarray]) -> list[np.ndarray]:
    """Per weight matrix: the sorted edge weights of a minimum spanning forest of the hosting components, an
    edge between two components weighing the cheapest pair between them."""
    out = []
    keep = np.isin(labels, hosts)
    lab = labels[keep]
    order = np.argsort(lab, kind="stable")
    lab = lab[order]
    starts = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
    for w in weights:
        sub = w[np.ix_(np.flatnonzero(keep)[order], np.flatnonzero(keep)[order])]
        comp = np.minimum.reduceat(np.minimum.reduceat(sub, starts, axis=0), starts, axis=1)
        np.fill_diagonal(comp, np.inf)
        k = comp.shape[0]
        edges = []
        if k > 1:
            inside = np.zeros(k, dtype=bool)
            inside[0] = True
            near = comp[0].copy()
            for _ in range(k - 1):
                j = int(np.argmin(np.where(inside, np.inf, near)))
                edges.append(float(near[j]))
                inside[j] = True
                near = np.minimum(near, comp[j])
        out.append(np.sort(np.array(edges)))
    return out


def _sync_split(pair: np.ndarray, trip: np.ndarray, xsym: np.ndarray, n_st: int, n_rep: int, n_mb: int,
                compute: float, period: float, phase: float, sync: float, work: np.ndarray | None) -> float:
    """Max over t of min(sync >= 2 t, or every group inside a component of pairs < t) (see the module doc).

    Inside: every pipeline's stage-s device lies in the component of group s, so all pipelines visit the same
    components, at least k of them (the fewest hosting components that hold S groups), joined by crossing hops
    that contain a spanning tree of those k: by the greedy property of spanning trees, their i-th cheapest is at
    least the i-th cheapest edge of a minimum spanning forest of all hosting components (round trips for the
    round trip, link occupancy for the period).
    """
    n = pair.shape[0]
    off = ~np.eye(n, dtype=bool)
    sym = np.maximum(pair, pair.T)
    vals = np.unique(sym[np.triu_indices(n, 1)])  # symmetric: the upper triangle holds every value
    tries = SEGMENT_THRESHOLDS if n <= 256 else SEGMENT_THRESHOLDS_LARGE
    if len(vals) > tries:
        vals = np.unique(np.quantile(vals, np.linspace(0.0, 1.0, tries), method="lower"))
    fast_min = float(trip[off].min())
    most = math.ceil(n_mb / n_rep)
    best = 0.0
    comps = ThresholdComponents(sym)
    for t in vals[1:]:
        spread = phase + 2.0 * max(sync, float(t))  # some group has a pair >= t
        labels = comps.labels(float(t), strict=True)
        sizes = np.bincount(labels)
        per = sizes // n_rep  # groups a component can hold
        if per.sum() < n_st or per.max() == 0:
            best = max(best, spread)  # the groups cannot all stay inside components
            continue
        visit = int(np.searchsorted(np.cumsum(np.sort(per)[::-1]), n_st)) + 1  # components every pipeline visits
        rtt_hops = (n_st - visit) * fast_min
        per_in = period
        if visit > 1:
            tree_trip, tree_x = _component_tree(labels, np.flatnonzero(per > 0), [trip, xsym])
            rtt_hops += float(tree_trip[: visit - 1].sum())
            per_in = max(period, float(tree_x[visit - 2]))
        rtt = compute + rtt_hops
        mean = rtt + max(0, n_mb - n_rep) * per_in / n_rep
        if work is not None and n_mb >= n_rep:  # all D pipelines active: their round trips hold the work
            rtt_sum = float(work[n_rep - 1]) + n_rep * rtt_hops
            mean = max(mean, rtt_sum / n_rep + (n_mb - n_rep) * per_in / n_rep,
                       _window_spread(n_mb, n_rep, n_st, rtt, rtt_sum, per_in))
        inside = max(phase, _window_finish(most, rtt, per_in, n_st), mean)
        best = max(best, min(spread, inside + 2.0 * sync))
    return best


def lower_bound(cluster: Cluster, workload: Workload, n_st: int, n_rep: int, cost_model: str,
                pairs: DtfmPairs | None = None, stages: list[tuple[int, int]] | None = None,
                reuse: bool = True, quick: bool = False) -> float:
    """The bound of ``cost_model`` for this split (see the module doc).

    ``reuse``: take a cached bound of a cluster this one is part of (:mod:`scheduler.bound_cache`: after a
    departure the bound is not recomputed) and cache the one computed here. ``quick``: when none is cached,
    compute the quick tier (valid, looser; cached for quick requests only), as a warm re-plan after a join does.
    """
    def compute() -> float:
        if cost_model == "dtfm":
            return dtfm_lower_bound(pairs or DtfmPairs.build(cluster, workload, n_st, n_rep), n_st, n_rep, quick)
        return full_lower_bound(cluster, workload, n_st, n_rep, stages, quick)

    if not reuse:
        return compute()
    return BOUNDS.get(cluster, workload, n_st, n_rep, cost_model, stages, compute, quick)


def gap(cost: float, bound: float) -> float:
    """Relative optimality gap (cost - bound) / cost, 0 when the bound is reached."""
    if not np.isfinite(bound) or cost <= 0:
        return 0.0 if cost <= bound else 1.0
    return max(0.0, (cost - bound) / cost)
