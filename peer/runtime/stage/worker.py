"""A stage worker: one peer's tasklet (one stage of one pipeline) served over gRPC.

:class:`StageWorker` is the shell that wires the parts of the peer side to its gRPC server:

* :mod:`~peer.runtime.stage.intake` checks everything received (role, key, step, tensor) before it touches
  state, on the gRPC server threads;
* :mod:`~peer.runtime.stage.assignment` takes an assignment (fencing, keep/init/fetch of the stage state) and
  serves this peer's stage state to others;
* :mod:`~peer.runtime.stage.loop` runs every forward, backward, reduce and apply on one compute thread
  (1F1B: backward first), and a first stage's feeder;
* :mod:`~peer.runtime.stage.sync` is the worker's end of the gradient averaging, apply, DiLoCo's outer round
  and a resync;
* :class:`~peer.runtime.stage.step.WorkerStep` holds the step's bookkeeping, changed only by its transitions;
* everything leaves through the :class:`~peer.runtime.stage.outbox.Outbox` and every op is timed by the
  :class:`~peer.runtime.stage.outbox.DeviceClock` the worker is given (the seams faults use).

State, and what guards it. The current assignment — run spec, assignment, compute state, gradient exchange,
link shapers, corpus — is one immutable :class:`Tasklet` snapshot, replaced by a single reference assignment
(under both locks below). Every handler and task reads it once and works on that snapshot only, so nobody sees
a new assignment with the old compute; a queued task of an older snapshot is dropped, never run on the new one.

* ``_state_lock`` serialises whatever changes the compute state: the compute thread's tasks and taking an
  assignment (which may build or load a stage). Taken before ``_lock`` when both are needed.
* ``_lock`` guards the :class:`WorkerStep` and the stages held for hand-over; ``_cond`` is a condition on it
  (the feeder waits on it for the 1F1B in-flight limit).

A step: the coordinator sends ``start_step``; micro-batches flow; each stage adds a micro-batch's gradient to
its accumulator right after its backward (memory: one gradient); when the pool is complete the coordinator
sends ``reduce`` with the commit record and the participating pipelines; the worker checks its accumulator
holds exactly its pipeline's micro-batches, averages with the participants (``exchange.py``), keeps the summed
gradient and reports ``reduced``. Only when *every* stage has reduced does the coordinator send ``apply``: so
a death during the averaging never leaves some stages updated and others not. ``drop_step`` (its pipeline lost
a member) throws the step's work away; its micro-batches are redone by other pipelines. The control messages
are the typed ones of :mod:`peer.runtime.control`; docs/architecture.md ("One step") walks through a step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.compute.stage import StageCompute, StageComputeConfig
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext, process_tls
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.bounds import checkpoint_bytes
from tasklet.peer.runtime.checkpoints import (
    COPIES_KEEP,
    CheckpointError,
    CheckpointStore,
    CopyReceiver,
    copies_folder,
    prune_copies,
    serve_copy,
)
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.assignment import DialCheck, FetchProgress, StageTaker, fence, require_named_leader
from tasklet.peer.runtime.stage.exchange import GradientExchange
from tasklet.peer.runtime.stage.intake import Intake
from tasklet.peer.runtime.stage.loop import ComputeLoop, Task
from tasklet.peer.runtime.stage.outbox import DeviceClock, LinkSource, Outbox
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.step import Work, WorkerStep
from tasklet.peer.runtime.stage.sync import GradientSync
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage, Rejected

log = logging.getLogger(__name__)
ALL_ATTEMPTS = 2**62  # a step beyond every real one: abort_before((ALL_ATTEMPTS, 0)) abandons every attempt

# A peer may hold 32 of the 48 stream slots (an upstream neighbour pushes up to max_inflight_pushes at once),
# so no single peer can take all of them. gRPC buffers a whole message before the server sees it, so messages
# are capped at a 1 MiB chunk plus framing: a stream never holds more than its Kind's limit plus 2 MiB.
WORKER_TRANSPORT = dict(
    max_concurrent_streams=48, thread_pool_size=64, max_inflight_pushes=32, max_streams_per_peer=32,
    max_message_bytes=2 << 20,
)

OutboxFactory = Callable[[TransportConfig, str, Callable[[], "Tasklet | None"], Callable[[], int], threading.Event],
                         Outbox]


class StageWorker:
    """Serves one tasklet. ``start()`` returns the endpoint; the coordinator assigns the stage over gRPC."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        bulk_port: int | None = 0,
        peer_id: str = "",
        device: str = "",
        max_envelope_bytes: int | None = None,
        tls: TlsContext | None = None,
        controllers: tuple[str, ...] = (),
        checkpoint_copies: Path | None = None,
        outbox: OutboxFactory = Outbox,
        clock: DeviceClock | None = None,
        links: LinkSource | None = None,
        memory_limit_bytes: int | None = None,
        copy_keep: int = COPIES_KEEP,
    ) -> None:
        """``checkpoint_copies``: a folder where this peer keeps copies of the leader's checkpoints (None: it
        refuses them), one folder per run, the newest ``copy_keep`` of each. ``outbox`` builds what every message
        leaves through, ``clock`` times every compute op: the seams a test or an emulated fault replaces
        (defaults: the real sender, the real clock). ``links``: how an emulated network shapes the link to each
        endpoint (None: unshaped). ``memory_limit_bytes``: the most device memory a stage may need here; an
        assignment of a larger stage is refused before anything is allocated (None: no bound)."""
        limits = {} if max_envelope_bytes is None else {"max_envelope_bytes": max_envelope_bytes}
        self.tls = tls or process_tls()
        self.config = TransportConfig(
            host=host, port=port, bulk_port=bulk_port, **WORKER_TRANSPORT, **limits, tls=self.tls
        )
        self.peer_id = peer_id
        self.checkpoint_copies = checkpoint_copies
        if copy_keep < 1:
            raise ValueError(f"copy_keep: must be at least 1, got {copy_keep}")
        self.copy_keep = copy_keep
        # (leader's peer id, reason) of an order refused for breaking the signed run (spec, memory, endpoints)
        self.on_refused: Callable[[str, str], None] | None = None
        self.stopped = threading.Event()
        self._trust_group = f"assignment:{id(self)}"
        self._state_lock = threading.Lock()  # compute tasks vs. taking an assignment (see the module docstring)
        self._lock = threading.Lock()  # the step's bookkeeping, the held stages
        self._cond = threading.Condition(self._lock)
        self._tasklet: Tasklet | None = None  # written under _state_lock and _lock; read once per handler
        self._step = WorkerStep()  # _lock
        self.step_record = ""  # the newest leader's step record a start_step carried (one str: written atomically)

        self.outbox = outbox(self.config, peer_id, lambda: self._tasklet, self._current_step, self.stopped)
        self.outbox.shape_links(links)
        self.taker = StageTaker(self.config, self.tls, peer_id, device, self._trust_group, self._lock, self.stopped,
                                memory_limit_bytes)
        sync = GradientSync(self._step, self._cond, self.outbox, lambda: self.server.endpoint, self.taker.load_from)
        self.loop = ComputeLoop(self._step, self._state_lock, self._cond, lambda: self._tasklet, self.outbox,
                                clock or DeviceClock(), sync, self.stopped)
        # Peers that may give this worker an assignment (and stop it) besides the current plan's coordinator:
        # the coordinator it was started for (local runs), or whatever may_assign accepts (the daemon: the
        # elected leader). This process itself always may.
        self.intake = Intake(self.tls, frozenset(controllers), checkpoint_copies is not None, lambda: self._tasklet,
                             self._step, self._cond, self.outbox, self.loop.put)
        self._copy_receiver = CopyReceiver()  # checkpoint copies arrive in bounded parts (peer.runtime.checkpoints)
        self._copy_bound_of: tuple[RunSpec, int] | None = None  # (signed spec, its largest copy): see _copy_bound
        self._compute_thread = threading.Thread(target=self.loop.serve, name="compute", daemon=True)
        self._external_compute = False  # the caller runs the compute loop (start(compute_thread=False))

        self.server = PeerServer(self.config)
        self.server.register_push(pb.STAGE_ASSIGNMENT, self._on_assignment)
        self.server.register_push(pb.CONTROL, self._on_control)
        self.server.register_push(pb.ACTIVATION, self.intake.activation)
        self.server.register_push(pb.ACTIVATION_GRAD, self.intake.activation_grad)
        self.server.register_push(pb.GRAD_SHARD, self.intake.grad_shard)
        self.server.register_push(pb.PARAM_SHARD, self.intake.param_shard)
        self.server.register_push(pb.TIED_GRAD, self.intake.tied_grad)
        self.server.register_fetch(pb.STAGE_STATE, self._on_fetch_state)
        self.server.register_push(pb.CHECKPOINT, self._on_checkpoint_copy)
        self.server.register_fetch(pb.CHECKPOINT, self._on_fetch_checkpoint)
        self.server.set_status_provider(self.status)
        self.server.set_push_admission(self.intake.admit_push)

        self._control_handlers: dict[ctl.Op, Callable[[Tasklet, Any], None]] = {
            ctl.Op.START_STEP: self._on_start_step,
            ctl.Op.DROP_STEP: lambda t, m: self.loop.put(Task(Work.DROP, t, m.step)),
            ctl.Op.REDUCE: self.loop.queue_reduce,
            ctl.Op.APPLY: lambda t, m: self.loop.put(Task(Work.APPLY, t, m.step, (m,))),
            ctl.Op.RESYNC: lambda t, m: self.loop.put(Task(Work.RESYNC, t, m.step, (m,))),
        }

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self, compute_thread: bool = True) -> str:
        """Serve; ``compute_thread`` False: the caller runs the compute loop (:meth:`run_beside`)."""
        self.server.start()
        self._external_compute = not compute_thread
        if compute_thread:
            self._compute_thread.start()
            threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
        return self.server.endpoint

    def _let_go(self) -> None:
        """Stop computing: the compute loop ends after its task, and a task waiting (a reduce, up to
        REDUCE_WAIT_S, for shards) lets go now, not after we are gone."""
        self.stopped.set()
        with self._cond:
            self._cond.notify_all()
        t = self._tasklet
        if t is not None:
            t.exchange.abort_before((ALL_ATTEMPTS, 0))

    def run_beside(self, control: Callable[[], None]) -> None:
        """Run ``control`` on a thread of its own and the compute loop on the calling thread until ``control``
        returns (or the worker stops). Why: torch on a process's main thread is the fast case of libgomp (a
        non-main thread's OpenMP team counts one thread more, spins far less when threads outnumber cores, and
        ran the same CPU training 25-30 % slower here: docs/benchmarks/overhead.md)."""
        if not self._external_compute:
            raise RuntimeError("run_beside needs a worker started with compute_thread=False")
        done = threading.Event()

        def wrapped() -> None:
            try:
                control()
            finally:
                done.set()
                self._let_go()  # as a compute thread is let go when the daemon stops its worker

        thread = threading.Thread(target=wrapped, name="control", daemon=True)
        thread.start()
        _warm_up()
        self.loop.serve(until=done.is_set)
        thread.join()

    def stop(self) -> None:
        self._let_go()
        if self._compute_thread.is_alive():
            self._compute_thread.join(timeout=5.0)
        self.outbox.close()
        self.server.stop(grace=0.5)

    # The current snapshot's parts, for callers outside the worker's threads (status, daemon, tests).
    @property
    def spec(self) -> RunSpec | None:
        t = self._tasklet
        return None if t is None else t.spec

    @property
    def assignment(self) -> Assignment | None:
        t = self._tasklet
        return None if t is None else t.assignment

    @property
    def compute(self) -> StageCompute | None:
        t = self._tasklet
        return None if t is None else t.compute

    @property
    def exchange(self) -> GradientExchange | None:
        t = self._tasklet
        return None if t is None else t.exchange

    @property
    def step(self) -> int:
        """The current step (-1: none started under this assignment)."""
        return self._step.step

    @property
    def attempt(self) -> int:
        return self._step.attempt

    @property
    def stats(self) -> dict[str, Any]:
        """Compute counters: forwards, backwards, busy seconds, ops over their emulated time."""
        return self.loop.stats

    def set_policies(self, *, may_assign: Callable[[str], bool] | None = None, may_dial: DialCheck | None = None,
                     on_refused: Callable[[str, str], None] | None = None,
                     on_fetch: FetchProgress | None = None) -> None:
        """What the daemon decides for this worker, all four at once (each None: no such policy).

        ``may_assign``: besides the plan's coordinator and ``controllers``, who else may assign (the daemon: the
        elected leader). ``may_dial``: ``(endpoint, peer id) -> bool``, whether an order may make this worker dial
        ``endpoint`` (the daemon: a live advert of the run at that endpoint, of that peer id, the one the order's
        certificate names; "" when the order names no certificate for it), checked for every endpoint an
        assignment names and every fetch or resync source, before any connection (None: any endpoint).
        ``on_refused``: told (leader's peer id, reason) of an order refused for breaking the signed run.
        ``on_fetch``: told the bytes of each state fetch as they arrive (a display)."""
        self.intake.accept_assignments_from(may_assign)
        self.taker.check_dials_with(may_dial)
        self.taker.show_fetches_with(on_fetch)
        self.on_refused = on_refused

    def limit_memory(self, limit_bytes: int | None) -> None:
        """The most device memory a stage may need on this peer (the daemon: its advertised device memory);
        a larger stage's assignment is refused before it is built. None: no bound."""
        self.taker.limit_memory(limit_bytes)

    @property
    def may_assign(self) -> Callable[[str], bool] | None:
        """Who else may assign this worker (:meth:`set_policies`)."""
        return self.intake.may_assign

    @property
    def may_dial(self) -> DialCheck | None:
        """Which endpoints an order may make this worker dial (:meth:`set_policies`); None: any."""
        return self.taker.may_dial

    @property
    def memory_limit_bytes(self) -> int | None:
        """The most device memory a stage may need on this peer (:meth:`limit_memory`); None: no bound."""
        return self.taker.memory_limit_bytes

    def status(self) -> dict[str, Any]:
        with self._lock:
            t, step, pending = self._tasklet, self._step.step, self._step.pending_apply
        a, running = None if t is None else t.assignment, self.loop.running
        last = self.loop.sync.times.last
        return {
            "peer_id": self.peer_id,
            "stage": None if a is None else a.stage,
            "replica": None if a is None else a.replica,
            "layers": None if a is None else list(a.layers),
            "epoch": None if a is None else a.epoch,
            "step": step,
            "trained_steps": None if t is None else t.compute.step,  # an int, read without the state lock
            "pending_apply": pending,
            # the parameters' hash at trained_steps, when known (never computed here: a status answers at once)
            "params_hash": None if t is None else t.compute.known_digest,
            **self.stats,
            # the compute op in progress (a straggler judged before its slow op ends): seconds so far, its op count
            "running_s": 0.0 if running is None else self.loop.clock.now() - running[0],
            "running_ops": 0 if running is None else running[1],
            # where the last applied step's time went (peer.runtime.stage.timing), and the share its device computed
            "step_times": None if last is None else last.as_dict(),
            "compute_share": None if last is None else round(last.compute_share, 4),
            # the newest signed record of a leader's this peer was sent (peer.node.step_record): a takeover's bound
            "step_record": self.step_record or None,
        }

    def preload_corpus(self, corpus: Any, local: RunSpec | None = None) -> None:
        """Use an already loaded corpus (the daemon reads it at start-up to check its fingerprint) and, with
        ``local`` (the daemon's spec), this peer's own file paths in place of an assignment's."""
        with self._state_lock:
            self.taker.use_corpus(corpus, local)

    def _current_step(self) -> int:
        with self._lock:
            return self._step.step

    # ------------------------------------------------------------------------------------------ assignment
    def _on_assignment(self, env: pb.Envelope) -> None:
        """Take a (new) tasklet (peer.runtime.stage.assignment): fenced by plan order, its claims checked (signed
        spec, memory, endpoints) before the current plan is disturbed, then built or kept. A refusal is logged
        here and answered to the sender (FAILED_PRECONDITION)."""
        self.intake.require_controller(env.sender, "a stage assignment")
        msg = ctl.StageAssignment.from_envelope(env)
        try:
            self._take(msg, env.sender)
        except Rejected as exc:
            log.warning("refused an assignment from peer %s: %s", env.sender[:16], exc)
            raise

    def _take(self, msg: ctl.StageAssignment, sender: str) -> None:
        assignment = msg.assignment
        require_named_leader(assignment, sender, self.tls.peer_id)
        old = self._tasklet
        fence(old, assignment)
        try:
            spec = self.taker.check(msg)  # before the current plan is disturbed
        except Rejected as exc:
            if self.on_refused is not None:  # an order that breaks the signed run: the daemon weighs its leader
                self.on_refused(sender, str(exc))
            raise
        if old is not None:
            # The compute thread may hold _state_lock in a reduce of the old plan, waiting (up to REDUCE_WAIT_S)
            # for a shard from a peer that died: abandon the old plan's attempts so that it lets go. The new plan
            # redoes that work; a gradient already reduced and awaiting apply is kept.
            old.exchange.abort_before((ALL_ATTEMPTS, 0))
        with self._state_lock:
            old = self._tasklet
            fence(old, assignment, lost_race=True)
            tasklet = self.taker.build(msg, old, spec)
            self.tls.trust.set_group(self._trust_group, assignment.peers.values())
            with self._lock:
                self.taker.hold(old, tasklet)
                self._tasklet = tasklet
                self._step.reset(assignment.replica)
            self.outbox.reset()
        log.info(
            "assigned stage %d (layers %s) of pipeline %d, epoch %d, state %s",
            assignment.stage,
            assignment.layers,
            assignment.replica,
            assignment.epoch,
            msg.source,
        )

    def _on_fetch_state(self, request: pb.FetchRequest) -> pb.Envelope:
        return self.taker.serve_state(request, lambda: self._tasklet, self.intake.check_grant)

    # --------------------------------------------------------------------------------------------- control
    def _on_control(self, env: pb.Envelope) -> None:
        t, msg = self.intake.control(env)
        if t is None:  # a stop
            self.stopped.set()
            return
        self._control_handlers[msg.op](t, msg)

    def _on_start_step(self, t: Tasklet, msg: ctl.StartStep) -> None:
        feeder = self.loop.start_step(t, msg)
        if msg.record:  # the leader's record of the steps trained so far: shown to a takeover, never read here
            self.step_record = msg.record
        if feeder is not None:
            threading.Thread(target=feeder.run, name=f"feeder-{msg.step}.{msg.attempt}", daemon=True).start()

    # ---------------------------------------------------------------------------------- checkpoint copies
    def _signed_spec(self) -> RunSpec | None:
        """The run this peer joined (the daemon's organiser-signed spec), else the current assignment's (a worker
        without a daemon), else None (no run yet)."""
        t = self._tasklet
        return self.taker.local or (None if t is None else t.spec)

    def _copies(self, run_id: str) -> CheckpointStore:
        """This run's copy store (a folder of its own, the newest ``copy_keep`` kept); a run id other than the
        signed run's is refused: a leader cannot make this peer keep (or serve) another run's checkpoints."""
        if self.checkpoint_copies is None:
            raise Rejected("this peer keeps no checkpoint copies")
        signed = self._signed_spec()
        if signed is not None and run_id != signed.run_id:
            raise Rejected(f"a checkpoint of run {run_id[:60]!r}; this peer trains {signed.run_id!r}")
        return CheckpointStore(copies_folder(self.checkpoint_copies, run_id), keep=self.copy_keep)

    def _copy_bound(self, spec: RunSpec) -> int:
        """The largest copy of ``spec``'s run (peer.runtime.bounds.checkpoint_bytes), computed once per run."""
        cached = self._copy_bound_of
        if cached is None or cached[0] is not spec:
            cached = self._copy_bound_of = (spec, checkpoint_bytes(spec))
        return cached[1]

    def _on_checkpoint_copy(self, env: pb.Envelope) -> None:
        """The leader's checkpoint: stored durably and verified against the leader's manifest, no larger than
        the signed run's checkpoint and leaving this peer's disk above its floor."""
        self.intake.require_controller(env.sender, "a checkpoint copy")
        self.intake.current()  # copies are taken only while this peer has a stage of the run
        spec = self._signed_spec()
        assert spec is not None
        store = self._copies(env.key.run_id)
        try:
            step = self._copy_receiver.receive(env, store, self._copy_bound(spec))
        except CheckpointError as exc:
            log.warning("refused a checkpoint copy from peer %s: %s", env.sender[:16], exc)
            raise BadMessage("checkpoint", str(exc)) from None
        if step is not None:
            log.info("stored a copy of the leader's checkpoint of step %d in %s", step, store.root)

    def _on_fetch_checkpoint(self, request: pb.FetchRequest) -> pb.Envelope:
        """The newest copy that verifies, for a (new) leader of the run."""
        self.intake.require_controller(request.sender, "a checkpoint fetch")
        store = self._copies(request.key.run_id)  # a folder per run: only this run's copies are there
        try:  # the step (probe), the manifest, or a bounded range of one file
            return serve_copy(store, request.key.run_id, request.key.epoch, request.meta)
        except (CheckpointError, OSError) as exc:
            raise Rejected(f"checkpoint copy: {exc}") from None

    def prune_copies(self, run_id: str) -> bool:
        """Remove every checkpoint copy of ``run_id`` this peer keeps (the daemon calls it when the run is done);
        whether there was anything to remove. A copy of it still arriving is dropped."""
        if self.checkpoint_copies is None:
            return False
        self._copy_receiver.abandon()
        return prune_copies(self.checkpoint_copies, run_id)


def _warm_up() -> None:
    """Pay torch's one-time lazy initialisation (about a second: optimizer and autograd machinery) while the
    peer waits for its first assignment, instead of inside it where every peer of a new plan pays it at once."""
    try:
        from tasklet.peer.compute.model import ModelConfig

        tiny = StageCompute(StageComputeConfig(ModelConfig(n_layers=1, d_model=8, n_heads=1, seq_len=4), 0, 1))
        tiny.forward_loss(0, torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64))
        tiny.apply_update(tiny.accumulated_grad(), 1)
    except Exception:  # a warm-up must never take the worker down
        log.debug("warm-up failed", exc_info=True)
