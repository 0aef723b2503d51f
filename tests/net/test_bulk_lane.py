"""The bulk lane (peer.net.bulk_wire, bulk_server, bulk_client) on real sockets on 127.0.0.1, against a real
PeerServer, with real mutual TLS.

Why a raw client: PeerClient only sends well-formed requests, so every check of the server side is spoken here byte
by byte (bulk_wire.HEAD, read_reply); each refusal test would fail if its check were removed. PeerClient's own use
of the lane (integrity, fallback to gRPC, the errors it raises) is tested through PeerClient.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import grpc
import pytest
import torch

from tasklet.peer.identity.certs import SERVER_NAME
from tasklet.peer.net import bulk_client, bulk_server
from tasklet.peer.net.bulk_client import BulkLane
from tasklet.peer.net.bulk_server import FIRST_PIECE_BYTES
from tasklet.peer.net.bulk_wire import HEAD, HEAD_MAGIC, read_reply
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.counters import TRAFFIC
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor, encode_tensor
from tasklet.protocol.errors import (
    BadMessage,
    Forbidden,
    PeerUnreachable,
    Refused,
    Rejected,
    Unauthenticated,
    Unavailable,
)
from tasklet.protocol.message import WireEnvelope
from tests.support.waits import wait_until

MIB = 1 << 20
OK = grpc.StatusCode.OK
BASE = TransportConfig(
    max_message_bytes=2 * MIB, chunk_bytes=MIB, max_envelope_bytes=64 * MIB, max_deadline_s=30.0, bulk_min_bytes=0
)


# --- helpers ----------------------------------------------------------------------------------------------------
@dataclass
class Identities:
    """A server's and a client's TLS identities that trust each other (and a third, trusted too)."""

    server: TlsContext
    client: TlsContext
    other: TlsContext


def _identities() -> Identities:
    server, client, other = TlsContext.generate(), TlsContext.generate(), TlsContext.generate()
    server.trust_only([client.certificate, other.certificate])
    client.trust_only([server.certificate])
    other.trust_only([server.certificate])
    return Identities(server, client, other)


@pytest.fixture(scope="module")
def ids() -> Identities:
    """Shared by the tests that do not change trust (an RSA key costs about 0.1 s)."""
    return _identities()


@dataclass
class Inbox:
    """A push handler that decodes every tensor (refusing NaN, as a worker does) and records what it got;
    ``step`` 13 crashes it, ``block`` holds it while set (``entered`` tells it started)."""

    got: list[WireEnvelope] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    block: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)

    def __call__(self, env: WireEnvelope) -> None:
        for tensor in env.tensors:
            decode_tensor(tensor)
        if env.key.step == 13:
            raise KeyError("boom")
        if self.block is not None and env.key.step == 1:
            self.entered.set()
            self.block.wait(10)
        with self.lock:
            self.got.append(env)

    @property
    def steps(self) -> list[int]:
        with self.lock:
            return [env.key.step for env in self.got]


class Lanes:
    """Starts PeerServers with a lane (and an Inbox for ACTIVATION) and stops them at the end of the test."""

    def __init__(self) -> None:
        self.servers: list[PeerServer] = []

    def start(self, tls: TlsContext | None, **changes: object) -> tuple[PeerServer, Inbox]:
        server = PeerServer(replace(BASE, tls=tls, **changes))
        inbox = Inbox()
        server.register_push(pb.ACTIVATION, inbox)
        server.start()
        self.servers.append(server)
        assert (server.bulk_port > 0) == (server.config.bulk_port is not None)
        return server, inbox

    def stop(self) -> None:
        for server in self.servers:
            server.stop(grace=0.2)


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    started = Lanes()
    try:
        yield started
    finally:
        started.stop()


class RawLane:
    """A hand-written lane client: a socket (TLS through ``tls.ssl_client_context()`` or ``context``) that speaks
    the bytes of peer.net.bulk_wire, nothing checked on our side."""

    def __init__(
        self,
        port: int,
        tls: TlsContext | None = None,
        *,
        context: ssl.SSLContext | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sent = 0
        if context is None and tls is not None:
            context = tls.ssl_client_context()
        try:
            self.sock = raw if context is None else context.wrap_socket(raw, server_hostname=SERVER_NAME)
        except BaseException:
            raw.close()
            raise

    def head(
        self, total: int, *, magic: bytes = HEAD_MAGIC, version: int = PROTOCOL_VERSION, deadline_ms: int = 5000
    ) -> None:
        self.sock.sendall(HEAD.pack(magic, version, deadline_ms, total))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def reply(self) -> tuple[grpc.StatusCode, int, str]:
        return read_reply(self.sock)

    def push(self, body: bytes, deadline_ms: int = 5000) -> tuple[grpc.StatusCode, int, str]:
        self.head(len(body), deadline_ms=deadline_ms)
        self.send(body)
        return self.reply()

    def closed_by_server(self, within_s: float) -> bool:
        """True when the server ends the connection (EOF, reset, TLS alert) within ``within_s``."""
        self.sock.settimeout(within_s)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except (ConnectionError, ssl.SSLError):
            return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawLane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def body(step: int = 0, tensor: torch.Tensor | None = None, *, kind: int = pb.ACTIVATION, sender: str = "") -> bytes:
    """A serialized Envelope, as a lane request carries it (fields in number order: version, then kind)."""
    env = pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=kind, sender=sender)
    env.key.step = step
    env.tensors.append(encode_tensor("h", torch.ones(4) if tensor is None else tensor))
    return env.SerializeToString()


def open_connections(server: PeerServer) -> int:
    assert server._lane is not None
    with server._lane._lock:
        return len(server._lane._conns)


def assert_still_serving(server: PeerServer, inbox: Inbox, tls: TlsContext | None, step: int = 7) -> None:
    """Nothing of the refused request reached the handler, no stream slot leaked, and a good push succeeds (on a
    new connection)."""
    assert inbox.steps == []
    assert server._per_peer == {}
    good = body(step)
    with RawLane(server.bulk_port, tls) as raw:
        assert raw.push(good) == (OK, len(good), "")
    assert inbox.steps == [step]


# --- integrity ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls"])
def test_large_tensors_cross_the_lane_bit_for_bit(lanes: Lanes, ids: Identities, secure: bool) -> None:
    """64 MiB of random bytes and 16M float32 values in one push (above the default bulk_min_bytes, so PeerClient
    picks the lane by itself), received equal bit for bit, decoded without a copy."""
    tls = ids.client if secure else None
    server, _ = lanes.start(
        ids.server if secure else None,
        max_envelope_bytes=160 * MIB,
        chunk_bytes=4 * MIB,
        max_message_bytes=8 * MIB,
        bulk_min_bytes=256 << 10,
    )
    got: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def on_push(env: WireEnvelope) -> None:
        raw = decode_tensor(env.tensors[0], expect_dtype=torch.uint8, expect_shape=(64 * MIB,))
        floats = decode_tensor(env.tensors[1], expect_dtype=torch.float32, expect_shape=(16 * MIB,))
        assert raw.data_ptr() == torch.frombuffer(env.tensors[0].payload, dtype=torch.uint8).data_ptr()
        got.append((env.sender, raw, floats))

    server.register_push(pb.ACTIVATION, on_push)
    data = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8)
    params = torch.randn(16 * MIB)
    env = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
    env.add_tensor("bytes", data)
    env.add_tensor("floats", params)
    with PeerClient(server.endpoint, replace(server.config, tls=tls), sender="claimed") as cli:
        cli.push(env, timeout_s=30)
        assert isinstance(cli._lane, BulkLane) and len(cli._lane._idle) == 1  # the lane carried it
    assert len(got) == 1
    sender, raw, floats = got[0]
    assert torch.equal(raw, data) and torch.equal(floats.view(torch.int32), params.view(torch.int32))
    assert sender == (ids.client.peer_id if secure else "claimed")  # TLS: the certificate's peer, not the claim


# --- refusals, spoken by a raw client -------------------------------------------------------------------------
@dataclass
class Refusal:
    """A bad request: head fields (``head``), the body sent after it (None: nothing, the head alone is refused),
    a server set-up; the code and the words of the answer."""

    code: grpc.StatusCode
    says: str
    head: dict[str, int | bytes] = field(default_factory=dict)
    body: bytes | None = None
    setup: Callable[[PeerServer], None] = lambda server: None


def _forbid(kind: int, caller: str) -> int:
    raise Forbidden(f"{caller or 'nobody'} has no role for {pb.Kind.Name(kind)}")


NAN = torch.ones(8)
NAN[3] = float("nan")
REFUSALS = {
    "wrong magic": Refusal(grpc.StatusCode.INVALID_ARGUMENT, "not a bulk-lane request", {"magic": b"GET "}),
    "wrong protocol version": Refusal(grpc.StatusCode.INVALID_ARGUMENT, "speaks protocol version 99", {"version": 99}),
    "no deadline": Refusal(grpc.StatusCode.INVALID_ARGUMENT, "without a deadline", {"deadline_ms": 0}),
    "deadline above the limit": Refusal(
        grpc.StatusCode.INVALID_ARGUMENT, "exceeds this peer's limit of 30 s", {"deadline_ms": 60_000}
    ),
    "admission forbidden": Refusal(
        grpc.StatusCode.PERMISSION_DENIED,
        "has no role for ACTIVATION",
        body=body(),
        setup=lambda s: s.set_push_admission(_forbid),
    ),
    "admission limit": Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceeds this peer's limit of 16 for ACTIVATION",
        body=body(),
        setup=lambda s: s.set_push_admission(lambda kind, caller: 16),
    ),
    "admission takes none": Refusal(
        grpc.StatusCode.FAILED_PRECONDITION,
        "takes no ACTIVATION messages now",
        body=body(),
        setup=lambda s: s.set_push_admission(lambda kind, caller: 0),
    ),
    "no handler for the kind": Refusal(
        grpc.StatusCode.FAILED_PRECONDITION, "takes no GRAD_SHARD messages", body=body(kind=pb.GRAD_SHARD)
    ),
    "NaN tensor": Refusal(grpc.StatusCode.INVALID_ARGUMENT, "NaN or inf", body=body(tensor=NAN)),
    "not an envelope": Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        "envelope",
        body=bytes([0x08, PROTOCOL_VERSION, 0x10, pb.ACTIVATION]) + b"\xff" * 60,
    ),
    "handler crash": Refusal(grpc.StatusCode.INTERNAL, "KeyError", body=body(step=13)),
}


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls"])
@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_refusal(lanes: Lanes, ids: Identities, case: str, secure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check answers its code on the lane as on gRPC, then ends the connection; the handler never records
    the request, the server keeps serving."""
    monkeypatch.setattr(bulk_server, "DRAIN_S", 0.1)  # how long a refused connection is read before it is closed
    refusal = REFUSALS[case]
    tls = ids.client if secure else None
    server, inbox = lanes.start(ids.server if secure else None)
    refusal.setup(server)
    before = TRAFFIC.snapshot().refused.get(refusal.code.name, 0)
    with RawLane(server.bulk_port, tls) as raw:
        total = len(refusal.body) if refusal.body is not None else 100
        raw.head(total, **refusal.head)  # type: ignore[arg-type]
        if refusal.body is not None:
            raw.send(refusal.body)
        code, received, message = raw.reply()
        assert (code, received) == (refusal.code, 0), message
        assert refusal.says in message
        assert raw.closed_by_server(within_s=3.0)  # a refusal ends the connection
    assert TRAFFIC.snapshot().refused.get(refusal.code.name, 0) > before
    server.set_push_admission(lambda kind, caller: 1 << 30)
    assert_still_serving(server, inbox, tls)


