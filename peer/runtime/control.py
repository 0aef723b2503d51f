"""The runtime's control plane: every operation between coordinator and workers, typed, in one module.

Three channels carry control messages, all on the data plane's gRPC transport:

* coordinator -> worker: a Push of Kind CONTROL (``stop``, ``start_step``, ``drop_step``, ``reduce``,
  ``apply``, ``resync``) — and the assignment itself, a Push of Kind STAGE_ASSIGNMENT (:class:`StageAssignment`);
* worker -> coordinator reports: a Push of Kind CONTROL (``loss``, ``reduced``, ``synced``, ``error``,
  ``peer_error``, ``bad_peer``);
* worker -> coordinator task pool: a Fetch of Kind LEASE or COMMIT (the key names step, micro-batch and
  pipeline), answered with a ``PoolReply`` (:class:`PoolStatus`, and whether a lease is a speculative copy).

On the wire an operation is the ``Control`` message of ``protocol/tasklet.proto`` in the envelope's
``control`` field: a ``oneof`` whose field name is the :class:`Op`'s value, so protobuf checks every field's
type. What protobuf cannot express is checked here (:func:`decode`): the operation must be one the channel
takes, strings are bounded. A malformed message is refused with :class:`~protocol.errors.BadMessage` naming
the field (gRPC INVALID_ARGUMENT); a handler only ever sees a typed :class:`Message`. The envelope's key
carries run, epoch, step and the sender's stage and replica.

``attempt`` (StartStep, Reduce, Reduced): how often the step was restarted after a pipeline was dropped from
it (a reduce of an older attempt is stale).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from tasklet.peer.runtime.spec import Assignment, RunSpec, SpecError
from tasklet.peer.runtime.wire import body_of, envelope, make_key
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage
from tasklet.protocol.message import WireEnvelope

MAX_TEXT = 1000  # an error text or a reason
MAX_ENDPOINT = 300
MAX_HASH = 64
MAX_STEP_RECORD_CHARS = 16384  # a leader's signed step record (peer.node.step_record): a seal and stage hashes


class Op(enum.Enum):
    """Every control operation; the value is the field name in ``Control``'s ``oneof`` (the pool's two: a Kind)."""

    # coordinator -> worker (Push, Kind CONTROL)
    STOP = "stop"
    START_STEP = "start_step"
    DROP_STEP = "drop_step"
    REDUCE = "reduce"
    APPLY = "apply"
    RESYNC = "resync"
    # worker -> coordinator reports (Push, Kind CONTROL)
    LOSS = "loss"
    REDUCED = "reduced"
    SYNCED = "synced"
    ERROR = "error"
    PEER_ERROR = "peer_error"
    BAD_PEER = "bad_peer"
    SKETCH = "sketch"
    # worker -> coordinator task pool (Fetch, Kind LEASE or COMMIT)
    LEASE = "lease"
    COMMIT = "commit"


class PoolStatus(enum.Enum):
    """The task pool's answer to a lease or commit (the reply's ``PoolReply.status``)."""

    WAIT = "wait"  # nothing to lease right now, or the request is not for the running step
    DONE = "done"  # every micro-batch is committed: stop feeding
    LEASE = "lease"  # the reply's key.microbatch is leased to the caller's pipeline
    COMMITTED = "committed"
    DUPLICATE = "duplicate"
    STALE = "stale"


_POOL_WIRE: dict[PoolStatus, int] = {
    PoolStatus.WAIT: pb.POOL_WAIT, PoolStatus.DONE: pb.POOL_DONE, PoolStatus.LEASE: pb.POOL_LEASED,
    PoolStatus.COMMITTED: pb.POOL_COMMITTED, PoolStatus.DUPLICATE: pb.POOL_DUPLICATE, PoolStatus.STALE: pb.POOL_STALE,
}
_POOL_FROM_WIRE = {wire: status for status, wire in _POOL_WIRE.items()}
POOL_KINDS: dict[Op, int] = {Op.LEASE: pb.LEASE, Op.COMMIT: pb.COMMIT}

# meta key of the activations of a micro-batch: "1" when the pipeline runs a speculative copy of a micro-batch
# another (straggling) pipeline holds; every stage keeps its gradient apart until the reduce
SPECULATIVE_META = "speculative"


# ------------------------------------------------------------------------------------------------ messages
@dataclass(frozen=True)
class Message:
    """A control operation. A subclass names its :class:`Op`; its fields are the proto message's
    (``Reduce.assignment`` is ``commits`` on the wire)."""

    op: ClassVar[Op]
    _renamed: ClassVar[dict[str, str]] = {}  # Python field -> proto field
    _limits: ClassVar[dict[str, int]] = {}  # string field -> the most characters kept

    def to_pb(self) -> pb.Control:
        control = pb.Control()
        part = getattr(control, self.op.value)
        part.SetInParent()
        for f in fields(self):
            value = getattr(self, f.name)
            target = self._renamed.get(f.name, f.name)
            if isinstance(value, Mapping):
                getattr(part, target).update(value)
            elif isinstance(value, tuple):
                getattr(part, target).extend(value)
            else:
                setattr(part, target, value)
        return control

    @classmethod
    def from_pb(cls, part: Any) -> Message:
        """The message of a decoded proto part; protobuf checked the types, this bounds the strings."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = getattr(part, cls._renamed.get(f.name, f.name))
            if isinstance(value, str):
                value = value[:cls._limits.get(f.name, MAX_TEXT)]
            elif isinstance(value, Mapping):  # a protobuf map
                value = dict(value)
            elif isinstance(value, Sequence):  # a repeated field
                value = tuple(value)
            values[f.name] = value
        return cls(**values)


