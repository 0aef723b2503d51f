"""Pacing: what the leader learns about micro-batch times from step to step (peer.timing, "Stragglers").

A step's task pool needs three figures from the steps before it: how long a lease lasts, after how long a
pipeline's head micro-batch counts as overdue (speculation), and each pipeline's seconds per micro-batch (the
pool paces a slow pipeline's leases by them). This object keeps the measurements those come from; it is only
read when a step starts and written when one ends (and as commits arrive), so it needs no lock of its own
beyond its owner's.
"""

from __future__ import annotations

import statistics
from collections import deque

from tasklet.peer.runtime.lead.pool import TaskPool
from tasklet.peer.timing import (
    LEASE_FACTOR,
    LEASE_FLOOR_S,
    SPECULATE_FACTOR,
    SPECULATE_FLOOR_S,
    SPECULATE_FORWARD_FACTOR,
)

SAT_OUT_DECAY = 0.7  # a paced pipeline's carried seconds per micro-batch shrink by this for each step it sat out


class Pacing:
    """Measured micro-batch times and the figures the next step's pool is built with."""

    def __init__(self) -> None:
        self.mb_seconds: deque[float] = deque(maxlen=64)  # lease-to-commit seconds of committed micro-batches
        self.head_seconds: deque[float] = deque(maxlen=64)  # head-of-window to commit (TaskPool.head_latencies)
        self.forward_seconds: deque[float] = deque(maxlen=64)  # forward head to loss (TaskPool.forward_latencies)
        self.predicted_mb_s: float | None = None  # the plan's predicted figure (``predict``; None: unknown)
        self.speculation = True
        # (epoch, pipeline -> seconds per micro-batch) measured in the last step: paces the next step's leases
        self.pipeline_service_s: tuple[int, dict[int, float]] = (-1, {})

    def predict(self, mb_s: float) -> None:
        """The plan's predicted seconds of a micro-batch: leases start from it until steps are measured."""
        self.predicted_mb_s = mb_s

    def service_s(self, epoch: int) -> dict[int, float] | None:
        """The pacing figures for a step of plan ``epoch`` (None: the last step was of another plan)."""
        return self.pipeline_service_s[1] if self.pipeline_service_s[0] == epoch else None

    def record(self, epoch: int, pool: TaskPool) -> None:
        """A step of plan ``epoch`` ended (applied, or at least its inner step): keep what its pool measured."""
        self.pipeline_service_s = (epoch, self.carry_service(epoch, pool.measured_service_s()))
        self.head_seconds.extend(pool.head_latencies)
        self.forward_seconds.extend(pool.forward_latencies)

    def carry_service(self, epoch: int, measured: dict[int, float]) -> dict[int, float]:
        """The pacing figures for the next step: this step's measurement, and for a pipeline of the same plan
        that sat the step out (paced: it leased nothing) its previous figure, shrunk by ``SAT_OUT_DECAY``.
        Forgetting the figure would hand a 5x-slow pipeline work again the very next step (every other step
        slow); keeping it for ever would shut out for the whole plan a pipeline that was slow once (a warm-up).
        """
        last_epoch, previous = self.pipeline_service_s
        if last_epoch != epoch:
            return dict(measured)
        carried = {p: s * SAT_OUT_DECAY for p, s in previous.items() if p not in measured}
        return {**carried, **measured}

    def expected_mb_s(self) -> float | None:
        """Expected lease-to-commit seconds of a micro-batch: the median measured, else the plan's figure."""
        if len(self.mb_seconds) >= 3:
            return statistics.median(self.mb_seconds)
        return self.predicted_mb_s

    def lease_timeout_s(self, step_timeout_s: float) -> float:
        expected = self.expected_mb_s()
        if expected is None:
            return step_timeout_s
        return min(step_timeout_s, max(LEASE_FLOOR_S, LEASE_FACTOR * expected))

    def speculate_after_s(self) -> tuple[float | None, float | None]:
        """How long a pipeline's head micro-batch may be held before the pool copies its work (TaskPool): a
        factor x the 80th percentile of the head latencies measured in earlier steps (else the plan's predicted
        figure), over a floor; and the same for the wait of its oldest micro-batch without a loss (forward
        latencies; None until 3 are measured). Not the median: a step's first micro-batch of each pipeline
        crosses every stage before it commits (2x a later, pipelined one here), and a healthy pipeline's first
        micro-batch is no straggler. Nor, before a step has ended, the lease-to-commit times measured so far:
        in a plan's first step they come from its fastest pipelines, and a healthy pipeline on longer links was
        given up on against them (CI, the headline bench's step 0)."""
        expected = (statistics.quantiles(self.head_seconds, n=5)[-1] if len(self.head_seconds) >= 3
                    else self.predicted_mb_s)
        if expected is None or not self.speculation:
            return None, None
        forward = (max(SPECULATE_FLOOR_S,
                       SPECULATE_FORWARD_FACTOR * statistics.quantiles(self.forward_seconds, n=5)[-1])
                   if len(self.forward_seconds) >= 3 else None)
        return max(SPECULATE_FLOOR_S, SPECULATE_FACTOR * expected), forward