def test_announced_size_over_the_limit_is_refused_from_the_first_piece(lanes: Lanes, ids: Identities) -> None:
    """A 1 GiB announcement is answered after its first 64 KiB: the client never has to send (nor the server
    read) the rest."""
    server, inbox = lanes.start(ids.server)
    prefix = body()[:8]
    with RawLane(server.bulk_port, ids.client) as raw:
        raw.head(1 << 30)
        raw.send(prefix + bytes(FIRST_PIECE_BYTES - len(prefix)))
        code, received, message = raw.reply()  # times out (5 s) if the server waited for more
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds this peer's limit" in message
        assert raw.sent == 64 << 10
    assert_still_serving(server, inbox, ids.client)


@contextlib.contextmanager
def _slot_held(holder: RawLane, inbox: Inbox) -> Iterator[bytes]:
    """``holder`` sends a push (step 1) that the server enters and holds, a stream slot in use, until the
    block ends; then its answer is checked. Yields the push's body."""
    inbox.block = threading.Event()
    first = body(step=1)
    holder.head(len(first))
    holder.send(first)
    try:
        assert inbox.entered.wait(5)
        yield first
    finally:
        inbox.block.set()
    assert holder.reply() == (OK, len(first), "")


def test_busy_server_answers_unavailable(lanes: Lanes, ids: Identities) -> None:
    """With every stream slot taken, a request is refused at its first chunk (a slot is taken only once the chunk's
    Kind is admitted from the caller, as on gRPC), before the rest is buffered."""
    server, inbox = lanes.start(ids.server, max_concurrent_streams=1, thread_pool_size=3)
    with RawLane(server.bulk_port, ids.client) as holder:
        with _slot_held(holder, inbox) as first, RawLane(server.bulk_port, ids.other) as late:
            late.head(len(first))
            late.send(first)
            code, _, message = late.reply()
            assert code == grpc.StatusCode.UNAVAILABLE and "busy" in message
        second = body(step=2)
        assert holder.push(second) == (OK, len(second), "")  # the same connection serves the next request
    assert inbox.steps == [1, 2]


