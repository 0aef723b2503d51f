"""What a model family provides (:class:`ModelFamily`) and what its model spec offers the runtime (:class:`ModelSpec`).

A *model spec* is the model part of a ``RunSpec``: it travels as JSON, builds any stage ``[a, b)`` of the model
with the same seeded or loaded weights on every peer, and names its shape. A *family* is what knows how to make
one (from a run record's dict or a run file's ``[model]`` section) and everything about it that the rest of the
peer used to find out by asking the spec's type: the scheduler's workload, the whole model for the single-process
reference, its parameter count, its tied weight, a name for messages, its fingerprint and this peer's own files.

The defaults suit a decoder whose spec has the byte GPT's shape fields: a new family overrides ``from_dict``
(and ``from_config`` if a run file can name it) and only what differs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from tasklet.scheduler.model_workload import Workload


@runtime_checkable
class ModelSpec(Protocol):
    """The surface of a model spec the stage runtime uses (``peer.compute.stage``, ``peer.runtime``)."""

    @property
    def n_layers(self) -> int: ...

    @property
    def d_model(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def validate(self) -> Any: ...

    def to_dict(self) -> dict[str, Any]: ...

    def build_stage(self, first_layer: int, last_layer: int) -> torch.nn.Module:
        """Layers ``[first_layer, last_layer)``: ids -> hidden on the first stage, hidden -> logits on the last;
        parameters named with the global layer index and seeded per name, so any split equals the whole."""
        ...

    def stage_shapes(self, first_layer: int, last_layer: int) -> list[tuple[str, Any]]: ...


class FamilyError(ValueError):
    """A model family is unknown or registered twice; the message names the kind (and the known ones)."""


class ModelMismatchError(ValueError):
    """An assignment's model is not the one this peer holds the files of (the fingerprints differ)."""


class ModelFamily(ABC):
    """One kind of model: parsing its spec and answering what the peer asks of it (see the module docstring).

    ``kind`` is the ``"kind"`` of the model's dict in a run record; ``spec_type`` the class of its specs, by which
    a spec instance finds its family.
    """

    kind: ClassVar[str]
    spec_type: ClassVar[type]

    @abstractmethod
    def from_dict(self, data: dict[str, Any]) -> ModelSpec:
        """The spec of a run record's model dict (its ``"kind"`` key, if any, is this family's); a bad field is a
        ``TypeError`` or ``ValueError`` naming it."""

    def to_dict(self, spec: Any) -> dict[str, Any]:
        """The JSON form of ``spec``, with its kind (what :meth:`from_dict` reads back)."""
        return {**spec.to_dict(), "kind": self.kind}

    def from_config(self, section: Any, seed: int, tie: bool) -> ModelSpec | None:
        """The spec a run file's ``[model]`` section names (``peer.config.ModelSection``), or None when it names
        no model of this family. ``tie``: keep tied embeddings tied (the run averages exactly)."""
        del section, seed, tie
        return None

    def workload(self, run: Any, stages: int | None, replicas: int | None) -> Workload:
        """The scheduler's description of ``run``'s model and batch (``run.model`` is this family's): a GPT-shaped
        decoder of the spec's shape, with 4-byte parameters and activations of the run's precision."""
        m = run.model
        return Workload.gpt(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=m.seq_len,
                            vocab=m.vocab_size, micro_batch=run.micro_batch, n_microbatches=run.n_microbatches,
                            stages=stages, replicas=replicas, param_bytes=4,
                            act_bytes=4 if run.precision == "fp32" else 2)

    def full_model(self, spec: Any) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
        """The whole model and its ids -> logits function, for the single-process reference: the one stage that
        holds every layer."""
        model = spec.build_stage(0, spec.n_layers)
        return model, model

    def numel(self, spec: Any) -> int:
        """Parameters of the whole model from their shapes alone (nothing allocated)."""
        return sum(math.prod(shape) for _, shape in spec.stage_shapes(0, spec.n_layers))

    def keeps_tied(self, spec: Any) -> bool:
        """Whether the first stage's embedding and the last stage's head are one weight whose gradients are
        summed between the stages (``peer.runtime.stage.tied``)."""
        del spec
        return False

    def tied_slice(self, spec: Any, first_layer: int, last_layer: int) -> tuple[int, int] | None:
        """``[start, end)`` of the tied weight in the flat vector of stage ``[first_layer, last_layer)``; None
        for an untied model."""
        del spec, first_layer, last_layer
        return None

    def describe(self, spec: Any) -> str:
        """What the user named, or a short name of the model, for messages."""
        return f"{self.kind} model, {spec.n_layers} layers"

    def fingerprint(self, spec: Any) -> str:
        """The digest of the model's files that every peer of a run must share ("": nothing read from disk)."""
        del spec
        return ""

    def with_local_files(self, sent: Any, local: Any) -> Any:
        """``sent`` (a leader's assignment's spec) with this peer's own file paths from ``local`` (the daemon's
        spec of the same run), or a :class:`ModelMismatchError` when they are not the same model. Why: a leader's
        paths name files on its disk, and following them would let it make this peer read where it says."""
        del local
        return sent


def check_same_model(family: ModelFamily, sent: Any, local: Any) -> None:
    """Refuse ``sent`` unless ``local`` is a spec of ``family`` with the same fingerprint (the same files)."""
    mine = family.fingerprint(local) if isinstance(local, family.spec_type) else None
    theirs = family.fingerprint(sent)
    if mine != theirs:
        raise ModelMismatchError(f"the assignment's model (fingerprint {str(theirs)[:12]}) is not this peer's "
                                 f"({str(mine)[:12]})")
