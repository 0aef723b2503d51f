"""Discrete-event simulation of one training iteration of the Tasklet runtime, event by event.

Rules (the runtime's, see ``docs/scheduler.md``):
1. M micro-batches sit in a pool; a pipeline's stage-0 device pulls the lowest unassigned id whenever it is
   free and the pipeline has fewer than W = S micro-batches in flight (started, backward not yet finished at
   stage 0).
2. Each device runs one op at a time; a ready backward goes before a ready forward; among ops of one kind, the
   lowest micro-batch id first.
3. After an op, the activation (forward) or its gradient (backward) is sent to the next (previous) stage:
   each directed link carries one transfer at a time, FIFO; a transfer occupies it for bits / bw and arrives
   one-way delay after it left the link (delay is latency, not occupancy); sending never blocks the sender.
4. When every micro-batch has finished backward at stage 0 (the task pool is complete), every stage's
   data-parallel group synchronises (``schedule.sync_times``); the iteration ends when the last group has,
   plus the leader's control rounds (``Timing.control``, not simulated event by event).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .cluster import Cluster
from .plan import Plan
from .schedule import Timing, timing
from .workload import Workload

FWD, BWD = 0, 1


@dataclass
class SimResult:
    total_s: float
    stage_done_s: list[float]
    microbatches: list[int]
    events: int
    busy_s: dict[int, float] = field(default_factory=dict)


def simulate_timing(t: Timing, cluster: Cluster) -> SimResult:
    n_rep, n_st, n_mb, win = t.replicas, t.stages, t.n_microbatches, t.window
    m = t.m
    heap: list[tuple[float, int, int, tuple[int, ...]]] = []
    seq = 0
    arrive, done_ev = 0, 1

    def push(time: float, kind: int, payload: tuple[int, ...]) -> None:
        nonlocal seq
        heapq.heappush(heap, (time, seq, kind, payload))
        seq += 1

    busy = np.zeros((n_rep, n_st), dtype=bool)
    # per (pipeline, stage): heap of (0 = backward / 1 = forward, micro-batch id)
    ready: list[list[list[tuple[int, int]]]] = [[[] for _ in range(n_st)] for _ in range(n_rep)]
    in_flight = [0] * n_rep
    next_mb = 0
    counts = [0] * n_rep
    bwd_done = [0] * n_st
    stage_done = [0.0] * n_st
    link_free: dict[tuple[int, int], float] = {}
    busy_s: dict[int, float] = {}

    def send(now: float, r: int, s_from: int, s_to: int, mb: int, kind: int) -> None:
        i, j = int(m[r, s_from]), int(m[r, s_to])
        start = max(now, link_free.get((i, j), 0.0))
        xfer = 8.0 * t.activation_bytes / cluster.bandwidth_bps[i, j]
        link_free[i, j] = start + xfer
        push(start + xfer + cluster.delay_s[i, j], arrive, (r, s_to, mb, kind))

    def try_start(now: float, r: int, s: int) -> None:
        nonlocal next_mb
        if busy[r, s]:
            return
        q = ready[r][s]
        # backward first: BWD has key 0, FWD key 1 in the heap; stage 0 only ever queues backwards
        if q:
            key, mb = heapq.heappop(q)
            kind = BWD if key == 0 else FWD
        elif s == 0 and in_flight[r] < win and next_mb < n_mb:
            mb, kind = next_mb, FWD
            next_mb += 1
            in_flight[r] += 1
            counts[r] += 1
        else:
            return
        dur = t.bwd[r, s] if kind == BWD else t.fwd[r, s]
        busy[r, s] = True
        dev = int(m[r, s])
        busy_s[dev] = busy_s.get(dev, 0.0) + dur
        push(now + dur, done_ev, (r, s, mb, kind))

    for r in range(n_rep):
        try_start(0.0, r, 0)
    events = 0
    while heap:
        now, _, ev, (r, s, mb, kind) = heapq.heappop(heap)
        events += 1
        if ev == arrive:
            heapq.heappush(ready[r][s], (0 if kind == BWD else 1, mb))
            try_start(now, r, s)
            continue
        busy[r, s] = False
        if kind == FWD:
            if s == n_st - 1:
                heapq.heappush(ready[r][s], (0, mb))  # the loss is here: backward is ready at once
            else:
                send(now, r, s, s + 1, mb, FWD)
        else:
            bwd_done[s] += 1
            if bwd_done[s] == n_mb:
                stage_done[s] = now
            if s > 0:
                send(now, r, s, s - 1, mb, BWD)
            else:
                in_flight[r] -= 1  # the window slot is free again: try_start below may pull
        try_start(now, r, s)
    pool_complete = stage_done[0]
    return SimResult(total_s=pool_complete + float(np.max(t.sync)) + t.control, stage_done_s=stage_done,
                     microbatches=counts, events=events, busy_s=busy_s)


def simulate(cluster: Cluster, workload: Workload, plan: Plan) -> SimResult:
    """Simulate one iteration of ``plan``."""
    return simulate_timing(timing(cluster, workload, plan), cluster)
