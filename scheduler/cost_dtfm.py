"""The paper's communication cost model (Yuan et al., NeurIPS 2022), reproduced exactly.

    total = DP + 2 PP
    DP    = max over stages s, over devices i of the group of s, of
            sum over the other members j of 2 (delay_ij + 8 G / (bw_ij D))
    PP    = sum over consecutive stages (s, s+1) of max over pipelines r of (delay + 8 A / bw) on that hop

Why this shape: in the paper's data-parallel exchange every device sends and receives a 1/D shard of the
stage gradient G to and from every peer (the factor 2), sequentially on its own link set, so the slowest
device of the slowest group bounds DP; in the pipeline, every hop of every micro-batch task carries one
activation A forward and one gradient back (the factor 2 on PP), and a hop is as slow as its slowest pipeline.

Everything here works on pair matrices precomputed once (:class:`DtfmPairs`), so that a plan's cost is a few
fancy-indexing operations and a swap of two devices can be evaluated incrementally by the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .cluster import Cluster
from .plan import Plan
from .workload import Workload


@dataclass
class DtfmPairs:
    """``dp[i, j] = 2 (delay_ij + 8 G / (bw_ij D))``, ``pp[i, j] = delay_ij + 8 A / bw_ij`` (diagonal 0)."""

    dp: np.ndarray
    pp: np.ndarray

    @classmethod
    def build(cls, cluster: Cluster, workload: Workload, stages: int, replicas: int) -> DtfmPairs:
        g = workload.dtfm_gradient_bytes(stages)
        a = workload.dtfm_activation_bytes_per_task()
        dp = 2.0 * (cluster.delay_s + 8.0 * g / (cluster.bandwidth_bps * replicas))
        pp = cluster.delay_s + 8.0 * a / cluster.bandwidth_bps
        np.fill_diagonal(dp, 0.0)
        np.fill_diagonal(pp, 0.0)
        return cls(dp=dp, pp=pp)


def dp_rows(pairs: DtfmPairs, m: np.ndarray) -> np.ndarray:
    """(S x D) per-device DP sums: row s holds, for each member i of group s, sum_j dp[i, j]."""
    g = m.T  # (S, D)
    return pairs.dp[g[:, :, None], g[:, None, :]].sum(axis=2)


def hop_rows(pairs: DtfmPairs, m: np.ndarray) -> np.ndarray:
    """((S-1) x D) one-way hop costs: row s holds pp[m[r, s], m[r, s+1]] for every pipeline r."""
    return pairs.pp[m[:, :-1], m[:, 1:]].T


def evaluate(pairs: DtfmPairs, m: np.ndarray) -> tuple[float, float, float]:
    """(total, DP, 2 PP) of the plan matrix ``m`` (replicas x stages)."""
    dp = float(dp_rows(pairs, m).max()) if m.shape[0] > 1 else 0.0
    pp = float(hop_rows(pairs, m).max(axis=1).sum()) if m.shape[1] > 1 else 0.0
    return dp + 2.0 * pp, dp, 2.0 * pp


def cost(cluster: Cluster, workload: Workload, plan: Plan) -> dict[str, Any]:
    """The paper's cost of ``plan``: ``total_s``, ``dp_s`` and ``pp_s`` (= 2 PP, both directions)."""
    m = plan.matrix()
    pairs = DtfmPairs.build(cluster, workload, m.shape[1], m.shape[0])
    total, dp, pp2 = evaluate(pairs, m)
    return {"total_s": total, "dp_s": dp, "pp_s": pp2, "cost_model": "dtfm"}