@dataclass(frozen=True)
class Stop(Message):
    """Exit the worker process."""

    op: ClassVar[Op] = Op.STOP


@dataclass(frozen=True)
class StartStep(Message):
    """Start (or, with a higher ``attempt``, restart) ``step``; ``feed``: a first stage leases micro-batches.
    ``record``: the leader's signed record of the steps trained so far, kept for a takeover (peer.node.step_record;
    a worker neither reads nor trusts it)."""

    op: ClassVar[Op] = Op.START_STEP
    _limits: ClassVar[dict[str, int]] = {"record": MAX_STEP_RECORD_CHARS}
    step: int
    attempt: int = 0
    feed: bool = False
    record: str = ""


@dataclass(frozen=True)
class DropStep(Message):
    """This pipeline lost a member: throw away the step's work."""

    op: ClassVar[Op] = Op.DROP_STEP
    step: int


@dataclass(frozen=True)
class Reduce(Message):
    """Average the step's gradient with ``participants``; ``assignment`` is the pool's commit record
    (micro-batch -> pipeline), so each replica checks its accumulator holds exactly its pipeline's share.
    ``outer``: average the DiLoCo pseudo-gradients of the round that ``step`` ends instead (peer.runtime.outer).
    ``apply``: a DiLoCo inner step, whose reduce is local: apply right after it and report ``synced`` (one round
    instead of a reduce and an apply)."""

    op: ClassVar[Op] = Op.REDUCE
    _renamed: ClassVar[dict[str, str]] = {"assignment": "commits"}
    step: int
    attempt: int
    participants: tuple[int, ...]
    assignment: dict[int, int] = field(default_factory=dict)
    outer: bool = False
    apply: bool = False


@dataclass(frozen=True)
class Apply(Message):
    """Apply the averaged gradient of ``step`` (idempotent); ``outer``: the outer step of the round it ends."""

    op: ClassVar[Op] = Op.APPLY
    step: int
    outer: bool = False


@dataclass(frozen=True)
class Loss(Message):
    """The last stage's loss of one micro-batch."""

    op: ClassVar[Op] = Op.LOSS
    step: int
    microbatch: int
    loss: float


@dataclass(frozen=True)
class Reduced(Message):
    """This worker holds the averaged gradient of (step, attempt)."""

    op: ClassVar[Op] = Op.REDUCED
    step: int
    attempt: int