def test_a_request_silent_after_its_head_holds_no_stream_slot(lanes: Lanes, ids: Identities) -> None:
    """A caller that sends a head and then nothing (or a Kind it has no role for) holds no stream slot: the only
    slot stays free for an honest push."""
    server, inbox = lanes.start(ids.server, max_concurrent_streams=1, thread_pool_size=3)
    with RawLane(server.bulk_port, ids.other) as silent, RawLane(server.bulk_port, ids.client) as honest:
        silent.head(1 << 20)
        time.sleep(0.2)  # the server has read the head and waits for the first chunk
        pushed = body(step=4)
        assert honest.push(pushed) == (OK, len(pushed), "")
    assert inbox.steps == [4]


def test_per_peer_quota_answers_resource_exhausted(lanes: Lanes, ids: Identities) -> None:
    """A caller holding its quota of slots is refused another; another caller still gets one."""
    server, inbox = lanes.start(ids.server, max_concurrent_streams=4, max_streams_per_peer=1)
    with RawLane(server.bulk_port, ids.client) as holder, _slot_held(holder, inbox) as first:
        with RawLane(server.bulk_port, ids.client) as again:
            again.head(len(first))
            again.send(first)
            code, _, message = again.reply()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota is 1" in message
        with RawLane(server.bulk_port, ids.other) as other:
            third = body(step=3)
            assert other.push(third) == (OK, len(third), "")
    assert inbox.steps == [3, 1]
    assert server._per_peer == {}


