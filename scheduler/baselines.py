"""Placements to compare against: random (a swarm whose devices join in arbitrary order), rank order
(Megatron's default: consecutive ranks form a pipeline), and the paper's genetic search (``paper_ga``).

All respect memory: a tasklet only goes to a device that can hold its (even) stage; the stages fewest devices
can hold are filled first, so a placement that fits is found whenever the greedy order allows one."""

from __future__ import annotations

import numpy as np

from .cluster import Cluster
from .errors import PlanningError
from .plan import Plan, even_stages
from .workload import Workload


def _split(cluster: Cluster, workload: Workload) -> tuple[int, int]:
    n_st, n_rep = workload.stages, workload.replicas
    if n_st is None or n_rep is None:
        raise PlanningError("stages", "baselines need a workload with stages and replicas set")
    if n_st * n_rep > cluster.n:
        raise PlanningError("replicas", f"{n_st} stages x {n_rep} replicas need {n_st * n_rep} devices, "
                            f"have {cluster.n}")
    return n_st, n_rep


def fits(cluster: Cluster, workload: Workload, n_st: int) -> np.ndarray:
    """(N, S) True where device n can hold even stage s."""
    stages = even_stages(workload.n_layers, n_st)
    need = np.array([workload.stage_memory_bytes(a, b, in_flight=n_st - s) for s, (a, b) in enumerate(stages)])
    return need[None, :] <= cluster.memory_bytes[:, None]


def place_in_order(order: np.ndarray, ok: np.ndarray, n_st: int, n_rep: int) -> np.ndarray:
    """Slots in rank order take the first unused device of ``order`` that fits; tight stages choose first.

    Where every device fits every stage this is exactly ``order[:S*D]`` cut into pipelines of S.
    """
    if ok.all():
        return np.asarray(order[: n_st * n_rep]).reshape(n_rep, n_st)
    m = np.full((n_rep, n_st), -1)
    used = np.zeros(ok.shape[0], dtype=bool)
    for s in np.argsort(ok.sum(axis=0), kind="stable"):
        for r in range(n_rep):
            d = next((int(d) for d in order if not used[d] and ok[d, s]), None)
            if d is None:
                raise PlanningError("memory_gb", f"too few devices can hold stage {s}")
            m[r, s] = d
            used[d] = True
    return m


def random_plan(cluster: Cluster, workload: Workload, seed: int) -> Plan:
    """Devices in a random order, cut into pipelines of S consecutive devices (skipping ones too small)."""
    n_st, n_rep = _split(cluster, workload)
    perm = np.random.default_rng(seed).permutation(cluster.n)
    m = place_in_order(perm, fits(cluster, workload, n_st), n_st, n_rep)
    return Plan(stages=even_stages(workload.n_layers, n_st), pipelines=m.tolist(),
                search={"algorithm": "random", "seed": seed})


def rank_order_plan(cluster: Cluster, workload: Workload) -> Plan:
    """``pipelines[r][s] = r * S + s``: rank order, as Megatron lays out pipeline groups (memory permitting)."""
    n_st, n_rep = _split(cluster, workload)
    m = place_in_order(np.arange(cluster.n), fits(cluster, workload, n_st), n_st, n_rep)
    return Plan(stages=even_stages(workload.n_layers, n_st), pipelines=m.tolist(),
                search={"algorithm": "rank-order"})
