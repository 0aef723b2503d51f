"""The referee of bad-peer reports: a report is a member's testimony, and testimony alone never rolls back.

A worker that refuses data (malformed, an outlier, unrelated to the others' sum, a summed shard its digests do
not explain) names the sender in a ``BadPeer`` report; a link whose two ends report different sketches of the
same bytes comes here too, as the receiver's report of the sender. The reporter may be lying, to get an honest
neighbour excluded, and an exclusion also rolls back the excluded peer's unverified applied work
(``peer.runtime.lead.verify``), which can reach back to step 0. So the rule is: **an exclusion (and the roll-back
it brings) needs evidence the leader computed itself** — a spot check's majority of copies or the leader's own
copy (``peer.runtime.lead.spot``), or a refusal by the leader's own worker — and **testimony costs the run at most
the current step**: the pipelines that must not use the disputed data sit out that step (their work is redone by
the others, their members go back on probation, so the spot checks look at them harder), an accused that no
other witness can clear is left out of the plan for a ban's time, and nothing is rolled back. Per report
(:meth:`Referee.report`):

* **The leader's own worker reported it**: the leader made that check itself; the accused is excluded.
* **The accused is the leader's own worker**: the leader knows what its worker sent; the reporter's pipeline is
  set aside at once and the accusation counts as false.
* **Corroborated**: two or more distinct identities named the accused (over the leadership). The accused is
  *sidelined*: left out of the plan for a ban's time, the step redone without it, its applied work kept (no
  roll-back), and the reporters' own pending set-asides are cancelled (``kept``). Two colluders can do this to an
  honest peer; it costs the run the current step and the victim one ban.
* **A lone report that others could have corroborated** (the accused's data reached two or more witnesses of
  its kind: the other participants of a replica group of three or more): unless another reporter corroborates it
  within ``SET_ASIDE_GRACE_S``, the reporter's own pipeline is set aside for this step. The accused stays: the
  other witnesses checked the same data.
* **A lone report nobody else could have made** (a pipeline neighbour's activations, a group of two): the leader
  cannot tell the two apart, and the step must not use data one of them refuses, so the accused is sidelined
  (as above: no roll-back). Setting both aside instead would leave a run of two pipelines with none intact, step
  after step, while a cheater keeps sending; sidelining keeps it training, and a reporter whose accusations are
  then contradicted is found false (below).
* **Found false**: an accusation is contradicted when the accused's pipeline applies a step at or after it (its
  work passed every check of the other witnesses: :meth:`vindicate`) and nobody else has named it. A reporter
  with ``FALSE_REPORTS`` contradicted accusations is a false reporter: its reports are ignored for the rest of
  the leadership (it is not excluded: that too would rest on testimony).

So one false report costs the run at most the current step (redone) and its victim one ban, never a roll-back
(``tests/runtime/test_lead_evidence.py``). Limits: only the leader's own evidence rolls back a cheater's applied work; a
cheater's work that passed every check is kept when testimony sidelines it. An honest receiver framed by a
cheater that then behaves is counted as a false reporter.
Identities are remembered for the leadership (``MAX_TRACKED``), not across leader changes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tasklet.peer.runtime.lead.machine import StepMachine
from tasklet.peer.runtime.lead.roster import Roster

FALSE_REPORTS = 2  # contradicted accusations that make a reporter a false one
# a lone reporter's pipeline is set aside only this long after its report: the other witnesses of the same data
# check it at about the same moment, and a report they corroborate meanwhile costs the reporter nothing
SET_ASIDE_GRACE_S = 2.0
MAX_TRACKED = 4096  # identities remembered (reporters and accused): bounded whatever the swarm reports


@dataclass(frozen=True)
class Verdict:
    """What a report does: identities to exclude from the plan (evidence only), identities whose pipelines are set
    aside for the step at once (``drop``) or after ``SET_ASIDE_GRACE_S`` (``set_aside``: a lone reporter, time for
    a second one), and why (the log, the exclusion's reason)."""

    exclude: tuple[str, ...] = ()
    set_aside: tuple[str, ...] = ()
    reason: str = ""
    kept: tuple[str, ...] = ()  # reporters whose pending set-aside is cancelled: another reporter corroborated them
    drop: tuple[str, ...] = ()
    # identities left out of the plan for a ban's time, their applied work kept (no roll-back): testimony's most
    sideline: tuple[str, ...] = ()

    @property
    def suspects(self) -> tuple[str, ...]:
        """Identities whose pipelines the verdict sets aside: back on probation, so spot checks look at them."""
        return tuple(sorted({*self.set_aside, *self.drop, *self.sideline}))


@dataclass
class Referee:
    """Weighs bad-peer reports by identity (a peer id; an endpoint where a local run has no certificates).
    ``own``: the leader's own identity, whose worker's checks are the leader's own evidence."""

    named_by: dict[str, set[str]] = field(default_factory=dict)  # accused -> distinct reporters, over the run
    lone: dict[str, dict[str, int]] = field(default_factory=dict)  # reporter -> accused -> step of the accusation
    contradicted: dict[str, int] = field(default_factory=dict)  # reporter -> its accusations found false
    false_reporters: set[str] = field(default_factory=set)
    own: str = ""

    def report(self, reporter: str, accused: str, witnesses: int, step: int) -> Verdict:
        """``reporter`` names ``accused`` in ``step``; ``witnesses``: how many workers of the plan receive the
        same kind of data from the accused (the reporter included)."""
        if reporter in self.false_reporters:
            return Verdict(reason=f"{reporter} made false reports before; its report is ignored")
        if reporter == accused:
            return Verdict(reason="a peer cannot report itself")
        if self.own and reporter == self.own:
            return Verdict(exclude=(accused,), reason="refused by the leader's own worker")
        if self.own and accused == self.own:
            self._contradict(reporter)
            return Verdict(drop=(reporter,), reason="it named the leader's own worker, whose data the leader "
                           "computed itself; the reporter's pipeline is set aside for the step")
        if accused not in self.named_by and len(self.named_by) >= MAX_TRACKED:
            return Verdict(set_aside=(reporter,), reason="too many identities accused; the reporter is set aside")
        reporters = self.named_by.setdefault(accused, set())
        reporters.add(reporter)
        if len(reporters) >= 2:
            for r in reporters:  # their accusations were true
                self.lone.get(r, {}).pop(accused, None)
            return Verdict(sideline=(accused,), kept=tuple(sorted(reporters - {reporter})),
                           reason=f"named by {len(reporters)} peers; left out of the plan for a ban's time, its "
                           "applied work kept")
        if len(self.lone) < MAX_TRACKED or reporter in self.lone:
            self.lone.setdefault(reporter, {})[accused] = step
        if witnesses >= 2:
            return Verdict(set_aside=(reporter,), reason=f"named by {reporter} alone while {witnesses - 1} other "
                           "witness(es) saw the same data; the reporter's pipeline is set aside for the step")
        return Verdict(sideline=(accused,), reason=f"named by its only witness {reporter}; left out of the plan for "
                       "a ban's time, its applied work kept (testimony rolls nothing back)")

    def vindicate(self, applied: set[str], step: int) -> Verdict:
        """The pipelines of ``applied`` (identities) applied ``step``: their work passed every check of the other
        witnesses. Each accusation of one of them made at or before ``step`` that nobody corroborated is
        contradicted; a reporter with ``FALSE_REPORTS`` of them is a false reporter from then on (ignored)."""
        false: list[str] = []
        for reporter, accused in self.lone.items():
            for peer, at in list(accused.items()):
                if peer in applied and at <= step and len(self.named_by.get(peer, ())) < 2:
                    del accused[peer]
                    self.named_by.get(peer, set()).discard(reporter)  # no longer counts toward corroboration
                    if self._contradict(reporter):
                        false.append(reporter)
        if not false:
            return Verdict()
        return Verdict(reason=f"{', '.join(false)}: {FALSE_REPORTS} of its reports named peers whose work then "
                       "passed every other witness's checks; its reports are ignored from now on")

    def _contradict(self, reporter: str) -> bool:
        """One more of ``reporter``'s accusations was false; True when that makes it a false reporter."""
        if reporter not in self.contradicted and len(self.contradicted) >= MAX_TRACKED:
            return False
        self.contradicted[reporter] = self.contradicted.get(reporter, 0) + 1
        if self.contradicted[reporter] >= FALSE_REPORTS and reporter not in self.false_reporters:
            self.false_reporters.add(reporter)
            return True
        return False


def set_aside(machine: StepMachine, roster: Roster, verdict: Verdict, who: Callable[[str], str], now: float) -> None:
    """Carry a verdict's set-asides into the running step (``who``: a worker's endpoint -> its identity): ``drop``
    at once (a pending grace gives way), ``set_aside`` after the grace, ``kept`` cancels a pending one."""
    for ep, a in roster.assignments.items():
        if who(ep) in verdict.drop:
            machine.keep(a.replica)
            machine.set_aside(a.replica, now)
        elif who(ep) in verdict.set_aside:
            machine.set_aside(a.replica, now + SET_ASIDE_GRACE_S)
        elif who(ep) in verdict.kept:
            machine.keep(a.replica)


def witnesses(roster: Roster, reporter: str, accused: str, out: Collection[str]) -> int:
    """How many workers of the plan (endpoints, the reporter included) receive the data the reporter refused from
    ``accused``: in a replica group every participant still in the step (not in ``out``) checks every owner's shard
    and every owner every contribution; a pipeline neighbour is the only one that receives its activations."""
    group = roster.assignments[accused].group if accused in roster.assignments else ()
    if reporter not in group:
        return 1
    return len([ep for ep in group if ep != accused and ep not in out])