# --- authentication -----------------------------------------------------------------------------------------------
def _stranger(ids: Identities) -> ssl.SSLContext:
    return TlsContext.generate().trust_only([ids.server.certificate]).ssl_client_context()


def _stranger_tls12(ids: Identities) -> ssl.SSLContext:
    context = _stranger(ids)
    context.maximum_version = ssl.TLSVersion.TLSv1_2  # the server's verdict then ends the handshake itself
    return context


def _no_certificate(ids: Identities) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=ids.server.certificate.decode())
    return context


@pytest.mark.parametrize(
    "make_context", [_stranger, _stranger_tls12, _no_certificate], ids=["stranger", "stranger TLS 1.2", "no cert"]
)
def test_untrusted_client_cannot_complete_the_handshake(
    lanes: Lanes, ids: Identities, make_context: Callable[[Identities], ssl.SSLContext]
) -> None:
    """The server requires a trusted client certificate: a stranger never gets a reply, nothing is delivered."""
    server, inbox = lanes.start(ids.server)
    good = body()
    # where it fails depends on the TLS version: in the handshake (1.2), or at the first read (1.3, whose client
    # finishes its side before the server has checked its certificate)
    with pytest.raises((ssl.SSLError, ConnectionError)), RawLane(server.bulk_port, context=make_context(ids)) as raw:
        raw.push(good)
    assert_still_serving(server, inbox, ids.client)


