"""The runtime's control plane: every operation between coordinator and workers, typed, in one module.

Three channels carry control messages, all on the data plane's gRPC transport:

* coordinator -> worker: a Push of Kind OTHER (``stop``, ``start_step``, ``drop_step``, ``reduce``,
  ``apply``) — and the assignment itself, a Push of Kind STAGE_ASSIGNMENT (:class:`StageAssignment`);
* worker -> coordinator reports: a Push of Kind OTHER (``loss``, ``reduced``, ``synced``, ``error``,
  ``peer_error``, ``bad_peer``);
* worker -> coordinator task pool: a Fetch of Kind COMMIT (``lease``, ``commit``) answered with a
  :class:`PoolStatus` in the reply's ``meta["status"]``.

On the wire ``meta["op"]`` names the :class:`Op` and ``meta["body"]`` holds the message's fields as JSON;
the envelope's key carries run, epoch, step and the sender's stage and replica. :func:`decode` refuses a
malformed body with :class:`~protocol.errors.BadMessage` naming the field (gRPC INVALID_ARGUMENT) and never
returns a half-checked message, so a handler only ever sees well-typed fields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from peer.runtime.spec import Assignment, RunSpec, SpecError
from peer.runtime.wire import body_of, envelope, make_key
from protocol import tasklet_pb2 as pb
from protocol.errors import BadMessage


class Op(enum.Enum):
    """Every control operation; the value is ``meta["op"]`` on the wire."""

    # coordinator -> worker (Push, Kind OTHER)
    STOP = "stop"
    START_STEP = "start_step"
    DROP_STEP = "drop_step"
    REDUCE = "reduce"
    APPLY = "apply"
    RESYNC = "resync"
    # worker -> coordinator reports (Push, Kind OTHER)
    LOSS = "loss"
    REDUCED = "reduced"
    SYNCED = "synced"
    ERROR = "error"
    PEER_ERROR = "peer_error"
    BAD_PEER = "bad_peer"
    # worker -> coordinator task pool (Fetch, Kind COMMIT)
    LEASE = "lease"
    COMMIT = "commit"


class PoolStatus(enum.Enum):
    """The task pool's answer to a lease or commit (``meta["status"]`` of the reply)."""

    WAIT = "wait"  # nothing to lease right now, or the request is not for the running step
    DONE = "done"  # every micro-batch is committed: stop feeding
    LEASE = "lease"  # the reply's key.microbatch is leased to the caller's pipeline
    COMMITTED = "committed"
    DUPLICATE = "duplicate"
    STALE = "stale"


# meta key of a lease reply and of the activations of its micro-batch: "1" when the pipeline runs a speculative
# copy of a micro-batch another (straggling) pipeline holds; every stage keeps its gradient apart until the reduce
SPECULATIVE_META = "speculative"


# ------------------------------------------------------------------------------------------ field checks
def _int(body: dict[str, Any], name: str, default: int | None = None) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadMessage(f"meta.body.{name}", "missing" if value is None else f"expected an integer, got {value!r}")
    return value


def _str(body: dict[str, Any], name: str, default: str | None = None, limit: int = 1000) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise BadMessage(f"meta.body.{name}", "missing" if value is None else f"expected a string, got {value!r}")
    return value[:limit]


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadMessage(f"meta.body.{name}", f"expected true or false, got {value!r}")
    return value


