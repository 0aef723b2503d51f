"""The leader's training loop: plan, assign, train, and re-plan whenever membership changes.

What a re-plan keeps fixed, and why: the *layer split* of the stages is chosen once, by the first plan, and
kept for the whole run. Then any live replica of stage ``s`` holds everything a newcomer to stage ``s`` needs
(parameters and AdamW moments of exactly those layers), so a hand-over is one fetch. Re-plans only move
devices between (stage, replica) slots and change the number of replicas.

Where a tasklet's state comes from after a re-plan, in order of preference: the device already holds it at
the run's trained step (``keep``); a live replica of the stage at that step (``fetch``); otherwise the stage
is lost with every replica, and the whole run rolls back to the last checkpoint (every stage ``fetch``es its
checkpoint from the coordinator), redoing the steps since — the log says how many.

Checkpoints are written by the leader: every ``checkpoint_every`` steps (and on request, e.g. SIGTERM) it
fetches each stage's state from one replica and writes it durably through
:class:`peer.runtime.checkpoints.CheckpointStore` (fsynced, checksummed, atomic ``latest``, the newest
``checkpoint_keep`` kept). ``resume`` starts a run from the newest one that verifies; a failed checkpoint is
logged and counted, never fatal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.runtime.checkpoints import DEFAULT_KEEP, Checkpoint, CheckpointError, CheckpointStore
from peer.runtime.control import StateSource
from peer.runtime.coordinator import Coordinator, ReplanNeededError, StepFailedError, StepReport
from peer.runtime.spec import Assignment, RunSpec
from peer.timing import REPLAN_WAIT_S, STEP_TIMEOUT_S

log = logging.getLogger(__name__)

Stages = list[tuple[int, int]]
Pipelines = list[list[int]]
# planner(live device ids, fixed stages or None) -> (stages, pipelines of device ids)
Planner = Callable[[list[int], Stages | None], tuple[Stages, Pipelines]]
# assignments_for(stages, pipelines, epoch) -> {endpoint: Assignment}
AssignmentBuilder = Callable[[Stages, Pipelines, int], dict[str, Assignment]]


@dataclass
class DriverConfig:
    steps: int
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # 0: only on request
    checkpoint_keep: int = DEFAULT_KEEP  # the newest this many checkpoints stay on disk
    step_timeout_s: float = STEP_TIMEOUT_S
    max_replans: int = 50
    replan_wait_s: float = REPLAN_WAIT_S


@dataclass
class RunEvents:
    """What happened during a run, for logs, status and benchmarks."""

    replans: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_errors: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: dict[str, Any] | None = None  # the checkpoint a resume used, and the newer ones it skipped


class RunDriver:
    """Runs ``cfg.steps`` steps of ``spec`` over whatever devices ``live_devices()`` reports."""

    def __init__(
        self,
        spec: RunSpec,
        coordinator: Coordinator,
        live_devices: Callable[[], dict[int, str]],
        planner: Planner,
        build_assignments: AssignmentBuilder,
        cfg: DriverConfig,
        on_step: Callable[[StepReport], None] | None = None,
        epoch: int = 0,
        on_replan: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.coordinator = coordinator
        self.live_devices = live_devices
        self.planner = planner
        self.build_assignments = build_assignments
        self.cfg = cfg
        self.on_step = on_step
        self.events = RunEvents()
        self.stages: Stages | None = None
        self.pipelines: Pipelines = []
        self.trained = 0  # steps applied everywhere
        self.epoch = epoch  # the last epoch used; the next plan takes epoch + 1 (a new leader starts higher)
        self.on_replan = on_replan
        self.banned: set[str] = set()  # endpoints declared dead: never planned again
        self.reports: list[StepReport] = []
        self.stop_event = threading.Event()  # set when this leader loses leadership: stop driving at once
        self.store = None if cfg.checkpoint_dir is None else CheckpointStore(cfg.checkpoint_dir, cfg.checkpoint_keep)
        self._loaded: Checkpoint | None = None  # the checkpoint _latest_checkpoint verified, until loaded
        # on_checkpoint(step, folder): after each checkpoint is written (replication to other peers)
        self.on_checkpoint: Callable[[int, Path], None] | None = None

    def _check_stopped(self) -> None:
        if self.stop_event.is_set():
            raise InterruptedError("the driver was stopped (leadership lost)")

    # ------------------------------------------------------------------------------------------------ run
    def run(self, resume: bool = False, takeover: tuple[int, Stages] | None = None) -> list[StepReport]:
        """Train to ``cfg.steps``. ``resume``: start from the latest checkpoint. ``takeover=(trained, stages)``:
        continue a run whose previous leader died, from the workers' own state."""
        restore = self._latest_checkpoint() if resume else None
        if restore is not None:
            skipped = [] if self._loaded is None else [s for s, _ in self._loaded.skipped]
            self.events.resumed_from = {"step": restore, "skipped_damaged": skipped}
            if skipped:
                log.warning("resuming from the checkpoint of step %d: the newer one(s) of step(s) %s are damaged",
                            restore, skipped)
            else:
                log.info("resuming from the checkpoint of step %d", restore)
            self._load_checkpoint_stages(restore)
        elif resume:
            log.warning("--resume: no usable checkpoint in %s; starting at step 0", self.cfg.checkpoint_dir)
        elif takeover is not None:
            self.trained, self.stages = takeover[0], [(int(a), int(b)) for a, b in takeover[1]]
        self._replan_until_done(reason="takeover" if takeover else "start", restore_step=restore)
        replans = 0
        while self.trained < self.cfg.steps:
            self._check_stopped()
            if self._membership_changed():
                self._replan_until_done(reason="membership changed")
            try:
                report = self.coordinator.run_step(self.trained, timeout_s=self.cfg.step_timeout_s)
            except StepFailedError as exc:
                replans += 1
                if replans > self.cfg.max_replans:
                    raise
                log.warning("step %d did not finish (%s); re-planning", self.trained, exc)
                self._ban_dead()
                time.sleep(self.cfg.replan_wait_s)
                self._replan_until_done(reason=str(exc))
                continue
            self.trained += 1
            self.reports.append(report)
            if self.on_step:
                self.on_step(report)
            if self.cfg.checkpoint_every and self.trained % self.cfg.checkpoint_every == 0:
                self.checkpoint()
        return self.reports

    def _ban_dead(self) -> None:
        self.banned |= set(self.coordinator.dead)

    def _membership_changed(self) -> bool:
        """A worker died at a step boundary, or a new device joined."""
        live = {ep for ep in self.live_devices().values() if ep not in self.banned}
        planned = set(self.coordinator.assignments)
        if self.coordinator.dead:
            self._ban_dead()
            return True
        return bool(live - planned - self.banned) and self._would_use_more(live)

    def _would_use_more(self, live: set[str]) -> bool:
        """A newcomer matters only if it lets the plan grow by a replica (else it stays a spare)."""
        assert self.stages is not None
        return len(live) // len(self.stages) > len(self.pipelines)

    # --------------------------------------------------------------------------------------------- replan
    def _replan_until_done(self, reason: str, restore_step: int | None = None) -> None:
        """Re-plan; when a worker fails to take its assignment (it died meanwhile), exclude it and try again."""
        for attempt in range(self.cfg.max_replans):
            self._check_stopped()
            try:
                self._replan(reason=reason if attempt == 0 else f"{reason} (retry {attempt})",
                             restore_step=restore_step)
                return
            except ReplanNeededError as exc:
                log.warning("re-plan failed: %s", exc)
                self._ban_dead()
                time.sleep(self.cfg.replan_wait_s)
        raise StepFailedError(f"could not form a plan after {self.cfg.max_replans} attempts")

    def _replan(self, reason: str = "start", restore_step: int | None = None) -> None:
        live = {d: ep for d, ep in self.live_devices().items() if ep not in self.banned}
        stages, pipelines = self.planner(sorted(live), self.stages)
        self.stages = stages
        self.epoch += 1
        assignments = self.build_assignments(stages, pipelines, self.epoch)
        # at step 0 every stage starts from the seeded initialiser: nobody needs to be asked
        holders = self._holders(set(live.values())) if self.trained > 0 or restore_step is not None else {}
        sources, rollback = self._sources(assignments, holders, restore_step)
        if rollback is not None:
            redone = self.trained - rollback
            log.warning(
                "every replica of a stage is gone; rolling back to the checkpoint of step %d, redoing %d step(s)",
                rollback,
                redone,
            )
            self.events.rollbacks.append({"from_step": self.trained, "to_step": rollback, "redone": redone})
            self._load_checkpoint_stages(rollback)
            self.trained = rollback
            self.reports = [r for r in self.reports if r.step < rollback]
            sources = {ep: StateSource.fetch(self.coordinator.endpoint, rollback) for ep in assignments}
        self.coordinator.assign(assignments, sources)  # a new plan: the coordinator forgets the dead
        self.pipelines = pipelines
        info = {
            "epoch": self.epoch,
            "reason": reason,
            "step": self.trained,
            "devices": sorted(live),
            "stages": [list(s) for s in stages],
            "pipelines": pipelines,
            "at": time.time(),
        }
        self.events.replans.append(info)
        if self.on_replan:
            self.on_replan(info)
        log.info(
            "plan epoch %d (%s): stages %s, pipelines %s, continuing at step %d",
            self.epoch,
            reason,
            stages,
            pipelines,
            self.trained,
        )

    def _holders(self, live: set[str]) -> dict[int, list[str]]:
        """Stage index -> live endpoints holding that stage at the trained step (asked, not assumed)."""

        def ask(ep: str) -> tuple[str, dict[str, Any] | None]:
            try:
                return ep, self.coordinator.worker_status(ep)
            except Exception as exc:  # unreachable: not a holder
                log.info("status of %s: %s", ep, exc)
                return ep, None

        out: dict[int, list[str]] = {}
        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(ask, sorted(live)))
        for ep, st in answers:
            if st and st.get("trained_steps") == self.trained and st.get("layers") is not None and self.stages:
                layers = tuple(st["layers"])
                if layers in self.stages:
                    out.setdefault(self.stages.index(layers), []).append(ep)
        return out

    def _sources(
        self, assignments: dict[str, Assignment], holders: dict[int, list[str]], restore_step: int | None
    ) -> tuple[dict[str, StateSource], int | None]:
        """Where each assignee gets its state; the checkpoint step to roll back to when a stage is lost."""
        if restore_step is not None:
            return {ep: StateSource.fetch(self.coordinator.endpoint, restore_step) for ep in assignments}, None
        if self.trained == 0 and not holders:
            return {ep: StateSource.init() for ep in assignments}, None
        sources: dict[str, StateSource] = {}
        for ep, a in assignments.items():
            have = holders.get(a.stage, [])
            if ep in have:
                sources[ep] = StateSource.keep(self.trained)
            elif have:
                sources[ep] = StateSource.fetch(have[0], self.trained)
            elif self.trained == 0:
                sources[ep] = StateSource.init()
            else:
                latest = self._latest_checkpoint()
                if latest is None:
                    raise StepFailedError(f"stage {a.stage} lost every replica and there is no checkpoint")
                return {}, latest
        return sources, None

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint(self) -> Path | None:
        """Write every stage's state at the trained step (one replica each); return the folder.

        A failure (disk full, a replica that does not answer) is logged and counted in
        ``events.checkpoint_errors``; it never stops training."""
        if self.store is None or not self.stages:
            return None
        try:
            states = self.coordinator.live_states(at_step=self.trained)
            saved = {stage for stage, _ in states}
            if saved != set(range(len(self.stages))):
                raise CheckpointError(f"stages {sorted(set(range(len(self.stages))) - saved)} did not answer")
            meta = {"run": self.spec.to_dict(), "stages": self.stages, "step": self.trained}
            step_dir = self.store.write(self.trained, {stage: st for (stage, _), st in states.items()}, meta)
        except Exception as exc:  # a checkpoint error must not kill the leader
            log.error("checkpoint of step %d failed: %s", self.trained, exc)
            self.events.checkpoint_errors.append({"step": self.trained, "error": str(exc)[:500]})
            return None
        self.events.checkpoints.append(self.trained)
        log.info("checkpoint of step %d written to %s", self.trained, step_dir)
        if self.on_checkpoint is not None:
            try:
                self.on_checkpoint(self.trained, step_dir)
            except Exception as exc:  # replication failing is reported, never fatal
                log.error("after the checkpoint of step %d: %s", self.trained, exc)
        return step_dir

    def _latest_checkpoint(self) -> int | None:
        """The step of the newest checkpoint that verifies (damaged newer ones are skipped, and logged)."""
        if self.store is None:
            return None
        ckpt = self.store.newest_valid()
        if ckpt is None:
            return None
        self._loaded = ckpt
        return ckpt.step

    def _load_checkpoint_stages(self, step: int) -> None:
        """Read a checkpoint and let the coordinator serve it to the workers that will fetch it."""
        assert self.store is not None
        ckpt = self._loaded if self._loaded is not None and self._loaded.step == step else self.store.load(step)
        self._loaded = None
        where = self.store.root / f"step-{step:06d}"
        if ckpt.meta.get("run") != self.spec.to_dict():
            raise StepFailedError(f"checkpoint {where} belongs to a different run configuration")
        stages = [tuple(x) for x in ckpt.meta["stages"]]
        if self.stages is not None and stages != self.stages:
            raise StepFailedError(f"checkpoint {where} has stages {stages}, the run has {self.stages}")
        self.stages = stages  # type: ignore[assignment]
        self.coordinator.serve_checkpoint(ckpt.states)
        self.trained = step
