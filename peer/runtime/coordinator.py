"""The coordinator: assigns tasklets, runs the task pool, and drives steps. Lives in the leader's process.

It is the only place with global knowledge of a step, and deliberately holds little else: no parameters, no
activations. Its messages are small (leases, commits, one loss per micro-batch), so it does not need a fast
link; in a local swarm it runs unshaped in the launching process.

A step, as the coordinator sees it:

1. ``start_step`` to every worker that is not a first stage (they must know the step before activations of
   it arrive), then to the first stages, which start pulling micro-batches from the pool.
2. Leases and commits arrive as Fetch calls of Kind COMMIT; losses as reports.
3. When the pool is complete, ``sync`` with the commit record goes to every worker; each averages with its
   group and reports ``synced``. The step ends when all have.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.runtime.pool import TaskPool
from peer.runtime.spec import Assignment, RunSpec
from peer.runtime.wire import body_of, control, envelope, make_key, tensor_named
from peer.transport import PeerClient, PeerServer, TransportConfig
from protocol import tasklet_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadMessage, Rejected

log = logging.getLogger(__name__)


class StepFailedError(RuntimeError):
    """A step could not finish: a worker reported an error or did not answer in time."""


@dataclass
class StepReport:
    """What one step did."""

    step: int
    loss: float
    seconds: float
    microbatches_per_pipeline: dict[int, int]
    requeued: int = 0


@dataclass
class _StepState:
    pool: TaskPool
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    synced: set[tuple[int, int]] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class Coordinator:
    """Drives a run over workers that have been given their assignments with :meth:`assign`."""

    def __init__(self, spec: RunSpec, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spec = spec.validate()
        self.config = TransportConfig(host=host, port=port, max_concurrent_streams=48, thread_pool_size=64)
        self.server = PeerServer(self.config)
        self.server.register_fetch(pb.COMMIT, self._on_pool_request)
        self.server.register_push(pb.OTHER, self._on_report)
        self._cond = threading.Condition()
        self._state: _StepState | None = None
        self.assignments: dict[str, Assignment] = {}
        self.epoch = 0
        self._clients: dict[str, PeerClient] = {}

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> str:
        self.server.start()
        return self.server.endpoint

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self.server.stop(grace=0.5)

    def _client(self, endpoint: str) -> PeerClient:
        if endpoint not in self._clients:
            self._clients[endpoint] = PeerClient(endpoint, self.config, sender="coordinator")
        return self._clients[endpoint]

    # ---------------------------------------------------------------------------------------------- assign
    def assign(self, assignments: dict[str, Assignment], timeout_s: float = 120.0) -> None:
        """Send every worker (by endpoint) its assignment; wait until all accepted."""
        epochs = {a.epoch for a in assignments.values()}
        if len(epochs) != 1:
            raise ValueError(f"assignments carry several epochs {sorted(epochs)}")
        self.epoch = epochs.pop()
        run = self.spec.to_dict()
        futures = [
            self._client(ep).push_async(
                envelope(pb.STAGE_ASSIGNMENT, make_key(self.spec.run_id, a.epoch, -1),
                         body={"run": run, "assignment": a.to_dict()}), timeout_s)
            for ep, a in assignments.items()
        ]
        for f in futures:
            f.result(timeout=timeout_s + 5)
        self.assignments = dict(assignments)

    # ------------------------------------------------------------------------------------------ step loop
    def run_step(self, step: int, timeout_s: float = 600.0) -> StepReport:
        """Run one step to the end (all groups synchronised) and report it."""
        if not self.assignments:
            raise RuntimeError("assign() the workers first")
        n_workers = len(self.assignments)
        with self._cond:
            self._state = _StepState(pool=TaskPool(step, self.spec.n_microbatches, lease_timeout_s=timeout_s))
        started = time.monotonic()
        deadline = started + timeout_s
        firsts = [ep for ep, a in self.assignments.items() if a.is_first]
        others = [ep for ep, a in self.assignments.items() if not a.is_first]
        self._broadcast(others, "start_step", {"step": step, "feed": False}, step)
        self._broadcast(firsts, "start_step", {"step": step, "feed": True}, step)
        state = self._wait(lambda s: s.pool.complete(), deadline, f"step {step}: micro-batches")
        assignment = state.pool.assignment()
        self._broadcast(list(self.assignments), "sync",
                        {"step": step, "assignment": {str(k): v for k, v in assignment.items()}}, step)
        self._wait(lambda s: len(s.synced) == n_workers, deadline, f"step {step}: gradient sync")
        seconds = time.monotonic() - started
        losses = [state.losses.get((mb, p), math.nan) for mb, p in sorted(assignment.items())]
        counts: dict[int, int] = {}
        for p in assignment.values():
            counts[p] = counts.get(p, 0) + 1
        report = StepReport(step, sum(losses) / len(losses), seconds, counts, state.pool.requeued)
        log.info("step %d: loss %.4f in %.3f s (micro-batches per pipeline %s)", step, report.loss, seconds,
                 counts)
        return report

    def _wait(self, ready: Any, deadline: float, what: str) -> _StepState:
        with self._cond:
            state = self._state
            assert state is not None
            while not ready(state):
                if state.errors:
                    raise StepFailedError(f"{what}: {state.errors[0]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepFailedError(f"{what}: timed out")
                self._cond.wait(min(left, 1.0))
            return state

    def _broadcast(self, endpoints: Sequence[str], op: str, body: dict[str, Any], step: int) -> None:
        futures = [self._client(ep).push_async(control(op, self.spec.run_id, self.epoch, step, body), 30.0)
                   for ep in endpoints]
        for f in futures:
            f.result(timeout=35.0)

    def stop_workers(self) -> None:
        """Ask every worker to exit (best effort)."""
        for ep in self.assignments:
            try:
                self._client(ep).push(control("stop", self.spec.run_id, self.epoch), timeout_s=5.0)
            except Exception as exc:  # a worker that is already gone is fine
                log.info("stop %s: %s", ep, exc)

    def fetch_state(self, endpoint: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """A worker's stage state (params, AdamW moments, step) as a plain dict of tensors and numbers."""
        env = self._client(endpoint).fetch(pb.STAGE_STATE, timeout_s=timeout_s)
        state: dict[str, Any] = dict(body_of(env))
        for name in ("params", "exp_avg", "exp_avg_sq"):
            state[name] = decode_tensor(tensor_named(env, name), expect_dtype=torch.float32)
        return state

    # ------------------------------------------------------------------------------------------- handlers
    def _on_pool_request(self, request: pb.FetchRequest) -> pb.Envelope:
        op = request.meta.get("op")
        key = request.key
        reply = pb.Envelope(kind=pb.COMMIT, key=key)
        with self._cond:
            state = self._state
            if state is None or key.step != state.pool.step or key.run_id != self.spec.run_id:
                reply.meta["status"] = "wait"
                return reply
            if op == "lease":
                if state.pool.complete():
                    reply.meta["status"] = "done"
                    return reply
                mb = state.pool.lease(key.replica)
                reply.meta["status"] = "wait" if mb is None else "lease"
                if mb is not None:
                    reply.key.microbatch = mb
            elif op == "commit":
                reply.meta["status"] = state.pool.commit(key.microbatch, key.replica).value
                self._cond.notify_all()
            else:
                raise BadMessage("meta.op", f"unknown pool operation {op!r}")
        return reply

    def _on_report(self, env: pb.Envelope) -> None:
        op = env.meta.get("op")
        body = body_of(env)
        with self._cond:
            state = self._state
            if state is None or env.key.step != state.pool.step:
                raise Rejected(f"report for step {env.key.step}, which is not running")
            who = (env.key.stage, env.key.replica)
            if op == "loss":
                loss = float(body["loss"])
                state.losses[(int(body["microbatch"]), env.key.replica)] = loss
            elif op == "synced":
                state.synced.add(who)
            elif op in ("error", "peer_error"):
                state.errors.append(f"stage {who[0]} replica {who[1]}: {body}")
                log.error("worker stage %d replica %d reports %s: %s", who[0], who[1], op, body)
            else:
                raise BadMessage("meta.op", f"unknown report {op!r}")
            self._cond.notify_all()
