"""``plan()``: the one call the daemon makes — choose S and D if needed, check memory, search, predict."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from . import cost_dtfm, cost_full
from .cluster import Cluster
from .cost_dtfm import DtfmPairs
from .errors import PlanningError
from .plan import Plan, even_stages
from .schedule import stage_flops, timing
from .search import CallableObjective, DtfmObjective, SearchConfig, SearchResult, run_search
from .seeding import seeds
from .workload import Workload

log = logging.getLogger(__name__)

COST_MODELS = ("dtfm", "full")


def memory_violations(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]]) -> np.ndarray:
    """(N, S) True where device n cannot hold stage s (weights, grads, AdamW, S - s stashed micro-batches).
    """
    n_st = len(stages)
    need = np.array([workload.stage_memory_bytes(a, b, in_flight=n_st - s)
                     for s, (a, b) in enumerate(stages)])
    bad = need[None, :] > cluster.memory_bytes[:, None]
    for s, (a, b) in enumerate(stages):
        if bad[:, s].all():
            raise PlanningError("memory_gb", f"stage {s} (layers {a}-{b - 1}) needs {need[s] / 1e9:.2f} "
                                f"GB, the largest device has {cluster.memory_bytes.max() / 1e9:.2f} GB")
    return bad


def predict(cluster: Cluster, workload: Workload, plan: Plan, cost_model: str) -> dict[str, Any]:
    if cost_model == "dtfm":
        return cost_dtfm.cost(cluster, workload, plan)
    return cost_full.predict(cluster, workload, plan)


def _objective(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]], n_st: int, n_rep: int,
               cost_model: str, mem_bad: np.ndarray | None) -> tuple[DtfmObjective | CallableObjective,
                                                                   np.ndarray]:
    if cost_model == "dtfm":
        pairs = DtfmPairs.build(cluster, workload, n_st, n_rep)
        return DtfmObjective(pairs, n_st, n_rep, mem_bad), pairs.pp
    flops = stage_flops(workload, stages)
    link = cluster.transfer_s(workload.activation_bytes())

    def f(m: np.ndarray) -> float:
        p = Plan(stages, m.tolist())
        return cost_full.predict_timing(timing(cluster, workload, p, flops))["total_s"]

    return CallableObjective(f, n_st, n_rep, mem_bad), link


def balance_layers(cluster: Cluster, workload: Workload, m: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous layer split minimising max_s (FLOPs of stage s) / (sum of TFLOP/s of its group).

    Pipelines pull micro-batches, so a stage's throughput is that of its whole data-parallel group; giving
    more layers to stages on faster devices evens the per-stage time. Memory limits are respected (a range a
    stage's weakest device cannot hold is not allowed). Linear-partition dynamic programme, O(S L^2).
    """
    n_st, n_lay = m.shape[1], workload.n_layers
    speed = cluster.tflops[m].sum(axis=0)
    cap = cluster.memory_bytes[m].min(axis=0)
    inf = float("inf")
    best = np.full((n_st + 1, n_lay + 1), inf)
    arg = np.zeros((n_st + 1, n_lay + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, n_st + 1):
        for b in range(s, n_lay - (n_st - s) + 1):
            for a in range(s - 1, b):
                if not np.isfinite(best[s - 1, a]):
                    continue
                if workload.stage_memory_bytes(a, b, n_st - (s - 1)) > cap[s - 1]:
                    continue
                v = max(best[s - 1, a], workload.stage_forward_flops(a, b) / speed[s - 1])
                if v < best[s, b]:
                    best[s, b], arg[s, b] = v, a
    if not np.isfinite(best[n_st, n_lay]):
        return even_stages(n_lay, n_st)
    out, b = [], n_lay
    for s in range(n_st, 0, -1):
        a = int(arg[s, b])
        out.append((a, b))
        b = a
    return out[::-1]


def choose_split(cluster: Cluster, workload: Workload, cost_model: str) -> tuple[int, int]:
    """Pick (S, D) when the workload leaves them open: the cheapest clustered seed plan over candidates."""
    n, n_lay = cluster.n, workload.n_layers
    cands: list[tuple[int, int]] = []
    if workload.stages is not None:
        cands = [(workload.stages, workload.replicas or max(1, n // workload.stages))]
    elif workload.replicas is not None:
        cands = [(s, workload.replicas) for s in range(1, n_lay + 1) if s * workload.replicas <= n]
    else:
        cands = [(s, n // s) for s in range(1, min(n_lay, n) + 1)]
    best, best_cost = None, float("inf")
    for n_st, n_rep in cands:
        stages = even_stages(n_lay, n_st)
        try:
            mem_bad = memory_violations(cluster, workload, stages)
        except PlanningError:
            continue
        w = workload.with_split(n_st, n_rep)
        obj, link = _objective(cluster, w, stages, n_st, n_rep, cost_model, mem_bad)
        for _, m in seeds(link, n_st, n_rep)[:1]:
            x = np.concatenate([m.reshape(-1), np.setdiff1d(np.arange(n), m.reshape(-1))])
            obj.reset(x)
            if obj.total < best_cost:
                best, best_cost = (n_st, n_rep), obj.total
    if best is None:
        raise PlanningError("memory_gb", "no split into stages fits the devices' memory")
    return best


def plan(cluster: Cluster, workload: Workload, cost_model: str = "full", seed: int = 0,
         time_limit_s: float | None = None, config: SearchConfig | None = None) -> Plan:
    """Place every (replica, stage) tasklet on a device; see ``docs/scheduler.md``."""
    if cost_model not in COST_MODELS:
        raise PlanningError("cost_model", f"must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    if workload.stages is None or workload.replicas is None:
        n_st, n_rep = choose_split(cluster, workload, cost_model)
        workload = workload.with_split(n_st, n_rep)
    n_st, n_rep = workload.stages, workload.replicas
    assert n_st is not None and n_rep is not None
    if n_st * n_rep > cluster.n:
        raise PlanningError("replicas", f"{n_st} stages x {n_rep} replicas need {n_st * n_rep} devices, the "
                            f"scenario has "
                            f"{cluster.n}")
    stages = even_stages(workload.n_layers, n_st)
    mem_bad = memory_violations(cluster, workload, stages)
    cfg = config or SearchConfig()
    cfg = SearchConfig(**{**cfg.__dict__, "seed": seed,
                          "time_limit_s": time_limit_s if time_limit_s is not None else cfg.time_limit_s})
    if cost_model == "full" and config is None:
        cfg.max_evaluations = min(cfg.max_evaluations, 4000)
    obj, link = _objective(cluster, workload, stages, n_st, n_rep, cost_model,
                           mem_bad if mem_bad.any() else None)
    res: SearchResult = run_search(obj, seeds(link, n_st, n_rep), cluster.n, cfg)
    m = res.matrix
    if mem_bad[m, np.arange(n_st)[None, :]].any():
        raise PlanningError("memory_gb", "no placement puts every stage on a device that can hold it")
    if cost_model == "full" and (np.ptp(cluster.tflops) > 0 or np.ptp(cluster.memory_bytes) > 0):
        balanced = balance_layers(cluster, workload, m)
        if balanced != stages:
            old = cost_full.predict(cluster, workload, Plan(stages, m.tolist()))["total_s"]
            new = cost_full.predict(cluster, workload, Plan(balanced, m.tolist()))["total_s"]
            if new < old:
                stages = balanced
    out = Plan(stages=stages, pipelines=m.tolist())
    out.validate(cluster.n, workload.n_layers)
    out.predicted = predict(cluster, workload, out, cost_model)
    out.search = {"algorithm": "tasklet-ils",
                  "seconds": round(res.seconds, 4), "evaluations": res.evaluations, "seed": seed,
                  "start": res.start, "stages": n_st, "replicas": n_rep,
                  "idle_devices": [int(x) for x in res.spares]}
    return out

