"""A virtual run of the stage workers: every node's real WorkerStep, GradientSync and compute loop over a fake
outbox, in virtual time (no gRPC, no threads of its own), with a scripted leader (shared by the workers' step
tests and the claims tests)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.stage import StageCompute, StageComputeConfig
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.outer import OuterState
from tasklet.peer.runtime.roles import Roles
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.exchange import GradientExchange
from tasklet.peer.runtime.stage.intake import Intake
from tasklet.peer.runtime.stage.loop import ComputeLoop, Feeder
from tasklet.peer.runtime.stage.outbox import DeviceClock
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.step import Work, WorkerStep
from tasklet.peer.runtime.stage.sync import GradientSync, SyncAttempt
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Rejected

MODEL = ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, seed=3)
SPEC = RunSpec(run_id="virtual", model=MODEL, seed=5, micro_batch=2, n_microbatches=4)
STAGES = [(0, 1), (1, 2)]
PIPELINES = [[0, 1], [2, 3]]
COORDINATOR = "coordinator:1"
ENDPOINTS = [f"10.0.0.{d}:1" for d in range(4)]
COORDINATOR_DIES = "coordinator"


class VirtualClock(DeviceClock):
    """Virtual time: sleeping advances it."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def done_future() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


class FakeOutbox:
    """Records what a worker emits and hands it to the virtual run at once."""

    def __init__(self, run: VirtualRun, endpoint: str) -> None:
        self.run, self.endpoint = run, endpoint
        self.sent: list[tuple[str, str, int, int]] = []  # (to, kind, step, micro-batch)
        self.reports: list[ctl.Message] = []

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        self.sent.append((endpoint, pb.Kind.Name(env.kind), env.key.step, env.key.microbatch))
        self.run.deliver(self.endpoint, endpoint, env)

    def report(self, t: Tasklet, msg: ctl.Message) -> Future[None]:
        self.reports.append(msg)
        self.run.reported(self.endpoint, msg)
        return done_future()

    def call(self, t: Tasklet, key: pb.Key, op: ctl.Op) -> pb.Envelope:
        return self.run.pool_call(t.assignment.replica, key, op)

    def submit(self, fn: Any, *args: Any) -> Future[None]:
        fn(*args)
        return done_future()


class Node:
    """One stage worker's parts, wired as StageWorker wires them, minus the server and the threads."""

    def __init__(self, run: VirtualRun, endpoint: str, corpus: Corpus) -> None:
        self.endpoint, self.corpus, self.alive, self.spec = endpoint, corpus, True, run.spec
        self.outbox = FakeOutbox(run, endpoint)
        self.step, self.cond = WorkerStep(), threading.Condition()
        self.t: Tasklet | None = None
        outbox: Any = self.outbox
        self.sync = GradientSync(self.step, self.cond, outbox, lambda: endpoint, no_load)
        self.loop = ComputeLoop(self.step, threading.Lock(), self.cond, lambda: self.t, outbox, VirtualClock(),
                                self.sync, threading.Event())
        self.intake = Intake(None, frozenset(), False, lambda: self.t, self.step, self.cond,  # type: ignore[arg-type]
                             outbox, self.loop.put)
        self.sync_attempt: SyncAttempt | None = None  # a reduce in progress: the phases done so far in ``phases``
        self.phases = 0

    def assign(self, a: Assignment, compute: StageCompute, outer: OuterState | None) -> None:
        self.t = Tasklet(self.spec, a, compute,
                         GradientExchange(a.replica, compute.numel, 10.0), self.corpus, Roles.of(a, None), outer)
        with self.cond:
            self.step.reset(a.replica)
        self.sync_attempt, self.phases = None, 0

    def contribute(self, t: Tasklet, step: int, msg: ctl.Reduce) -> None:
        sync = self.sync
        self.sync_attempt = sync.contribute_outer(t, step, msg) if msg.outer else sync.contribute(t, step, msg)
        self.phases = 1
        if msg.apply and self.sync_attempt is None:  # a DiLoCo inner step: applied in the same task
            sync.apply(t, step)


