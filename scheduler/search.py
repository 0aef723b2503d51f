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
    cpu_clock: bool = False  # time_limit_s counts this process's CPU seconds instead of wall seconds


@dataclass
class SearchResult:
    matrix: np.ndarray
    spares: np.ndarray
    total: float
    evaluations: int
    seconds: float
    start: str
    trace: list[tuple[int, float]] = field(default_factory=list)
    generations: int = 0  # memetic search only
    found_s: float = 0.0  # CPU seconds into the search when the best layout was found (memetic search only)
    stopped_by: str = ""  # the rule that ended the search: gap, time, evaluations, generations, stalled, converged
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (seconds of its clock, best) (memetic)


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
    """Incremental ``dtfm`` cost (+ per-slot penalties) of the flat layout ``x``; soft = power-mean cost.

    ``slot_cost[d, s]`` is added for every tasklet of stage ``s`` on device ``d``: the memory penalty where ``d``
    cannot hold ``s``, and in a re-plan the time to bring stage ``s``'s state to ``d``. A swap changes at most
    one member of two groups and four hop entries, so a trial updates O(D) numbers: a group's row sums by the
    difference of the leaving and arriving device's entries, and each changed row's max and sum of 4th powers
    (the soft cost is ``(mean x^4)^(1/4)`` of the DP entries plus twice that of every hop row).
    """

    def __init__(self, pairs: DtfmPairs, stages: int, replicas: int, mem_bad: np.ndarray | None = None,
                 slot_cost: np.ndarray | None = None) -> None:
        self.pairs, self.n_st, self.n_rep = pairs, stages, replicas
        self.n_slots = stages * replicas
        self.mem_bad = mem_bad  # (N, S) True where device cannot hold stage
        cost = None if mem_bad is None else mem_bad.astype(float) * MEMORY_PENALTY
        if slot_cost is not None:
            cost = slot_cost if cost is None else cost + slot_cost
        self.slot_cost = cost

    def reset(self, x: np.ndarray) -> None:
        self.x = np.asarray(x, dtype=int).copy()
        m = self.x[: self.n_slots].reshape(self.n_rep, self.n_st)
        self.dps = dp_rows(self.pairs, m)
        self.hop = hop_rows(self.pairs, m) if self.n_st > 1 else np.zeros((0, self.n_rep))
        self.dmax, self.d4 = self.dps.max(axis=1), (self.dps ** SOFT_POWER).sum(axis=1)
        self.hmax = self.hop.max(axis=1) if self.n_st > 1 else np.zeros(0)
        self.h4 = (self.hop ** SOFT_POWER).sum(axis=1)
        self.pen = self._penalty(m)
        self.total, self.soft = self._score(self.dmax, self.d4, self.hmax, self.h4, self.pen)

    def _penalty(self, m: np.ndarray) -> float:
        if self.slot_cost is None:
            return 0.0
        return float(self.slot_cost[m, np.arange(self.n_st)[None, :]].sum())

    def _score(self, dmax: np.ndarray, d4: np.ndarray, hmax: np.ndarray, h4: np.ndarray, pen: float
               ) -> tuple[float, float]:
        if self.n_rep > 1:
            dp, soft = float(dmax.max()), float((d4.sum() / self.n_slots) ** (1.0 / SOFT_POWER))
        else:
            dp, soft = 0.0, 0.0
        if self.n_st > 1:
            pp = float(hmax.sum())
            soft += 2.0 * float(((h4 / self.n_rep) ** (1.0 / SOFT_POWER)).sum())
        else:
            pp = 0.0
        return dp + 2.0 * pp + pen, soft

    def trial(self, p: int, q: int) -> tuple[float, float]:
        x, n_st, ns = self.x, self.n_st, self.n_slots
        dev_p, dev_q = int(x[q]), int(x[p])  # devices at p and q after the swap

        def at(pos: int) -> int:
            return dev_p if pos == p else dev_q if pos == q else int(x[pos])

        dp, pp = self.pairs.dp, self.pairs.pp
        d_rows: dict[int, np.ndarray] = {}
        h_rows: dict[int, np.ndarray] = {}
        same_group = p < ns and q < ns and p % n_st == q % n_st
        if same_group and self.n_rep > 1:  # same members, only their pipelines (row positions) swap
            row = self.dps[p % n_st].copy()
            row[p // n_st], row[q // n_st] = row[q // n_st], row[p // n_st]
            d_rows[p % n_st] = row
        pen = self.pen
        for pos, old, new in ((p, dev_q, dev_p), (q, dev_p, dev_q)):
            if pos >= ns:
                continue
            s, r = pos % n_st, pos // n_st
            if self.slot_cost is not None:
                pen += self.slot_cost[new, s] - self.slot_cost[old, s]
            if not same_group and self.n_rep > 1:
                g = x[s:ns:n_st].copy()
                g[r] = new
                row = self.dps[s] - dp[g, old] + dp[g, new]
                row[r] = dp[new, g].sum()
                d_rows[s] = row
            for h in (s - 1, s):
                if 0 <= h < n_st - 1:
                    row = h_rows.get(h)
                    if row is None:
                        row = h_rows[h] = self.hop[h].copy()
                    row[r] = pp[at(r * n_st + h), at(r * n_st + h + 1)]
        dmax, d4, hmax, h4 = self.dmax, self.d4, self.hmax, self.h4
        if d_rows:
            dmax, d4 = dmax.copy(), d4.copy()
            for s, row in d_rows.items():
                dmax[s], d4[s] = row.max(), (row ** SOFT_POWER).sum()
        if h_rows:
            hmax, h4 = hmax.copy(), h4.copy()
            for h, row in h_rows.items():
                hmax[h], h4[h] = row.max(), (row ** SOFT_POWER).sum()
        self._pending = (p, q, d_rows, h_rows, dmax, d4, hmax, h4, pen)
        return self._score(dmax, d4, hmax, h4, pen)

    def commit(self) -> None:
        p, q, d_rows, h_rows, self.dmax, self.d4, self.hmax, self.h4, self.pen = self._pending
        self.x[p], self.x[q] = self.x[q], self.x[p]
        for s, row in d_rows.items():
            self.dps[s] = row
        for h, row in h_rows.items():
            self.hop[h] = row
        self.total, self.soft = self._score(self.dmax, self.d4, self.hmax, self.h4, self.pen)

    def critical(self, rng: np.random.Generator) -> int:
        """A position whose device attains a max term (ties broken at random)."""
        n_st, n_rep = self.n_st, self.n_rep
        if n_st > 1 and (n_rep == 1 or rng.random() < 0.5):
            h = int(rng.integers(n_st - 1))
            rs = np.flatnonzero(self.hop[h] >= self.hmax[h] - EPS)
            r = int(rs[rng.integers(len(rs))])
            return r * n_st + h + int(rng.integers(2))
        if n_rep > 1:
            ss = np.flatnonzero(self.dmax >= self.dmax.max() - EPS)
            s = int(ss[rng.integers(len(ss))])
            rs = np.flatnonzero(self.dps[s] >= self.dmax[s] - EPS)
            return int(rs[rng.integers(len(rs))]) * n_st + s
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
    """Any cost ``f(matrix) -> float`` (the ``full`` model), re-evaluated from scratch on every trial.

    ``slot_cost[d, s]`` is added per tasklet as in :class:`DtfmObjective` (memory penalty, moves).
    """

    def __init__(self, f: Callable[[np.ndarray], float], stages: int, replicas: int,
                 mem_bad: np.ndarray | None = None, slot_cost: np.ndarray | None = None) -> None:
        self.f, self.n_st, self.n_rep, self.n_slots = f, stages, replicas, stages * replicas
        self.mem_bad = mem_bad
        cost = None if mem_bad is None else mem_bad.astype(float) * MEMORY_PENALTY
        if slot_cost is not None:
            cost = slot_cost if cost is None else cost + slot_cost
        self.slot_cost = cost

    def _eval(self, x: np.ndarray) -> float:
        m = x[: self.n_slots].reshape(self.n_rep, self.n_st)
        pen = 0.0
        if self.slot_cost is not None:
            pen = float(self.slot_cost[m, np.arange(self.n_st)[None, :]].sum())
        return self.f(m) + pen

    def reset(self, x: np.ndarray) -> None:
        self.x = x.copy()
        self.total, self.soft = self._eval(self.x), 0.0

    def trial(self, p: int, q: int) -> tuple[float, float]:
        x2 = self.x.copy()
        x2[p], x2[q] = x2[q], x2[p]
        self._pending = (x2, self._eval(x2))
        return self._pending[1], 0.0

    def commit(self) -> None:
        self.x, self.total = self._pending

    def critical(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.n_slots))

    def polish(self) -> None:
        return None


