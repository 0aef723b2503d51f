"""The coordinator: assigns tasklets, runs the task pool, drives steps, notices deaths. Lives in the leader.

It is the only place with global knowledge of a step, and deliberately holds little else: no parameters, no
activations. Its messages are small (leases, commits, one loss per micro-batch), so it does not need a fast
link; in a local swarm it runs unshaped in the launching process.

A step, as the coordinator sees it:

1. ``start_step`` to every worker that is not a first stage (they must know the step before activations of
   it arrive), then to the first stages, which start pulling micro-batches from the pool.
2. Leases and commits arrive as Fetch calls of Kind COMMIT; losses as reports.
3. When the pool is complete, ``reduce`` (with the commit record and the intact pipelines) goes to every
   worker of an intact pipeline; each averages with its group and reports ``reduced``.
4. When every one has, ``apply``; each steps AdamW and reports ``synced``. The step ends when all have.

Deaths. A worker is declared dead when a heartbeat ping fails twice, when a neighbour reports a failed send
and a ping confirms it, or when a receiver reports it sent malformed data (NaN, wrong shape). Its pipeline is
dropped from the step: the pool requeues every micro-batch that pipeline leased or committed, the pipeline's
survivors discard their work, and the intact pipelines redo it — if the averaging had started, it is restarted
with the remaining participants (a new round). Only when no pipeline is intact does the step fail
(:class:`ReplanNeededError`): the driver re-plans and redoes it. ``apply`` is only sent once every stage has
its averaged gradient, so a death can never leave some stages updated and others not.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from peer.net import PeerClient, PeerServer, TransportConfig
from peer.runtime.pool import TaskPool
from peer.runtime.spec import Assignment, RunSpec
from peer.runtime.wire import body_of, control, envelope, make_key
from peer.runtime.worker import state_envelope, state_from_envelope
from protocol import tasklet_pb2 as pb
from protocol.errors import BadMessage, Rejected, TransportError

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
PING_TIMEOUT_S = 2.0


class StepFailedError(RuntimeError):
    """A step could not finish: it timed out or a worker reported an error it cannot recover from."""


class ReplanNeededError(StepFailedError):
    """No pipeline of the plan is intact any more (or a worker is gone at a step boundary): re-plan."""


@dataclass
class StepReport:
    """What one step did."""

    step: int
    loss: float
    seconds: float
    microbatches_per_pipeline: dict[int, int]
    requeued: int = 0
    dropped_pipelines: list[int] = field(default_factory=list)


@dataclass
class _StepState:
    pool: TaskPool
    round: int = 0
    phase: str = "compute"  # compute -> reduce -> apply
    feeders_done: bool = False  # some feeder was told "done" (the pool was complete)
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    reduced: set[str] = field(default_factory=set)
    synced: set[str] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class Coordinator:
    """Drives a run over workers that have been given their assignments with :meth:`assign`."""

    def __init__(self, spec: RunSpec, host: str = "127.0.0.1", port: int = 0, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.spec = spec.validate()
        self.heartbeat_s = heartbeat_s
        self.config = TransportConfig(host=host, port=port, max_concurrent_streams=48, thread_pool_size=64)
        self.server = PeerServer(self.config)
        self.server.register_fetch(pb.COMMIT, self._on_pool_request)
        self.server.register_fetch(pb.STAGE_STATE, self._on_state_request)
        self.server.register_push(pb.OTHER, self._on_report)
        self._cond = threading.Condition()
        self._state: _StepState | None = None
        self.assignments: dict[str, Assignment] = {}
        self.dead: set[str] = set()
        self.dead_reasons: dict[str, str] = {}
        self.epoch = 0
        self._clients: dict[str, PeerClient] = {}
        self._clients_lock = threading.Lock()
        self._checkpoint_states: dict[int, dict[str, Any]] = {}  # stage -> state served to restoring workers
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self.on_death: Callable[[str, str], None] | None = None
        # on_event(name, info): "lease", "commit", "reduce", "apply", "dead", "requeue" as they happen; must not
        # block (tests use it to kill a worker at a chosen moment, benchmarks to time recovery)
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def start(self) -> str:
        self.server.start()
        self._heartbeat.start()
        return self.server.endpoint

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(timeout=5.0)
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        self.server.stop(grace=0.5)

    def _client(self, endpoint: str) -> PeerClient:
        with self._clients_lock:
            if endpoint not in self._clients:
                self._clients[endpoint] = PeerClient(endpoint, self.config, sender="coordinator")
            return self._clients[endpoint]

    # ---------------------------------------------------------------------------------------------- assign
    def assign(
        self,
        assignments: dict[str, Assignment],
        sources: dict[str, dict[str, Any]] | None = None,
        timeout_s: float = 180.0,
    ) -> None:
        """Send every worker (by endpoint) its assignment and state source; wait until all accepted.

        ``sources[endpoint]`` is ``{"source": "init"|"keep"|"fetch", "endpoint": ..., "step": k}``; default
        ``init`` at step 0. A worker that refuses or cannot be reached raises (the caller re-plans).
        """
        epochs = {a.epoch for a in assignments.values()}
        if len(epochs) != 1:
            raise ValueError(f"assignments carry several epochs {sorted(epochs)}")
        with self._cond:
            self.epoch = epochs.pop()
            self._state = None
            self.assignments = dict(assignments)
        run = self.spec.to_dict()
        sources = sources or {}
        futures = {
            ep: self._client(ep).push_async(
                envelope(
                    pb.STAGE_ASSIGNMENT,
                    make_key(self.spec.run_id, a.epoch, -1),
                    body={
                        "run": run,
                        "assignment": a.to_dict(),
                        "state": sources.get(ep, {"source": "init", "step": 0}),
                    },
                ),
                timeout_s,
            )
            for ep, a in assignments.items()
        }
        for ep, f in futures.items():
            try:
                f.result(timeout=timeout_s + 5)
            except TransportError as exc:
                self._confirm_death(ep, f"did not take its assignment: {exc}")
                raise ReplanNeededError(f"worker {ep} did not take its assignment: {exc}") from exc

    def serve_checkpoint(self, states: dict[int, dict[str, Any]]) -> None:
        """Serve these stage states (by stage index) to workers told to fetch from the coordinator."""
        self._checkpoint_states = dict(states)

    # ------------------------------------------------------------------------------------------ step loop
    def _intact(self, state: _StepState) -> list[int]:
        """Pipelines whose every member is alive and that were not dropped from this step."""
        n_rep = max((a.n_replicas for a in self.assignments.values()), default=0)
        broken = {a.replica for ep, a in self.assignments.items() if ep in self.dead} | state.dropped
        return [r for r in range(n_rep) if r not in broken]

    def _members(self, pipelines: Sequence[int], first: bool | None = None) -> list[str]:
        return [
            ep
            for ep, a in self.assignments.items()
            if a.replica in pipelines and ep not in self.dead and (first is None or a.is_first == first)
        ]

    def run_step(self, step: int, timeout_s: float = 600.0) -> StepReport:
        """Run one step to the end (all intact pipelines' stages updated) and report it."""
        if not self.assignments:
            raise RuntimeError("assign() the workers first")
        if self.dead:
            raise ReplanNeededError(f"step {step}: workers died since the plan was made: {sorted(self.dead)}")
        state = _StepState(pool=TaskPool(step, self.spec.n_microbatches, lease_timeout_s=timeout_s))
        with self._cond:
            self._state = state
            intact = self._intact(state)
        started = time.monotonic()
        deadline = started + timeout_s
        self._broadcast(self._members(intact, first=False), "start_step", {"step": step, "round": 0}, step)
        self._broadcast(self._members(intact, first=True), "start_step", {"step": step, "round": 0, "feed": True}, step)
        while True:
            self._wait(state, lambda: state.pool.complete(), deadline, f"step {step}: micro-batches")
            with self._cond:
                if not state.pool.complete():
                    continue
                state.phase, state.round, state.reduced = "reduce", state.round + 1, set()
                intact, rnd = self._intact(state), state.round
                assignment = state.pool.assignment()
            members = self._members(intact)
            body = {
                "step": step,
                "round": rnd,
                "participants": intact,
                "assignment": {str(k): v for k, v in assignment.items()},
            }
            self._emit("reduce", step=step, round=rnd, participants=intact)
            self._broadcast(members, "reduce", body, step)
            expected = set(members)
            restarted = self._wait(
                state,
                lambda expected=expected: state.reduced >= expected,
                deadline,
                f"step {step}: gradient averaging",
                watch_round=rnd,
            )
            if restarted:
                continue
            break
        with self._cond:
            state.phase = "apply"
        self._emit("apply", step=step)
        self._broadcast(members, "apply", {"step": step}, step)
        self._wait(
            state,
            lambda: state.synced >= {m for m in members if m not in self.dead},
            deadline,
            f"step {step}: optimizer step",
            allow_failures=True,
        )
        seconds = time.monotonic() - started
        losses = [state.losses.get((mb, p), math.nan) for mb, p in sorted(assignment.items())]
        counts: dict[int, int] = {}
        for p in assignment.values():
            counts[p] = counts.get(p, 0) + 1
        report = StepReport(
            step,
            sum(losses) / len(losses),
            seconds,
            counts,
            state.pool.requeued,
            sorted(state.dropped),
        )
        log.info(
            "step %d: loss %.4f in %.3f s (micro-batches per pipeline %s%s)",
            step,
            report.loss,
            seconds,
            counts,
            f", dropped pipelines {sorted(state.dropped)}" if state.dropped else "",
        )
        return report

    def _wait(
        self,
        state: _StepState,
        ready: Callable[[], bool],
        deadline: float,
        what: str,
        watch_round: int | None = None,
        allow_failures: bool = False,
    ) -> bool:
        """Wait for ``ready``; handle deaths on the way. True when a death sent the step back to computing."""
        with self._cond:
            while not ready():
                if state.errors:
                    raise StepFailedError(f"{what}: {state.errors[0]}")
                if not allow_failures and self._drop_broken(state):
                    if not self._intact(state):
                        raise ReplanNeededError(f"{what}: no intact pipeline left (dead: {sorted(self.dead)})")
                    if state.feeders_done:
                        # the feeders had stopped (pool complete): start them again, and abort any averaging
                        state.phase, state.feeders_done = "compute", False
                        self._refeed(state)
                        if watch_round is not None:
                            return True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepFailedError(f"{what}: timed out")
                self._cond.wait(min(left, 0.2))
            return False

    def _drop_broken(self, state: _StepState) -> list[int]:
        """Drop pipelines with a dead member from the step (called with the lock held); return them."""
        broken = sorted({a.replica for ep, a in self.assignments.items() if ep in self.dead} - state.dropped)
        for r in broken:
            lost = state.pool.fail_pipeline(r)
            self._emit("requeue", step=state.pool.step, pipeline=r, microbatches=lost)
            state.dropped.add(r)
            log.warning(
                "step %d: pipeline %d lost a member; %d micro-batches go back to the pool",
                state.pool.step,
                r,
                len(lost),
            )
            survivors = self._members([r])
            if survivors:
                threading.Thread(
                    target=self._broadcast_quietly,
                    args=(survivors, "drop_step", {"step": state.pool.step}, state.pool.step),
                    daemon=True,
                ).start()
        return broken

    def _refeed(self, state: _StepState) -> None:
        """A new round for the intact pipelines: abort their averaging, restart their feeders.

        Called only when no micro-batch is in flight (the pool had been complete), so resetting the feeders'
        in-flight counts is safe. Non-first stages are told first, as at the start of a step.
        """
        state.round += 1
        intact, step, rnd = self._intact(state), state.pool.step, state.round

        def send() -> None:
            self._broadcast_quietly(
                self._members(intact, first=False), "start_step", {"step": step, "round": rnd}, step
            )
            self._broadcast_quietly(
                self._members(intact, first=True), "start_step", {"step": step, "round": rnd, "feed": True}, step
            )

        threading.Thread(target=send, daemon=True).start()

    def _emit(self, name: str, **info: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(name, info)
            except Exception:  # a broken observer must not break training
                log.exception("on_event(%s) failed", name)

    def _broadcast(self, endpoints: Sequence[str], op: str, body: dict[str, Any], step: int) -> None:
        """Send a control message to every endpoint; a worker that does not answer is checked for death."""
        futures = {
            ep: self._client(ep).push_async(control(op, self.spec.run_id, self.epoch, step, body), 30.0)
            for ep in endpoints
        }
        for ep, f in futures.items():
            try:
                f.result(timeout=35.0)
            except TransportError as exc:
                log.warning("%s to %s failed: %s", op, ep, exc)
                self._confirm_death(ep, f"{op} failed: {exc}")

    def _broadcast_quietly(self, endpoints: Sequence[str], op: str, body: dict[str, Any], step: int) -> None:
        try:
            self._broadcast(endpoints, op, body, step)
        except Exception as exc:  # background notice; the step loop notices real failures itself
            log.info("%s broadcast: %s", op, exc)

    # ------------------------------------------------------------------------------------------ liveness
    def declare_dead(self, endpoint: str, reason: str) -> None:
        """Exclude a worker for the rest of this plan (its pipeline is dropped from the running step)."""
        with self._cond:
            if endpoint in self.dead or endpoint not in self.assignments:
                return
            self.dead.add(endpoint)
            self.dead_reasons[endpoint] = reason
            log.warning("worker %s declared dead: %s", endpoint, reason)
            self._emit("dead", endpoint=endpoint, reason=reason)
            self._cond.notify_all()
        if self.on_death:
            self.on_death(endpoint, reason)

    def _alive(self, endpoint: str) -> bool:
        try:
            self._client(endpoint).ping(timeout_s=PING_TIMEOUT_S)
            return True
        except TransportError:
            return False

    def _confirm_death(self, endpoint: str, reason: str) -> None:
        if endpoint in self.assignments and endpoint not in self.dead and not self._alive(endpoint):
            self.declare_dead(endpoint, reason)

    def _heartbeat_loop(self) -> None:
        misses: dict[str, int] = {}
        while not self._stop.wait(self.heartbeat_s):
            for ep in [ep for ep in list(self.assignments) if ep not in self.dead]:
                if self._alive(ep):
                    misses[ep] = 0
                    continue
                misses[ep] = misses.get(ep, 0) + 1
                if misses[ep] >= 2:
                    self.declare_dead(ep, f"missed {misses[ep]} heartbeats")

    # ------------------------------------------------------------------------------------------- queries
    def stop_workers(self) -> None:
        """Ask every live worker to exit (best effort)."""
        for ep in self.assignments:
            if ep in self.dead:
                continue
            try:
                self._client(ep).push(control("stop", self.spec.run_id, self.epoch), timeout_s=5.0)
            except Exception as exc:  # a worker that is already gone is fine
                log.info("stop %s: %s", ep, exc)

    def fetch_state(self, endpoint: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """A worker's stage state (params, AdamW moments, step) as a plain dict of tensors and numbers."""
        a = self.assignments[endpoint]
        env = self._client(endpoint).fetch(
            pb.STAGE_STATE,
            make_key(self.spec.run_id, a.epoch, -1, stage=a.stage),
            meta={"layers": json.dumps(list(a.layers))},
            timeout_s=timeout_s,
        )
        return state_from_envelope(env)

    def worker_status(self, endpoint: str, timeout_s: float = 5.0) -> dict[str, Any]:
        return self._client(endpoint).status(timeout_s=timeout_s)

    # ------------------------------------------------------------------------------------------- handlers
    def _on_pool_request(self, request: pb.FetchRequest) -> pb.Envelope:
        op = request.meta.get("op")
        key = request.key
        reply = pb.Envelope(kind=pb.COMMIT, key=key)
        with self._cond:
            state = self._state
            if (
                state is None
                or key.step != state.pool.step
                or key.run_id != self.spec.run_id
                or key.epoch != self.epoch
            ):
                reply.meta["status"] = "wait"
                return reply
            if op == "lease":
                if state.pool.complete():
                    reply.meta["status"] = "done"
                    state.feeders_done = True
                    return reply
                mb = state.pool.lease(key.replica)
                reply.meta["status"] = "wait" if mb is None else "lease"
                if mb is not None:
                    reply.key.microbatch = mb
                    self._emit("lease", step=key.step, microbatch=mb, pipeline=key.replica)
            elif op == "commit":
                result = state.pool.commit(key.microbatch, key.replica)
                reply.meta["status"] = result.value
                self._emit("commit", step=key.step, microbatch=key.microbatch, pipeline=key.replica,
                           result=result.value)
                self._cond.notify_all()
            else:
                raise BadMessage("meta.op", f"unknown pool operation {op!r}")
        return reply

    def _on_state_request(self, request: pb.FetchRequest) -> pb.Envelope:
        state = self._checkpoint_states.get(request.key.stage)
        if state is None:
            raise Rejected(f"the coordinator serves no checkpoint of stage {request.key.stage}")
        return state_envelope(state, self.spec.run_id, self.epoch, request.key.stage)

    def _endpoint_of(self, stage: int, replica: int) -> str | None:
        for ep, a in self.assignments.items():
            if a.stage == stage and a.replica == replica:
                return ep
        return None

    def _on_report(self, env: pb.Envelope) -> None:
        op = env.meta.get("op")
        body = body_of(env)
        if env.key.epoch != self.epoch:
            raise Rejected(f"report of epoch {env.key.epoch}, the plan is at epoch {self.epoch}")
        sender = self._endpoint_of(env.key.stage, env.key.replica)
        if op == "peer_error":
            target = str(body.get("endpoint", ""))
            threading.Thread(target=self._confirm_death, args=(target, f"reported by {sender}"), daemon=True).start()
            return
        if op == "bad_peer":
            culprit = self._endpoint_of(int(body.get("stage", -1)), int(body.get("replica", -1)))
            if culprit is not None:
                self.declare_dead(culprit, f"sent malformed data to {sender}: {body.get('error')}")
            return
        with self._cond:
            state = self._state
            if state is None or env.key.step != state.pool.step:
                raise Rejected(f"report for step {env.key.step}, which is not running")
            if op == "loss":
                state.losses[(int(body["microbatch"]), env.key.replica)] = float(body["loss"])
            elif op == "reduced":
                if int(body.get("round", -1)) == state.round and sender is not None:
                    state.reduced.add(sender)
            elif op == "synced":
                if sender is not None:
                    state.synced.add(sender)
            elif op == "error":
                if env.key.replica in state.dropped or sender in self.dead:
                    log.info("ignoring an error from dropped pipeline %d: %s", env.key.replica, body)
                else:
                    log.error("worker stage %d replica %d: %s", env.key.stage, env.key.replica, body)
                    threading.Thread(target=self._judge_error, args=(sender, body), daemon=True).start()
            else:
                raise BadMessage("meta.op", f"unknown report {op!r}")
            self._cond.notify_all()

    def _judge_error(self, sender: str | None, body: dict[str, Any]) -> None:
        """A worker's task failed. If the step can still finish it will (a missing message shows up as a
        death elsewhere); an error during averaging or apply with everyone alive is fatal for the step."""
        time.sleep(self.heartbeat_s)
        with self._cond:
            state = self._state
            if state is None or sender in self.dead:
                return
            if body.get("what") in ("reduce", "apply") and state.phase != "compute":
                state.errors.append(f"{sender}: {body.get('error')}")
                self._cond.notify_all()
