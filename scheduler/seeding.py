"""Starting layouts from a clustering of the devices by link speed.

Devices joined by fast, short links should share a pipeline (activations cross every hop, every micro-batch)
or a data-parallel group (gradients are exchanged all-to-all). Average-linkage hierarchical clustering on the
pairwise hop cost puts such devices next to each other in the dendrogram's leaf order; cutting that order into
consecutive runs gives good seeds whatever order the devices were listed in:

* pipeline-major: pipeline r = the r-th run of S devices (each pipeline inside one fast cluster), and
* stage-major: stage group s = the s-th run of D devices (each data-parallel group inside one cluster),
  then the pipeline through the groups is made optimal by :func:`layout.best_pipelines`;
* aligned: cut the dendrogram at its lowest merge heights into fast clusters, split them into pieces of at
  most S, bin-pack the pieces into the D pipelines (worst fit, largest first) and lay each pipeline's largest
  piece first, so that fast clusters occupy the *same* stage range in every pipeline. A hop is only as fast as
  its slowest pipeline, so fast hops only pay when they line up (``datacenter_spot``: 8 four-GPU instances
  become stages 0-3 of the 8 pipelines).
"""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import fcluster, leaves_list, linkage
from scipy.spatial.distance import squareform

from .layout import best_pipelines


def _linkage(link_cost: np.ndarray) -> np.ndarray:
    sym = 0.5 * (link_cost + link_cost.T)
    np.fill_diagonal(sym, 0.0)
    finite = np.isfinite(sym)
    sym = np.where(finite, sym, sym[finite].max() * 10 if finite.any() else 1.0)
    return linkage(squareform(sym, checks=False), method="average")


def cluster_order(link_cost: np.ndarray) -> np.ndarray:
    """Device order of the average-linkage dendrogram over the symmetrised link cost."""
    n = link_cost.shape[0]
    if n <= 2:
        return np.arange(n)
    return leaves_list(_linkage(link_cost)).astype(int)


def aligned(clusters: list[list[int]], stages: int, replicas: int) -> np.ndarray:
    """Spread cluster pieces over pipelines (worst fit), largest piece first in each (see module doc)."""
    pieces: list[list[int]] = []
    for c in clusters:
        pieces.extend(c[i:i + stages] for i in range(0, len(c), stages))
    pieces.sort(key=len, reverse=True)
    bins: list[list[list[int]]] = [[] for _ in range(replicas)]
    room = [stages] * replicas
    leftover: list[int] = []
    for piece in pieces:
        fit = int(np.argmax(room))  # worst fit: spread large pieces over pipelines, one each
        if room[fit] < len(piece):
            leftover.extend(piece)
        else:
            bins[fit].append(piece)
            room[fit] -= len(piece)
    m = np.empty((replicas, stages), dtype=int)
    for r in range(replicas):
        row = [d for piece in bins[r] for d in piece]
        while len(row) < stages:
            row.append(leftover.pop(0))
        m[r] = row
    return m


def aligned_seeds(link_cost: np.ndarray, stages: int, replicas: int, levels: int = 6
                  ) -> list[tuple[str, np.ndarray]]:
    """Aligned seeds for the lowest ``levels`` distinct merge heights of the dendrogram."""
    n = link_cost.shape[0]
    if n <= 2 or stages * replicas > n:
        return []
    z = _linkage(link_cost)
    out = []
    for h in np.unique(z[:, 2])[:levels]:
        labels = fcluster(z, t=h, criterion="distance")
        clusters = [list(np.flatnonzero(labels == k)) for k in np.unique(labels)]
        out.append((f"aligned@{h:.3g}", aligned(clusters, stages, replicas)))
    return out


def pipeline_major(order: np.ndarray, stages: int, replicas: int) -> np.ndarray:
    return np.asarray(order[: stages * replicas]).reshape(replicas, stages).copy()


def stage_major(order: np.ndarray, stages: int, replicas: int, pp: np.ndarray) -> np.ndarray:
    used = np.asarray(order[: stages * replicas])
    groups = [used[s * replicas:(s + 1) * replicas] for s in range(stages)]
    return best_pipelines(pp, groups)[1]


def seeds(link_cost: np.ndarray, stages: int, replicas: int) -> list[tuple[str, np.ndarray]]:
    """Named seed layouts (replicas x stages) built from the clustering order."""
    order = cluster_order(link_cost)
    pm = pipeline_major(order, stages, replicas)
    out = [("cluster-pipeline-major", pm)]
    if replicas > 1 and stages > 1:
        out.append(("cluster-stage-major", stage_major(order, stages, replicas, link_cost)))
        out.append(("cluster-pipeline-major+tsp",
                    best_pipelines(link_cost, [pm[:, s] for s in range(stages)])[1]))
        out.extend(aligned_seeds(link_cost, stages, replicas))
    return out


def sorted_seeds(pp: np.ndarray, dp: np.ndarray, stages: int, replicas: int) -> list[tuple[str, np.ndarray]]:
    """Stage groups cut from the devices sorted by how slow their links are (the memetic search's extra seeds).

    A hop costs as much as its slowest pipeline, so slow devices are best concentrated on a few hops rather
    than spread over all of them; the clustering order does not do that when slow devices sit in many small
    clusters (home connections). Two orders: median hop cost to the others, and the D - 1 cheapest partners'
    data-parallel cost (how well a device can sit in a group).
    """
    n = pp.shape[0]
    if stages * replicas > n or n < 2:
        return []
    off = ~np.eye(n, dtype=bool)
    sym = 0.5 * (pp + pp.T)
    slow = np.median(np.where(off, sym, np.nan), axis=1)
    d = np.where(off, dp, np.inf)
    k = max(1, min(replicas - 1, n - 1))
    group = np.partition(d, k - 1, axis=1)[:, :k].sum(axis=1)
    out = []
    for name, key in (("sorted-by-link", slow), ("sorted-by-group", group)):
        order = np.lexsort((np.arange(n), key))  # ties by id: only exact ties depend on the id order
        out.append((name, stage_major(order, stages, replicas, pp)))
    return out
