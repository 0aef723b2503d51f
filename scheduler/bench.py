"""``python -m tasklet.scheduler bench``: how the default search stops; ``--baselines``: the comparison with others.

The default (:func:`run_stop_bench`): every bundled scenario and generated 64 / 256 / 1,024-device ones, under
three device numberings, with ``plan``'s defaults (2 % gap, default time limit): the best cost at 0.5, 1 and 2
wall seconds and at the stop, the bound, the gap, the rule that stopped the search, seconds and the load
average; then a warm re-plan after one departure per scenario (8 x (N / 8 - 1), so that idle devices can take
the departed one's tasklets), beside a cold one (``warm=False``) up to 256 devices. Wall seconds depend on the
machine's load.

``--baselines`` (:func:`run_bench`): random / rank order / the paper's search / our ILS / our memetic search.

Device ids are shuffled before planning (seed-dependent), so no planner profits from devices being listed
region by region; costs do not depend on ids, so nothing needs mapping back. Every cost is the ``dtfm`` model
with the paper's GPT3-XL workload (8 stages x 8 replicas; 8 x 128 on the 1,024-device scenario). Search
budgets and times are CPU seconds of this process (one core), so that other work on the machine changes how
long a run takes but not what it finds; wall seconds and the load average are reported beside them.
The lower bound (``bound.py``) is printed with the gap of the memetic search's worst seed.
A last table re-plans a heterogeneous 64-device run after one departure (``replan.py``, ``full`` model).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from .bound import dtfm_lower_bound, gap
from .cluster import Cluster, default_scenarios_path
from .cost_dtfm import DtfmPairs, evaluate
from .memetic import MemeticConfig, run_memetic
from .paper_ga import PaperGAConfig, paper_ga
from .search import DtfmObjective, SearchConfig, run_search
from .seeding import seeds
from .synthetic import geo_scenario, hetero_scenario
from .workload import Workload

log = logging.getLogger(__name__)

PAPER_SCENARIOS = ("datacenter_on_demand", "datacenter_spot", "multi_universities",
                   "regional_geo_distributed", "worldwide_geo_distributed")
# Best cost the paper's own code reached (shared/scenarios/README.md).
PAPER_REFERENCE = {"datacenter_on_demand": 3.4398, "datacenter_spot": 49.5039, "multi_universities": 16.0868,
                   "regional_geo_distributed": 34.8020, "worldwide_geo_distributed": 49.2184}
SYNTHETIC_64 = ("hetero64_0", "hetero64_1", "hetero64_2", "geo64_0")


def synthetic(name: str) -> Cluster:
    """``hetero64_<seed>`` / ``geo64_<seed>`` / ``geo1024_<seed>``: the synthetic scenarios of the bench."""
    kind, _, seed = name.partition("_")
    n = int(kind.removeprefix("hetero").removeprefix("geo"))
    make = hetero_scenario if kind.startswith("hetero") else geo_scenario
    c = Cluster.from_dict(make(n, seed=int(seed)))
    c.name = name
    return c


def ils(pairs: DtfmPairs, n: int, n_st: int, n_rep: int, seed: int, cpu_s: float,
        max_evaluations: int = 10**9) -> dict[str, float]:
    """Today's iterated local search (``search.py``) for ``cpu_s`` CPU seconds."""
    w0, c0 = time.perf_counter(), time.process_time()
    res = run_search(DtfmObjective(pairs, n_st, n_rep), seeds(pairs.pp, n_st, n_rep), n,
                     SearchConfig(seed=seed, max_evaluations=max_evaluations, time_limit_s=cpu_s, cpu_clock=True))
    return {"cost": evaluate(pairs, res.matrix)[0], "cpu_s": time.process_time() - c0,
            "wall_s": time.perf_counter() - w0, "evaluations": res.evaluations}


def memetic(pairs: DtfmPairs, n: int, n_st: int, n_rep: int, seed: int, cpu_s: float,
            generations: int = 10**6) -> dict[str, float]:
    """The memetic search for at most ``cpu_s`` CPU seconds; it stops earlier at the bound or after 25
    generations without a new best (the defaults of ``plan``)."""
    w0, c0 = time.perf_counter(), time.process_time()
    bound = dtfm_lower_bound(pairs, n_st, n_rep)
    cfg = MemeticConfig(seed=seed, time_limit_s=cpu_s, cpu_clock=True, generations=generations)
    res = run_memetic(DtfmObjective(pairs, n_st, n_rep), seeds(pairs.pp, n_st, n_rep), n, cfg, pairs.dp,
                      pairs.pp, bound)
    return {"cost": evaluate(pairs, res.matrix)[0], "cpu_s": time.process_time() - c0,
            "wall_s": time.perf_counter() - w0, "evaluations": res.evaluations, "bound": bound,
            "generations": res.generations, "found_cpu_s": res.found_s}


