"""Intake: everything a worker receives is checked here before it touches any state.

gRPC server threads run these checks. A push is first admitted by role (``admit_push``, before it is
buffered): the caller is the peer its mutual-TLS certificate proves, and each Kind is taken only from the peer
the current plan gives that role (peer.runtime.roles), up to the Kind's size bound (peer.runtime.bounds). Then
the message is validated (run, epoch, step, micro-batch, dtype, shape, NaN/inf) against the snapshot and the
step (:class:`WorkerStep`), and queued for the compute thread; a bad message is refused with a gRPC status
(Rejected, BadMessage, Forbidden) and a malformed tensor's sender is reported to the coordinator.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.bounds import push_limits
from tasklet.peer.runtime.checkpoints import copy_part_bound_bytes
from tasklet.peer.runtime.control import SPECULATIVE_META
from tasklet.peer.runtime.grants import read_grant
from tasklet.peer.runtime.stage.exchange import DIGEST_META, parse_digest
from tasklet.peer.runtime.stage.gradient_checks import Tag
from tasklet.peer.runtime.stage.loop import Task
from tasklet.peer.runtime.stage.outbox import Outbox
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.step import Work, WorkerStep
from tasklet.peer.runtime.stage.tied import ATTEMPT_META
from tasklet.peer.runtime.wire import tensor_named
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor
from tasklet.protocol.errors import BadMessage, Forbidden, Rejected

EARLY_SHARD_WAIT_S = 5.0  # a shard that ran ahead of this peer's start of its step waits this long for it
TIED_ROLE = "the other end of this pipeline's tied embedding"


class Intake:
    """A worker's checks of what it receives (module docstring).

    ``controllers`` and ``may_assign`` name the peers besides the current plan's coordinator that may assign
    this worker (and stop it); ``keeps_copies`` whether it takes checkpoint copies; ``current`` gives the
    snapshot, ``step``/``cond`` the step bookkeeping and its lock; valid work goes to ``put``."""

    def __init__(self, tls: TlsContext, controllers: frozenset[str], keeps_copies: bool,
                 current: Callable[[], Tasklet | None], step: WorkerStep, cond: threading.Condition,
                 outbox: Outbox, put: Callable[[Task], None]) -> None:
        self.tls, self.controllers, self.keeps_copies = tls, controllers, keeps_copies
        self.may_assign: Callable[[str], bool] | None = None  # set by accept_assignments_from
        self._current, self.step, self.cond, self.outbox, self.put = current, step, cond, outbox, put

    # ------------------------------------------------------------------------------------------ authority
    def accept_assignments_from(self, may_assign: Callable[[str], bool] | None) -> None:
        """Who else may assign this worker and stop it (the daemon: the elected leader); None: nobody else."""
        self.may_assign = may_assign

    def require_controller(self, caller: str, what: str) -> None:
        """Assignments (and a stop) come from the current plan's coordinator, a controller named at start-up,
        whatever ``may_assign`` accepts (the daemon: the elected leader), or this process itself."""
        t = self._current()
        if caller == self.tls.peer_id or caller in self.controllers:
            return
        if t is not None and caller == t.roles.peer(t.assignment.coordinator):
            return
        if self.may_assign is not None and self.may_assign(caller):
            return
        raise Forbidden(f"{what} is taken only from the coordinator of the current plan; peer {caller} is not")

    def check_grant(self, request: pb.FetchRequest, t: Tasklet, layers: tuple[int, int]) -> None:
        """A fetch outside our plan's roles needs a grant signed by a peer we take control from, for this
        caller, these layers and this run, of our plan's epoch or a newer one."""
        grant = read_grant(request.meta["grant"], self.tls)
        self.require_controller(grant.signer, "a fetch grant")
        if grant.peer != request.sender or grant.layers != layers or grant.run_id != t.spec.run_id:
            raise Forbidden(f"the grant is for peer {grant.peer}, layers {list(grant.layers)} of run {grant.run_id!r}")
        if grant.epoch < t.assignment.epoch:
            raise Forbidden(f"the grant is of plan epoch {grant.epoch}, older than this peer's {t.assignment.epoch}")

    def admit_push(self, kind: int, caller: str) -> int:
        """Before a push is buffered: the caller must have a role for its Kind; the size bound of the Kind."""
        t = self._current()
        if kind in (pb.STAGE_ASSIGNMENT, pb.CONTROL, pb.CHECKPOINT):
            self.require_controller(caller, f"a {pb.Kind.Name(kind)} message")
            if kind == pb.CHECKPOINT:
                return 0 if t is None or not self.keeps_copies else copy_part_bound_bytes()
        elif t is not None:
            a, what = t.assignment, f"a {pb.Kind.Name(kind) if kind in pb.Kind.values() else kind} message"
            senders = {pb.ACTIVATION: ([a.prev], "the upstream neighbour"),
                       pb.ACTIVATION_GRAD: ([a.next], "the downstream neighbour"),
                       pb.GRAD_SHARD: (list(a.group), "this stage's group"),
                       pb.PARAM_SHARD: (list(a.group), "this stage's group"),
                       pb.TIED_GRAD: ([t.exchange.tied.partner] if t.exchange.tied else [], TIED_ROLE)}.get(kind)
            if senders is not None:
                t.roles.require(caller, senders[0], senders[1], what)
        return push_limits(None if t is None else t.spec, 0 if t is None else t.compute.numel).get(kind, 0)

    def current(self) -> Tasklet:
        t = self._current()
        if t is None:
            raise Rejected("this peer has no stage assignment yet")
        return t

    def control(self, env: pb.Envelope) -> tuple[Tasklet | None, ctl.Message]:
        """A control message from a controller, of this peer's plan epoch (a stop needs no assignment)."""
        msg = ctl.decode(env, ctl.TO_WORKER)
        if isinstance(msg, ctl.Stop):
            self.require_controller(env.sender, "a stop")
            return None, msg
        self.require_controller(env.sender, f"control message {msg.op.value!r}")
        t = self.current()
        if env.key.epoch != t.assignment.epoch:
            raise Rejected(f"plan epoch {env.key.epoch} is not this peer's epoch {t.assignment.epoch}")
        return t, msg

    # ------------------------------------------------------------------------------------------ validation
    def _check_key(self, t: Tasklet, key: pb.Key) -> None:
        """Refuse work for another run, plan, step or pipeline (Rejected -> FAILED_PRECONDITION)."""
        spec, a = t.spec, t.assignment
        if key.run_id != spec.run_id:
            raise Rejected(f"run {key.run_id!r} is not this peer's run {spec.run_id!r}")
        if key.epoch != a.epoch:
            raise Rejected(f"plan epoch {key.epoch} is not this peer's epoch {a.epoch}")
        with self.cond:
            if self._current() is not t:
                raise Rejected("this peer took a new assignment meanwhile")
            self.step.check_current(key.step)
        if key.replica != a.replica:
            raise Rejected(f"pipeline {key.replica} is not this peer's pipeline {a.replica}")
        if not 0 <= key.microbatch < spec.n_microbatches:
            raise Rejected(f"micro-batch {key.microbatch} is not in [0, {spec.n_microbatches})")

    def _decode(self, t: Tasklet, env: pb.Envelope, name: str, **expect: Any) -> torch.Tensor:
        """Decode a tensor; a malformed one (NaN, wrong shape, ...) is refused AND its sender reported."""
        try:
            return decode_tensor(tensor_named(env, name), **expect)
        except BadMessage as exc:
            self.outbox.report(t, ctl.BadPeer(env.key.stage, env.key.replica, env.sender, str(exc)[:300]))
            raise

    def _hidden(self, t: Tasklet, env: pb.Envelope, name: str) -> torch.Tensor:
        m = t.spec.model
        shape = (t.spec.micro_batch, m.seq_len, m.d_model)
        return self._decode(t, env, name, expect_shape=shape, expect_dtype=t.compute.dtype)

    # ---------------------------------------------------------------------------------------- data pushes
    def activation(self, env: pb.Envelope) -> None:
        t = self.current()
        t.roles.require(env.sender, [t.assignment.prev], "the upstream neighbour of this stage", "an activation")
        self._check_key(t, env.key)
        if t.assignment.is_first:
            raise Rejected("the first stage takes no activations")
        x = self._hidden(t, env, "hidden")
        with self.cond:
            self.step.take_activation(env.key.step, env.key.microbatch)
        speculative = env.meta.get(SPECULATIVE_META) == "1"  # a copy another pipeline also runs (stragglers)
        self.put(Task(Work.FORWARD, t, env.key.step, (env.key.microbatch, x, speculative)))

    def activation_grad(self, env: pb.Envelope) -> None:
        t = self.current()
        t.roles.require(env.sender, [t.assignment.next], "the downstream neighbour of this stage",
                        "an activation gradient")
        self._check_key(t, env.key)
        if t.assignment.is_last:
            raise Rejected("the last stage takes no activation gradients")
        g = self._hidden(t, env, "grad")
        with self.cond:
            self.step.take_grad(env.key.step, env.key.microbatch)
        self.put(Task(Work.BACKWARD, t, env.key.step, (env.key.microbatch, g)))

    def _shard_message(self, env: pb.Envelope, tensor: str | None = "grad"
                       ) -> tuple[Tasklet, Tag, list[int], torch.Tensor | None]:
        key = env.key
        t = self.current()
        if key.run_id != t.spec.run_id or key.epoch != t.assignment.epoch:
            raise Rejected(f"run/epoch {key.run_id!r}/{key.epoch} is not this peer's")
        group = t.assignment.group
        if not 0 <= key.replica < len(group):
            raise BadMessage("key.replica", f"replica {key.replica} is not in [0, {len(group)})")
        t.roles.require(env.sender, [group[key.replica]], f"replica {key.replica} of this stage's group",
                        "a gradient or parameter shard")
        if key.stage != t.assignment.stage:
            raise Rejected(f"stage {key.stage} is not this peer's stage {t.assignment.stage}")
        try:
            participants = [int(x) for x in json.loads(env.meta.get("participants", "[]"))]
            attempt = int(env.meta.get("attempt", ""))
        except (ValueError, TypeError):
            raise BadMessage("meta", "attempt and participants must be an integer and a JSON list") from None
        self._check_shard(key.step, attempt)
        if tensor is None:
            return t, (key.step, attempt), participants, None
        # a shard is a slice of this stage: its declared shape is bounded by the stage before anything is allocated
        shard = self._decode(t, env, tensor, expect_dtype=torch.float32, max_elements=t.compute.numel)
        return t, (key.step, attempt), participants, shard

    def _check_shard(self, step: int, attempt: int) -> None:
        """Bounded mailbox: only the attempts that can follow the one this peer was told about. A shard that only
        ran ahead of this peer's own start of the step or attempt (``WorkerStep.early``) waits for it, at most
        ``EARLY_SHARD_WAIT_S``, holding nothing but this call."""
        with self.cond:
            if self.step.early(step, attempt):
                self.cond.wait_for(lambda: not self.step.early(step, attempt), EARLY_SHARD_WAIT_S)
            self.step.check_shard(step, attempt)

    def grad_shard(self, env: pb.Envelope) -> None:
        t, tag, participants, shard = self._shard_message(env)
        assert shard is not None
        t.exchange.put_contribution(tag, participants, env.key.replica, shard, list(env.microbatches))

    def tied_grad(self, env: pb.Envelope) -> None:
        """The other end's summed gradient of the tied weight (peer.runtime.stage.tied), for this pipeline."""
        key, t = env.key, self.current()
        end = t.exchange.tied
        if end is None:
            raise Rejected("this stage holds no tied weight (an untied model, a middle stage or one stage)")
        t.roles.require(env.sender, [end.partner], TIED_ROLE, "a tied gradient")
        if key.run_id != t.spec.run_id or key.epoch != t.assignment.epoch:
            raise Rejected(f"run/epoch {key.run_id!r}/{key.epoch} is not this peer's")
        if key.stage != end.partner_stage or key.replica != t.assignment.replica:
            raise Rejected(f"stage {key.stage} of pipeline {key.replica} is not the other end of this pipeline's "
                           f"tie (stage {end.partner_stage} of pipeline {t.assignment.replica})")
        try:
            attempt = int(env.meta.get(ATTEMPT_META, ""))
        except ValueError:
            raise BadMessage("meta.attempt", "must be an integer") from None
        self._check_shard(key.step, attempt)
        grad = self._decode(t, env, "grad", expect_shape=(end.numel,), expect_dtype=torch.float32)
        t.exchange.put_tied((key.step, attempt), grad)

    def param_shard(self, env: pb.Envelope) -> None:
        if DIGEST_META in env.meta:  # the all-gather's digests (peer.runtime.stage.exchange)
            t, tag, participants, _ = self._shard_message(env, None)
            digest = parse_digest(env.meta[DIGEST_META], len(participants))
            t.exchange.put_digest(tag, participants, env.key.replica, digest)
            return
        t, tag, participants, shard = self._shard_message(env)
        assert shard is not None
        t.exchange.put_reduced(tag, participants, env.key.replica, shard)