def test_untrusted_client_is_refused_on_its_open_connection() -> None:
    """Trust is checked at every request, not only at the handshake: a caller dropped from the server's trust
    is refused UNAUTHENTICATED on the connection it opened while trusted."""
    mine = _identities()
    with PeerServer(replace(BASE, tls=mine.server)) as server:
        inbox = Inbox()
        server.register_push(pb.ACTIVATION, inbox)
        with RawLane(server.bulk_port, mine.client) as raw:
            first = body(step=1)
            assert raw.push(first) == (OK, len(first), "")
            mine.server.trust.set_group("bootstrap", [])
            code, received, message = raw.push(body(step=2))
            assert (code, received) == (grpc.StatusCode.UNAUTHENTICATED, 0) and "not trusted" in message
        assert inbox.steps == [1]


def test_handler_sees_the_authenticated_sender(lanes: Lanes, ids: Identities) -> None:
    """envelope.sender is the certificate's peer id, whatever the envelope claims."""
    server, inbox = lanes.start(ids.server)
    for who in (ids.client, ids.other):
        claimed = body(sender="someone-else")
        with RawLane(server.bulk_port, who) as raw:
            assert raw.push(claimed)[0] == OK
    assert [env.sender for env in inbox.got] == [ids.client.peer_id, ids.other.peer_id]


