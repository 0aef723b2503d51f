"""The referee of bad-peer reports: a report is a member's claim, and no single claim excludes a peer.

A worker that refuses data (malformed, an outlier, unrelated to the others' sum, a summed shard its digests do
not explain) names the sender in a ``BadPeer`` report. The reporter may be lying, to get an honest neighbour
excluded. The leader cannot look at the data itself, so it weighs what it can check: how many distinct identities
name the accused, how many could have seen the data, and whether the accused's work later passed the checks of
other witnesses. Per report (:meth:`Referee.report`):

* **Corroborated**: the accused has been named by two or more distinct reporters (identities, over the run).
  It is excluded from the plan, and those reporters' accusations of it count as true.
* **A lone report that others could have corroborated** (the accused's data reached two or more witnesses of
  its kind: the other participants of a replica group of three or more): unless another reporter corroborates it
  within ``SET_ASIDE_GRACE_S``, the reporter's own pipeline is set aside for this step (its work is redone by
  the others; nobody is excluded or banned, and it catches up after the apply). The accused stays: the other
  witnesses checked the same data.
* **A lone report nobody else could have made** (a pipeline neighbour's activations, a group of two): the
  leader cannot tell the two apart, and the step must not use data one of them refuses, so the accused is
  excluded from the plan as before, and the accusation is remembered.
* **Found false**: an accusation is contradicted when the accused's pipeline applies a step at or after it (its
  work passed every check of the other witnesses: :meth:`vindicate`) and nobody else has named it. A reporter
  with ``FALSE_REPORTS`` contradicted accusations is excluded itself, and its reports are ignored for the rest
  of the leadership. So a false accuser costs the run at most ``FALSE_REPORTS - 1`` honest plan exclusions (or
  steps of its own pipeline set aside) before it is the one excluded.

Limits: two colluding identities in witness positions corroborate each other; a cheater that sends bad bytes to
one receiver only gets that receiver's pipeline set aside for the step (and counted against it if the cheater then
behaves); identities are remembered for the leadership (``MAX_TRACKED``), not across leader changes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from peer.runtime.lead.roster import Roster

FALSE_REPORTS = 2  # contradicted accusations that make a reporter a false one
# a lone reporter's pipeline is set aside only this long after its report: the other witnesses of the same data
# check it at about the same moment, and a report they corroborate meanwhile costs the reporter nothing
SET_ASIDE_GRACE_S = 2.0
MAX_TRACKED = 4096  # identities remembered (reporters and accused): bounded whatever the swarm reports


@dataclass(frozen=True)
class Verdict:
    """What a report does: identities to exclude from the plan, reporters' pipelines to set aside for the step
    (identities; after ``SET_ASIDE_GRACE_S``, time for a second reporter), and why (the log, the exclusion's
    reason)."""

    exclude: tuple[str, ...] = ()
    set_aside: tuple[str, ...] = ()
    reason: str = ""
    kept: tuple[str, ...] = ()  # reporters whose pending set-aside is cancelled: another reporter corroborated them


@dataclass
class Referee:
    """Weighs bad-peer reports by identity (a peer id; an endpoint where a local run has no certificates)."""

    named_by: dict[str, set[str]] = field(default_factory=dict)  # accused -> distinct reporters, over the run
    lone: dict[str, dict[str, int]] = field(default_factory=dict)  # reporter -> accused -> step of the accusation
    contradicted: dict[str, int] = field(default_factory=dict)  # reporter -> its accusations found false
    false_reporters: set[str] = field(default_factory=set)

    def report(self, reporter: str, accused: str, witnesses: int, step: int) -> Verdict:
        """``reporter`` names ``accused`` in ``step``; ``witnesses``: how many workers of the plan receive the
        same kind of data from the accused (the reporter included)."""
        if reporter in self.false_reporters:
            return Verdict(reason=f"{reporter} made false reports before; its report is ignored")
        if reporter == accused:
            return Verdict(reason="a peer cannot report itself")
        if accused not in self.named_by and len(self.named_by) >= MAX_TRACKED:
            return Verdict(set_aside=(reporter,), reason="too many identities accused; the reporter is set aside")
        reporters = self.named_by.setdefault(accused, set())
        reporters.add(reporter)
        if len(reporters) >= 2:
            for r in reporters:  # their accusations were true
                self.lone.get(r, {}).pop(accused, None)
            return Verdict(exclude=(accused,), reason=f"named by {len(reporters)} peers",
                           kept=tuple(sorted(reporters - {reporter})))
        if len(self.lone) < MAX_TRACKED or reporter in self.lone:
            self.lone.setdefault(reporter, {})[accused] = step
        if witnesses >= 2:
            return Verdict(set_aside=(reporter,), reason=f"named by {reporter} alone while {witnesses - 1} other "
                           "witness(es) saw the same data; the reporter's pipeline is set aside for the step")
        return Verdict(exclude=(accused,), reason=f"named by its only witness {reporter}")

    def vindicate(self, applied: set[str], step: int) -> Verdict:
        """The pipelines of ``applied`` (identities) applied ``step``: their work passed every check of the other
        witnesses. Each accusation of one of them made at or before ``step`` that nobody corroborated is
        contradicted; a reporter with ``FALSE_REPORTS`` of them is excluded."""
        false: list[str] = []
        for reporter, accused in self.lone.items():
            for peer, at in list(accused.items()):
                if peer in applied and at <= step and len(self.named_by.get(peer, ())) < 2:
                    del accused[peer]
                    self.named_by.get(peer, set()).discard(reporter)  # no longer counts toward corroboration
                    self.contradicted[reporter] = self.contradicted.get(reporter, 0) + 1
                    if self.contradicted[reporter] >= FALSE_REPORTS and reporter not in self.false_reporters:
                        self.false_reporters.add(reporter)
                        false.append(reporter)
        if not false:
            return Verdict()
        return Verdict(exclude=tuple(false), reason=f"{FALSE_REPORTS} of its reports named peers whose work then "
                       "passed every other witness's checks")


def witnesses(roster: Roster, reporter: str, accused: str, out: Collection[str]) -> int:
    """How many workers of the plan (endpoints, the reporter included) receive the data the reporter refused from
    ``accused``: in a replica group every participant still in the step (not in ``out``) checks every owner's shard
    and every owner every contribution; a pipeline neighbour is the only one that receives its activations."""
    group = roster.assignments[accused].group if accused in roster.assignments else ()
    if reporter not in group:
        return 1
    return len([ep for ep in group if ep != accused and ep not in out])