def _float(body: dict[str, Any], name: str) -> float:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadMessage(f"meta.body.{name}", "missing" if value is None else f"expected a number, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------------ messages
@dataclass(frozen=True)
class Message:
    """A control message body. Subclasses name their :class:`Op` and check their fields in ``from_body``."""

    op: ClassVar[Op]

    def to_body(self) -> dict[str, Any] | None:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Message:
        raise NotImplementedError


@dataclass(frozen=True)
class Stop(Message):
    """Exit the worker process."""

    op: ClassVar[Op] = Op.STOP

    def to_body(self) -> dict[str, Any] | None:
        return None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Stop:
        return cls()


@dataclass(frozen=True)
class StartStep(Message):
    """Start (or, with a higher ``round``, restart) ``step``; ``feed``: a first stage leases micro-batches."""

    op: ClassVar[Op] = Op.START_STEP
    step: int
    round: int = 0
    feed: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> StartStep:
        return cls(_int(body, "step"), _int(body, "round", 0), _bool(body, "feed", False))


@dataclass(frozen=True)
class DropStep(Message):
    """This pipeline lost a member: throw away the step's work."""

    op: ClassVar[Op] = Op.DROP_STEP
    step: int

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> DropStep:
        return cls(_int(body, "step"))


@dataclass(frozen=True)
class Reduce(Message):
    """Average the step's gradient with ``participants``; ``assignment`` is the pool's commit record
    (micro-batch -> pipeline), so each replica checks its accumulator holds exactly its pipeline's share.
    ``outer``: average the DiLoCo pseudo-gradients of the round that ``step`` ends instead (peer.runtime.outer)."""

    op: ClassVar[Op] = Op.REDUCE
    step: int
    round: int
    participants: tuple[int, ...]
    assignment: dict[int, int] = field(default_factory=dict)
    outer: bool = False

    def to_body(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "round": self.round,
            "participants": list(self.participants),
            "assignment": {str(mb): p for mb, p in self.assignment.items()},
            "outer": self.outer,
        }

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Reduce:
        parts = body.get("participants")
        if not isinstance(parts, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in parts):
            raise BadMessage("meta.body.participants", f"expected a list of integers, got {parts!r}")
        raw = body.get("assignment")
        if not isinstance(raw, dict):
            raise BadMessage("meta.body.assignment", f"expected an object micro-batch -> pipeline, got {raw!r}")
        assignment: dict[int, int] = {}
        for mb, p in raw.items():
            if not (isinstance(mb, str) and mb.lstrip("-").isdigit()) or isinstance(p, bool) or not isinstance(p, int):
                raise BadMessage("meta.body.assignment", f"entry {mb!r}: {p!r} is not micro-batch -> pipeline")
            assignment[int(mb)] = p
        return cls(_int(body, "step"), _int(body, "round"), tuple(parts), assignment, _bool(body, "outer", False))


@dataclass(frozen=True)
class Apply(Message):
    """Apply the averaged gradient of ``step`` (idempotent); ``outer``: the outer step of the round it ends."""

    op: ClassVar[Op] = Op.APPLY
    step: int
    outer: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Apply:
        return cls(_int(body, "step"), _bool(body, "outer", False))


@dataclass(frozen=True)
class Loss(Message):
    """The last stage's loss of one micro-batch."""

    op: ClassVar[Op] = Op.LOSS
    step: int
    microbatch: int
    loss: float

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Loss:
        return cls(_int(body, "step"), _int(body, "microbatch"), _float(body, "loss"))


@dataclass(frozen=True)
class Reduced(Message):
    """This worker holds the averaged gradient of (step, round)."""

    op: ClassVar[Op] = Op.REDUCED
    step: int
    round: int

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Reduced:
        return cls(_int(body, "step"), _int(body, "round"))


@dataclass(frozen=True)
class Synced(Message):
    """This worker applied ``step``; it has now trained ``trained_steps`` steps and its parameters hash to
    ``params_hash`` (replicas of a stage must agree; see Coordinator's majority check)."""

    op: ClassVar[Op] = Op.SYNCED
    step: int
    trained_steps: int
    params_hash: str = ""

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Synced:
        return cls(_int(body, "step"), _int(body, "trained_steps"), _str(body, "params_hash", "", limit=64))


@dataclass(frozen=True)
class Resync(Message):
    """This replica's parameters after ``step`` differ from its group's majority: load the stage's state from
    ``source`` (a replica in the majority), which must be at ``trained_steps``."""

    op: ClassVar[Op] = Op.RESYNC
    step: int
    trained_steps: int
    source: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Resync:
        return cls(_int(body, "step"), _int(body, "trained_steps"), _str(body, "source", limit=300))


@dataclass(frozen=True)
class TaskError(Message):
    """A compute task (``what``: forward, backward, reduce, apply, drop) of ``step`` failed on this worker."""

    op: ClassVar[Op] = Op.ERROR
    what: str
    step: int
    error: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> TaskError:
        return cls(_str(body, "what", limit=32), _int(body, "step"), _str(body, "error"))


@dataclass(frozen=True)
class PeerError(Message):
    """A send to ``endpoint`` failed: the coordinator checks whether that peer is alive."""

    op: ClassVar[Op] = Op.PEER_ERROR
    endpoint: str
    error: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PeerError:
        return cls(_str(body, "endpoint", limit=300), _str(body, "error"))


@dataclass(frozen=True)
class BadPeer(Message):
    """The worker of (``stage``, ``replica``) sent malformed data (NaN, wrong shape): exclude it."""

    op: ClassVar[Op] = Op.BAD_PEER
    stage: int
    replica: int
    sender: str
    error: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> BadPeer:
        return cls(_int(body, "stage"), _int(body, "replica"), _str(body, "sender", "", limit=300),
                   _str(body, "error"))


MESSAGES: dict[Op, type[Message]] = {
    m.op: m
    for m in (Stop, StartStep, DropStep, Reduce, Apply, Resync, Loss, Reduced, Synced, TaskError, PeerError, BadPeer)
}
TO_WORKER = frozenset({Op.STOP, Op.START_STEP, Op.DROP_STEP, Op.REDUCE, Op.APPLY, Op.RESYNC})
REPORTS = frozenset({Op.LOSS, Op.REDUCED, Op.SYNCED, Op.ERROR, Op.PEER_ERROR, Op.BAD_PEER})
POOL_OPS = frozenset({Op.LEASE, Op.COMMIT})


# ----------------------------------------------------------------------------------------- encode / decode
def op_of(env: pb.Envelope | pb.FetchRequest, allowed: frozenset[Op]) -> Op:
    """The operation of a control message or pool request; BadMessage when unknown or not ``allowed`` here."""
    raw = env.meta.get("op", "")
    try:
        op = Op(raw)
    except ValueError:
        raise BadMessage("meta.op", f"unknown control operation {raw[:64]!r}") from None
    if op not in allowed:
        raise BadMessage("meta.op", f"operation {op.value!r} is not accepted here")
    return op


def decode(env: pb.Envelope, allowed: frozenset[Op]) -> Message:
    """The typed body of a control message (Kind OTHER); BadMessage names the first bad field."""
    op = op_of(env, allowed)
    body = body_of(env)
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise BadMessage("meta.body", f"expected a JSON object, got {type(body).__name__}")
    return MESSAGES[op].from_body(body)


def encode(msg: Message, run_id: str, epoch: int, step: int = -1, **key: int) -> pb.Envelope:
    """A control message (Kind OTHER) carrying ``msg``; ``key`` adds stage / replica / microbatch."""
    return envelope(pb.OTHER, make_key(run_id, epoch, step, **key), op=msg.op.value, body=msg.to_body())


def pool_request_meta(op: Op) -> dict[str, str]:
    """The Fetch meta of a task pool request (the key carries step, micro-batch and pipeline)."""
    if op not in POOL_OPS:
        raise ValueError(f"{op} is not a pool operation")
    return {"op": op.value}


def pool_status(reply: pb.Envelope) -> PoolStatus | None:
    """The pool's answer in a reply; None when it is missing or unknown."""
    try:
        return PoolStatus(reply.meta.get("status", ""))
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------- assignments
class SourceKind(enum.Enum):
    """Where a newly assigned tasklet's parameters come from."""

    INIT = "init"  # step 0: the seeded initialiser, identical everywhere
    KEEP = "keep"  # this peer already holds the stage at the run's trained step
    FETCH = "fetch"  # a live replica of the stage, or the coordinator serving a checkpoint


@dataclass(frozen=True)
class StateSource:
    """A tasklet's state source: ``init`` at step 0, ``keep`` at ``step``, or ``fetch`` from ``endpoint``."""

    kind: SourceKind = SourceKind.INIT
    step: int = 0
    endpoint: str | None = None
    grant: str = ""  # fetch only: the coordinator's signed permission to read the state (peer.runtime.grants)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"state source step must be >= 0, got {self.step}")
        if (self.kind is SourceKind.FETCH) != bool(self.endpoint):
            raise ValueError("a state source has an endpoint exactly when it is 'fetch'")
        if self.kind is SourceKind.INIT and self.step != 0:
            raise ValueError(f"'init' is only valid at step 0, not step {self.step}")

    @classmethod
    def init(cls) -> StateSource:
        return cls(SourceKind.INIT, 0)

    @classmethod
    def keep(cls, step: int) -> StateSource:
        return cls(SourceKind.KEEP, step)

    @classmethod
    def fetch(cls, endpoint: str, step: int) -> StateSource:
        return cls(SourceKind.FETCH, step, endpoint)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"source": self.kind.value, "step": self.step}
        if self.endpoint is not None:
            d["endpoint"] = self.endpoint
        if self.grant:
            d["grant"] = self.grant
        return d

    @classmethod
    def from_dict(cls, d: Any) -> StateSource:
        if not isinstance(d, dict):
            raise BadMessage("meta.body.state", f"expected an object, got {type(d).__name__}")
        try:
            kind = SourceKind(d.get("source", "init"))
        except ValueError:
            raise BadMessage("meta.body.state.source", f"unknown state source {d.get('source')!r}") from None
        step = _int(d, "step", 0)
        endpoint = d.get("endpoint")
        if endpoint is not None and not (isinstance(endpoint, str) and 0 < len(endpoint) <= 300):
            raise BadMessage("meta.body.state.endpoint", f"expected host:port, got {endpoint!r}")
        grant = _str(d, "grant", "", limit=4096)
        try:
            return cls(kind, step, endpoint if kind is SourceKind.FETCH else None, grant)
        except ValueError as exc:
            raise BadMessage("meta.body.state", f"state source {kind.value!r} at step {step} is not valid ({exc})") \
                from None

    def __str__(self) -> str:
        return self.kind.value + (f" from {self.endpoint}" if self.endpoint else "") + f" at step {self.step}"