# --- requests that do not arrive whole ------------------------------------------------------------------------
def test_truncated_body_is_not_delivered(lanes: Lanes, ids: Identities) -> None:
    """A client that closes mid-body: the handler is not called, its stream slot is given back (one slot only:
    the good push after it would be refused busy otherwise)."""
    server, inbox = lanes.start(ids.server, max_concurrent_streams=1, thread_pool_size=3)
    data = body(tensor=torch.randn(64 << 10))
    with RawLane(server.bulk_port, ids.client) as raw:
        raw.head(len(data))
        raw.send(data[: len(data) // 2])
    wait_until(lambda: open_connections(server) == 0, 5.0, "every connection closed", 0.01)
    assert_still_serving(server, inbox, ids.client)


def test_stalled_body_is_cut_at_its_deadline(lanes: Lanes, ids: Identities) -> None:
    """A client that stops sending is cut off when the request's own deadline passes (not sooner, not later):
    the connection is closed without an answer, nothing is delivered."""
    server, inbox = lanes.start(ids.server, max_concurrent_streams=1, thread_pool_size=3)
    data = body(tensor=torch.randn(64 << 10))
    with RawLane(server.bulk_port, ids.client) as raw:
        start = time.monotonic()
        raw.head(len(data), deadline_ms=400)
        raw.send(data[: len(data) // 2])
        assert not raw.closed_by_server(within_s=0.2)
        assert raw.closed_by_server(within_s=3.0)
        assert 0.35 < time.monotonic() - start < 3.0
    wait_until(lambda: open_connections(server) == 0, 5.0, "every connection closed", 0.01)
    assert_still_serving(server, inbox, ids.client)


def test_connections_over_the_cap_are_closed_at_once(lanes: Lanes, ids: Identities) -> None:
    """max_connections idle connections (not even handshaken) fill the lane; one more is closed at once; when one
    goes, a new one is served."""
    server, inbox = lanes.start(ids.server, max_concurrent_streams=2, thread_pool_size=4)
    assert server._lane is not None and server._lane.max_connections == 4
    before = TRAFFIC.snapshot().refused.get("UNAVAILABLE", 0)
    # from four source addresses: one address may hold only half of the lane's connections
    idle = [socket.create_connection(("127.0.0.1", server.bulk_port), timeout=5, source_address=(f"127.0.0.{i}", 0))
            for i in range(1, 5)]
    try:
        wait_until(lambda: open_connections(server) == 4, 5.0, "4 open connections", 0.01)
        with socket.create_connection(("127.0.0.1", server.bulk_port), timeout=5,
                                      source_address=("127.0.0.5", 0)) as extra:
            extra.settimeout(2.0)
            with contextlib.suppress(ConnectionResetError):
                assert extra.recv(1) == b""
        assert TRAFFIC.snapshot().refused.get("UNAVAILABLE", 0) > before
        assert not select.select(idle, [], [], 0)[0]  # the ones let in are still open, waiting
        idle.pop().close()
        wait_until(lambda: open_connections(server) == 3, 5.0, "3 open connections", 0.01)
        assert_still_serving(server, inbox, ids.client)
    finally:
        for sock in idle:
            sock.close()


# --- PeerClient: fallback to gRPC, and when the lane is never asked -----------------------------------------------
def test_unreachable_lane_falls_back_to_grpc(lanes: Lanes, ids: Identities) -> None:
    """A lane that stopped answering (refused connections) costs no push: it goes through gRPC, and the client
    stops trying the lane (only this client: a refused connection is not a firewall)."""
    server, inbox = lanes.start(ids.server)
    assert server._lane is not None
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client)) as cli:
        cli.push(pb.Envelope.FromString(body(step=1)), timeout_s=10)
        lane = cli._lane
        assert isinstance(lane, BulkLane) and lane._idle
        server._lane.stop()  # the lane is gone, the port is still advertised
        cli.push(pb.Envelope.FromString(body(step=2)), timeout_s=10)
        assert cli._lane is False and not lane._idle
        assert bulk_client.usable(lane.address)
    assert inbox.steps == [1, 2]
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client)) as fresh:  # asks, fails to connect, falls back
        fresh.push(pb.Envelope.FromString(body(step=3)), timeout_s=10)
        assert fresh._lane is False
    assert inbox.steps == [1, 2, 3]


def test_a_kept_connection_the_peer_closed_unseen_costs_no_push(
    lanes: Lanes, ids: Identities, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer closes an idle lane connection and its close has not reached the client when the next push takes
    that connection: the push goes again on a fresh one (here refused: the lane is gone) and so through gRPC."""
    server, inbox = lanes.start(ids.server)
    assert server._lane is not None
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client)) as cli:
        cli.push(pb.Envelope.FromString(body(step=1)), timeout_s=10)
        lane = cli._lane
        assert isinstance(lane, BulkLane) and len(lane._idle) == 1
        server._lane.stop()
        monkeypatch.setattr(bulk_client, "_readable", lambda conn: False)  # the close not seen yet
        cli.push(pb.Envelope.FromString(body(step=2)), timeout_s=10)
        assert cli._lane is False
    assert inbox.steps == [1, 2]


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port whose connection attempts time out (a listener whose accept queue is full drops SYNs): what a
    firewall that lets only the gRPC port through looks like."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):
            try:
                fillers.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel does not drop SYNs to a full accept queue")
        yield port
    finally:
        for sock in fillers:
            sock.close()
        listener.close()


def test_lane_that_times_out_is_skipped_by_every_client(
    lanes: Lanes, ids: Identities, blackhole: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane nobody answers at is marked unusable process-wide: the push falls back to gRPC, and a new client
    of the same peer does not wait for the lane again."""
    monkeypatch.setattr(bulk_client, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(bulk_client, "_unusable", {})
    server, inbox = lanes.start(ids.server)
    assert server._lane is not None
    monkeypatch.setattr(server._lane, "port", blackhole)  # what the BulkLane call now advertises
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client)) as first:
        first.push(pb.Envelope.FromString(body(step=1)), timeout_s=10)
        assert first._lane is False
    assert not bulk_client.usable(("127.0.0.1", blackhole))
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client)) as second:
        assert second._bulk_lane(5.0) is None and second._lane is False  # asked, and skipped without connecting
        second.push(pb.Envelope.FromString(body(step=2)), timeout_s=10)
    assert inbox.steps == [1, 2]


