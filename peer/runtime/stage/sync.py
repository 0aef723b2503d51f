"""The stage worker's end of a step: the exactly-once check, the gradient averaging with the other replicas of
its stage, the apply, DiLoCo's outer round, and a resync from a replica.

:class:`GradientSync` is a part of :class:`peer.runtime.worker.StageWorker` (a mixin), split off so that each
module reads in one sitting; its methods run on the worker's compute thread, one at a time, and use the
worker's locks and step bookkeeping (peer.runtime.worker's module docstring says what guards what).
"""

from __future__ import annotations

import json
import logging
import threading

import torch

from peer.runtime import control as ctl
from peer.runtime.exchange import OutlierContributionError, Tag
from peer.runtime.outer import BLOCK_SIZE, allgather_codec, is_round_end, roundtrip
from peer.runtime.tasklet import Tasklet, params_hash
from peer.runtime.wire import envelope
from peer.timing import REDUCE_WAIT_S
from protocol import tasklet_pb2 as pb
from protocol.errors import Rejected

log = logging.getLogger(__name__)


class GradientSync:
    """Reduce, apply, outer round and resync (module docstring). The attributes declared here are the worker's,
    as are the methods it calls without defining them (``_report``, ``_send``, ``_load_from``, ``server``)."""

    _lock: threading.Lock
    _inflight_cond: threading.Condition
    _dropped: bool  # _lock
    _reduced: tuple[int, torch.Tensor] | None  # _lock: (step, summed gradient) awaiting apply
    _local_count: int  # _lock: DiLoCo, the micro-batches this pipeline committed in the inner step
    _outer_pending: tuple[int, torch.Tensor, torch.Tensor] | None  # _lock: (step, averaged pseudo-grad, residual)

    def _do_reduce(self, t: Tasklet, step: int, msg: ctl.Reduce) -> None:
        """Check exactly-once locally, then reduce-scatter + all-gather with the participants; keep the sum.

        DiLoCo (``t.outer``): an inner step keeps this pipeline's own sum and count instead (no averaging);
        ``msg.outer`` averages the round's pseudo-gradients (:meth:`_do_outer_reduce`)."""
        if msg.outer:
            self._do_outer_reduce(t, step, msg)
            return
        a, compute, exchange = t.assignment, t.compute, t.exchange
        rnd, participants = msg.round, list(msg.participants)
        expected = sorted(mb for mb, p in msg.assignment.items() if p == a.replica)
        if t.outer is not None and not expected:
            # DiLoCo: a pipeline the record gives nothing (dropped from the step: its share went back to the pool)
            # skips the inner step; whatever it accumulated (a drop notice not yet here) is thrown away, and so is
            # any late work of the step still in flight
            with self._inflight_cond:
                self._dropped = True
                self._inflight_cond.notify_all()
            compute.reset_step()
        compute.settle(set(expected))  # speculative copies: the ones the pool gave this pipeline now count
        mine = sorted(compute.accumulated())
        if mine != expected:
            raise RuntimeError(
                f"step {step}: accumulator holds micro-batches {mine}, the pool committed "
                f"{expected} for pipeline {a.replica}"
            )
        if t.outer is not None:
            with self._lock:
                self._reduced, self._local_count = (step, compute.accumulated_grad()), len(expected)
            self._report(t, ctl.Reduced(step, rnd))
            return
        tag: Tag = (step, rnd)
        flat = compute.accumulated_grad()
        meta = {"round": str(rnd), "participants": json.dumps(participants)}
        for r in participants:
            lo, hi = exchange.shard_of(participants, r)
            if r == a.replica:
                exchange.put_contribution(tag, participants, r, flat[lo:hi].clone(), mine)
            else:
                env = envelope(pb.GRAD_SHARD, t.key(step), {"grad": flat[lo:hi]}, microbatches=mine)
                env.meta.update(meta)
                self._send(t, a.group[r], env)
        try:
            reduced = exchange.reduce(tag, participants, t.spec.n_microbatches, REDUCE_WAIT_S)
        except OutlierContributionError as exc:
            log.warning("step %d: %s", step, exc)
            for r in exc.replicas:
                culprit = t.roles.peer(a.group[r]) or ""
                self._report(t, ctl.BadPeer(a.stage, r, culprit, str(exc)[:300]))
            raise
        for r in participants:
            if r == a.replica:
                exchange.put_reduced(tag, participants, r, reduced)
            else:
                env = envelope(pb.PARAM_SHARD, t.key(step), {"grad": reduced})
                env.meta.update(meta)
                self._send(t, a.group[r], env)
        summed = exchange.gather(tag, participants, REDUCE_WAIT_S)
        with self._lock:
            self._reduced = (step, summed)
        self._report(t, ctl.Reduced(step, rnd))

    def _do_apply(self, t: Tasklet, step: int, msg: ctl.Apply | None = None) -> None:
        """Apply the reduced gradient of ``step`` (idempotent: a repeated apply only re-reports). DiLoCo: an inner
        step divides by the micro-batches this pipeline committed (none: no AdamW step); ``msg.outer`` applies
        the outer step (:meth:`_do_outer_apply`)."""
        if msg is not None and msg.outer:
            self._do_outer_apply(t, step)
            return
        compute = t.compute
        with self._lock:
            reduced, count = self._reduced, self._local_count
        if compute.step == step + 1 and reduced is None:
            self._report(t, ctl.Synced(step, compute.step, params_hash(compute)))
            return
        if reduced is None or reduced[0] != step:
            raise RuntimeError(f"apply of step {step}, but no reduced gradient of that step is held")
        if t.outer is None:
            compute.apply_update(reduced[1], t.spec.n_microbatches)
        elif count:
            compute.apply_update(reduced[1], count)
        else:
            compute.skip_update()
        with self._lock:
            self._reduced = None
        self._report(t, ctl.Synced(step, compute.step, params_hash(compute)))

    def _do_outer_reduce(self, t: Tasklet, step: int, msg: ctl.Reduce) -> None:
        """The outer round after inner step ``step``: reduce-scatter + all-gather of the participants'
        (compressed) pseudo-gradients; keep their average for the outer apply (peer.runtime.outer)."""
        a, compute, exchange, outer, spec = t.assignment, t.compute, t.exchange, t.outer, t.spec
        if outer is None or not is_round_end(step, spec.sync_period):
            raise RuntimeError(f"step {step} ends no outer round (sync_period {spec.sync_period})")
        if compute.step != step + 1:
            raise RuntimeError(f"outer round after step {step}, but this stage has trained {compute.step} steps")
        rnd, participants = msg.round, list(msg.participants)
        if a.replica not in participants:
            raise RuntimeError(f"pipeline {a.replica} is not among the outer round's participants {participants}")
        shards = [exchange.shard_of(participants, r) for r in participants]
        sent, residual = outer.contribution(compute.flat_params(), shards, spec.pseudo_grad_compression)
        tag: Tag = (step, rnd)
        meta = {"round": str(rnd), "participants": json.dumps(participants)}
        codec = spec.pseudo_grad_compression
        for r, (lo, hi) in zip(participants, shards, strict=True):
            if r == a.replica:
                exchange.put_contribution(tag, participants, r, roundtrip(sent[lo:hi], codec), [])
            else:
                self._send(t, a.group[r], self._shard_envelope(t, pb.GRAD_SHARD, step, sent[lo:hi], codec, meta))
        try:
            reduced = exchange.reduce(tag, participants, None, REDUCE_WAIT_S)
        except OutlierContributionError as exc:
            log.warning("outer round of step %d: %s", step, exc)
            for r in exc.replicas:
                self._report(t, ctl.BadPeer(a.stage, r, t.roles.peer(a.group[r]) or "", str(exc)[:300]))
            raise
        codec2, block = allgather_codec(codec, reduced.numel(), len(participants))
        for r in participants:
            if r == a.replica:
                exchange.put_reduced(tag, participants, r, roundtrip(reduced, codec2, block))
            else:
                env = self._shard_envelope(t, pb.PARAM_SHARD, step, reduced, codec2, meta, block)
                self._send(t, a.group[r], env)
        summed = exchange.gather(tag, participants, REDUCE_WAIT_S)
        with self._lock:
            self._outer_pending = (step, summed / len(participants), residual)
        self._report(t, ctl.Reduced(step, rnd))

    @staticmethod
    def _shard_envelope(t: Tasklet, kind: int, step: int, x: torch.Tensor, codec: str, meta: dict[str, str],
                        block: int = BLOCK_SIZE) -> pb.Envelope:
        env = envelope(kind, t.key(step))
        env.add_tensor("grad", x, codec, block_size=block)
        env.meta.update(meta)
        return env

    def _do_outer_apply(self, t: Tasklet, step: int) -> None:
        """The identical Nesterov step from the round's anchor on every replica (idempotent)."""
        compute, outer, spec = t.compute, t.outer, t.spec
        with self._lock:
            pending, self._outer_pending = self._outer_pending, None
        if outer is None:
            raise RuntimeError("an outer apply, but this run has no outer loop")
        if pending is None or pending[0] != step:
            if compute.step == step + 1 and torch.equal(outer.anchor, compute.flat_params()):
                self._report(t, ctl.Synced(step, compute.step, params_hash(compute)))  # a repeated apply
                return
            raise RuntimeError(f"outer apply of step {step}, but no averaged pseudo-gradient of that step is held")
        compute.set_params(outer.apply(pending[1], spec.outer_lr, spec.outer_momentum, pending[2]))
        self._report(t, ctl.Synced(step, compute.step, params_hash(compute)))

    def _do_resync(self, t: Tasklet, step: int, msg: ctl.Resync) -> None:
        """Our parameters differ from the group's majority, or our pipeline was dropped from the step (a
        speculative copy overtook it): load the stage from a replica that applied it."""
        a, compute = t.assignment, t.compute
        if msg.source not in a.group or msg.source == self.server.endpoint:
            raise Rejected(f"resync source {msg.source} is not another replica of this stage")
        if compute.step not in (msg.trained_steps, msg.trained_steps - 1):  # -1: its pipeline missed the step
            raise Rejected(f"resync to step {msg.trained_steps}, this stage has trained {compute.step} steps")
        outer = self._load_from(compute, msg.source, t.spec, a, msg.trained_steps)
        if t.outer is not None and outer is not None:  # DiLoCo: resyncs happen after an outer step (at an anchor)
            t.outer.anchor, t.outer.momentum = outer.anchor, outer.momentum
        log.warning("step %d: parameters differed from the group's majority; reloaded from %s", step, msg.source)
        self._report(t, ctl.Synced(step, compute.step, params_hash(compute)))