@dataclass(frozen=True)
class Synced(Message):
    """This worker applied ``step``; it has now trained ``trained_steps`` steps and its parameters hash to
    ``params_hash`` (replicas of a stage must agree; see Coordinator's majority check)."""

    op: ClassVar[Op] = Op.SYNCED
    _limits: ClassVar[dict[str, int]] = {"params_hash": MAX_HASH}
    step: int
    trained_steps: int
    params_hash: str = ""


@dataclass(frozen=True)
class Resync(Message):
    """This replica's parameters after ``step`` differ from its group's majority: load the stage's state from
    ``source`` (a replica in the majority), which must be at ``trained_steps``."""

    op: ClassVar[Op] = Op.RESYNC
    _limits: ClassVar[dict[str, int]] = {"source": MAX_ENDPOINT}
    step: int
    trained_steps: int
    source: str


@dataclass(frozen=True)
class TaskError(Message):
    """A compute task (``what``: forward, backward, reduce, apply, drop) of ``step`` failed on this worker."""

    op: ClassVar[Op] = Op.ERROR
    _limits: ClassVar[dict[str, int]] = {"what": 32}
    what: str
    step: int
    error: str


@dataclass(frozen=True)
class PeerError(Message):
    """A send to ``endpoint`` failed: the coordinator checks whether that peer is alive."""

    op: ClassVar[Op] = Op.PEER_ERROR
    _limits: ClassVar[dict[str, int]] = {"endpoint": MAX_ENDPOINT}
    endpoint: str
    error: str


@dataclass(frozen=True)
class BadPeer(Message):
    """The worker of (``stage``, ``replica``) sent malformed data (NaN, wrong shape): exclude it."""

    op: ClassVar[Op] = Op.BAD_PEER
    _limits: ClassVar[dict[str, int]] = {"sender": MAX_ENDPOINT}
    stage: int
    replica: int
    sender: str
    error: str


@dataclass(frozen=True)
class Sketch(Message):
    """This stage's sketches of one micro-batch (peer.runtime.sketch): ``values`` holds K + 1 numbers per point
    of ``points``, in that order. :meth:`parsed` checks the shape; the coordinator refuses what does not fit."""

    op: ClassVar[Op] = Op.SKETCH
    step: int
    microbatch: int
    points: tuple[str, ...]
    values: tuple[float, ...]

    def parsed(self) -> dict[str, tuple[float, ...]]:
        """Point -> its sketch; BadMessage when the points are unknown or repeated, or the values do not fit."""
        from tasklet.peer.runtime.sketch import PER_POINT, POINTS  # noqa: PLC0415 - torch only where sketches are read

        if len(self.points) > len(POINTS) or len(set(self.points)) != len(self.points):
            raise BadMessage("sketch.points", f"{list(self.points)[:8]} are not distinct points")
        if any(p not in POINTS for p in self.points):
            raise BadMessage("sketch.points", f"{list(self.points)[:8]}: known points are {list(POINTS)}")
        if len(self.values) != PER_POINT * len(self.points):
            raise BadMessage("sketch.values", f"{len(self.values)} values for {len(self.points)} points")
        if not all(math.isfinite(v) for v in self.values):
            raise BadMessage("sketch.values", "a value is not finite")
        return {p: tuple(self.values[i * PER_POINT:(i + 1) * PER_POINT]) for i, p in enumerate(self.points)}


MESSAGES: dict[Op, type[Message]] = {
    m.op: m
    for m in (Stop, StartStep, DropStep, Reduce, Apply, Resync, Loss, Reduced, Synced, TaskError, PeerError, BadPeer,
              Sketch)
}
TO_WORKER = frozenset({Op.STOP, Op.START_STEP, Op.DROP_STEP, Op.REDUCE, Op.APPLY, Op.RESYNC})
REPORTS = frozenset({Op.LOSS, Op.REDUCED, Op.SYNCED, Op.ERROR, Op.PEER_ERROR, Op.BAD_PEER, Op.SKETCH})
POOL_OPS = frozenset({Op.LEASE, Op.COMMIT})


