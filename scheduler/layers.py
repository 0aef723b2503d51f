"""Uneven layer splits inside the search: each candidate layout gets the layer ranges that suit its devices.

A stage on faster devices may hold more layers, and a stage whose group has little memory fewer. For a layout
(plan matrix) the candidates are the contiguous splits that minimise ``max_s (forward FLOPs of stage s) /
speed_s`` under every stage's memory limit, for two notions of a stage's speed: the summed TFLOP/s of its
group (pipelines pull micro-batches, so a group shares its stage's work) and the slowest member's (each
pipeline is as fast as its slowest stage). The ``full`` model prices both and the cheaper wins.

The split is a linear-partition dynamic programme over precomputed tables (FLOPs and memory of every layer
range at every stage position), vectorised over the range start, so it costs S numpy steps per layout;
results are cached by the stage speeds and capacities, which many swaps leave unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import cost_full
from .cluster import Cluster
from .plan import Plan, even_stages
from .schedule import GroupSync, stage_flops, timing
from .workload import Workload

MEMORY_PENALTY = 1e6


class LayerTable:
    """FLOPs and memory of every layer range [a, b) at every stage position s (in-flight = S - s)."""

    def __init__(self, workload: Workload, n_st: int) -> None:
        n_lay = workload.n_layers
        self.n_lay, self.n_st = n_lay, n_st
        self.flops = np.full((n_lay + 1, n_lay + 1), np.inf)
        self.mem = np.full((n_st, n_lay + 1, n_lay + 1), np.inf)
        for a in range(n_lay):
            for b in range(a + 1, n_lay + 1):
                self.flops[a, b] = workload.stage_forward_flops(a, b)
                for s in range(n_st):
                    self.mem[s, a, b] = workload.stage_memory_bytes(a, b, in_flight=n_st - s)

    def split(self, speed: np.ndarray, cap: np.ndarray) -> list[tuple[int, int]] | None:
        """Contiguous split minimising max_s flops_s / speed_s with mem_s <= cap_s; None if none fits."""
        n_st, n_lay = self.n_st, self.n_lay
        best = np.full(n_lay + 1, np.inf)
        best[0] = 0.0
        args = np.zeros((n_st, n_lay + 1), dtype=int)
        for s in range(n_st):
            t = np.where(self.mem[s] <= cap[s], self.flops / speed[s], np.inf)  # (a, b)
            v = np.maximum(best[:, None], t)
            args[s] = v.argmin(axis=0)
            best = v.min(axis=0)
            best[: s + 1] = np.inf  # s + 1 stages need at least s + 1 layers
        if not np.isfinite(best[n_lay]):
            return None
        out, b = [], n_lay
        for s in range(n_st - 1, -1, -1):
            a = int(args[s, b])
            out.append((a, b))
            b = a
        return out[::-1]


class SplitCost:
    """``f(m)``: the ``full`` cost of layout ``m`` with its best layer split (see the module doc).

    Memory: a layout no split fits gets the even split's cost plus a penalty per tasklet that cannot hold its
    even stage, which leads the search back to layouts that fit.
    """

    def __init__(self, cluster: Cluster, workload: Workload, n_st: int) -> None:
        self.cluster, self.workload, self.n_st = cluster, workload, n_st
        self.table = LayerTable(workload, n_st)
        self.even = even_stages(workload.n_layers, n_st)
        self.even_need = np.array([workload.stage_memory_bytes(a, b, in_flight=n_st - s)
                                   for s, (a, b) in enumerate(self.even)])
        self._splits: dict[bytes, list[list[tuple[int, int]]]] = {}
        self.sync = GroupSync(cluster, workload)

    def candidates(self, m: np.ndarray) -> list[list[tuple[int, int]]]:
        t = self.cluster.tflops[m]
        cap = self.cluster.memory_bytes[m].min(axis=0)
        key = np.concatenate([t.sum(axis=0), t.min(axis=0), cap]).tobytes()
        got = self._splits.get(key)
        if got is None:
            got = []
            for speed in (t.sum(axis=0), t.min(axis=0)):
                sp = self.table.split(speed, cap)
                if sp is not None and sp not in got:
                    got.append(sp)
            if len(self._splits) > 100_000:
                self._splits.clear()
            self._splits[key] = got
        return got

    def _cost(self, m: np.ndarray, stages: list[tuple[int, int]]) -> float:
        p = Plan(stages, m.tolist())
        return float(cost_full.predict_timing(timing(self.cluster, self.workload, p,
                                                     stage_flops(self.workload, stages), self.sync))["total_s"])

    def best(self, m: np.ndarray) -> tuple[float, list[tuple[int, int]]]:
        """(cost, layer split) of layout ``m``; the cost includes the memory penalty when nothing fits."""
        cands = self.candidates(m)
        if not cands:
            bad = self.even_need[None, :] > self.cluster.memory_bytes[m]
            return self._cost(m, self.even) + MEMORY_PENALTY * float(bad.sum()), self.even
        scored = [(self._cost(m, sp), sp) for sp in cands]
        return min(scored, key=lambda t: t[0])

    def __call__(self, m: np.ndarray) -> float:
        return self.best(m)[0]


def fixed_split_cost(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]]
                     ) -> Callable[[np.ndarray], float]:
    """``f(m)`` of the ``full`` model with the layer split fixed (a re-plan keeps the run's split)."""
    flops = stage_flops(workload, stages)
    sync = GroupSync(cluster, workload)

    def f(m: np.ndarray) -> float:
        return float(cost_full.predict_timing(timing(cluster, workload, Plan(stages, m.tolist()), flops,
                                                     sync))["total_s"])

    return f


def fits_memory(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]], m: np.ndarray) -> bool:
    """Whether every tasklet's device holds its stage (weights, grads, AdamW, S - s stashed micro-batches)."""
    n_st = len(stages)
    need = np.array([workload.stage_memory_bytes(a, b, in_flight=n_st - s) for s, (a, b) in enumerate(stages)])
    return bool((need[None, :] <= cluster.memory_bytes[m]).all())
