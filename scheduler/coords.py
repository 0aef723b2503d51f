"""Links from a sample: each peer probes k peers, the rest of the N x N matrix is estimated.

Probing every pair costs N (N - 1) probes; at a thousand peers that is a million bandwidth tests. Each peer
probes k peers instead (:func:`probe_targets`), and the leader estimates every other pair
(:func:`estimate_links`):

RTT: Vivaldi network coordinates (Dabek, Cox, Kaashoek, Morris, "Vivaldi: a decentralized network coordinate
    system", SIGCOMM 2004) with the paper's *height vectors* (a point in R^d plus a height: the access link
    every path from that peer crosses, so ``rtt(i, j) = |x_i - x_j| + h_i + h_j``) and its *adaptive
    timestep* (a sample moves node ``i`` by ``cc * e_i / (e_i + e_j)`` of the error, ``e`` being each node's
    confidence-weighted relative error). The leader holds all samples at once, so :func:`fit_vivaldi` runs
    the rounds in lockstep: every round each node moves by the mean of the forces its samples put on it
    (vectorised; a round over 10^4 samples takes milliseconds). Deterministic for a seed: the only
    randomness (the start positions, the direction that separates two nodes at the same point) comes from it.

Bandwidth: a link's bandwidth is the smaller of what the sender's uplink and the receiver's downlink carry,
    and of what the path between their sites carries. Measured links teach both:
    * *capacities*: a peer's uplink carries at least the fastest link it was measured on (up_i, down_j);
    * *sites*: two peers joined by a fast link — above the widest gap (at least 1.5x) in the measured
      bandwidths, close to both their capacities, with a short RTT — share a site (a LAN, a data centre);
      sites are the transitive closure of such links (fast links are transitive inside a LAN, slow ones are
      not);
    * *paths*: between two sites that were measured, the median of those measurements; between sites that
      were not, the lower quartile of the measured links between sites whose RTT is nearest the pair's
      estimated RTT (long paths are slower: TCP throughput falls with RTT) among those the path limited (slower
      than both ends' capacities), else unlimited. A quartile, not the median: the search picks the links the
      estimate rates highest, so with the median it picked the ones the estimate overrated; inside a site
      none of whose own links was measured, the median of the other sites' LANs.
    Between sites the estimate is ``min(path, up_i, down_j)``; inside a site it is the path's. A pair measured
    in one direction only takes the measurement of the other (paths are mostly symmetric). Estimated and
    measured RTTs are rounded to a probe's resolution (``MIN_RTT_S``): noise below it (Vivaldi's residue
    around a zero-delay LAN) would only steer the search among links that are in truth equal.

Which peers to probe: those the plan will make talk to each other — a peer's pipeline neighbours and the
    members of its replica group in the current plan, or before any plan the peers nearest it by estimated
    RTT (the scheduler puts close peers together) — plus a few at random, so the estimates keep seeing the
    whole swarm.

This module is pure (numpy and the standard library).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

# Vivaldi's constants. The paper's cc = 0.25 is per sample, applied one sample after another; in lockstep rounds a
# node moves once per round by the mean force of all its samples, so a round may correct the whole error
VIVALDI_CC = 1.0  # fraction of the error a round corrects, scaled by the relative confidence e_i / (e_i + e_j)
VIVALDI_CE = 0.25  # weight of a new sample in a node's error estimate (the paper's)
VIVALDI_DIM = 3
VIVALDI_ROUNDS = 300
RELATIVE_FIT_POWER = 0.5  # a sample weighs rtt^-p in its node's mean force (0: the paper's absolute fit)
MIN_RTT_S = 1e-4  # a probe's resolution: RTTs are rounded to it, and one below it (same host) counts as it
MIN_HEIGHT_S = 0.0

# site detection (see the module docstring)
SITE_BANDWIDTH_FRACTION = 0.8  # a site link carries at least this fraction of both ends' capacity ...
SITE_GAP_FACTOR = 1.5  # ... is above a gap of at least this factor in the measured bandwidths ...
SITE_MAX_RTT_S = 0.015  # ... over at most this RTT (a LAN or a metropolitan area)
RTT_NEIGHBOURS = 8  # measured links whose RTT is nearest an unmeasured pair's estimate its bandwidth uses
# an unmeasured path between sites takes this percentile of its RTT neighbours' bandwidths, not their median: a
# search picks the links an estimate rates highest, so an estimate that errs both ways leads it to the ones it
# overrates (docs/benchmarks/controlplane.md)
UNMEASURED_PERCENTILE = 25.0
ACCESS_LIMITED = 0.95  # a link at this fraction of one end's capacity was limited by that end, not the path


@dataclass(frozen=True)
class Sample:
    """One measured link ``src -> dst``: round-trip time (s) and bandwidth (bit/s)."""

    src: int
    dst: int
    rtt_s: float
    bandwidth_bps: float


@dataclass
class Coordinates:
    """Vivaldi coordinates of n nodes: a point, a height and an error estimate each."""

    points: np.ndarray  # (n, dim)
    heights: np.ndarray  # (n,)
    errors: np.ndarray  # (n,) relative error, 1.0 = knows nothing

    def rtt(self, i: int, j: int) -> float:
        if i == j:
            return 0.0
        return float(np.linalg.norm(self.points[i] - self.points[j]) + self.heights[i] + self.heights[j])

    def rtt_matrix(self) -> np.ndarray:
        """Estimated RTT of every pair (0 on the diagonal)."""
        diff = self.points[:, None, :] - self.points[None, :, :]
        out = np.sqrt((diff**2).sum(-1)) + self.heights[:, None] + self.heights[None, :]
        np.fill_diagonal(out, 0.0)
        return out


def _rng(seed: int | str) -> np.random.Generator:
    digest = hashlib.sha256(str(seed).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def fit_vivaldi(n: int, samples: Sequence[Sample], dim: int = VIVALDI_DIM, rounds: int = VIVALDI_ROUNDS,
                seed: int | str = 0, cc: float = VIVALDI_CC) -> Coordinates:
    """Coordinates of ``n`` nodes that fit the samples' RTTs (see the module docstring)."""
    rng = _rng(seed)
    pts = rng.normal(scale=1e-3, size=(n, dim))
    heights = np.full(n, MIN_RTT_S / 2)
    errors = np.ones(n)
    if not samples:
        return Coordinates(pts, heights, errors)
    # every measurement acts on both its ends (Vivaldi's symmetric update)
    src = np.array([s.src for s in samples] + [s.dst for s in samples], dtype=int)
    dst = np.array([s.dst for s in samples] + [s.src for s in samples], dtype=int)
    rtt = np.maximum(np.array([s.rtt_s for s in samples] * 2, dtype=float), MIN_RTT_S)
    count = np.bincount(src, minlength=n).astype(float)
    # each sample's force is weighted by rtt^-1/2: a node's mean force leans towards relative errors,
    # and its short paths (the ones a plan uses) are not drowned by its long ones
    inv = rtt ** -RELATIVE_FIT_POWER
    wsum = np.bincount(src, weights=inv, minlength=n)
    wsum[wsum <= 0] = 1.0
    has = count > 0
    count[~has] = 1.0
    if np.median(rtt) > 0:  # start at the scale of the measurements, so early rounds are not wasted growing
        pts *= float(np.median(rtt)) / 1e-3 / 4
    for _ in range(rounds):
        diff = pts[src] - pts[dst]
        norm = np.sqrt((diff**2).sum(-1))
        same = norm < 1e-9
        if same.any():  # two nodes at one point: push them apart in a random direction
            diff[same] = rng.normal(size=(int(same.sum()), dim))
            norm[same] = np.sqrt((diff[same] ** 2).sum(-1))
            diff[same] *= 1e-9 / norm[same][:, None]
            norm[same] = 1e-9
        hsum = heights[src] + heights[dst]
        dist = norm + hsum
        weight = errors[src] / (errors[src] + errors[dst])
        rel = np.abs(dist - rtt) / rtt
        force = cc * weight * (rtt - dist)  # > 0: too close, move apart
        move = np.zeros_like(pts)
        np.add.at(move, src, (inv * force / dist)[:, None] * diff)
        grow = np.bincount(src, weights=inv * force * hsum / dist, minlength=n)
        sample_err = np.bincount(src, weights=rel * VIVALDI_CE * weight, minlength=n) / count
        keep = np.bincount(src, weights=VIVALDI_CE * weight, minlength=n) / count
        pts = pts + move / wsum[:, None]
        heights = np.maximum(heights + grow / wsum, MIN_HEIGHT_S)
        errors = np.where(has, np.clip(sample_err + errors * (1 - keep), 1e-3, 1.0), errors)
    return Coordinates(pts, heights, errors)