def test_client_without_a_lane_pushes_through_grpc(lanes: Lanes, ids: Identities) -> None:
    """bulk_port=None on the client: it never asks, even a peer that has a lane gets every push over gRPC."""
    server, inbox = lanes.start(ids.server)
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client, bulk_port=None)) as cli:
        assert cli._lane is False
        cli.push(pb.Envelope.FromString(body(step=1, tensor=torch.randn(1 << 20))), timeout_s=10)
        assert cli._lane is False
    assert inbox.steps == [1] and open_connections(server) == 0


def test_relayed_and_routed_endpoints_never_ask_for_the_lane(lanes: Lanes, ids: Identities) -> None:
    """The lane is dialled at the endpoint's host: a relayed peer cannot be dialled there, and a routed endpoint
    names a server mounted on another's port (whose lane is not its own)."""
    server, inbox = lanes.start(ids.server)
    relayed = f"{'ab' * 8}@127.0.0.1:{server.port}"
    with PeerClient(relayed, replace(BASE, tls=ids.client)) as cli:
        assert cli._lane is False and cli._bulk_lane(5.0) is None
    mounted = PeerServer(replace(BASE, tls=ids.server))
    routed_inbox = Inbox()
    mounted.register_push(pb.ACTIVATION, routed_inbox)
    server.mount("coordinator", mounted)
    with PeerClient(f"{server.endpoint}/coordinator", replace(BASE, tls=ids.client)) as cli:
        assert cli._lane is False
        cli.push(pb.Envelope.FromString(body(step=4, tensor=torch.randn(1 << 20))), timeout_s=10)
        assert cli._lane is False
    assert routed_inbox.steps == [4] and inbox.steps == [] and open_connections(server) == 0


# --- PeerClient: the same errors on both paths --------------------------------------------------------------------
RAISED: dict[int, Exception] = {
    20: BadMessage("h", "bad"),
    21: Rejected("unknown step"),
    22: Forbidden("no role"),
    23: Unauthenticated("who are you"),
    24: Unavailable("not ready"),
}
EXPECTED = {
    "bad message": (Refused, "INVALID_ARGUMENT"),
    "rejected": (Refused, "FAILED_PRECONDITION"),
    "forbidden": (Refused, "PERMISSION_DENIED"),
    "unauthenticated": (Refused, "UNAUTHENTICATED"),
    "unavailable": (PeerUnreachable, "UNAVAILABLE"),
    "crash": (Refused, "INTERNAL"),
    "no handler": (Refused, "FAILED_PRECONDITION"),
    "over the admission limit": (Refused, "INVALID_ARGUMENT"),
    "deadline": (PeerUnreachable, "DEADLINE_EXCEEDED"),
}


