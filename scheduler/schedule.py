"""Per-tasklet timing facts shared by the ``full`` cost model and the discrete-event simulator.

Both must model exactly what the runtime does (see ``docs/scheduler.md``), so the numbers they start from are
computed once, here: forward / backward op times per (pipeline, stage), the transfer time of an activation or
activation gradient over every hop, and the duration of each stage's gradient synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cluster import Cluster
from .plan import Plan
from .workload import Workload

BACKWARD_FACTOR = 2.0
# The leader's control rounds (``peer.runtime.lead.machine``): each broadcast the step waits on, answered by a
# report from every worker of the plan. Measured on the local emulated swarm (``bench.scaling``, 8 and 16 worker
# processes on 2 shared cores, the coordinator unshaped on loopback): 0.03-0.04 s a round at 8 workers,
# 0.07-0.09 s at 16, about this much per worker (gRPC and the worker's task queue on a shared CPU). A swarm whose
# leader sits across a link adds that link's round trip per round (``control_time``'s ``leader_rtt_s``).
CONTROL_S_PER_WORKER = 0.005
EXACT_ROUNDS = 3  # start_step, reduce, apply


@dataclass
class Timing:
    """Times in seconds; ``m`` is the plan matrix (replicas x stages)."""

    m: np.ndarray
    fwd: np.ndarray  # (D, S) forward op time of one micro-batch
    bwd: np.ndarray  # (D, S) backward op time
    hop_fwd: np.ndarray  # (D, S-1) activation transfer stage s -> s+1: delay + bits / bw
    hop_bwd: np.ndarray  # (D, S-1) gradient transfer stage s+1 -> s
    xfer_fwd: np.ndarray  # (D, S-1) time the transfer occupies its link: bits / bw (the delay overlaps)
    xfer_bwd: np.ndarray  # (D, S-1)
    sync: np.ndarray  # (S,) reduce-scatter + all-gather of each stage's gradient
    n_microbatches: int
    window: int
    activation_bytes: float
    # the leader's control rounds per step, outside the pipeline and averaging phases: 0 in the search's
    # objective (for a given split it is a constant, and the lower bound stays tight without it); a prediction of
    # a run sets it (compression.timing_for)
    control: float = 0.0

    @property
    def replicas(self) -> int:
        return int(self.m.shape[0])

    @property
    def stages(self) -> int:
        return int(self.m.shape[1])


def control_time(n_workers: int, rounds: float, leader_rtt_s: float = 0.0) -> float:
    """Seconds per step of ``rounds`` control rounds over ``n_workers`` workers (``CONTROL_S_PER_WORKER``):
    a step waits on each round, so it is paid on top of the pipeline and averaging phases."""
    return float(rounds) * (CONTROL_S_PER_WORKER * n_workers + leader_rtt_s)


def stage_flops(workload: Workload, stages: list[tuple[int, int]]) -> np.ndarray:
    return np.array([workload.stage_forward_flops(a, b) for a, b in stages])


def sync_times(cluster: Cluster, workload: Workload, stages: list[tuple[int, int]], m: np.ndarray,
               bytes_factor: float = 1.0, digests: bool = True) -> np.ndarray:
    """Per stage: 2 phases x max over ordered member pairs of (delay + 8 (P_s / D) / bw), plus, with
    ``digests``, the largest one-way delay between members.

    ``bytes_factor`` scales the bytes sent (a compressed pseudo-gradient, :mod:`scheduler.compression`).

    Reduce-scatter then all-gather: in each phase every member sends a 1/D shard of the stage gradient to
    every other member at once, over independent links, so a phase lasts as long as its slowest pair. An exact
    step then checks the all-gather: every member sends every other one the digests of its contributions and
    waits for theirs (``peer.runtime.stage.sync``, phase 4), a third exchange whose bytes are negligible but
    whose slowest delay is not; a DiLoCo outer round ends with the all-gather (``digests=False``).
    """
    d = m.shape[0]
    out = np.zeros(m.shape[1])
    if d == 1:
        return out
    for s, (a, b) in enumerate(stages):
        g = m[:, s]
        shard = bytes_factor * workload.stage_param_bytes(a, b) / d
        delay = cluster.delay_s[np.ix_(g, g)].copy()
        t = delay + 8.0 * shard / cluster.bandwidth_bps[np.ix_(g, g)]
        np.fill_diagonal(t, 0.0)
        np.fill_diagonal(delay, 0.0)
        out[s] = 2.0 * t.max() + (delay.max() if digests else 0.0)
    return out


class GroupSync:
    """:func:`sync_times` remembered per (stage layers, group members): a search's swap changes at most two
    groups, so the other stages' syncs (O(D^2) each, most of a ``full`` evaluation at large D) are looked up."""

    MAX_ENTRIES = 200_000

    def __init__(self, cluster: Cluster, workload: Workload) -> None:
        self.cluster, self.workload = cluster, workload
        self._memo: dict[tuple[int, int, bytes], float] = {}

    def __call__(self, stages: list[tuple[int, int]], m: np.ndarray) -> np.ndarray:
        d = m.shape[0]
        out = np.zeros(m.shape[1])
        if d == 1:
            return out
        for s, (a, b) in enumerate(stages):
            g = np.sort(m[:, s])  # the slowest pair does not depend on the members' order
            key = (int(a), int(b), g.tobytes())
            got = self._memo.get(key)
            if got is None:
                got = float(sync_times(self.cluster, self.workload, [(a, b)], g[:, None])[0])
                if len(self._memo) >= self.MAX_ENTRIES:
                    self._memo.clear()
                self._memo[key] = got
            out[s] = got
        return out


def timing(cluster: Cluster, workload: Workload, plan: Plan, flops: np.ndarray | None = None,
           sync: GroupSync | None = None) -> Timing:
    """The per-tasklet times of ``plan``; ``sync``: a memo of group syncs to use (a search's evaluations)."""
    m = plan.matrix()
    if flops is None:
        flops = stage_flops(workload, plan.stages)
    fwd = flops[None, :] / (cluster.tflops[m] * 1e12)
    act = workload.activation_bytes()
    a, b = m[:, :-1], m[:, 1:]
    xfer_fwd = 8.0 * act / cluster.bandwidth_bps[a, b]
    xfer_bwd = 8.0 * act / cluster.bandwidth_bps[b, a]
    hop_fwd = cluster.delay_s[a, b] + xfer_fwd
    hop_bwd = cluster.delay_s[b, a] + xfer_bwd
    return Timing(
        m=m,
        fwd=fwd,
        bwd=BACKWARD_FACTOR * fwd,
        hop_fwd=hop_fwd,
        hop_bwd=hop_bwd,
        xfer_fwd=xfer_fwd,
        xfer_bwd=xfer_bwd,
        sync=sync_times(cluster, workload, plan.stages, m) if sync is None else sync(plan.stages, m),
        n_microbatches=workload.n_microbatches,
        window=m.shape[1],
        activation_bytes=act,
    )