@dataclass
class LinkEstimate:
    """An N x N estimate: one-way delay (s) and bandwidth (bit/s), which entries were measured, the sites."""

    delay_s: np.ndarray
    bandwidth_bps: np.ndarray
    measured: np.ndarray  # bool (n, n): this direction was measured
    sites: np.ndarray  # int (n,): site of each peer (see the module docstring)
    coordinates: Coordinates


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def fast_threshold(bandwidths: Sequence[float]) -> float:
    """The middle (log scale) of the widest gap between measured bandwidths when that gap is at least
    ``SITE_GAP_FACTOR``: LAN links stand apart from wide-area ones. Infinity when there is no such gap."""
    values = np.unique(np.log(np.asarray([b for b in bandwidths if b > 0], dtype=float)))
    if values.size < 2:
        return np.inf
    gaps = np.diff(values)
    widest = int(np.argmax(gaps))
    middle = (values[widest] + values[widest + 1]) / 2
    return float(np.exp(middle)) if gaps[widest] >= np.log(SITE_GAP_FACTOR) else np.inf


def find_sites(n: int, samples: Sequence[Sample], capacity: np.ndarray, hosts: Sequence[Hashable] | None = None
               ) -> np.ndarray:
    """Site of each peer: the transitive closure of fast, short links (see the module docstring); peers with
    the same ``hosts`` label (e.g. one IP address: the GPUs of one machine) share a site whatever was measured."""
    parent = list(range(n))
    if hosts is not None:
        first: dict[Hashable, int] = {}
        for i, host in enumerate(hosts[:n]):
            if host is not None and host != "":
                parent[i] = first.setdefault(host, i)
    fast = fast_threshold([s.bandwidth_bps for s in samples if s.bandwidth_bps > 0])
    for s in samples:
        if s.src == s.dst or s.bandwidth_bps <= 0 or s.rtt_s > SITE_MAX_RTT_S:
            continue
        if s.bandwidth_bps < fast:
            continue
        if s.bandwidth_bps < SITE_BANDWIDTH_FRACTION * min(capacity[s.src], capacity[s.dst]):
            continue
        a, b = _find(parent, s.src), _find(parent, s.dst)
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [_find(parent, i) for i in range(n)]
    labels = {r: k for k, r in enumerate(dict.fromkeys(roots))}
    return np.array([labels[r] for r in roots], dtype=int)


