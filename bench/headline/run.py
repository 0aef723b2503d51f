"""Train one plan on the local emulated swarm and record what the headline needs from it.

The run goes through ``peer.emulation.local.LocalSwarm``, the object ``train_plan`` uses (the workers,
coordinator and driver that the daemons of ``peer swarm`` run too: no runtime of its own here). The bench keeps
the swarm open for three things ``train_plan`` does not return:

* when each step ended (wall clock since step 0 began), for loss against time;
* when each step's pipeline phase ended (the coordinator's ``reduce`` event: every micro-batch committed) and
  its averaging ended (``apply``), so measured phases compare with the cost model's ``pipeline_s``/``dp_s``;
* every worker's status after the last step, whose ``overrun_ops`` counts ops whose real compute took longer
  than the emulated device: non-zero means the figure measured this machine's CPU, not the emulated world.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tasklet.peer.emulation.local import LocalSwarm
from tasklet.peer.emulation.network import link_model
from tasklet.peer.runtime.lead.coordinator import Coordinator, StepReport
from tasklet.peer.runtime.spec import RunSpec
from tasklet.protocol.errors import TransportError
from tasklet.scheduler import Cluster, Plan, Workload

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 10.0


class DisturbedRunError(RuntimeError):
    """The swarm re-planned or dropped a pipeline mid-run (e.g. a worker missed heartbeats on a loaded
    machine): its step times would mix placements, so the run is not a measurement of the plan."""


@dataclass
class StepPhases:
    """Seconds from a step's start: all micro-batches committed (``pipeline_s``), averaging done (``dp_s``)."""

    pipeline_s: float
    dp_s: float


@dataclass
class PlanRun:
    """One trained plan: per-step seconds, losses, end times (s since step 0 began), phases, worker statuses."""

    step_seconds: list[float]
    losses: list[float]
    ended_at_s: list[float]
    phases: list[StepPhases] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)

    def measured_step_s(self, warmup_steps: int) -> float:
        """Median step time after the warm-up steps (first gRPC channels, first shaper clocks)."""
        return float(statistics.median(self.step_seconds[warmup_steps:]))

    def measured_phases(self, warmup_steps: int) -> StepPhases:
        """Median pipeline phase and median averaging phase after warm-up."""
        kept = self.phases[warmup_steps:]
        if not kept:
            return StepPhases(float("nan"), float("nan"))
        return StepPhases(float(statistics.median(p.pipeline_s for p in kept)),
                          float(statistics.median(p.dp_s for p in kept)))

    @property
    def overrun_ops(self) -> int:
        """Ops whose real compute exceeded the emulated time, summed over workers (-1: a status is missing)."""
        if not self.workers or any("overrun_ops" not in w for w in self.workers):
            return -1
        return int(sum(w["overrun_ops"] for w in self.workers))

    @property
    def compute_ops(self) -> int:
        return int(sum(w.get("forward", 0) + w.get("backward", 0) for w in self.workers))


class _PhaseClock:
    """Times of the coordinator's ``reduce`` and ``apply`` events (``on_event`` runs on its threads).

    A step's start is not an event, but the step report carries its duration, and the report is handed to
    ``on_step`` right as the step ends: start = (time of the report) - seconds. An attempt restarted by a death
    emits ``reduce`` again; the last one counts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, float] = {}

    def on_event(self, name: str, info: dict[str, Any]) -> None:
        if name in ("reduce", "apply"):
            with self._lock:
                self._marks[name] = time.monotonic()

    def phases(self, ended_at: float, step_s: float) -> StepPhases:
        """Phases of the step that ended at ``ended_at`` (monotonic) after ``step_s`` seconds; resets marks."""
        started = ended_at - step_s
        with self._lock:
            marks, self._marks = self._marks, {}
        reduce_at = marks.get("reduce", math.nan) - started
        apply_at = marks.get("apply", math.nan) - started
        return StepPhases(pipeline_s=reduce_at, dp_s=apply_at - reduce_at)


def run_plan(spec: RunSpec, cluster: Cluster, workload: Workload, plan: Plan, steps: int, *,
             on_step: Callable[[StepReport], None] | None = None, step_timeout_s: float = 300.0,
             log_dir: str | None = None) -> PlanRun:
    """Start one worker per device of ``cluster``, emulate its links and speeds, train ``steps`` steps."""
    n_used = 1 + max(d for p in plan.pipelines for d in p)
    if n_used > cluster.n:
        raise ValueError(f"plan uses device {n_used - 1}, the cluster has {cluster.n}")
    clock = _PhaseClock()
    ended: list[float] = []
    phases: list[StepPhases] = []

    def step_done(report: StepReport) -> None:
        now = time.monotonic()
        ended.append(now)
        phases.append(clock.phases(now, report.seconds))
        if on_step:
            on_step(report)

    with LocalSwarm(spec, n_used, links=link_model(cluster), forward_flops=workload.stage_forward_flops,
                    log_dir=log_dir) as swarm:
        swarm.coordinator.on_event = clock.on_event
        result = swarm.train(([tuple(s) for s in plan.stages], [list(p) for p in plan.pipelines]), steps,
                             on_step=step_done, step_timeout_s=step_timeout_s, collect_states=False)
        statuses = [_status(swarm.coordinator, ep) for ep in swarm.workers.endpoints]
    replans = [e["reason"] for e in result.events.replans if e["reason"] != "start"]
    dropped = [r.step for r in result.reports if r.dropped_pipelines or r.requeued]
    if replans or dropped:
        raise DisturbedRunError(f"re-plans {replans}, steps with dropped pipelines or requeued work {dropped}")
    first_start = ended[0] - result.step_seconds[0] if ended else 0.0
    return PlanRun(step_seconds=result.step_seconds, losses=result.losses,
                   ended_at_s=[t - first_start for t in ended], phases=phases,
                   workers=statuses)


def _status(coordinator: Coordinator, endpoint: str) -> dict[str, Any]:
    """A worker's status (its compute counters), or an ``error`` entry if it does not answer in time. Asked
    by the coordinator: the workers accept TLS connections only from the peers of their plan."""
    try:
        return coordinator.worker_status(endpoint, timeout_s=STATUS_TIMEOUT_S)
    except TransportError as exc:
        log.warning("status of %s: %s", endpoint, exc)
        return {"endpoint": endpoint, "error": str(exc)}
