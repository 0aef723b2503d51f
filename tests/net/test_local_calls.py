"""A peer's calls to itself stay in the process (peer.net.local) and are checked and refused as gRPC calls are.

Each test publishes a real, started PeerServer under an endpoint nothing listens on (``127.0.0.1:9``), so a call
that reaches the handler there can only have come the local way; a client that may not take it (another TLS
identity, an emulated link) fails to connect instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tasklet.peer.net import local
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.shaping import LinkShaper
from tasklet.peer.net.tls import TlsContext
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Forbidden, PeerUnreachable, Refused, Rejected

NOWHERE = "127.0.0.1:9"  # the discard port: nothing of ours listens there
TLS = TlsContext.generate()
CONFIG = TransportConfig(host="127.0.0.1", port=0, tls=TLS, max_concurrent_streams=4, max_streams_per_peer=2,
                         thread_pool_size=8, default_timeout_s=2.0)


class Handlers:
    def __init__(self) -> None:
        self.pushed: list[tuple[str, int]] = []
        self.release = threading.Event()

    def control(self, env: pb.Envelope) -> None:
        if env.key.step < 0:
            raise Rejected("key.step: negative")
        if env.key.step == 99:  # hold the stream until released
            self.release.wait(10)
        self.pushed.append((env.sender, env.key.step))

    def lease(self, req: pb.FetchRequest) -> pb.Envelope:
        if req.key.step == 99:
            self.release.wait(10)
        return pb.Envelope(kind=pb.LEASE, key=req.key, meta={"asker": req.sender})


@pytest.fixture
def served() -> Iterator[tuple[PeerServer, Handlers]]:
    server, handlers = PeerServer(CONFIG), Handlers()
    server.register_push(pb.CONTROL, handlers.control)
    server.register_fetch(pb.LEASE, handlers.lease)
    mounted = PeerServer(CONFIG)
    mounted.register_push(pb.CONTROL, lambda env: handlers.pushed.append(("mounted", env.key.step)))
    server.mount("coordinator", mounted)
    server.start()
    local.publish(NOWHERE, server)
    try:
        yield server, handlers
    finally:
        handlers.release.set()
        local.withdraw(server)
        server.stop(0.1)


def control(step: int) -> pb.Envelope:
    return pb.Envelope(kind=pb.CONTROL, key=pb.Key(run_id="r", epoch=1, step=step))


def test_a_push_and_a_fetch_to_a_published_endpoint_run_in_process_as_this_peer(
        served: tuple[PeerServer, Handlers]) -> None:
    server, handlers = served
    with PeerClient(NOWHERE, CONFIG, sender="claimed-name") as client:
        client.push(control(3), timeout_s=2)
        reply = client.fetch(pb.LEASE, pb.Key(run_id="r", step=4), timeout_s=2)
        with PeerClient(f"{NOWHERE}/coordinator", CONFIG) as routed:
            routed.push(control(5), timeout_s=2)
    assert handlers.pushed == [(TLS.peer_id, 3), ("mounted", 5)]  # the sender is the authenticated self
    assert reply.meta["asker"] == TLS.peer_id and reply.key.step == 4
    assert server.stats["pushes"] == 1 and server.stats["fetches"] == 1


def test_refusals_come_back_as_over_grpc(served: tuple[PeerServer, Handlers]) -> None:
    server, handlers = served

    def admit(kind: int, caller: str) -> int:
        if kind == pb.CONTROL:
            raise Forbidden("envelope.kind: no role for control")
        return 1 << 20

    with PeerClient(NOWHERE, CONFIG) as client:
        with pytest.raises(Refused) as refused:
            client.push(control(-1), timeout_s=2)
        assert refused.value.code == "FAILED_PRECONDITION" and "negative" in str(refused.value)
        with pytest.raises(Refused) as unknown:
            client.fetch(pb.CHECKPOINT, timeout_s=2)
        assert unknown.value.code == "FAILED_PRECONDITION"
        server.set_push_admission(admit)
        with pytest.raises(Refused) as forbidden:
            client.push(control(1), timeout_s=2)
        assert forbidden.value.code == "PERMISSION_DENIED"
    assert handlers.pushed == []


def test_a_callers_stream_quota_and_deadline_hold_in_process(served: tuple[PeerServer, Handlers]) -> None:
    _, handlers = served
    with PeerClient(NOWHERE, CONFIG) as client:
        held = [client.push_async(control(99), timeout_s=5) for _ in range(2)]  # the quota: 2 streams a caller
        time.sleep(0.3)
        with pytest.raises(Refused) as refused:
            client.push(control(1), timeout_s=2)
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        handlers.release.set()
        for f in held:
            f.result(timeout=5)
        handlers.release.clear()
        start = time.monotonic()
        with pytest.raises(PeerUnreachable):
            client.fetch(pb.LEASE, pb.Key(step=99), timeout_s=0.5)
        assert time.monotonic() - start < 2.0
        handlers.release.set()


def test_another_identity_an_emulated_link_or_a_withdrawn_server_go_through_the_network(
        served: tuple[PeerServer, Handlers]) -> None:
    server, handlers = served
    other = TransportConfig(host="127.0.0.1", port=0, tls=TlsContext.generate().trust_only([TLS.certificate]))
    for client in (PeerClient(NOWHERE, other), PeerClient(NOWHERE, CONFIG, shaper=LinkShaper(None))):
        with client, pytest.raises(PeerUnreachable):
            client.push(control(1), timeout_s=1)
    local.withdraw(server)
    with PeerClient(NOWHERE, CONFIG) as client, pytest.raises(PeerUnreachable):
        client.push(control(2), timeout_s=1)
    assert handlers.pushed == []


def test_a_stopped_server_is_unreachable_not_a_hang() -> None:
    server = PeerServer(CONFIG)
    server.register_push(pb.CONTROL, lambda env: None)
    server.start()
    local.publish(NOWHERE, server)
    server.stop(0.1)
    try:
        with PeerClient(NOWHERE, CONFIG) as client, pytest.raises(PeerUnreachable):
            client.push(control(1), timeout_s=1)
    finally:
        local.withdraw(server)


def test_a_local_push_whose_handler_hangs_fails_at_its_deadline_for_a_callback_only_caller(
        served: tuple[PeerServer, Handlers]) -> None:
    _, handlers = served
    heard: list[BaseException | None] = []
    told = threading.Event()
    with PeerClient(NOWHERE, CONFIG) as client:
        start = time.monotonic()
        future = client.push_async(control(99), timeout_s=0.4)  # the handler holds it until released
        future.add_done_callback(lambda f: (heard.append(f.exception()), told.set()))
        assert told.wait(3), "no outcome after the deadline"
        assert 0.35 < time.monotonic() - start < 2.0
        assert isinstance(heard[0], PeerUnreachable) and "DEADLINE_EXCEEDED" in str(heard[0])
        handlers.release.set()  # the handler ends later: the outcome given stays
        time.sleep(0.2)
        assert isinstance(future.exception(), PeerUnreachable)
        client.push(control(4), timeout_s=2)  # its stream slot and in-flight slot came back
    assert (TLS.peer_id, 4) in handlers.pushed