def estimate_links(n: int, samples: Sequence[Sample], seed: int | str = 0, dim: int = VIVALDI_DIM,
                   rounds: int = VIVALDI_ROUNDS, hosts: Sequence[Hashable] | None = None) -> LinkEstimate:
    """Every pair's delay and bandwidth from the measured ``samples`` (see the module docstring); ``hosts``
    optionally labels peers that share a machine (see :func:`find_sites`).

    Samples with an index outside 0..n-1, a self-link or a non-positive bandwidth are ignored; the last sample
    of a direction wins.
    """
    good = [s for s in samples if 0 <= s.src < n and 0 <= s.dst < n and s.src != s.dst and s.bandwidth_bps > 0
            and np.isfinite(s.rtt_s) and np.isfinite(s.bandwidth_bps) and s.rtt_s >= 0]
    rtt = np.full((n, n), np.nan)
    bw = np.full((n, n), np.nan)
    for s in good:
        rtt[s.src, s.dst] = max(s.rtt_s, MIN_RTT_S)  # below a probe's resolution; and the fit's floor
        bw[s.src, s.dst] = s.bandwidth_bps
    measured = ~np.isnan(bw)
    coords = fit_vivaldi(n, good, dim=dim, rounds=rounds, seed=seed)
    est_rtt = coords.rtt_matrix()
    # one direction measured: the other is the same path
    rtt = np.where(np.isnan(rtt), rtt.T, rtt)
    bw = np.where(np.isnan(bw), bw.T, bw)
    known = ~np.isnan(bw)
    np.fill_diagonal(known, False)
    capacity = np.where(known, bw, 0.0).max(axis=1)  # symmetric now: up == down
    capacity = np.where(capacity > 0, capacity, np.inf)
    sites = find_sites(n, good, capacity, hosts)
    est_bw = _path_bandwidth(n, bw, known, rtt, est_rtt, sites, capacity)
    # a capacity is the fastest link a peer was seen on: a bound for paths between sites, not inside one (a
    # peer measured only over slow paths would otherwise never look fast to its own LAN)
    cross = sites[:, None] != sites[None, :]
    est_bw = np.where(cross, np.minimum(est_bw, np.minimum(capacity[:, None], capacity[None, :])), est_bw)
    out_bw = np.where(known, bw, est_bw)
    # no more precision than a probe has: noise far below it only misleads a search among equal links
    out_rtt = np.maximum(np.round(np.where(np.isnan(rtt), est_rtt, rtt) / MIN_RTT_S), 1.0) * MIN_RTT_S
    np.fill_diagonal(out_bw, np.inf)
    np.fill_diagonal(out_rtt, 0.0)
    return LinkEstimate(out_rtt / 2.0, out_bw, measured, sites, coords)