def no_load(*args: Any) -> None:
    raise AssertionError("no resync in these runs")


@dataclass
class Pool:
    """The coordinator's task pool of one step: first commit wins; a dropped pipeline's share goes back."""

    n: int
    free: list[int] = field(default_factory=list)
    leased: dict[int, int] = field(default_factory=dict)
    record: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.n))

    def requeue(self, pipeline: int) -> None:
        for mb in [mb for mb, p in {**self.leased, **self.record}.items() if p == pipeline]:
            self.leased.pop(mb, None)
            self.record.pop(mb, None)
            self.free.append(mb)
        self.free.sort()


class VirtualRun:
    """Two pipelines of two stages, a coordinator played here, one transition per :meth:`tick`."""

    def __init__(self, spec: RunSpec, corpus: Corpus) -> None:
        self.spec, self.epoch = spec, 1
        self.nodes = {ep: Node(self, ep, corpus) for ep in ENDPOINTS}
        self.assignments = build_assignments(spec, STAGES, PIPELINES, ENDPOINTS, COORDINATOR, epoch=self.epoch)
        for ep, node in self.nodes.items():
            a = self.assignments[ep]
            compute = fresh_stage(spec, a)
            outer = OuterState.start(compute.flat_params()) if spec.sync_period > 1 else None
            node.assign(a, compute, outer)
        self.out: set[int] = set()  # pipelines that lost a member (DiLoCo: for the rest of the round)
        self.merged = spec.sync_period > 1  # a DiLoCo inner step's reduce carries its apply (one round)
        self.log: list[tuple[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.failed = False

    # ------------------------------------------------------------------------------ the coordinator's view
    def pipeline_nodes(self, p: int) -> list[Node]:
        return [self.nodes[ENDPOINTS[d]] for d in PIPELINES[p]]

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def intact(self) -> list[int]:
        return [p for p in range(len(PIPELINES)) if p not in self.out
                and all(n.alive for n in self.pipeline_nodes(p))]

    def begin(self, step: int) -> None:
        """Start ``step`` (attempt 0) on every intact pipeline: later stages first, as the coordinator does."""
        self.step, self.attempt, self.phase = step, 0, "pool"
        self.pool = Pool(self.spec.n_microbatches)
        self.reduced: set[str] = set()
        self.synced: dict[str, tuple[int, str]] = {}
        self.outer_done = False
        self._start_round()

    def _start_round(self) -> None:
        self.feeders: dict[int, Feeder] = {}
        for p in self.intact():
            for node in reversed(self.pipeline_nodes(p)):
                assert node.t is not None
                start = ctl.StartStep(self.step, self.attempt, feed=node.t.assignment.is_first)
                feeder = node.loop.start_step(node.t, start)
                if feeder is not None:
                    self.feeders[p] = feeder

    def pool_call(self, pipeline: int, key: pb.Key, op: ctl.Op) -> pb.Envelope:
        assert op is ctl.Op.COMMIT
        mb, pool = key.microbatch, self.pool
        ok = (key.step == self.step and pool.leased.get(mb) == pipeline and mb not in pool.record
              and pipeline in self.intact())
        if ok:
            pool.record[mb] = pipeline
        return ctl.pool_reply(pb.COMMIT, key, ctl.PoolStatus.COMMITTED if ok else ctl.PoolStatus.STALE)

    def deliver(self, sender: str, to: str, env: pb.Envelope) -> None:
        node = self.nodes[to]
        if not node.alive:  # the real outbox reports a failed push; the coordinator then probes the receiver
            self.nodes[sender].outbox.report(None, ctl.PeerError(to, "unreachable"))  # type: ignore[arg-type]
            return
        handler = {pb.ACTIVATION: node.intake.activation, pb.ACTIVATION_GRAD: node.intake.activation_grad,
                   pb.GRAD_SHARD: node.intake.grad_shard, pb.PARAM_SHARD: node.intake.param_shard}[env.kind]
        env.sender = sender
        try:
            handler(env)
        except Rejected as exc:
            self.log.append(("refused", (to, pb.Kind.Name(env.kind), str(exc))))

    def reported(self, endpoint: str, msg: ctl.Message) -> None:
        self.log.append((endpoint, msg))
        if isinstance(msg, ctl.Reduced) and msg.step == self.step and msg.attempt == self.attempt:
            self.reduced.add(endpoint)
        if isinstance(msg, ctl.Synced) and msg.step == self.step:
            self.synced[endpoint] = (msg.trained_steps, msg.params_hash)

    # ------------------------------------------------------------------------------------- transitions
    def tick(self) -> bool:
        """One transition; False when the step (and its outer round) is over."""
        for node in self.live():
            if node.loop.run_next({Work.REDUCE: node.contribute}):
                return True
        if self._reduce_phase():
            return True
        return self._coordinate()

    def _reduce_phase(self) -> bool:
        """Phase 2 or 3 of a replica's reduce, once every live participant of its group finished the phase
        before. A reduce of an abandoned attempt (a participant died) lets go at once on a replica the coordinator
        restarted (its exchange aborted the attempt); on a dropped pipeline's replica it is simply not resumed."""
        for node in self.live():
            sync, t = node.sync_attempt, node.t
            if sync is None or t is None or node.phases >= 4:
                continue
            group = [n for n in self.live() if n.t is not None and n.t.assignment.stage == t.assignment.stage
                     and n.t.assignment.replica in sync.participants]
            restarted = t.assignment.replica in self.intact()
            abandoned = sync.attempt < self.attempt or len(group) < len(sync.participants) or not restarted
            if abandoned and not restarted:
                node.sync_attempt = None
                continue
            if not abandoned and any(n.sync_attempt is None or n.sync_attempt.tag != sync.tag or n.phases < node.phases
                                     for n in group):
                continue
            phase = {1: node.sync.sum_shard, 2: node.sync.gather}.get(node.phases, node.sync.verify)
            node.phases = 4 if abandoned else node.phases + 1
            node.loop.run(loop_task(t, sync.step), lambda t, step, s=sync, f=phase: f(t, s))
            return True
        return False

    def _coordinate(self) -> bool:
        """One coordinator action: a lease, the reduce, the apply (or DiLoCo's outer round)."""
        if self.phase == "pool":
            given = {**self.pool.leased, **self.pool.record}
            held = {p: sum(1 for q in given.values() if q == p) for p in self.feeders}
            for p, feeder in sorted(self.feeders.items(), key=lambda item: (held[item[0]], item[0])):  # fair shares
                node = self.pipeline_nodes(p)[0]
                if self.pool.free and node.step.feeds(self.step, self.attempt) and node.step.inflight < len(STAGES):
                    mb = self.pool.free.pop(0)
                    self.pool.leased[mb] = p
                    feeder.take(mb)
                    return True
            if len(self.pool.record) == self.pool.n:
                self.phase = "reduce"
                self._send_reduce()
                return True
            return False
        if self.phase == "reduce":
            want = {n.endpoint for p in self.intact() for n in self.pipeline_nodes(p)}
            if self.merged:  # DiLoCo inner step: one round, answered by synced
                if want <= set(self.synced):
                    self.phase = "apply"
                    return True
                return False
            if want and want <= self.reduced:
                self.phase, self.applying = "apply", self.intact()
                for p in self.applying:
                    for node in self.pipeline_nodes(p):
                        assert node.t is not None
                        node.loop.put(loop_task(node.t, self.step, Work.APPLY, ctl.Apply(self.step)))
                return True
            return False
        if self.phase == "apply":
            self.phase = "applied"
            self.records.append({"step": self.step, "commits": dict(self.pool.record), "applied": self.applying,
                                 "outer": None})
            if self.spec.sync_period > 1 and (self.step + 1) % self.spec.sync_period == 0:
                return self._outer_round()
            return True
        if self.phase == "outer":
            want = {n.endpoint for p in self.intact() for n in self.pipeline_nodes(p)}
            if want <= self.reduced:
                self.phase = "outer-apply"
                self.records[-1]["outer"] = self.intact()
                for node in [n for p in self.intact() for n in self.pipeline_nodes(p)]:
                    assert node.t is not None
                    node.loop.put(loop_task(node.t, self.step, Work.APPLY, ctl.Apply(self.step, outer=True)))
                return True
        return False

    def _send_reduce(self) -> None:
        participants = tuple(self.intact())
        self.applying = list(participants)  # merged: from here the commit record is final
        for p in participants:
            for node in self.pipeline_nodes(p):
                assert node.t is not None
                node.loop.queue_reduce(node.t, ctl.Reduce(self.step, self.attempt, participants, dict(self.pool.record),
                                                    apply=self.merged))

    def _outer_round(self) -> bool:
        participants = tuple(self.intact())
        if not participants:
            self.failed = True
            return False
        self.phase, self.reduced = "outer", set()
        for p in participants:
            for node in self.pipeline_nodes(p):
                assert node.t is not None
                node.loop.queue_reduce(node.t, ctl.Reduce(self.step, self.attempt, participants, {}, outer=True))
        return True

    # ------------------------------------------------------------------------------------------ deaths
    def kill(self, victim: str) -> None:
        """A death as the coordinator sees it (docs/architecture.md, "Deaths")."""
        if victim == COORDINATOR_DIES:
            self._new_leader()
            return
        node = self.nodes[victim]
        if not node.alive:
            return
        node.alive = False
        assert node.t is not None
        p = node.t.assignment.replica
        if self.phase == "pool" or (self.phase == "reduce" and not self.merged):  # merged: nothing is redone
            self.out.add(p)
            for other in self.pipeline_nodes(p):
                if other.alive and other.t is not None:
                    other.loop.put(loop_task(other.t, self.step, Work.DROP))
            self.pool.requeue(p)
            if not self.intact():
                self.failed = True
                self.phase = "failed"
                return
            self.attempt += 1
            self.phase, self.reduced = "pool", set()
            self._start_round()
        elif self.phase == "outer":  # the outer average restarts without the pipeline
            self.out.add(p)
            self.attempt += 1
            self.reduced = set()
            if not self._outer_round():
                self.phase = "failed"
        elif self.spec.sync_period > 1:
            self.out.add(p)

    def _new_leader(self) -> None:
        """The coordinator died; a new leader assigns every live worker its stage again (keep) and restarts
        the step. Only before the first apply: afterwards replicas differ in trained steps, a re-plan's case."""
        if self.phase not in ("pool", "reduce") or (self.phase == "reduce" and self.merged):
            return
        self.epoch += 1
        for node in self.live():
            assert node.t is not None
            old = node.t
            old.exchange.abort_before((2**62, 0))
            old.compute.reset_step()
            node.assign(replace(old.assignment, epoch=self.epoch), old.compute, old.outer)
        self.begin(self.step)

    def run_to_end(self, limit: int = 500) -> None:
        for _ in range(limit):
            if self.failed or not self.tick():
                return
        raise AssertionError("the virtual run did not settle")


def fresh_stage(spec: RunSpec, a: Assignment) -> StageCompute:
    return StageCompute(StageComputeConfig(spec.model, a.layers[0], a.layers[1], optim=spec.optim))


def loop_task(t: Tasklet, step: int, kind: Work = Work.REDUCE, *args: Any) -> Any:
    from tasklet.peer.runtime.stage.loop import Task

    return Task(kind, t, step, tuple(args))
