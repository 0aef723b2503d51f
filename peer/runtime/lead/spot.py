"""Spot checks: a sampled fraction of micro-batches re-run on another pipeline and compared stage by stage.

Every stage reports a sketch (``peer.runtime.sketch``) of what it received and sent for each micro-batch it
worked on; a stage cannot tell which micro-batches are checked, and the original pipeline is never told. Rules,
and why:

* **Sampling.** When a micro-batch is leased to a pipeline, it is checked with that pipeline's rate: the
  run's ``spot_check``, or ``probation_check`` while one of its members has fewer than
  ``probation_microbatches`` verified micro-batches (:class:`Probation`, the leader's record across steps). The
  draw is the leader's own randomness (``random.SystemRandom``): nobody can predict it.
* **Shadow copy.** A checked micro-batch is leased, as a *shadow*, to another intact pipeline that has not held
  it, before any free work: its stages hold its gradient apart (the lease is marked speculative, as a straggler's
  copy is) and the commit record never gives it to the shadow, so it is never summed. When the copies agree, the
  shadow becomes the micro-batch's backup (``TaskPool.backup``): if the original pipeline is dropped later in the
  step, the shadow's held gradient counts instead of a redo.
* **Comparison.** Two copies are compared along the data's path (:func:`path`): stage 0's output, stage 1's
  input, stage 1's output, ..., the last stage's loss, then the activation gradients back. The first point
  where they differ by more than the tolerance names the stage whose inputs still agreed: the pair of suspects
  is that stage's peer in each copy. Within one copy, what a sender says it sent and what its receiver says it
  received must agree (:func:`broken_link`); they are the same bytes, so a difference means one of the two lies,
  and it is handed to the referee as the receiver's report of the sender (``peer.runtime.lead.referee``: the
  leader cannot tell which of the two lies, so the pipeline is set aside for the step and its members go back on
  probation; only the leader's own worker at one end makes it evidence that excludes).
* **Majority.** A disagreement goes to a third copy on a third pipeline; the copy that disagrees with the other
  two at the first differing point names its stage's peer, which is excluded (``Finding`` "exclude"); its pipeline
  is dropped from the step and its work requeued, so nothing it touched in the step reaches the model. Its
  unverified work of earlier steps (:class:`Ledger`) is discarded too: the run rolls back to a checkpoint from
  before it and redoes the steps since (``peer.runtime.lead.driver``). Three
  copies that all differ decide nothing: the first two pipelines are set aside for the step (redone by others)
  and their members go back on probation.
* **The leader's own copy.** Where one of the two suspects of a disagreement is the leader's own worker, the
  leader believes its own computation: the other suspect is excluded at once, no third copy needed (the leader
  is the arbiter of everything else too).
* **Two pipelines.** Otherwise, without a third pipeline there is no majority: both are set aside for the step
  ("aside"), which leaves no intact pipeline, so the step is re-planned and redone, and their members are on
  probation again, so the repeated step checks them again. A cheater that keeps corrupting, in a run of two
  pipelines neither of which holds the leader at the stage it corrupts, stalls that run; it never poisons it.
* **Waiting.** The reduce waits until every committed micro-batch's pipeline sent all its sketches and every
  check is decided. A pipeline whose sketches are still missing ``SKETCH_WAIT_S`` after its commit, or whose
  shadow is not done within its lease time, is set aside for the step (its work is redone, nobody is excluded).

Pure state like the pool (no I/O, no clock of its own): the machine calls it with ``now``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tasklet.peer.runtime.sketch import agree, link_tolerance, tolerance

SKETCH_WAIT_S = 10.0  # after a commit, how long its pipeline's sketches may take to arrive
MAX_PROBATION_RECORDS = 4096  # identities whose verified work the leader counts (bounded whatever joins)
MAX_PUBLISHED_LEDGER = 512  # ledger entries a progress record carries (about 30 bytes each)
MAX_COPIES = 3  # the original, a shadow, and the third copy that decides

Point = tuple[int, str]  # (stage, point name)
Sketches = dict[Point, tuple[float, ...]]


def path(n_stages: int) -> list[Point]:
    """The points of one copy in the order the data crosses them (module docstring, "Comparison")."""
    out: list[Point] = []
    for s in range(n_stages):
        if s > 0:
            out.append((s, "act_in"))
        if s < n_stages - 1:
            out.append((s, "act_out"))
    out.append((n_stages - 1, "loss"))
    for s in reversed(range(n_stages)):
        if s < n_stages - 1:
            out.append((s, "grad_in"))
        if s > 0:
            out.append((s, "grad_out"))
    return out


def expected_points(stage: int, n_stages: int) -> set[str]:
    """The points a stage reports (``act_in`` unless first, ``act_out`` and ``grad_in`` unless last,
    ``grad_out`` unless first)."""
    points = set()
    if stage > 0:
        points |= {"act_in", "grad_out"}
    if stage < n_stages - 1:
        points |= {"act_out", "grad_in"}
    return points


def first_difference(a: Sketches, b: Sketches, n_stages: int, tol: float) -> int | None:
    """The index in :func:`path` of the first point where two copies differ; None when they agree."""
    for i, point in enumerate(path(n_stages)):
        if not agree(a[point], b[point], tol):
            return i
    return None


def broken_link(copy: Sketches, n_stages: int, tol: float) -> tuple[int, int] | None:
    """(sender stage, receiver stage) of the first link, along the data's path, where what the sender says it
    sent and what the receiver says it received differ; None when every link agrees."""
    for s in range(n_stages - 1):
        if not agree(copy[(s, "act_out")], copy[(s + 1, "act_in")], tol):
            return s, s + 1
    for s in reversed(range(1, n_stages)):
        if not agree(copy[(s, "grad_out")], copy[(s - 1, "grad_in")], tol):
            return s, s - 1
    return None


def majority(copies: list[Sketches], n_stages: int, tol: float) -> tuple[int, int] | None:
    """Three copies: (index of the copy that disagrees with the other two, stage of its peer to blame), judged at
    the first point where the first two differ; None when no copy is alone (all differ, or none does)."""
    a, b, c = copies
    k = first_difference(a, b, n_stages, tol)
    if k is None:
        return None
    d_ac, d_bc = first_difference(a, c, n_stages, tol), first_difference(b, c, n_stages, tol)
    stage = path(n_stages)[k][0]
    if (d_ac is None or d_ac > k) and d_bc is not None and d_bc <= k:
        return 1, stage
    if (d_bc is None or d_bc > k) and d_ac is not None and d_ac <= k:
        return 0, stage
    return None


class Probation:
    """The leader's count of each identity's verified micro-batches (across steps and plans of its leadership):
    a peer with fewer than ``needed`` is checked at ``rate``. A suspect starts again from zero."""

    def __init__(self, rate: float, needed: int) -> None:
        self.rate, self.needed = rate, needed
        self.verified: dict[str, int] = {}

    def on_probation(self, identity: str) -> bool:
        return self.verified.get(identity, 0) < self.needed

    def credit(self, identities: Iterable[str]) -> None:
        for who in identities:
            if who in self.verified or len(self.verified) < MAX_PROBATION_RECORDS:
                self.verified[who] = self.verified.get(who, 0) + 1

    def suspect(self, identities: Iterable[str]) -> None:
        for who in identities:
            self.verified.pop(who, None)


class Ledger:
    """The leader's record of unverified work that reached the model: per identity, the first step (0-based) in
    which a micro-batch of a committed step ran on a pipeline it was a member of and no spot check verified that
    copy. When a spot check later excludes the identity, everything from that step on may hold its corrupted
    work, so the run rolls back to a checkpoint of that step or earlier (``RunDriver``; the checkpoint "of step
    N" holds N applied steps). A verified copy does not count: it is the honest result.

    Bounded like :class:`Probation`: beyond ``MAX_PROBATION_RECORDS`` identities, a new one's step is folded into
    ``overflow`` (the earliest such step), which every identity without a record of its own is taken to have:
    a full ledger rolls back further than needed, never less."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}
        self.overflow: int | None = None

    def applied(self, step: int, identities: Iterable[str]) -> None:
        """``identities`` had unverified work applied in ``step``."""
        for who in identities:
            if who in self.first:
                continue
            if len(self.first) < MAX_PROBATION_RECORDS:
                self.first[who] = step
            elif self.overflow is None or step < self.overflow:
                self.overflow = step

    def first_unverified(self, identity: str) -> int | None:
        """The first step with unverified applied work of ``identity`` (None: none)."""
        return self.first.get(identity, self.overflow)

    def earliest(self, identities: Iterable[str]) -> int | None:
        """The earliest first-unverified step among ``identities`` (the checkpoint a roll-back may need)."""
        steps = [s for who in identities if (s := self.first_unverified(who)) is not None]
        return min(steps, default=None)

    def rolled_back(self, step: int) -> None:
        """The run went back to the checkpoint of ``step``: the work of ``step`` on is discarded."""
        self.first = {who: s for who, s in self.first.items() if s < step}
        if self.overflow is not None and self.overflow >= step:
            self.overflow = None

    def to_record(self, limit: int = MAX_PUBLISHED_LEDGER) -> dict[str, Any]:
        """The ledger for the leader's signed progress record, so a new leader can roll back its predecessor's
        unverified work: the ``limit`` earliest entries; the rest are folded into ``overflow`` (further, never
        less)."""
        ordered = sorted(self.first.items(), key=lambda kv: (kv[1], kv[0]))
        rest = [s for _, s in ordered[limit:]] + ([] if self.overflow is None else [self.overflow])
        return {"first": dict(ordered[:limit]), "overflow": min(rest, default=None)}

    @classmethod
    def from_record(cls, value: Any) -> Ledger:
        """A ledger read from a progress record (signed by the previous leader, read as hostile all the same:
        malformed entries are dropped, at most ``MAX_PUBLISHED_LEDGER`` kept)."""
        ledger = cls()
        if not isinstance(value, dict):
            return ledger
        first = value.get("first")
        for who, step in list(first.items())[:MAX_PUBLISHED_LEDGER] if isinstance(first, dict) else []:
            if isinstance(who, str) and 0 < len(who) <= 128 and type(step) is int and step >= 0:
                ledger.first[who] = step
        overflow = value.get("overflow")
        ledger.overflow = overflow if type(overflow) is int and overflow >= 0 else None
        return ledger


@dataclass(frozen=True)
class Finding:
    """What a check found, for the coordinator to act on: ``verified`` (credit the members of ``pipelines``),
    ``exclude`` (the peer at ``stage`` of ``pipelines[0]``), ``link`` (the receiver at ``receiver`` reports the
    sender at ``stage`` of ``pipelines[0]`` to the referee), ``aside`` (set ``pipelines`` aside for the step,
    their members back on probation), ``late`` (set ``pipelines`` aside for the step: its sketches or its copy
    did not come in time)."""

    kind: str
    microbatch: int
    pipelines: tuple[int, ...]
    reason: str
    stage: int = -1
    receiver: int = -1


@dataclass
class Check:
    """One checked micro-batch: its copies (pipelines, the original first), when each was leased and committed."""

    copies: list[int]
    wanted: int = 2  # copies wanted in all (3 after a disagreement)
    leased: dict[int, float] = field(default_factory=dict)
    done: dict[int, float] = field(default_factory=dict)
    decided: bool = False

    def decide(self) -> None:
        """Nothing more is asked of this check (verified, judged, or no copy can run)."""
        self.decided = True

    def want_third(self) -> None:
        """Two copies disagreed: a third one decides."""
        self.wanted = 3


class SpotChecks:
    """The spot checks of one step (module docstring). ``rate_of(pipeline)``: its sampling rate now."""

    def __init__(self, step: int, n_stages: int, rate_of: Callable[[int], float], precision: str = "fp32",
                 compression: str = "none", lease_timeout_s: float = 60.0,
                 rng: random.Random | None = None, own: Callable[[int, int], bool] | None = None) -> None:
        self.step, self.n_stages, self.rate_of = step, n_stages, rate_of
        self.own = own or (lambda pipeline, stage: False)  # whether the leader's own worker is there
        self.tol, self.link_tol = tolerance(precision), link_tolerance(precision, compression)
        self.lease_timeout_s = lease_timeout_s
        self.rng = rng or random.SystemRandom()
        self.checks: dict[int, Check] = {}
        self.sketches: dict[tuple[int, int], Sketches] = {}  # (mb, pipeline) -> its points
        self.committed: dict[tuple[int, int], float] = {}  # (mb, pipeline) -> when its first stage committed
        self.linked: set[tuple[int, int]] = set()  # (mb, pipeline) whose links were checked and agree
        self.passed: set[tuple[int, int]] = set()  # (mb, pipeline) whose copy a check verified (Ledger)
        self.sampled = self.unchecked = self.verified = 0

    # ------------------------------------------------------------------------------------------ events
    def sample(self, mb: int, pipeline: int) -> bool:
        """``mb`` was leased to ``pipeline`` (an original): draw whether it is checked."""
        if mb in self.checks and not self.checks[mb].decided:
            return False
        rate = self.rate_of(pipeline)
        if rate <= 0 or self.rng.random() >= rate:
            return False
        self.checks[mb] = Check([pipeline])
        self.sampled += 1
        return True

    def shadow_for(self, pipeline: int, can_take: Callable[[int], bool], now: float) -> int | None:
        """A checked micro-batch that ``pipeline`` should run as a copy (``can_take(mb)``: it has not held it);
        registers the copy."""
        for mb, check in sorted(self.checks.items()):
            if not check.decided and len(check.copies) < check.wanted and pipeline not in check.copies \
                    and can_take(mb):
                check.copies.append(pipeline)
                check.leased[pipeline] = now
                return mb
        return None

    def is_copy(self, mb: int, pipeline: int) -> bool:
        """Whether ``pipeline`` runs ``mb`` as a shadow (not its original)."""
        check = self.checks.get(mb)
        return check is not None and pipeline in check.copies[1:]

    def commit(self, mb: int, pipeline: int, now: float) -> None:
        """``pipeline``'s first stage finished ``mb`` (an original that counted, or a shadow)."""
        self.committed.setdefault((mb, pipeline), now)
        check = self.checks.get(mb)
        if check is not None and pipeline in check.copies:
            check.done.setdefault(pipeline, now)

    def sketch(self, mb: int, pipeline: int, stage: int, points: dict[str, tuple[float, ...]]) -> bool:
        """A stage's sketches of ``mb``; False (ignored) when they are not the points its stage reports."""
        if not 0 <= stage < self.n_stages or set(points) != expected_points(stage, self.n_stages):
            return False
        copy = self.sketches.setdefault((mb, pipeline), {})
        for name, values in points.items():
            copy.setdefault((stage, name), values)
        return True

    def loss(self, mb: int, pipeline: int, loss: float) -> None:
        self.sketches.setdefault((mb, pipeline), {}).setdefault((self.n_stages - 1, "loss"), (loss, abs(loss)))

    def done_copies(self, mb: int) -> list[int]:
        """The pipelines whose shadow of ``mb`` finished (their stages hold its gradient apart)."""
        check = self.checks.get(mb)
        return [] if check is None else [p for p in check.copies[1:] if p in check.done]

    def forget(self, pipeline: int) -> None:
        """``pipeline`` left the step (dropped): its own micro-batches go back to the pool (their checks are
        cancelled, a new lease draws again); the checks it was a copy of want another copy, and judge the copies
        left as a fresh pair."""
        for key in [k for k in self.committed if k[1] == pipeline]:
            del self.committed[key]
        for mb, check in list(self.checks.items()):
            if check.decided:
                continue
            if check.copies[0] == pipeline:
                del self.checks[mb]
            elif pipeline in check.copies:
                check.copies.remove(pipeline)
                check.leased.pop(pipeline, None)
                check.done.pop(pipeline, None)
                # the disagreement that asked for a third copy may have been this copy's: the ones left are
                # compared afresh (two that differ ask for a third again)
                check.wanted = 2

    # ------------------------------------------------------------------------------------------ judging
    def complete(self, key: tuple[int, int]) -> bool:
        """Whether a copy's every point has arrived."""
        have = self.sketches.get(key, {})
        return all(p in have for p in path(self.n_stages))

    def judge(self, now: float, commits: dict[int, int], free: Callable[[int, list[int]], bool]) -> list[Finding]:
        """What can be decided now. ``commits``: the pool's commit record; ``free(mb, copies)``: whether an
        intact pipeline not among ``copies`` could still run a copy of ``mb``."""
        out: list[Finding] = []
        for mb, pipeline in sorted({*commits.items(), *((m, p) for m, c in self.checks.items()
                                                      for p in c.done)}):
            out += self._links(mb, pipeline, now)
        for mb, check in sorted(self.checks.items()):
            if not check.decided:
                out += self._decide(mb, check, now, free)
        return out

    def _links(self, mb: int, pipeline: int, now: float) -> list[Finding]:
        key = (mb, pipeline)
        if key in self.linked or key not in self.committed:
            return []
        if not self.complete(key):
            if now - self.committed[key] < SKETCH_WAIT_S:
                return []
            self.linked.add(key)
            return [Finding("late", mb, (pipeline,), f"its sketches of micro-batch {mb} did not arrive within "
                                                      f"{SKETCH_WAIT_S:g} s of its commit")]
        self.linked.add(key)
        if self.n_stages < 2 or (bad := broken_link(self.sketches[key], self.n_stages, self.link_tol)) is None:
            return []
        sender, receiver = bad
        return [Finding("link", mb, (pipeline,), f"spot check: stage {receiver} received another tensor of "
                                                 f"micro-batch {mb} than stage {sender} says it sent",
                        stage=sender, receiver=receiver)]

    def _decide(self, mb: int, check: Check, now: float, free: Callable[[int, list[int]], bool]) -> list[Finding]:
        late = [p for p in check.copies[1:] if p not in check.done
                and now - check.leased.get(p, now) > self.lease_timeout_s]
        if late:
            return [Finding("late", mb, (late[0],), f"its copy of micro-batch {mb} was not done in time")]
        ready = [p for p in check.copies if p in check.done and self.complete((mb, p))]
        if len(check.copies) < check.wanted and not free(mb, check.copies):
            check.decide()  # nobody left to run the copy
            if check.wanted == 2:
                self.unchecked += 1
                return []
            return [Finding("aside", mb, tuple(check.copies[:2]), f"spot check of micro-batch {mb}: two copies "
                                                                   "differ and no third pipeline can decide")]
        if len(ready) < check.wanted or len(check.copies) < check.wanted:
            return []
        copies = [self.sketches[(mb, p)] for p in check.copies]
        if check.wanted == 2:
            k = first_difference(copies[0], copies[1], self.n_stages, self.tol)
            if k is None:
                check.decide()
                self.verified += 1
                self.passed.update((mb, p) for p in check.copies)
                return [Finding("verified", mb, tuple(check.copies), f"micro-batch {mb}: two copies agree")]
            stage, point = path(self.n_stages)[k]
            mine = [i for i in (0, 1) if self.own(check.copies[i], stage)]
            if len(mine) == 1:  # one suspect is the leader's own worker: it trusts its own copy
                check.decide()
                winner, loser = check.copies[mine[0]], check.copies[1 - mine[0]]
                self.verified += 1
                self.passed.add((mb, winner))
                return [Finding("exclude", mb, (loser,), f"spot check: its stage {stage} {point} of micro-batch "
                                f"{mb} (step {self.step}) disagreed with the leader's own copy (pipeline {winner})",
                                stage=stage),
                        Finding("verified", mb, (winner,), f"micro-batch {mb}: the leader's own copy")]
            if len(check.copies) >= MAX_COPIES:
                return []
            check.want_third()  # a third copy decides (or, if none can run, the two are set aside now)
            return self._decide(mb, check, now, free)
        check.decide()
        judged = majority(copies[:3], self.n_stages, self.tol)
        if judged is None:
            return [Finding("aside", mb, tuple(check.copies[:2]), f"spot check of micro-batch {mb}: three copies "
                                                                   "and no majority")]
        loser, stage = judged
        point = path(self.n_stages)[first_difference(copies[0], copies[1], self.n_stages, self.tol) or 0][1]
        winners = tuple(p for i, p in enumerate(check.copies[:3]) if i != loser)
        self.verified += 1
        self.passed.update((mb, p) for p in winners)
        return [Finding("exclude", mb, (check.copies[loser],),
                        f"spot check: its stage {stage} {point} of micro-batch {mb} (step {self.step}) disagreed "
                        f"with the two other copies (pipelines {list(winners)})", stage=stage),
                Finding("verified", mb, winners, f"micro-batch {mb}: two of three copies agree")]

    def settled(self, commits: dict[int, int]) -> bool:
        """Whether the reduce may start: every committed micro-batch's links were checked, every check decided."""
        return all((mb, p) in self.linked for mb, p in commits.items()) and \
            all(c.decided for c in self.checks.values())
