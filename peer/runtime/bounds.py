"""The largest message of each Kind a worker accepts, derived from its run: what anyone can make it buffer.

A push is refused from its first chunk when it announces more than its Kind's bound here (peer.net.server
checks, before buffering), and buffers grow only with the bytes that arrive. The bounds are tight multiples
of the real sizes: an activation is at most ``micro_batch x seq_len x d_model x 4`` bytes (float32, the
widest dtype on the wire), a gradient or parameter shard at most the stage's parameter count x 4, and a fetched
stage state (:func:`state_bytes`) its five float32 vectors at most, whatever the transport's default.

What an order may make a worker allocate is bounded from the run's own (organiser-signed) spec as well: a
checkpoint copy (:func:`checkpoint_bytes`) and a stage's device memory (:func:`stage_memory_bytes`), so a
leader cannot make a peer write or allocate more than the run it joined needs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tasklet.peer.compute.family import family_of
from tasklet.peer.compute.workload import workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.protocol import tasklet_pb2 as pb

# Room for an Envelope's key, names, shapes, meta and JSON bodies on top of its tensor bytes.
ENVELOPE_SLACK_BYTES = 64 * 1024
ASSIGNMENT_BYTES = 1 << 20  # a STAGE_ASSIGNMENT: the run spec and plan as JSON, certificates of the plan's peers
CONTROL_BYTES = 64 * 1024  # a CONTROL message: a few numbers; a reduce names the commit record


def push_limits(spec: RunSpec | None, stage_numel: int) -> dict[int, int]:
    """Kind -> the largest Envelope (bytes) accepted. Before any assignment only control messages are."""
    limits = {pb.STAGE_ASSIGNMENT: ASSIGNMENT_BYTES, pb.CONTROL: CONTROL_BYTES + 16 * _mb_bytes(spec)}
    if spec is None:
        return limits
    hidden = spec.micro_batch * spec.model.seq_len * spec.model.d_model * 4
    shard = stage_numel * 4
    limits[pb.ACTIVATION] = hidden + ENVELOPE_SLACK_BYTES
    limits[pb.ACTIVATION_GRAD] = hidden + ENVELOPE_SLACK_BYTES
    limits[pb.GRAD_SHARD] = shard + ENVELOPE_SLACK_BYTES + 16 * spec.n_microbatches
    limits[pb.PARAM_SHARD] = shard + ENVELOPE_SLACK_BYTES
    if family_of(spec.model).keeps_tied(spec.model):  # the tied weight's gradient, first <-> last stage
        limits[pb.TIED_GRAD] = spec.model.vocab_size * spec.model.d_model * 4 + ENVELOPE_SLACK_BYTES
    return limits


def _mb_bytes(spec: RunSpec | None) -> int:
    """A reduce carries the commit record: one entry per micro-batch."""
    return 0 if spec is None else spec.n_microbatches


STATE_VECTORS = 5  # a STAGE_STATE's float32 vectors: parameters, two AdamW moments, DiLoCo's anchor and momentum


def stage_numel(model: Any, layers: tuple[int, int]) -> int:
    """Parameters of the stage holding ``layers`` of ``model`` (a spec of any family), from
    their shapes alone: nothing is allocated."""
    return sum(math.prod(shape) for _, shape in model.stage_shapes(*layers))


def state_bytes(stage_params: int) -> int:
    """The largest STAGE_STATE of a stage of ``stage_params`` parameters: what a fetch of it may buffer (the
    state of a stage over ~89M parameters, 53M with DiLoCo's vectors, exceeds the transport's 1 GiB default)."""
    return STATE_VECTORS * 4 * stage_params + ENVELOPE_SLACK_BYTES


def model_numel(model: Any) -> int:
    """Parameters of the whole model, from its shapes alone (nothing is allocated), as its family counts them
    (the byte GPT's closed form; else the shapes of the stage of every layer)."""
    return family_of(model).numel(model)


def checkpoint_bytes(spec: RunSpec) -> int:
    """The largest checkpoint (every file a copy lists) of a run of ``spec``: each stage's state is at most
    :func:`state_bytes`, so the whole model's parameters in :data:`STATE_VECTORS` float32 vectors (a checkpoint
    stores three: parameters and AdamW's moments), with a second copy of a tied weight (kept by the first and the
    last stage), and per file (at most one per layer, and ``run.json``) the envelope slack and the run's own
    description, which every stage file and ``run.json`` repeat."""
    model = spec.model
    numel = model_numel(model)
    if family_of(model).keeps_tied(model):
        numel += model.vocab_size * model.d_model
    files = model.n_layers + 1
    described = len(json.dumps(spec.to_dict()))
    return STATE_VECTORS * 4 * numel + files * (ENVELOPE_SLACK_BYTES + described)


def stage_memory_bytes(spec: RunSpec, layers: tuple[int, int], in_flight: int) -> float:
    """The device memory a stage of ``layers`` needs with ``in_flight`` micro-batches in flight (1F1B: stage
    ``s`` of ``n`` holds ``n - s``): weights, gradients, AdamW's moments and stashed activations, the scheduler's
    estimate from the spec's shapes (``peer.node.planning.workload_for``); nothing is allocated."""
    return workload_for(spec).stage_memory_bytes(layers[0], layers[1], in_flight=in_flight)
