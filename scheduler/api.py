"""``plan()``: the one call the daemon makes — choose S and D if needed, check memory, search, predict."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from . import cost_dtfm, cost_full
from .bound import gap as gap_of
from .bound import lower_bound
from .canonical import canonical_order
from .cluster import Cluster
from .compression import CompressedCost, CompressionSpace, refine
from .compression import predict as compression_predict
from .cost_dtfm import DtfmPairs
from .errors import PlanningError
from .layers import SplitCost, fits_memory, fixed_split_cost
from .memetic import MemeticConfig, run_memetic
from .plan import Plan, even_stages
from .schedule import stage_flops, timing
from .search import CallableObjective, DtfmObjective, SearchConfig, SearchResult, run_search
from .seeding import seeds
from .workload import Workload

log = logging.getLogger(__name__)

COST_MODELS = ("dtfm", "full")


def memory_violations(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]], strict: bool = True
                      ) -> np.ndarray:
    """(N, S) True where device n cannot hold stage s (weights, grads, AdamW, S - s stashed micro-batches).

    ``strict``: a stage no device can hold is an error; without it (uneven splits may still fit) only a model
    whose smallest possible stage fits no device is.
    """
    n_st = len(stages)
    need = np.array([workload.stage_memory_bytes(a, b, in_flight=n_st - s)
                     for s, (a, b) in enumerate(stages)])
    bad = need[None, :] > cluster.memory_bytes[:, None]
    if not strict:
        one = min(workload.stage_memory_bytes(a, a + 1, in_flight=1) for a in range(workload.n_layers))
        if one > cluster.memory_bytes.max():
            raise PlanningError("memory_gb", f"no single layer fits: it needs {one / 1e9:.2f} GB, the largest "
                                f"device has {cluster.memory_bytes.max() / 1e9:.2f} GB")
        return bad
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


ALGORITHMS = ("memetic", "ils")
DEFAULT_GAP = 0.02  # stop once the plan is proven within 2 % of optimal
DEFAULT_TIME_S_64 = 5.0  # default search time limit for 64 devices (wall seconds), scaled by sqrt(N / 64)


def default_time_limit(n_devices: int) -> float:
    """The search's default wall-time limit: 5 s for 64 devices, growing with the square root of N.

    Why the square root: a local search step costs O(D) to O(N) and the bound usually ends the search first;
    the limit is a guard for the leader (the swarm waits on a re-plan), not the expected time.
    """
    return DEFAULT_TIME_S_64 * float(np.sqrt(max(n_devices, 1) / 64.0))


# Evaluations of the memetic search per CPU second of one core (N devices, 8 x N/8 tasklets): the slowest seen on
# the machine the defaults were set on (docs/scheduler.md, "The evaluation budget"; the same search's rate varied
# by 40 % from run to run there); between the points, log-linear in N.
EVALUATION_RATE: dict[str, tuple[tuple[int, float], ...]] = {
    "dtfm": ((64, 127e3), (256, 176e3), (1024, 57e3)),
    "full": ((64, 3.9e3), (256, 1.1e3), (1024, 0.55e3)),
}
BUDGET_SHARE = 0.6  # of a time limit, spent at those rates: the rest is the bound, the seeds and a slower machine


def evaluation_budget(n_devices: int, cost_model: str, time_limit_s: float) -> int:
    """The evaluations a default search may make under ``time_limit_s``: :data:`BUDGET_SHARE` of it at
    :data:`EVALUATION_RATE`.

    Why a count and not only the clock: the search is deterministic up to its stop, so a count makes the same
    scenario give the same plan on every run and under every numbering of its devices (the canonical order);
    the time limit stays the guard on a slower or loaded machine, and then the plan depends on when it fell.
    """
    points = EVALUATION_RATE[cost_model]
    x = float(np.log2(max(n_devices, 1)))
    rate = float(np.interp(x, [np.log2(n) for n, _ in points], [r for _, r in points]))
    return max(1000, int(BUDGET_SHARE * time_limit_s * rate))


def _memetic_config(cfg: MemeticConfig | None, seed: int, time_limit_s: float | None, cost_model: str,
                    gap_stop: float | None, n_devices: int) -> MemeticConfig:
    base = cfg or MemeticConfig()
    out = MemeticConfig(**{**base.__dict__, "seed": seed,
                           "time_limit_s": time_limit_s if time_limit_s is not None else base.time_limit_s})
    if gap_stop is not None:
        out.gap = gap_stop
    if cost_model == "full" and cfg is None:  # every evaluation is a full prediction: a smaller budget
        out.max_evaluations, out.population = min(out.max_evaluations, 6000), min(out.population, 4)
    if cfg is None and time_limit_s is not None:
        out.max_evaluations = min(out.max_evaluations, evaluation_budget(n_devices, cost_model, time_limit_s))
    return out


def search_layout(cluster: Cluster, workload: Workload, cost_model: str, seed: int, time_limit_s: float | None,
                  config: SearchConfig | MemeticConfig | None, algorithm: str,
                  stages: list[tuple[int, int]] | None, slot_cost: np.ndarray | None = None,
                  extra_starts: list[tuple[str, np.ndarray]] | None = None,
                  compression: CompressionSpace | None = None, gap_stop: float | None = None,
                  canonical: bool = True, cold_seeds: bool = True, quick_bound: bool = False
                  ) -> tuple[np.ndarray, list[tuple[int, int]], SearchResult, float, SplitCost | None]:
    """The search proper for a workload with S and D set: (matrix, layer split, result, bound, split model).

    ``canonical``: search over the devices in :func:`canonical.canonical_order` and map the result back, so
    that the same scenario under any numbering of its devices gets the same plan (up to exact ties).
    ``gap_stop``: the memetic search stops once its best is within this fraction of the lower bound.
    ``cold_seeds``: add the clustering seeds to ``extra_starts`` (a warm re-plan starts from its own only).
    ``quick_bound``: a bound no cached one covers is the quick tier (:func:`bound.lower_bound`).
    The returned split model (``full`` with uneven splits) is over the canonically ordered devices.
    A wall-clock ``time_limit_s`` counts the whole call: the bound, the seeds and the ordering are taken from
    the search's share (which keeps at least :data:`MIN_SEARCH_S`).
    """
    started = time.perf_counter()
    if not canonical:
        return _search_layout(cluster, workload, cost_model, seed, time_limit_s, config, algorithm, stages,
                              slot_cost, extra_starts, compression, gap_stop, cold_seeds, started, quick_bound)
    perm = canonical_order(cluster)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    starts = [(name, inv[np.asarray(m, dtype=int)]) for name, m in (extra_starts or [])]
    m, layer_split, res, bound, split = _search_layout(
        cluster.subset(perm), workload, cost_model, seed, time_limit_s, config, algorithm, stages,
        None if slot_cost is None else slot_cost[perm], starts, compression, gap_stop, cold_seeds, started,
        quick_bound)
    res.matrix, res.spares = perm[res.matrix], perm[res.spares]
    return perm[m], layer_split, res, bound, split


MIN_SEARCH_S = 0.05  # the search's share of a time limit the setup (bound, seeds) already used up


def _remaining(limit: float | None, cpu_clock: bool, started: float | None) -> float | None:
    """A wall-clock limit less the seconds since ``started``; CPU-clock limits count the search only."""
    if limit is None or cpu_clock or started is None:
        return limit
    return max(MIN_SEARCH_S, limit - (time.perf_counter() - started))


def _search_layout(cluster: Cluster, workload: Workload, cost_model: str, seed: int, time_limit_s: float | None,
                   config: SearchConfig | MemeticConfig | None, algorithm: str,
                   stages: list[tuple[int, int]] | None, slot_cost: np.ndarray | None,
                   extra_starts: list[tuple[str, np.ndarray]] | None, compression: CompressionSpace | None,
                   gap_stop: float | None, cold_seeds: bool = True, started: float | None = None,
                   quick_bound: bool = False
                   ) -> tuple[np.ndarray, list[tuple[int, int]], SearchResult, float, SplitCost | None]:
    """:func:`search_layout` over the devices as listed.

    ``stages`` fixes the layer split; otherwise the ``full`` model chooses a split per layout (uneven) and the
    ``dtfm`` model keeps the even one (its G is the model spread evenly). ``compression`` (``full`` only): each
    layout is priced with its cheapest feasible compression choice (:mod:`scheduler.compression`); the layer
    split is then fixed (given or even).
    """
    n_st, n_rep = workload.stages, workload.replicas
    assert n_st is not None and n_rep is not None
    uneven = stages is None and cost_model == "full" and compression is None
    layer_split = stages or even_stages(workload.n_layers, n_st)
    mem_bad = memory_violations(cluster, workload, layer_split, strict=not uneven)
    split: SplitCost | None = None
    if cost_model == "dtfm":
        pairs = DtfmPairs.build(cluster, workload, n_st, n_rep)
        obj: DtfmObjective | CallableObjective = DtfmObjective(pairs, n_st, n_rep, mem_bad if mem_bad.any() else None,
                                                               slot_cost)
        link, group_cost = pairs.pp, pairs.dp
    else:
        link = cluster.transfer_s(workload.activation_bytes())
        group_cost = link + link.T
        if compression is not None:
            obj = CallableObjective(CompressedCost(cluster, workload, layer_split, compression), n_st, n_rep,
                                    mem_bad if mem_bad.any() else None, slot_cost)
        elif uneven:
            split = SplitCost(cluster, workload, n_st)
            obj = CallableObjective(split, n_st, n_rep, None, slot_cost)
        else:
            obj = CallableObjective(fixed_split_cost(cluster, workload, layer_split), n_st, n_rep,
                                    mem_bad if mem_bad.any() else None, slot_cost)
    bound = lower_bound(cluster, workload, n_st, n_rep, cost_model,
                        pairs if cost_model == "dtfm" else None, stages, quick=quick_bound)
    if compression is not None:  # the bound is of uncompressed steps: compressed ones may beat it
        bound = 0.0
    starts = list(extra_starts or [])
    if cold_seeds or not starts:
        starts += seeds(link, n_st, n_rep)
    if algorithm == "ils":
        base = config if isinstance(config, SearchConfig) else SearchConfig()
        cfg = SearchConfig(**{**base.__dict__, "seed": seed,
                              "time_limit_s": time_limit_s if time_limit_s is not None else base.time_limit_s})
        if cost_model == "full" and config is None:
            cfg.max_evaluations = min(cfg.max_evaluations, 4000)
        cfg.time_limit_s = _remaining(cfg.time_limit_s, cfg.cpu_clock, started)
        res = run_search(obj, starts, cluster.n, cfg)
    else:
        mcfg = _memetic_config(config if isinstance(config, MemeticConfig) else None, seed, time_limit_s,
                               cost_model, gap_stop, cluster.n)
        mcfg.cold_seeds = mcfg.cold_seeds and cold_seeds
        mcfg.time_limit_s = _remaining(mcfg.time_limit_s, mcfg.cpu_clock, started)
        # per-slot costs (moves, memory penalties) are >= 0, so the bound of the cost bounds the objective too
        res = run_memetic(obj, starts, cluster.n, mcfg, group_cost, link, bound)
    m = res.matrix
    if uneven:
        assert split is not None
        layer_split = split.best(m)[1]
    return m, layer_split, res, bound, split


def stopping(n_devices: int, config: SearchConfig | MemeticConfig | None, gap: float | None,
             time_limit_s: float | None) -> tuple[float | None, float | None]:
    """(gap target, time limit) of a search: the defaults apply where neither argument nor config sets them."""
    if gap is not None and not 0.0 <= gap < 1.0:
        raise PlanningError("gap", f"must be in [0, 1), got {gap!r}")
    if gap is None:
        gap = config.gap if isinstance(config, MemeticConfig) else None if config is not None else DEFAULT_GAP
    if time_limit_s is None and config is None:
        time_limit_s = default_time_limit(n_devices)
    return gap, time_limit_s


def plan(cluster: Cluster, workload: Workload, cost_model: str = "full", seed: int = 0,
         time_limit_s: float | None = None, config: SearchConfig | MemeticConfig | None = None,
         algorithm: str | None = None, stages: list[tuple[int, int]] | None = None,
         compression: CompressionSpace | None = None, gap: float | None = None,
         canonical: bool | None = None) -> Plan:
    """Place every (replica, stage) tasklet on a device; see ``docs/scheduler.md``.

    ``algorithm``: ``"memetic"`` (default) or ``"ils"`` (the previous iterated local search; also chosen when
    ``config`` is a :class:`SearchConfig`). ``stages`` fixes the layer ranges (a run keeps its split after the
    first plan); otherwise the ``full`` model picks an uneven split per layout inside the search.
    ``compression``: choose per-boundary activation compression and the data-parallel sync (period, pseudo-
    gradient encoding) together with the placement, under the space's loss-penalty limit (``full`` only); the
    choice is ``plan.predicted["choice"]`` and the prediction is of a step under it.

    Stopping: the search ends once its plan is proven within ``gap`` of optimal by the lower bound (default
    :data:`DEFAULT_GAP`, or ``config.gap`` when a config is given), at the evaluation budget of ``time_limit_s``
    (:func:`evaluation_budget`; without a config) or at ``time_limit_s`` itself (default, when no config is given
    either: :func:`default_time_limit`); ``plan.search["stopped_by"]`` says which rule did.
    ``canonical``: search the devices in a canonical order, so that their numbering does not change the plan
    (default: yes unless a config is given -- an explicit budget keeps reproducing the listed-order search).
    """
    if cost_model not in COST_MODELS:
        raise PlanningError("cost_model", f"must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    if compression is not None and cost_model != "full":
        raise PlanningError("cost_model", "compression choices need the 'full' cost model")
    if algorithm is None:
        algorithm = "ils" if isinstance(config, SearchConfig) else "memetic"
    if algorithm not in ALGORITHMS:
        raise PlanningError("algorithm", f"must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if stages is not None:
        stages = [(int(a), int(b)) for a, b in stages]
        Plan(stages, [list(range(len(stages)))]).validate(1 << 30, workload.n_layers)
        if workload.stages not in (None, len(stages)):
            raise PlanningError("stages", f"{len(stages)} layer ranges for a workload of {workload.stages} stages")
        workload = workload.with_split(len(stages), workload.replicas or max(1, cluster.n // len(stages)))
    if workload.stages is None or workload.replicas is None:
        n_st, n_rep = choose_split(cluster, workload, cost_model)
        workload = workload.with_split(n_st, n_rep)
    n_st, n_rep = workload.stages, workload.replicas
    assert n_st is not None and n_rep is not None
    if n_st * n_rep > cluster.n:
        raise PlanningError("replicas", f"{n_st} stages x {n_rep} replicas need {n_st * n_rep} devices, the "
                            f"scenario has {cluster.n}")
    gap_stop, time_limit_s = stopping(cluster.n, config, gap, time_limit_s)
    cpu0 = time.process_time()
    m, layer_split, res, bound, _ = search_layout(cluster, workload, cost_model, seed, time_limit_s, config,
                                                  algorithm, stages, compression=compression, gap_stop=gap_stop,
                                                  canonical=config is None if canonical is None else canonical)
    cpu = time.process_time() - cpu0
    if not fits_memory(cluster, workload, layer_split, m):
        raise PlanningError("memory_gb", "no placement puts every stage on a device that can hold it")
    out = Plan(stages=layer_split, pipelines=m.tolist())
    out.validate(cluster.n, workload.n_layers)
    if compression is not None:
        choice = refine(cluster, workload, out, CompressedCost(cluster, workload, layer_split, compression).best(m)[1],
                        compression)
        out.predicted = compression_predict(cluster, workload, out, choice, compression.penalties)
    else:
        out.predicted = predict(cluster, workload, out, cost_model)
    total = float(out.predicted["total_s"])
    out.search = {"algorithm": "tasklet-memetic" if algorithm == "memetic" else "tasklet-ils",
                  "seconds": round(res.seconds, 4), "cpu_seconds": round(cpu, 4),
                  "evaluations": res.evaluations, "seed": seed, "start": res.start, "stages": n_st,
                  "replicas": n_rep, "idle_devices": [int(x) for x in res.spares],
                  "lower_bound": float(bound), "gap": round(gap_of(total, bound), 6),
                  "stopped_by": res.stopped_by, "gap_target": gap_stop,
                  "time_limit_s": None if time_limit_s is None else round(time_limit_s, 3)}
    if algorithm == "memetic":
        out.search["generations"] = res.generations
    return out