@dataclass(frozen=True)
class StageAssignment:
    """The body of a STAGE_ASSIGNMENT push: the run, this peer's tasklet and where its state comes from."""

    run: RunSpec
    assignment: Assignment
    source: StateSource = field(default_factory=StateSource.init)

    def to_envelope(self) -> pb.Envelope:
        body = {"run": self.run.to_dict(), "assignment": self.assignment.to_dict(), "state": self.source.to_dict()}
        return envelope(pb.STAGE_ASSIGNMENT, make_key(self.run.run_id, self.assignment.epoch, -1), body=body)

    @classmethod
    def from_envelope(cls, env: pb.Envelope) -> StageAssignment:
        body = body_of(env)
        if not isinstance(body, dict) or not isinstance(body.get("run"), dict) \
                or not isinstance(body.get("assignment"), dict):
            raise BadMessage("meta.body", "assignment needs 'run' and 'assignment' objects")
        try:
            run = RunSpec.from_dict(body["run"])
            assignment = Assignment.from_dict(body["assignment"])
        except SpecError as exc:
            raise BadMessage("meta.body", str(exc)) from None
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise BadMessage("meta.body", f"assignment needs 'run' and 'assignment' objects ({exc})") from None
        return cls(run, assignment, StateSource.from_dict(body.get("state", {"source": "init", "step": 0})))
