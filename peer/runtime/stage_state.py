"""The stage state both sides hand over: the STAGE_STATE envelope a replica, a checkpoint or the coordinator
serves, and the parameters hash that replicas compare after every apply. (The worker's snapshot of its
assignment, :class:`peer.runtime.stage.snapshot.Tasklet`, is the peer side's own.)"""

from __future__ import annotations

from typing import Any

import torch

from tasklet.peer.compute.stage import StageCompute
from tasklet.peer.runtime.outer import OuterState
from tasklet.peer.runtime.wire import body_of, envelope, make_key, tensor_named
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor
from tasklet.protocol.errors import BadMessage


def params_hash(compute: StageCompute) -> str:
    """A short hash of a stage's parameters: replicas that applied the same steps agree bitwise."""
    return compute.params_digest()


def state_envelope(state: dict[str, Any], run_id: str, epoch: int, stage: int, replica: int = -1,
                   outer: OuterState | None = None) -> pb.Envelope:
    """A STAGE_STATE envelope: flat tensors plus the scalar fields as JSON (and a DiLoCo replica's anchor and
    Nesterov buffer when ``outer`` is given)."""
    meta = {k: state[k] for k in ("format", "model", "layers", "step", "adam_step")}
    key = make_key(run_id, epoch, int(state["step"]), stage=stage, replica=replica)
    tensors = {k: state[k] for k in ("params", "exp_avg", "exp_avg_sq")}
    if outer is not None:
        tensors.update(outer_anchor=outer.anchor, outer_momentum=outer.momentum)
    return envelope(pb.STAGE_STATE, key, tensors, body=meta)


def state_from_envelope(env: pb.Envelope) -> dict[str, Any]:
    """Inverse of :func:`state_envelope` (tensors checked: float32, finite)."""
    state: dict[str, Any] = dict(body_of(env))
    for t in env.tensors:  # a state is sent as it is: each element paid for by 4 bytes of the bounded message
        if t.compression != pb.NONE:
            raise BadMessage(f"tensors[{t.name!r}].compression", "a stage state is sent uncompressed")
    for name in ("params", "exp_avg", "exp_avg_sq"):
        state[name] = decode_tensor(tensor_named(env, name), expect_dtype=torch.float32)
    for t in env.tensors:
        if t.name in ("outer_anchor", "outer_momentum"):
            state[t.name] = decode_tensor(t, expect_dtype=torch.float32)
    if not isinstance(state.get("step"), int):
        raise BadMessage("meta.body.step", "missing or not an integer")
    return state