Objective = DtfmObjective | CallableObjective


def better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic (cost, soft cost) comparison with a relative tolerance."""
    return a[0] < b[0] - EPS * max(1.0, abs(b[0])) or (a[0] <= b[0] + EPS * max(1.0, abs(b[0]))
                                                        and a[1] < b[1] - EPS * max(1.0, abs(b[1])))


def run_search(obj: Objective, starts: list[tuple[str, np.ndarray]], n_devices: int, cfg: SearchConfig
               ) -> SearchResult:
    """Iterated local search over the flat layout; ``starts`` are (name, plan matrix) seeds."""
    rng = np.random.default_rng(cfg.seed)
    clock = time.process_time if cfg.cpu_clock else time.perf_counter
    t0 = clock()
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
    stopped_by = "evaluations"
    while evals < cfg.max_evaluations:
        if deadline is not None and (evals & 63) == 0 and clock() > deadline:
            stopped_by = "time"
            break
        p = obj.critical(rng) if rng.random() < cfg.critical_prob else int(rng.integers(n_slots))
        q = int(rng.integers(n_pos - 1))
        q += q >= p
        evals += 1
        cand = obj.trial(p, q)
        if better(cand, (obj.total, obj.soft)):
            obj.commit()
            stall = 0
            if better((obj.total, obj.soft), best_key):
                best_key, best_x = (obj.total, obj.soft), obj.x.copy()
                trace.append((evals, obj.total))
            continue
        stall += 1
        if stall < stall_limit:
            continue
        # Local optimum: make the pipeline through these groups optimal, then kick or restart.
        obj.polish()
        if better((obj.total, obj.soft), best_key):
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
    if better((obj.total, obj.soft), best_key):
        best_x = obj.x.copy()
    obj.reset(best_x)
    secs = clock() - t0
    log.info("search: %d evaluations in %.2fs, best %.4f (start %s)", evals, secs, obj.total, best_name)
    return SearchResult(matrix=best_x[:n_slots].reshape(n_rep, n_st).copy(), spares=best_x[n_slots:].copy(),
                        total=obj.total, evaluations=evals, seconds=secs, start=best_name, trace=trace,
                        stopped_by=stopped_by)
