"""Stream slots are taken only after admission: members with many identities and no role, each opening 16
streams that send nothing, hold no stream slot and do not stop an honest call (unit: in-process gRPC).

The bounds: streams waiting for their first chunk are at most a caller's quota and the room's total
(peer.net.waiting); when the room is full, a caller waiting with fewer streams displaces the one waiting
with the most.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.net.waiting import RoomFullError, WaitingRoom
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import encode_chunk
from tasklet.protocol.errors import Forbidden
from tests.support.waits import held_within

ATTACKERS = 5  # member identities without a role on this server
IDLE_PER_IDENTITY = 16
PUSH = f"/{pb.DESCRIPTOR.services_by_name['Peer'].full_name}/Push"


class _Call:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_the_room_bounds_each_caller_and_the_total_and_a_small_waiter_displaces_the_largest() -> None:
    room = WaitingRoom(total=4, per_caller=3)
    calls = [_Call() for _ in range(4)]
    tokens = [room.enter("a", calls[i]) for i in range(3)]
    with pytest.raises(RoomFullError) as refused:
        room.enter("a", _Call())
    assert refused.value.per_caller and "quota is 3" in str(refused.value)
    b = room.enter("b", calls[3])
    assert room.waiting == 4
    honest = _Call()
    room.enter("honest", honest)  # full: "a" waits with the most (3 > 0): its oldest stream is cancelled
    assert calls[0].cancelled and not any(c.cancelled for c in calls[1:]) and room.evicted == 1
    assert room.waiting == 4 and room.waiting_of("a") == 2 and room.waiting_of("honest") == 1
    room.leave(tokens[0])  # the evicted stream's own leave is a no-op: its place went to the newcomer
    assert room.waiting == 4
    room.enter("c", _Call())  # "a" still waits with the most (2 > 0)
    assert room.waiting_of("a") == 1 and room.waiting == 4
    with pytest.raises(RoomFullError) as busy:  # everyone waits with 1: nobody has more than "b" would
        room.enter("b", _Call())
    assert not busy.value.per_caller and "busy" in str(busy.value)
    room.leave(b)
    room.leave(b)  # twice is harmless
    assert room.waiting == 3 and room.waiting_of("b") == 0


@pytest.fixture
def swarm() -> Iterator[tuple[PeerServer, TlsContext, list[TlsContext], list[pb.Envelope]]]:
    server_tls, honest = TlsContext.generate(), TlsContext.generate()
    attackers = [TlsContext.generate() for _ in range(ATTACKERS)]
    server_tls.trust_only([honest.certificate, *[a.certificate for a in attackers]])
    for peer in (honest, *attackers):
        peer.trust_only([server_tls.certificate])
    config = TransportConfig(tls=server_tls, bulk_port=None, max_concurrent_streams=8, thread_pool_size=12,
                             max_streams_per_peer=8, stream_idle_s=60.0)
    server = PeerServer(config)
    got: list[pb.Envelope] = []
    server.register_push(pb.ACTIVATION, got.append)

    def admit(kind: int, caller: str) -> int:  # only the honest peer has a role here
        if caller != honest.peer_id:
            raise Forbidden(f"{caller} has no role for this kind")
        return 1 << 20

    server.set_push_admission(admit)
    server.start()
    try:
        yield server, honest, attackers, got
    finally:
        server.stop(grace=0.5)


def _idle_streams(endpoint: str, attacker: TlsContext, release: threading.Event, n: int) -> tuple:
    channel = attacker.channel(endpoint, [])
    push = channel.stream_unary(PUSH, request_serializer=None, response_deserializer=pb.Ack.FromString)

    def nothing() -> Iterator[bytes]:
        release.wait(60)
        return
        yield b""  # a generator that sends no chunk

    return channel, [push.future(nothing(), timeout=90) for _ in range(n)]


def _codes(futures: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in futures:
        try:
            f.result(timeout=30)
            name = "OK"
        except grpc.RpcError as exc:
            name = exc.code().name
        out[name] = out.get(name, 0) + 1
    return out


def test_idle_streams_of_many_identities_hold_no_slot_and_an_honest_push_gets_through(swarm) -> None:
    server, honest, attackers, got = swarm
    release = threading.Event()
    floods = [_idle_streams(server.endpoint, a, release, IDLE_PER_IDENTITY) for a in attackers]
    try:
        time.sleep(2.0)  # every idle stream reached the server and waits (or was refused, or displaced)
        assert server._per_peer == {}, "an idle stream holds a stream slot"
        assert server._waiting_room.waiting <= server.config.max_concurrent_streams
        env = pb.Envelope(kind=pb.ACTIVATION)
        env.key.step = 7
        with PeerClient(server.endpoint, TransportConfig(tls=honest, bulk_port=None)) as client:
            started = time.monotonic()
            for _ in range(3):
                client.push(env, timeout_s=10)
            took = time.monotonic() - started
            client.probe(4096, timeout_s=10)  # a Probe waits in the same room and gets through the same way
        print(f"3 honest pushes among {ATTACKERS} x {IDLE_PER_IDENTITY} idle streams: {took:.3f} s")
        assert len(got) == 3 and took < 5.0, took
        assert server._waiting_room.evicted >= 1  # the honest streams displaced idle ones
        # a member without a role that does send a first chunk is refused on it, and holds no slot either
        channel = attackers[0].channel(server.endpoint, [])
        push = channel.stream_unary(PUSH, request_serializer=None, response_deserializer=pb.Ack.FromString)
        payload = env.SerializeToString()
        with pytest.raises(grpc.RpcError) as refused:
            push(iter([encode_chunk(len(payload), 0, payload)]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        channel.close()
        assert server._per_peer == {}
    finally:
        release.set()
        outcomes = {}
        for channel, futures in floods:
            for name, n in _codes(futures).items():
                outcomes[name] = outcomes.get(name, 0) + n
            channel.close()
    assert "OK" not in outcomes and sum(outcomes.values()) == ATTACKERS * IDLE_PER_IDENTITY
    assert outcomes.get("RESOURCE_EXHAUSTED", 0) + outcomes.get("UNAVAILABLE", 0) > 0, outcomes
    held_within(lambda: not server._waiting_room.waiting, 10, 0.05)
    assert server._waiting_room.waiting == 0 and server._per_peer == {}

