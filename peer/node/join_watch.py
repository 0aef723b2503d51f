"""Which phase of taking part this peer is in, and why, derived once a heartbeat from what the daemon knows.

The daemon reports the device measurement itself and the stage fetches arrive from the worker; the rest is read
here (:meth:`JoinWatch.tick`) and handed to the :class:`~peer.observe.phases.PhaseReporter`: measuring links
until the prober's first round, waiting (paused by the owner or the schedule, no leader the organiser trusts, the
swarm paused by its leader, no leader yet, this peer planning as leader, no stage fits this device's memory, not
in the current plan, no assignment yet), or training (this peer's own steps/s, tokens/s and compute busy share
over the last ``RATE_WINDOW_S``). It only reads: what a peer shows never changes what it does.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasklet.peer.node.roles import State
from tasklet.peer.observe.phases import PhaseReporter
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.swarm.plans import PlanRecord

log = logging.getLogger(__name__)

RATE_WINDOW_S = 30.0  # this peer's rates are averaged over this long


@dataclass(frozen=True)
class WatchSources:
    """What the watch reads of its daemon, each read once a tick."""

    worker_status: Callable[[], dict[str, Any]]
    role_state: Callable[[], State]
    waiting_line: Callable[[], str | None]  # why no leader may lead (the organiser's stewards all gone), or None
    beat: Callable[[], dict[str, Any] | None]  # the followed leader's last beat
    elected: Callable[[], str | None]
    leading: Callable[[], bool]
    followed_plan: Callable[[], PlanRecord | None]
    paused_by: Callable[[], str | None]  # "owner" or "schedule" while this peer's owner paused it, else None
    probe_rounds: Callable[[], int]  # link-probe rounds this peer has finished
    peers_live: Callable[[], int]
    memory_bytes: Callable[[], int | None]  # what a plan may give this peer


class JoinWatch:
    """Feeds ``reporter`` from ``sources`` (module docstring); ``spec``: the run's, ``run_steps``: its last step."""

    def __init__(self, me: str, spec: RunSpec, run_steps: int, sources: WatchSources, reporter: PhaseReporter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.me, self.spec, self.run_steps, self.sources = me, spec, run_steps, sources
        self.reporter, self.clock = reporter, clock
        self._samples: deque[tuple[float, int, int, float]] = deque()  # (t, trained steps, forward passes, busy s)
        self._stage: tuple[Any, ...] | None = None
        self._fits: tuple[Any, str | None] | None = None  # (stages, why none fits) of the last memory check

    def tick(self) -> None:
        """Report the phase now; never raises (showing the phase must not stop the peer)."""
        try:
            self._tick()
        except Exception as exc:
            log.debug("phase watch: %s", exc)

    def _tick(self) -> None:
        s, phases = self.sources, self.reporter
        paused_by = s.paused_by()
        if paused_by:
            phases.waiting("paused by the owner (`peer resume` brings it back)" if paused_by == "owner"
                           else "paused outside the --schedule hours")
            return
        if s.role_state() is State.WAITING:
            phases.waiting(s.waiting_line() or "waiting for a leader the organiser trusts")
            return
        beat = s.beat()
        beat = beat if isinstance(beat, dict) else {}
        paused = beat.get("paused")
        if beat.get("state") == "paused" and isinstance(paused, dict):
            phases.waiting(f"the swarm is paused: {str(paused.get('reason', '?'))[:160]}")
            return
        status = s.worker_status()
        stage = status.get("stage")
        if isinstance(stage, int) and not isinstance(stage, bool):
            phases.training(self._training_reason(status), **self._rates(status), **self._run(beat))
            return
        self._samples.clear()
        if s.probe_rounds() == 0 and s.peers_live() > 1:
            phases.measuring(f"links to {s.peers_live() - 1} other peer(s): round-trip time, bandwidth")
            return
        phases.waiting(self._why_waiting())

    def _why_waiting(self) -> str:
        s = self.sources
        if s.elected() is None:
            return "waiting for a leader to be elected"
        if s.leading():
            return "this peer leads: it plans once the peers' links are measured"
        plan = s.followed_plan()
        stages = plan.plan.get("stages") if plan is not None and isinstance(plan.plan, dict) else None
        why_not = self._no_fit(stages)
        if why_not:
            return f"no stage fits this device's memory: {why_not}"
        if plan is None:
            return "waiting for the leader's first plan"
        pipelines = plan.plan.get("pipelines") if isinstance(plan.plan, dict) else None
        members = {p for pipe in pipelines if isinstance(pipe, list) for p in pipe} if isinstance(
            pipelines, list) else set()
        if self.me not in members:
            return f"waiting for the next plan: plan epoch {plan.epoch} has no place for this peer"
        return f"waiting for this peer's assignment of plan epoch {plan.epoch}"

    def _no_fit(self, stages: Any) -> str | None:
        """Why no stage of the plan's split (None: of any split the run could have) fits this device, or None."""
        memory = self.sources.memory_bytes()
        if not isinstance(memory, int) or memory <= 0:
            return None
        try:
            split = None if stages is None else [(int(a), int(b)) for a, b in stages][:1024]
        except (TypeError, ValueError):
            return None
        key = (None if split is None else tuple(split), memory)
        if self._fits is None or self._fits[0] != key:
            from tasklet.peer.node.doctor import verdict  # torch is loaded by now; the doctor's own reasoning

            try:
                found = verdict(self.spec, memory, split)
                self._fits = (key, None if found.get("ok") else str(found.get("why_not", "")))
            except Exception as exc:  # a split this peer cannot reason about: claim nothing
                log.debug("memory check: %s", exc)
                self._fits = (key, None)
        return self._fits[1]

    def _training_reason(self, status: dict[str, Any]) -> str:
        layers = status.get("layers")
        shown = f" (layers {layers[0]}..{layers[1] - 1})" if isinstance(layers, list) and len(layers) == 2 and all(
            isinstance(x, int) for x in layers) else ""
        return (f"stage {status.get('stage')}{shown} of pipeline {status.get('replica')}, "
                f"plan epoch {status.get('epoch')}")

    def _rates(self, status: dict[str, Any]) -> dict[str, Any]:
        """steps/s, tokens/s and compute busy share over the last RATE_WINDOW_S (None until two samples), and
        the device's share of a step where the worker reports one (``device_share``)."""
        now = self.clock()
        stage = (status.get("stage"), status.get("replica"), status.get("epoch"))
        steps, forward, busy = status.get("trained_steps"), status.get("forward"), status.get("busy_s")
        if not (_count(steps) and _count(forward) and _finite(busy)):
            return {}
        if stage != self._stage or (self._samples and (steps < self._samples[-1][1] or forward < self._samples[-1][2])):
            self._samples.clear()
            self._stage = stage
        self._samples.append((now, steps, forward, float(busy)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        t0, s0, f0, b0 = self._samples[0]
        dt = now - t0
        device = status.get("device_share")
        out: dict[str, Any] = {"steps_per_s": None, "tokens_per_s": None, "busy_share": None,
                               "device_share": float(device) if _finite(device) and 0 <= device <= 1 else None}
        if dt > 0:
            tokens = (forward - f0) * self.spec.micro_batch * self.spec.model.seq_len
            out.update(steps_per_s=round((steps - s0) / dt, 4), tokens_per_s=round(tokens / dt, 1),
                       busy_share=round(min(1.0, max(0.0, (busy - b0) / dt)), 3))
        return out

    def _run(self, beat: dict[str, Any]) -> dict[str, Any]:
        """The run's step and loss as the followed leader's beat says them."""
        step, loss = beat.get("step"), beat.get("loss")
        return {"run_step": step if _count(step) else None, "run_steps": self.run_steps,
                "loss": float(loss) if _finite(loss) else None}


def report_end(reporter: PhaseReporter, done: bool, error: str | None) -> None:
    """The last phase: done when the run is over, else left (and why)."""
    if error:
        reporter.left(error)
    elif done:
        reporter.done("the run is over")
    else:
        reporter.left("stopped before the end of the run")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