def bench_scenario(cluster: Cluster, workload: Workload, n_seeds: int, ga_budget: int, ils_s: float,
                   memetic_s: float, ga_time_s: float | None = None) -> dict[str, Any]:
    n_st, n_rep = workload.stages or 8, workload.replicas or 8
    row: dict[str, Any] = {"scenario": cluster.name, "devices": cluster.n, "load_before": os.getloadavg()[0]}
    base = DtfmPairs.build(cluster, workload, n_st, n_rep)
    rng = np.random.default_rng(12345)
    n_rand = 100 if cluster.n <= 256 else 20
    rand = [evaluate(base, rng.permutation(cluster.n)[: n_st * n_rep].reshape(n_rep, n_st))[0]
            for _ in range(n_rand)]
    row["random_mean"] = float(np.mean(rand))
    il, me, rank, ga = [], [], [], []
    for seed in range(n_seeds):
        perm = np.random.default_rng(1000 + seed).permutation(cluster.n)
        pairs = DtfmPairs.build(cluster.subset(perm), workload, n_st, n_rep)
        rank.append(evaluate(pairs, np.arange(n_st * n_rep).reshape(n_rep, n_st))[0])
        il.append(ils(pairs, cluster.n, n_st, n_rep, seed, ils_s))
        me.append(memetic(pairs, cluster.n, n_st, n_rep, seed, memetic_s))
        if seed == 0:  # the paper's search is slow: one run per scenario
            c0 = time.process_time()
            r = paper_ga(pairs, cluster.n, n_st, n_rep,
                         PaperGAConfig(offspring=ga_budget - 100, seed=seed, time_limit_s=ga_time_s))
            ga.append({"cost": r.total, "cpu_s": time.process_time() - c0, "evaluations": r.evaluations})
        log.info("%s seed %d: ils %.4f, memetic %.4f", cluster.name, seed, il[-1]["cost"], me[-1]["cost"])
    bound = me[0]["bound"]
    worst = max(x["cost"] for x in me)
    row.update(
        rank_order=float(np.mean(rank)), paper_ga=ga[0]["cost"], paper_ga_s=ga[0]["cpu_s"],
        paper_ga_evaluations=ga[0]["evaluations"],
        ils_best=min(x["cost"] for x in il), ils_worst=max(x["cost"] for x in il),
        ils_mean=float(np.mean([x["cost"] for x in il])), ils_s=max(x["cpu_s"] for x in il),
        memetic_best=min(x["cost"] for x in me), memetic_worst=worst,
        memetic_s=max(x["cpu_s"] for x in me), memetic_wall_s=max(x["wall_s"] for x in me),
        memetic_found_s=max(x["found_cpu_s"] for x in me), lower_bound=bound, gap=gap(worst, bound),
        seeds=n_seeds, load_after=os.getloadavg()[0])
    row["memetic_le_ils"] = bool(worst <= row["ils_best"] + 1e-6)
    ref = PAPER_REFERENCE.get(cluster.name)
    row["paper_reference"] = ref
    row["memetic_le_reference"] = None if ref is None else bool(worst <= ref + 5e-5)
    return row


