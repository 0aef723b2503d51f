"""The coordinator: assigns tasklets, runs the task pool, drives steps, notices deaths. Lives in the leader.

It is the only place with global knowledge of a step, and deliberately holds little else: no parameters, no
activations. Its messages are small (leases, commits, one loss per micro-batch), so it does not need a fast
link; in a local swarm it runs unshaped in the launching process.

A step, as the coordinator sees it (its :class:`StepPhase` in brackets; docs/architecture.md, "One step"):

1. [compute] ``start_step`` to every worker that is not a first stage (they must know the step before
   activations of it arrive), then to the first stages, which start pulling micro-batches from the pool.
2. Leases and commits arrive as Fetch calls of Kind COMMIT; losses as reports.
3. [reduce] When the pool is complete, ``reduce`` (with the commit record and the intact pipelines) goes to
   every worker of an intact pipeline; each averages with its group and reports ``reduced``.
4. [apply] When every one has, ``apply``; each steps AdamW and reports ``synced``. The step ends when all have.

Deaths. A worker is declared dead when two liveness checks in a row (a Ping every ``liveness_interval_s``)
fail, when a neighbour reports a failed send and a ping confirms it, or when a receiver reports it sent
malformed data (NaN, wrong shape). Its pipeline is dropped from the step: the pool requeues every micro-batch
that pipeline leased or committed, the pipeline's survivors discard their work, and the intact pipelines redo
it — if the averaging had started, it is restarted with the remaining participants (a new round). Only when
no pipeline is intact does the step fail (:class:`ReplanNeededError`): the driver re-plans and redoes it.
``apply`` is only sent once every stage has its averaged gradient, so a death can never leave some stages
updated and others not.

Laggards (peer.runtime.lead.resync). The live workers of a pipeline dropped from a step without a death did not
apply it: they reload their stage from a replica in the background, and their pipeline is left out of the
steps until it is in sync again.

Threads and locks. ``_cond`` (a condition) guards the step state, the assignments, the epoch and the dead set;
the step loop waits on it. The observer (``on_event``) is never called while it is held: events are
collected under the lock and emitted after. Background work (drop notices, restarts, judging an error,
confirming a reported death) runs on one executor, shut down by :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from peer.net import PeerClient, PeerServer, TransportConfig
from peer.net.endpoint import with_route
from peer.net.tls import TlsContext, peer_ids, process_tls
from peer.runtime import control as ctl
from peer.runtime.bounds import CONTROL_BYTES
from peer.runtime.checkpoints import copy_bound_bytes, copy_parts, fetch_copy_files
from peer.runtime.grants import sign_grant
from peer.runtime.lead.pool import CommitResult, TaskPool
from peer.runtime.lead.resync import LaggardSync
from peer.runtime.lead.step import (  # re-exported: the coordinator's callers name them from here
    Event,
    OuterRoundFailedError,
    ReplanNeededError,
    StepFailedError,
    StepPhase,
    StepReport,
    StepState,
)
from peer.runtime.outer import is_round_end
from peer.runtime.spec import Assignment, RunSpec
from peer.runtime.wire import make_key
from peer.runtime.worker import state_envelope, state_from_envelope
from peer.timing import (
    ASSIGN_TIMEOUT_S,
    BROADCAST_POLL_S,
    CONTROL_SLACK_S,
    CONTROL_TIMEOUT_S,
    FETCH_STATE_TIMEOUT_S,
    HEARTBEAT_S,
    LEASE_FACTOR,
    LEASE_FLOOR_S,
    PING_MISSES,
    PING_RTT_FACTOR,
    PING_TIMEOUT_MAX_S,
    PING_TIMEOUT_S,
    SPECULATE_FACTOR,
    SPECULATE_FLOOR_S,
    SPECULATE_FORWARD_FACTOR,
    STATUS_TIMEOUT_S,
    STEP_TIMEOUT_S,
)
from protocol import tasklet_pb2 as pb
from protocol.errors import Forbidden, Rejected, TransportError

log = logging.getLogger(__name__)

COORDINATOR_ROUTE = "coordinator"  # a daemon's coordinator is served on its worker's port under this route
SAT_OUT_DECAY = 0.7  # a paced pipeline's carried seconds per micro-batch shrink by this for each step it sat out


class Coordinator(LaggardSync):
    """Drives a run over workers that have been given their assignments with :meth:`assign`."""

    def __init__(
        self,
        spec: RunSpec,
        host: str = "127.0.0.1",
        port: int = 0,
        liveness_interval_s: float = HEARTBEAT_S,
        *,
        host_server: PeerServer | None = None,
        public_endpoint: str | None = None,
        tls: TlsContext | None = None,
    ) -> None:
        """``host_server``: serve on that (started) server's port under the route "coordinator" instead of a
        port of our own (a peer daemon's worker server: one port per peer); ``public_endpoint``: that server's
        announced endpoint, which workers dial (the listen address may be 0.0.0.0). ``tls``: this peer's
        identity and trust (default: the host server's, else the process's own)."""
        self.spec = spec.validate()
        self.liveness_interval_s = liveness_interval_s
        host_tls = None if host_server is None else host_server.config.tls
        self.tls = tls or host_tls or process_tls()
        self.config = TransportConfig(
            host=host, port=port, max_concurrent_streams=48, thread_pool_size=64, max_streams_per_peer=16, tls=self.tls
        )
        self.server = PeerServer(self.config)
        self._host_server = host_server
        self._public_endpoint = public_endpoint
        self.server.register_fetch(pb.COMMIT, self._on_pool_request)
        self.server.register_fetch(pb.STAGE_STATE, self._on_state_request)
        self.server.register_push(pb.OTHER, self._on_report)
        self.server.set_push_admission(self._admit_push)
        self._cond = threading.Condition()
        self._state: StepState | None = None  # _cond
        self.assignments: dict[str, Assignment] = {}  # _cond; replaced whole by assign(), so a read sees one plan
        self._peer_ids: dict[str, str] = {}  # worker endpoint -> peer id (its certificate's); replaced with assignments
        self._dead: set[str] = set()  # _cond
        self.dead_reasons: dict[str, str] = {}  # _cond
        self.epoch = 0  # _cond
        self._clients: dict[str, PeerClient] = {}  # _clients_lock
        self._clients_lock = threading.Lock()
        self._checkpoint_states: dict[int, dict[str, Any]] = {}  # stage -> state; replaced whole
        # stragglers (peer.timing, "Stragglers"): measured lease-to-commit seconds (_cond), the plan's predicted
        # figure (set by the driver; None: unknown), each worker's round-trip time (moving average)
        self.mb_seconds: deque[float] = deque(maxlen=64)
        self.head_seconds: deque[float] = deque(maxlen=64)  # head-of-window to commit (TaskPool.head_latencies)
        self.forward_seconds: deque[float] = deque(maxlen=64)  # forward head to loss (TaskPool.forward_latencies)
        # laggards (module docstring): endpoint -> ((trained steps, params hash) it must reach, when told); _cond
        self._pending_sync: dict[str, tuple[tuple[int, str], float]] = {}
        self.predicted_mb_s: float | None = None
        self.speculation = True
        # (epoch, pipeline -> seconds per micro-batch) measured in the last step: paces the next step's leases
        self.pipeline_service_s: tuple[int, dict[int, float]] = (-1, {})
        self._rtt: dict[str, float] = {}
        self._pings: dict[str, Future[None]] = {}
        self._misses: dict[str, int] = {}
        self._pinger = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ping")
        self._stop = threading.Event()
        self._liveness = threading.Thread(target=self._liveness_loop, name="liveness", daemon=True)
        self._background = ThreadPoolExecutor(max_workers=8, thread_name_prefix="coordinator")
        # on_event(name, info): "lease", "commit", "reduce", "apply", "dead", "requeue" as they happen; called
        # without the coordinator's lock, must not block for long (tests use it to kill a worker at a chosen
        # moment, benchmarks to time recovery)
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None
        self._pool_handlers: dict[ctl.Op, Callable[[StepState, pb.Key, pb.Envelope], list[Event]]] = {
            ctl.Op.LEASE: self._on_lease,
            ctl.Op.COMMIT: self._on_commit,
        }
        # step reports: called with _cond held, on the running step
        self._step_reports: dict[ctl.Op, Callable[[StepState, pb.Key, str | None, Any], None]] = {
            ctl.Op.LOSS: self._on_loss,
            ctl.Op.REDUCED: self._on_reduced,
            ctl.Op.SYNCED: self._on_synced,
            ctl.Op.ERROR: self._on_error,
        }

    @property
    def endpoint(self) -> str:
        if self._public_endpoint is not None:
            return with_route(self._public_endpoint, COORDINATOR_ROUTE)
        return self.server.endpoint

    @property
    def dead(self) -> frozenset[str]:
        """Workers of the current plan declared dead (a snapshot)."""
        with self._cond:
            return frozenset(self._dead)

    def start(self) -> str:
        if self._host_server is not None:
            self._host_server.mount(COORDINATOR_ROUTE, self.server)
        else:
            self.server.start()
        self._liveness.start()
        return self.endpoint

    def close(self) -> None:
        self._stop.set()
        if self._liveness.is_alive():
            self._liveness.join(timeout=5.0)
        self._background.shutdown(wait=False, cancel_futures=True)
        self._pinger.shutdown(wait=False, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        self.server.stop(grace=0.5)

    def _client(self, endpoint: str) -> PeerClient:
        """A client to a worker, pinned to the certificate its assignment names (a new one if that changed)."""
        expect = self._peer_ids.get(endpoint, "")
        with self._clients_lock:
            client = self._clients.get(endpoint)
            if client is None or client.expect_peer != expect:
                if client is not None:
                    client.close()
                client = PeerClient(endpoint, self.config, sender="coordinator", expect_peer=expect)
                self._clients[endpoint] = client
            return client

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` in the background; after close() it is dropped (nothing is waiting for it)."""
        try:
            self._background.submit(fn, *args)
        except RuntimeError:  # the executor is shut down
            log.debug("coordinator closed; %s not run", getattr(fn, "__name__", fn))

    def _emit(self, events: Sequence[Event]) -> None:
        """Call the observer for each event; never with ``_cond`` held."""
        if self.on_event is None:
            return
        for name, info in events:
            try:
                self.on_event(name, info)
            except Exception:  # a broken observer must not break training
                log.exception("on_event(%s) failed", name)

    # ---------------------------------------------------------------------------------------------- assign
    def assign(
        self,
        assignments: dict[str, Assignment],
        sources: dict[str, ctl.StateSource] | None = None,
        timeout_s: float = ASSIGN_TIMEOUT_S,
    ) -> None:
        """Send every worker (by endpoint) its assignment and state source; wait until all accepted.

        A new plan starts with no dead workers (the driver left the dead ones out of it). ``sources[endpoint]``
        defaults to ``init`` at step 0. A worker that refuses or cannot be reached raises (the caller re-plans).
        """
        epochs = {a.epoch for a in assignments.values()}
        if len(epochs) != 1:
            raise ValueError(f"assignments carry several epochs {sorted(epochs)}")
        certificates = {ep: a.peers[ep] for ep, a in assignments.items() if ep in a.peers}
        self.tls.trust.set_group(f"plan:{id(self)}", certificates.values())
        with self._cond:
            self.epoch = epochs.pop()
            self._state = None
            self.assignments = dict(assignments)
            self._peer_ids = peer_ids(certificates)
            self._dead.clear()
            self.dead_reasons.clear()
            self._misses.clear()
            self._pending_sync.clear()  # the new plan's state sources say who holds what
        sources = {ep: self._granted(ep, a, src) for ep, src in (sources or {}).items() if (a := assignments.get(ep))}
        futures = {
            ep: self._client(ep).push_async(
                ctl.StageAssignment(self.spec, a, sources.get(ep, ctl.StateSource.init())).to_envelope(), timeout_s
            )
            for ep, a in assignments.items()
        }
        for ep, f in futures.items():
            try:
                f.result(timeout=timeout_s + CONTROL_SLACK_S)
            except TransportError as exc:
                self._confirm_death(ep, f"did not take its assignment: {exc}")
                raise ReplanNeededError(f"worker {ep} did not take its assignment: {exc}") from exc

    def _granted(self, endpoint: str, a: Assignment, source: ctl.StateSource) -> ctl.StateSource:
        """A fetch source with our signed permission for the worker at ``endpoint`` to read those layers (the
        source may not be in the new plan, so it cannot know the fetcher's role otherwise)."""
        if source.kind is not ctl.SourceKind.FETCH:
            return source
        peer = self._peer_ids.get(endpoint, self.tls.peer_id)
        return dataclasses.replace(source, grant=sign_grant(self.tls, self.spec.run_id, a.epoch, peer, a.layers))

    def serve_checkpoint(self, states: dict[int, dict[str, Any]]) -> None:
        """Serve these stage states (by stage index) to workers told to fetch from the coordinator."""
        self._checkpoint_states = dict(states)

    # ------------------------------------------------------------------------------------------ step loop
    def _intact(self, state: StepState) -> list[int]:
        """Pipelines whose every member is alive and that were not dropped from this step (``_cond`` held)."""
        n_rep = max((a.n_replicas for a in self.assignments.values()), default=0)
        broken = {a.replica for ep, a in self.assignments.items() if ep in self._dead} | state.dropped | state.syncing
        return [r for r in range(n_rep) if r not in broken]

    def _members(self, pipelines: Sequence[int], first: bool | None = None) -> list[str]:
        """Live workers of ``pipelines`` (only first stages, or only the others, when ``first`` is set)."""
        with self._cond:
            return [
                ep
                for ep, a in self.assignments.items()
                if a.replica in pipelines and ep not in self._dead and (first is None or a.is_first == first)
            ]

    def run_step(self, step: int, timeout_s: float = STEP_TIMEOUT_S) -> StepReport:
        """Run one step to the end (all intact pipelines' stages updated) and report it."""
        with self._cond:
            if not self.assignments:
                raise RuntimeError("assign() the workers first")
            mid_round = self.spec.sync_period > 1 and step % self.spec.sync_period != 0
            syncing = self._syncing_pipelines()  # may declare a laggard dead
            if self._dead and not (mid_round and self._alive_pipelines()):
                # DiLoCo mid-round: the pipelines that lost a member sit out the rest of the round (peer.runtime.outer)
                raise ReplanNeededError(f"step {step}: workers died since the plan was made: {sorted(self._dead)}")
            paced_by = self.pipeline_service_s[1] if self.pipeline_service_s[0] == self.epoch else None
            state = StepState(pool=TaskPool(step, self.spec.n_microbatches,
                                             lease_timeout_s=self._lease_timeout_s(timeout_s), service_s=paced_by))
            state.syncing = syncing
            self._state = state
            intact = self._intact(state)
            if not intact:
                raise ReplanNeededError(f"step {step}: no pipeline in sync (syncing: {sorted(state.syncing)})")
        started = time.monotonic()
        deadline = started + timeout_s
        self._broadcast(self._members(intact, first=False), ctl.StartStep(step, 0), step)
        self._broadcast(self._members(intact, first=True), ctl.StartStep(step, 0, feed=True), step)
        while True:
            self._wait(state, lambda: state.pool.complete(), deadline, f"step {step}: micro-batches")
            with self._cond:
                if not state.pool.complete():
                    continue
                state.phase, state.round, state.reduced = StepPhase.REDUCE, state.round + 1, set()
                state.pool.end_speculation()  # the stages settle what they hold apart: copies count no more
                intact, rnd = self._intact(state), state.round
                assignment = state.pool.assignment()
            if self.spec.sync_period > 1:  # DiLoCo inner step: every live pipeline applies its own share (maybe none)
                with self._cond:
                    intact = self._alive_pipelines()
            members = self._members(intact)
            self._emit([("reduce", {"step": step, "round": rnd, "participants": intact})])
            self._broadcast(members, ctl.Reduce(step, rnd, tuple(intact), assignment), step)
            expected = set(members)
            restarted = self._wait(
                state,
                lambda expected=expected: state.reduced >= expected,
                deadline,
                f"step {step}: gradient averaging",
                watch_round=rnd,
            )
            if not restarted:
                break
        with self._cond:
            state.phase = StepPhase.APPLY
        self._emit([("apply", {"step": step})])
        self._broadcast(members, ctl.Apply(step), step)
        self._wait(
            state,
            lambda: state.synced >= {m for m in members if m not in self._dead},
            deadline,
            f"step {step}: optimizer step",
            allow_failures=True,
        )
        outer: list[int] | None = None
        failed: StepFailedError | None = None
        if self.spec.sync_period == 1:
            self._check_replicas(state, step, [m for m in members if m not in self.dead], deadline)
            self._catch_up(state, step, [m for m in members if m not in self.dead])
        elif is_round_end(step, self.spec.sync_period):
            try:
                outer = self._outer_round(state, step, deadline)
            except StepFailedError as exc:
                failed = exc
        self.pipeline_service_s = (self.epoch, self._carry_service(state.pool.measured_service_s()))
        self.head_seconds.extend(state.pool.head_latencies)
        self.forward_seconds.extend(state.pool.forward_latencies)
        seconds = time.monotonic() - started
        losses = [state.losses.get((mb, p), math.nan) for mb, p in sorted(assignment.items())]
        counts: dict[int, int] = {}
        for p in assignment.values():
            counts[p] = counts.get(p, 0) + 1
        report = StepReport(step, sum(losses) / len(losses), seconds, counts, state.pool.requeued,
                            sorted(state.dropped), state.pool.speculated, state.pool.speculation_won,
                            dict(assignment), sorted(intact), outer)
        log.info(
            "step %d: loss %.4f in %.3f s (micro-batches per pipeline %s%s)",
            step,
            report.loss,
            seconds,
            counts,
            f", dropped pipelines {sorted(state.dropped)}" if state.dropped else "",
        )
        if failed is not None:
            raise OuterRoundFailedError(f"step {step}: the outer round failed: {failed}", report) from failed
        return report

    def _alive_pipelines(self) -> list[int]:
        """Pipelines none of whose members is dead (``_cond`` held)."""
        n_rep = max((a.n_replicas for a in self.assignments.values()), default=0)
        dead = {a.replica for ep, a in self.assignments.items() if ep in self._dead}
        return [r for r in range(n_rep) if r not in dead]

    def _outer_round(self, state: StepState, step: int, deadline: float) -> list[int]:
        """DiLoCo's outer round after inner step ``step`` (peer.runtime.outer): every live pipeline's replicas
        average their pseudo-gradients; only when every stage holds its average does anyone take the outer
        step (two-phase, as an apply). A death during the averaging restarts it without the dead member's
        pipeline; none left: re-plan. Returns the participants."""
        while True:
            with self._cond:
                participants = self._alive_pipelines()
                if not participants:
                    raise ReplanNeededError(f"step {step}: no pipeline left for the outer round")
                state.phase, state.round, state.reduced = StepPhase.OUTER, state.round + 1, set()
                rnd = state.round
            members = self._members(participants)
            self._emit([("outer", {"step": step, "round": rnd, "participants": participants})])
            self._broadcast(members, ctl.Reduce(step, rnd, tuple(participants), {}, outer=True), step)
            expected = set(members)
            with self._cond:
                done = self._cond.wait_for(
                    lambda expected=expected: state.reduced >= expected or bool(state.errors)
                    or bool(expected & self._dead),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if state.errors:
                    raise StepFailedError(f"step {step}: outer round: {state.errors[0]}")
                if not done:
                    raise StepFailedError(f"step {step}: outer round: timed out")
                if not expected & self._dead:
                    state.synced, state.hashes = set(), {}
                    break
            log.warning("step %d: a member of the outer round died; averaging again without its pipeline", step)
        self._emit([("apply", {"step": step, "outer": True})])
        self._broadcast(members, ctl.Apply(step, outer=True), step)
        self._wait(state, lambda: state.synced >= {m for m in members if m not in self._dead}, deadline,
                   f"step {step}: outer step", allow_failures=True)
        self._check_replicas(state, step, [m for m in members if m not in self.dead], deadline)
        return participants

    def _wait(
        self,
        state: StepState,
        ready: Callable[[], bool],
        deadline: float,
        what: str,
        watch_round: int | None = None,
        allow_failures: bool = False,
    ) -> bool:
        """Wait for ``ready``; handle deaths on the way. True when a death sent the step back to computing."""
        while True:
            events: list[Event] = []
            restarted = False
            with self._cond:
                if ready():
                    return False
                if state.errors:
                    raise StepFailedError(f"{what}: {state.errors[0]}")
                if state.phase is StepPhase.COMPUTE and (stuck := state.pool.unleasable(
                        set(self._intact(state)) | state.syncing)):
                    raise ReplanNeededError(f"{what}: micro-batches {stuck} were held by every pipeline left, whose "
                                            "stages refuse a repeat")
                broken = [] if allow_failures else self._drop_broken(state, events)
                if not allow_failures and not self._intact(state):  # also when a lease or commit dropped the last
                    raise ReplanNeededError(f"{what}: no intact pipeline left (dead: {sorted(self._dead)})")
                if broken and state.feeders_done:
                    # the feeders had stopped (pool complete): start them again, and abort any averaging
                    state.phase, state.feeders_done = StepPhase.COMPUTE, False
                    self._refeed(state)
                    restarted = watch_round is not None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepFailedError(f"{what}: timed out")
                if not events and not restarted:
                    self._cond.wait(min(left, 0.2))
            self._emit(events)
            if restarted:
                return True

    def _drop_broken(self, state: StepState, events: list[Event]) -> list[int]:
        """Drop from the step the pipelines with a dead member, a lease past its deadline, or a micro-batch a
        speculative copy won (``_cond`` held); return them."""
        state.pool.expire()
        dead = {a.replica for ep, a in self.assignments.items() if ep in self._dead}
        broken = sorted((dead | state.pool.failed() | set(state.pool.losers())) - state.dropped)
        for r in broken:
            why = ("lost a member" if r in dead else "is late with nothing committed; its work goes to the others"
                   if r in state.pool.abandoned else "was overtaken by a speculative copy"
                   if r in state.pool.losers() else "held a lease past its deadline")
            lost = state.pool.fail_pipeline(r)
            events.append(("requeue", {"step": state.pool.step, "pipeline": r, "microbatches": lost}))
            state.dropped.add(r)
            log.warning(
                "step %d: pipeline %d %s; %d micro-batches go back to the pool",
                state.pool.step,
                r,
                why,
                len(lost),
            )
            survivors = [ep for ep, a in self.assignments.items() if a.replica == r and ep not in self._dead]
            if survivors:
                self._submit(self._broadcast_quietly, survivors, ctl.DropStep(state.pool.step), state.pool.step)
        return broken

    def _refeed(self, state: StepState) -> None:
        """A new round for the intact pipelines: abort their averaging, restart their feeders (``_cond`` held).

        Called only when no micro-batch is in flight (the pool had been complete), so resetting the feeders'
        in-flight counts is safe. Non-first stages are told first, as at the start of a step.
        """
        state.round += 1
        intact, step, rnd = self._intact(state), state.pool.step, state.round

        def send() -> None:
            self._broadcast_quietly(self._members(intact, first=False), ctl.StartStep(step, rnd), step)
            self._broadcast_quietly(self._members(intact, first=True), ctl.StartStep(step, rnd, feed=True), step)

        self._submit(send)

    def _broadcast(self, endpoints: Sequence[str], msg: ctl.Message, step: int) -> None:
        """Send a control message to every endpoint; a worker that does not answer is checked for death.

        The wait for an answer ends early once liveness has declared the worker dead: a peer cut off while a
        ``start_step`` was on its way must not hold the step for the whole control timeout (30 s) when its
        pipeline is already out of the step."""
        with self._cond:
            epoch = self.epoch
        futures = {
            ep: self._client(ep).push_async(ctl.encode(msg, self.spec.run_id, epoch, step), CONTROL_TIMEOUT_S)
            for ep in endpoints
        }
        for ep, f in futures.items():
            give_up_at = time.monotonic() + CONTROL_TIMEOUT_S + CONTROL_SLACK_S
            while True:
                try:
                    f.result(timeout=max(0.0, min(BROADCAST_POLL_S, give_up_at - time.monotonic())))
                except TimeoutError:
                    with self._cond:
                        dead = ep in self._dead
                    if dead:
                        log.info("%s to %s: no answer yet, and it was declared dead; not waiting", msg.op.value, ep)
                    elif time.monotonic() < give_up_at:
                        continue
                    else:
                        self._confirm_death(ep, f"{msg.op.value}: no answer in {CONTROL_TIMEOUT_S:g} s")
                except TransportError as exc:
                    log.warning("%s to %s failed: %s", msg.op.value, ep, exc)
                    self._confirm_death(ep, f"{msg.op.value} failed: {exc}")
                break

    def _broadcast_quietly(self, endpoints: Sequence[str], msg: ctl.Message, step: int) -> None:
        try:
            self._broadcast(endpoints, msg, step)
        except Exception as exc:  # background notice; the step loop notices real failures itself
            log.info("%s broadcast: %s", msg.op.value, exc)

    # ------------------------------------------------------------------------------------------ liveness
    def declare_dead(self, endpoint: str, reason: str) -> None:
        """Exclude a worker for the rest of this plan (its pipeline is dropped from the running step)."""
        with self._cond:
            if endpoint in self._dead or endpoint not in self.assignments:
                return
            self._dead.add(endpoint)
            self.dead_reasons[endpoint] = reason
            log.warning("worker %s declared dead: %s", endpoint, reason)
            self._cond.notify_all()
        self._emit([("dead", {"endpoint": endpoint, "reason": reason})])

    def _alive(self, endpoint: str) -> bool:
        try:
            rtt = self._client(endpoint).ping(timeout_s=self.ping_timeout_s(endpoint))
        except TransportError:
            return False
        old = self._rtt.get(endpoint)
        self._rtt[endpoint] = rtt if old is None else 0.8 * old + 0.2 * rtt
        return True

    def _confirm_death(self, endpoint: str, reason: str) -> None:
        """Declare ``endpoint`` dead if it is a live worker of the plan and does not answer a ping."""
        with self._cond:
            candidate = endpoint in self.assignments and endpoint not in self._dead
        if candidate and not self._alive(endpoint):
            self.declare_dead(endpoint, reason)

    def _liveness_loop(self) -> None:
        """Ping every live worker each ``liveness_interval_s``; ``PING_MISSES`` misses in a row: dead."""
        while not self._stop.wait(self.liveness_interval_s):
            with self._cond:
                workers = [ep for ep in self.assignments if ep not in self._dead]
            for ep in workers:  # concurrently, one ping outstanding per worker (a slow one delays no other)
                pending = self._pings.get(ep)
                if pending is not None and not pending.done():
                    continue
                try:
                    self._pings[ep] = self._pinger.submit(self._liveness_check, ep)
                except RuntimeError:  # closed
                    return

    def _liveness_check(self, endpoint: str) -> None:
        """One ping; ``PING_MISSES`` misses in a row: dead (only this worker's one outstanding check writes its
        count)."""
        if self._alive(endpoint):
            self._misses[endpoint] = 0
            return
        self._misses[endpoint] = self._misses.get(endpoint, 0) + 1
        if self._misses[endpoint] >= PING_MISSES:
            self.declare_dead(endpoint, f"missed {self._misses[endpoint]} liveness checks")

    # ------------------------------------------------------------------------------------------- queries
    def stop_workers(self) -> None:
        """Ask every live worker to exit (best effort)."""
        with self._cond:
            workers, epoch = [ep for ep in self.assignments if ep not in self._dead], self.epoch
        for ep in workers:
            try:
                # as short as a status query: a worker that does not answer at once is gone or going
                self._client(ep).push(ctl.encode(ctl.Stop(), self.spec.run_id, epoch), timeout_s=STATUS_TIMEOUT_S)
            except Exception as exc:  # a worker that is already gone is fine
                log.info("stop %s: %s", ep, exc)

    def fetch_state(self, endpoint: str, timeout_s: float = FETCH_STATE_TIMEOUT_S) -> dict[str, Any]:
        """A worker's stage state (params, AdamW moments, step) as a plain dict of tensors and numbers."""
        a = self.assignments[endpoint]
        env = self._client(endpoint).fetch(
            pb.STAGE_STATE,
            make_key(self.spec.run_id, a.epoch, -1, stage=a.stage),
            meta={"layers": json.dumps(list(a.layers))},
            timeout_s=timeout_s,
        )
        return state_from_envelope(env)

    def live_states(
        self, *, every_replica: bool = False, at_step: int | None = None
    ) -> dict[tuple[int, int], dict[str, Any]]:
        """States of the live workers by (stage, replica): one per stage (the lowest replica that answers, at
        ``at_step`` when given), or with ``every_replica`` every live worker's (a failed fetch then raises).

        The one way checkpoints, the leader's final save and local runs read the trained stages.
        """
        with self._cond:
            workers = sorted(
                ((a.stage, a.replica, ep) for ep, a in self.assignments.items() if ep not in self._dead)
            )
        out: dict[tuple[int, int], dict[str, Any]] = {}
        done: set[int] = set()
        for stage, replica, ep in workers:
            if stage in done and not every_replica:
                continue
            try:
                state = self.fetch_state(ep)
            except Exception as exc:
                if every_replica:
                    raise
                log.warning("fetching stage %d from %s failed (%s); trying another replica", stage, ep, exc)
                continue
            if at_step is not None and state["step"] != at_step:
                log.info("%s holds stage %d at step %d, not %d", ep, stage, state["step"], at_step)
                continue
            out[(stage, replica)] = state
            done.add(stage)
        return out

    def copy_targets(self, n: int, exclude: Sequence[str] = ()) -> list[str]:
        """``n`` live workers of the plan to hold checkpoint copies, chosen for their links: the lowest measured
        round-trip time first (unmeasured ones last), never the leader's own endpoint."""
        own = {self._public_endpoint, self.server.endpoint if self._host_server is None else None}
        with self._cond:
            live = [ep for ep in self.assignments if ep not in self._dead and ep not in own and ep not in exclude]
        return sorted(live, key=lambda ep: (self._rtt.get(ep, math.inf), ep))[:n]

    def push_checkpoint(self, endpoint: str, step: int, files: dict[str, bytes], timeout_s: float) -> None:
        """Send one checkpoint copy (the worker stores and verifies it before it answers)."""
        with self._cond:
            epoch = self.epoch
        client = self._client(endpoint)
        for part in copy_parts(self.spec.run_id, epoch, step, files):  # bounded parts: any size fits the bounds
            client.push(part, timeout_s=timeout_s)

    def checkpoint_step(self, endpoint: str, timeout_s: float = STATUS_TIMEOUT_S) -> int:
        """The step of the newest checkpoint copy ``endpoint`` holds (nothing else is sent)."""
        with self._cond:
            epoch = self.epoch
        env = self._client(endpoint).fetch(pb.CHECKPOINT, make_key(self.spec.run_id, epoch, -1),
                                           meta={"probe": "1"}, timeout_s=timeout_s)
        try:
            return int(env.meta.get("step", ""))
        except ValueError:
            raise Rejected(f"{endpoint} answered a checkpoint probe without a step") from None

    def fetch_checkpoint(self, endpoint: str, timeout_s: float = FETCH_STATE_TIMEOUT_S) -> tuple[int, dict[str, bytes]]:
        """The newest checkpoint copy ``endpoint`` holds for this run (files, not yet verified here)."""
        with self._cond:
            epoch = self.epoch
        client, key = self._client(endpoint), make_key(self.spec.run_id, epoch, -1)
        return fetch_copy_files(lambda meta: client.fetch(pb.CHECKPOINT, key, meta=meta, timeout_s=timeout_s),
                                copy_bound_bytes(self.spec.model))

    def worker_status(self, endpoint: str, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
        return self._client(endpoint).status(timeout_s=timeout_s)

    # ------------------------------------------------------------------------------------------- handlers
    def _on_pool_request(self, request: pb.FetchRequest) -> pb.Envelope:
        op = ctl.op_of(request, ctl.POOL_OPS)
        key = request.key
        self._require_member(request.sender, key.stage, key.replica, f"a {op.value}")
        reply = pb.Envelope(kind=pb.COMMIT, key=key)
        with self._cond:
            state = self._state
            if (
                state is None
                or key.step != state.pool.step
                or key.run_id != self.spec.run_id
                or key.epoch != self.epoch
            ):
                reply.meta["status"] = ctl.PoolStatus.WAIT.value
                return reply
            events = self._pool_handlers[op](state, key, reply)
        self._emit(events)
        return reply

    def _on_lease(self, state: StepState, key: pb.Key, reply: pb.Envelope) -> list[Event]:
        if state.pool.complete():
            reply.meta["status"] = ctl.PoolStatus.DONE.value
            state.feeders_done = True
            return []
        if key.replica in state.syncing:  # not in sync (a start_step of before it was dropped): no work
            reply.meta["status"] = ctl.PoolStatus.WAIT.value
            return []
        mb = state.pool.lease(key.replica, *self._speculate_after_s())
        events: list[Event] = []
        if state.pool.losers():  # a pipeline given up on (TaskPool.abandoned): its work goes back to the pool now
            self._drop_broken(state, events)
            self._cond.notify_all()
            if mb is None:
                mb = state.pool.lease(key.replica, *self._speculate_after_s())
        if mb is None:
            reply.meta["status"] = ctl.PoolStatus.WAIT.value
            return events
        reply.meta["status"] = ctl.PoolStatus.LEASE.value
        reply.key.microbatch = mb
        speculative = state.pool.is_speculative(mb, key.replica)
        if speculative:
            reply.meta[ctl.SPECULATIVE_META] = "1"
            log.info("step %d: micro-batch %d copied to pipeline %d (a straggler holds it)",
                     key.step, mb, key.replica)
        state.leased_at[(mb, key.replica)] = time.monotonic()
        return [*events, ("lease", {"step": key.step, "microbatch": mb, "pipeline": key.replica,
                                    "speculative": speculative})]

    def _on_commit(self, state: StepState, key: pb.Key, reply: pb.Envelope) -> list[Event]:
        result = state.pool.commit(key.microbatch, key.replica)
        reply.meta["status"] = result.value  # CommitResult values are PoolStatus values
        leased = state.leased_at.get((key.microbatch, key.replica))
        if result is CommitResult.COMMITTED and leased is not None:
            self.mb_seconds.append(time.monotonic() - leased)
        events: list[Event] = []
        if state.pool.losers():  # the original holder of a micro-batch a copy won has it in its sum: drop it now,
            self._drop_broken(state, events)  # before the pool can look complete with its commits in it
        self._cond.notify_all()
        info = {"step": key.step, "microbatch": key.microbatch, "pipeline": key.replica, "result": result.value}
        return [("commit", info), *events]

    # ------------------------------------------------------------------------------------------ stragglers
    def _carry_service(self, measured: dict[int, float]) -> dict[int, float]:
        """The pacing figures for the next step: this step's measurement, and for a pipeline of the same plan
        that sat the step out (paced: it leased nothing) its previous figure, shrunk by ``SAT_OUT_DECAY``.
        Forgetting the figure would hand a 5x-slow pipeline work again the very next step (every other step
        slow); keeping it for ever would shut out for the whole plan a pipeline that was slow once (a warm-up).
        """
        epoch, previous = self.pipeline_service_s
        if epoch != self.epoch:
            return dict(measured)
        carried = {p: s * SAT_OUT_DECAY for p, s in previous.items() if p not in measured}
        return {**carried, **measured}

    def _expected_mb_s(self) -> float | None:
        """Expected lease-to-commit seconds of a micro-batch: the median measured, else the plan's figure."""
        if len(self.mb_seconds) >= 3:
            return statistics.median(self.mb_seconds)
        return self.predicted_mb_s

    def _lease_timeout_s(self, step_timeout_s: float) -> float:
        expected = self._expected_mb_s()
        if expected is None:
            return step_timeout_s
        return min(step_timeout_s, max(LEASE_FLOOR_S, LEASE_FACTOR * expected))

    def _speculate_after_s(self) -> tuple[float | None, float | None]:
        """How long a pipeline's head micro-batch may be held before the pool copies its work (TaskPool): a
        factor x the 80th percentile of the head latencies measured in earlier steps (else the plan's predicted
        figure), over a floor; and the same for the wait of its oldest micro-batch without a loss (forward
        latencies; None until 3 are measured). Not the median: a step's first micro-batch of each pipeline
        crosses every stage before it commits (2x a later, pipelined one here), and a healthy pipeline's first
        micro-batch is no straggler. Nor, before a step has ended, the lease-to-commit times measured so far:
        in a plan's first step they come from its fastest pipelines, and a healthy pipeline on longer links was
        given up on against them (CI, the headline bench's step 0)."""
        expected = (statistics.quantiles(self.head_seconds, n=5)[-1] if len(self.head_seconds) >= 3
                    else self.predicted_mb_s)
        if expected is None or not self.speculation:
            return None, None
        forward = (max(SPECULATE_FLOOR_S,
                           SPECULATE_FORWARD_FACTOR * statistics.quantiles(self.forward_seconds, n=5)[-1])
                   if len(self.forward_seconds) >= 3 else None)
        return max(SPECULATE_FLOOR_S, SPECULATE_FACTOR * expected), forward

    def ping_timeout_s(self, endpoint: str) -> float:
        """A ping's deadline for ``endpoint``: its measured RTT times a factor, plus its largest message on its
        slowest known link (a ping queued behind that transfer is late, not lost); see peer.timing."""
        a = self.assignments.get(endpoint)
        transfer = 0.0
        if a is not None and a.links:
            slowest = min((rate for rate, _ in a.links.values() if rate > 0), default=0.0)
            if slowest:
                transfer = 8.0 * self._largest_message_bytes(a) / slowest
        rtt = self._rtt.get(endpoint, 0.0)
        return min(PING_TIMEOUT_MAX_S, max(PING_TIMEOUT_S, PING_RTT_FACTOR * rtt + transfer))

    def _largest_message_bytes(self, a: Assignment) -> float:
        """An activation, or a gradient shard of the stage (about 12 d^2 parameters a layer, fp32)."""
        m = self.spec.model
        hidden = self.spec.micro_batch * m.seq_len * m.d_model * 4
        shard = 12 * m.d_model * m.d_model * (a.layers[1] - a.layers[0]) * 4 / max(1, a.n_replicas)
        return max(hidden, shard)

    def _on_state_request(self, request: pb.FetchRequest) -> pb.Envelope:
        with self._cond:
            holders = [ep for ep, a in self.assignments.items() if a.stage == request.key.stage]
        if not any(self._peer_of(ep) == request.sender for ep in holders) and request.sender != self.tls.peer_id:
            raise Forbidden(
                f"a checkpoint of stage {request.key.stage} is served only to a peer the plan gives that stage; "
                f"peer {request.sender} is not"
            )
        state = self._checkpoint_states.get(request.key.stage)
        if state is None:
            raise Rejected(f"the coordinator serves no checkpoint of stage {request.key.stage}")
        return state_envelope(state, self.spec.run_id, self.epoch, request.key.stage)

    def _admit_push(self, kind: int, caller: str) -> int:
        """Only workers of the plan push to the coordinator (reports), and only small messages."""
        if caller != self.tls.peer_id and caller not in self._peer_ids.values():
            raise Forbidden(f"the coordinator takes reports only from workers of its plan; peer {caller} is not one")
        return CONTROL_BYTES if kind == pb.OTHER else 0

    def _peer_of(self, endpoint: str | None) -> str | None:
        """The peer id of a worker of the plan (this process's own when its assignment carried no certificate)."""
        return None if endpoint is None else self._peer_ids.get(endpoint, self.tls.peer_id)

    def _require_member(self, caller: str, stage: int, replica: int, what: str) -> str:
        """The endpoint of (stage, replica) in the plan, if ``caller`` is the peer there; else Forbidden."""
        endpoint = self._endpoint_of(stage, replica)
        if endpoint is None or self._peer_of(endpoint) != caller:
            raise Forbidden(
                f"{what} for stage {stage} of pipeline {replica} is taken only from the worker the plan puts "
                f"there; peer {caller} is not"
            )
        return endpoint

    def _endpoint_of(self, stage: int, replica: int) -> str | None:
        with self._cond:
            for ep, a in self.assignments.items():
                if a.stage == stage and a.replica == replica:
                    return ep
        return None

    def _on_report(self, env: pb.Envelope) -> None:
        msg = ctl.decode(env, ctl.REPORTS)
        with self._cond:
            epoch = self.epoch
        if env.key.epoch != epoch:
            raise Rejected(f"report of epoch {env.key.epoch}, the plan is at epoch {epoch}")
        sender = self._require_member(env.sender, env.key.stage, env.key.replica, f"a {msg.op.value} report")
        if isinstance(msg, ctl.PeerError):
            self._submit(self._confirm_death, msg.endpoint, f"reported by {sender}")
            return
        if isinstance(msg, ctl.BadPeer):
            culprit = self._endpoint_of(msg.stage, msg.replica)
            with self._cond:
                mine = self.assignments.get(sender)
            # only a peer that receives data from the culprit can have seen it misbehave
            if culprit is not None and mine is not None and culprit not in (mine.prev, mine.next, *mine.group):
                raise Forbidden(f"stage {msg.stage} of pipeline {msg.replica} sends nothing to {sender}")
            if culprit is not None and culprit != sender:
                self.declare_dead(culprit, f"sent malformed data to {sender}: {msg.error}")
            return
        if isinstance(msg, ctl.Synced) and self._on_caught_up(sender, msg):
            return
        with self._cond:
            state = self._state
            if state is None or env.key.step != state.pool.step:
                raise Rejected(f"report for step {env.key.step}, which is not running")
            self._step_reports[msg.op](state, env.key, sender, msg)
            self._cond.notify_all()

    def _on_loss(self, state: StepState, key: pb.Key, sender: str | None, msg: ctl.Loss) -> None:
        state.losses[(msg.microbatch, key.replica)] = msg.loss
        a = self.assignments.get(sender or "")
        if a is not None and a.is_last:
            state.pool.progress(msg.microbatch, key.replica)  # its forward crossed every stage (stragglers)

    def _on_reduced(self, state: StepState, key: pb.Key, sender: str | None, msg: ctl.Reduced) -> None:
        if msg.round == state.round and sender is not None:
            state.reduced.add(sender)

    def _on_synced(self, state: StepState, key: pb.Key, sender: str | None, msg: ctl.Synced) -> None:
        if sender is not None:
            state.synced.add(sender)
            if msg.params_hash:
                state.hashes[sender] = (msg.trained_steps, msg.params_hash)

    def _on_error(self, state: StepState, key: pb.Key, sender: str | None, msg: ctl.TaskError) -> None:
        if key.replica in state.dropped or key.replica in state.syncing or sender in self._dead:
            log.info("ignoring an error from dropped or syncing pipeline %d: %s", key.replica, msg)
            return
        log.error("worker stage %d replica %d: %s", key.stage, key.replica, msg)
        self._submit(self._judge_error, sender, msg)

    def _judge_error(self, sender: str | None, msg: ctl.TaskError) -> None:
        """A worker's task failed. If the step can still finish it will (a missing message shows up as a
        death elsewhere); an error during averaging or apply with everyone alive is fatal for the step.
        Waits one liveness interval first, so that a sender that is dying is noticed as dead instead."""
        time.sleep(self.liveness_interval_s)
        with self._cond:
            state = self._state
            if state is None or sender in self._dead:
                return
            if msg.what in ("reduce", "apply") and state.phase is not StepPhase.COMPUTE:
                state.errors.append(f"{sender}: {msg.error}")
                self._cond.notify_all()
