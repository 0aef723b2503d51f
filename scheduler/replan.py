"""Re-planning after a membership change, with the cost of moving state in the objective.

A tasklet of stage s that lands on a device which did not hold stage s before must first receive the stage's
state (weights and AdamW moments, ``params x (param_bytes + 8)`` bytes) from a surviving holder of that stage,
over the fastest such link: ``delay + 8 bytes / bandwidth``. The objective of a re-plan is the iteration cost
plus ``move_weight`` times the sum of these transfers (sum, not max: it charges every move, so the search
moves only what pays for itself; the parallel figure, the slowest single transfer, is reported beside it).
The move cost is separable per tasklet, so it enters both objectives as a per-slot cost and costs nothing
extra per swap.

The search starts from the current plan, repaired: a departed device's tasklet goes to the idle device
cheapest to bring there, and when the devices left no longer fill S x D the replica with the most holes is
dropped. Warm (the default): the population is the repaired plan and kicked copies of it only, small
(:data:`WARM`), and the search stops after a few generations without a new best, at the gap, or at the evaluation
budget (:func:`scheduler.api.evaluation_budget`) of a tenth of the from-scratch default time limit, at most
:data:`WARM_TIME_MAX_S`, which is also its time limit. Why: after one peer left or joined, the
running plan was already near the best and a better one is a few swaps away, while the swarm waits on the
re-plan. The lower bound of a departure's re-plan is the cached bound of the cluster before it
(:mod:`scheduler.bound_cache`), so the re-plan does not recompute it; where none covers the cluster (a join), a
warm re-plan computes the bound's quick tier only (valid, looser), cached for the next warm re-plan.
``warm=False`` adds the usual cold seeds and budget, so a re-plan can still end far from the current plan when
that pays.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .api import COST_MODELS, DEFAULT_GAP, default_time_limit, evaluation_budget, predict, search_layout, stopping
from .bound import gap as gap_of
from .cluster import Cluster
from .errors import PlanningError
from .memetic import MemeticConfig
from .plan import Plan
from .search import SearchConfig
from .workload import ADAM_STATE_BYTES_PER_PARAM, Workload

DEPARTED = -1
# a warm re-plan's search: a small population from the repaired plan, ended by a few idle generations
WARM = {"population": 2, "generations": 30, "stop_after": 3, "restart_after": 3, "child_kicks": 0,
        "stall_per_position": 0.75}
WARM_TIME_FRACTION = 0.1  # of the from-scratch default time limit ...
WARM_TIME_MAX_S = 0.5  # ... and at most this: above ~256 devices a tenth of the default is seconds


def state_bytes(workload: Workload, stages: list[tuple[int, int]]) -> np.ndarray:
    """Bytes of each stage's state a new holder must receive: weights and the two AdamW moments."""
    return np.array([workload.stage_params(a, b) * (workload.param_bytes + ADAM_STATE_BYTES_PER_PARAM)
                     for a, b in stages], dtype=float)


def move_costs(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]],
               current: list[list[int]]) -> np.ndarray:
    """(N, S): seconds to bring stage s's state to device d (0 where d already holds stage s).

    A stage with no surviving holder costs 0 here: its state must come from a checkpoint, whatever the plan.
    """
    n, n_st = cluster.n, len(stages)
    nbytes = state_bytes(workload, stages)
    out = np.zeros((n, n_st))
    for s in range(n_st):
        holders = sorted({row[s] for row in current if 0 <= row[s] < n})
        if not holders:
            continue
        t = cluster.delay_s[holders, :] + 8.0 * nbytes[s] / cluster.bandwidth_bps[holders, :]
        out[:, s] = t.min(axis=0)
        out[holders, s] = 0.0
    return out


def _check_current(cluster: Cluster, workload: Workload, current: Plan) -> list[list[int]]:
    if not current.stages or not current.pipelines:
        raise PlanningError("current", "the current plan is empty")
    n_st = len(current.stages)
    rows = []
    seen: set[int] = set()
    for r, row in enumerate(current.pipelines):
        if len(row) != n_st:
            raise PlanningError(f"current.pipelines[{r}]", f"has {len(row)} stages, expected {n_st}")
        out = []
        for d in row:
            if not isinstance(d, (int, np.integer)) or not DEPARTED <= int(d) < cluster.n:
                raise PlanningError(f"current.pipelines[{r}]", f"device {d!r} not in -1..{cluster.n - 1}")
            if int(d) != DEPARTED and int(d) in seen:
                raise PlanningError(f"current.pipelines[{r}]", f"device {d} used twice")
            seen.add(int(d))
            out.append(int(d))
        rows.append(out)
    Plan(current.stages, [list(range(n_st))]).validate(1 << 30, workload.n_layers)
    return rows


def repair(rows: list[list[int]], n_devices: int, n_rep: int, move: np.ndarray) -> np.ndarray:
    """The current plan with ``n_rep`` replicas: drop the replicas with most holes, fill holes cheaply."""
    keep = sorted(range(len(rows)), key=lambda r: (sum(d == DEPARTED for d in rows[r]), r))[:n_rep]
    m = np.array([rows[r] for r in sorted(keep)], dtype=int).reshape(-1, len(rows[0]))
    free = sorted(set(range(n_devices)) - {int(d) for d in m.ravel() if d != DEPARTED})
    grow = n_rep - m.shape[0]
    for _ in range(grow):  # more replicas than before (arrivals): new rows start empty
        m = np.vstack([m, np.full(m.shape[1], DEPARTED)])
    for r, s in zip(*np.nonzero(m == DEPARTED), strict=True):
        d = min(free, key=lambda d: (move[d, s], d))
        m[r, s] = d
        free.remove(d)
    return m


