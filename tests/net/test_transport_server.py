"""PeerServer / PeerClient over real gRPC on 127.0.0.1: chunked pushes and fetches, control calls, deadlines,
stream limits and client backpressure.

Every push test runs on both paths a push can take (the ``path`` parameter): "grpc" (no bulk lane on either side,
so large messages keep their coverage on gRPC) and "lane" (every push on the bulk lane, peer.net.bulk_wire). The
lane's own checks, spoken by a raw client, are in test_bulk_lane.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch

from tasklet.peer.net.bulk_client import BulkLane
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.shaping import LinkShaper, download_cap, set_download_cap
from tasklet.peer.net.tls import process_tls
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor, encode_tensor
from tasklet.protocol.errors import Backpressure, BadMessage, PeerUnreachable, Refused
from tasklet.protocol.message import WireEnvelope

CONFIG = TransportConfig(max_message_bytes=2 << 20, chunk_bytes=1 << 20, max_envelope_bytes=64 << 20)
PATHS = ("grpc", "lane")
both_paths = pytest.mark.parametrize("path", PATHS)


def on_path(path: str, config: TransportConfig = CONFIG, **changes: object) -> TransportConfig:
    """``config`` (with ``changes``) for one push path: "grpc" turns the lane off on both sides, "lane" sends every
    push, however small, on it; "default" leaves the lane as configured (large pushes only)."""
    if path == "grpc":
        changes["bulk_port"] = None
    elif path == "lane":
        changes["bulk_min_bytes"] = 0
    return replace(config, **changes)


def assert_path(client: PeerClient, server: PeerServer, path: str, delivered: bool = True) -> None:
    """The pushes so far took ``path``: on "lane" the client holds the lane (a lane that failed and fell back to
    gRPC would be False), with a connection that a ``delivered`` push gave back; on "grpc" neither side has one."""
    if path == "lane":
        assert isinstance(client._lane, BulkLane), client._lane
        assert client._lane._idle or not delivered
        assert server.bulk_port > 0
    elif path == "grpc":
        assert client._lane is False and server.bulk_port == 0


class Inbox:
    """A push handler that records what it got (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: list[pb.Envelope] = []

    def __call__(self, env: pb.Envelope) -> None:
        with self.lock:
            self.got.append(env)


@pytest.fixture
def path() -> str:
    """The push path of a test that is not parametrized with ``both_paths``: the product's default."""
    return "default"


@pytest.fixture
def server(path: str) -> Iterator[PeerServer]:
    srv = PeerServer(on_path(path))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(grace=0.5)


@pytest.fixture
def client(server: PeerServer, path: str) -> Iterator[PeerClient]:
    cli = PeerClient(server.endpoint, on_path(path), sender="tester")
    try:
        yield cli
    finally:
        cli.close()


def _activation(t: torch.Tensor, step: int = 0, compression: str = "none") -> pb.Envelope:
    env = pb.Envelope(kind=pb.ACTIVATION)
    env.key.step = step
    env.key.microbatch = 1
    env.tensors.append(encode_tensor("h", t, compression))
    return env


@both_paths
def test_push_large_tensor_streams_past_grpc_message_limit(server: PeerServer, client: PeerClient, path: str) -> None:
    inbox = Inbox()
    server.register_push("ACTIVATION", inbox)
    t = torch.randn(3, 1 << 20)  # 12 MiB, six times the 2 MiB gRPC message limit
    client.push(_activation(t, step=5), timeout_s=30)
    assert len(inbox.got) == 1
    env = inbox.got[0]
    # the sender is the caller's authenticated identity (its TLS certificate), not what the client wrote
    assert env.protocol_version == PROTOCOL_VERSION and env.sender == process_tls().peer_id and env.key.step == 5
    assert torch.equal(decode_tensor(env.tensors[0], expect_shape=(3, 1 << 20)), t)
    assert server.stats["pushes"] == 1 and server.stats["push_bytes"] > 12 << 20
    assert_path(client, server, path)


@both_paths
def test_compressed_push_round_trip(server: PeerServer, client: PeerClient, path: str) -> None:
    inbox = Inbox()
    server.register_push(pb.ACTIVATION, inbox)
    t = torch.randn(1000)
    client.push(_activation(t, compression="int8"), timeout_s=10)
    out = decode_tensor(inbox.got[0].tensors[0])
    assert (out - t).abs().max() <= t.abs().max() / 254 * 1.001
    assert_path(client, server, path)


def test_fetch_stage_state(server: PeerServer, client: PeerClient) -> None:
    params = torch.randn(5 << 20 >> 2)  # 5 MiB: several chunks back

    def stage_state(request: pb.FetchRequest) -> pb.Envelope:
        env = pb.Envelope(kind=pb.STAGE_STATE, sender="server")
        env.key.CopyFrom(request.key)
        env.tensors.append(encode_tensor("w", params))
        env.meta["optimizer_step"] = "7"
        env.meta["asked_by"] = request.sender
        return env

    server.register_fetch("STAGE_STATE", stage_state)
    key = pb.Key(run_id="r", stage=1)
    seen: list[tuple[int, int]] = []
    env = client.fetch("STAGE_STATE", key, meta={"why": "join"}, timeout_s=30,
                       progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 2 and seen[-1][0] == seen[-1][1] > 5 << 20  # bytes so far of the announced total, per chunk
    assert [d for d, _ in seen] == sorted({d for d, _ in seen})
    assert env.key.stage == 1 and env.meta["optimizer_step"] == "7" and env.meta["asked_by"] == process_tls().peer_id
    assert torch.equal(decode_tensor(env.tensors[0]), params)
    with pytest.raises(Refused) as info:
        client.fetch("GRAD_SHARD", key, timeout_s=5)
    assert info.value.code == "FAILED_PRECONDITION" and "GRAD_SHARD" in info.value.detail


def test_a_fetch_of_known_size_is_bounded_by_it_not_by_the_transport_default(server: PeerServer,
                                                                              path: str) -> None:
    """A stage's state may exceed ``max_envelope_bytes`` (a 1 GiB default; ~50M parameters of state): the
    fetcher that knows its size bounds it by that size instead, and a reply over that bound is refused."""
    from tasklet.peer.compute.model import ModelConfig
    from tasklet.peer.runtime.bounds import stage_numel, state_bytes

    model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=16)
    numel = stage_numel(model, (0, 2))
    assert numel == sum(p.numel() for p in model.build_stage(0, 2).parameters())
    params = torch.randn(numel)
    server.register_fetch("STAGE_STATE", lambda request: pb.Envelope(
        kind=pb.STAGE_STATE, key=request.key, tensors=[encode_tensor(n, params) for n in ("a", "b", "c", "d")]))
    small = PeerClient(server.endpoint, on_path(path, max_envelope_bytes=numel * 4), sender="tester")
    try:
        with pytest.raises(BadMessage, match="exceeds this peer's limit"):
            small.fetch("STAGE_STATE", pb.Key(run_id="r"), timeout_s=30)  # four vectors over the default
        env = small.fetch("STAGE_STATE", pb.Key(run_id="r"), timeout_s=30, max_bytes=state_bytes(numel))
        assert torch.equal(decode_tensor(env.tensors[3]), params)
        with pytest.raises(BadMessage, match="exceeds this peer's limit"):
            small.fetch("STAGE_STATE", pb.Key(run_id="r"), timeout_s=30, max_bytes=3 * numel * 4)
    finally:
        small.close()


def test_control_calls(server: PeerServer, client: PeerClient) -> None:
    server.set_status_provider(lambda: {"stage": 1, "loss": 2.5})
    assert 0 < client.ping(timeout_s=5) < 5
    status = client.status(timeout_s=5)
    assert status["stage"] == 1 and status["loss"] == 2.5 and status["protocol_version"] == PROTOCOL_VERSION
    assert client.probe(3 << 20, timeout_s=30) > 0
    assert client.status()["transport"]["probes"] == 1


@both_paths
def test_push_without_handler_is_refused(server: PeerServer, client: PeerClient, path: str) -> None:
    with pytest.raises(Refused) as info:
        client.push(_activation(torch.ones(2)), timeout_s=5)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "envelope.kind: this peer takes no ACTIVATION messages" in str(info.value)
    assert_path(client, server, path, delivered=False)


@both_paths
def test_handler_crash_is_internal_and_server_keeps_serving(server: PeerServer, client: PeerClient, path: str) -> None:
    calls = []

    def flaky(env: pb.Envelope) -> None:
        calls.append(env.key.step)
        if env.key.step == 0:
            raise KeyError("boom")

    server.register_push("ACTIVATION", flaky)
    with pytest.raises(Refused) as info:
        client.push(_activation(torch.ones(2), step=0), timeout_s=5)
    assert info.value.code == "INTERNAL" and "KeyError" in info.value.detail
    client.push(_activation(torch.ones(2), step=1), timeout_s=5)
    assert calls == [0, 1]
    assert_path(client, server, path)


@both_paths
def test_unreachable_peer_and_deadline(path: str) -> None:
    cfg = on_path(path)
    srv = PeerServer(cfg)
    port = srv.start()
    srv.stop(grace=0)
    with PeerClient(f"127.0.0.1:{port}", cfg) as dead:
        with pytest.raises(PeerUnreachable, match="UNAVAILABLE"):
            dead.ping(timeout_s=2)
        with pytest.raises(PeerUnreachable):
            dead.push(_activation(torch.ones(2)), timeout_s=2)

    release = threading.Event()
    with PeerServer(cfg) as slow, PeerClient(slow.endpoint, cfg) as cli:
        slow.register_push("ACTIVATION", lambda env: release.wait(10))
        try:
            with pytest.raises(PeerUnreachable, match="DEADLINE_EXCEEDED"):
                cli.push(_activation(torch.ones(2)), timeout_s=0.5)
        finally:
            release.set()
        assert_path(cli, slow, path, delivered=False)


def test_calls_without_deadline_are_refused(server: PeerServer) -> None:
    with process_tls().channel(server.endpoint) as channel:
        ping = channel.unary_unary(
            "/tasklet.v1.Peer/Ping",
            request_serializer=pb.PingRequest.SerializeToString,
            response_deserializer=pb.PingReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            ping(pb.PingRequest(protocol_version=PROTOCOL_VERSION))  # no timeout on purpose
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "without a deadline" in info.value.details()


@both_paths
def test_client_backpressure_blocks_then_times_out(path: str) -> None:
    cfg = on_path(path, TransportConfig(max_inflight_pushes=2))
    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocked(env: pb.Envelope) -> None:
        entered.release()
        release.wait(10)

    with PeerServer(cfg) as srv, PeerClient(srv.endpoint, cfg) as cli:
        srv.register_push("ACTIVATION", blocked)
        try:
            first = cli.push_async(_activation(torch.ones(2)), timeout_s=10)
            second = cli.push_async(_activation(torch.ones(2)), timeout_s=10)
            assert entered.acquire(timeout=5) and entered.acquire(timeout=5)
            with pytest.raises(Backpressure, match="2 pushes in flight"):
                cli.push_async(_activation(torch.ones(2)), timeout_s=0.3)
        finally:
            release.set()
        first.result(timeout=10)
        second.result(timeout=10)
        cli.push(_activation(torch.ones(2)), timeout_s=5)  # a slot is free again
        assert_path(cli, srv, path)


@both_paths
def test_server_stream_limit_answers_busy(path: str) -> None:
    cfg = on_path(path, TransportConfig(max_concurrent_streams=1, thread_pool_size=3))
    release = threading.Event()
    entered = threading.Event()

    def blocked(env: pb.Envelope) -> None:
        entered.set()
        release.wait(10)

    with PeerServer(cfg) as srv, PeerClient(srv.endpoint, cfg) as a, PeerClient(srv.endpoint, cfg) as b:
        srv.register_push("ACTIVATION", blocked)
        try:
            pending = a.push_async(_activation(torch.ones(2)), timeout_s=10)
            assert entered.wait(5)
            with pytest.raises(PeerUnreachable, match="busy"):
                b.push(_activation(torch.ones(2)), timeout_s=5)
            assert b.ping(timeout_s=5) > 0  # unary calls still get a thread
        finally:
            release.set()
        pending.result(timeout=10)
        assert_path(a, srv, path)
        assert_path(b, srv, path, delivered=False)


@both_paths
def test_shaped_link_delays_push_and_both_ping_directions(server: PeerServer, path: str) -> None:
    inbox = Inbox()
    server.register_push("ACTIVATION", inbox)
    back = LinkShaper(50e6, 0.03)
    server.set_reply_shaper(lambda sender: back if sender == process_tls().peer_id else None)
    link = LinkShaper(50e6, 0.02)
    with PeerClient(server.endpoint, on_path(path), shaper=link, sender="shaped") as cli:
        t = torch.randn(100_000)
        start = time.monotonic()
        cli.push(_activation(t), timeout_s=10)
        assert time.monotonic() - start >= 0.02 + 400_000 * 8 / 50e6  # the link's delay and rate, on either path
        assert torch.equal(decode_tensor(inbox.got[0].tensors[0]), t)
        assert link.bytes_sent >= 400_000
        assert_path(cli, server, path)
        # Lower bounds hold by construction (the shaper sleeps); they are not performance assertions.
        assert cli.ping(timeout_s=5) >= 0.05
        state = torch.randn(50_000)
        server.register_fetch("STAGE_STATE", lambda req: pb.Envelope(tensors=[encode_tensor("w", state)]))
        start = time.monotonic()
        env = cli.fetch("STAGE_STATE", timeout_s=10)
        assert time.monotonic() - start >= 0.05  # request one way + reply one way
        assert torch.equal(decode_tensor(env.tensors[0]), state)
        assert back.bytes_sent >= 200_000  # the reply went through the server's shaper for this sender


@both_paths
def test_the_download_cap_paces_what_this_process_takes_in(server: PeerServer, client: PeerClient, path: str) -> None:
    """``--max-download``: pushes received (gRPC or bulk lane) and fetch replies pass one token bucket; the push's
    ack waits for the last chunk to be taken in, so the sender is held to the cap too."""
    inbox = Inbox()
    server.register_push("ACTIVATION", inbox)
    state = torch.randn(1 << 19)  # 2 MiB
    server.register_fetch("STAGE_STATE", lambda req: pb.Envelope(tensors=[encode_tensor("w", state)]))
    rate = 64e6  # 8 MB/s
    set_download_cap(rate)
    try:
        cap = download_cap()
        assert cap is not None
        t = torch.randn(1 << 20)  # 4 MiB
        start = time.monotonic()
        client.push(_activation(t), timeout_s=30)
        pushed_s = time.monotonic() - start
        start = time.monotonic()
        env = client.fetch("STAGE_STATE", timeout_s=30)
        fetched_s = time.monotonic() - start
        taken = cap.bytes_sent
    finally:
        set_download_cap(None)
    assert torch.equal(decode_tensor(inbox.got[0].tensors[0]), t)
    assert torch.equal(decode_tensor(env.tensors[0]), state)
    assert taken >= (4 << 20) + (2 << 20)
    assert pushed_s >= (4 << 20) * 8 / rate and fetched_s >= (2 << 20) * 8 / rate, (pushed_s, fetched_s)
    assert_path(client, server, path)
    with pytest.raises(ValueError):
        set_download_cap(float("inf"))
    assert download_cap() is None


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        TransportConfig(chunk_bytes=8 << 20, max_message_bytes=8 << 20)
    with pytest.raises(ValueError, match="thread_pool_size"):
        TransportConfig(max_concurrent_streams=8, thread_pool_size=8)
    with pytest.raises(ValueError, match="port"):
        TransportConfig(port=70000)
    with pytest.raises(ValueError, match="bulk_port"):
        TransportConfig(bulk_port=70000)
    with pytest.raises(ValueError, match="bulk_min_bytes"):
        TransportConfig(bulk_min_bytes=-1)


@both_paths
def test_large_messages_round_trip_bit_for_bit_on_the_copy_free_path(path: str) -> None:
    """A 64 MiB tensor of random bytes pushed, and a 64 MiB float tensor fetched, over mutual TLS, each sent
    from its own storage (WireEnvelope) and received into a buffer of its own: equal bit for bit, decoded
    without a copy."""
    cfg = on_path(path, TransportConfig(max_message_bytes=8 << 20, chunk_bytes=4 << 20, max_envelope_bytes=80 << 20))
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    params = torch.randn(16 << 20)  # 64 MiB
    got: list[torch.Tensor] = []

    def on_push(env: WireEnvelope) -> None:
        assert isinstance(env, WireEnvelope)
        out = decode_tensor(env.tensors[0], expect_dtype=torch.uint8, expect_shape=(64 << 20,))
        assert out.data_ptr() == torch.frombuffer(env.tensors[0].payload, dtype=torch.uint8).data_ptr()
        got.append(out)

    def stage_state(request: pb.FetchRequest) -> WireEnvelope:
        env = WireEnvelope(pb.Envelope(kind=pb.STAGE_STATE))
        env.add_tensor("w", params)
        return env

    with PeerServer(cfg) as srv, PeerClient(srv.endpoint, cfg) as cli:
        srv.register_push("ACTIVATION", on_push)
        srv.register_fetch("STAGE_STATE", stage_state)
        env = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
        env.add_tensor("h", data)
        cli.push(env, timeout_s=60)
        assert len(got) == 1 and torch.equal(got[0], data)
        assert_path(cli, srv, path)
        fetched = cli.fetch("STAGE_STATE", timeout_s=60)
        assert torch.equal(decode_tensor(fetched.tensors[0], expect_shape=(16 << 20,)), params)
        # past the limit: refused from the first chunk, on this path too
        big = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
        big.add_tensor("h", torch.zeros(81 << 20, dtype=torch.uint8))
        with pytest.raises(Refused) as info:
            cli.push(big, timeout_s=60)
        assert info.value.code == "INVALID_ARGUMENT" and "exceeds this peer's limit" in info.value.detail
        assert len(got) == 1


@both_paths
def test_copy_free_push_refusals(server: PeerServer, client: PeerClient, path: str) -> None:
    """NaN, a size that does not match the shape, and a wrong dtype are refused on the copy-free path too."""

    def strict(env: WireEnvelope) -> None:
        decode_tensor(env.tensors[0], expect_dtype=torch.float32, expect_shape=(None, 4))

    server.register_push("ACTIVATION", strict)
    nan = torch.ones(2, 4)
    nan[1, 2] = float("nan")
    bad_size = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
    bad_size.add_tensor("h", torch.ones(2, 4)).header.shape[:] = [3, 4]
    cases = [(nan, "NaN or inf"), (torch.ones(2, 4, dtype=torch.float64), "expected float32")]
    for t, why in cases:
        env = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
        env.add_tensor("h", t)
        with pytest.raises(Refused) as info:
            client.push(env, timeout_s=10)
        assert info.value.code == "INVALID_ARGUMENT" and why in info.value.detail
    with pytest.raises(Refused) as info:
        client.push(bad_size, timeout_s=10)
    assert info.value.code == "INVALID_ARGUMENT" and "needs 48" in info.value.detail
    client.push(_activation(torch.ones(5, 4)), timeout_s=10)  # a pb.Envelope still goes through
    assert_path(client, server, path)
