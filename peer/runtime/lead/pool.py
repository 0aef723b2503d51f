"""The task pool of one training step: micro-batches leased to pipelines, committed exactly once.

Not to be confused with hivemind's or Petals' "task pool", which is a server-side batching queue. Here a
*task* is one micro-batch of the current step, and the pool is the book-keeping that makes the step's
gradient a sum over every micro-batch exactly once, whatever pipelines die on the way.

Rules, and why:

* A pipeline's first stage *pulls* work: ``lease(pipeline)`` hands out the lowest free micro-batch id. Pulling
  (rather than a fixed split) lets fast pipelines do more micro-batches, and makes re-assignment after a
  death the normal path instead of a special case.
* ``commit(mb, pipeline)`` is called when the micro-batch's backward finished on the pipeline's first stage,
  i.e. every stage of that pipeline holds its gradient contribution. The first commit wins; a second commit
  of the same micro-batch (a late reply after a requeue) is reported as a duplicate and must not be summed.
* When a pipeline loses a member, every micro-batch it leased *or committed* in this step goes back to the
  pool, and the surviving stages of that pipeline drop their whole gradient accumulator for the step. A
  committed micro-batch has to be redone too: its contribution to the dead stage is gone with the peer.
* A lease that passes its deadline counts as the death of its pipeline (same treatment). A replica adds a
  micro-batch's gradient to its accumulator as soon as its backward is done (memory stays one gradient per
  replica); the price is that a failed pipeline's whole share of the step is redone, never patched.
* A failed pipeline gets no more leases and its commits are stale for the rest of the step; the coordinator
  re-plans and the next step (or the re-planned remainder of this one) uses new pipeline ids.
* Speculation (stragglers). A pipeline is *overdue* when the micro-batch at the head of its window (its oldest
  outstanding lease, counted from when it became the head: its lease, or the pipeline's last commit if later)
  has been held longer than ``speculate_after_s`` (the caller's figure for a head micro-batch of a pipeline of
  the swarm's usual speed: a factor x the measured head latency, ``head_latencies``), or when its oldest lease
  whose loss has not arrived (``progress``: the last stage reports a micro-batch's loss once it crossed every
  stage forward, the earliest sign of progress the pool gets, about two thirds of the way on two stages) has
  waited longer than ``forward_after_s`` (the same, for ``forward_latencies``), both stretched by the
  pipeline's known slowness (its pacing figure over the median's, at least 1: a pipeline known slow is not
  copied for being as slow as it is known to be); once overdue it stays so for the step. The forward signal
  fires about a third of a head latency sooner than the commit signal, before any healthy pipeline runs out
  of work. An overdue pipeline gets no new micro-batch while another pipeline is left, and when nothing is
  free a pipeline that asks and holds at most one micro-batch gets a copy of an overdue pipeline's
  micro-batch, the oldest first (all of them may be copied: the later ones wait behind its slow head; at most
  one copy each). Why at most one: behind one micro-batch a copy pipelines through the stages a stage-time
  later than on an idle pipeline, still well before a head that is already late (a 5x straggler's takes 5
  head latencies); behind more it may lose the race. What a copy costs on a real swarm: one micro-batch of
  compute on each stage of the copying pipeline and its activations on that pipeline's links, spent only
  when nothing is left to lease (the capacity would idle otherwise); a copy that loses is discarded at the
  reduce and at most delays the copier's reduce by the one op it is running.
  Counting from the head, not from the lease, keeps a
  healthy pipeline's second micro-batch (leased at once, queued behind its first) from looking late. The copy
  is marked speculative: every stage of the copying pipeline keeps its gradient apart (not in the step's sum)
  until the reduce says whose it is. The first commit wins. When the copy wins, the original pipeline has that
  micro-batch in its sum already or soon (stages backward last-first, so it cannot be told to keep it apart in
  time): it is failed like a dead one (``losers()``), its work requeued. When the original wins, the copy's
  commit is a duplicate and the copy stays a *backup*: its stages hold its gradient apart until the reduce, so
  if the original pipeline is failed later in the step (its copy of another micro-batch won, a death), that
  micro-batch goes to the backup instead of back to the pool, and is not redone. Once the reduce starts
  (``end_speculation``) the stages have settled what they hold apart, so copies and backups no longer count.
  A pipeline whose head is late on the commit signal while it has committed nothing in the step and free
  micro-batches are left is given up on at once (``abandoned``, failed like a loser): what it holds goes back
  to the pool as free work for the others, instead of being copied later, when a winning copy would make its
  commits of the meantime be redone too.
* A pipeline never gets a micro-batch it already held in this step (a copy that lost the race after the reduce
  had started, the micro-batch requeued later because its owner was failed): its stages have forwarded it and
  refuse it as a repeat, so such a lease would only hang until its deadline (at least ``LEASE_FLOOR_S``) failed
  the pipeline and its whole share. Another pipeline takes it. When every live pipeline held it
  (``unleasable``), nobody can: the coordinator re-plans at once instead of waiting for a deadline.
* Pacing (stragglers). A pipeline gets a free micro-batch only if it would finish it no later than the other
  pipelines would finish their own work plus every free micro-batch without it (``service_s``: each
  pipeline's measured seconds per micro-batch, from the previous step of the same plan). A pipeline five times
  slower than the others takes one micro-batch where it used to take its share, and the step does not wait for
  it, nor does a speculative copy have to overtake it (which fails its whole share of the step). Without a
  measurement, or with no other pipeline leasing in this step (after one of its own micro-batch times), every
  pipeline is served. Only pipelines that can take a free micro-batch count as others (a stage refuses a
  micro-batch it held in this step, e.g. a spot check's shadow copy whose original pipeline was then lost), and
  a free micro-batch nobody else can take is never held back from the one pipeline that can.
* The step may synchronise gradients only when ``complete()``: every micro-batch committed. The commit record
  (``assignment()``) tells each stage replica exactly which micro-batches its accumulator must hold, so the
  reduction can verify "each micro-batch once" instead of trusting it.

The pool is pure state (no I/O, no threads); the coordinator serialises calls to it.
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasklet.peer.timing import LEASE_TIMEOUT_S

KNOWN_SLOWER = 1.5  # a pipeline is known slower than another when its pacing figure is over this x the other's


class CommitResult(enum.Enum):
    """What happened to a commit request."""

    COMMITTED = "committed"
    DUPLICATE = "duplicate"  # already committed (by this or another pipeline): ignore its gradient
    STALE = "stale"  # not leased to this pipeline (requeued after its death or lease expiry)


@dataclass
class Lease:
    """A micro-batch handed to a pipeline, valid until ``deadline`` (monotonic seconds)."""

    microbatch: int
    pipeline: int
    deadline: float
    at: float = 0.0  # when it was leased
    speculative: bool = False  # a copy of a micro-batch another pipeline holds
    progressed: bool = False  # its loss arrived: it crossed every stage forward (``TaskPool.progress``)


class TaskPool:
    """Leases and commits of the micro-batches of one step."""

    def __init__(
        self,
        step: int,
        n_microbatches: int,
        lease_timeout_s: float = LEASE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        service_s: dict[int, float] | None = None,
    ) -> None:
        if n_microbatches <= 0:
            raise ValueError(f"n_microbatches: must be positive, got {n_microbatches}")
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s: must be positive, got {lease_timeout_s}")
        self.step = step
        self.n_microbatches = n_microbatches
        self.lease_timeout_s = lease_timeout_s
        self._clock = clock
        self._free: list[int] = list(range(n_microbatches))
        self._leases: dict[int, Lease] = {}
        self._committed: dict[int, int] = {}
        self._failed: set[int] = set()
        self._copies: dict[int, Lease] = {}  # micro-batch -> its speculative copy (at most one)
        self._held_by: dict[int, set[int]] = {}  # micro-batch -> pipelines that held it (leased or copied) this step
        self._losers: set[int] = set()  # pipelines whose micro-batch a speculative copy won: to be failed
        self._backups: dict[int, int] = {}  # micro-batch -> pipeline whose copy committed second (held apart)
        self._abandoned: set[int] = set()  # late, nothing committed, free work left: failed (``_maybe_abandon``)
        self.backups_used = 0  # committed micro-batches of a failed pipeline handed to their backup, not redone
        self.requeued = 0
        self.speculated = 0  # speculative copies handed out
        self.speculation_won = 0  # ... that committed first
        # pipeline -> measured seconds per micro-batch (previous step); only positive, finite figures count
        self.service_s = {p: s for p, s in (service_s or {}).items() if 0 < s < float("inf")}
        self.paced = 0  # lease requests answered "wait" because another pipeline finishes sooner
        self._started = clock()
        self._moved = self._started  # the last lease, commit or requeue (``idle_s``)
        self._first_lease: dict[int, float] = {}
        self._busy: dict[int, list[tuple[float, float]]] = {}  # pipeline -> (leased, committed) of its commits
        self._last_commit: dict[int, float] = {}  # pipeline -> when it last committed (its head's start)
        self.head_latencies: list[float] = []  # head-of-window to commit seconds of this step's commits
        self._last_progress: dict[int, float] = {}  # pipeline -> when a loss of it last arrived
        self.forward_latencies: list[float] = []  # forward head to loss seconds of this step's leases
        self.overdue: set[int] = set()  # pipelines seen overdue in this step (see the module docstring)

    # -- leasing -----------------------------------------------------------------------------------------
    def lease(self, pipeline: int, speculate_after_s: float | None = None,
              forward_after_s: float | None = None) -> int | None:
        """Lease the lowest free micro-batch to ``pipeline``; None when nothing is free right now.

        ``speculate_after_s``: the head time that makes a pipeline overdue, ``forward_after_s`` the same for its
        oldest micro-batch without a loss (None: that signal is off); ``pipeline`` may then get a speculative
        copy of an overdue pipeline's oldest micro-batch (see the module docstring and :meth:`is_speculative`).
        ``speculate_after_s`` None: no speculation."""
        self.expire()
        if pipeline in self._failed:
            return None
        now = self._clock()
        if speculate_after_s is not None:
            for p in {lease.pipeline for lease in self._leases.values()}:
                self._overdue(p, now, speculate_after_s, forward_after_s)  # marks it, for the rest of the step
                self._maybe_abandon(p, now, speculate_after_s)
            if not self._free and pipeline not in self.overdue:
                return self._speculate(pipeline, now)
        if not self._free:
            return None
        if pipeline in self.overdue and self._better_alive(pipeline):
            self.paced += 1
            return None  # seen slow in this step: no more work behind its late head
        if self._others_finish_sooner(pipeline):
            self.paced += 1
            return None
        fresh = [mb for mb in self._free if pipeline not in self._held_by.get(mb, ())]
        if not fresh:
            return None  # another pipeline takes it: this one's stages would refuse it as a repeat (unleasable)
        mb = min(fresh)
        self._free.remove(mb)
        self._leases[mb] = Lease(mb, pipeline, now + self.lease_timeout_s, at=now)
        self._held_by.setdefault(mb, set()).add(pipeline)
        self._first_lease.setdefault(pipeline, now)
        self._moved = now
        return mb

    def _better_alive(self, pipeline: int) -> bool:
        """Whether another pipeline leasing in this step, not failed and not overdue, is not known slower than
        ``pipeline``: only then is an overdue ``pipeline`` refused work (or given up). A healthy pipeline that
        was late once must not leave the step to a known straggler kept for lack of a spare."""
        active = set(self._first_lease).union(*self._held_by.values())
        return any(p != pipeline and p not in self._failed and p not in self.overdue
                   and not self._known_slower(p, pipeline) for p in active)

    def _known_slower(self, pipeline: int, than: int) -> bool:
        """Whether the pacing figures say ``pipeline`` is clearly slower than ``than`` (over ``KNOWN_SLOWER`` x:
        healthy pipelines differ by a few per cent from step to step, which must not decide anything)."""
        own, other = self.service_s.get(pipeline), self.service_s.get(than)
        return own is not None and other is not None and own > KNOWN_SLOWER * other

    def _held(self, pipeline: int) -> int:
        return sum(1 for lease in (*self._leases.values(), *self._copies.values()) if lease.pipeline == pipeline)

    def _others_finish_sooner(self, pipeline: int) -> bool:
        """Whether the other pipelines would finish their held work and every free micro-batch before
        ``pipeline`` finished one more (fluid estimate from ``service_s``; see the module docstring)."""
        own = self.service_s.get(pipeline)
        if own is None:
            return False
        # a pipeline counts once it leases in this step, or while the step is younger than one of our own
        # micro-batches (feeders start together): one that sits the step out holds nobody back for long
        young = self._clock() - self._started < own
        others = {p: s for p, s in self.service_s.items()  # an overdue one takes no new work: it is no help
                  if p != pipeline and p not in self._failed and p not in self.overdue
                  and (p in self._first_lease or young)}
        # nor is one whose stages held every free micro-batch already (they refuse a repeat)
        others = {p: s for p, s in others.items() if any(p not in self._held_by.get(mb, ()) for mb in self._free)}
        if not others or any(pipeline not in (held := self._held_by.get(mb, set())) and others.keys() <= held
                             for mb in self._free):
            return False  # a free micro-batch only this pipeline can take: nobody else would
        own_finish = (self._held(pipeline) + 1) * own
        fluid = (sum(self._held(p) for p in others) + len(self._free)) / sum(1 / s for s in others.values())
        # a micro-batch is not divisible: no other pipeline finishes one more before (its held + 1) x its time.
        # Without this bound, 3 idle pipelines of one speed each wait for the others to take the last micro-batch.
        soonest = min((self._held(p) + 1) * s for p, s in others.items())
        return own_finish > max(fluid, soonest)

    def _slowness(self, pipeline: int) -> float:
        """How much slower than the median pipeline ``pipeline`` is known to be (pacing figures; at least 1)."""
        own = self.service_s.get(pipeline)
        if own is None or len(self.service_s) < 2:
            return 1.0
        return max(1.0, own / statistics.median(self.service_s.values()))

    def _overdue(self, pipeline: int, now: float, after_s: float, forward_after_s: float | None = None) -> bool:
        """Whether ``pipeline``'s head micro-batch has been held longer than ``after_s`` x its slowness, or its
        oldest micro-batch without a loss longer than ``forward_after_s`` x its slowness, now or before in this
        step (a slow pipeline whose late head finally commits is no faster for the next one)."""
        if pipeline in self.overdue:
            return True
        held = [lease for lease in self._leases.values() if lease.pipeline == pipeline]
        if not held:
            return False
        slowness = self._slowness(pipeline)
        late = self._head_late(pipeline, [lease.at for lease in held], now, after_s * slowness)
        waiting = [lease.at for lease in held if not lease.progressed]
        if not late and forward_after_s is not None and waiting:
            forward_since = max(min(waiting), self._last_progress.get(pipeline, -float("inf")))
            late = now - forward_since >= forward_after_s * slowness
        if late:
            self.overdue.add(pipeline)
        return late

    def _maybe_abandon(self, pipeline: int, now: float, after_s: float) -> None:
        """Give up on ``pipeline`` for the step (``losers``) when its head is late on the commit signal, it has
        committed nothing in the step and free micro-batches are left: the others have work to do anyway, and
        what it holds is better leased to them now, as free work, than copied once nothing is free. A copy that
        wins later fails it anyway, and by then its commits of the step have to be redone (with 2 pipelines,
        a 5x straggler commits its first micro-batch before the copy of its second wins). Only in favour of a
        pipeline that is not overdue and not known slower: a healthy pipeline with a late start must not leave
        the step to a known straggler."""
        if pipeline in self._abandoned or pipeline in self._busy or not self._free or not self._better_alive(pipeline):
            return
        held = [lease.at for lease in self._leases.values() if lease.pipeline == pipeline]
        if held and self._head_late(pipeline, held, now, after_s * self._slowness(pipeline)):
            self._abandoned.add(pipeline)

    def _head_late(self, pipeline: int, leased_at: list[float], now: float, limit_s: float) -> bool:
        """Whether ``pipeline``'s head (its oldest lease, timed from its last commit if later) is held ``limit_s``."""
        return now - max(min(leased_at), self._last_commit.get(pipeline, -float("inf"))) >= limit_s

    def progress(self, microbatch: int, pipeline: int) -> None:
        """``pipeline`` reported ``microbatch``'s loss: it crossed every stage forward (a sign of life of its
        head that comes before the commit). Measures ``forward_latencies`` on its own leases."""
        now = self._clock()
        lease = self._leases.get(microbatch)
        copy = self._copies.get(microbatch)
        if lease is not None and lease.pipeline == pipeline and not lease.progressed:
            lease.progressed = True
            self.forward_latencies.append(now - max(lease.at, self._last_progress.get(pipeline, -float("inf"))))
        elif copy is None or copy.pipeline != pipeline:
            return  # not held by it (late, stale or made up): no sign of anything
        self._last_progress[pipeline] = now  # a copy's loss shows the copier moving too

    def end_speculation(self) -> None:
        """The reduce starts: the stages settle what they held apart, so copies and backups stop counting (a
        copy's late commit is a duplicate; a micro-batch requeued after this is redone)."""
        self._copies.clear()
        self._backups.clear()

    def unleasable(self, live: set[int]) -> list[int]:
        """Free micro-batches that every pipeline of ``live`` (not failed) already held in this step: nobody's
        stages would take them (they refuse a repeat), so the step cannot finish without a re-plan. None when no
        pipeline is left at all: that is a lost pipeline, not a refused repeat."""
        able = live - self._failed
        if not able:
            return []
        return sorted(mb for mb in self._free if able <= self._held_by.get(mb, set()))

    def idle_s(self, able: set[int]) -> float:
        """Seconds the pool has stood still with work that one of ``able`` could take: micro-batches free,
        none leased or copied, nothing leased, committed or requeued since, and a pipeline of ``able`` (not
        failed) whose stages never held one of the free micro-batches; 0 while any of that is false. A healthy
        step is never idle for long (a free micro-batch is leased within a round trip); a long idle is a stall
        that no deadline short of the step's own would end (the coordinator re-plans, ``StepMachine``)."""
        if self._leases or self._copies or not self._free:
            return 0.0
        takers = able - self._failed
        if not any(p not in self._held_by.get(mb, ()) for mb in self._free for p in takers):
            return 0.0  # nobody can take it: a refused repeat (``unleasable``) or no pipeline at all
        return max(0.0, self._clock() - self._moved)

    def _speculate(self, pipeline: int, now: float) -> int | None:
        if self._held(pipeline) > 1:
            return None  # a copy queued behind more than one micro-batch may lose the race (module docstring)
        # never from a pipeline known faster than the copier: a known-slow copier would only lose the race
        old = [lease for mb, lease in self._leases.items() if mb not in self._copies
               and pipeline not in self._held_by.get(mb, ()) and lease.pipeline in self.overdue
               and not self._known_slower(pipeline, lease.pipeline)]
        if not old:
            return None
        mb = min(old, key=lambda lease: (lease.at, lease.microbatch)).microbatch
        self._copies[mb] = Lease(mb, pipeline, now + self.lease_timeout_s, at=now, speculative=True)
        self._held_by.setdefault(mb, set()).add(pipeline)
        self.speculated += 1
        self._moved = now
        return mb

    def hold(self, microbatch: int, pipeline: int) -> None:
        """``pipeline`` runs a shadow copy of ``microbatch`` (a spot check, ``peer.runtime.lead.spot``): never
        summed, but its stages know the micro-batch now, so it is never leased to it again in this step."""
        self._held_by.setdefault(microbatch, set()).add(pipeline)

    def held_by(self, microbatch: int) -> frozenset[int]:
        """Pipelines that held ``microbatch`` in this step (leased, copied or shadowed)."""
        return frozenset(self._held_by.get(microbatch, ()))

    def backup(self, microbatch: int, pipeline: int) -> None:
        """``pipeline``'s verified shadow of committed ``microbatch`` holds its gradient apart: if the committing
        pipeline is failed before the reduce, the micro-batch goes to ``pipeline`` instead of being redone."""
        owner = self._committed.get(microbatch)
        if owner is not None and owner != pipeline and pipeline not in self._failed:
            self._backups.setdefault(microbatch, pipeline)

    def adopt(self, microbatch: int, pipeline: int) -> bool:
        """Commit free ``microbatch`` to ``pipeline``, whose finished shadow copy holds its gradient apart (its
        original pipeline was failed): it is not redone. False when it is not free or ``pipeline`` is failed."""
        if microbatch not in self._free or pipeline in self._failed:
            return False
        self._free.remove(microbatch)
        self._committed[microbatch] = pipeline
        self.backups_used += 1
        return True

    def is_speculative(self, microbatch: int, pipeline: int) -> bool:
        """True when ``pipeline`` holds ``microbatch`` as a speculative copy (its gradient is kept apart)."""
        copy = self._copies.get(microbatch)
        return copy is not None and copy.pipeline == pipeline

    def commit(self, microbatch: int, pipeline: int) -> CommitResult:
        """Record that ``pipeline`` finished ``microbatch`` on every stage."""
        if microbatch in self._committed:
            if self.is_speculative(microbatch, pipeline):
                del self._copies[microbatch]  # the original won; the copy's stages hold its gradient apart:
                if self._committed[microbatch] != pipeline and pipeline not in self._failed:
                    self._backups[microbatch] = pipeline  # a backup until the reduce (module docstring)
            return CommitResult.DUPLICATE
        if pipeline in self._failed:
            return CommitResult.STALE
        if self.is_speculative(microbatch, pipeline):
            copy = self._copies.pop(microbatch)
            self._busy.setdefault(pipeline, []).append((copy.at, self._clock()))
            self._last_commit[pipeline] = self._moved = self._clock()
            original = self._leases.pop(microbatch, None)
            if original is not None:
                self._losers.add(original.pipeline)
            self._committed[microbatch] = pipeline
            self.speculation_won += 1
            return CommitResult.COMMITTED
        lease = self._leases.get(microbatch)
        if lease is None or lease.pipeline != pipeline:
            return CommitResult.STALE
        del self._leases[microbatch]
        self._committed[microbatch] = pipeline
        now = self._clock()
        self._busy.setdefault(pipeline, []).append((lease.at, now))
        self.head_latencies.append(now - max(lease.at, self._last_commit.get(pipeline, -float("inf"))))
        self._last_commit[pipeline] = self._moved = now
        return CommitResult.COMMITTED

    def failed(self) -> set[int]:
        """Pipelines failed in this step (dead, expired, or overtaken)."""
        return set(self._failed)

    def losers(self) -> list[int]:
        """Pipelines a speculative copy beat, or given up on while late with nothing committed (``abandoned``),
        not yet failed: the caller fails them (and tells their workers)."""
        return sorted((self._losers | self._abandoned) - self._failed)

    @property
    def abandoned(self) -> frozenset[int]:
        """Pipelines given up on in this step (late, nothing committed, free work left for the others)."""
        return frozenset(self._abandoned)

    def fail_pipeline(self, pipeline: int) -> list[int]:
        """Return every micro-batch ``pipeline`` leased or committed this step to the pool (a committed one with a
        backup goes to the backup instead, an outstanding one with a copy to the copy); list the requeued."""
        self._failed.add(pipeline)
        for mb in [mb for mb, copy in self._copies.items() if copy.pipeline == pipeline]:
            del self._copies[mb]
        for mb in [mb for mb, backup in self._backups.items() if backup == pipeline]:
            del self._backups[mb]
        for mb in [mb for mb, owner in self._committed.items() if owner == pipeline and mb in self._backups]:
            self._committed[mb] = self._backups.pop(mb)  # its copy's stages hold the gradient apart: not redone
            self.backups_used += 1
        lost = [mb for mb, lease in self._leases.items() if lease.pipeline == pipeline]
        lost += [mb for mb, owner in self._committed.items() if owner == pipeline]
        for mb in lost:
            self._leases.pop(mb, None)
            self._committed.pop(mb, None)
            copy = self._copies.pop(mb, None)
            if copy is not None:  # the speculative copy carries on as the micro-batch's lease
                self._leases[mb] = Lease(mb, copy.pipeline, copy.deadline, at=copy.at)
        requeued = sorted(mb for mb in lost if mb not in self._leases)
        self._free.extend(requeued)
        self.requeued += len(requeued)
        if requeued:
            self._moved = self._clock()
        return requeued

    def expire(self) -> list[int]:
        """Fail every pipeline holding a lease past its deadline; return those pipelines."""
        now = self._clock()
        held = (*self._leases.values(), *self._copies.values())
        late = sorted({lease.pipeline for lease in held if lease.deadline < now})
        for pipeline in late:
            self.fail_pipeline(pipeline)
        return late

    # -- queries -----------------------------------------------------------------------------------------
    def measured_service_s(self) -> dict[int, float]:
        """Pipeline -> seconds per micro-batch in this step: the time it held work (the union of its committed
        micro-batches' lease-to-commit intervals, so waiting for a lease does not count) over its commits. A
        pipeline that leased but committed nothing gets the time since its first lease (a lower bound). What the
        next step's pool paces leases by."""
        now = self._clock()
        out: dict[int, float] = {}
        for p, spans in self._busy.items():
            busy, end = 0.0, -float("inf")
            for a, b in sorted(spans):
                busy += max(0.0, b - max(a, end))
                end = max(end, b)
            out[p] = max(busy, 1e-6) / len(spans)
        for p, first in self._first_lease.items():
            if p not in out:
                out[p] = max(now - first, 1e-6)
        return out

    def complete(self) -> bool:
        """True when every micro-batch of the step is committed: gradients may be synchronised."""
        return len(self._committed) == self.n_microbatches

    def assignment(self) -> dict[int, int]:
        """Committed micro-batch -> the pipeline whose contribution counts."""
        return dict(self._committed)
