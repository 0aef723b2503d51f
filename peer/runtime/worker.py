"""A stage worker: one peer's tasklet (one stage of one pipeline) served over gRPC.

Threads, and why there are this many:

* gRPC server threads run the handlers. They only *validate* what arrives (run, epoch, step, micro-batch,
  dtype, shape, NaN/inf) and queue it; a bad message is refused with a gRPC status and touches no state.
* One compute thread runs every forward, backward and optimizer step, one at a time — a GPU has one compute
  stream, and ``StageCompute`` is not thread-safe. Backward work goes first (priority 0), forward second:
  finishing micro-batches frees memory and feeds the pipeline's earlier stages, the 1F1B rule.
* On the first stage, a feeder thread leases micro-batches from the coordinator's task pool while fewer than
  ``n_stages`` are in flight (the 1F1B in-flight limit), and builds their tokens locally: data is a pure
  function of (seed, step, micro-batch).
* Sends are asynchronous (``push_async``) through per-destination link shapers, so a slow link never stalls
  compute; coordinator calls go through a small executor for the same reason.

A step: the coordinator sends ``start_step``; micro-batches flow; each stage adds a micro-batch's gradient to
its accumulator right after its backward (memory: one gradient); when the pool is complete the coordinator
sends ``reduce`` with the commit record and the participating pipelines; the worker checks its accumulator
holds exactly its pipeline's micro-batches, averages with the participants (``exchange.py``), keeps the summed
gradient and reports ``reduced``. Only when *every* stage has reduced does the coordinator send ``apply``: so
a death during the averaging never leaves some stages updated and others not. ``drop_step`` (its pipeline lost
a member) throws the step's work away; its micro-batches are redone by other pipelines.

Faults for tests: ``fault="nan-grad"`` makes this worker send NaN activation gradients and gradient shards,
the behaviour of a broken or malicious peer that the receivers must refuse and report.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from peer.compute.data import Corpus, microbatch
from peer.compute.stage import StageCompute, StageComputeConfig
from peer.net import PeerClient, PeerServer, TransportConfig
from peer.net.shaping import LinkTable
from peer.runtime.exchange import ExchangeAbortedError, GradientExchange, Tag
from peer.runtime.spec import Assignment, RunSpec, SpecError
from peer.runtime.wire import body_of, control, envelope, make_key, tensor_named
from protocol import tasklet_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadMessage, Rejected, TransportError

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 120.0
SEND_TIMEOUT_S = 120.0
CONTROL_TIMEOUT_S = 30.0
FETCH_STATE_TIMEOUT_S = 120.0
WORKER_TRANSPORT = dict(max_concurrent_streams=48, thread_pool_size=64, max_inflight_pushes=32)


class StageWorker:
    """Serves one tasklet. ``start()`` returns the endpoint; the coordinator assigns the stage over gRPC."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        peer_id: str = "",
        fault: str | None = None,
        device: str = "",
        max_envelope_bytes: int | None = None,
    ) -> None:
        if fault not in (None, "nan-grad"):
            raise ValueError(f"fault: unknown fault {fault!r} (known: nan-grad)")
        limits = {} if max_envelope_bytes is None else {"max_envelope_bytes": max_envelope_bytes}
        self.config = TransportConfig(host=host, port=port, **WORKER_TRANSPORT, **limits)
        self.peer_id = peer_id
        self.fault = fault
        self.device = device  # this peer's --device; empty: what the assignment says
        self.server = PeerServer(self.config)
        self.server.register_push(pb.STAGE_ASSIGNMENT, self._on_assignment)
        self.server.register_push(pb.OTHER, self._on_control)
        self.server.register_push(pb.ACTIVATION, self._on_activation)
        self.server.register_push(pb.ACTIVATION_GRAD, self._on_activation_grad)
        self.server.register_push(pb.GRAD_SHARD, self._on_grad_shard)
        self.server.register_push(pb.PARAM_SHARD, self._on_param_shard)
        self.server.register_fetch(pb.STAGE_STATE, self._on_fetch_state)
        self.server.set_status_provider(self.status)

        self.spec: RunSpec | None = None
        self.assignment: Assignment | None = None
        self.compute: StageCompute | None = None
        self.exchange: GradientExchange | None = None
        self._corpus: Corpus | None = None
        self._links: LinkTable | None = None
        self._links_table: dict[str, tuple[float, float]] = {}
        self._clients: dict[str, PeerClient] = {}
        # layers -> (compute, stage index): the current stage and the one held before the last assignment
        self._holdings: dict[tuple[int, int], tuple[StageCompute, int]] = {}

        self._lock = threading.Lock()  # guards step, known micro-batches, in-flight count, clients
        self._state_lock = threading.Lock()  # compute state vs. a concurrent STAGE_STATE fetch
        self._inflight_cond = threading.Condition(self._lock)
        self.step = -1
        self.round = 0
        self._dropped = False  # this pipeline was dropped from the current step
        self._reduced: tuple[int, torch.Tensor] | None = None  # (step, summed gradient) awaiting "apply"
        self._known: set[int] = set()
        self._inflight = 0
        self._tasks: queue.PriorityQueue[tuple[int, int, tuple[Any, ...]]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._control_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="worker-control")
        self.stopped = threading.Event()
        self._compute_thread = threading.Thread(target=self._compute_loop, name="compute", daemon=True)
        self.stats = {"forward": 0, "backward": 0, "busy_s": 0.0, "overrun_ops": 0}

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
        for client in self._clients.values():
            client.close()
        self.server.stop(grace=0.5)

    def status(self) -> dict[str, Any]:
        a = self.assignment
        return {
            "peer_id": self.peer_id,
            "stage": None if a is None else a.stage,
            "replica": None if a is None else a.replica,
            "layers": None if a is None else list(a.layers),
            "epoch": None if a is None else a.epoch,
            "step": self.step,
            "trained_steps": None if self.compute is None else self.compute.step,
            "pending_apply": None if self._reduced is None else self._reduced[0],
            **self.stats,
        }

    # ------------------------------------------------------------------------------------------ assignment
    def _on_assignment(self, env: pb.Envelope) -> None:
        """Take a (new) tasklet. ``state`` says where its parameters come from:

        ``keep`` (this peer already holds the stage at the run's trained step), ``init`` (step 0: the seeded
        initialiser, identical everywhere), or ``fetch`` from ``endpoint`` (a live replica of the stage, or the
        coordinator serving a checkpoint) — checked to be at the expected step before it is accepted.
        """
        body = body_of(env)
        try:
            spec = RunSpec.from_dict(body["run"])
            assignment = Assignment.from_dict(body["assignment"])
            source = body.get("state", {"source": "init", "step": 0})
            want_step = int(source.get("step", 0))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise BadMessage("meta.body", str(exc)) from None
            raise BadMessage("meta.body", f"assignment needs 'run' and 'assignment' objects ({exc})") from None
        if self.assignment is not None and assignment.epoch < self.assignment.epoch:
            raise Rejected(
                f"plan epoch {assignment.epoch} is older than this peer's epoch {self.assignment.epoch}; "
                "a newer leader has taken over"
            )
        with self._state_lock:
            same_stage = (
                self.compute is not None
                and self.spec == spec
                and self.assignment is not None
                and self.assignment.layers == assignment.layers
            )
            kind = source.get("source", "init")
            if kind == "keep":
                if not same_stage or self.compute is None or self.compute.step != want_step:
                    raise Rejected(
                        f"cannot keep stage {assignment.layers} at step {want_step}: this peer holds "
                        f"{None if self.assignment is None else self.assignment.layers} at step "
                        f"{None if self.compute is None else self.compute.step}"
                    )
                compute = self.compute
                compute.reset_step()
            else:
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
                if kind == "fetch":
                    self._load_from(compute, str(source["endpoint"]), spec, assignment, want_step)
                elif kind != "init" or want_step != 0:
                    raise BadMessage("meta.body", f"state source {kind!r} at step {want_step} is not valid")
            if (assignment.is_first or assignment.is_last) and self._corpus is None:
                corpus = Corpus.load(spec.corpus)
                if spec.corpus_fingerprint and corpus.fingerprint != spec.corpus_fingerprint:
                    raise Rejected(
                        f"corpus fingerprint {corpus.fingerprint[:12]} differs from the run's "
                        f"{spec.corpus_fingerprint[:12]} (a different Python or data path)"
                    )
                self._corpus = corpus
            with self._lock:
                previous = (
                    {}
                    if self.compute is None or self.assignment is None
                    else {self.assignment.layers: (self.compute, self.assignment.stage)}
                )
                self._holdings = {**previous, assignment.layers: (compute, assignment.stage)}
            self.compute = compute
            self.spec, self.assignment = spec, assignment
            self.exchange = GradientExchange(assignment.replica, compute.numel)
            links = dict(assignment.links)
            self._links = LinkTable(lambda dest: links.get(dest))
            with self._lock:
                self.step, self.round, self._dropped, self._reduced = -1, 0, False, None
                self._known = set()
                for client in self._clients.values():
                    client.close()
                self._clients.clear()
        log.info(
            "assigned stage %d (layers %s) of pipeline %d, epoch %d, state %s",
            assignment.stage,
            assignment.layers,
            assignment.replica,
            assignment.epoch,
            source,
        )

    def _load_from(self, compute: StageCompute, endpoint: str, spec: RunSpec, a: Assignment, step: int) -> None:
        """Fetch a stage's state from a live replica (or a checkpoint server) and load it."""
        client = PeerClient(endpoint, self.config, sender=self.peer_id)
        try:
            env = client.fetch(
                pb.STAGE_STATE,
                make_key(spec.run_id, a.epoch, step, stage=a.stage),
                meta={"layers": json.dumps(list(a.layers))},
                timeout_s=FETCH_STATE_TIMEOUT_S,
            )
        except TransportError as exc:
            raise Rejected(f"could not fetch stage {a.layers} from {endpoint}: {exc}") from None
        finally:
            client.close()
        state = state_from_envelope(env)
        if state["step"] != step:
            raise Rejected(f"{endpoint} holds stage {a.layers} at step {state['step']}, expected step {step}")
        try:
            compute.load_state_dict(state)
        except ValueError as exc:
            raise BadMessage("stage_state", str(exc)) from None

    def preload_corpus(self, corpus: Corpus) -> None:
        """Use an already loaded corpus (the daemon reads it at start-up to check its fingerprint)."""
        self._corpus = corpus

    def set_links(self, links: dict[str, tuple[float, float]]) -> None:
        """Shape traffic to these endpoints (rate bit/s, delay s) before any assignment, e.g. so that link
        probes of an emulated swarm measure the emulated links. An assignment replaces the table."""
        with self._lock:
            if self._links_table == links:
                return
            self._links_table = dict(links)
            self._links = LinkTable(lambda dest: self._links_table.get(dest))
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _client(self, endpoint: str) -> PeerClient:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                shaper = None if self._links is None else self._links.get(endpoint)
                client = PeerClient(endpoint, self.config, shaper=shaper, sender=self.peer_id)
                self._clients[endpoint] = client
            return client

    # ------------------------------------------------------------------------------------------- validation
    def _check_key(self, key: pb.Key) -> None:
        """Refuse work for another run, plan, step or pipeline (Rejected -> FAILED_PRECONDITION)."""
        if self.spec is None or self.assignment is None:
            raise Rejected("this peer has no stage assignment yet")
        if key.run_id != self.spec.run_id:
            raise Rejected(f"run {key.run_id!r} is not this peer's run {self.spec.run_id!r}")
        if key.epoch != self.assignment.epoch:
            raise Rejected(f"plan epoch {key.epoch} is not this peer's epoch {self.assignment.epoch}")
        if key.step != self.step:
            raise Rejected(f"step {key.step} is not the current step {self.step}")
        if self._dropped:
            raise Rejected(f"pipeline {self.assignment.replica} was dropped from step {self.step}")
        if key.replica != self.assignment.replica:
            raise Rejected(f"pipeline {key.replica} is not this peer's pipeline {self.assignment.replica}")
        if not 0 <= key.microbatch < self.spec.n_microbatches:
            raise Rejected(f"micro-batch {key.microbatch} is not in [0, {self.spec.n_microbatches})")

    def _decode(self, env: pb.Envelope, name: str, **expect: Any) -> torch.Tensor:
        """Decode a tensor; a malformed one (NaN, wrong shape, ...) is refused AND its sender reported."""
        try:
            return decode_tensor(tensor_named(env, name), **expect)
        except BadMessage as exc:
            if self.assignment is not None:
                self._report(
                    "bad_peer",
                    {"stage": env.key.stage, "replica": env.key.replica, "sender": env.sender, "error": str(exc)[:300]},
                )
            raise

    def _hidden(self, env: pb.Envelope, name: str) -> torch.Tensor:
        assert self.spec is not None and self.compute is not None
        m = self.spec.model
        return self._decode(
            env, name, expect_shape=(self.spec.micro_batch, m.seq_len, m.d_model), expect_dtype=self.compute.dtype
        )

    # ---------------------------------------------------------------------------------------- data handlers
    def _on_activation(self, env: pb.Envelope) -> None:
        self._check_key(env.key)
        assert self.assignment is not None
        if self.assignment.is_first:
            raise Rejected("the first stage takes no activations")
        x = self._hidden(env, "hidden")
        with self._lock:
            if env.key.microbatch in self._known:
                raise Rejected(f"micro-batch {env.key.microbatch} was already forwarded here this step")
            self._known.add(env.key.microbatch)
        self._put(1, ("forward", env.key.step, env.key.microbatch, x))

    def _on_activation_grad(self, env: pb.Envelope) -> None:
        self._check_key(env.key)
        assert self.assignment is not None
        if self.assignment.is_last:
            raise Rejected("the last stage takes no activation gradients")
        with self._lock:
            if env.key.microbatch not in self._known:
                raise Rejected(f"micro-batch {env.key.microbatch} was never forwarded here this step")
        g = self._hidden(env, "grad")
        self._put(0, ("backward", env.key.step, env.key.microbatch, g))

    def _shard_message(self, env: pb.Envelope) -> tuple[Tag, list[int], torch.Tensor]:
        key = env.key
        if self.spec is None or self.assignment is None or self.exchange is None:
            raise Rejected("this peer has no stage assignment yet")
        if key.run_id != self.spec.run_id or key.epoch != self.assignment.epoch:
            raise Rejected(f"run/epoch {key.run_id!r}/{key.epoch} is not this peer's")
        if key.stage != self.assignment.stage:
            raise Rejected(f"stage {key.stage} is not this peer's stage {self.assignment.stage}")
        if key.step != self.step:
            raise Rejected(f"step {key.step} is not the current step {self.step}")
        try:
            participants = [int(x) for x in json.loads(env.meta.get("participants", "[]"))]
            rnd = int(env.meta.get("round", ""))
        except (ValueError, TypeError):
            raise BadMessage("meta", "round and participants must be an integer and a JSON list") from None
        return (key.step, rnd), participants, self._decode(env, "grad", expect_dtype=torch.float32)

    def _on_grad_shard(self, env: pb.Envelope) -> None:
        tag, participants, shard = self._shard_message(env)
        assert self.exchange is not None
        self.exchange.put_contribution(tag, participants, env.key.replica, shard, list(env.microbatches))

    def _on_param_shard(self, env: pb.Envelope) -> None:
        tag, participants, shard = self._shard_message(env)
        assert self.exchange is not None
        self.exchange.put_reduced(tag, participants, env.key.replica, shard)

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
            spec = self.spec
        if held is None or spec is None:
            raise Rejected(f"this peer holds no stage with layers {list(layers)}")
        compute, stage = held
        return state_envelope(compute.state_dict(), spec.run_id, request.key.epoch, stage)

    # --------------------------------------------------------------------------------------------- control
    def _on_control(self, env: pb.Envelope) -> None:
        op = env.meta.get("op", "")
        body = body_of(env)
        if op == "stop":
            self.stopped.set()
            return
        if self.spec is None or self.assignment is None:
            raise Rejected("this peer has no stage assignment yet")
        if env.key.epoch != self.assignment.epoch:
            raise Rejected(f"plan epoch {env.key.epoch} is not this peer's epoch {self.assignment.epoch}")
        try:
            step = int(body["step"])
            if op == "start_step":
                self._start_step(step, int(body.get("round", 0)), bool(body.get("feed", False)))
            elif op == "drop_step":
                self._put(0, ("drop", step))
            elif op == "reduce":
                assignment = {int(mb): int(p) for mb, p in body["assignment"].items()}
                participants = [int(x) for x in body["participants"]]
                self._put(0, ("reduce", step, int(body["round"]), assignment, participants))
            elif op == "apply":
                self._put(0, ("apply", step))
            else:
                raise BadMessage("meta.op", f"unknown control operation {op!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, BadMessage):
                raise
            raise BadMessage("meta.body", f"malformed {op} ({exc!r})") from None

    def _start_step(self, step: int, rnd: int, feed: bool) -> None:
        assert self.assignment is not None
        if feed and not self.assignment.is_first:
            raise Rejected("only a first stage feeds micro-batches")
        with self._lock:
            if step < self.step:
                raise Rejected(f"step {step} is before the current step {self.step}")
            if step > self.step:
                if self._reduced is not None or (self.compute is not None and self.compute.step != step):
                    raise Rejected(
                        f"cannot start step {step}: this stage has trained "
                        f"{None if self.compute is None else self.compute.step} steps"
                    )
                self.step, self._dropped, self._known = step, False, set()
            if self._dropped:
                raise Rejected(f"pipeline {self.assignment.replica} was dropped from step {step}")
            self.round = rnd
            self._inflight = 0
        if self.exchange is not None:
            self.exchange.abort_before((step, rnd))
        if feed:
            threading.Thread(target=self._feed, args=(step, rnd), name=f"feeder-{step}.{rnd}", daemon=True).start()

    def _put(self, priority: int, task: tuple[Any, ...]) -> None:
        self._tasks.put((priority, next(self._seq), task))

    def _coordinator(self) -> PeerClient:
        assert self.assignment is not None
        return self._client(self.assignment.coordinator)

    def _report(self, op: str, body: dict[str, Any]) -> Future[None]:
        """Send a report to the coordinator without blocking the caller."""
        assert self.spec is not None and self.assignment is not None
        env = control(
            op,
            self.spec.run_id,
            self.assignment.epoch,
            self.step,
            body,
            stage=self.assignment.stage,
            replica=self.assignment.replica,
        )
        return self._control_pool.submit(self._coordinator().push, env, CONTROL_TIMEOUT_S)

    # ---------------------------------------------------------------------------------------------- feeder
    def _feed(self, step: int, rnd: int) -> None:
        """Lease micro-batches for this pipeline while fewer than n_stages are in flight."""
        assert self.spec is not None and self.assignment is not None and self._corpus is not None
        spec, a = self.spec, self.assignment
        window = a.n_stages
        key = make_key(spec.run_id, a.epoch, step, stage=0, replica=a.replica)

        def current() -> bool:
            return self.step == step and self.round == rnd and not self._dropped and not self.stopped.is_set()

        while current():
            with self._inflight_cond:
                while self._inflight >= window and current():
                    self._inflight_cond.wait(0.5)
                if not current():
                    return
            try:
                reply = self._coordinator().fetch(pb.COMMIT, key, meta={"op": "lease"}, timeout_s=CONTROL_TIMEOUT_S)
            except TransportError as exc:
                log.warning("lease request for step %d failed: %s", step, exc)
                time.sleep(0.5)
                continue
            status = reply.meta.get("status")
            if status == "done":
                return
            if status != "lease":
                time.sleep(0.02)
                continue
            mb = reply.key.microbatch
            tokens, _ = microbatch(self._corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
            with self._lock:
                if not current():
                    return
                self._known.add(mb)
                self._inflight += 1
            self._put(1, ("forward", step, mb, tokens))

    # ------------------------------------------------------------------------------------- compute thread
    def _compute_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                _, _, task = self._tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if task[1] != self.step or (self._dropped and task[0] in ("forward", "backward")):
                    log.info("dropping %s of step %d (current step %d)", task[0], task[1], self.step)
                    continue
                with self._state_lock:
                    getattr(self, f"_do_{task[0]}")(*task[1:])
            except ExchangeAbortedError as exc:
                log.info("%s of step %d abandoned: %s", task[0], task[1], exc)
            except Exception as exc:  # one bad task must not kill the worker; the coordinator decides
                log.exception("%s of step %d failed", task[0], task[1])
                if self.assignment is not None:
                    self._report("error", {"what": task[0], "step": task[1], "error": str(exc)[:500]})

    def _emulate(self, started: float, forward_units: float) -> None:
        """Stretch an op to the emulated device's time: forward_units x forward_flops / TFLOP/s."""
        assert self.assignment is not None
        elapsed = time.monotonic() - started
        tflops = self.assignment.emulate_tflops
        if tflops:
            target = forward_units * self.assignment.forward_flops / (tflops * 1e12)
            if target > elapsed:
                time.sleep(target - elapsed)
            else:
                self.stats["overrun_ops"] += 1
        self.stats["busy_s"] += time.monotonic() - started

    def _send(self, endpoint: str, env: pb.Envelope) -> None:
        def done(fut: Future[None]) -> None:
            exc = fut.exception()
            if exc is not None and not self.stopped.is_set():
                log.warning("send to %s failed: %s", endpoint, exc)
                self._report("peer_error", {"endpoint": endpoint, "error": str(exc)[:500]})

        self._client(endpoint).push_async(env, SEND_TIMEOUT_S).add_done_callback(done)

    def _key(self, step: int, mb: int) -> pb.Key:
        assert self.spec is not None and self.assignment is not None
        return make_key(
            self.spec.run_id, self.assignment.epoch, step, mb, self.assignment.stage, self.assignment.replica
        )

    def _outgoing_grad(self, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan")) if self.fault == "nan-grad" else t

    def _do_forward(self, step: int, mb: int, x: torch.Tensor) -> None:
        assert self.spec is not None and self.assignment is not None and self.compute is not None
        spec, a, compute = self.spec, self.assignment, self.compute
        started = time.monotonic()
        self.stats["forward"] += 1
        if not a.is_last:
            out = compute.forward(mb, x)
            self._emulate(started, 1.0)
            assert a.next is not None
            self._send(
                a.next, envelope(pb.ACTIVATION, self._key(step, mb), {"hidden": out}, compression=spec.compression)
            )
            return
        assert self._corpus is not None
        _, targets = microbatch(self._corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
        loss, grad_in = compute.forward_loss(mb, x, targets)
        compute.commit(mb)
        self._emulate(started, 3.0)
        self.stats["backward"] += 1
        self._report("loss", {"step": step, "microbatch": mb, "loss": loss})
        self._after_backward(step, mb, grad_in)

    def _do_backward(self, step: int, mb: int, grad_out: torch.Tensor) -> None:
        assert self.compute is not None
        started = time.monotonic()
        grad_in = self.compute.backward(mb, grad_out)
        self.compute.commit(mb)
        self._emulate(started, 2.0)
        self.stats["backward"] += 1
        self._after_backward(step, mb, grad_in)

    def _after_backward(self, step: int, mb: int, grad_in: torch.Tensor | None) -> None:
        assert self.spec is not None and self.assignment is not None
        if not self.assignment.is_first:
            assert grad_in is not None and self.assignment.prev is not None
            self._send(
                self.assignment.prev,
                envelope(
                    pb.ACTIVATION_GRAD,
                    self._key(step, mb),
                    {"grad": self._outgoing_grad(grad_in)},
                    compression=self.spec.compression,
                ),
            )
            return
        self._control_pool.submit(self._commit_to_pool, step, mb)

    def _commit_to_pool(self, step: int, mb: int) -> None:
        try:
            reply = self._coordinator().fetch(
                pb.COMMIT, self._key(step, mb), meta={"op": "commit"}, timeout_s=CONTROL_TIMEOUT_S
            )
            if reply.meta.get("status") != "committed":
                log.warning("micro-batch %d of step %d: pool answered %s", mb, step, reply.meta.get("status"))
        except TransportError as exc:
            log.warning("commit of micro-batch %d of step %d failed: %s", mb, step, exc)
        finally:
            with self._inflight_cond:
                self._inflight -= 1
                self._inflight_cond.notify_all()

    def _do_drop(self, step: int) -> None:
        """This pipeline lost a member: forget the step's work; other pipelines redo its micro-batches."""
        assert self.compute is not None
        with self._lock:
            self._dropped, self._known = True, set()
        with self._inflight_cond:
            self._inflight_cond.notify_all()
        self.compute.reset_step()
        log.info("pipeline dropped from step %d; its work is discarded", step)

    def _do_reduce(self, step: int, rnd: int, assignment: dict[int, int], participants: list[int]) -> None:
        """Check exactly-once locally, then reduce-scatter + all-gather with the participants; keep the sum."""
        assert self.spec is not None and self.assignment is not None
        assert self.compute is not None and self.exchange is not None
        a, compute, exchange = self.assignment, self.compute, self.exchange
        mine = sorted(compute.committed())
        expected = sorted(mb for mb, p in assignment.items() if p == a.replica)
        if mine != expected:
            raise RuntimeError(
                f"step {step}: accumulator holds micro-batches {mine}, the pool committed "
                f"{expected} for pipeline {a.replica}"
            )
        tag: Tag = (step, rnd)
        flat = compute.accumulated_grad()
        meta = {"round": str(rnd), "participants": json.dumps(participants)}
        for r in participants:
            lo, hi = exchange.shard_of(participants, r)
            if r == a.replica:
                exchange.put_contribution(tag, participants, r, flat[lo:hi].clone(), mine)
            else:
                env = envelope(
                    pb.GRAD_SHARD, self._key(step, -1), {"grad": self._outgoing_grad(flat[lo:hi])}, microbatches=mine
                )
                env.meta.update(meta)
                self._send(a.group[r], env)
        reduced = exchange.reduce(tag, participants, self.spec.n_microbatches, SYNC_TIMEOUT_S)
        for r in participants:
            if r == a.replica:
                exchange.put_reduced(tag, participants, r, reduced)
            else:
                env = envelope(pb.PARAM_SHARD, self._key(step, -1), {"grad": reduced})
                env.meta.update(meta)
                self._send(a.group[r], env)
        self._reduced = (step, exchange.gather(tag, participants, SYNC_TIMEOUT_S))
        self._report("reduced", {"step": step, "round": rnd})

    def _do_apply(self, step: int) -> None:
        """Apply the reduced gradient of ``step`` (idempotent: a repeated apply only re-reports)."""
        assert self.spec is not None and self.compute is not None
        if self.compute.step == step + 1 and self._reduced is None:
            self._report("synced", {"step": step, "trained_steps": self.compute.step})
            return
        if self._reduced is None or self._reduced[0] != step:
            raise RuntimeError(f"apply of step {step}, but no reduced gradient of that step is held")
        self.compute.apply_update(self._reduced[1], self.spec.n_microbatches)
        self._reduced = None
        self._report("synced", {"step": step, "trained_steps": self.compute.step})


def _warm_up() -> None:
    """Pay torch's one-time lazy initialisation (about a second: optimizer and autograd machinery) while the
    peer waits for its first assignment, instead of inside it where every peer of a new plan pays it at once."""
    try:
        from peer.compute.model import ModelConfig

        tiny = StageCompute(StageComputeConfig(ModelConfig(n_layers=1, d_model=8, n_heads=1, seq_len=4), 0, 1))
        loss, _ = tiny.forward_loss(0, torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64))
        tiny.commit(0)
        tiny.apply_update(tiny.accumulated_grad(), 1)
    except Exception:  # a warm-up must never take the worker down
        log.debug("warm-up failed", exc_info=True)


def state_envelope(state: dict[str, Any], run_id: str, epoch: int, stage: int, replica: int = -1) -> pb.Envelope:
    """A STAGE_STATE envelope: flat tensors plus the scalar fields as JSON."""
    meta = {k: state[k] for k in ("format", "model", "layers", "step", "adam_step")}
    key = make_key(run_id, epoch, int(state["step"]), stage=stage, replica=replica)
    tensors = {k: state[k] for k in ("params", "exp_avg", "exp_avg_sq")}
    return envelope(pb.STAGE_STATE, key, tensors, body=meta)


def state_from_envelope(env: pb.Envelope) -> dict[str, Any]:
    """Inverse of :func:`state_envelope` (tensors checked: float32, finite)."""
    state: dict[str, Any] = dict(body_of(env))
    for name in ("params", "exp_avg", "exp_avg_sq"):
        state[name] = decode_tensor(tensor_named(env, name), expect_dtype=torch.float32)
    if not isinstance(state.get("step"), int):
        raise BadMessage("meta.body.step", "missing or not an integer")
    return state
