"""A stage worker: one peer's tasklet (one stage of one pipeline) served over gRPC.

Threads, and why there are this many:

* gRPC server threads run the handlers. They only *validate* what arrives (run, epoch, step, micro-batch,
  dtype, shape, NaN/inf) and queue it; a bad message is refused with a gRPC status and touches no state.
  Before that, every push is admitted by role (``_admit_push``, before it is buffered): the caller is the
  peer its mutual-TLS certificate proves, and each Kind is taken only from the peer the current plan gives
  that role (peer.runtime.roles), up to the Kind's size bound (peer.runtime.bounds).
* One compute thread runs every forward, backward and optimizer step, one at a time — a GPU has one compute
  stream, and ``StageCompute`` is not thread-safe. Backward work goes first (priority 0), forward second:
  finishing micro-batches frees memory and feeds the pipeline's earlier stages, the 1F1B rule.
* On the first stage, a feeder thread leases micro-batches from the coordinator's task pool while fewer than
  ``n_stages`` are in flight (the 1F1B in-flight limit), and builds their tokens locally: data is a pure
  function of (seed, step, micro-batch).
* Sends are asynchronous (``push_async``) through per-destination link shapers, so a slow link never stalls
  compute; coordinator calls go through a small executor for the same reason.

State, and what guards it. The current assignment — run spec, assignment, compute state, gradient exchange,
link shapers, corpus — is one immutable :class:`Tasklet` snapshot, replaced by a single reference assignment
(under both locks below). Every handler and task reads it once and works on that snapshot only, so nobody sees
a new assignment with the old compute; a queued task of an older snapshot is dropped, never run on the new one.
Everything else that several threads share names its guard where it is declared:

* ``_state_lock`` serialises whatever changes the compute state: the compute thread's tasks and taking an
  assignment (which may build or load a stage). Taken before ``_lock`` when both are needed.
* ``_lock`` guards the step's bookkeeping (step, round, dropped, known micro-batches, in-flight count, the
  reduced gradient awaiting ``apply``), the client cache, the pre-assignment link table and the stages held
  for hand-over; ``_inflight_cond`` is a condition on it.

A step: the coordinator sends ``start_step``; micro-batches flow; each stage adds a micro-batch's gradient to
its accumulator right after its backward (memory: one gradient); when the pool is complete the coordinator
sends ``reduce`` with the commit record and the participating pipelines; the worker checks its accumulator
holds exactly its pipeline's micro-batches, averages with the participants (``exchange.py``), keeps the summed
gradient and reports ``reduced``. Only when *every* stage has reduced does the coordinator send ``apply``: so
a death during the averaging never leaves some stages updated and others not. ``drop_step`` (its pipeline lost
a member) throws the step's work away; its micro-batches are redone by other pipelines. The control messages
are the typed ones of :mod:`peer.runtime.control`; docs/architecture.md ("One step") walks through a step.
The worker's end of the reduce, the apply, DiLoCo's outer round and a resync are in
:mod:`peer.runtime.worker_sync`; the snapshot and the stage-state envelope in :mod:`peer.runtime.tasklet`.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peer.compute.data import Corpus, microbatch
from peer.compute.hf import ModelSourceError
from peer.compute.stage import StageCompute, StageComputeConfig
from peer.compute.textdata import load_corpus
from peer.net import PeerClient, PeerServer, TransportConfig
from peer.net.shaping import LinkTable
from peer.net.tls import TlsContext, process_tls
from peer.runtime import control as ctl
from peer.runtime.bounds import push_limits
from peer.runtime.checkpoints import (
    CheckpointError,
    CheckpointStore,
    CopyReceiver,
    copy_bound_bytes,
    copy_part_bound_bytes,
    serve_copy,
)
from peer.runtime.control import SPECULATIVE_META
from peer.runtime.exchange import ExchangeAbortedError, GradientExchange, Tag
from peer.runtime.grants import read_grant
from peer.runtime.outer import OuterState
from peer.runtime.roles import Roles
from peer.runtime.spec import Assignment, RunSpec
from peer.runtime.tasklet import (  # re-exported: the coordinator and the fault workers name them from here
    Tasklet,
    state_envelope,
    state_from_envelope,
)
from peer.runtime.wire import envelope, make_key, tensor_named
from peer.runtime.worker_sync import GradientSync
from peer.timing import CONTROL_TIMEOUT_S, SEND_TIMEOUT_S, WORKER_FETCH_STATE_TIMEOUT_S
from protocol import tasklet_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadMessage, Forbidden, Rejected, TransportError

log = logging.getLogger(__name__)
ALL_ROUNDS = 2**62  # a step beyond every real one: abort_before((ALL_ROUNDS, 0)) abandons every round

# A peer may hold 32 of the 48 stream slots (an upstream neighbour pushes up to max_inflight_pushes at once),
# so no single peer can take all of them. gRPC buffers a whole message before the server sees it, so messages
# are capped at a 1 MiB chunk plus framing: a stream never holds more than its Kind's limit plus 2 MiB.
WORKER_TRANSPORT = dict(
    max_concurrent_streams=48, thread_pool_size=64, max_inflight_pushes=32, max_streams_per_peer=32,
    max_message_bytes=2 << 20,
)
# A state fetch refused or unreachable is retried this long: during a re-plan the source may take its own new
# assignment (which trusts and authorizes us) a moment after ours arrives.
FETCH_STATE_RETRY_S = 15.0


class TaskKind(enum.Enum):
    """What the compute thread can be asked to do."""

    FORWARD = "forward"
    BACKWARD = "backward"
    DROP = "drop"
    REDUCE = "reduce"
    APPLY = "apply"
    RESYNC = "resync"


@dataclass(frozen=True)
class _Task:
    kind: TaskKind
    tasklet: Tasklet  # the snapshot the task was queued under; dropped if another one is current
    step: int
    args: tuple[Any, ...] = ()


class StageWorker(GradientSync):
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
    ) -> None:
        """``checkpoint_copies``: a folder where this peer keeps copies of the leader's checkpoints (None: it
        refuses them)."""
        limits = {} if max_envelope_bytes is None else {"max_envelope_bytes": max_envelope_bytes}
        self.tls = tls or process_tls()
        self.config = TransportConfig(
            host=host, port=port, bulk_port=bulk_port, **WORKER_TRANSPORT, **limits, tls=self.tls
        )
        # Peers that may give this worker an assignment (and stop it) besides the current plan's coordinator:
        # the coordinator it was started for (local runs), or whatever may_assign accepts (the daemon: the
        # elected leader). This process itself always may.
        self.controllers = frozenset(controllers)
        self.may_assign: Callable[[str], bool] | None = None
        self._trust_group = f"assignment:{id(self)}"
        self.peer_id = peer_id
        self.device = device  # this peer's --device; empty: what the assignment says
        self.server = PeerServer(self.config)
        self.server.register_push(pb.STAGE_ASSIGNMENT, self._on_assignment)
        self.server.register_push(pb.OTHER, self._on_control)
        self.server.register_push(pb.ACTIVATION, self._on_activation)
        self.server.register_push(pb.ACTIVATION_GRAD, self._on_activation_grad)
        self.server.register_push(pb.GRAD_SHARD, self._on_grad_shard)
        self.server.register_push(pb.PARAM_SHARD, self._on_param_shard)
        self.server.register_fetch(pb.STAGE_STATE, self._on_fetch_state)
        self.checkpoint_copies = checkpoint_copies
        self._copy_receiver = CopyReceiver()  # checkpoint copies arrive in bounded parts (peer.runtime.checkpoints)
        self.server.register_push(pb.CHECKPOINT, self._on_checkpoint_copy)
        self.server.register_fetch(pb.CHECKPOINT, self._on_fetch_checkpoint)
        self.server.set_status_provider(self.status)
        self.server.set_push_admission(self._admit_push)

        self._state_lock = threading.Lock()  # compute tasks vs. taking an assignment (see the module docstring)
        self._lock = threading.Lock()  # step bookkeeping, clients, link table, holdings
        self._inflight_cond = threading.Condition(self._lock)

        self._tasklet: Tasklet | None = None  # written under _state_lock and _lock; read once per handler
        self._corpus: Corpus | None = None  # _state_lock
        self._links_table: dict[str, tuple[float, float]] = {}  # _lock: shaping before any assignment
        self._links = LinkTable(lambda dest: None)  # _lock
        self._clients: dict[str, PeerClient] = {}  # _lock
        # _lock. layers -> (compute, stage index, outer state): the current stage and the one held before the last
        # assignment
        self._holdings: dict[tuple[int, int], tuple[StageCompute, int, OuterState | None]] = {}
        self.step = -1  # _lock
        self.round = 0  # _lock
        self._dropped = False  # _lock: this pipeline was dropped from the current step
        self._reduced: tuple[int, torch.Tensor] | None = None  # _lock: (step, summed gradient) awaiting "apply"
        self._local_count = 0  # _lock: DiLoCo inner step: micro-batches this pipeline committed (divides _reduced)
        # _lock: DiLoCo: (step, averaged pseudo-gradient, top-k residual after sending) awaiting the outer apply
        self._outer_pending: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._known: set[int] = set()  # _lock: micro-batches forwarded here this step
        self._grads_seen: set[int] = set()  # _lock: micro-batches whose activation gradient arrived this step
        self._inflight = 0  # _lock: micro-batches leased by the feeder and not yet committed

        self._tasks: queue.PriorityQueue[tuple[int, int, _Task]] = queue.PriorityQueue()  # thread-safe
        self._seq = itertools.count()
        self._control_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="worker-control")
        self.stopped = threading.Event()
        self._compute_thread = threading.Thread(target=self._compute_loop, name="compute", daemon=True)
        self.stats = {"forward": 0, "backward": 0, "busy_s": 0.0, "overrun_ops": 0}  # written by compute only
        self._running: tuple[float, int] | None = None  # compute op in progress: (started, ops it counts)

        self._control_handlers: dict[ctl.Op, Callable[[Tasklet, Any], None]] = {
            ctl.Op.START_STEP: self._on_start_step,
            ctl.Op.DROP_STEP: lambda t, m: self._put(0, _Task(TaskKind.DROP, t, m.step)),
            ctl.Op.REDUCE: self._on_reduce,
            ctl.Op.APPLY: lambda t, m: self._put(0, _Task(TaskKind.APPLY, t, m.step, (m,))),
            ctl.Op.RESYNC: lambda t, m: self._put(0, _Task(TaskKind.RESYNC, t, m.step, (m,))),
        }
        self._task_handlers: dict[TaskKind, Callable[..., None]] = {
            TaskKind.FORWARD: self._do_forward,
            TaskKind.BACKWARD: self._do_backward,
            TaskKind.DROP: self._do_drop,
            TaskKind.REDUCE: self._do_reduce,
            TaskKind.APPLY: self._do_apply,
            TaskKind.RESYNC: self._do_resync,
        }

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> str:
        self.server.start()
        self._compute_thread.start()
        threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()
        return self.server.endpoint

    def stop(self) -> None:
        self.stopped.set()
        with self._inflight_cond:
            self._inflight_cond.notify_all()
        if self._compute_thread.is_alive():
            self._compute_thread.join(timeout=5.0)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
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

    def status(self) -> dict[str, Any]:
        with self._lock:
            t, step, reduced = self._tasklet, self.step, self._reduced
        a, running = None if t is None else t.assignment, self._running
        return {
            "peer_id": self.peer_id,
            "stage": None if a is None else a.stage,
            "replica": None if a is None else a.replica,
            "layers": None if a is None else list(a.layers),
            "epoch": None if a is None else a.epoch,
            "step": step,
            "trained_steps": None if t is None else t.compute.step,  # an int, read without the state lock
            "pending_apply": None if reduced is None else reduced[0],
            **self.stats,
            # the compute op in progress (a straggler judged before its slow op ends): seconds so far, its op count
            "running_s": 0.0 if running is None else time.monotonic() - running[0],
            "running_ops": 0 if running is None else running[1],
        }

    # ------------------------------------------------------------------------------------------ assignment
    def _on_assignment(self, env: pb.Envelope) -> None:
        """Take a (new) tasklet. Its state source says where its parameters come from:

        ``keep`` (this peer already holds the stage at the run's trained step), ``init`` (step 0: the seeded
        initialiser, identical everywhere), or ``fetch`` from ``endpoint`` (a live replica of the stage, or the
        coordinator serving a checkpoint) — checked to be at the expected step before it is accepted.
        """
        self._require_controller(env.sender, "a stage assignment")
        msg = ctl.StageAssignment.from_envelope(env)
        spec, assignment, source = msg.run, msg.assignment, msg.source
        old = self._tasklet
        if old is not None and _plan_order(assignment) <= _plan_order(old.assignment):
            # fencing: plans are ordered by (epoch, leader id); two leaders can never both drive this peer
            raise Rejected(
                f"plan epoch {assignment.epoch} of leader {assignment.leader!r} is not newer: older than this "
                f"peer's epoch {old.assignment.epoch} of leader {old.assignment.leader!r} or equal to it; "
                "a newer leader has taken over"
            )
        if old is not None:
            # The compute thread may hold _state_lock in a reduce of the old plan, waiting (up to REDUCE_WAIT_S)
            # for a shard from a peer that died: abandon the old plan's rounds so that it lets go. The new plan
            # redoes that work; a gradient already reduced and awaiting apply is kept.
            old.exchange.abort_before((ALL_ROUNDS, 0))
        with self._state_lock:
            old = self._tasklet
            if old is not None and _plan_order(assignment) <= _plan_order(old.assignment):
                raise Rejected(f"plan epoch {assignment.epoch} of {assignment.leader!r} lost a race to a newer plan")
            if source.kind is ctl.SourceKind.KEEP:
                same_stage = old is not None and old.spec == spec and old.assignment.layers == assignment.layers
                if old is None or not same_stage or old.compute.step != source.step:
                    raise Rejected(
                        f"cannot keep stage {assignment.layers} at step {source.step}: this peer holds "
                        f"{None if old is None else old.assignment.layers} at step "
                        f"{None if old is None else old.compute.step}"
                    )
                compute = old.compute
                compute.reset_step()
                outer = old.outer
            else:
                try:
                    compute = StageCompute(
                        StageComputeConfig(
                            model=spec.model,
                            first_layer=assignment.layers[0],
                            last_layer=assignment.layers[1],
                            optim=spec.optim,
                            device=self.device or assignment.device,
                            precision=spec.precision,
                        )
                    )
                except ModelSourceError as exc:  # e.g. this peer's checkpoint files differ from the run's
                    raise Rejected(f"cannot build stage {assignment.layers}: {exc}") from None
                outer = None
                if source.kind is ctl.SourceKind.FETCH:
                    assert source.endpoint is not None
                    outer = self._load_from(compute, source.endpoint, spec, assignment, source.step, source.grant)
            outer = _outer_state(spec, compute, outer)
            if (assignment.is_first or assignment.is_last) and self._corpus is None:
                try:
                    corpus = load_corpus(spec.corpus, spec.tokenizer, spec.text_field, spec.model)
                except ValueError as exc:  # missing data or tokenizer files on this peer
                    raise Rejected(f"cannot load the run's data: {exc}") from None
                if spec.corpus_fingerprint and corpus.fingerprint != spec.corpus_fingerprint:
                    raise Rejected(
                        f"corpus fingerprint {corpus.fingerprint[:12]} differs from the run's "
                        f"{spec.corpus_fingerprint[:12]} (a different Python or data path)"
                    )
                self._corpus = corpus
            links = dict(assignment.links)
            roles = Roles.of(assignment, self.tls)
            tasklet = Tasklet(
                spec=spec,
                assignment=assignment,
                compute=compute,
                exchange=GradientExchange(assignment.replica, compute.numel, spec.grad_outlier_factor),
                links=LinkTable(lambda dest: links.get(dest)),
                corpus=self._corpus,
                roles=roles,
                outer=outer,
            )
            self.tls.trust.set_group(self._trust_group, assignment.peers.values())
            with self._lock:
                previous = {} if old is None else {
                    old.assignment.layers: (old.compute, old.assignment.stage, old.outer)}
                self._holdings = {**previous, assignment.layers: (compute, assignment.stage, outer)}
                self._tasklet = tasklet
                self.step, self.round, self._dropped, self._reduced = -1, 0, False, None
                self._outer_pending = None
                self._known, self._grads_seen = set(), set()
                clients, self._clients = list(self._clients.values()), {}
            for client in clients:
                client.close()
        log.info(
            "assigned stage %d (layers %s) of pipeline %d, epoch %d, state %s",
            assignment.stage,
            assignment.layers,
            assignment.replica,
            assignment.epoch,
            source,
        )

    def _load_from(
        self, compute: StageCompute, endpoint: str, spec: RunSpec, a: Assignment, step: int, grant: str = ""
    ) -> OuterState | None:
        """Fetch a stage's state from a live replica (or a checkpoint server) and load it; with DiLoCo, also the
        replica's outer state (round-start parameters, Nesterov buffer) when it has one (a checkpoint has not)."""
        want_outer = {"outer": "1"} if spec.sync_period > 1 else {}
        roles = Roles.of(a, self.tls)
        self.tls.trust.add(self._trust_group, a.peers.values())  # the source must be trusted to be dialled
        deadline = time.monotonic() + FETCH_STATE_RETRY_S
        while True:
            client = PeerClient(endpoint, self.config, sender=self.peer_id, expect_peer=roles.ids.get(endpoint, ""))
            try:
                env = client.fetch(
                    pb.STAGE_STATE,
                    make_key(spec.run_id, a.epoch, step, stage=a.stage),
                    meta={"layers": json.dumps(list(a.layers)), **({"grant": grant} if grant else {}), **want_outer},
                    timeout_s=WORKER_FETCH_STATE_TIMEOUT_S,
                )
                break
            except TransportError as exc:
                if time.monotonic() > deadline or self.stopped.is_set():
                    raise Rejected(f"could not fetch stage {a.layers} from {endpoint}: {exc}") from None
                log.info("fetching stage %s from %s: %s; retrying", a.layers, endpoint, exc)
                time.sleep(0.5)
            finally:
                client.close()
        state = state_from_envelope(env)
        if state["step"] != step:
            raise Rejected(f"{endpoint} holds stage {a.layers} at step {state['step']}, expected step {step}")
        try:
            compute.load_state_dict(state)
        except ValueError as exc:
            raise BadMessage("stage_state", str(exc)) from None
        if "outer_anchor" not in state or "outer_momentum" not in state:
            return None
        for name in ("outer_anchor", "outer_momentum"):
            if state[name].numel() != compute.numel:
                raise BadMessage(f"tensors.{name}", f"{state[name].numel()} values for a stage of {compute.numel}")
        return OuterState.start(state["outer_anchor"], state["outer_momentum"])

    def preload_corpus(self, corpus: Corpus) -> None:
        """Use an already loaded corpus (the daemon reads it at start-up to check its fingerprint)."""
        with self._state_lock:
            self._corpus = corpus

    def set_links(self, links: dict[str, tuple[float, float]]) -> None:
        """Shape traffic to these endpoints (rate bit/s, delay s) before any assignment, e.g. so that link
        probes of an emulated swarm measure the emulated links. Once assigned, the assignment's links apply."""
        with self._lock:
            if self._links_table == links:
                return
            table = dict(links)
            self._links_table = table
            self._links = LinkTable(lambda dest: table.get(dest))
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _client(self, endpoint: str) -> PeerClient:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                t = self._tasklet
                links = self._links if t is None else t.links
                expect = "" if t is None else t.roles.ids.get(endpoint, "")
                client = PeerClient(
                    endpoint, self.config, shaper=links.get(endpoint), sender=self.peer_id, expect_peer=expect
                )
                self._clients[endpoint] = client
            return client

    # ------------------------------------------------------------------------------------------- validation
    def _require_controller(self, caller: str, what: str) -> None:
        """Assignments (and a stop) come from the current plan's coordinator, a controller named at start-up,
        whatever ``may_assign`` accepts (the daemon: the elected leader), or this process itself."""
        t = self._tasklet
        if caller == self.tls.peer_id or caller in self.controllers:
            return
        if t is not None and caller == t.roles.peer(t.assignment.coordinator):
            return
        if self.may_assign is not None and self.may_assign(caller):
            return
        raise Forbidden(f"{what} is taken only from the coordinator of the current plan; peer {caller} is not")

    def _check_grant(self, request: pb.FetchRequest, t: Tasklet, layers: tuple[int, int]) -> None:
        """A fetch outside our plan's roles needs a grant signed by a peer we take control from, for this
        caller, these layers and this run, of our plan's epoch or a newer one."""
        grant = read_grant(request.meta["grant"], self.tls)
        self._require_controller(grant.signer, "a fetch grant")
        if grant.peer != request.sender or grant.layers != layers or grant.run_id != t.spec.run_id:
            raise Forbidden(f"the grant is for peer {grant.peer}, layers {list(grant.layers)} of run {grant.run_id!r}")
        if grant.epoch < t.assignment.epoch:
            raise Forbidden(f"the grant is of plan epoch {grant.epoch}, older than this peer's {t.assignment.epoch}")

    def _admit_push(self, kind: int, caller: str) -> int:
        """Before a push is buffered: the caller must have a role for its Kind; the size bound of the Kind."""
        t = self._tasklet
        if kind in (pb.STAGE_ASSIGNMENT, pb.OTHER, pb.CHECKPOINT):
            self._require_controller(caller, f"a {pb.Kind.Name(kind)} message")
            if kind == pb.CHECKPOINT:
                return 0 if t is None or self.checkpoint_copies is None else copy_part_bound_bytes()
        elif t is not None:
            a, what = t.assignment, f"a {pb.Kind.Name(kind) if kind in pb.Kind.values() else kind} message"
            senders = {pb.ACTIVATION: ([a.prev], "the upstream neighbour"),
                       pb.ACTIVATION_GRAD: ([a.next], "the downstream neighbour"),
                       pb.GRAD_SHARD: (list(a.group), "this stage's group"),
                       pb.PARAM_SHARD: (list(a.group), "this stage's group")}.get(kind)
            if senders is not None:
                t.roles.require(caller, senders[0], senders[1], what)
        return push_limits(None if t is None else t.spec, 0 if t is None else t.compute.numel).get(kind, 0)

    def _current(self) -> Tasklet:
        t = self._tasklet
        if t is None:
            raise Rejected("this peer has no stage assignment yet")
        return t

    def _check_key(self, t: Tasklet, key: pb.Key) -> None:
        """Refuse work for another run, plan, step or pipeline (Rejected -> FAILED_PRECONDITION)."""
        spec, a = t.spec, t.assignment
        if key.run_id != spec.run_id:
            raise Rejected(f"run {key.run_id!r} is not this peer's run {spec.run_id!r}")
        if key.epoch != a.epoch:
            raise Rejected(f"plan epoch {key.epoch} is not this peer's epoch {a.epoch}")
        with self._lock:
            step, dropped, current = self.step, self._dropped, self._tasklet is t
        if not current:
            raise Rejected("this peer took a new assignment meanwhile")
        if key.step != step:
            raise Rejected(f"step {key.step} is not the current step {step}")
        if dropped:
            raise Rejected(f"pipeline {a.replica} was dropped from step {step}")
        if key.replica != a.replica:
            raise Rejected(f"pipeline {key.replica} is not this peer's pipeline {a.replica}")
        if not 0 <= key.microbatch < spec.n_microbatches:
            raise Rejected(f"micro-batch {key.microbatch} is not in [0, {spec.n_microbatches})")

    def _decode(self, t: Tasklet, env: pb.Envelope, name: str, **expect: Any) -> torch.Tensor:
        """Decode a tensor; a malformed one (NaN, wrong shape, ...) is refused AND its sender reported."""
        try:
            return decode_tensor(tensor_named(env, name), **expect)
        except BadMessage as exc:
            self._report(t, ctl.BadPeer(env.key.stage, env.key.replica, env.sender, str(exc)[:300]))
            raise

    def _hidden(self, t: Tasklet, env: pb.Envelope, name: str) -> torch.Tensor:
        m = t.spec.model
        shape = (t.spec.micro_batch, m.seq_len, m.d_model)
        return self._decode(t, env, name, expect_shape=shape, expect_dtype=t.compute.dtype)

    # ---------------------------------------------------------------------------------------- data handlers
    def _on_activation(self, env: pb.Envelope) -> None:
        t = self._current()
        t.roles.require(env.sender, [t.assignment.prev], "the upstream neighbour of this stage", "an activation")
        self._check_key(t, env.key)
        if t.assignment.is_first:
            raise Rejected("the first stage takes no activations")
        x = self._hidden(t, env, "hidden")
        with self._lock:
            if env.key.microbatch in self._known:
                raise Rejected(f"micro-batch {env.key.microbatch} was already forwarded here this step")
            self._known.add(env.key.microbatch)
        speculative = env.meta.get(SPECULATIVE_META) == "1"  # a copy another pipeline also runs (stragglers)
        self._put(1, _Task(TaskKind.FORWARD, t, env.key.step, (env.key.microbatch, x, speculative)))

    def _on_activation_grad(self, env: pb.Envelope) -> None:
        t = self._current()
        t.roles.require(env.sender, [t.assignment.next], "the downstream neighbour of this stage",
                        "an activation gradient")
        self._check_key(t, env.key)
        if t.assignment.is_last:
            raise Rejected("the last stage takes no activation gradients")
        g = self._hidden(t, env, "grad")
        with self._lock:
            if env.key.microbatch not in self._known:
                raise Rejected(f"micro-batch {env.key.microbatch} was never forwarded here this step")
            if env.key.microbatch in self._grads_seen:
                raise Rejected(f"the gradient of micro-batch {env.key.microbatch} already arrived this step")
            self._grads_seen.add(env.key.microbatch)
        self._put(0, _Task(TaskKind.BACKWARD, t, env.key.step, (env.key.microbatch, g)))

    def _shard_message(self, env: pb.Envelope) -> tuple[Tasklet, Tag, list[int], torch.Tensor]:
        key = env.key
        t = self._current()
        if key.run_id != t.spec.run_id or key.epoch != t.assignment.epoch:
            raise Rejected(f"run/epoch {key.run_id!r}/{key.epoch} is not this peer's")
        group = t.assignment.group
        if not 0 <= key.replica < len(group):
            raise BadMessage("key.replica", f"replica {key.replica} is not in [0, {len(group)})")
        t.roles.require(env.sender, [group[key.replica]], f"replica {key.replica} of this stage's group",
                        "a gradient or parameter shard")
        if key.stage != t.assignment.stage:
            raise Rejected(f"stage {key.stage} is not this peer's stage {t.assignment.stage}")
        with self._lock:
            step, current_round = self.step, self.round
        if key.step != step:
            raise Rejected(f"step {key.step} is not the current step {step}")
        try:
            participants = [int(x) for x in json.loads(env.meta.get("participants", "[]"))]
            rnd = int(env.meta.get("round", ""))
        except (ValueError, TypeError):
            raise BadMessage("meta", "round and participants must be an integer and a JSON list") from None
        if not current_round <= rnd <= current_round + 2:
            # bounded mailbox: only the rounds that can follow the one this peer was told about are kept
            raise Rejected(f"round {rnd} is not within 2 of the current round {current_round}")
        return t, (key.step, rnd), participants, self._decode(t, env, "grad", expect_dtype=torch.float32)

    def _on_grad_shard(self, env: pb.Envelope) -> None:
        t, tag, participants, shard = self._shard_message(env)
        t.exchange.put_contribution(tag, participants, env.key.replica, shard, list(env.microbatches))

    def _on_param_shard(self, env: pb.Envelope) -> None:
        t, tag, participants, shard = self._shard_message(env)
        t.exchange.put_reduced(tag, participants, env.key.replica, shard)

    def _on_fetch_state(self, request: pb.FetchRequest) -> pb.Envelope:
        """Serve the state of the stage with the requested layers: the current one or the one held just before.

        Deliberately without the state lock: during a re-plan two peers may fetch from each other while each is
        taking its new assignment (a swap of stages); serving the retained previous stage keeps that working.
        """
        try:
            layers = tuple(int(x) for x in json.loads(request.meta.get("layers", "null")))
        except (TypeError, ValueError):
            raise BadMessage("meta.layers", "must be a JSON list [first_layer, last_layer]") from None
        with self._lock:
            held = self._holdings.get(layers)  # type: ignore[arg-type]
            t = self._tasklet
        if held is None or t is None:
            raise Rejected(f"this peer holds no stage with layers {list(layers)}")
        if len(layers) != 2:
            raise BadMessage("meta.layers", "must be a JSON list [first_layer, last_layer]")
        try:
            t.roles.require_holder(request.sender, layers, t.assignment.coordinator, "a stage state fetch")  # type: ignore[arg-type]
        except Forbidden:
            if "grant" not in request.meta:
                raise
            self._check_grant(request, t, layers)  # type: ignore[arg-type]
        compute, stage, outer = held
        outer = outer if request.meta.get("outer") == "1" else None
        return state_envelope(compute.state_dict(), t.spec.run_id, request.key.epoch, stage, outer=outer)

    # ---------------------------------------------------------------------------------- checkpoint copies
    def _copies(self, run_id: str) -> CheckpointStore:
        if self.checkpoint_copies is None:
            raise Rejected("this peer keeps no checkpoint copies")
        folder = "run-" + hashlib.sha256(run_id.encode()).hexdigest()[:16]
        return CheckpointStore(self.checkpoint_copies / folder)

    def _on_checkpoint_copy(self, env: pb.Envelope) -> None:
        """The leader's checkpoint: stored durably and verified against the leader's manifest."""
        self._require_controller(env.sender, "a checkpoint copy")
        t = self._current()
        if env.key.run_id != t.spec.run_id:
            raise Rejected(f"a checkpoint of run {env.key.run_id!r}; this peer trains {t.spec.run_id!r}")
        store = self._copies(t.spec.run_id)
        try:
            step = self._copy_receiver.receive(env, store, copy_bound_bytes(t.spec.model))
        except CheckpointError as exc:
            raise BadMessage("checkpoint", str(exc)) from None
        if step is not None:
            log.info("stored a copy of the leader's checkpoint of step %d in %s", step, store.root)

    def _on_fetch_checkpoint(self, request: pb.FetchRequest) -> pb.Envelope:
        """The newest copy that verifies, for a (new) leader of the run."""
        self._require_controller(request.sender, "a checkpoint fetch")
        store = self._copies(request.key.run_id)  # a folder per run: only this run's copies are there
        try:  # the step (probe), the manifest, or a bounded range of one file
            return serve_copy(store, request.key.run_id, request.key.epoch, request.meta)
        except (CheckpointError, OSError) as exc:
            raise Rejected(f"checkpoint copy: {exc}") from None

    # --------------------------------------------------------------------------------------------- control
    def _on_control(self, env: pb.Envelope) -> None:
        msg = ctl.decode(env, ctl.TO_WORKER)
        if isinstance(msg, ctl.Stop):
            self._require_controller(env.sender, "a stop")
            self.stopped.set()
            return
        self._require_controller(env.sender, f"control message {msg.op.value!r}")
        t = self._current()
        if env.key.epoch != t.assignment.epoch:
            raise Rejected(f"plan epoch {env.key.epoch} is not this peer's epoch {t.assignment.epoch}")
        self._control_handlers[msg.op](t, msg)

    def _on_start_step(self, t: Tasklet, msg: ctl.StartStep) -> None:
        step, rnd = msg.step, msg.round
        if msg.feed and not t.assignment.is_first:
            raise Rejected("only a first stage feeds micro-batches")
        with self._lock:
            if self._tasklet is not t:
                raise Rejected("this peer took a new assignment meanwhile")
            if step < self.step:
                raise Rejected(f"step {step} is before the current step {self.step}")
            if step > self.step:
                if self._reduced is not None or t.compute.step != step:
                    raise Rejected(f"cannot start step {step}: this stage has trained {t.compute.step} steps")
                self.step, self._dropped, self._known, self._grads_seen = step, False, set(), set()
            if self._dropped:
                raise Rejected(f"pipeline {t.assignment.replica} was dropped from step {step}")
            self.round = rnd
            self._inflight = 0
        t.exchange.abort_before((step, rnd))
        if msg.feed:
            threading.Thread(
                target=self._feed, args=(t, step, rnd), name=f"feeder-{step}.{rnd}", daemon=True
            ).start()

    def _on_reduce(self, t: Tasklet, msg: ctl.Reduce) -> None:
        """Queue a reduce. An outer round (DiLoCo) may be restarted with fewer participants after a death: its
        round becomes current here at once, and a compute task still waiting on the abandoned round lets go."""
        if msg.outer:
            with self._lock:
                if msg.step != self.step:
                    raise Rejected(f"outer round of step {msg.step}, the current step is {self.step}")
                self.round = max(self.round, msg.round)
            t.exchange.abort_before((msg.step, msg.round))
        self._put(0, _Task(TaskKind.REDUCE, t, msg.step, (msg,)))

    def _put(self, priority: int, task: _Task) -> None:
        self._tasks.put((priority, next(self._seq), task))

    def _report(self, t: Tasklet, msg: ctl.Message) -> Future[None]:
        """Send a report to the coordinator without blocking the caller."""
        step = getattr(msg, "step", None)
        if step is None:
            with self._lock:
                step = self.step
        a = t.assignment
        env = ctl.encode(msg, t.spec.run_id, a.epoch, step, stage=a.stage, replica=a.replica)
        return self._control_pool.submit(self._client(a.coordinator).push, env, CONTROL_TIMEOUT_S)

    # ---------------------------------------------------------------------------------------------- feeder
    def _feed(self, t: Tasklet, step: int, rnd: int) -> None:
        """Lease micro-batches for this pipeline while fewer than n_stages are in flight."""
        spec, a, corpus = t.spec, t.assignment, t.corpus
        assert corpus is not None
        window = a.n_stages
        key = make_key(spec.run_id, a.epoch, step, stage=0, replica=a.replica)
        meta = ctl.pool_request_meta(ctl.Op.LEASE)

        def current() -> bool:  # call with _lock held
            return (
                self._tasklet is t and self.step == step and self.round == rnd and not self._dropped
                and not self.stopped.is_set()
            )

        while True:
            with self._inflight_cond:
                while current() and self._inflight >= window:
                    self._inflight_cond.wait(0.5)
                if not current():
                    return
            try:
                reply = self._client(a.coordinator).fetch(pb.COMMIT, key, meta=meta, timeout_s=CONTROL_TIMEOUT_S)
            except TransportError as exc:
                log.warning("lease request for step %d failed: %s", step, exc)
                time.sleep(0.5)
                continue
            status = ctl.pool_status(reply)
            if status is ctl.PoolStatus.DONE:
                return
            if status is not ctl.PoolStatus.LEASE:
                time.sleep(0.02)
                continue
            mb = reply.key.microbatch
            speculative = reply.meta.get(SPECULATIVE_META) == "1"
            tokens, _ = microbatch(corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
            with self._lock:
                if not current():
                    return
                self._known.add(mb)
                self._inflight += 1
            self._put(1, _Task(TaskKind.FORWARD, t, step, (mb, tokens, speculative)))

    # ------------------------------------------------------------------------------------- compute thread
    def _compute_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                _, _, task = self._tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                with self._state_lock:
                    with self._lock:
                        stale = (
                            task.tasklet is not self._tasklet
                            or task.step != self.step
                            or (self._dropped and task.kind in (TaskKind.FORWARD, TaskKind.BACKWARD))
                        )
                        current_step = self.step
                    if stale:
                        log.info("dropping %s of step %d (current step %d)", task.kind.value, task.step,
                                 current_step)
                        continue
                    if task.kind in (TaskKind.FORWARD, TaskKind.BACKWARD):  # status: a slow op shows before it ends
                        last = task.kind is TaskKind.FORWARD and task.tasklet.assignment.is_last
                        self._running = (time.monotonic(), 2 if last else 1)
                    try:
                        self._task_handlers[task.kind](task.tasklet, task.step, *task.args)
                    finally:
                        self._running = None
            except ExchangeAbortedError as exc:
                log.info("%s of step %d abandoned: %s", task.kind.value, task.step, exc)
            except Exception as exc:  # one bad task must not kill the worker; the coordinator decides
                log.exception("%s of step %d failed", task.kind.value, task.step)
                self._report(task.tasklet, ctl.TaskError(task.kind.value, task.step, str(exc)[:500]))

    def _emulate(self, t: Tasklet, started: float, forward_units: float) -> None:
        """Stretch an op to the emulated device's time: forward_units x forward_flops / TFLOP/s."""
        elapsed = time.monotonic() - started
        tflops = t.assignment.emulate_tflops
        if tflops:
            target = forward_units * t.assignment.forward_flops / (tflops * 1e12)
            if target > elapsed:
                time.sleep(target - elapsed)
            else:
                self.stats["overrun_ops"] += 1
        self.stats["busy_s"] += time.monotonic() - started

    def _send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        """Push ``env`` asynchronously; a failure is reported to the coordinator, which checks the receiver."""

        def done(fut: Future[None]) -> None:
            exc = fut.exception()
            if exc is not None and not self.stopped.is_set():
                log.warning("send to %s failed: %s", endpoint, exc)
                self._report(t, ctl.PeerError(endpoint, str(exc)[:500]))

        self._client(endpoint).push_async(env, SEND_TIMEOUT_S).add_done_callback(done)

    def _do_forward(self, t: Tasklet, step: int, mb: int, x: torch.Tensor, speculative: bool = False) -> None:
        spec, a, compute = t.spec, t.assignment, t.compute
        started = time.monotonic()
        self.stats["forward"] += 1
        if speculative:
            compute.mark_tentative(mb)
        if not a.is_last:
            out = compute.forward(mb, x)
            self._emulate(t, started, 1.0)
            assert a.next is not None
            env = envelope(pb.ACTIVATION, t.key(step, mb), {"hidden": out}, compression=spec.compression)
            if speculative:
                env.meta[SPECULATIVE_META] = "1"
            self._send(t, a.next, env)
            return
        assert t.corpus is not None
        _, targets = microbatch(t.corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
        loss, grad_in = compute.forward_loss(mb, x, targets)
        self._emulate(t, started, 3.0)
        self.stats["backward"] += 1
        self._report(t, ctl.Loss(step, mb, loss))
        self._after_backward(t, step, mb, grad_in)

    def _do_backward(self, t: Tasklet, step: int, mb: int, grad_out: torch.Tensor) -> None:
        started = time.monotonic()
        grad_in = t.compute.backward(mb, grad_out)
        self._emulate(t, started, 2.0)
        self.stats["backward"] += 1
        self._after_backward(t, step, mb, grad_in)

    def _after_backward(self, t: Tasklet, step: int, mb: int, grad_in: torch.Tensor | None) -> None:
        a = t.assignment
        if not a.is_first:
            assert grad_in is not None and a.prev is not None
            env = envelope(pb.ACTIVATION_GRAD, t.key(step, mb), {"grad": grad_in}, compression=t.spec.compression)
            self._send(t, a.prev, env)
            return
        self._control_pool.submit(self._commit_to_pool, t, step, mb)

    def _commit_to_pool(self, t: Tasklet, step: int, mb: int) -> None:
        try:
            reply = self._client(t.assignment.coordinator).fetch(
                pb.COMMIT, t.key(step, mb), meta=ctl.pool_request_meta(ctl.Op.COMMIT), timeout_s=CONTROL_TIMEOUT_S
            )
            if ctl.pool_status(reply) is not ctl.PoolStatus.COMMITTED:
                log.warning("micro-batch %d of step %d: pool answered %s", mb, step, reply.meta.get("status"))
        except TransportError as exc:
            log.warning("commit of micro-batch %d of step %d failed: %s", mb, step, exc)
        finally:
            with self._inflight_cond:
                self._inflight -= 1
                self._inflight_cond.notify_all()

    def _do_drop(self, t: Tasklet, step: int) -> None:
        """This pipeline lost a member: forget the step's work; other pipelines redo its micro-batches."""
        with self._inflight_cond:
            self._dropped, self._known, self._grads_seen = True, set(), set()
            self._inflight_cond.notify_all()
        t.compute.reset_step()
        log.info("pipeline dropped from step %d; its work is discarded", step)

def _warm_up() -> None:
    """Pay torch's one-time lazy initialisation (about a second: optimizer and autograd machinery) while the
    peer waits for its first assignment, instead of inside it where every peer of a new plan pays it at once."""
    try:
        from peer.compute.model import ModelConfig

        tiny = StageCompute(StageComputeConfig(ModelConfig(n_layers=1, d_model=8, n_heads=1, seq_len=4), 0, 1))
        tiny.forward_loss(0, torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64))
        tiny.apply_update(tiny.accumulated_grad(), 1)
    except Exception:  # a warm-up must never take the worker down
        log.debug("warm-up failed", exc_info=True)


def _outer_state(spec: RunSpec, compute: StageCompute, fetched: OuterState | None) -> OuterState | None:
    """A new tasklet's outer-loop state (DiLoCo only). Fetched mid-round from a replica, the tasklet restarts the
    round's remaining inner steps from the round-start parameters: the replica it took the state from keeps its
    own inner progress, which must reach the outer average once, not twice."""
    if spec.sync_period <= 1:
        return None
    if fetched is None:
        return OuterState.start(compute.flat_params())
    if not torch.equal(fetched.anchor, compute.flat_params()):  # mid-round (or after a failed outer round)
        compute.set_params(fetched.anchor)
    return fetched


def _plan_order(assignment: Assignment) -> tuple[int, str]:
    """Plans are ordered by (epoch, leader id), as on the plan board (peer.swarm.plans)."""
    return assignment.epoch, assignment.leader
