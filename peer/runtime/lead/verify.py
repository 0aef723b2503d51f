"""The coordinator's side of the spot checks: each step's :class:`~peer.runtime.lead.spot.SpotChecks`, sampled
at rates from the leader's probation record, and what a finding does (credit, exclusion, the referee, probation).

Kept out of the coordinator so its shell stays a shell; the rules themselves are in ``peer.runtime.lead.spot``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.lead.machine import StepMachine
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.spot import Finding, Ledger, Probation, SpotChecks
from tasklet.peer.runtime.spec import RunSpec
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage, Forbidden, Rejected

log = logging.getLogger(__name__)

# a reported loss beyond this is refused: a language model's cross-entropy at init is ln(vocab) (~11 for 64k
# tokens), so nothing an honest stage computes comes near it, and the step's mean of such values stays finite
MAX_LOSS = 1e6


class Verification:
    """Spot checks across a leadership. ``who(endpoint)``: the identity of a worker; ``exclude(endpoint, reason)``
    excludes it (the coordinator's declare_dead, which records the reason for the credit record);
    ``refer(roster, reporter, accused, step, error)`` hands a report to the referee; ``own_id``: the leader's
    peer id, whose own worker's copy decides a disagreement it is part of (it trusts its own computation)."""

    def __init__(self, spec: RunSpec, who: Callable[[str], str], exclude: Callable[[str, str], None],
                 refer: Callable[[Roster, str, str, int, str], None], own_id: str = "") -> None:
        self.spec, self.own_id = spec, own_id
        self.probation = Probation(spec.probation_check, spec.probation_microbatches)
        self.who, self.exclude, self.refer = who, exclude, refer
        self.totals = {"verified": 0, "excluded": 0}  # findings over the leadership (a redone step's included)
        self.ledger = Ledger()  # unverified work applied, per identity: what an exclusion rolls back
        # endpoint -> (first unverified step, reason) of the excluded peers whose applied work must be discarded,
        # until the driver takes them after the step (bounded: only a worker of the plan is excluded, once)
        self._undo: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()  # act() runs on the threads that carry out commands, the rest on the driver's

    def inherit(self, ledger: Ledger) -> None:
        """Start from the unverified work a previous leader recorded (its roll-backs are this leadership's too)."""
        with self._lock:
            self.ledger = ledger

    def applied(self, step: int, roster: Roster, commits: dict[int, int], spot: SpotChecks | None) -> None:
        """A step was applied with ``commits`` (micro-batch -> pipeline): record, per identity, the work no spot
        check verified (``Ledger``)."""
        if spot is None:
            return
        unverified = {p for mb, p in commits.items() if (mb, p) not in spot.passed}
        with self._lock:
            self.ledger.applied(step, [self.who(ep) for ep in roster.members(unverified)])

    def discard(self, culprit: str, reason: str) -> None:
        """``culprit`` was excluded (by a spot check or the referee): its applied work no spot check verified
        (the ledger) is to be rolled back by the driver after the step (:meth:`take_rollback`)."""
        with self._lock:
            first = self.ledger.first_unverified(self.who(culprit))
            if first is not None:
                self._undo[culprit] = (min(first, self._undo.get(culprit, (first, ""))[0]), reason)
        if first is not None:
            log.warning("%s had unverified work applied from step %d on: it is discarded", culprit, first)

    def take_rollback(self) -> tuple[int, list[str], str] | None:
        """(the earliest first-unverified step, the endpoints, the reasons) of the peers excluded (:meth:`discard`)
        since the last call whose unverified work reached the model; None when there are none."""
        with self._lock:
            undo, self._undo = self._undo, {}
        if not undo:
            return None
        step = min(s for s, _ in undo.values())
        return step, sorted(undo), "; ".join(f"{ep}: {why}" for ep, (_, why) in sorted(undo.items()))

    def rolled_back(self, step: int) -> None:
        """The run went back to the checkpoint of ``step``: the ledger forgets the discarded work."""
        with self._lock:
            self.ledger.rolled_back(step)

    def earliest_unverified(self, endpoints: list[str]) -> int | None:
        """The earliest first-unverified step of these workers (the checkpoint to keep for a roll-back)."""
        with self._lock:
            return self.ledger.earliest(self.who(ep) for ep in endpoints)

    def checks(self, step: int, roster: Roster, lease_timeout_s: float) -> SpotChecks | None:
        """The spot checks of one step (None when the run has them off, or trains DiLoCo, whose pipelines apply
        their own shares and are not compared micro-batch by micro-batch)."""
        if not self.spec.sketches:
            return None
        n_stages = max((a.n_stages for a in roster.assignments.values()), default=1)

        def rate_of(pipeline: int) -> float:
            members = [self.who(ep) for ep in roster.members([pipeline])]
            if any(self.probation.on_probation(m) for m in members):
                return max(self.spec.spot_check, self.spec.probation_check)
            return self.spec.spot_check

        def own(pipeline: int, stage: int) -> bool:
            ep = roster.endpoint_of(stage, pipeline)
            return bool(self.own_id) and ep is not None and roster.peer_ids.get(ep) == self.own_id

        return SpotChecks(step, n_stages, rate_of, self.spec.precision, self.spec.compression, lease_timeout_s,
                          own=own)

    @staticmethod
    def sketch(machine: StepMachine, key: pb.Key, msg: ctl.Sketch) -> None:
        """A stage's sketches (the sender is the plan's worker at the key's stage and pipeline): to the step."""
        if not machine.sketch(key.replica, key.stage, msg.microbatch, msg.parsed()):
            raise Rejected(f"sketches of points {list(msg.points)} do not fit stage {key.stage}, or spot checks "
                           "are off")

    @staticmethod
    def check_loss(cond: threading.Condition, machine: StepMachine | None, key: pb.Key, msg: ctl.Loss,
                   from_last_stage: bool, sender: str) -> None:
        """:func:`check_loss`; a refused loss of the last stage still tells the spot checks that this copy of the
        micro-batch has no usable loss (it disagrees with any other copy at once, instead of being waited for)."""
        try:
            check_loss(msg.loss, from_last_stage, sender)
        except BadMessage:
            with cond:
                if machine is not None and machine.spot is not None and key.step == machine.step \
                        and 0 <= msg.microbatch < machine.pool.n_microbatches:
                    machine.spot.loss(msg.microbatch, key.replica, math.nan)
            raise

    def act(self, roster: Roster, step: int, finding: Finding) -> None:
        """Carry out a finding (the machine already set aside what the step must not use)."""
        f = finding
        members = roster.members(f.pipelines)
        if f.kind == "verified":
            self.totals["verified"] += 1
            self.probation.credit(self.who(ep) for ep in members)
            return
        if f.kind == "aside":
            self.probation.suspect(self.who(ep) for ep in members)
            log.warning("step %d: pipelines %s set aside: %s", step, list(f.pipelines), f.reason)
        elif f.kind == "late":
            log.warning("step %d: pipeline %d set aside: %s", step, f.pipelines[0], f.reason)
        elif f.kind == "exclude":
            culprit = roster.endpoint_of(f.stage, f.pipelines[0])
            if culprit is not None:
                self.totals["excluded"] += 1
                log.warning("step %d: excluding %s: %s", step, culprit, f.reason)
                self.exclude(culprit, f.reason)
                self.discard(culprit, f.reason)
        elif f.kind == "link":
            sender, receiver = roster.endpoint_of(f.stage, f.pipelines[0]), roster.endpoint_of(f.receiver,
                                                                                             f.pipelines[0])
            if sender is not None and receiver is not None:
                self.refer(roster, receiver, sender, step, f.reason)


def check_loss(loss: float, from_last_stage: bool, sender: str) -> None:
    """Refuse a loss report the run cannot use: only a pipeline's last stage computes a loss, and it is a finite
    number within ``MAX_LOSS`` (a NaN, an infinity or 1e308 would make the step's loss, and the progress record
    published from it, unusable)."""
    if not from_last_stage:
        raise Forbidden(f"a loss is taken only from the last stage of a pipeline; {sender} is not one")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise BadMessage("loss", f"{loss!r} is not a finite number")
    if abs(loss) > MAX_LOSS:
        raise BadMessage("loss", f"{loss:g} is outside [-{MAX_LOSS:g}, {MAX_LOSS:g}]")
