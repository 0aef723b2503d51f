"""Building and reading the runtime's envelopes: keys, tensors and the JSON body in ``meta["body"]``.

Data messages use the transport's Kinds (ACTIVATION, ACTIVATION_GRAD, GRAD_SHARD, PARAM_SHARD, STAGE_STATE).
Control messages (coordinator <-> workers, and the task pool's lease/commit requests) are built and checked
by :mod:`peer.runtime.control` on top of these helpers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from protocol import tasklet_pb2 as pb
from protocol.codec import encode_tensor
from protocol.errors import BadMessage

MAX_BODY_BYTES = 1 << 20


def make_key(run_id: str, epoch: int, step: int, microbatch: int = -1, stage: int = -1,
             replica: int = -1) -> pb.Key:
    return pb.Key(run_id=run_id, epoch=epoch, step=step, microbatch=microbatch, stage=stage, replica=replica)


def envelope(kind: int, key: pb.Key, tensors: Mapping[str, torch.Tensor] | None = None, *,
             compression: str = "none", microbatches: list[int] | None = None, op: str = "",
             body: Any = None) -> pb.Envelope:
    """An Envelope with tensors encoded (``compression`` applies to floating tensors only)."""
    env = pb.Envelope(kind=kind, key=key)
    for name, t in (tensors or {}).items():
        env.tensors.append(encode_tensor(name, t, compression if t.is_floating_point() else "none"))
    if microbatches:
        env.microbatches.extend(microbatches)
    if op:
        env.meta["op"] = op
    if body is not None:
        env.meta["body"] = json.dumps(body)
    return env


def body_of(env: pb.Envelope | pb.FetchRequest) -> Any:
    """The JSON body of a control message; BadMessage when it is malformed or oversized."""
    raw = env.meta.get("body", "null")
    if len(raw) > MAX_BODY_BYTES:
        raise BadMessage("meta.body", f"{len(raw)} bytes, more than {MAX_BODY_BYTES}")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadMessage("meta.body", f"not JSON ({exc.msg})") from None


def tensor_named(env: pb.Envelope, name: str) -> pb.Tensor:
    for t in env.tensors:
        if t.name == name:
            return t
    raise BadMessage("tensors", f"no tensor named {name!r}")
