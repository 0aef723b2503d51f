"""A healed partition: which side's work the run keeps (docs/architecture.md, "Partitions").

A leader without a quorum goes on after ``[swarm] quorum_wait_s`` (``peer.node.leader_role``), so a long
partition can leave two sides that both trained. When they meet again, the leader the whole swarm elects finds
the other side's plan (signed by its leader, made after this leadership began, naming peers that just came back)
and judges: the side with the newer (plan epoch, trained step) wins; on an exact tie the side whose leader id
sorts first wins, so both leaders reach the same verdict from the same inputs. The loser's steps since the split are
discarded: its peers fetch the winner's state at the next plan, and the leader logs and publishes what was lost.
A step number read from the other side's records is believed only as an int within the run's steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tasklet.peer.swarm.plans import PlanRecord
from tasklet.peer.timing import now

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """Whose side wins and what the loser's work was: ``theirs`` (True: the other side's state is kept),
    ``step`` (the step the run goes on from), ``split`` (the step the sides parted at), ``their_peers`` (the
    other side's planned peer ids) and ``discarded`` (what `peer status` shows)."""

    theirs: bool
    step: int
    split: int
    epoch: int
    their_peers: frozenset[str] = field(default_factory=frozenset)
    discarded: dict[str, Any] = field(default_factory=dict)


def bounded_step(value: object, steps: int) -> int | None:
    """A step number read from another peer's record, believed only as an int in 0..steps."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= steps:
        return None
    return value


def find_rival(plans: Iterable[PlanRecord], me: str, start_epoch: int, returning: set[str]) -> PlanRecord | None:
    """The newest plan of another leader made after this leadership began (epoch above ``start_epoch``) that
    names a peer that just came back: the other side of a partition (``plans``: newest first)."""
    return next((r for r in plans if r.leader_id != me and r.epoch > start_epoch and set(r.members) & returning),
                None)


def split_step(plans: Iterable[PlanRecord], rival: PlanRecord, steps: int) -> int | None:
    """The step the sides parted at: where the rival's lineage went on without a quorum (the ``step`` of its
    leader's plan that waived it), None when no such plan is found."""
    for r in plans:
        if r.leader_id == rival.leader_id and r.epoch <= rival.epoch and isinstance(r.plan.get("quorum_waived"), dict):
            return bounded_step(r.plan.get("step"), steps)
    return None


def side_wins(a: tuple[int, int], a_leader: str, b: tuple[int, int], b_leader: str) -> bool:
    """Whether side ``a`` (its (plan epoch, trained step) and leader id) beats side ``b``: the newer (epoch,
    step), then the smaller leader id; antisymmetric for distinct leaders, so either side computes the same."""
    if a != b:
        return a > b
    return a_leader < b_leader


def judge(rival: PlanRecord, progress: dict[str, Any], me: str, ours: tuple[int, int], steps: int,
          split: int | None = None) -> Verdict:
    """The side with the newer (epoch, trained step) wins, on a tie the side whose leader id sorts first: a total
    order, so the two leaders judging each other reach one verdict. ``ours`` is (our plan epoch, our trained
    step), ``progress`` the other leader's progress record, ``split`` the step the sides parted at (see
    :func:`split_step`; None: the lesser of the two sides' steps)."""
    their_step = bounded_step(progress.get("step"), steps)
    if their_step is None:
        their_step = bounded_step(rival.plan.get("step"), steps) or 0
    if split is None or split > min(their_step, ours[1]):
        split = min(their_step, ours[1])
    theirs = (rival.epoch, their_step)
    peers = frozenset(pid for pipe in rival.plan.get("pipelines") or [] if isinstance(pipe, list)
                      for pid in pipe if isinstance(pid, str))
    win = side_wins(theirs, rival.leader_id, ours, me)
    loser, kept = (ours, theirs) if win else (theirs, ours)
    discarded = {"leader": me if win else rival.leader_id, "epoch": loser[0], "step": loser[1],
                 "steps": max(0, loser[1] - split), "kept_leader": rival.leader_id if win else me,
                 "kept_epoch": kept[0], "kept_step": kept[1]}
    return Verdict(win, their_step if win else ours[1], split, rival.epoch, peers, discarded)


class QuorumWait:
    """A leader's bounded pause without a quorum of the previous plan's members, as a small state machine:
    ``waiting`` -> ``paused`` (when first short of a quorum) -> ``go`` (a quorum is back) or ``waived`` (after
    ``wait_s``: the leader goes on with the peers present, fencing the previous plan). ``now_s`` is monotonic
    seconds; ``pause`` (why, since and until when, in DHT time) is what the progress record publishes."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.paused_at: float | None = None
        self.pause: dict[str, Any] | None = None
        self.waiver: dict[str, Any] | None = None  # what the next plan's quorum waiver says, once waived

    def step(self, previous: PlanRecord | None, live: set[str], quorum: bool, now_s: float) -> str:
        """``go``, ``paused`` (just now: publish it), ``waiting`` (still paused) or ``waived``."""
        if quorum:
            if self.paused_at is not None:
                log.info("leader: a quorum of the previous plan's members is back; resuming")
            self.pause = None
            return "go"
        assert previous is not None  # no previous plan always has a quorum
        members = set(previous.members) | {previous.leader_id}
        present = len(members & live)
        if self.paused_at is None:
            self.paused_at = now_s
            reason = (f"only {present} of the {len(members)} members of plan {previous.epoch} are reachable (a "
                      "majority is needed)")
            self.pause = {"reason": reason, "since": now(), "until": now() + self.wait_s, "epoch": previous.epoch}
            log.warning("leader: paused, %s; going on without them in %.0f s ([swarm] quorum_wait_s)", reason,
                        self.wait_s)
            return "paused"
        waited = now_s - self.paused_at
        if waited < self.wait_s:
            return "waiting"
        log.warning("leader: no majority of plan %d's members for %.0f s; going on with the %d present in a new "
                    "epoch that fences plan %d (quorum waived)", previous.epoch, waited, present, previous.epoch)
        self.waiver = {"fenced_epoch": previous.epoch, "waited_s": round(waited, 1), "present": present,
                       "members": len(members)}
        self.pause = None
        return "waived"
