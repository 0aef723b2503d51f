"""Reuse of lower bounds across re-plans: a bound of a cluster also bounds every cluster that is a part of it.

Why this is valid: a plan over a sub-cluster (some devices left, the rest unchanged) is also a plan over the
whole cluster, with the same cost, because both cost models read only the figures of the devices a plan uses
and of the links between them. So the optimum of the part is at least the optimum of the whole, which is at
least the whole's bound. After a departure the leader re-plans over such a part, and recomputing the bound
(seconds at 1,024 devices) would dominate a warm re-plan.

A cached bound is reused only when the new cluster's every device is found in the cached one by its label
*and* the delay, bandwidth and speed figures at those positions are identical (checked, not assumed), the
workload, S, D and cost model are equal, and the cached bound holds for the requested layer split (it was
computed for the same split, or for every split). A reused bound is looser than the part's own (the part
cannot do better than the whole), never wrong. Joins (a device the cache has never seen) compute afresh. A
bound of the quick tier (a warm re-plan's) is cached too, but given only to requests that accept that tier.
Memory: :data:`CACHE_ENTRIES` clusters of at most :data:`CACHE_MAX_DEVICES` devices, figures copied (at most
128 MiB; 32 MiB for two 1,024-device clusters).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from .cluster import Cluster
from .workload import Workload

CACHE_ENTRIES = 2  # the plan being run and the one before the last join
CACHE_MAX_DEVICES = 2048  # larger clusters are not cached: two N x N float64 arrays each (64 MiB at 2,048)


@dataclass
class _Entry:
    key: tuple
    stages: tuple[tuple[int, int], ...] | None
    index: dict[str, int]
    delay_s: np.ndarray
    bandwidth_bps: np.ndarray
    tflops: np.ndarray
    bound: float
    quick: bool  # the quick tier: given only to quick requests


def _key(workload: Workload, n_st: int, n_rep: int, cost_model: str) -> tuple:
    return cost_model, n_st, n_rep, tuple(sorted((k, repr(v)) for k, v in asdict(workload).items()))


class BoundCache:
    """Bounds of recently planned clusters, reused for any sub-cluster of one of them (see the module doc)."""

    def __init__(self, entries: int = CACHE_ENTRIES) -> None:
        self.size = entries
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _covers(self, e: _Entry, cluster: Cluster) -> bool:
        try:
            idx = np.fromiter((e.index[label] for label in cluster.labels), dtype=int, count=cluster.n)
        except KeyError:
            return False
        if len(set(idx.tolist())) != cluster.n:
            return False
        grid = np.ix_(idx, idx)
        return (np.array_equal(e.tflops[idx], cluster.tflops)
                and np.array_equal(e.delay_s[grid], cluster.delay_s)
                and np.array_equal(e.bandwidth_bps[grid], cluster.bandwidth_bps))

    def lookup(self, cluster: Cluster, workload: Workload, n_st: int, n_rep: int, cost_model: str,
               stages: list[tuple[int, int]] | None, quick: bool = False) -> float | None:
        """A cached bound valid for this cluster and split, or None; ``quick``: a quick-tier one will do."""
        key = _key(workload, n_st, n_rep, cost_model)
        want = None if stages is None else tuple((int(a), int(b)) for a, b in stages)
        with self._lock:
            for i, e in enumerate(self._entries):
                if e.key != key or (e.stages is not None and e.stages != want) or (e.quick and not quick):
                    continue
                if self._covers(e, cluster):
                    self._entries.insert(0, self._entries.pop(i))
                    self.hits += 1
                    return e.bound
            self.misses += 1
        return None

    def store(self, cluster: Cluster, workload: Workload, n_st: int, n_rep: int, cost_model: str,
              stages: list[tuple[int, int]] | None, bound: float, quick: bool = False) -> None:
        if cluster.n > CACHE_MAX_DEVICES or len(set(cluster.labels)) != cluster.n:
            return
        e = _Entry(key=_key(workload, n_st, n_rep, cost_model),
                   stages=None if stages is None else tuple((int(a), int(b)) for a, b in stages),
                   index={label: i for i, label in enumerate(cluster.labels)},
                   delay_s=np.array(cluster.delay_s, dtype=float), bandwidth_bps=np.array(cluster.bandwidth_bps,
                                                                                        dtype=float),
                   tflops=np.array(cluster.tflops, dtype=float), bound=float(bound), quick=quick)
        with self._lock:
            self._entries.insert(0, e)
            del self._entries[self.size:]

    def get(self, cluster: Cluster, workload: Workload, n_st: int, n_rep: int, cost_model: str,
            stages: list[tuple[int, int]] | None, compute: Callable[[], float], quick: bool = False) -> float:
        """The cached bound if one covers this cluster, else ``compute()`` (then cached, as quick or not)."""
        got = self.lookup(cluster, workload, n_st, n_rep, cost_model, stages, quick)
        if got is not None:
            return got
        bound = compute()
        self.store(cluster, workload, n_st, n_rep, cost_model, stages, bound, quick)
        return bound

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


BOUNDS = BoundCache()