def _path_bandwidth(n: int, bw: np.ndarray, known: np.ndarray, rtt: np.ndarray, est_rtt: np.ndarray,
                    sites: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Bandwidth of every pair's path: the median of the measured links between the two sites, else the lower
    quartile (``UNMEASURED_PERCENTILE``) of the measured links between sites with the nearest RTT that the path
    limited (slower than both ends' capacities; a link as fast as one end's capacity says nothing about the path),
    else unlimited."""
    out = np.full((n, n), np.nan)
    ii, jj = np.nonzero(known)
    if ii.size == 0:
        return np.full((n, n), np.inf)
    # site-pair medians
    n_sites = int(sites.max()) + 1
    block: dict[tuple[int, int], list[float]] = {}
    for i, j in zip(ii.tolist(), jj.tolist(), strict=True):
        a, b = int(sites[i]), int(sites[j])
        block.setdefault((min(a, b), max(a, b)), []).append(float(bw[i, j]))
    block_med = np.full((n_sites, n_sites), np.nan)
    for (a, b), values in block.items():
        block_med[a, b] = block_med[b, a] = float(np.median(values))
    # a site none of whose own links was measured: as fast as the other sites' LANs (their median)
    inside = [float(np.median(v)) for (a, b), v in block.items() if a == b]
    lan = float(np.median(inside)) if inside else np.nan
    diag = np.diag(block_med).copy()
    multi = np.bincount(sites, minlength=n_sites) > 1
    block_med[np.diag_indices(n_sites)] = np.where(np.isnan(diag) & multi, lan, diag)
    out = block_med[sites[:, None], sites[None, :]]
    # the rest: nearest measured RTTs (log scale: 10 ms vs 20 ms differs as much as 100 vs 200)
    todo = np.isnan(out)
    # a site's own links say nothing about paths between sites, nor does a link an access link limited
    pool = (sites[ii] != sites[jj]) & (bw[ii, jj] < ACCESS_LIMITED * np.minimum(capacity[ii], capacity[jj]))
    ii, jj = ii[pool], jj[pool]
    if todo.any() and ii.size == 0:
        out[todo] = np.inf
    elif todo.any():
        m_rtt = np.log(np.maximum(rtt[ii, jj], 1e-4))
        order = np.argsort(m_rtt, kind="stable")
        m_rtt, m_bw = m_rtt[order], bw[ii, jj][order]
        qi, qj = np.nonzero(todo)
        q = np.log(np.maximum(est_rtt[qi, qj], 1e-4))
        k = min(RTT_NEIGHBOURS, m_rtt.size)
        width = min(2 * k, m_rtt.size)
        # a window of 2k around the insertion point, then the k nearest of it
        lo = np.clip(np.searchsorted(m_rtt, q) - k, 0, m_rtt.size - width)
        idx = lo[:, None] + np.arange(width)[None, :]
        dist = np.abs(m_rtt[idx] - q[:, None])
        nearest = np.take_along_axis(idx, np.argsort(dist, axis=1)[:, :k], axis=1)
        out[qi, qj] = np.percentile(m_bw[nearest], UNMEASURED_PERCENTILE, axis=1)
    return out


# ---- which peers to probe -------------------------------------------------------------------------------


def plan_neighbours(pipelines: Sequence[Sequence[Hashable]], me: Hashable) -> list[Hashable]:
    """The peers ``me`` exchanges data with in a plan: its pipeline neighbours first, then its replica group."""
    out: list[Hashable] = []
    for row in pipelines:
        for s, dev in enumerate(row):
            if dev != me:
                continue
            out += [row[t] for t in (s - 1, s + 1) if 0 <= t < len(row)]
            out += [other[s] for other in pipelines if other is not row and s < len(other)]
    return list(dict.fromkeys(out))


def probe_targets(me: Hashable, peers: Sequence[Hashable], k: int, *, pipelines: Sequence[Sequence[Hashable]]
                  | None = None, nearest: Sequence[Hashable] = (), exclude: set | frozenset = frozenset(),
                  n_random: int = 2, seed: int | str = 0) -> list[Hashable]:
    """Up to ``k + n_random`` peers for ``me`` to probe, most relevant first; deterministic for a seed.

    Relevance: ``me``'s neighbours in ``pipelines`` (the current or likely plan), then ``nearest`` (e.g.
    the peers closest to ``me`` by estimated RTT, which a plan tends to group), up to ``k`` of them; then
    ``n_random`` others at random. Peers in ``exclude`` (already measured) and ``me`` are never chosen.
    """
    live = set(peers)
    skip = set(exclude) | {me}
    chosen: list[Hashable] = []
    relevant = plan_neighbours(pipelines, me) if pipelines else []
    for p in list(relevant) + list(nearest):
        if len(chosen) >= k:
            break
        if p in live and p not in skip and p not in chosen:
            chosen.append(p)
    rest = sorted((p for p in live if p not in skip and p not in chosen), key=str)
    rng = random.Random(f"{seed}|{me}")
    chosen += rng.sample(rest, min(len(rest), max(0, k - len(chosen)) + n_random))
    return chosen


def nearest_peers(coords: Coordinates, me: int, count: int) -> list[int]:
    """The ``count`` peers nearest ``me`` by estimated RTT (ties by index)."""
    rtt = np.linalg.norm(coords.points - coords.points[me], axis=1) + coords.heights
    rtt[me] = np.inf
    return [int(i) for i in np.argsort(rtt, kind="stable")[:count]]
