"""The coordinator: the leader's shell around the step machine. Assigns tasklets, serves the task pool and the
workers' reports over gRPC, carries out the machine's commands, and serves stage states and checkpoints.

It is the only place with global knowledge of a step, and deliberately holds little else: no parameters, no
activations. Its messages are small (leases, commits, one loss per micro-batch), so it does not need a fast
link; in a local swarm it runs unshaped in the launching process.

What a step does, and when, is the :class:`peer.runtime.lead.machine.StepMachine`'s (its module docstring has
the phases). This shell turns gRPC calls into the machine's events (lease, commit, loss, reduced, synced,
error; a death from :class:`peer.runtime.lead.liveness.Liveness`), carries out the commands that come back
(broadcasts, observer events, the end of the step) and wakes the machine with ``tick`` whenever something
changed or 0.2 s passed. After an apply, :class:`peer.runtime.lead.resync.Resync` compares the replicas and
has the laggards reload their stage; :class:`peer.runtime.lead.pacing.Pacing` keeps what the steps measured
for the next one's leases and speculation.

Threads and locks. ``_cond`` (a condition) guards the machine, the roster and the epoch; the step loop waits
on it. The helpers own their state under locks of their own (the dead set is the liveness's, the laggards the
resync's), leaves taken under ``_cond`` and never the other way round. The observer (``on_event``) is never
called while ``_cond`` is held: commands are collected under the lock and carried out after. A broadcast the
step waits for (start, reduce, apply) runs on the step loop's thread; background work (drop notices, restarts,
confirming a reported death) runs on one executor, shut down by :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.endpoint import with_route
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext, peer_ids, process_tls
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.bounds import CONTROL_BYTES
from tasklet.peer.runtime.grants import sign_grant
from tasklet.peer.runtime.lead.liveness import Liveness
from tasklet.peer.runtime.lead.machine import Command, Done, Emit, Fail, Send, Spot, StepMachine
from tasklet.peer.runtime.lead.pacing import Pacing
from tasklet.peer.runtime.lead.referee import Referee, Verdict, set_aside, witnesses
from tasklet.peer.runtime.lead.resync import SYNC_LIMIT_S, Resync
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.states import StageStates
from tasklet.peer.runtime.lead.step import (
    Event,
    OuterInFlight,
    OuterRoundFailedError,
    ReplanNeededError,
    StepFailedError,
    StepReport,
)
from tasklet.peer.runtime.lead.verify import MAX_LOSS, Verification, check_loss
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.timing import (
    ASSIGN_RETRY_HEARTBEATS,
    ASSIGN_TIMEOUT_S,
    BROADCAST_POLL_S,
    CONTROL_SLACK_S,
    CONTROL_TIMEOUT_S,
    HEARTBEAT_S,
    STATUS_TIMEOUT_S,
    STEP_TIMEOUT_S,
)
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Forbidden, PeerUnreachable, Refused, Rejected, TransportError

# the step's outcomes, named from here by the coordinator's callers (driver, local swarm, benchmarks)
__all__ = ["COORDINATOR_ROUTE", "MAX_LOSS", "Coordinator", "OuterRoundFailedError", "ReplanNeededError",
           "StepFailedError", "StepReport", "check_loss"]

log = logging.getLogger(__name__)

COORDINATOR_ROUTE = "coordinator"  # a daemon's coordinator is served on its worker's port under this route
WAKE_S = 0.2  # the step loop ticks the machine at least this often (deadlines, leases, errors to judge)
MAX_EXCLUSIONS = 1024  # exclusions kept until the leader takes them (bounded whatever a swarm reports)


class Coordinator:
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
        host_tls = None if host_server is None else host_server.config.tls
        self.tls = tls or host_tls or process_tls()
        self.config = TransportConfig(
            host=host, port=port, max_concurrent_streams=48, thread_pool_size=64, max_streams_per_peer=16, tls=self.tls
        )
        self.server = PeerServer(self.config)
        self._host_server = host_server
        self._public_endpoint = public_endpoint
        for kind in ctl.POOL_KINDS.values():
            self.server.register_fetch(kind, self._on_pool_request)
        self.server.register_push(pb.CONTROL, self._on_report)
        self.server.set_push_admission(self._admit_push)
        self._cond = threading.Condition()
        self._machine: StepMachine | None = None  # _cond: the running (or last) step
        self._carry: OuterInFlight | None = None  # _cond: an overlapped outer round, for the next step to land
        self.roster = Roster()  # _cond; replaced whole by assign(), so a read sees one plan
        self.epoch = 0  # _cond
        # the leader's signed record of the steps trained so far, sent with every start_step (peer.node.step_record)
        self.step_record = ""  # set between steps by note_trained (the driver's thread, which runs the steps)
        self._clients: dict[str, PeerClient] = {}  # _clients_lock
        self._clients_lock = threading.Lock()
        self._background = ThreadPoolExecutor(max_workers=8, thread_name_prefix="coordinator")
        self.pacing = Pacing()  # measured and predicted micro-batch times, speculation on or off
        self.liveness = Liveness(liveness_interval_s, self._ping, self.declare_dead, self.spec.model,
                                 self.spec.micro_batch)
        self.states = StageStates(self.spec, self._plan, self._client, self.tls.peer_id)
        self.resync = Resync(self.spec.run_id, self._cond, self.liveness, self._client, self._submit, self._emit,
                             fetch=self.states.fetch_state, own=lambda ep: self._who(ep) == self.tls.peer_id)
        self.server.register_fetch(pb.STAGE_STATE, self.states.on_state_request)
        st = self.states  # stage states and checkpoint copies (peer.runtime.lead.states), as the coordinator's own API
        self.serve_checkpoint, self.fetch_state, self.live_states = st.serve_checkpoint, st.fetch_state, st.live_states
        self.push_checkpoint, self.checkpoint_step, self.fetch_checkpoint = (
            self.states.push_checkpoint, self.states.checkpoint_step, self.states.fetch_checkpoint)
        # on_event(name, info), as they happen (lease commit reduce apply outer dead requeue resync disputed divergent)
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None
        self._exclusions: deque[tuple[int, str, str]] = deque(maxlen=MAX_EXCLUSIONS)  # (epoch, id, reason): credit
        self.referee = Referee(own=self.tls.peer_id)  # weighs bad-peer reports: testimony excludes nobody (_cond)
        self.verification = Verification(self.spec, self._who, self.declare_dead, self._refer, self.tls.peer_id)

    @property
    def endpoint(self) -> str:
        if self._public_endpoint is not None:
            return with_route(self._public_endpoint, COORDINATOR_ROUTE)
        return self.server.endpoint

    @property
    def assignments(self) -> dict[str, Assignment]:
        """The current plan's assignments by worker endpoint."""
        return self.roster.assignments

    @property
    def dead(self) -> frozenset[str]:
        """Workers of the current plan declared dead (a snapshot)."""
        return self.liveness.dead_now()

    @property
    def dead_reasons(self) -> dict[str, str]:
        """Why each dead worker of the current plan was declared dead."""
        return self.liveness.reasons()

    def _plan(self) -> tuple[Roster, int, frozenset[str]]:
        """The current plan: (roster, epoch, dead workers), read together."""
        with self._cond:
            return self.roster, self.epoch, self.liveness.dead_now()

    def start(self) -> str:
        if self._host_server is not None:
            self._host_server.mount(COORDINATOR_ROUTE, self.server)
        else:
            self.server.start()
        self.liveness.start()
        return self.endpoint

    def close(self) -> None:
        self.liveness.close()
        self._background.shutdown(wait=False, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        self.server.stop(grace=0.5)

    def _client(self, endpoint: str) -> PeerClient:
        """A client to a worker, pinned to the certificate its assignment names (a new one if that changed)."""
        expect = self.roster.peer_ids.get(endpoint, "")
        with self._clients_lock:
            client = self._clients.get(endpoint)
            if client is None or client.expect_peer != expect:
                if client is not None:
                    client.close()
                client = PeerClient(endpoint, self.config, sender="coordinator", expect_peer=expect)
                self._clients[endpoint] = client
            return client

    def _ping(self, endpoint: str, timeout_s: float) -> float:
        return self._client(endpoint).ping(timeout_s=timeout_s)

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
    def assign(self, assignments: dict[str, Assignment], sources: dict[str, ctl.StateSource] | None = None,
               timeout_s: float = ASSIGN_TIMEOUT_S) -> None:
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
            self._machine = None
            self._carry = None  # a round in flight does not survive a new plan (peer.runtime.outer, "Overlap")
            self.roster = Roster(dict(assignments), peer_ids(certificates))
            self.liveness.reset(self.roster.assignments)
            self.resync.new_plan()
        sources = {ep: self._granted(ep, a, src) for ep, src in (sources or {}).items() if (a := assignments.get(ep))}
        envelopes = {ep: ctl.StageAssignment(self.spec, a, sources.get(ep, ctl.StateSource.init())).to_envelope()
                     for ep, a in assignments.items()}
        deadline = time.monotonic() + timeout_s
        futures = {ep: self._client(ep).push_async(env, timeout_s) for ep, env in envelopes.items()}
        for ep, f in futures.items():
            try:
                f.result(timeout=timeout_s + CONTROL_SLACK_S)
            except TransportError as exc:
                last = send_again(lambda env, t, ep=ep: self._client(ep).push(env, timeout_s=t), envelopes[ep], exc,
                                  self.liveness.interval_s, deadline)
                if last is not None:  # a worker that keeps following another leader is out as a dead one
                    again = self.liveness.refused_again(ep, getattr(last, "code", "") == "PERMISSION_DENIED")
                    (self.declare_dead if again else self.liveness.confirm)(ep, f"refused: {last}")
                    raise ReplanNeededError(f"worker {ep} did not take its assignment: {last}") from last

    def _granted(self, endpoint: str, a: Assignment, source: ctl.StateSource) -> ctl.StateSource:
        """A fetch source with our signed permission for the worker at ``endpoint`` to read those layers (the
        source may not be in the new plan, so it cannot know the fetcher's role otherwise)."""
        if source.kind is not ctl.SourceKind.FETCH:
            return source
        peer = self.roster.peer_ids.get(endpoint, self.tls.peer_id)
        return dataclasses.replace(source, grant=sign_grant(self.tls, self.spec.run_id, a.epoch, peer, a.layers))

    # ------------------------------------------------------------------------------------------ step loop
    def note_trained(self, record: str) -> None:
        """The leader's signed record of the steps trained so far: every start_step from now on carries it."""
        self.step_record = record

    def run_step(self, step: int, timeout_s: float = STEP_TIMEOUT_S, overlap: bool = False) -> StepReport:
        """Run one step to the end (all intact pipelines' stages updated) and report it. ``overlap``: a round-end
        step hands its outer round on, to land after the next step (:meth:`land_outer` lands it at once)."""
        with self._cond:
            if not self.roster.assignments:
                raise RuntimeError("assign() the workers first")
            in_flight, self._carry = self._carry, None
            now, roster, epoch = time.monotonic(), self.roster, self.epoch
            syncing = self.resync.syncing_pipelines(roster, now)  # may declare a laggard dead
            lease_timeout_s = self.pacing.lease_timeout_s(timeout_s)
            machine = StepMachine(
                step, roster, self.spec.n_microbatches, now=now, timeout_s=timeout_s, lease_timeout_s=lease_timeout_s,
                sync_period=self.spec.sync_period,
                dead=sorted(self.liveness.dead_now()), syncing=syncing, service_s=self.pacing.service_s(epoch),
                speculate_after=self.pacing.speculate_after_s(), judge_after_s=self.liveness.interval_s,
                spot=self.verification.checks(step, roster, lease_timeout_s), overlap=overlap, in_flight=in_flight,
                record=self.step_record)
            self._machine = machine
            commands = machine.start()
        return self._drive(machine, commands, roster, epoch, step)

    def land_outer(self, timeout_s: float = STEP_TIMEOUT_S) -> StepReport | None:
        """Land the overlapped outer round in flight now (every replica at the new anchor: before a re-plan, a
        checkpoint, the run's end); None when none is in flight. Its report's ``outer``: the participants."""
        with self._cond:
            in_flight, self._carry = self._carry, None
            if in_flight is None:
                return None
            now, roster, epoch = time.monotonic(), self.roster, self.epoch
            machine = StepMachine(
                in_flight.step, roster, self.spec.n_microbatches, now=now, timeout_s=timeout_s,
                lease_timeout_s=self.pacing.lease_timeout_s(timeout_s), sync_period=self.spec.sync_period,
                dead=sorted(self.liveness.dead_now()), judge_after_s=self.liveness.interval_s, in_flight=in_flight,
                land_only=True)
            self._machine = machine
            commands = machine.start()
        return self._drive(machine, commands, roster, epoch, in_flight.step)

    def drop_outer(self) -> None:
        """Forget an overlapped outer round in flight (a re-plan: the workers' new assignments drop it too)."""
        with self._cond:
            self._carry = None

    def _drive(self, machine: StepMachine, commands: list[Command], roster: Roster, epoch: int,
               step: int) -> StepReport:
        """Carry the machine's commands out and tick it until its step is done; check the replicas; report."""
        while (done := self._carry_out(machine, commands)) is None:
            with self._cond:
                while not (commands := machine.tick(time.monotonic())):
                    self._cond.wait(max(0.001, min(WAKE_S, machine.deadline - time.monotonic())))
        hashes = machine.state.hashes
        live = [m for m in done.members if m not in self.dead]
        digests = self.resync.check_replicas(roster, epoch, step, live, hashes, machine.deadline) if done.check else {}
        if done.catch_up:
            with self._cond:
                left_out = machine.state.dropped | machine.state.syncing
            live = [m for m in done.members if m not in self.dead]  # again: the check may have found the dead
            self.resync.catch_up(roster, epoch, step, live, left_out, hashes)
        with self._cond:
            machine.tick(time.monotonic())
            report = dataclasses.replace(machine.report(), stage_hashes=digests)
            self.verification.applied(step, roster, report.commits, machine.spot)
            applied = {self._who(ep) for ep in roster.members(report.applied)}
            verdict = self.referee.vindicate(applied, step)  # their work passed every other witness's checks
        if verdict.reason:
            log.warning("step %d: %s", step, verdict.reason)
        with self._cond:
            self._carry = machine.carry
        if not machine.land_only:
            self._finish(epoch, machine, report)
        return report

    def _finish(self, epoch: int, machine: StepMachine, report: StepReport) -> None:
        """The step's measurements go to pacing, its summary to the log."""
        self.pacing.record(epoch, machine.pool)
        log.info("step %d: loss %.4f in %.3f s (micro-batches per pipeline %s%s)", report.step, report.loss,
                 report.seconds, report.microbatches_per_pipeline,
                 f", dropped pipelines {report.dropped_pipelines}" if report.dropped_pipelines else "")

    def _carry_out(self, machine: StepMachine, commands: Sequence[Command]) -> Done | None:
        """Carry out the machine's commands in order (never with ``_cond`` held): the step's end, or None."""
        for c in commands:
            if isinstance(c, Emit):
                self._emit([(c.name, c.info)])
            elif isinstance(c, Send) and c.wait:
                self._broadcast(c.endpoints, c.msg, machine.step)
            elif isinstance(c, Send):
                self._submit(self._send_later, machine, c)
            elif isinstance(c, Fail):
                if isinstance(c.error, OuterRoundFailedError):  # the inner step stands: it counts as a step
                    self._finish(self.epoch, machine, c.error.report)
                raise c.error
            elif isinstance(c, Spot):
                self.verification.act(self.roster, machine.step, c.finding)
            elif isinstance(c, Done):
                return c
        return None

    def _send_later(self, machine: StepMachine, send: Send) -> None:
        """A background send (drop notices, a restarted attempt, a pipeline rejoining), then what follows it."""
        try:
            self._broadcast(send.endpoints, send.msg, machine.step)
        except Exception as exc:  # background notice; the step loop notices real failures itself
            log.info("%s broadcast: %s", send.msg.op.value, exc)
        if send.rejoin is not None and isinstance(send.msg, ctl.StartStep):
            with self._cond:
                commands = machine.rejoined(send.rejoin, send.msg.attempt)
            self._carry_out(machine, commands)
        if send.then is not None:
            self._send_later(machine, send.then)

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
                        dead = self.liveness.is_dead(ep)
                    if dead:
                        log.info("%s to %s: no answer yet, and it was declared dead; not waiting", msg.op.value, ep)
                    elif time.monotonic() < give_up_at:
                        continue
                    else:
                        self.liveness.confirm(ep, f"{msg.op.value}: no answer in {CONTROL_TIMEOUT_S:g} s")
                except TransportError as exc:
                    log.warning("%s to %s failed: %s", msg.op.value, ep, exc)
                    self.liveness.confirm(ep, f"{msg.op.value} failed: {exc}")
                break

    def declare_dead(self, endpoint: str, reason: str) -> None:
        """Exclude a worker for the rest of this plan (its pipeline is dropped from the running step)."""
        with self._cond:
            if not self.liveness.mark(endpoint, reason):
                return
            if self._machine is not None:
                self._machine.died(endpoint)
            self._exclusions.append((self.epoch, self._who(endpoint), reason))
            self._cond.notify_all()
        self._emit([("dead", {"endpoint": endpoint, "reason": reason})])

    def take_exclusions(self) -> list[tuple[int, str, str]]:
        """(plan epoch, identity, reason) of the workers excluded since the last call (the newest ones)."""
        with self._cond:
            out = list(self._exclusions)
            self._exclusions.clear()
        return out

    def wait_in_sync(self, timeout_s: float = SYNC_LIMIT_S) -> bool:
        """Wait until no laggard is left reloading its stage (the end of a run, before its states are read)."""
        with self._cond:
            return self._cond.wait_for(self.resync.in_sync, timeout=timeout_s)

    # ------------------------------------------------------------------------------------------- handlers
    def _on_pool_request(self, request: pb.FetchRequest) -> pb.Envelope:
        op = ctl.op_of(request, ctl.POOL_OPS)
        key = request.key
        endpoint = self.roster.member(request.sender, key.stage, key.replica, f"a {op.value}", self.tls.peer_id)
        a = self.roster.assignments.get(endpoint)
        if a is None or not a.is_first:  # only the head of a pipeline feeds it and knows when its backward ended
            raise Forbidden(f"a {op.value} is taken only from the first stage of a pipeline; "
                            f"peer {request.sender} holds stage {key.stage}")
        with self._cond:
            machine = self._machine
            if machine is None or key.step != machine.step or key.run_id != self.spec.run_id or key.epoch != self.epoch:
                return ctl.pool_reply(request.kind, key, ctl.PoolStatus.WAIT)
            if op is ctl.Op.LEASE:
                answer = machine.lease(key.replica, time.monotonic())
            else:
                answer = machine.commit(key.microbatch, key.replica, time.monotonic())
                if answer.seconds is not None:
                    self.pacing.mb_seconds.append(answer.seconds)
            self._cond.notify_all()
        reply_key = pb.Key()  # a lease names its micro-batch in the key
        reply_key.CopyFrom(key)
        if answer.status is ctl.PoolStatus.LEASE and answer.microbatch is not None:
            reply_key.microbatch = answer.microbatch
        reply = ctl.pool_reply(request.kind, reply_key, answer.status, bool(answer.speculative))
        self._carry_out(machine, answer.commands)
        return reply

    def _on_report(self, env: pb.Envelope) -> None:
        msg = ctl.decode(env, ctl.REPORTS)
        with self._cond:
            epoch, roster = self.epoch, self.roster
        if env.key.epoch != epoch:
            raise Rejected(f"report of epoch {env.key.epoch}, the plan is at epoch {epoch}")
        sender = self.roster.member(env.sender, env.key.stage, env.key.replica, f"a {msg.op.value} report",
                                    self.tls.peer_id)
        if isinstance(msg, ctl.Loss):
            self.verification.check_loss(self._cond, self._machine, env.key, msg, roster.is_last(sender), env.sender)
        if isinstance(msg, ctl.PeerError):
            self._submit(self.liveness.confirm, msg.endpoint, f"reported by {sender}")
            return
        if isinstance(msg, ctl.BadPeer):
            culprit, mine = roster.endpoint_of(msg.stage, msg.replica), roster.assignments.get(sender)
            # only a peer that receives data from the culprit can have seen it misbehave
            if culprit is not None and mine is not None and culprit not in (mine.prev, mine.next, *mine.group):
                raise Forbidden(f"stage {msg.stage} of pipeline {msg.replica} sends nothing to {sender}")
            if culprit is not None and culprit != sender:
                self._refer(roster, sender, culprit, env.key.step, msg.error)
            return
        with self._cond:
            machine, laggard, commands = self._machine, False, []
            if isinstance(msg, ctl.Synced):
                laggard, rejoin = self.resync.caught_up(roster, sender, msg)
                if rejoin is not None and machine is not None:
                    commands = machine.rejoin(rejoin)
            if not laggard:
                self._step_report(machine, env.key, sender, msg)
            self._cond.notify_all()
        if machine is not None:
            self._carry_out(machine, commands)

    def _refer(self, roster: Roster, reporter: str, accused: str, step: int, error: str) -> None:
        """A bad-peer report goes to the referee (``peer.runtime.lead.referee``); its verdict excludes peers from
        the plan or sets the reporter's pipeline aside for the step."""
        with self._cond:
            machine = self._machine
            out = set(self.liveness.dead_now()) | set(roster.members(machine.state.dropped if machine else ()))
            seen_by = witnesses(roster, reporter, accused, out)
            verdict = self.referee.report(self._who(reporter), self._who(accused), seen_by, step)
            if machine is not None:
                set_aside(machine, roster, verdict, self._who, time.monotonic())
            self.verification.probation.suspect(verdict.suspects)  # the spot checks look at them harder
            self._cond.notify_all()
        log.warning("bad-peer report by %s against %s (%s): %s", reporter, accused, error[:200], verdict.reason)
        self._exclude(roster, verdict, f"sent data {reporter} refused ({error}); {verdict.reason}")

    def _who(self, endpoint: str) -> str:
        return self.roster.who(endpoint)  # the current plan's (the roster is replaced whole)

    def _exclude(self, roster: Roster, verdict: Verdict, reason: str) -> None:
        """Exclude whom the verdict names: on the leader's own evidence its unverified applied work is rolled back;
        a peer testimony sidelines is only left out of the plan (``peer.runtime.lead.referee``)."""
        for ep in (ep for ep in roster.assignments if self._who(ep) in {*verdict.exclude, *verdict.sideline}):
            self.declare_dead(ep, reason)
            if self._who(ep) in verdict.exclude:  # the leader's own evidence: its unverified applied work goes too
                self.verification.discard(ep, reason)

    def _step_report(self, machine: StepMachine | None, key: pb.Key, sender: str, msg: ctl.Message) -> None:
        """A report of the running step, to its machine (``_cond`` held)."""
        if machine is None or not machine.carries(key.step):
            raise Rejected(f"report for step {key.step}, which is not running")
        if isinstance(msg, ctl.Loss):
            machine.loss(sender, key.replica, msg.microbatch, msg.loss, time.monotonic())
        elif isinstance(msg, ctl.Sketch):
            self.verification.sketch(machine, key, msg)
        elif isinstance(msg, ctl.Reduced):
            machine.reduced(sender, msg.attempt, key.step)
        elif isinstance(msg, ctl.Synced):
            machine.synced(sender, msg.trained_steps, msg.params_hash)
        elif isinstance(msg, ctl.TaskError):
            if machine.error(sender, key.replica, msg.what, msg.error, time.monotonic(), key.step):
                log.error("worker stage %d replica %d: %s", key.stage, key.replica, msg)
            else:
                log.info("ignoring an error from dropped or syncing pipeline %d: %s", key.replica, msg)

    def _admit_push(self, kind: int, caller: str) -> int:
        """Only workers of the plan push to the coordinator (reports), and only small messages."""
        if caller != self.tls.peer_id and caller not in self.roster.peer_ids.values():
            raise Forbidden(f"the coordinator takes reports only from workers of its plan; peer {caller} is not one")
        return CONTROL_BYTES if kind == pb.CONTROL else 0

    # ------------------------------------------------------------------------------------------- queries
    def stop_workers(self) -> None:
        """Ask every live worker to exit (best effort)."""
        with self._cond:
            workers, epoch = [ep for ep in self.assignments if not self.liveness.is_dead(ep)], self.epoch
        for ep in workers:
            try:
                # as short as a status query: a worker that does not answer at once is gone or going
                self._client(ep).push(ctl.encode(ctl.Stop(), self.spec.run_id, epoch), timeout_s=STATUS_TIMEOUT_S)
            except Exception as exc:  # a worker that is already gone is fine
                log.info("stop %s: %s", ep, exc)

    def copy_targets(self, n: int, exclude: Sequence[str] = ()) -> list[str]:
        """``n`` live workers of the plan to hold checkpoint copies, chosen for their links: the lowest measured
        round-trip time first (unmeasured ones last), never the leader's own endpoint."""
        own = {self._public_endpoint, self.server.endpoint if self._host_server is None else None}
        with self._cond:
            live = [ep for ep in self.roster.assignments
                    if not self.liveness.is_dead(ep) and ep not in own and ep not in exclude]
        return sorted(live, key=lambda ep: (self.liveness.rtt.get(ep, math.inf), ep))[:n]

    def worker_status(self, endpoint: str, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
        return self._client(endpoint).status(timeout_s=timeout_s)


def _passing_refusal(exc: TransportError) -> bool:
    """A refusal that the next heartbeat may end: no connection (refused, TLS handshake failed, reconnect
    backoff: UNAVAILABLE at once) or the worker's intake not yet following this leader (PERMISSION_DENIED).
    A timeout is no such refusal: the peer may be gone, and waiting again would only hold the plan longer."""
    if isinstance(exc, Refused):
        return exc.code == "PERMISSION_DENIED"
    return isinstance(exc, PeerUnreachable) and exc.detail.startswith("UNAVAILABLE")


def send_again(push: Callable[[pb.Envelope, float], None], envelope: pb.Envelope, exc: TransportError,
               interval_s: float, deadline: float) -> TransportError | None:
    """Send a refused assignment again once a heartbeat (``interval_s``), ``ASSIGN_RETRY_HEARTBEATS`` times, while
    the refusal is one a heartbeat can end (``_passing_refusal``): a peer back from a partition trusts our
    certificate and follows us only once it has read our advert again, and until then its TLS handshake or its
    intake refuses us at once. None once it took it; else the last error (the caller declares it dead)."""
    for _ in range(ASSIGN_RETRY_HEARTBEATS):
        if not _passing_refusal(exc) or time.monotonic() + interval_s >= deadline:
            return exc
        log.info("assignment refused (%s); sending it again in %.1f s", exc, interval_s)
        time.sleep(interval_s)
        try:
            push(envelope, max(1.0, deadline - time.monotonic()))
            return None
        except TransportError as again:
            exc = again
    return exc