@pytest.mark.parametrize("path", ["grpc", "lane"])
def test_peer_client_maps_refusals_alike_on_both_paths(lanes: Lanes, ids: Identities, path: str) -> None:
    """Refused (with the code's name) when the peer said no, PeerUnreachable when it could not take the call: the
    same on the lane as on gRPC."""
    lane_config = {"bulk_port": None} if path == "grpc" else {}
    server, _ = lanes.start(ids.server, **lane_config)
    release = threading.Event()

    def handler(env: WireEnvelope) -> None:
        step = env.key.step
        if step in RAISED:
            raise RAISED[step]
        if step == 13:
            raise KeyError("boom")
        if step == 30:
            release.wait(5)

    server.register_push(pb.ACTIVATION, handler)
    server.set_push_admission(lambda kind, caller: 1 << 20)
    sends = {
        "bad message": (body(20), 10.0),
        "rejected": (body(21), 10.0),
        "forbidden": (body(22), 10.0),
        "unauthenticated": (body(23), 10.0),
        "unavailable": (body(24), 10.0),
        "crash": (body(13), 10.0),
        "no handler": (body(kind=pb.GRAD_SHARD), 10.0),
        "over the admission limit": (body(tensor=torch.randn(1 << 19)), 10.0),
        "deadline": (body(30), 0.5),
    }
    seen: dict[str, tuple[type, str]] = {}
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client, **lane_config)) as cli:
        try:
            for case, (data, timeout_s) in sends.items():
                with pytest.raises((Refused, PeerUnreachable)) as info:
                    cli.push(pb.Envelope.FromString(data), timeout_s=timeout_s)
                error = info.value
                code = error.code if isinstance(error, Refused) else error.detail.partition(":")[0]
                seen[case] = (type(error), code)
        finally:
            release.set()
        cli.push(pb.Envelope.FromString(body(1)), timeout_s=10)
        if path == "lane":
            assert isinstance(cli._lane, BulkLane) and cli._lane._idle
        else:
            assert cli._lane is False
    assert seen == EXPECTED


def test_server_without_a_lane_gets_pushes_through_grpc(lanes: Lanes, ids: Identities) -> None:
    """A peer with bulk_port=None answers the BulkLane call with port 0: the client stays on gRPC for good."""
    server, inbox = lanes.start(ids.server, bulk_port=None)
    with PeerClient(server.endpoint, replace(BASE, tls=ids.client)) as cli:
        cli.push(pb.Envelope.FromString(body(step=1)), timeout_s=10)
        assert cli._lane is False
        cli.push(pb.Envelope.FromString(body(step=2)), timeout_s=10)
    assert inbox.steps == [1, 2]


def test_a_plain_grpc_target_takes_large_pushes_too(lanes: Lanes, ids: Identities) -> None:
    """An endpoint string that is no HOST:PORT but a target gRPC dials (peer.net.endpoint.dial_plan) works for
    every push, small or large (the lane is simply not used)."""
    server, inbox = lanes.start(ids.server, bulk_min_bytes=1 << 10)
    with PeerClient(f"dns:///127.0.0.1:{server.port}", replace(server.config, tls=ids.client)) as cli:
        cli.push(pb.Envelope.FromString(body(step=1)), timeout_s=10)  # small: gRPC
        cli.push(pb.Envelope.FromString(body(step=2, tensor=torch.randn(1 << 12))), timeout_s=10)
    assert inbox.steps == [1, 2]


@pytest.mark.parametrize("path", ["grpc", "lane"])
def test_stop_lets_a_running_push_finish_within_its_grace(ids: Identities, path: str) -> None:
    """PeerServer.stop gives running calls ``grace`` seconds: a push whose handler finishes within it is answered
    OK, on either path."""
    changes = {"bulk_port": None} if path == "grpc" else {}
    entered, done = threading.Event(), threading.Event()

    def slow(env: WireEnvelope) -> None:
        entered.set()
        time.sleep(0.3)
        done.set()

    server = PeerServer(replace(BASE, tls=ids.server, **changes))
    server.register_push(pb.ACTIVATION, slow)
    server.start()
    try:
        with PeerClient(server.endpoint, replace(BASE, tls=ids.client, **changes)) as cli:
            pending = cli.push_async(pb.Envelope.FromString(body(step=1)), timeout_s=10)
            assert entered.wait(5)
            server.stop(grace=2.0)
            assert done.is_set()  # the running call was waited for
            pending.result(timeout=10)
    finally:
        server.stop(grace=0)
