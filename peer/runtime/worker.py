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
sends ``sync`` with the commit record; the worker checks its accumulator holds exactly its pipeline's
micro-batches, averages with its replicas (``exchange.py``), steps AdamW and reports ``synced``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from peer.data import Corpus, microbatch
from peer.runtime.exchange import GradientExchange
from peer.runtime.spec import Assignment, RunSpec, SpecError
from peer.runtime.wire import body_of, control, envelope, make_key, tensor_named
from peer.shaping import LinkTable
from peer.stage_compute import StageCompute, StageComputeConfig, shard_bounds
from peer.transport import PeerClient, PeerServer, TransportConfig
from protocol import tasklet_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadMessage, Rejected, TransportError

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 120.0
SEND_TIMEOUT_S = 120.0
CONTROL_TIMEOUT_S = 30.0
WORKER_TRANSPORT = dict(max_concurrent_streams=48, thread_pool_size=64, max_inflight_pushes=32)


class StageWorker:
    """Serves one tasklet. ``start()`` returns the endpoint; the coordinator assigns the stage over gRPC."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, peer_id: str = "") -> None:
        self.config = TransportConfig(host=host, port=port, **WORKER_TRANSPORT)
        self.peer_id = peer_id
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
        self._clients: dict[str, PeerClient] = {}

        self._lock = threading.Lock()  # guards step, known micro-batches, in-flight count, clients
        self._state_lock = threading.Lock()  # compute state vs. a concurrent STAGE_STATE fetch
        self._inflight_cond = threading.Condition(self._lock)
        self.step = -1
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
        return self.server.endpoint

    def stop(self) -> None:
        self.stopped.set()
        with self._inflight_cond:
            self._inflight_cond.notify_all()
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
            "step": self.step,
            "trained_steps": None if self.compute is None else self.compute.step,
            **self.stats,
        }

    # ------------------------------------------------------------------------------------------ assignment
    def _on_assignment(self, env: pb.Envelope) -> None:
        body = body_of(env)
        try:
            spec = RunSpec.from_dict(body["run"])
            assignment = Assignment.from_dict(body["assignment"])
        except (KeyError, TypeError) as exc:
            raise BadMessage("meta.body", f"assignment needs 'run' and 'assignment' objects ({exc})") from None
        except SpecError as exc:
            raise BadMessage("meta.body", str(exc)) from None
        with self._state_lock:
            same_stage = (self.compute is not None and self.spec == spec
                          and self.assignment is not None and self.assignment.layers == assignment.layers)
            if not same_stage:
                self.compute = StageCompute(StageComputeConfig(
                    model=spec.model, first_layer=assignment.layers[0], last_layer=assignment.layers[1],
                    optim=spec.optim, device=assignment.device, precision=spec.precision))
            if (assignment.is_first or assignment.is_last) and (self._corpus is None or not same_stage):
                self._corpus = Corpus.load(spec.corpus)
                if spec.corpus_fingerprint and self._corpus.fingerprint != spec.corpus_fingerprint:
                    raise Rejected(f"corpus fingerprint {self._corpus.fingerprint[:12]} differs from the run's "
                                   f"{spec.corpus_fingerprint[:12]} (a different Python or data path)")
            self.spec, self.assignment = spec, assignment
            assert self.compute is not None
            self.exchange = GradientExchange(assignment.replica, assignment.n_replicas,
                                             shard_bounds(self.compute.numel, assignment.n_replicas))
            links = dict(assignment.links)
            self._links = LinkTable(lambda dest: links.get(dest))
            with self._lock:
                for client in self._clients.values():
                    client.close()
                self._clients.clear()
        log.info("assigned stage %d (layers %s) of pipeline %d, epoch %d", assignment.stage,
                 assignment.layers, assignment.replica, assignment.epoch)

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
        """Refuse work for another run, plan or step (Rejected -> FAILED_PRECONDITION)."""
        if self.spec is None or self.assignment is None:
            raise Rejected("this peer has no stage assignment yet")
        if key.run_id != self.spec.run_id:
            raise Rejected(f"run {key.run_id!r} is not this peer's run {self.spec.run_id!r}")
        if key.epoch != self.assignment.epoch:
            raise Rejected(f"plan epoch {key.epoch} is not this peer's epoch {self.assignment.epoch}")
        if key.step != self.step:
            raise Rejected(f"step {key.step} is not the current step {self.step}")
        if key.replica != self.assignment.replica:
            raise Rejected(f"pipeline {key.replica} is not this peer's pipeline {self.assignment.replica}")
        if not 0 <= key.microbatch < self.spec.n_microbatches:
            raise Rejected(f"micro-batch {key.microbatch} is not in [0, {self.spec.n_microbatches})")

    def _hidden(self, env: pb.Envelope, name: str) -> torch.Tensor:
        assert self.spec is not None and self.compute is not None
        m = self.spec.model
        return decode_tensor(tensor_named(env, name), expect_shape=(self.spec.micro_batch, m.seq_len, m.d_model),
                             expect_dtype=self.compute.dtype)

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

    def _on_grad_shard(self, env: pb.Envelope) -> None:
        key = env.key
        self._check_group_key(key)
        assert self.exchange is not None
        shard = decode_tensor(tensor_named(env, "grad"), expect_dtype=torch.float32)
        self.exchange.put_contribution(key.step, key.replica, shard, list(env.microbatches))

    def _on_param_shard(self, env: pb.Envelope) -> None:
        key = env.key
        self._check_group_key(key)
        assert self.exchange is not None
        shard = decode_tensor(tensor_named(env, "grad"), expect_dtype=torch.float32)
        self.exchange.put_reduced(key.step, key.replica, shard)

    def _check_group_key(self, key: pb.Key) -> None:
        if self.spec is None or self.assignment is None:
            raise Rejected("this peer has no stage assignment yet")
        if key.run_id != self.spec.run_id or key.epoch != self.assignment.epoch:
            raise Rejected(f"run/epoch {key.run_id!r}/{key.epoch} is not this peer's")
        if key.stage != self.assignment.stage:
            raise Rejected(f"stage {key.stage} is not this peer's stage {self.assignment.stage}")
        if key.step != self.step:
            raise Rejected(f"step {key.step} is not the current step {self.step}")

    def _on_fetch_state(self, request: pb.FetchRequest) -> pb.Envelope:
        with self._state_lock:
            if self.compute is None or self.spec is None or self.assignment is None:
                raise Rejected("this peer holds no stage yet")
            state = self.compute.state_dict()
            a = self.assignment
        meta = {k: state[k] for k in ("format", "model", "layers", "step", "adam_step")}
        key = make_key(self.spec.run_id, a.epoch, self.step, stage=a.stage, replica=a.replica)
        tensors = {k: state[k] for k in ("params", "exp_avg", "exp_avg_sq")}
        return envelope(pb.STAGE_STATE, key, tensors, body=meta)

    # --------------------------------------------------------------------------------------------- control
    def _on_control(self, env: pb.Envelope) -> None:
        op = env.meta.get("op", "")
        body = body_of(env)
        if op == "start_step":
            self._start_step(int(body["step"]), bool(body.get("feed", False)))
        elif op == "sync":
            self._check_group_key(make_key(env.key.run_id, env.key.epoch, int(body["step"]),
                                           stage=self.assignment.stage if self.assignment else -1))
            assignment = {int(mb): int(p) for mb, p in body["assignment"].items()}
            self._put(0, ("sync", int(body["step"]), assignment))
        elif op == "stop":
            self.stopped.set()
        else:
            raise BadMessage("meta.op", f"unknown control operation {op!r}")

    def _start_step(self, step: int, feed: bool) -> None:
        if self.assignment is None:
            raise Rejected("this peer has no stage assignment yet")
        with self._lock:
            if step <= self.step and not feed:
                raise Rejected(f"step {step} is not after the current step {self.step}")
            self.step = step
            self._known = set()
            self._inflight = 0
        if feed:
            if not self.assignment.is_first:
                raise Rejected("only a first stage feeds micro-batches")
            threading.Thread(target=self._feed, args=(step,), name=f"feeder-{step}", daemon=True).start()

    def _put(self, priority: int, task: tuple[Any, ...]) -> None:
        self._tasks.put((priority, next(self._seq), task))

    def _coordinator(self) -> PeerClient:
        assert self.assignment is not None
        return self._client(self.assignment.coordinator)

    def _report(self, op: str, body: dict[str, Any]) -> Future[None]:
        """Send a report to the coordinator without blocking the caller."""
        assert self.spec is not None and self.assignment is not None
        env = control(op, self.spec.run_id, self.assignment.epoch, self.step, body,
                      stage=self.assignment.stage, replica=self.assignment.replica)
        return self._control_pool.submit(self._coordinator().push, env, CONTROL_TIMEOUT_S)

    # ---------------------------------------------------------------------------------------------- feeder
    def _feed(self, step: int) -> None:
        """Lease micro-batches for this pipeline while fewer than n_stages are in flight."""
        assert self.spec is not None and self.assignment is not None and self._corpus is not None
        spec, a = self.spec, self.assignment
        window = a.n_stages
        key = make_key(spec.run_id, a.epoch, step, stage=0, replica=a.replica)
        while not self.stopped.is_set():
            with self._inflight_cond:
                while self._inflight >= window and self.step == step and not self.stopped.is_set():
                    self._inflight_cond.wait(0.5)
                if self.step != step or self.stopped.is_set():
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
                if self.step != step:
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
                if task[1] != self.step:
                    log.info("dropping %s of step %d (current step %d)", task[0], task[1], self.step)
                    continue
                with self._state_lock:
                    getattr(self, f"_do_{task[0]}")(*task[1:])
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
            if exc is not None:
                log.warning("send to %s failed: %s", endpoint, exc)
                self._report("peer_error", {"endpoint": endpoint, "error": str(exc)[:500]})
        self._client(endpoint).push_async(env, SEND_TIMEOUT_S).add_done_callback(done)

    def _key(self, step: int, mb: int) -> pb.Key:
        assert self.spec is not None and self.assignment is not None
        return make_key(self.spec.run_id, self.assignment.epoch, step, mb, self.assignment.stage,
                        self.assignment.replica)

    def _do_forward(self, step: int, mb: int, x: torch.Tensor) -> None:
        assert self.spec is not None and self.assignment is not None and self.compute is not None
        spec, a, compute = self.spec, self.assignment, self.compute
        started = time.monotonic()
        self.stats["forward"] += 1
        if not a.is_last:
            out = compute.forward(mb, x)
            self._emulate(started, 1.0)
            self._send(a.next, envelope(pb.ACTIVATION, self._key(step, mb), {"hidden": out},  # type: ignore[arg-type]
                                        compression=spec.compression))
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
            assert grad_in is not None
            self._send(self.assignment.prev, envelope(  # type: ignore[arg-type]
                pb.ACTIVATION_GRAD, self._key(step, mb), {"grad": grad_in}, compression=self.spec.compression))
            return
        self._control_pool.submit(self._commit_to_pool, step, mb)

    def _commit_to_pool(self, step: int, mb: int) -> None:
        assert self.assignment is not None
        try:
            reply = self._coordinator().fetch(pb.COMMIT, self._key(step, mb), meta={"op": "commit"},
                                              timeout_s=CONTROL_TIMEOUT_S)
            if reply.meta.get("status") != "committed":
                log.warning("micro-batch %d of step %d: pool answered %s", mb, step, reply.meta.get("status"))
        except TransportError as exc:
            log.warning("commit of micro-batch %d of step %d failed: %s", mb, step, exc)
        finally:
            with self._inflight_cond:
                self._inflight -= 1
                self._inflight_cond.notify_all()

    def _do_sync(self, step: int, assignment: dict[int, int]) -> None:
        """Check exactly-once locally, reduce-scatter + all-gather with the group, step AdamW, report."""
        assert self.spec is not None and self.assignment is not None
        assert self.compute is not None and self.exchange is not None
        a, compute, exchange = self.assignment, self.compute, self.exchange
        mine = sorted(compute.committed())
        expected = sorted(mb for mb, p in assignment.items() if p == a.replica)
        if mine != expected:
            raise RuntimeError(f"step {step}: accumulator holds micro-batches {mine}, the pool committed "
                               f"{expected} for pipeline {a.replica}")
        flat = compute.accumulated_grad()
        for r, (lo, hi) in enumerate(exchange.bounds):
            if r == a.replica:
                exchange.put_contribution(step, r, flat[lo:hi].clone(), mine)
            else:
                self._send(a.group[r], envelope(pb.GRAD_SHARD, self._key(step, -1), {"grad": flat[lo:hi].clone()},
                                                microbatches=mine))
        reduced = exchange.reduce(step, self.spec.n_microbatches, SYNC_TIMEOUT_S)
        for r in range(a.n_replicas):
            if r == a.replica:
                exchange.put_reduced(step, r, reduced)
            else:
                self._send(a.group[r], envelope(pb.PARAM_SHARD, self._key(step, -1), {"grad": reduced}))
        summed = exchange.gather(step, SYNC_TIMEOUT_S)
        compute.apply_update(summed, self.spec.n_microbatches)
        self._report("synced", {"step": step, "trained_steps": compute.step})