# ----------------------------------------------------------------------------------------- encode / decode
def decode(env: pb.Envelope | WireEnvelope, allowed: frozenset[Op]) -> Message:
    """The typed operation of a Kind CONTROL envelope; BadMessage when it holds none, or one not ``allowed``."""
    if env.kind != pb.CONTROL:
        raise BadMessage("kind", f"a control message is of Kind CONTROL, not {env.kind}")
    which = env.control.WhichOneof("op") if env.HasField("control") else None
    if which is None:
        raise BadMessage("control", "holds no operation")
    try:
        op = Op(which)
    except ValueError:
        raise BadMessage("control", f"operation {which!r} is not a control operation") from None
    if op not in allowed:
        raise BadMessage("control", f"operation {op.value!r} is not accepted here")
    return MESSAGES[op].from_pb(getattr(env.control, which))


def encode(msg: Message, run_id: str, epoch: int, step: int = -1, **key: int) -> WireEnvelope:
    """A control message (Kind CONTROL) carrying ``msg``; ``key`` adds stage / replica / microbatch."""
    env = WireEnvelope(pb.Envelope(kind=pb.CONTROL, key=make_key(run_id, epoch, step, **key)))
    env.control.CopyFrom(msg.to_pb())
    return env


def op_of(request: pb.FetchRequest, allowed: frozenset[Op]) -> Op:
    """The operation of a task pool request (its Kind); BadMessage when it is not one ``allowed`` here."""
    for op, kind in POOL_KINDS.items():
        if request.kind == kind and op in allowed:
            return op
    raise BadMessage("kind", f"Kind {request.kind} is not a task pool operation accepted here")


def pool_kind(op: Op) -> int:
    """The Fetch Kind of a task pool request."""
    if op not in POOL_KINDS:
        raise ValueError(f"{op} is not a pool operation")
    return POOL_KINDS[op]


def pool_reply(kind: int, key: pb.Key, status: PoolStatus, speculative: bool = False) -> pb.Envelope:
    """The task pool's answer to a request of ``kind`` for ``key`` (a lease names its micro-batch in the key)."""
    answer = pb.PoolReply(status=_POOL_WIRE[status], speculative=speculative)  # type: ignore[arg-type]
    return pb.Envelope(kind=kind, key=key, control=pb.Control(pool_reply=answer))


def pool_status(reply: pb.Envelope | WireEnvelope) -> PoolStatus | None:
    """The pool's answer in a reply; None when it is missing or unknown."""
    if not reply.HasField("control") or reply.control.WhichOneof("op") != "pool_reply":
        return None
    return _POOL_FROM_WIRE.get(reply.control.pool_reply.status)


def is_speculative(reply: pb.Envelope | WireEnvelope) -> bool:
    """Whether a lease is of a speculative copy (a straggling pipeline holds the micro-batch too)."""
    return pool_status(reply) is PoolStatus.LEASE and reply.control.pool_reply.speculative


# ------------------------------------------------------------------------------------------- field checks
def _int(body: dict[str, Any], name: str, default: int | None = None) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadMessage(f"meta.body.{name}", "missing" if value is None else f"expected an integer, got {value!r}")
    return value


def _str(body: dict[str, Any], name: str, default: str | None = None, limit: int = MAX_TEXT) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise BadMessage(f"meta.body.{name}", "missing" if value is None else f"expected a string, got {value!r}")
    return value[:limit]


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
    params_hash: str = ""  # fetch only: the hash the fetched parameters must have ("": the leader knows none)

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
    def fetch(cls, endpoint: str, step: int, params_hash: str = "") -> StateSource:
        return cls(SourceKind.FETCH, step, endpoint, params_hash=params_hash)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"source": self.kind.value, "step": self.step}
        if self.endpoint is not None:
            d["endpoint"] = self.endpoint
        if self.grant:
            d["grant"] = self.grant
        if self.params_hash:
            d["params_hash"] = self.params_hash
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
        expected = _str(d, "params_hash", "", limit=MAX_HASH)
        try:
            return cls(kind, step, endpoint if kind is SourceKind.FETCH else None, grant, expected)
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