def move_summary(move: np.ndarray, m: np.ndarray, weight: float) -> dict[str, Any]:
    cost = move[m, np.arange(m.shape[1])[None, :]]
    moved = cost > 0
    return {"moved_tasklets": int(moved.sum()), "transfer_s": float(cost.sum()),
            "transfer_parallel_s": float(cost.max()) if cost.size else 0.0, "move_weight": weight}


def replan(cluster: Cluster, workload: Workload, current: Plan, cost_model: str = "full", seed: int = 0,
           time_limit_s: float | None = None, config: SearchConfig | MemeticConfig | None = None,
           algorithm: str = "memetic", move_weight: float = 1.0, replicas: int | None = None,
           gap: float | None = None, warm: bool = True, canonical: bool | None = None) -> Plan:
    """A new plan after a membership change, starting from ``current`` and charging every move.

    ``current``: the run's plan over *this* cluster's device indices, with ``-1`` for every device that left;
    its layer ranges are kept. ``replicas``: D of the new plan (default: the current D if the devices left
    allow it, else as many as fit). The returned plan's ``predicted`` holds the iteration cost as usual plus
    ``moves`` (moved tasklets, summed and slowest transfer seconds) and ``objective_s`` (cost + weighted moves).
    ``gap`` and the default time limit are those of :func:`scheduler.api.plan`; the bound of the cost also bounds
    the objective (moves cost >= 0), so a re-plan whose repaired plan is already within the gap stops at once.
    ``canonical``: as in :func:`scheduler.api.plan` (default: yes unless a config is given).
    """
    if cost_model not in COST_MODELS:
        raise PlanningError("cost_model", f"must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    if not move_weight >= 0:
        raise PlanningError("move_weight", f"must be >= 0, got {move_weight!r}")
    rows = _check_current(cluster, workload, current)
    stages = [(int(a), int(b)) for a, b in current.stages]
    n_st = len(stages)
    n_rep = replicas or min(len(rows), cluster.n // n_st)
    if n_rep < 1 or n_st * n_rep > cluster.n:
        raise PlanningError("replicas", f"{n_st} stages x {n_rep} replicas need {n_st * n_rep} devices, "
                            f"{cluster.n} left")
    w = workload.with_split(n_st, n_rep)
    move = move_costs(cluster, w, stages, rows)
    start = repair(rows, cluster.n, n_rep, move)
    if canonical is None:
        canonical = config is None
    if warm and config is None and algorithm == "memetic":
        if time_limit_s is None:
            time_limit_s = min(WARM_TIME_MAX_S, WARM_TIME_FRACTION * default_time_limit(cluster.n))
        config = MemeticConfig(**WARM, max_evaluations=evaluation_budget(cluster.n, cost_model, time_limit_s))
        gap = DEFAULT_GAP if gap is None else gap
    gap_stop, time_limit_s = stopping(cluster.n, config, gap, time_limit_s)
    cpu0 = time.process_time()
    m, _, res, bound, _ = search_layout(cluster, w, cost_model, seed, time_limit_s, config, algorithm, stages,
                                        slot_cost=move_weight * move, extra_starts=[("current", start)],
                                        gap_stop=gap_stop, cold_seeds=not warm, canonical=canonical,
                                        quick_bound=warm)
    out = Plan(stages=stages, pipelines=m.tolist())
    out.validate(cluster.n, w.n_layers)
    out.predicted = predict(cluster, w, out, cost_model)
    moves = move_summary(move, m, move_weight)
    total = float(out.predicted["total_s"])
    out.predicted["moves"] = moves
    out.predicted["objective_s"] = total + move_weight * moves["transfer_s"]
    out.search = {"algorithm": f"tasklet-{algorithm}-replan", "seconds": round(res.seconds, 4),
                  "cpu_seconds": round(time.process_time() - cpu0, 4), "evaluations": res.evaluations,
                  "seed": seed, "start": res.start, "stages": n_st, "replicas": n_rep,
                  "idle_devices": [int(x) for x in res.spares], "lower_bound": float(bound),
                  "gap": round(gap_of(total, bound), 6), "stopped_by": res.stopped_by, "gap_target": gap_stop,
                  "warm": bool(warm)}
    return out


def objective_of(cluster: Cluster, workload: Workload, current: Plan, candidate: Plan, cost_model: str = "full",
                 move_weight: float = 1.0) -> float:
    """The re-plan objective (cost + weighted moves from ``current``) of any ``candidate`` plan."""
    rows = _check_current(cluster, workload, current)
    w = workload.with_split(candidate.n_stages, candidate.n_replicas)
    move = move_costs(cluster, w, [(int(a), int(b)) for a, b in current.stages], rows)
    total = float(predict(cluster, w, candidate, cost_model)["total_s"])
    return total + move_weight * move_summary(move, candidate.matrix(), move_weight)["transfer_s"]
