"""What a step is, as the leader and its callers see it: its phases, its report, its running state, and the ways
it fails. Kept apart from the step machine and the coordinator so that the callers (driver, local swarm,
benchmarks) can name them without either."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tasklet.peer.runtime.lead.pool import TaskPool

Event = tuple[str, dict[str, Any]]  # (name, info) for the coordinator's on_event


class StepFailedError(RuntimeError):
    """A step could not finish: it timed out or a worker reported an error it cannot recover from."""


class ReplanNeededError(StepFailedError):
    """No pipeline of the plan is intact any more (or a worker is gone at a step boundary): re-plan."""


class TooFewPeersError(ReplanNeededError):
    """The live peers cannot hold the plan's stages: the leader waits for more (a banned peer's ban ends, a
    volunteer joins) instead of giving up, since a leader that gives up hands the same swarm to the next one."""


class OuterRoundFailedError(ReplanNeededError):
    """DiLoCo: the inner step was applied everywhere, but its outer round could not finish (no pipeline left
    whole, an error, a timeout). The step counts as trained without the outer step: the replicas keep their
    local parameters and the round's anchor, so the next outer round covers both rounds' inner steps."""

    def __init__(self, message: str, report: StepReport) -> None:
        super().__init__(message)
        self.report = report


class StepPhase(enum.Enum):
    """Where a step is: computing micro-batches, averaging gradients, applying them, and (DiLoCo) the outer round."""

    COMPUTE = "compute"
    REDUCE = "reduce"
    APPLY = "apply"
    OUTER = "outer"  # DiLoCo: averaging the round's pseudo-gradients ...
    OUTER_APPLY = "outer_apply"  # ... then the outer step
    DONE = "done"  # applied everywhere it could be (reports of it may still come: the replicas' hashes)
    FAILED = "failed"


@dataclass
class StepReport:
    """What one step did."""

    step: int
    loss: float
    seconds: float
    microbatches_per_pipeline: dict[int, int]
    requeued: int = 0
    dropped_pipelines: list[int] = field(default_factory=list)
    speculated: int = 0  # speculative copies of straggling micro-batches handed out
    speculation_won: int = 0  # ... that committed before the original
    # the replayable record (peer.runtime.outer.assignment_record): the commit record (micro-batch -> pipeline),
    # the pipelines that applied the step, and the participants of the outer round it ended (DiLoCo) or None
    commits: dict[int, int] = field(default_factory=dict)
    applied: list[int] = field(default_factory=list)
    outer: list[int] | None = None
    outer_of: int | None = None  # overlap: the earlier step whose outer round landed after this one (None: its own)
    spot_checked: int = 0  # micro-batches sampled for a spot check (peer.runtime.lead.spot)
    spot_verified: int = 0  # ... whose copies agreed (or two of three did)
    # layers -> the parameters hash a strict majority of the stage's replicas reported after the step (steps
    # whose replicas must agree: exact ones and DiLoCo's outer steps; empty otherwise)
    stage_hashes: dict[tuple[int, int], str] = field(default_factory=dict)


@dataclass
class OuterInFlight:
    """An overlapped outer round (``RunSpec.outer_overlap``): the round of ``step`` travels while the next step
    computes. Shared by the machine that started it and the one it lands in, so that no report of it is lost
    between the two. ``members`` must each report ``reduced`` of ``attempt``; ``judging``: errors awaiting
    judgement (due, sender, error), as ``StepState.judging``."""

    step: int
    attempt: int
    participants: list[int]
    members: list[str]
    reduced: set[str] = field(default_factory=set)
    judging: list[tuple[float, str, str]] = field(default_factory=list)

    def restart(self, participants: list[int], members: list[str]) -> None:
        """Average again with ``participants`` only (a member died): a new attempt, nobody has reported it."""
        self.participants, self.members, self.reduced = participants, members, set()
        if participants:
            self.attempt += 1


@dataclass
class StepState:
    """The running step's book-keeping, owned by its :class:`peer.runtime.lead.machine.StepMachine` (and guarded by
    the lock of whoever feeds it)."""

    pool: TaskPool
    attempt: int = 0
    phase: StepPhase = StepPhase.COMPUTE
    feeders_done: bool = False  # some feeder was told "done" (the pool was complete)
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    reduced: set[str] = field(default_factory=set)
    synced: set[str] = field(default_factory=set)
    hashes: dict[str, tuple[int, str]] = field(default_factory=dict)  # endpoint -> (trained steps, params hash)
    dropped: set[int] = field(default_factory=set)
    syncing: set[int] = field(default_factory=set)  # pipelines left out until their workers reloaded the stage
    aside: dict[int, float] = field(default_factory=dict)  # pipeline -> when the referee's set-aside takes effect
    errors: list[str] = field(default_factory=list)
    leased_at: dict[tuple[int, int], float] = field(default_factory=dict)  # (micro-batch, pipeline) -> when
    members: list[str] = field(default_factory=list)  # the workers the last reduce or apply went to
    expected: set[str] = field(default_factory=set)  # ... of whom these must report it
    participants: list[int] = field(default_factory=list)  # the pipelines of the last reduce (the report's)
    commits: dict[int, int] = field(default_factory=dict)  # the commit record of the last reduce
    outer: list[int] | None = None  # the outer round's participants (DiLoCo)
    judging: list[tuple[float, str, str, str]] = field(default_factory=list)  # (due, sender, what, error)

    def enter(self, phase: StepPhase) -> None:
        self.phase = phase

    def stop_feeders(self) -> None:
        """Some feeder was told "done": the pool was complete."""
        self.feeders_done = True

    def restart_feeders(self) -> None:
        """A new attempt after the feeders had stopped: back to computing."""
        self.phase, self.feeders_done = StepPhase.COMPUTE, False

    def next_attempt(self) -> int:
        self.attempt += 1
        return self.attempt

    def new_round(self, phase: StepPhase, members: list[str], participants: list[int] | None = None,
                  commits: dict[int, int] | None = None) -> None:
        """A reduce (or an outer round) goes to ``members``, a new attempt each of them must report;
        ``participants`` and ``commits``: a reduce's pipelines and commit record (the report's)."""
        self.phase, self.attempt, self.reduced = phase, self.attempt + 1, set()
        if participants is not None:
            self.participants, self.commits = participants, commits or {}
        self.members, self.expected = members, set(members)

    def land(self, fl: OuterInFlight) -> None:
        """The overlapped round ``fl`` lands here: its averaging becomes this step's outer round, as it stands
        (its attempt, members, who reported, the errors awaiting judgement)."""
        self.phase, self.attempt, self.members = StepPhase.OUTER, fl.attempt, list(fl.members)
        self.expected, self.reduced = set(fl.members), set(fl.reduced)
        self.synced, self.hashes = set(), {}
        self.judging.extend((due, sender, "reduce", error) for due, sender, error in fl.judging)

    def due_errors(self, now: float) -> list[tuple[float, str, str, str]]:
        """The errors whose wait is over at ``now``, taken out of ``judging``."""
        due = [j for j in self.judging if j[0] <= now]
        self.judging = [j for j in self.judging if j[0] > now]
        return due

    def done(self, outer: list[int] | None = None) -> None:
        """The step ended (``outer``: the outer round's participants, when it had one)."""
        if outer is not None:
            self.outer = outer
        self.phase = StepPhase.DONE
