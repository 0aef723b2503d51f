"""A scripted worker: a real gRPC server that does no compute and answers the coordinator's control messages the
way a one-stage pipeline would (lease, report a loss, commit; ``reduced``; ``synced``), records what it was told,
and misbehaves on cue (shared by the coordinator's tests and the claims tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.runtime.wire import make_key
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import TransportError

SPEC = RunSpec(run_id="coord", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=6)
EPOCH = 1

@dataclass
class Script:
    """How a scripted worker behaves."""

    commit_twice: bool = False
    die_after_leases: int | None = None  # stop serving while holding this many-th lease, uncommitted
    fail_reduce: bool = False  # answer "reduce" with a task error instead of "reduced"
    wait_before_leasing: threading.Event | None = None
    leased_first: threading.Event = field(default_factory=threading.Event)
    hold_s: dict[int, float] = field(default_factory=dict)  # step -> seconds each lease is held before its loss
    resync_delay_s: float = 0.0  # reloading the stage when told to resync takes this long
    hang_start_step: threading.Event | None = None  # hold the answer to a start_step until this is set

class ScriptedWorker:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.server = PeerServer(TransportConfig(host="127.0.0.1"))
        self.server.register_push(pb.STAGE_ASSIGNMENT, self._on_assignment)
        self.server.register_push(pb.CONTROL, self._on_control)
        self.received: list[tuple[float, ctl.Message]] = []
        self.commit_replies: list[str] = []
        self.reduced_at: float | None = None
        self.assignment: ctl.StageAssignment | None = None
        self.client: PeerClient | None = None
        self.stopping = threading.Event()
        self.dead = False
        self.resynced_at: float | None = None  # when it reported the resynced stage
        self.started: dict[int, float] = {}  # step -> when a start_step of it arrived
        self.dropped: set[int] = set()

    def start(self) -> str:
        self.server.start()
        return self.server.endpoint

    def stop(self) -> None:
        self.stopping.set()  # threads still reporting (a feeder of a step the test no longer waits for) end quietly
        if self.client is not None:
            self.client.close()
        self.server.stop(grace=0.1)

    def ops(self) -> list[ctl.Op]:
        return [m.op for _, m in self.received]

    def _on_assignment(self, env: pb.Envelope) -> None:
        self.assignment = ctl.StageAssignment.from_envelope(env)
        self.client = PeerClient(self.assignment.assignment.coordinator, sender="scripted")

    def _report(self, msg: ctl.Message, step: int) -> None:
        assert self.assignment is not None and self.client is not None
        a = self.assignment.assignment
        self.client.push(ctl.encode(msg, SPEC.run_id, a.epoch, step, stage=a.stage, replica=a.replica), timeout_s=10)

    def _spawn(self, target: Callable[..., object], *args: object) -> None:
        """Run ``target`` in a thread; once the worker is stopped its closed client's errors are expected."""

        def run() -> None:
            try:
                target(*args)
            except (ValueError, TransportError):  # ValueError: gRPC's "Channel closed!"
                if not self.stopping.is_set():
                    raise

        threading.Thread(target=run, daemon=True).start()

    def _on_control(self, env: pb.Envelope) -> None:
        msg = ctl.decode(env, ctl.TO_WORKER)
        self.received.append((time.monotonic(), msg))
        if isinstance(msg, ctl.StartStep):
            self.started.setdefault(msg.step, time.monotonic())
            if self.script.hang_start_step is not None:
                self.script.hang_start_step.wait(30)  # accepted over TCP, never answered (until released)
                return
        if isinstance(msg, ctl.DropStep):
            self.dropped.add(msg.step)
        if isinstance(msg, ctl.Resync):
            self._spawn(self._resync, msg)
        if isinstance(msg, ctl.StartStep) and msg.feed:
            self._spawn(self._feed, msg.step)
        elif isinstance(msg, ctl.Reduce):
            if self.script.fail_reduce:
                reply: ctl.Message = ctl.TaskError("reduce", msg.step, "boom: averaging failed")
            elif msg.apply:  # the apply comes with the reduce (a lone one-stage pipeline): one report, synced
                reply, self.reduced_at = ctl.Synced(msg.step, msg.step + 1, f"params-{msg.step + 1}"), time.monotonic()
            else:
                reply, self.reduced_at = ctl.Reduced(msg.step, msg.attempt), time.monotonic()
            self._spawn(self._report, reply, msg.step)
        elif isinstance(msg, ctl.Apply):
            synced = ctl.Synced(msg.step, msg.step + 1, f"params-{msg.step + 1}")
            self._spawn(self._report, synced, msg.step)

    def _resync(self, msg: ctl.Resync) -> None:
        time.sleep(self.script.resync_delay_s)
        self.resynced_at = time.monotonic()
        self._report(ctl.Synced(msg.step, msg.trained_steps, f"params-{msg.trained_steps}"), msg.step)

    def _feed(self, step: int) -> None:
        assert self.assignment is not None and self.client is not None
        if self.script.wait_before_leasing is not None:
            self.script.wait_before_leasing.wait(10)
        replica = self.assignment.assignment.replica
        key = make_key(SPEC.run_id, EPOCH, step, stage=0, replica=replica)
        leases = 0
        while step not in self.dropped and max(self.started) == step and not self.stopping.is_set():
            reply = self.client.fetch(ctl.pool_kind(ctl.Op.LEASE), key, timeout_s=10)
            status = ctl.pool_status(reply)
            if status is ctl.PoolStatus.DONE:
                return
            if status is not ctl.PoolStatus.LEASE:
                time.sleep(0.01)
                continue
            mb, leases = reply.key.microbatch, leases + 1
            self.script.leased_first.set()
            if self.script.die_after_leases == leases:
                self.dead = True
                self.server.stop(grace=0)  # gone, holding an uncommitted lease
                return
            time.sleep(self.script.hold_s.get(step, 0.0))
            self._report(ctl.Loss(step, mb, float(mb)), step)
            for _ in range(2 if self.script.commit_twice else 1):
                commit = make_key(SPEC.run_id, EPOCH, step, mb, 0, replica)
                answer = self.client.fetch(ctl.pool_kind(ctl.Op.COMMIT), commit, timeout_s=10)
                status = ctl.pool_status(answer)
                self.commit_replies.append("" if status is None else status.value)
