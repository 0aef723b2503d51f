"""Placements to compare against: random (a swarm whose devices join in arbitrary order), rank order
(Megatron's default: consecutive ranks form a pipeline), and the paper's genetic search (``paper_ga``)."""

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


def random_plan(cluster: Cluster, workload: Workload, seed: int) -> Plan:
    """Devices in a random order, cut into pipelines of S consecutive devices."""
    n_st, n_rep = _split(cluster, workload)
    perm = np.random.default_rng(seed).permutation(cluster.n)[: n_st * n_rep]
    return Plan(stages=even_stages(workload.n_layers, n_st), pipelines=perm.reshape(n_rep, n_st).tolist(),
                search={"algorithm": "random", "seed": seed})


def rank_order_plan(cluster: Cluster, workload: Workload) -> Plan:
    """``pipelines[r][s] = r * S + s``: rank order, as Megatron lays out pipeline groups."""
    n_st, n_rep = _split(cluster, workload)
    return Plan(stages=even_stages(workload.n_layers, n_st),
                pipelines=np.arange(n_st * n_rep).reshape(n_rep, n_st).tolist(),
                search={"algorithm": "rank-order"})