def bench_replan(name: str = "hetero64_0", departures: int = 3, time_limit_s: float | None = None
                 ) -> list[dict[str, Any]]:
    """Plan 8 x 7 on 64 heterogeneous devices (``full`` model), then re-plan after each of a few departures.

    Without a time limit every search runs its default budget, so the table does not depend on the load.
    """
    from .api import plan
    from .plan import Plan
    from .replan import move_costs, objective_of, repair, replan

    def replan_moves(sub: Cluster, w: Workload, current: Plan, p: Plan) -> int:
        return int((move_costs(sub, w, current.stages, current.pipelines)[p.matrix(), np.arange(8)] > 0).sum())

    cluster = synthetic(name)
    w = Workload.preset("gpt3-xl-dtfm").with_split(8, 7)
    first = plan(cluster, w, cost_model="full", seed=0, time_limit_s=time_limit_s)
    rows = []
    used = [d for row in first.pipelines for d in row]
    for k in range(departures):
        gone = used[int(np.random.default_rng(k).integers(len(used)))]
        live = [d for d in range(cluster.n) if d != gone]
        index = {d: i for i, d in enumerate(live)}
        sub = cluster.subset(live)
        current = Plan(first.stages, [[index.get(d, -1) for d in row] for row in first.pipelines])
        c0 = time.process_time()
        new = replan(sub, w, current, cost_model="full", seed=0, time_limit_s=time_limit_s)
        secs = time.process_time() - c0
        scratch = plan(sub, w, cost_model="full", seed=0, time_limit_s=time_limit_s, stages=first.stages)
        mv = new.predicted["moves"]
        scratch_moves = replan_moves(sub, w, current, scratch)
        move = move_costs(sub, w, current.stages, current.pipelines)
        fixed = Plan(first.stages, repair(current.pipelines, sub.n, 7, move).tolist())
        rows.append({"scenario": name, "departed": int(gone), "cost_before": first.predicted["total_s"],
                     "cost_after": new.predicted["total_s"], "moved_tasklets": mv["moved_tasklets"],
                     "transfer_s": mv["transfer_s"], "transfer_parallel_s": mv["transfer_parallel_s"],
                     "objective_s": new.predicted["objective_s"], "replan_cpu_s": secs,
                     "scratch_cost": scratch.predicted["total_s"],
                     "scratch_objective_s": objective_of(sub, w, current, scratch, "full"),
                     "scratch_moved_tasklets": scratch_moves,
                     "repaired_objective_s": objective_of(sub, w, current, fixed, "full"),
                     "repaired_moved_tasklets": replan_moves(sub, w, current, fixed)})
    return rows


def run_bench(quick: bool = False, seeds: int = 3, scenarios_path: str | None = None, large: bool = True,
              synthetic_64: bool = True) -> dict[str, Any]:
    path = scenarios_path or default_scenarios_path()
    w = Workload.preset("gpt3-xl-dtfm")
    ils_s, mem_s = (2.0, 1.0) if quick else (6.0, 2.0)
    rows = []
    clusters = [Cluster.from_scenario(path, name) for name in PAPER_SCENARIOS]
    if synthetic_64:
        clusters += [synthetic(name) for name in SYNTHETIC_64]
    for cluster in clusters:
        rows.append(bench_scenario(cluster, w, n_seeds=seeds, ga_budget=500 if quick else 5000, ils_s=ils_s,
                                   memetic_s=mem_s))
    if large:
        big = synthetic("geo1024_0")
        rows.append(bench_scenario(big, w.with_split(8, 128), n_seeds=1, ga_budget=10**6,
                                   ils_s=5.0 if quick else 10.0, memetic_s=5.0 if quick else 9.5,
                                   ga_time_s=10.0))
    return {"scenarios": rows, "replan": bench_replan(departures=1 if quick else 3)}


