"""The runtime's envelopes (peer.runtime.wire, checkpoint copy parts) go out on the copy-free path: the bytes on
the wire are exactly those of the protobuf Envelope the runtime used to build, and a real push delivers them."""

from __future__ import annotations

import threading

import pytest
import torch

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.runtime.checkpoints import MANIFEST, copy_parts
from tasklet.peer.runtime.wire import envelope, make_key, tensor_named
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor, encode_tensor
from tasklet.protocol.message import WireEnvelope

PLAIN = TransportConfig(tls=None)


def _old_style(kind: int, key: pb.Key, tensors: dict[str, torch.Tensor], compression: str) -> pb.Envelope:
    env = pb.Envelope(kind=kind, key=key)
    for name, t in tensors.items():
        env.tensors.append(encode_tensor(name, t, compression if t.is_floating_point() else "none"))
    env.meta["body"] = '{"x": 1}'
    return env


@pytest.mark.unit
@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "int4", "int2", "topk", "topk2", "topk4"])
def test_runtime_envelopes_serialize_as_the_protobuf_ones(compression: str) -> None:
    key = make_key("run", 1, 2, 3, 0, 1)
    tensors = {"hidden": torch.randn(4, 8, 16), "ids": torch.arange(6), "half": torch.randn(5).to(torch.bfloat16)}
    env = envelope(pb.ACTIVATION, key, tensors, compression=compression, body={"x": 1})
    assert isinstance(env, WireEnvelope)
    assert pb.Envelope.FromString(b"".join(env.segments())) == _old_style(pb.ACTIVATION, key, tensors, compression)
    if compression == "none":  # sent from the tensor's own storage: nothing copied
        assert env.tensors[0].payload.obj is not None
        assert decode_tensor(tensor_named(env, "hidden")).data_ptr() == tensors["hidden"].data_ptr()


@pytest.mark.unit
def test_runtime_and_checkpoint_envelopes_arrive_intact_over_grpc() -> None:
    got: list[WireEnvelope] = []
    arrived = threading.Event()

    def on_push(env: WireEnvelope) -> None:
        got.append(env)
        arrived.set()

    server = PeerServer(TransportConfig(tls=None, chunk_bytes=64 << 10))
    server.register_push("ACTIVATION", on_push)
    server.register_push("CHECKPOINT", on_push)
    server.start()
    try:
        x = torch.randn(3, 70_000)  # several chunks
        files = {MANIFEST: b"{}", "stage-0.pt": bytes(range(256)) * 1000}
        with PeerClient(server.endpoint, TransportConfig(tls=None, chunk_bytes=64 << 10)) as client:
            client.push(envelope(pb.ACTIVATION, make_key("run", 0, 0, 0, 0, 0), {"hidden": x}), timeout_s=30)
            parts = list(copy_parts("run", 0, 2, files, chunk_bytes=100_000))
            for part in parts:
                client.push(part, timeout_s=30)
        assert torch.equal(decode_tensor(got[0].tensors[0], expect_shape=[3, 70_000]), x)
        sent = [(p.meta["part"], p.tensors[0].data if p.tensors else b"") for p in parts]
        received = [(p.meta["part"], p.tensors[0].data if p.tensors else b"") for p in got[1:]]
        assert received == sent and b"".join(d for part, d in sent if part == "data") == files["stage-0.pt"]
    finally:
        server.stop()
