"""What a run is (``RunSpec``) and what one peer does in it (``Assignment``): the runtime's two configs.

Both travel as JSON (inside a STAGE_ASSIGNMENT envelope, in the DHT, in ``run.json``), so each has a strict
``from_dict`` that names the bad field instead of failing somewhere deep in the training loop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tasklet.peer.compute.family import ModelSpec, family_of, model_from_dict, model_to_dict
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.runtime.choices import COMPRESSIONS, GRAD_OUTLIER_FACTOR, PRECISIONS, PSEUDO_GRAD_COMPRESSIONS
from tasklet.protocol.codec import COMPRESSIONS as WIRE_COMPRESSIONS


class SpecError(ValueError):
    """A run or assignment field is invalid; the message names the field."""


def _need(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise SpecError(f"{where}.{key}: missing")
    value = d[key]
    if isinstance(value, bool) and kind is not bool:
        raise SpecError(f"{where}.{key}: expected {kind}, got a boolean")
    if not isinstance(value, kind):
        raise SpecError(f"{where}.{key}: expected {kind}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class RunSpec:
    """Everything every peer of a run must agree on: model, optimizer, data, batch, numerics.

    The global batch of one step is ``n_microbatches x micro_batch`` sequences of ``model.seq_len`` tokens;
    micro-batch ``m`` of step ``k`` is ``peer.compute.data.microbatch(corpus, seed, k, m, ...)`` on whichever peer
    computes it.
    """

    run_id: str = "tasklet"
    model: ModelSpec = field(default_factory=ModelConfig)  # of a registered family (peer.compute.family)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    micro_batch: int = 4
    n_microbatches: int = 8
    corpus: str | None = None  # None: the Python standard library's sources
    corpus_fingerprint: str = ""
    tokenizer: str | None = None  # a local tokenizer folder (AutoTokenizer); None: byte-level
    text_field: str = "text"  # the field of JSONL records / Parquet rows that holds the text
    precision: str = "fp32"
    compression: str = "none"  # of activations and activation gradients on the wire
    # a replica's gradient more than this many times the median of its group's (per micro-batch), or its owner's
    # whole gradient's, is refused and its sender excluded (peer.runtime.stage.gradient_checks); 0: no check
    grad_outlier_factor: float = GRAD_OUTLIER_FACTOR
    # a replica's gradient shard whose direction is unrelated to its group's (this many standard errors within
    # what noise scores, peer.runtime.stage.checks) is refused and its sender excluded; 0 disables the test
    grad_direction_z: float = 5.0
    # Data-parallel sync (peer.runtime.outer): every ``sync_period`` inner steps, an outer round. 1 = exact
    # gradient averaging every step. Above 1, DiLoCo: each pipeline steps AdamW on its own micro-batches, and
    # every sync_period steps the replicas average their pseudo-gradients (round-start minus local parameters,
    # compressed by ``pseudo_grad_compression``) and apply Nesterov SGD (``outer_lr``, ``outer_momentum``).
    sync_period: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    pseudo_grad_compression: str = "none"
    # DiLoCo: the outer round of round k travels while round k + 1's first inner step computes, and lands after
    # it (one step late; peer.runtime.outer, "Overlap"); False: every inner step waits for the round
    outer_overlap: bool = False
    # verified work (peer.runtime.lead.spot): the fraction of micro-batches re-run on another pipeline and
    # compared, the fraction while a member is on probation, and the verified micro-batches that end it. Off in
    # the runtime's default; the run file's [trust] turns it on
    spot_check: float = 0.0
    probation_check: float = 0.0
    probation_microbatches: int = 0

    def validate(self) -> RunSpec:
        self.model.validate()
        self.optim.validate()
        if self.optim.grad_clip is not None:
            raise SpecError("optim.grad_clip: global-norm clipping across stages is not supported yet")
        if not self.run_id or len(self.run_id) > 128:
            raise SpecError("run.run_id: must be 1-128 characters")
        for name in ("micro_batch", "n_microbatches"):
            if getattr(self, name) < 1:
                raise SpecError(f"run.{name}: must be >= 1, got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise SpecError(f"run.precision: must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compression not in COMPRESSIONS:
            raise SpecError(f"run.compression: must be one of {COMPRESSIONS}, got {self.compression!r}")
        if not (self.grad_outlier_factor == 0 or self.grad_outlier_factor > 1):
            raise SpecError(f"run.grad_outlier_factor: must be 0 (off) or above 1, got {self.grad_outlier_factor}")
        if not (self.grad_direction_z == 0 or 1 <= self.grad_direction_z <= 100):
            raise SpecError(f"run.grad_direction_z: must be 0 (off) or in [1, 100], got {self.grad_direction_z}")
        self._validate_sync()
        for name in ("spot_check", "probation_check"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise SpecError(f"trust.{name}: must be a fraction in [0, 1], got {rate!r}")
        count = self.probation_microbatches
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1_000_000:
            raise SpecError(f"trust.probation_microbatches: must be an integer in [0, 1000000], got {count!r}")
        if family_of(self.model).keeps_tied(self.model) and self.sync_period > 1:
            raise SpecError("run.sync_period: a model that keeps its embeddings tied trains with exact averaging "
                            "(sync_period 1) only")
        return self

    def _validate_sync(self) -> None:
        period = self.sync_period
        if isinstance(period, bool) or not isinstance(period, int) or not 1 <= period <= 1_000_000:
            raise SpecError(f"run.sync_period: must be an integer in [1, 1000000], got {self.sync_period!r}")
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise SpecError(f"run.outer_lr: must be a positive number, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise SpecError(f"run.outer_momentum: must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.outer_overlap, bool):
            raise SpecError(f"run.outer_overlap: must be true or false, got {self.outer_overlap!r}")
        if self.pseudo_grad_compression not in PSEUDO_GRAD_COMPRESSIONS:
            raise SpecError(f"run.pseudo_grad_compression: must be one of {PSEUDO_GRAD_COMPRESSIONS}, "
                            f"got {self.pseudo_grad_compression!r}")
        if self.pseudo_grad_compression not in WIRE_COMPRESSIONS:
            raise SpecError(f"run.pseudo_grad_compression: {self.pseudo_grad_compression!r} is not in this "
                            "build's wire codec")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = model_to_dict(self.model)
        d["optim"]["betas"] = list(self.optim.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        if not isinstance(d, dict):
            raise SpecError("run: expected a JSON object")
        model = _need(d, "model", dict, "run")
        tokenizer = d.get("tokenizer")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise SpecError("run.tokenizer: expected a folder path or null")
        text_field = d.get("text_field", "text")
        if not isinstance(text_field, str) or not text_field:
            raise SpecError("run.text_field: expected a non-empty string")
        optim = dict(_need(d, "optim", dict, "run"))
        if "betas" in optim:
            optim["betas"] = tuple(optim["betas"])
        try:
            spec = cls(
                run_id=_need(d, "run_id", str, "run"),
                model=model_from_dict(model),
                optim=OptimConfig(**optim),
                seed=_need(d, "seed", int, "run"),
                micro_batch=_need(d, "micro_batch", int, "run"),
                n_microbatches=_need(d, "n_microbatches", int, "run"),
                corpus=d.get("corpus"),
                corpus_fingerprint=d.get("corpus_fingerprint", ""),
                tokenizer=tokenizer,
                text_field=text_field,
                precision=d.get("precision", "fp32"),
                compression=d.get("compression", "none"),
                grad_outlier_factor=float(d.get("grad_outlier_factor", GRAD_OUTLIER_FACTOR)),
                grad_direction_z=float(d.get("grad_direction_z", 5.0)),
                sync_period=d.get("sync_period", 1),
                outer_lr=float(d.get("outer_lr", 0.7)),
                outer_momentum=float(d.get("outer_momentum", 0.9)),
                pseudo_grad_compression=d.get("pseudo_grad_compression", "none"),
                outer_overlap=d.get("outer_overlap", False),
                spot_check=float(d.get("spot_check", 0.0)),
                probation_check=float(d.get("probation_check", 0.0)),
                probation_microbatches=d.get("probation_microbatches", 0),
            )
        except TypeError as exc:  # an unknown key inside model/optim
            raise SpecError(f"run: {exc}") from None
        except ValueError as exc:  # a bad model spec, or an unknown model family (model.kind)
            raise SpecError(f"run.{exc}") from None
        return spec.validate()

    @property
    def sketches(self) -> bool:
        """Whether stages report sketches of their micro-batches (spot checks on; DiLoCo's pipelines apply their
        own shares and are not compared micro-batch by micro-batch)."""
        on = self.spot_check > 0 or (self.probation_check > 0 and self.probation_microbatches > 0)
        return on and self.sync_period == 1


MAX_PLAN_EPOCH = 2**31 - 1  # as on the plan board (peer.swarm.plans.MAX_EPOCH)


@dataclass(frozen=True)
class Assignment:
    """One peer's tasklet: stage ``stage`` of pipeline ``replica``, under plan ``epoch``.

    Endpoints are "host:port" of the neighbours' gRPC servers; ``group[r]`` is the endpoint of replica ``r`` of
    this stage (this peer included). ``forward_flops``: the plan's figure for one forward of a micro-batch on
    this stage (a device clock that emulates a declared speed stretches each op to it; peer.runtime.stage).
    Nothing about emulated links or speeds travels here: an emulated run gives each worker its own network
    model and device clock (peer.emulation.network).

    Who is who, for mutual TLS and authorization (peer.net.tls): ``peers`` maps endpoints of the plan (every
    worker and the coordinator) to their certificates (base64 DER; the peer id is the hash of the certificate's
    key), and ``plan`` maps every worker endpoint of the plan to the layers it holds. A worker accepts
    activations only from ``prev``'s peer, activation gradients only from ``next``'s, shards only from
    ``group``'s, control only from ``coordinator``'s, and serves a stage's state only to a peer that ``plan``
    gives those layers (or the coordinator). An endpoint without a certificate can only be this process itself.
    """

    epoch: int
    stage: int
    replica: int
    n_stages: int
    n_replicas: int
    layers: tuple[int, int]
    group: tuple[str, ...]
    coordinator: str
    prev: str | None = None
    next: str | None = None
    forward_flops: float = 0.0
    device: str = "cpu"
    peers: dict[str, str] = field(default_factory=dict)
    plan: dict[str, tuple[int, int]] = field(default_factory=dict)
    leader: str = ""  # peer id of the leader whose plan this is: workers order plans by (epoch, leader)
    pipeline: tuple[str, ...] = ()  # this pipeline's worker endpoints by stage (first and last: tied embeddings)

    def validate(self) -> Assignment:
        if not 0 <= self.epoch <= MAX_PLAN_EPOCH:
            raise SpecError(f"assignment.epoch: {self.epoch} not in [0, {MAX_PLAN_EPOCH}]")
        if len(self.leader) > 64:
            raise SpecError("assignment.leader: a peer id of at most 64 characters")
        if not 0 <= self.stage < self.n_stages:
            raise SpecError(f"assignment.stage: {self.stage} not in [0, {self.n_stages})")
        if not 0 <= self.replica < self.n_replicas:
            raise SpecError(f"assignment.replica: {self.replica} not in [0, {self.n_replicas})")
        if len(self.group) != self.n_replicas:
            raise SpecError(f"assignment.group: {len(self.group)} endpoints for {self.n_replicas} replicas")
        if (self.stage > 0) != (self.prev is not None):
            raise SpecError("assignment.prev: required exactly when stage > 0")
        if (self.stage < self.n_stages - 1) != (self.next is not None):
            raise SpecError("assignment.next: required exactly when stage < n_stages - 1")
        if self.pipeline and (len(self.pipeline) != self.n_stages or self.pipeline[self.stage] != self.group[
                self.replica] or (self.prev, self.next) != (
                self.pipeline[self.stage - 1] if self.stage > 0 else None,
                self.pipeline[self.stage + 1] if self.stage < self.n_stages - 1 else None)):
            raise SpecError("assignment.pipeline: must list this pipeline's n_stages endpoints, this worker's and "
                            "its neighbours' in their places")
        if not (self.forward_flops >= 0 and math.isfinite(self.forward_flops)):
            raise SpecError(f"assignment.forward_flops: must be a finite number >= 0, got {self.forward_flops}")
        return self

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["group"] = list(self.group)
        d["pipeline"] = list(self.pipeline)
        d["plan"] = {k: list(v) for k, v in self.plan.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Assignment:
        if not isinstance(d, dict):
            raise SpecError("assignment: expected a JSON object")
        try:
            layers = tuple(int(x) for x in _need(d, "layers", list, "assignment"))
            a = cls(
                epoch=_need(d, "epoch", int, "assignment"),
                stage=_need(d, "stage", int, "assignment"),
                replica=_need(d, "replica", int, "assignment"),
                n_stages=_need(d, "n_stages", int, "assignment"),
                n_replicas=_need(d, "n_replicas", int, "assignment"),
                layers=(layers[0], layers[1]),
                group=tuple(str(x) for x in _need(d, "group", list, "assignment")),
                coordinator=_need(d, "coordinator", str, "assignment"),
                prev=d.get("prev"),
                next=d.get("next"),
                forward_flops=float(d.get("forward_flops", 0.0)),
                device=str(d.get("device", "cpu")),
                peers={str(k): str(v) for k, v in d.get("peers", {}).items()},
                plan={str(k): (int(v[0]), int(v[1])) for k, v in d.get("plan", {}).items()},
                leader=str(d.get("leader", "")),
                pipeline=tuple(str(x) for x in d.get("pipeline", [])),
            )
        except (IndexError, TypeError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise
            raise SpecError(f"assignment: malformed field ({exc})") from None
        return a.validate()
