"""The default search: a memetic (evolutionary) algorithm over layouts, with our swap search as its local step.

Why a population: a single iterated local search falls into one basin and which one depends on the order of
the device ids (up to 3 % apart on heterogeneous scenarios). Here a small population of local optima is kept
*diverse* (a child too close to a member may only replace that member, never the worst one), and children are
built from the parts that make a layout good:

* group crossover: the cheapest data-parallel groups of both parents (by their worst row sum) are taken
  greedily, conflicts dropped, holes filled with the free device closest to the group; the pipelines through
  the groups are then rebuilt (exactly with the paper's inner problem for small groups, hop by hop otherwise);
* pipeline crossover: the cheapest pipelines of both parents (by their summed hop cost) are taken greedily,
  the rest completed from the first parent's pipelines with free devices closest to their neighbours.

Every child is improved by the incremental swap search of :mod:`search` (critical moves, soft tie-breaker,
exact re-piping at the local optimum) before it competes. After ``restart_after`` generations without a new
best the worse half of the population is replaced by heavily kicked, re-improved copies of the best.

Anytime: the best layout so far is kept at every step, and the search stops at the generation limit, the
evaluation budget, the time limit, after ``stop_after`` generations without a new best, or as soon as the best
cost is within ``gap`` of the lower bound (``(cost - bound) / cost <= gap``: proven near-optimal); which rule
ended it is ``SearchResult.stopped_by``. Deterministic for a seed whenever the time limit does not end it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from .layout import best_pipelines
from .search import EPS, DtfmObjective, Objective, SearchResult, better
from .seeding import sorted_seeds
from .sweep import trial_some

log = logging.getLogger(__name__)

EXACT_PIPES_MAX_REPLICAS = 32  # above: consecutive groups matched by one assignment each instead


@dataclass
class MemeticConfig:
    """Knobs; the defaults plan 64 devices in well under 2 s of one core."""

    seed: int = 0
    time_limit_s: float | None = None
    generations: int = 60
    stop_after: int = 25  # generations without a new best that end the search (0: never)
    max_evaluations: int = 5_000_000
    population: int = 6  # halved above 256 slots, where a local search costs seconds
    stall_per_position: float = 1.5  # non-improving swaps (x devices) that end a swap local search
    sweep_stall_frac: float = 0.25  # non-improving sweeps (x slots) that end a sweep local search (dtfm)
    sweep_stall_max: int = 32  # ... but at most this many: large scenarios gain more from kicks than from waiting
    sweep_candidates: int = 128  # partners tried per sweep: all when N - 1 is at most this, else a random sample
    child_kicks: int = 1  # kicked re-descents of each child (iterated local search inside the improvement)
    kick_swaps: int = 3
    restart_after: int = 12  # generations without a new best before the worse half is re-seeded
    min_distance_frac: float = 0.08  # children closer than this (devices on another stage) to a member are twins
    cpu_clock: bool = False  # time_limit_s counts this process's CPU seconds instead of wall seconds
    gap: float = 0.0  # stop once the best layout is proven within this fraction of optimal by the lower bound
    cold_seeds: bool = True  # add the sorted-device seeds to the given starts (a warm re-plan does not)


def _stage_labels(x: np.ndarray, n_slots: int, n_st: int, n_devices: int) -> np.ndarray:
    lab = np.full(n_devices, -1, dtype=int)
    lab[x[:n_slots]] = np.arange(n_slots) % n_st
    return lab


class Memetic:
    """One run of the memetic search over an objective of :mod:`search` (see the module doc)."""

    def __init__(self, obj: Objective, n_devices: int, group_cost: np.ndarray, hop_cost: np.ndarray,
                 cfg: MemeticConfig, lower_bound: float = 0.0) -> None:
        self.obj, self.n, self.cfg = obj, n_devices, cfg
        self.n_st, self.n_rep, self.n_slots = obj.n_st, obj.n_rep, obj.n_slots
        self.gcost, self.hcost = group_cost, hop_cost
        self.bound = lower_bound
        self.rng = np.random.default_rng(cfg.seed)
        self.evals = 0
        self.stall_limit = max(40, int(cfg.stall_per_position * n_devices))
        self.min_dist = max(2, int(cfg.min_distance_frac * self.n_slots))
        self.size = cfg.population if self.n_slots <= 256 else max(2, cfg.population // 2)
        self.best_key: tuple[float, float] = (float("inf"), float("inf"))
        self.best_x: np.ndarray | None = None
        self.found_s = 0.0
        self.trace: list[tuple[int, float]] = []
        self.timeline: list[tuple[float, float]] = []
        self.clock = time.process_time if cfg.cpu_clock else time.perf_counter
        self.t0 = self.clock()
        self.cpu0 = time.process_time()
        self.stopped_by = ""

    # ----------------------------------------------------------------- helpers
    def flat(self, m: np.ndarray) -> np.ndarray:
        used = np.zeros(self.n, dtype=bool)
        used[m.reshape(-1)] = True
        return np.concatenate([m.reshape(-1), np.flatnonzero(~used)]).astype(int)

    def done(self) -> bool:
        """Whether a stopping rule holds; the first that does is recorded in ``stopped_by``."""
        if self.stopped_by:
            return True
        if self.best_key[0] * (1.0 - self.cfg.gap) <= self.bound * (1.0 + 1e-9):
            self.stopped_by = "gap"  # (cost - bound) / cost <= gap: the plan is proven near-optimal
        elif self.evals >= self.cfg.max_evaluations:
            self.stopped_by = "evaluations"
        elif self.cfg.time_limit_s is not None and self.clock() - self.t0 > self.cfg.time_limit_s:
            self.stopped_by = "time"
        return bool(self.stopped_by)

    def _note(self) -> None:
        key = (self.obj.total, self.obj.soft)
        if self.best_x is None or better(key, self.best_key):
            self.best_key, self.best_x = key, self.obj.x.copy()
            self.trace.append((self.evals, key[0]))
            self.timeline.append((self.clock() - self.t0, key[0]))
            self.found_s = time.process_time() - self.cpu0

    # ------------------------------------------------------------ local search
    def descend(self, x: np.ndarray) -> None:
        """Local search to a local optimum, then exact re-piping; the result is left in ``obj``."""
        if self.n < 2:  # one device: nothing to swap
            self.obj.reset(x)
            self.evals += 1
        elif isinstance(self.obj, DtfmObjective):
            self._descend_sweeps(x)
        else:
            self._descend_swaps(x)
        self.obj.polish()
        self._note()

    def _descend_sweeps(self, x: np.ndarray) -> None:
        """Best-improvement moves: a slot (usually one attaining a max term) goes to its best partner."""
        obj, rng = self.obj, self.rng
        assert isinstance(obj, DtfmObjective)
        obj.reset(x)
        stall = 0
        limit = max(8, min(self.cfg.sweep_stall_max, int(self.cfg.sweep_stall_frac * self.n_slots)))
        while stall < limit and not self.done():
            p = obj.critical(rng) if rng.random() < 0.7 else int(rng.integers(self.n_slots))
            if self.n - 1 > self.cfg.sweep_candidates:
                cand = rng.choice(self.n - 1, size=self.cfg.sweep_candidates, replace=False)
                cand += cand >= p
            else:
                cand = np.delete(np.arange(self.n), p)
            totals, softs = trial_some(obj, p, cand)
            self.evals += len(cand)
            lo = totals.min()
            tied = np.flatnonzero(totals <= lo + EPS * max(1.0, abs(lo)))
            i = int(tied[np.argmin(softs[tied])])
            q = int(cand[i])
            if better((float(totals[i]), float(softs[i])), (obj.total, obj.soft)):
                obj.trial(p, q)
                obj.commit()
                stall = 0
            else:
                stall += 1

    def _descend_swaps(self, x: np.ndarray) -> None:
        """Random swaps (any objective) until ``stall_limit`` trials in a row fail."""
        obj, rng = self.obj, self.rng
        obj.reset(x)
        stall = 0
        n_pos, n_slots = self.n, self.n_slots
        while stall < self.stall_limit:
            if (self.evals & 15) == 0 and self.done():
                break
            p = obj.critical(rng) if rng.random() < 0.7 else int(rng.integers(n_slots))
            q = int(rng.integers(n_pos - 1))
            q += q >= p
            self.evals += 1
            if better(obj.trial(p, q), (obj.total, obj.soft)):
                obj.commit()
                stall = 0
            else:
                stall += 1

    def improve(self, x: np.ndarray) -> tuple[tuple[float, float], np.ndarray]:
        self.descend(x)
        key, bx = (self.obj.total, self.obj.soft), self.obj.x.copy()
        for _ in range(self.cfg.child_kicks):
            if self.done():
                break
            y = self.kick(bx, self.cfg.kick_swaps)
            self.descend(y)
            if better((self.obj.total, self.obj.soft), key):
                key, bx = (self.obj.total, self.obj.soft), self.obj.x.copy()
        return key, bx

    def kick(self, x: np.ndarray, swaps: int) -> np.ndarray:
        y = x.copy()
        if self.n < 2:
            return y
        for _ in range(swaps):
            a = int(self.rng.integers(self.n_slots))
            b = int(self.rng.integers(self.n - 1))
            b += b >= a
            y[a], y[b] = y[b], y[a]
        return y

    # --------------------------------------------------------------- crossover
    def _group_quality(self, g: np.ndarray) -> float:
        return float(self.gcost[np.ix_(g, g)].sum(axis=1).max())

    def _repipe(self, groups: list[np.ndarray]) -> np.ndarray:
        """Pipelines through the groups: exact for small groups, else consecutive groups matched by sum."""
        if self.n_st == 1:
            return np.asarray(groups[0], dtype=int).reshape(self.n_rep, 1)
        if self.n_rep <= EXACT_PIPES_MAX_REPLICAS:
            return best_pipelines(self.hcost, groups)[1]
        m = np.empty((self.n_rep, self.n_st), dtype=int)
        m[:, 0] = groups[0]
        for s in range(1, self.n_st):
            _, cols = linear_sum_assignment(self.hcost[np.ix_(m[:, s - 1], groups[s])])
            m[:, s] = np.asarray(groups[s])[cols]
        return m

    def group_crossover(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        n_st, n_rep = self.n_st, self.n_rep
        cands = []
        for par in (a, b):
            m = par[: self.n_slots].reshape(n_rep, n_st)
            for s in range(n_st):
                g = m[:, s]
                cands.append((self._group_quality(g) * self.rng.uniform(0.95, 1.05), s, g))
        cands.sort(key=lambda t: t[0])
        used = np.zeros(self.n, dtype=bool)
        chosen: list[tuple[int, list[int]]] = []
        taken_stage = set()
        for need_half in (True, False):
            for _, s, g in cands:
                if len(chosen) == n_st:
                    break
                free = [int(d) for d in g if not used[d]]
                if s in taken_stage or not free or (need_half and 2 * len(free) < n_rep):
                    continue
                chosen.append((s, free))
                taken_stage.add(s)
                used[free] = True
        for s in range(n_st):  # stages no candidate could fill start empty
            if s not in taken_stage:
                chosen.append((s, []))
        chosen.sort()
        groups = []
        for _, members in chosen:
            while len(members) < n_rep:
                pool = np.flatnonzero(~used)
                if members:
                    d = int(pool[self.gcost[np.ix_(pool, members)].sum(axis=1).argmin()])
                else:
                    d = int(self.rng.choice(pool))
                members.append(d)
                used[d] = True
            groups.append(np.asarray(members, dtype=int))
        return self.flat(self._repipe(groups))

    def pipeline_crossover(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        n_st, n_rep = self.n_st, self.n_rep
        ma, mb = a[: self.n_slots].reshape(n_rep, n_st), b[: self.n_slots].reshape(n_rep, n_st)
        rows = []
        for m in (ma, mb):
            for r in range(n_rep):
                q = float(self.hcost[m[r, :-1], m[r, 1:]].sum()) if n_st > 1 else 0.0
                rows.append((q * self.rng.uniform(0.95, 1.05), m[r]))
        rows.sort(key=lambda t: t[0])
        used = np.zeros(self.n, dtype=bool)
        out: list[np.ndarray] = []
        for _, row in rows:
            if len(out) == n_rep:
                break
            if not used[row].any():
                out.append(row.copy())
                used[row] = True
        for r in range(n_rep):
            if len(out) == n_rep:
                break
            row = ma[r].copy()
            if used[row].all():
                continue
            for s in range(n_st):
                if used[row[s]]:
                    pool = np.flatnonzero(~used)
                    pool = pool[~np.isin(pool, row)]
                    nb = [row[t] for t in (s - 1, s + 1) if 0 <= t < n_st and not used[row[t]]]
                    cost = self.hcost[np.ix_(pool, nb)].sum(axis=1) if nb else self.rng.random(len(pool))
                    row[s] = int(pool[int(np.argmin(cost))])
            out.append(row)
            used[row] = True
        while len(out) < n_rep:  # every parent row conflicted: fill from the free devices
            pool = np.flatnonzero(~used)
            row = self.rng.choice(pool, size=n_st, replace=False)
            out.append(row)
            used[row] = True
        return self.flat(np.stack(out))

    # ------------------------------------------------------------------- main
    def run(self, starts: list[tuple[str, np.ndarray]]) -> SearchResult:
        cfg, rng = self.cfg, self.rng
        pop: list[tuple[tuple[float, float], np.ndarray]] = []
        if cfg.cold_seeds:
            starts = list(starts) + sorted_seeds(self.hcost, self.gcost, self.n_st, self.n_rep)
        names: dict[int, str] = {}
        scored = []
        for name, m in starts:
            x = self.flat(m)
            self.obj.reset(x)
            self.evals += 1
            scored.append(((self.obj.total, self.obj.soft), name, x))
        scored.sort(key=lambda t: t[0])
        start_name = scored[0][1]
        for _, name, x in scored[: self.size]:
            if self.done() and pop:
                break
            key, bx = self.improve(x)
            names[len(pop)] = name
            self._insert(pop, key, bx)
        tries = 0
        while len(pop) < self.size and not self.done() and tries < 3 * self.size:
            tries += 1  # small instances may have fewer distinct local optima than the population's size
            base = pop[int(rng.integers(len(pop)))][1]
            self._insert(pop, *self.improve(self.kick(base, max(cfg.kick_swaps, self.n_slots // 8))))
        gen, since_best, best_at, idle = 0, 0, self.best_key, 0
        while not self.done():
            if gen >= cfg.generations:
                self.stopped_by = "generations"
            elif len(pop) < 2:
                self.stopped_by = "converged"  # a single distinct local optimum: nothing to cross
            elif cfg.stop_after and idle >= cfg.stop_after:
                self.stopped_by = "stalled"  # stop_after generations without a new best
            if self.stopped_by:
                break
            gen += 1
            i, j = self._parents(pop)
            cross = self.group_crossover if rng.random() < 0.5 else self.pipeline_crossover
            child = cross(pop[i][1], pop[j][1])
            self._insert(pop, *self.improve(child))
            if self.best_key[0] < best_at[0] or better(self.best_key, best_at):
                best_at, since_best, idle = self.best_key, 0, 0
            else:
                since_best += 1
                idle += 1
            if since_best >= cfg.restart_after:
                since_best = 0
                pop.sort(key=lambda t: t[0])
                keep = pop[: max(1, len(pop) // 2)]
                pop[:] = keep
                tries = 0
                while len(pop) < self.size and not self.done() and tries < 3 * self.size:
                    tries += 1
                    y = self.kick(keep[0][1], max(cfg.kick_swaps, self.n_slots // 4))
                    self._insert(pop, *self.improve(y))
        assert self.best_x is not None
        self.obj.reset(self.best_x)
        secs = self.clock() - self.t0
        log.info("memetic: %d generations, %d evaluations in %.2fs, best %.4f", gen, self.evals, secs,
                 self.obj.total)
        x = self.best_x
        res = SearchResult(matrix=x[: self.n_slots].reshape(self.n_rep, self.n_st).copy(),
                           spares=x[self.n_slots:].copy(), total=self.obj.total, evaluations=self.evals,
                           seconds=secs, start=start_name, trace=self.trace, generations=gen,
                           found_s=self.found_s, stopped_by=self.stopped_by, timeline=self.timeline)
        return res

    def _parents(self, pop: list[tuple[tuple[float, float], np.ndarray]]) -> tuple[int, int]:
        def tournament() -> int:
            a, b = self.rng.integers(len(pop), size=2)
            return int(a) if pop[a][0] <= pop[b][0] else int(b)

        i = tournament()
        j = tournament()
        if j == i:
            j = (i + 1 + int(self.rng.integers(len(pop) - 1))) % len(pop)
        return i, j

    def _insert(self, pop: list[tuple[tuple[float, float], np.ndarray]], key: tuple[float, float],
                x: np.ndarray) -> None:
        """Crowding: a twin replaces only its twin (if better); otherwise the child replaces the worst."""
        lab = _stage_labels(x, self.n_slots, self.n_st, self.n)
        for k, (kk, y) in enumerate(pop):
            if int((_stage_labels(y, self.n_slots, self.n_st, self.n) != lab).sum()) < self.min_dist:
                if better(key, kk):
                    pop[k] = (key, x)
                return
        if len(pop) < self.size:
            pop.append((key, x))
            return
        worst = max(range(len(pop)), key=lambda k: pop[k][0])
        if key[0] < pop[worst][0][0] - EPS * max(1.0, abs(key[0])) or better(key, pop[worst][0]):
            pop[worst] = (key, x)


def run_memetic(obj: Objective, starts: list[tuple[str, np.ndarray]], n_devices: int, cfg: MemeticConfig,
                group_cost: np.ndarray, hop_cost: np.ndarray, lower_bound: float = 0.0) -> SearchResult:
    """Run the memetic search; ``group_cost`` / ``hop_cost`` rate groups and pipelines in the crossovers."""
    return Memetic(obj, n_devices, group_cost, hop_cost, cfg, lower_bound).run(starts)
