"""One worker's bookkeeping of the current step, changed only through named transitions.

:class:`WorkerStep` is pure (no gRPC, no threads, no tensors computed): every transition checks its
precondition and raises :class:`protocol.errors.Rejected` with the reason when the event does not fit the
step as it stands — a message of another step, a micro-batch seen twice, an apply with nothing reduced. The
worker calls it under its step lock and acts only on what a transition allowed, so the rules of a step live in
one place and can be tested event by event (tests/runtime/test_worker_step.py).

The step's life (docs/architecture.md, "One step"): ``start_step`` (a new step, or a new attempt of the current
one), micro-batches enter (``lease`` on a first stage, ``take_activation`` elsewhere) and their gradients
return (``take_grad``); ``drop`` throws the pipeline's work away; ``reduce`` checks the accumulator against the
commit record and ``reduced`` keeps the sum; ``apply``/``applied`` step the optimizer once. DiLoCo's outer round
has its own pair, ``outer_reduced``/``take_outer``, and its own slot (``outer_step``, ``outer_attempt``): with
overlap (``RunSpec.outer_overlap``) the round of step ``s`` is still in flight while step ``s + 1`` runs.

===================  =============================================  ================================================
transition           refused (Rejected) when                        effect
===================  =============================================  ================================================
``reset``            never (a new assignment)                       IDLE: step -1, attempt 0, nothing held
``start_step``       an older step; a new step the stage has not    a new step: RUNNING, micro-batches forgotten;
                     trained to, or with a gradient unapplied; a    the current step: its new attempt, none in flight
                     step this pipeline was dropped from
``drop``             not the current step                           DROPPED: micro-batches forgotten, feeding stops
``sit_out``          not the current step                           DiLoCo: dropped, the record gave it nothing
``lease``            not feeding this step and attempt              the micro-batch enters, one more in flight
``take_activation``  another step; dropped; seen already            the micro-batch enters
``take_grad``        another step; dropped; never forwarded here;   its backward may run, once
                     seen already
``reduce``           not the current step; the accumulator is not   the micro-batches its shards carry
                     exactly the commit record's share
``reduced``          not the current step                           REDUCED: the sum awaits apply
``apply``            nothing of that step held (unless applied      what to apply (None: a repeat, re-report)
                     already: trained = step + 1)
``applied``          that step was not awaiting apply               the gradient is applied once
``outer_round``      neither the current step nor, with overlap,    the round's attempt only moves forward
                     the round in flight
``outer_reduced``    not the round's step and attempt               OUTER_REDUCED: the average awaits the apply
``take_outer``       never (None: nothing of that step held)        the average, taken once; the round is over
===================  =============================================  ================================================
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tasklet.protocol.errors import Rejected

ATTEMPT_WINDOW = 2  # shards of attempts up to this far ahead of the current one are kept (a bounded mailbox)


class Phase(enum.Enum):
    """Where the step stands (derived from the fields; for status and tests)."""

    IDLE = "idle"  # no step started under this assignment
    RUNNING = "running"  # micro-batches flow
    DROPPED = "dropped"  # this pipeline was dropped from the step
    REDUCED = "reduced"  # a summed gradient awaits apply
    OUTER_REDUCED = "outer_reduced"  # DiLoCo: an averaged pseudo-gradient awaits the outer apply


class Work(enum.Enum):
    """The kinds of queued compute work whose staleness the step decides."""

    FORWARD = "forward"
    BACKWARD = "backward"
    DROP = "drop"
    REDUCE = "reduce"
    APPLY = "apply"
    RESYNC = "resync"


@dataclass
class WorkerStep:
    """The per-step fields of one stage worker (module docstring). Not thread-safe: the worker holds its lock."""

    pipeline: int = -1  # this worker's replica (pipeline) id, for the refusals' wording
    step: int = -1
    attempt: int = 0
    feeding: bool = False  # a first stage leases micro-batches for this step and attempt
    dropped: bool = False  # this pipeline was dropped from the current step
    known: set[int] = field(default_factory=set)  # micro-batches forwarded here this step
    grads_seen: set[int] = field(default_factory=set)  # micro-batches whose activation gradient arrived
    inflight: int = 0  # micro-batches leased by the feeder whose backward has not finished here
    pending: tuple[int, torch.Tensor] | None = None  # (step, summed gradient) awaiting apply
    local_count: int = 0  # DiLoCo inner step: micro-batches this pipeline committed (divides ``pending``)
    outer_pending: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (step, average, residual): outer apply
    outer_step: int = -1  # DiLoCo: the step whose outer round is in flight (-1: none)
    outer_attempt: int = 0  # ... and its attempt

    @property
    def phase(self) -> Phase:
        if self.outer_pending is not None:
            return Phase.OUTER_REDUCED
        if self.pending is not None:
            return Phase.REDUCED
        if self.step < 0:
            return Phase.IDLE
        return Phase.DROPPED if self.dropped else Phase.RUNNING

    @property
    def pending_apply(self) -> int | None:
        """The step whose reduced gradient awaits apply (status)."""
        return None if self.pending is None else self.pending[0]

    # ----------------------------------------------------------------------------------------- the step
    def reset(self, pipeline: int) -> None:
        """A new assignment (of pipeline ``pipeline``): nothing of the previous plan's step carries over."""
        self.pipeline = pipeline
        self.step, self.attempt, self.feeding, self.dropped, self.inflight = -1, 0, False, False, 0
        self.pending, self.local_count, self.outer_pending = None, 0, None
        self.outer_step, self.outer_attempt = -1, 0
        self.known, self.grads_seen = set(), set()

    def start_step(self, step: int, attempt: int, trained_steps: int, feed: bool = False) -> None:
        """Start ``step`` (the stage has trained ``trained_steps``) or a new attempt of the current step (a
        pipeline died: the pool was requeued). An older step, a step the stage is not at, or a step this
        pipeline was dropped from is refused."""
        if step < self.step:
            raise Rejected(f"step {step} is before the current step {self.step}")
        if step > self.step:
            if self.pending is not None or trained_steps != step:
                raise Rejected(f"cannot start step {step}: this stage has trained {trained_steps} steps")
            self.step, self.dropped, self.known, self.grads_seen = step, False, set(), set()
        if self.dropped:
            raise Rejected(f"pipeline {self.pipeline} was dropped from step {step}")
        self.attempt, self.inflight, self.feeding = attempt, 0, feed

    def drop(self, step: int) -> None:
        """This pipeline lost a member: forget the step's micro-batches (other pipelines redo them)."""
        self._require_current(step, "a drop")
        self.dropped, self.feeding, self.known, self.grads_seen = True, False, set(), set()

    def sit_out(self, step: int) -> None:
        """DiLoCo: the commit record gives this pipeline nothing in ``step``; it takes no inner step."""
        self._require_current(step, "sitting out")
        self.dropped, self.feeding = True, False

    def outer_round(self, step: int, attempt: int) -> None:
        """DiLoCo: an outer round of ``step`` (restarted after a death: a later attempt) becomes current. With
        overlap a restart may come while the next step runs: the round in flight is then the previous step's."""
        if step == self.step:
            self.attempt = max(self.attempt, attempt)
        elif step != self.outer_step:
            raise Rejected(f"outer round of step {step}, the current step is {self.step}")
        if step != self.outer_step:
            self.outer_step, self.outer_attempt = step, attempt
        self.outer_attempt = max(self.outer_attempt, attempt)

    @property
    def outer_live(self) -> bool:
        """An outer round is in flight: started, its average not yet taken by the outer apply."""
        return self.outer_step >= 0

    # ------------------------------------------------------------------------------------- micro-batches
    def feeds(self, step: int, attempt: int) -> bool:
        """Whether the feeder of (step, attempt) may still lease."""
        return self.feeding and self.step == step and self.attempt == attempt and not self.dropped

    def lease(self, step: int, attempt: int, mb: int) -> None:
        """The feeder leased ``mb`` for (step, attempt): it enters the pipeline here."""
        if not self.feeds(step, attempt):
            raise Rejected(f"no longer feeding step {step} attempt {attempt}")
        self.known.add(mb)
        self.inflight += 1

    def finished(self) -> None:
        """A leased micro-batch's backward finished on this first stage (its commit to the pool goes on off the
        compute thread): it holds no memory here any more, one fewer in flight."""
        self.inflight = max(0, self.inflight - 1)

    def check_current(self, step: int) -> None:
        """A message of ``step`` fits: it is the current step and this pipeline was not dropped from it."""
        if step != self.step:
            raise Rejected(f"step {step} is not the current step {self.step}")
        if self.dropped:
            raise Rejected(f"pipeline {self.pipeline} was dropped from step {step}")

    def take_activation(self, step: int, mb: int) -> None:
        """An activation of ``mb`` arrived: each micro-batch is forwarded here once per step."""
        self.check_current(step)
        if mb in self.known:
            raise Rejected(f"micro-batch {mb} was already forwarded here this step")
        self.known.add(mb)

    def take_grad(self, step: int, mb: int) -> None:
        """The activation gradient of ``mb`` arrived: only for a micro-batch forwarded here, and once."""
        self.check_current(step)
        if mb not in self.known:
            raise Rejected(f"micro-batch {mb} was never forwarded here this step")
        if mb in self.grads_seen:
            raise Rejected(f"the gradient of micro-batch {mb} already arrived this step")
        self.grads_seen.add(mb)

    def check_shard(self, step: int, attempt: int) -> None:
        """A gradient or parameter shard of (step, attempt) fits: the current step (or the outer round in flight),
        an attempt that can follow."""
        if step == self.outer_step:
            current = self.outer_attempt
        elif step == self.step:
            current = self.attempt
        else:
            raise Rejected(f"step {step} is not the current step {self.step}")
        if not current <= attempt <= current + ATTEMPT_WINDOW:
            raise Rejected(f"attempt {attempt} is not within {ATTEMPT_WINDOW} of the current attempt {current}")

    def early(self, step: int, attempt: int) -> bool:
        """A shard that fits once this peer hears of the start its sender acted on: the next step, or the current
        step one restart past the window. The leader's start of a new attempt goes to every replica at once, and
        when the pool was already complete its reduce follows at once: a replica may push its shard of the new
        attempt before this peer's own start has arrived (refused, the push was lost and the reduce waited for it
        until its deadline)."""
        if step == self.outer_step:
            return False
        if step == self.step:
            return self.attempt + ATTEMPT_WINDOW < attempt <= self.attempt + 2 * ATTEMPT_WINDOW
        return self.step >= 0 and step == self.step + 1 and 0 <= attempt <= 2 * ATTEMPT_WINDOW

    def runs(self, work: Work, step: int) -> bool:
        """Whether queued work of ``step`` still runs: stale work (another step; forward or backward of a
        dropped step) is thrown away. A resync of a later step runs: a pipeline left out of steps gets no
        ``start_step`` until in sync, so its step stays the one it missed while the leader tells it newer ones."""
        if work is Work.RESYNC and step > self.step:
            return True
        if work in (Work.REDUCE, Work.APPLY) and step == self.outer_step:
            return True  # the outer round in flight (with overlap, the previous step's)
        if step != self.step:
            return False
        return not (self.dropped and work in (Work.FORWARD, Work.BACKWARD))

    # ------------------------------------------------------------------------------------ reduce / apply
    def check_accumulated(self, step: int, expected: Iterable[int], held: Iterable[int]) -> list[int]:
        """Exactly once, locally: the accumulator must hold exactly the micro-batches the commit record gives
        this pipeline. Returns them (sorted)."""
        self._require_current(step, "a reduce")
        want, have = sorted(expected), sorted(held)
        if have != want:
            raise Rejected(f"step {step}: accumulator holds micro-batches {have}, the pool committed "
                           f"{want} for pipeline {self.pipeline}")
        return want

    def reduced(self, step: int, summed: torch.Tensor, count: int = 0) -> None:
        """The step's summed gradient (DiLoCo: this pipeline's own, over ``count`` micro-batches) awaits apply."""
        self._require_current(step, "a reduced gradient")
        self.pending, self.local_count = (step, summed), count

    def apply(self, step: int, trained_steps: int) -> tuple[torch.Tensor, int] | None:
        """What ``apply`` of ``step`` applies: (summed gradient, local count); None when the step was already
        applied (a repeated apply only re-reports). Kept until :meth:`applied`."""
        if self.pending is None and trained_steps == step + 1:
            return None
        if self.pending is None or self.pending[0] != step:
            raise Rejected(f"apply of step {step}, but no reduced gradient of that step is held")
        return self.pending[1], self.local_count

    def applied(self, step: int) -> None:
        """The optimizer stepped with ``step``'s gradient: it is applied once."""
        if self.pending is None or self.pending[0] != step:
            raise Rejected(f"step {step} was not awaiting apply")
        self.pending = None

    def outer_reduced(self, step: int, average: torch.Tensor, residual: torch.Tensor,
                      attempt: int | None = None) -> None:
        """DiLoCo: the round's averaged pseudo-gradient (and this replica's new residual) awaits the outer apply.
        ``attempt``: the averaging's own (one a restart abandoned is refused)."""
        if step != self.outer_step or (attempt is not None and attempt != self.outer_attempt):
            raise Rejected(f"an outer reduce of step {step} attempt {attempt}, the outer round in flight is of step "
                           f"{self.outer_step} attempt {self.outer_attempt}")
        self.outer_pending = (step, average, residual)

    def take_outer(self, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The outer apply of ``step`` takes the averaged pseudo-gradient (once); None when none of that step is
        held (a repeated apply, or one without its reduce: the caller tells them apart)."""
        pending, self.outer_pending = self.outer_pending, None
        if pending is None or pending[0] != step:
            return None
        self.outer_step, self.outer_attempt = -1, 0
        return pending[1], pending[2]

    def _require_current(self, step: int, what: str) -> None:
        if step != self.step:
            raise Rejected(f"{what} of step {step}, the current step is {self.step}")
