"""The stage worker's end of a step: the exactly-once check, the gradient averaging with the other replicas of
its stage, the apply, DiLoCo's outer round, and a resync from a replica.

:class:`GradientSync` runs on the worker's compute thread, one task at a time (the compute loop holds the state
lock around each); the step's bookkeeping it changes only through :class:`WorkerStep`'s transitions, under the
step lock it is given, and everything it sends leaves through the outbox it is given.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tasklet.peer.compute.stage import StageCompute
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.outer import BLOCK_SIZE, OuterState, allgather_codec, is_round_end, roundtrip
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.exchange import DIGEST_META, digest_text
from tasklet.peer.runtime.stage.gradient_checks import (
    DigestMismatchError,
    ExchangeAbortedError,
    OutlierContributionError,
    Tag,
)
from tasklet.peer.runtime.stage.outbox import Outbox
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.step import Work, WorkerStep
from tasklet.peer.runtime.stage.tied import sum_with_other_end
from tasklet.peer.runtime.stage.timing import StepTimes
from tasklet.peer.runtime.stage_state import params_hash
from tasklet.peer.runtime.wire import envelope
from tasklet.peer.timing import REDUCE_WAIT_S
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Rejected

log = logging.getLogger(__name__)

# Loads a stage's state from a replica: (compute, endpoint, spec, assignment, step) -> its outer state, if any
Loader = Callable[[StageCompute, str, RunSpec, Assignment, int], "OuterState | None"]


@dataclass(frozen=True)
class SyncAttempt:
    """One averaging in progress: its step and attempt, participants, and the meta its shards carry."""

    step: int
    attempt: int
    participants: list[int]
    meta: dict[str, str]
    outer: bool = False  # DiLoCo's outer round: pseudo-gradients under ``codec``, ``residual`` kept after it
    codec: str = "none"
    residual: torch.Tensor | None = None
    flat: torch.Tensor | None = None  # an exact step: this replica's whole contribution (for the digest)

    @property
    def tag(self) -> Tag:
        return self.step, self.attempt


class GradientSync:
    """Reduce, apply, outer round and resync of one worker (module docstring).

    ``step``/``cond``: the worker's step bookkeeping and the condition on its step lock (a drop wakes the
    feeder); ``outbox``: where reports and shards go; ``endpoint``: this worker's own endpoint (a resync never
    loads from itself); ``load``: fetches a stage's state from a replica."""

    def __init__(self, step: WorkerStep, cond: threading.Condition, outbox: Outbox, endpoint: Callable[[], str],
                 load: Loader) -> None:
        self.step, self.cond, self.outbox = step, cond, outbox
        self.endpoint, self.load = endpoint, load
        self.times = StepTimes()  # where each step's time goes (peer.runtime.stage.timing)

    @contextmanager
    def _timed(self, t: Tasklet) -> Iterator[None]:
        """Time a part of the averaging or the apply: its waits in the exchange are network, the rest host."""
        waited, t0 = t.exchange.waited_s, time.monotonic()
        try:
            yield
        finally:
            network = t.exchange.waited_s - waited
            self.times.add("network", network)
            self.times.add("host", time.monotonic() - t0 - network)

    def reduce(self, t: Tasklet, step: int, msg: ctl.Reduce) -> None:
        """Check exactly-once locally, then reduce-scatter + all-gather with the participants; keep the sum.

        DiLoCo (``t.outer``): an inner step keeps this pipeline's own sum and count instead (no averaging);
        ``msg.outer`` averages the round's pseudo-gradients (:meth:`outer_reduce`); ``msg.apply`` (an inner step)
        applies it right after, in the same task (:meth:`apply`). The four phases
        (:meth:`contribute`, :meth:`sum_shard`, :meth:`gather`, :meth:`verify`) run one after the other on the
        compute thread; they are separate so that a test can interleave the replicas of a group without threads."""
        if msg.outer:
            with self._timed(t):
                self.outer_reduce(t, step, msg)
            return
        with self._timed(t):
            sync = self.contribute(t, step, msg)
            if sync is not None:
                self.sum_shard(t, sync)
                self.gather(t, sync)
                self.verify(t, sync, report=not msg.apply)
        if msg.apply:  # nothing crosses replicas or stages (a DiLoCo inner step, a lone one-stage pipeline)
            self.apply(t, step)

    def contribute(self, t: Tasklet, step: int, msg: ctl.Reduce) -> SyncAttempt | None:
        """Phase 1: the accumulator must hold exactly this pipeline's micro-batches of the commit record; send
        each participant its shard of the sum (reduce-scatter). None: a DiLoCo inner step, kept locally."""
        a, compute, exchange = t.assignment, t.compute, t.exchange
        attempt, participants = msg.attempt, list(msg.participants)
        if msg.apply and t.outer is None and not (participants == [a.replica] and a.n_stages == 1):
            raise Rejected("an exact step's apply comes with its reduce only to a pipeline of one stage, alone; "
                           f"this stage has {a.n_stages} stages and participants {participants}")
        expected = sorted(mb for mb, p in msg.assignment.items() if p == a.replica)
        if t.outer is not None and not expected:
            # DiLoCo: a pipeline the record gives nothing (dropped from the step: its share went back to the pool)
            # skips the inner step; whatever it accumulated (a drop notice not yet here) is thrown away, and so is
            # any late work of the step still in flight
            with self.cond:
                self.step.sit_out(step)
                self.cond.notify_all()
            compute.reset_step()
        compute.settle(set(expected))  # speculative copies: the ones the pool gave this pipeline now count
        with self.cond:
            mine = self.step.check_accumulated(step, expected, compute.accumulated())
        if t.outer is not None:
            with self.cond:
                self.step.reduced(step, compute.accumulated_grad(), len(expected))
            if not msg.apply:  # merged with the apply: its ``synced`` is the one report the leader waits for
                self.outbox.report(t, ctl.Reduced(step, attempt))
            return None
        meta = {"attempt": str(attempt), "participants": json.dumps(participants)}
        alone = participants == [a.replica] and exchange.tied is None
        # a group of one sends nothing, checks nothing and adds nothing to its sum before the apply: it applies
        # the accumulator itself (no copy of the stage's size); otherwise a copy that nothing changes
        flat = compute.accumulated_view() if alone else compute.accumulated_grad()
        sync = SyncAttempt(step, attempt, participants, meta, flat=flat)
        for r in participants:
            lo, hi = exchange.shard_of(participants, r)
            if r == a.replica:
                exchange.put_contribution(sync.tag, participants, r, flat[lo:hi], mine,
                                          whole_norm=0.0 if alone else float(flat.norm()))
            else:
                env = envelope(pb.GRAD_SHARD, t.key(step), {"grad": flat[lo:hi]}, microbatches=mine)
                env.meta.update(sync.meta)
                self.outbox.send(t, a.group[r], env)
        return sync

    def sum_shard(self, t: Tasklet, sync: SyncAttempt) -> None:
        """Phase 2: wait for every participant's contribution to my shard, sum them (exactly-once checked there;
        an outer round's pseudo-gradients carry no micro-batches) and send the sum to every participant
        (all-gather); an outlier's sender is reported."""
        a, exchange, participants = t.assignment, t.exchange, sync.participants
        try:
            reduced = exchange.shard_sum(sync.tag, participants, None if sync.outer else t.spec.n_microbatches,
                                      REDUCE_WAIT_S)
        except OutlierContributionError as exc:
            log.warning("%s %d: %s", "outer round of step" if sync.outer else "step", sync.step, exc)
            self._report(t, exc.replicas, str(exc))
            raise
        codec, block = sync.codec, BLOCK_SIZE
        if sync.outer:
            codec, block = allgather_codec(sync.codec, reduced.numel(), len(participants))
        for r in participants:
            if r == a.replica:
                own = roundtrip(reduced, codec, block) if sync.outer else reduced
                exchange.put_reduced(sync.tag, participants, r, own)
            elif sync.outer:
                self.outbox.send(t, a.group[r], _shard_envelope(t, pb.PARAM_SHARD, sync.step, reduced, codec,
                                                                sync.meta, block))
            else:
                env = envelope(pb.PARAM_SHARD, t.key(sync.step), {"grad": reduced})
                env.meta.update(sync.meta)
                self.outbox.send(t, a.group[r], env)

    def gather(self, t: Tasklet, sync: SyncAttempt) -> None:
        """Phase 3: wait for every owner's summed shard. An exact step of a group of two or more then sends every
        participant the digests of this replica's contributions, seeded by the summed shards as they arrived
        (exchange module docstring), and :meth:`verify` finishes; an outer round keeps the participants' average
        for the outer apply and reports ``reduced``."""
        summed = t.exchange.gather(sync.tag, sync.participants, REDUCE_WAIT_S)
        if sync.flat is None:
            t.exchange.forget_through(sync.tag)
            assert sync.residual is not None
            with self.cond:
                self.step.outer_reduced(sync.step, summed / len(sync.participants), sync.residual, sync.attempt)
            self.outbox.report(t, ctl.Reduced(sync.step, sync.attempt))
            return
        if len(sync.participants) == 1:
            return  # a group of one: its sum is its own contribution, nobody to check it against
        a, exchange = t.assignment, t.exchange
        digest = exchange.my_digest(sync.tag, sync.participants, sync.flat)
        exchange.put_digest(sync.tag, sync.participants, a.replica, digest)
        for r in sync.participants:
            if r != a.replica:
                env = envelope(pb.PARAM_SHARD, t.key(sync.step))
                env.meta.update(sync.meta)
                env.meta[DIGEST_META] = digest_text(digest)
                self.outbox.send(t, a.group[r], env)

    def verify(self, t: Tasklet, sync: SyncAttempt, report: bool = True) -> None:
        """Phase 4 of an exact step: check every summed shard against the participants' digests, keep the whole
        sum for apply and report ``reduced`` (not when the apply comes with the reduce: ``report`` False). A
        failure is reported and raised: this replica does not report ``reduced``, so no replica of the run
        applies the step."""
        if sync.flat is None:
            return  # an outer round finished in phase 3
        summed = t.exchange.gather(sync.tag, sync.participants, REDUCE_WAIT_S)  # held since phase 3
        try:
            if len(sync.participants) == 1:
                t.exchange.forget_through(sync.tag)
            else:
                t.exchange.verify(sync.tag, sync.participants, REDUCE_WAIT_S)
        except DigestMismatchError as exc:
            log.warning("step %d: %s", sync.step, exc)
            self._report(t, exc.replicas, str(exc))
            raise
        end = t.exchange.tied
        if end is not None:  # tied embeddings: the first and the last stage add each other's gradient of it
            sum_with_other_end(end, t.key(sync.step), sync.attempt, summed,
                               lambda env: self.outbox.send(t, end.partner, env),
                               lambda: t.exchange.take_tied(sync.tag, REDUCE_WAIT_S))
        with self.cond:
            self.step.reduced(sync.step, summed)
        if report:
            self.outbox.report(t, ctl.Reduced(sync.step, sync.attempt))

    def apply(self, t: Tasklet, step: int, msg: ctl.Apply | None = None) -> None:
        """Apply the reduced gradient of ``step`` (idempotent: a repeated apply only re-reports). DiLoCo: an inner
        step divides by the micro-batches this pipeline committed (none: no AdamW step); ``msg.outer`` applies
        the outer step (:meth:`outer_apply`)."""
        if msg is not None and msg.outer:
            self.outer_apply(t, step)
            return
        compute = t.compute
        optimizer_s = compute.optimizer_s
        with self._timed(t):
            with self.cond:
                pending = self.step.apply(step, compute.step)
            if pending is not None:
                summed, count = pending
                if t.outer is None:
                    compute.apply_update(summed, t.spec.n_microbatches)
                elif count:
                    compute.apply_update(summed, count)
                else:
                    compute.skip_update()
                with self.cond:
                    self.step.applied(step)
            synced = ctl.Synced(step, compute.step, params_hash(compute))
        self.times.move("host", "optimizer", compute.optimizer_s - optimizer_s)
        self.outbox.report(t, synced)
        done = self.times.finish(step)
        if done is not None:
            log.info("%s", done.line())

    def outer_reduce(self, t: Tasklet, step: int, msg: ctl.Reduce) -> None:
        """The outer round after inner step ``step``: reduce-scatter + all-gather of the participants'
        (compressed) pseudo-gradients; keep their average for the outer apply (peer.runtime.outer). The same
        three phases as :meth:`reduce`. With overlap (``RunSpec.outer_overlap``) only the contribution is taken
        here, on the compute thread; the waits and sums run on a thread of their own while the next inner step
        computes."""
        sync = self.contribute_outer(t, step, msg)
        if not t.spec.outer_overlap:
            self.sum_shard(t, sync)
            self.gather(t, sync)
            return
        threading.Thread(target=self._outer_rest, args=(t, sync), name=f"outer-{step}.{sync.attempt}",
                         daemon=True).start()

    def _outer_rest(self, t: Tasklet, sync: SyncAttempt) -> None:
        """Phases 2 and 3 of an overlapped outer round; a failure goes to the coordinator as the compute loop's
        do (an abandoned attempt, restarted after a death, just ends). Not counted in the step's time breakdown:
        it runs beside the step, off its critical path."""
        try:
            self.sum_shard(t, sync)
            self.gather(t, sync)
        except ExchangeAbortedError as exc:
            log.info("outer round of step %d attempt %d abandoned: %s", sync.step, sync.attempt, exc)
        except Exception as exc:  # the coordinator decides
            log.exception("outer round of step %d failed", sync.step)
            self.outbox.report(t, ctl.TaskError(Work.REDUCE.value, sync.step, str(exc)[:500]))

    def contribute_outer(self, t: Tasklet, step: int, msg: ctl.Reduce) -> SyncAttempt:
        """Phase 1 of an outer round: send each participant its shard of this replica's pseudo-gradient."""
        a, compute, exchange, outer, spec = t.assignment, t.compute, t.exchange, t.outer, t.spec
        if outer is None or not is_round_end(step, spec.sync_period):
            raise Rejected(f"step {step} ends no outer round (sync_period {spec.sync_period})")
        attempt, participants = msg.attempt, list(msg.participants)
        if a.replica not in participants:
            raise Rejected(f"pipeline {a.replica} is not among the outer round's participants {participants}")
        if outer.keeps_round_end(step):
            assert outer.round_end is not None
            params = outer.round_end  # a restart while the next step computes: the round's end as it was
        elif compute.step == step + 1:
            params = compute.flat_params()
            if spec.outer_overlap:  # kept until the round lands: the next inner steps move the parameters
                outer.keep_round_end(params, step)
        else:
            raise Rejected(f"outer round after step {step}, but this stage has trained {compute.step} steps")
        shards = [exchange.shard_of(participants, r) for r in participants]
        codec = spec.pseudo_grad_compression
        sent, residual = outer.contribution(params, shards, codec)
        meta = {"attempt": str(attempt), "participants": json.dumps(participants)}
        sync = SyncAttempt(step, attempt, participants, meta, outer=True, codec=codec, residual=residual)
        for r, (lo, hi) in zip(participants, shards, strict=True):
            if r == a.replica:
                exchange.put_contribution(sync.tag, participants, r, roundtrip(sent[lo:hi], codec), [])
            else:
                env = _shard_envelope(t, pb.GRAD_SHARD, step, sent[lo:hi], codec, sync.meta)
                self.outbox.send(t, a.group[r], env)
        return sync

    def outer_apply(self, t: Tasklet, step: int) -> None:
        """The identical Nesterov step from the round's anchor on every replica (idempotent)."""
        compute, outer, spec = t.compute, t.outer, t.spec
        with self.cond:
            pending = self.step.take_outer(step)
        if outer is None:
            raise Rejected("an outer apply, but this run has no outer loop")
        if pending is None:
            if compute.step == step + 1 and torch.equal(outer.anchor, compute.flat_params()):
                self.outbox.report(t, ctl.Synced(step, compute.step, params_hash(compute)))  # a repeated apply
                return
            raise Rejected(f"outer apply of step {step}, but no averaged pseudo-gradient of that step is held")
        average, residual = pending
        # landed late (overlap): the new anchor plus this replica's progress since the round's end
        now = compute.flat_params() if outer.keeps_round_end(step) else None  # a copy only where it landed late
        compute.set_params(outer.land(step, average, spec.outer_lr, spec.outer_momentum, residual, now))
        self.outbox.report(t, ctl.Synced(step, compute.step, params_hash(compute)))

    def resync(self, t: Tasklet, step: int, msg: ctl.Resync) -> None:
        """Our parameters differ from the group's majority, or our pipeline was dropped from the step (a
        speculative copy overtook it): load the stage from a replica that applied it."""
        a, compute = t.assignment, t.compute
        if msg.source not in a.group or msg.source == self.endpoint():
            raise Rejected(f"resync source {msg.source} is not another replica of this stage")
        if compute.step > msg.trained_steps:  # behind by any number: a laggard whose reloads outlasted steps
            raise Rejected(f"resync to step {msg.trained_steps}, this stage has trained {compute.step} steps")
        outer = self.load(compute, msg.source, t.spec, a, msg.trained_steps)
        if t.outer is not None and outer is not None:  # DiLoCo: resyncs happen after an outer step (at an anchor)
            t.outer.resume(outer)
        log.warning("step %d: parameters differed from the group's majority; reloaded from %s", step, msg.source)
        self.outbox.report(t, ctl.Synced(step, compute.step, params_hash(compute)))

    def _report(self, t: Tasklet, replicas: list[int], why: str) -> None:
        a = t.assignment
        for r in replicas:
            self.outbox.report(t, ctl.BadPeer(a.stage, r, t.roles.peer(a.group[r]) or "", why[:300]))


def _shard_envelope(t: Tasklet, kind: int, step: int, x: torch.Tensor, codec: str, meta: dict[str, str],
                    block: int = BLOCK_SIZE) -> pb.Envelope:
    env = envelope(kind, t.key(step))
    env.add_tensor("grad", x, codec, block_size=block)
    env.meta.update(meta)
    return env