def _f(x: Any, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def format_table(result: dict[str, Any]) -> str:
    rows = result["scenarios"] if isinstance(result, dict) else result
    head = ("| scenario | random (mean) | rank order | paper's search: cost (cpu s) | ILS: best / worst (cpu s) | "
            "memetic: best / worst (cpu s; best found by) | lower bound | gap | paper's code reached |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {_f(r['random_mean'], 2)} | {_f(r['rank_order'])} | "
                     f"{_f(r['paper_ga'])} ({_f(r['paper_ga_s'], 1)}) | {_f(r['ils_best'])} / "
                     f"{_f(r['ils_worst'])} ({_f(r['ils_s'], 1)}) | {_f(r['memetic_best'])} / "
                     f"{_f(r['memetic_worst'])} ({_f(r['memetic_s'], 1)}; {_f(r['memetic_found_s'], 2)}) | "
                     f"{_f(r['lower_bound'])} | {100 * r['gap']:.1f} % | {_f(r['paper_reference'])} |")
    rp = result.get("replan", []) if isinstance(result, dict) else []
    if rp:
        lines += ["", "| re-plan after a departure | cost before | cost after | moved tasklets | transfer s (sum / "
                  "slowest) | objective | holes filled only: objective (moved) | from scratch: cost / objective "
                  "(moved) | cpu s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rp:
            lines.append(f"| {r['scenario']} device {r['departed']} | {_f(r['cost_before'])} | "
                         f"{_f(r['cost_after'])} | {r['moved_tasklets']} | {_f(r['transfer_s'], 2)} / "
                         f"{_f(r['transfer_parallel_s'], 2)} | {_f(r['objective_s'])} | "
                         f"{_f(r.get('repaired_objective_s'))} ({r.get('repaired_moved_tasklets', '-')}) | "
                         f"{_f(r['scratch_cost'])} / {_f(r['scratch_objective_s'])} ({r['scratch_moved_tasklets']}) | "
                         f"{_f(r['replan_cpu_s'], 1)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Stopping benchmark (the default of ``python -m tasklet.scheduler bench``): how fast the search nears its bound.

STOP_SCENARIOS_64 = ("hetero64_0", "geo64_0")
STOP_SCENARIOS_LARGE = ("hetero256_0", "geo1024_0")
CHECKPOINTS_S = (0.5, 1.0, 2.0)


def _replicas(n: int) -> int:
    """8 stages x N / 8 replicas (the paper's 8 x 8 on 64 devices)."""
    return max(1, n // 8)


def _best_at(timeline: list[tuple[float, float]], offset: float, t: float) -> float | None:
    """Best cost found by wall second ``t`` of the whole call (``offset``: seconds before the search started)."""
    seen = [c for s, c in timeline if offset + s <= t]
    return min(seen) if seen else None


def stop_run(cluster: Cluster, workload: Workload, cost_model: str, perm_seed: int | None,
             gap_target: float | None = None, time_limit_s: float | None = None) -> dict[str, Any]:
    """One default search (``plan``'s stopping rules) of a renumbered scenario, with its cost over time."""
    from .api import search_layout, stopping

    perm = (np.arange(cluster.n) if perm_seed is None
            else np.random.default_rng(perm_seed).permutation(cluster.n))
    sub = cluster.subset(perm)
    gap_stop, limit = stopping(sub.n, None, gap_target, time_limit_s)
    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    _, _, res, bound, _ = search_layout(sub, workload, cost_model, 0, limit, None, "memetic", None,
                                        gap_stop=gap_stop)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    offset = wall - res.seconds  # bound, seeds and canonical order before the search's clock started
    row: dict[str, Any] = {"scenario": cluster.name, "devices": cluster.n, "cost_model": cost_model,
                           "stages": workload.stages, "replicas": workload.replicas,
                           "permutation": perm_seed, "load_before": load}
    for t in CHECKPOINTS_S:
        row[f"cost_at_{t:g}s"] = _best_at(res.timeline, offset, t)
    row.update(cost=res.total, lower_bound=bound, gap=gap(res.total, bound), stopped_by=res.stopped_by,
               seconds=wall, cpu_seconds=cpu, setup_seconds=offset, evaluations=res.evaluations,
               time_limit_s=limit, gap_target=gap_stop, load_after=os.getloadavg()[0])
    return row


def replan_run(cluster: Cluster, workload: Workload, cost_model: str, time_limit_s: float | None = None,
               cold: bool = False) -> dict[str, Any]:
    """Plan, then re-plan (warm, the default) after the departure of one busy device; seconds of each.

    ``cold``: also re-plan with ``warm=False`` (cold seeds, the from-scratch budget) for comparison.
    """
    from .api import plan
    from .plan import Plan
    from .replan import replan

    w0 = time.perf_counter()
    first = plan(cluster, workload, cost_model=cost_model, time_limit_s=time_limit_s)
    first_s = time.perf_counter() - w0
    used = [d for row in first.pipelines for d in row]
    gone = used[int(np.random.default_rng(0).integers(len(used)))]
    live = [d for d in range(cluster.n) if d != gone]
    index = {d: i for i, d in enumerate(live)}
    sub = cluster.subset(live)
    current = Plan(first.stages, [[index.get(d, -1) for d in row] for row in first.pipelines])
    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    new = replan(sub, workload, current, cost_model=cost_model)
    secs, cpu = time.perf_counter() - w0, time.process_time() - c0
    extra: dict[str, Any] = {}
    if cold:
        w0 = time.perf_counter()
        ref = replan(sub, workload, current, cost_model=cost_model, warm=False)
        extra = {"cold_objective_s": ref.predicted["objective_s"], "cold_cost_after": ref.predicted["total_s"],
                 "cold_replan_s": time.perf_counter() - w0, "cold_stopped_by": ref.search["stopped_by"]}
    return {**extra, "objective_s": new.predicted["objective_s"], "scenario": cluster.name, "devices": cluster.n,
            "cost_model": cost_model, "departed": int(gone),
            "stages": workload.stages, "replicas": workload.replicas,
            "first_plan_s": first_s, "cost_before": first.predicted["total_s"],
            "cost_after": new.predicted["total_s"], "lower_bound_after": new.search["lower_bound"],
            "gap_after": new.search["gap"], "moved_tasklets": new.predicted["moves"]["moved_tasklets"],
            "replan_s": secs, "replan_cpu_s": cpu, "stopped_by": new.search["stopped_by"],
            "evaluations": new.search["evaluations"], "load_before": load, "load_after": os.getloadavg()[0]}


def run_stop_bench(quick: bool = False, scenarios_path: str | None = None, large: bool = True,
                   cost_models: tuple[str, ...] = ("dtfm", "full"), permutations: int = 3,
                   cold_replans: bool = True) -> dict[str, Any]:
    """Every scenario under ``permutations`` device numberings (the first as listed) with default stopping."""
    path = scenarios_path or default_scenarios_path()
    base = Workload.preset("gpt3-xl-dtfm")
    clusters = [Cluster.from_scenario(path, name) for name in PAPER_SCENARIOS]
    clusters += [synthetic(name) for name in STOP_SCENARIOS_64]
    if large and not quick:
        clusters += [synthetic(name) for name in STOP_SCENARIOS_LARGE]
    rows, replans = [], []
    for cluster in clusters:
        w = base.with_split(8, _replicas(cluster.n))
        # the re-plan keeps one replica's worth of devices idle, so that a departure leaves D unchanged
        spare = base.with_split(8, max(1, _replicas(cluster.n) - 1))
        for cost_model in cost_models:
            for k in range(permutations):
                rows.append(stop_run(cluster, w, cost_model, None if k == 0 else 1000 + k))
                log.info("%s %s perm %d: %s", cluster.name, cost_model, k, rows[-1])
            replans.append(replan_run(cluster, spare, cost_model, cold=cold_replans and cluster.n <= 256))
    spread = {}
    for r in rows:
        spread.setdefault((r["scenario"], r["cost_model"]), []).append(r["cost"])
    summary = [{"scenario": s, "cost_model": m, "permutation_spread": max(c) / min(c) - 1.0}
               for (s, m), c in spread.items()]
    return {"runs": rows, "permutations": summary, "replan": replans}


def format_stop_table(result: dict[str, Any]) -> str:
    lines = ["| scenario | model | perm | cost @0.5 s / 1 s / 2 s | cost at stop | bound | gap | stopped by | "
             "s (load) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        at = " / ".join(_f(r[f"cost_at_{t:g}s"]) for t in CHECKPOINTS_S)
        lines.append(f"| {r['scenario']} | {r['cost_model']} | {r['permutation'] or 'as listed'} | {at} | "
                     f"{_f(r['cost'])} | {_f(r['lower_bound'])} | {100 * r['gap']:.1f} % | {r['stopped_by']} | "
                     f"{r['seconds']:.2f} ({r['load_before']:.1f}) |")
    lines += ["", "| scenario | model | cost spread over the numberings |", "| --- | --- | --- |"]
    lines += [f"| {s['scenario']} | {s['cost_model']} | {100 * s['permutation_spread']:.2f} % |"
              for s in result["permutations"]]
    lines += ["", "| re-plan after one departure | model | cost before / after | bound / gap after | moved | "
              "stopped by | re-plan s (load) | objective warm / cold (cold s) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["replan"]:
        cold = (f"{_f(r['objective_s'])} / {_f(r['cold_objective_s'])} ({r['cold_replan_s']:.2f})"
                if "cold_objective_s" in r else f"{_f(r.get('objective_s'))} / -")
        lines.append(f"| {r['scenario']} device {r['departed']} | {r['cost_model']} | {_f(r['cost_before'])} / "
                     f"{_f(r['cost_after'])} | {_f(r['lower_bound_after'])} / {100 * r['gap_after']:.1f} % | "
                     f"{r['moved_tasklets']} | {r['stopped_by']} | {r['replan_s']:.2f} ({r['load_before']:.1f}) | "
                     f"{cold} |")
    return "\n".join(lines)
