"""Building and reading the runtime's envelopes: keys, tensors and the JSON body in ``meta["body"]`` (a stage
state, an assignment).

Data messages use the transport's Kinds (ACTIVATION, ACTIVATION_GRAD, GRAD_SHARD, PARAM_SHARD, STAGE_STATE).
Control messages (coordinator <-> workers, and the task pool's lease/commit requests) are built and checked
by :mod:`peer.runtime.control` on top of these helpers.

Envelopes are built as protocol.message.WireEnvelope (read like a pb.Envelope): an uncompressed CPU tensor is
sent from its own storage, copied once into the chunks gRPC carries, instead of into a protobuf message, its
serialized form and then the chunks (three copies). The price is the transport's rule for such tensors: they
must not change until the push has finished; the runtime sends fresh tensors (a stage's outputs and input
gradients, cloned gradient and parameter vectors) and never writes into them after sending.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage
from tasklet.protocol.message import WireEnvelope, WireTensor

MAX_BODY_BYTES = 1 << 20


def make_key(run_id: str, epoch: int, step: int, microbatch: int = -1, stage: int = -1,
             replica: int = -1) -> pb.Key:
    return pb.Key(run_id=run_id, epoch=epoch, step=step, microbatch=microbatch, stage=stage, replica=replica)


def envelope(kind: int, key: pb.Key, tensors: Mapping[str, torch.Tensor] | None = None, *,
             compression: str = "none", microbatches: list[int] | None = None, body: Any = None) -> WireEnvelope:
    """An Envelope with tensors encoded (``compression`` applies to floating tensors only); uncompressed CPU
    tensors are sent from their own storage (see the module docstring)."""
    env = WireEnvelope(pb.Envelope(kind=kind, key=key))
    for name, t in (tensors or {}).items():
        env.add_tensor(name, t, compression if t.is_floating_point() else "none")
    if microbatches:
        env.microbatches.extend(microbatches)
    if body is not None:
        env.meta["body"] = json.dumps(body)
    return env


def body_of(env: pb.Envelope | WireEnvelope | pb.FetchRequest) -> Any:
    """The JSON body of a control message; BadMessage when it is malformed or oversized."""
    raw = env.meta.get("body", "null")
    if len(raw) > MAX_BODY_BYTES:
        raise BadMessage("meta.body", f"{len(raw)} bytes, more than {MAX_BODY_BYTES}")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadMessage("meta.body", f"not JSON ({exc.msg})") from None


def tensor_named(env: pb.Envelope | WireEnvelope, name: str) -> pb.Tensor | WireTensor:
    for t in env.tensors:
        if t.name == name:
            return t
    raise BadMessage("tensors", f"no tensor named {name!r}")
