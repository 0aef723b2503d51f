"""The compute loop: one thread runs every forward, backward, reduce and apply of a worker, one at a time.

A GPU has one compute stream and ``StageCompute`` is not thread-safe, so all work goes through one priority
queue: backward work first (priority 0), forward second — finishing micro-batches frees memory and feeds the
pipeline's earlier stages, the 1F1B rule. A task carries the snapshot it was queued under and runs only while
that snapshot is current and :meth:`WorkerStep.runs` says its step still stands; anything else is dropped.
On a first stage the :class:`Feeder` leases micro-batches from the coordinator's task pool while fewer than
``n_stages`` are in flight, and a finished micro-batch is committed to the pool off the compute thread.

:meth:`ComputeLoop.run` executes one task synchronously, so a test drives a step without threads.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tasklet.peer.compute.data import microbatch
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.control import SPECULATIVE_META
from tasklet.peer.runtime.sketch import POINTS, seed_of, sketch
from tasklet.peer.runtime.stage.gradient_checks import ExchangeAbortedError
from tasklet.peer.runtime.stage.outbox import DeviceClock, Outbox
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.step import Work, WorkerStep
from tasklet.peer.runtime.stage.sync import GradientSync
from tasklet.peer.runtime.wire import envelope, make_key
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Rejected, TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """Work for the compute thread."""

    kind: Work
    tasklet: Tasklet  # the snapshot the task was queued under; dropped if another one is current
    step: int
    args: tuple[Any, ...] = ()


class ComputeLoop:
    """Runs a worker's tasks (module docstring).

    ``state_lock`` is held around each task (taking an assignment holds it too); ``cond`` is the condition on the
    step lock guarding ``step``; ``current`` gives the current snapshot."""

    def __init__(self, step: WorkerStep, state_lock: threading.Lock, cond: threading.Condition,
                 current: Callable[[], Tasklet | None], outbox: Outbox, clock: DeviceClock, sync: GradientSync,
                 stopped: threading.Event) -> None:
        self.step, self.state_lock, self.cond, self.current = step, state_lock, cond, current
        self.outbox, self.clock, self.sync, self.stopped = outbox, clock, sync, stopped
        self._tasks: queue.PriorityQueue[tuple[int, int, Task]] = queue.PriorityQueue()  # thread-safe
        self._seq = itertools.count()
        self.stats = {"forward": 0, "backward": 0, "busy_s": 0.0, "overrun_ops": 0}  # written by compute only
        self.running: tuple[float, int] | None = None  # compute op in progress: (started, ops it counts)
        self.sketches = SketchReporter(outbox)
        self._handlers: dict[Work, Callable[..., None]] = {
            Work.FORWARD: self.forward,
            Work.BACKWARD: self.backward,
            Work.DROP: self.drop,
            Work.REDUCE: sync.reduce,
            Work.APPLY: sync.apply,
            Work.RESYNC: sync.resync,
        }

    def put(self, task: Task) -> None:
        """Queue a task: backward and control work before forward work (1F1B)."""
        self._tasks.put((1 if task.kind is Work.FORWARD else 0, next(self._seq), task))

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        """The compute thread: run queued tasks until the worker stops (or ``until()`` holds)."""
        while not self.stopped.is_set() and not (until is not None and until()):
            try:
                _, _, task = self._tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            self.run(task)

    def run_next(self, handlers: dict[Work, Callable[..., None]] | None = None) -> bool:
        """Run the next queued task if there is one (without waiting): a test steps through the queue with it,
        ``handlers`` replacing some kinds' own."""
        try:
            _, _, task = self._tasks.get_nowait()
        except queue.Empty:
            return False
        self.run(task, (handlers or {}).get(task.kind))
        return True

    def run(self, task: Task, handler: Callable[..., None] | None = None) -> None:
        """Run one task, unless it is stale; a failure is reported to the coordinator, which decides.
        ``handler`` replaces the task kind's own (a test runs the phases of a reduce one at a time)."""
        try:
            with self.state_lock:
                with self.cond:
                    runs = task.tasklet is self.current() and self.step.runs(task.kind, task.step)
                    current_step = self.step.step
                if not runs:
                    log.info("dropping %s of step %d (current step %d)", task.kind.value, task.step, current_step)
                    return
                if task.kind in (Work.FORWARD, Work.BACKWARD):  # status: a slow op shows before it ends
                    last = task.kind is Work.FORWARD and task.tasklet.assignment.is_last
                    self.running = (self.clock.now(), 2 if last else 1)
                try:
                    (handler or self._handlers[task.kind])(task.tasklet, task.step, *task.args)
                finally:
                    self.running = None
        except ExchangeAbortedError as exc:
            log.info("%s of step %d abandoned: %s", task.kind.value, task.step, exc)
        except Exception as exc:  # one bad task must not kill the worker; the coordinator decides
            log.exception("%s of step %d failed", task.kind.value, task.step)
            self.outbox.report(task.tasklet, ctl.TaskError(task.kind.value, task.step, str(exc)[:500]))

    def _timed(self, t: Tasklet, step: int, started: float, forward_units: float, summed_s: float = 0.0) -> None:
        """An op ends: its busy time counts as compute, but for the ``summed_s`` seconds of it that adding its
        gradient to the step's sum took on the host."""
        busy, overran = self.clock.finish(t.assignment, step, started, forward_units)
        self.stats["busy_s"] += busy
        summed_s = min(busy, summed_s)
        self.sync.times.add("compute", busy - summed_s)
        self.sync.times.add("host", summed_s)
        if overran:
            self.stats["overrun_ops"] += 1

    # ------------------------------------------------------------------------------------ control messages
    def start_step(self, t: Tasklet, msg: ctl.StartStep) -> Feeder | None:
        """``start_step`` from the coordinator: the step (or its new attempt) becomes current, the attempts before
        it are abandoned; a first stage told to feed gets the feeder to run."""
        if msg.feed and not t.assignment.is_first:
            raise Rejected("only a first stage feeds micro-batches")
        with self.cond:
            if self.current() is not t:
                raise Rejected("this peer took a new assignment meanwhile")
            self.step.start_step(msg.step, msg.attempt, t.compute.step, feed=msg.feed)
            self.cond.notify_all()  # a shard that ran ahead of this start waits for it (intake)
            # with overlap the outer round of the step before is still in flight: its averaging goes on
            floor = (msg.step, msg.attempt) if not self.step.outer_live else \
                min((msg.step, msg.attempt), (self.step.outer_step, self.step.outer_attempt))
        self.sync.times.begin(msg.step)
        t.exchange.abort_before(floor)
        return Feeder(self, t, msg.step, msg.attempt) if msg.feed else None

    def queue_reduce(self, t: Tasklet, msg: ctl.Reduce) -> None:
        """Queue a reduce. An outer round (DiLoCo) may be restarted with fewer participants after a death: its
        new attempt becomes current here at once, and a compute task still waiting on the abandoned one lets go."""
        if msg.outer:
            with self.cond:
                self.step.outer_round(msg.step, msg.attempt)
            t.exchange.abort_before((msg.step, msg.attempt))
        self.put(Task(Work.REDUCE, t, msg.step, (msg,)))

    # ---------------------------------------------------------------------------------------------- tasks
    def forward(self, t: Tasklet, step: int, mb: int, x: torch.Tensor, speculative: bool = False) -> None:
        spec, a, compute = t.spec, t.assignment, t.compute
        started = self.clock.now()
        self.stats["forward"] += 1
        if speculative:
            compute.mark_tentative(mb)
        if not a.is_first:
            self.sketches.keep(t, step, mb, "act_in", x)
        if not a.is_last:
            out = compute.forward(mb, x)
            self._timed(t, step, started, 1.0)
            assert a.next is not None
            self.sketches.keep(t, step, mb, "act_out", out)
            env = envelope(pb.ACTIVATION, t.key(step, mb), {"hidden": out}, compression=spec.compression)
            if speculative:
                env.meta[SPECULATIVE_META] = "1"
            self.outbox.send(t, a.next, env)
            return
        assert t.corpus is not None
        _, targets = microbatch(t.corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
        summed = compute.accumulate_s
        loss, grad_in = compute.forward_loss(mb, x, targets)
        self._timed(t, step, started, 3.0, compute.accumulate_s - summed)
        self.stats["backward"] += 1
        self.outbox.report(t, ctl.Loss(step, mb, loss))
        self._after_backward(t, step, mb, grad_in)

    def backward(self, t: Tasklet, step: int, mb: int, grad_out: torch.Tensor) -> None:
        started = self.clock.now()
        self.sketches.keep(t, step, mb, "grad_in", grad_out)
        summed = t.compute.accumulate_s
        grad_in = t.compute.backward(mb, grad_out)
        self._timed(t, step, started, 2.0, t.compute.accumulate_s - summed)
        self.stats["backward"] += 1
        self._after_backward(t, step, mb, grad_in)

    def _after_backward(self, t: Tasklet, step: int, mb: int, grad_in: torch.Tensor | None) -> None:
        a = t.assignment
        if not a.is_first:
            assert grad_in is not None and a.prev is not None
            self.sketches.keep(t, step, mb, "grad_out", grad_in)
            self.sketches.send(t, step, mb)
            env = envelope(pb.ACTIVATION_GRAD, t.key(step, mb), {"grad": grad_in}, compression=t.spec.compression)
            self.outbox.send(t, a.prev, env)
            return
        self.sketches.send(t, step, mb)
        with self.cond:  # it holds no memory here any more: the feeder may let the next one in at once
            self.step.finished()
            self.cond.notify_all()
        self.outbox.submit(self.commit, t, step, mb)

    def commit(self, t: Tasklet, step: int, mb: int) -> None:
        """Commit a first stage's finished micro-batch to the pool (off the compute thread)."""
        try:
            with self.sync.times.timed("control"):
                reply = self.outbox.call(t, t.key(step, mb), ctl.Op.COMMIT)
            if ctl.pool_status(reply) is not ctl.PoolStatus.COMMITTED:
                log.warning("micro-batch %d of step %d: pool answered %s", mb, step, ctl.pool_status(reply))
        except TransportError as exc:
            log.warning("commit of micro-batch %d of step %d failed: %s", mb, step, exc)

    def drop(self, t: Tasklet, step: int) -> None:
        """This pipeline lost a member: forget the step's work; other pipelines redo its micro-batches."""
        with self.cond:
            self.step.drop(step)
            self.cond.notify_all()
        t.compute.reset_step()
        log.info("pipeline dropped from step %d; its work is discarded", step)


class SketchReporter:
    """Keeps the tensors a stage received and sent for each micro-batch and, once its backward is done, reports
    their sketches (peer.runtime.sketch) to the coordinator, computed off the compute thread. Only when the
    run's spot checks are on; every micro-batch is reported, so a stage cannot tell which ones are checked."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        # (epoch, stage, step, mb) -> point -> tensor. The plan's epoch and stage belong to the key: a step redone
        # after a re-plan that moved this peer to another stage must not mix the old stage's points into the new
        # stage's report (the coordinator refuses such a report, and the pipeline was set aside for "missing" it)
        self._kept: dict[tuple[int, int, int, int], dict[str, torch.Tensor]] = {}

    @staticmethod
    def _key(t: Tasklet, step: int, mb: int) -> tuple[int, int, int, int]:
        return t.assignment.epoch, t.assignment.stage, step, mb

    def keep(self, t: Tasklet, step: int, mb: int, point: str, tensor: torch.Tensor) -> None:
        if not t.spec.sketches:
            return
        key = self._key(t, step, mb)
        for old in [k for k in self._kept if k[:3] != key[:3]]:  # leftovers of another plan, stage or step
            del self._kept[old]
        self._kept.setdefault(key, {})[point] = tensor

    def send(self, t: Tasklet, step: int, mb: int) -> None:
        kept = self._kept.pop(self._key(t, step, mb), None)
        if kept:
            self.outbox.submit(self._report, t, step, mb, kept)

    def _report(self, t: Tasklet, step: int, mb: int, kept: dict[str, torch.Tensor]) -> None:
        points = tuple(p for p in POINTS if p in kept)
        stage = t.assignment.stage
        values = tuple(v for p in points for v in sketch(kept[p], seed_of(t.spec.run_id, step, mb, p, stage)))
        self.outbox.report(t, ctl.Sketch(step, mb, points, values))


class Feeder:
    """A first stage's feeder of one (step, attempt): leases micro-batches for this pipeline while fewer than
    ``n_stages`` are in flight (the 1F1B limit) and builds their tokens locally — data is a pure function of
    (seed, step, micro-batch)."""

    def __init__(self, loop: ComputeLoop, t: Tasklet, step: int, attempt: int) -> None:
        self.loop, self.t, self.step, self.attempt = loop, t, step, attempt

    def _current(self) -> bool:  # call with the step lock held
        loop = self.loop
        return loop.current() is self.t and loop.step.feeds(self.step, self.attempt) and not loop.stopped.is_set()

    def run(self) -> None:
        """Lease one micro-batch ahead: the next lease's round trip runs while the pipeline is full, so no
        micro-batch waits for it; its forward is queued only once there is room (the 1F1B limit holds)."""
        loop, t, step = self.loop, self.t, self.step
        spec, a = t.spec, t.assignment
        key = make_key(spec.run_id, a.epoch, step, stage=0, replica=a.replica)
        while True:
            with loop.cond:
                if not self._current():
                    return
            asked = time.monotonic()
            try:
                reply = loop.outbox.call(t, key, ctl.Op.LEASE)
            except TransportError as exc:
                log.warning("lease request for step %d failed: %s", step, exc)
                time.sleep(0.5)
                continue
            status = ctl.pool_status(reply)
            if status is ctl.PoolStatus.LEASE:  # a request answered "nothing free yet" is waiting, not control
                loop.sync.times.add("control", time.monotonic() - asked)
            if status is ctl.PoolStatus.DONE:
                return
            if status is not ctl.PoolStatus.LEASE:
                time.sleep(0.02)
                continue
            with loop.cond:
                while self._current() and loop.step.inflight >= a.n_stages:
                    loop.cond.wait(0.5)
            if not self.take(reply.key.microbatch, ctl.is_speculative(reply)):
                return

    def take(self, mb: int, speculative: bool = False) -> bool:
        """A micro-batch leased for this pipeline enters it: build its tokens, queue its forward. False when
        the step, attempt or snapshot moved on meanwhile (the feeder stops)."""
        loop, t, step = self.loop, self.t, self.step
        spec, corpus = t.spec, t.corpus
        assert corpus is not None
        tokens, _ = microbatch(corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
        with loop.cond:
            if not self._current():
                return False
            try:
                loop.step.lease(step, self.attempt, mb)
            except Rejected:
                return False
        loop.put(Task(Work.FORWARD, t, step, (mb, tokens, speculative)))
        return True
