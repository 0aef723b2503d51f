"""Our placement search: clustered seeds, incremental swap local search, exact re-piping, kicks.

The state is a flat array ``x``: positions ``r * S + s`` (``r < D``) hold the device of stage ``s`` of
pipeline ``r``; positions past ``S * D`` hold idle spare devices. A move swaps the devices of two positions
(two slots: a re-partition or a re-matching; a slot and a spare: bringing a spare in). Why this works well:

* Incremental evaluation: a swap touches at most two data-parallel groups and four hops, so the ``dtfm``
  objective is updated from a few cached rows (O(D^2) numpy work) instead of recomputed.
* Critical moves: the objective is a max of maxes, so only moving a device that attains a max can lower it;
  most trials move such a device.
* Plateaus: ties on the primary cost are broken by a smooth secondary cost (the mean instead of the max of
  every term), which gives the search a gradient where every layout costs the same under the max (the
  paper's ``datacenter_spot``).
* At each local optimum, the pipeline through the current groups is made exactly optimal (bottleneck
  matchings + open-path TSP, the paper's inner problem), then the best layout is kicked with random swaps
  (iterated local search) and every few kicks the search restarts from another seed.

Deterministic for a given seed as long as the evaluation budget, not the time limit, ends the search.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .cost_dtfm import DtfmPairs, dp_rows, hop_rows
from .layout import best_pipelines

log = logging.getLogger(__name__)

EPS = 1e-12
MEMORY_PENALTY = 1e6


@dataclass
class SearchConfig:
    """Knobs of the search; the defaults plan 64 devices in a few seconds."""

    seed: int = 0
    time_limit_s: float | None = None
    max_evaluations: int = 40_000
    stall_per_position: float = 3.0  # non-improving trials (x positions) before a local optimum is declared
    kick_swaps: int = 3
    restart_every: int = 4  # kicks between restarts from a fresh seed
    critical_prob: float = 0.7


@dataclass
class SearchResult:
    matrix: np.ndarray
    spares: np.ndarray
    total: float
    evaluations: int
    seconds: float
    start: str
    trace: list[tuple[int, float]] = field(default_factory=list)


SOFT_POWER = 4.0


def _power_mean(rows: np.ndarray) -> np.ndarray:
    """Row-wise power mean (p = 4) of non-negative costs: between the mean and the max.

    Unlike the mean it rewards concentrating cheap entries in the same row (a hop whose pipelines are all
    fast is worth more than two half-fast hops), which is what lowers the max terms eventually.
    """
    mx = rows.max(axis=1)
    safe = np.where(mx > 0, mx, 1.0)
    return mx * (((rows / safe[:, None]) ** SOFT_POWER).mean(axis=1)) ** (1.0 / SOFT_POWER)


class DtfmObjective:
    """Incremental ``dtfm`` cost (+ memory penalty) of the flat layout ``x``; soft = mean-of-terms cost."""

    def __init__(self, pairs: DtfmPairs, stages: int, replicas: int, mem_bad: np.ndarray | None = None
                 ) -> None:
        self.pairs, self.n_st, self.n_rep = pairs, stages, replicas
        self.n_slots = stages * replicas
        self.mem_bad = mem_bad  # (N, S) True where device cannot hold stage

    def reset(self, x: np.ndarray) -> None:
        self.x = x.copy()
        m = self.x[: self.n_slots].reshape(self.n_rep, self.n_st)
        self.dps = dp_rows(self.pairs, m)
        self.hop = hop_rows(self.pairs, m) if self.n_st > 1 else np.zeros((0, self.n_rep))
        self.pen = self._penalty(m)
        self.total, self.soft = self._score(self.dps, self.hop, self.pen)

    def _penalty(self, m: np.ndarray) -> float:
        if self.mem_bad is None:
            return 0.0
        return float(self.mem_bad[m, np.arange(self.n_st)[None, :]].sum()) * MEMORY_PENALTY

    def _score(self, dps: np.ndarray, hop: np.ndarray, pen: float) -> tuple[float, float]:
        dp = float(dps.max()) if self.n_rep > 1 else 0.0
        pp = float(hop.max(axis=1).sum()) if self.n_st > 1 else 0.0
        soft = (_power_mean(dps.reshape(1, -1)).sum() if self.n_rep > 1 else 0.0) + 2.0 * (
            _power_mean(hop).sum() if self.n_st > 1 else 0.0)
        return dp + 2.0 * pp + pen, float(soft)

    def trial(self, p: int, q: int) -> tuple[float, float]:
        x2 = self.x.copy()
        x2[p], x2[q] = x2[q], x2[p]
        m2 = x2[: self.n_slots].reshape(self.n_rep, self.n_st)
        n_st = self.n_st
        st, hops = set(), set()
        for pos in (p, q):
            if pos < self.n_slots:
                s = pos % n_st
                st.add(s)
                if s > 0:
                    hops.add(s - 1)
                if s < n_st - 1:
                    hops.add(s)
        if p < self.n_slots and q < self.n_slots and p % n_st == q % n_st:
            st.clear()  # same group, only the matching changed
        dps, hop = self.dps, self.hop
        if st:
            dps = dps.copy()
            dp = self.pairs.dp
            for s in st:
                g = m2[:, s]
                dps[s] = dp[g[:, None], g[None, :]].sum(axis=1)
        if hops:
            hop = hop.copy()
            pp = self.pairs.pp
            for h in hops:
                hop[h] = pp[m2[:, h], m2[:, h + 1]]
        pen = self._penalty(m2) if self.mem_bad is not None else 0.0
        self._pending = (x2, dps, hop, pen)
        return self._score(dps, hop, pen)

    def commit(self) -> None:
        self.x, self.dps, self.hop, self.pen = self._pending
        self.total, self.soft = self._score(self.dps, self.hop, self.pen)

    def critical(self, rng: np.random.Generator) -> int:
        """A position whose device attains a max term (ties broken at random)."""
        n_st, n_rep = self.n_st, self.n_rep
        if n_st > 1 and (n_rep == 1 or rng.random() < 0.5):
            hmax = self.hop.max(axis=1)
            h = int(rng.integers(n_st - 1))
            rs = np.flatnonzero(self.hop[h] >= hmax[h] - EPS)
            r = int(rng.choice(rs))
            return r * n_st + h + int(rng.integers(2))
        if n_rep > 1:
            dmax = self.dps.max(axis=1)
            ss = np.flatnonzero(dmax >= dmax.max() - EPS)
            s = int(rng.choice(ss))
            rs = np.flatnonzero(self.dps[s] >= dmax[s] - EPS)
            return int(rng.choice(rs)) * n_st + s
        return int(rng.integers(self.n_slots))

    def polish(self) -> None:
        """Replace the pipelines through the current groups by the optimal ones (DP is unchanged)."""
        if self.n_st < 2:
            return
        m = self.x[: self.n_slots].reshape(self.n_rep, self.n_st)
        _, m2 = best_pipelines(self.pairs.pp, [m[:, s] for s in range(self.n_st)])
        x2 = self.x.copy()
        x2[: self.n_slots] = m2.reshape(-1)
        old = (self.total, self.soft, self.x)
        self.reset(x2)
        if self.total > old[0] + EPS:
            self.reset(old[2])


class CallableObjective:
    """Any cost ``f(matrix) -> float`` (the ``full`` model), re-evaluated from scratch on every trial."""

    def __init__(self, f: Callable[[np.ndarray], float], stages: int, replicas: int,
                 mem_bad: np.ndarray | None = None) -> None:
        self.f, self.n_st, self.n_rep, self.n_slots = f, stages, replicas, stages * replicas
        self.mem_bad = mem_bad

    def _eval(self, x: np.ndarray) -> float:
        m = x[: self.n_slots].reshape(self.n_rep, self.n_st)
        pen = 0.0
        if self.mem_bad is not None:
            pen = float(self.mem_bad[m, np.arange(self.n_st)[None, :]].sum()) * MEMORY_PENALTY
        return self.f(m) + pen

    def reset(self, x: np.ndarray) -> None:
        self.x = x.copy()
        self.total, self.soft = self._eval(self.x), 0.0

    def trial(self, p: int, q: int) -> tuple[float, float]:
        x2 = self.x.copy()
        x2[p], x2[q] = x2[q], x2[p]
        self._pending = x2
        return self._eval(x2), 0.0

    def commit(self) -> None:
        self.x = self._pending
        self.total = self._eval(self.x)

    def critical(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.n_slots))

    def polish(self) -> None:
        return None


Objective = DtfmObjective | CallableObjective


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[0] - EPS * max(1.0, abs(b[0])) or (a[0] <= b[0] + EPS * max(1.0, abs(b[0]))
                                                        and a[1] < b[1] - EPS * max(1.0, abs(b[1])))


def run_search(obj: Objective, starts: list[tuple[str, np.ndarray]], n_devices: int, cfg: SearchConfig
               ) -> SearchResult:
    """Iterated local search over the flat layout; ``starts`` are (name, plan matrix) seeds."""
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    deadline = None if cfg.time_limit_s is None else t0 + cfg.time_limit_s
    n_st, n_rep, n_slots = obj.n_st, obj.n_rep, obj.n_slots
    n_pos = n_devices

    def flat(m: np.ndarray) -> np.ndarray:
        used = set(m.reshape(-1).tolist())
        spares = [d for d in range(n_devices) if d not in used]
        return np.concatenate([m.reshape(-1), np.asarray(spares, dtype=int)]).astype(int)

    # Evaluate every seed and start from the best.
    scored = []
    for name, m in starts:
        x = flat(m)
        obj.reset(x)
        obj.polish()
        scored.append(((obj.total, obj.soft), name, obj.x.copy()))
    scored.sort(key=lambda t: t[0])
    best_key, best_name, best_x = scored[0]
    evals = len(starts)
    trace = [(evals, best_key[0])]
    obj.reset(best_x)
    stall_limit = max(50, int(cfg.stall_per_position * n_pos))
    stall, kicks, next_start = 0, 0, 1
    while evals < cfg.max_evaluations:
        if deadline is not None and (evals & 63) == 0 and time.perf_counter() > deadline:
            break
        p = obj.critical(rng) if rng.random() < cfg.critical_prob else int(rng.integers(n_slots))
        q = int(rng.integers(n_pos - 1))
        q += q >= p
        evals += 1
        cand = obj.trial(p, q)
        if _better(cand, (obj.total, obj.soft)):
            obj.commit()
            stall = 0
            if _better((obj.total, obj.soft), best_key):
                best_key, best_x = (obj.total, obj.soft), obj.x.copy()
                trace.append((evals, obj.total))
            continue
        stall += 1
        if stall < stall_limit:
            continue
        # Local optimum: make the pipeline through these groups optimal, then kick or restart.
        obj.polish()
        if _better((obj.total, obj.soft), best_key):
            best_key, best_x = (obj.total, obj.soft), obj.x.copy()
            trace.append((evals, obj.total))
        kicks += 1
        stall = 0
        if cfg.restart_every and kicks % cfg.restart_every == 0:
            if next_start < len(scored):
                x = scored[next_start][2].copy()
                next_start += 1
            else:
                x = rng.permutation(n_devices)
                x = flat(x[:n_slots].reshape(n_rep, n_st))
        else:
            x = best_x.copy()
        for _ in range(cfg.kick_swaps):
            a, b = rng.choice(n_pos, size=2, replace=False)
            x[a], x[b] = x[b], x[a]
        obj.reset(x)
    obj.reset(best_x)
    obj.polish()
    if _better((obj.total, obj.soft), best_key):
        best_x = obj.x.copy()
    obj.reset(best_x)
    secs = time.perf_counter() - t0
    log.info("search: %d evaluations in %.2fs, best %.4f (start %s)", evals, secs, obj.total, best_name)
    return SearchResult(matrix=best_x[:n_slots].reshape(n_rep, n_st).copy(), spares=best_x[n_slots:].copy(),
                        total=obj.total, evaluations=evals, seconds=secs, start=best_name, trace=trace)
