"""The relay of peer.net.relay on loopback: a peer nobody dials is reached through a relay with the same gRPC
calls (push, fetch, ping) and the same refusals; registration needs the peer's key; strangers are bounded."""

from __future__ import annotations

import base64
import socket
import time

import pytest

from tasklet.peer.identity.keys import Identity
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.endpoint import (
    PATH_DIRECT,
    PATH_RELAYED,
    PATH_REVERSED,
    EndpointError,
    parse_endpoint,
    set_local_relay,
    with_route,
)
from tasklet.peer.net.relay import MAGIC, RelayAgent, RelayLimits, RelayServer, check_reachable
from tasklet.peer.net.server import PeerServer
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage, PeerUnreachable, Refused


@pytest.fixture(name="relay")
def relay_fixture():
    relay = RelayServer("127.0.0.1", 0, RelayLimits(handshake_timeout_s=2.0, dial_back_timeout_s=2.0))
    relay.start()
    yield relay
    relay.close()


@pytest.fixture(name="nated")
def nated_fixture():
    """A peer's gRPC server that only a relay agent reaches (loopback stands in for the NAT'd host)."""
    received: list[pb.Envelope] = []
    server = PeerServer(TransportConfig())

    def on_push(env: pb.Envelope) -> None:
        if env.meta.get("bad"):
            raise BadMessage("envelope.meta", "refused on purpose")
        received.append(env)

    server.register_push(pb.OTHER, on_push)
    server.register_fetch(pb.STAGE_STATE, lambda req: pb.Envelope(kind=pb.STAGE_STATE, meta={"n": "7"}))
    server.start()
    yield server, received
    server.stop()


def _register(relay: RelayServer, server: PeerServer, identity: Identity) -> RelayAgent:
    agent = RelayAgent(identity, [relay.local_address], f"127.0.0.1:{server.port}")
    agent.start()
    assert agent.wait_registered(10), "the agent did not register"
    return agent


def test_endpoint_grammar() -> None:
    assert parse_endpoint("10.0.0.1:31400").relayed is False
    ep = parse_endpoint("0123456789abcdef0123@10.0.0.2:31402/coordinator")
    assert (ep.peer, ep.address, ep.route) == ("0123456789abcdef0123", "10.0.0.2:31402", "coordinator")
    assert with_route("10.0.0.1:31400", "coordinator") == "10.0.0.1:31400/coordinator"
    for bad in ("10.0.0.1", "x@10.0.0.1:5", "10.0.0.1:0", "10.0.0.1:5/no-route!", ""):
        with pytest.raises(EndpointError):
            parse_endpoint(bad)


def test_relayed_calls_behave_like_direct_ones(relay: RelayServer, nated) -> None:
    server, received = nated
    identity = Identity.generate()
    agent = _register(relay, server, identity)
    try:
        endpoint = f"{identity.peer_id}@{relay.local_address}"
        with PeerClient(endpoint) as client:
            assert client.path == PATH_RELAYED
            assert client.ping(timeout_s=5) > 0
            client.push(pb.Envelope(kind=pb.OTHER, meta={"x": "y" * 3_000_000}), timeout_s=20)
            assert len(received) == 1 and len(received[0].meta["x"]) == 3_000_000
            with pytest.raises(Refused, match="refused on purpose"):  # the server's validation is untouched
                client.push(pb.Envelope(kind=pb.OTHER, meta={"bad": "1"}), timeout_s=5)
            assert client.fetch(pb.STAGE_STATE, timeout_s=5).meta["n"] == "7"
            assert client.probe(1 << 20, timeout_s=10) > 0
        # A server mounted on the NAT'd peer's port (a leader's coordinator) through the same relay.
        mounted = PeerServer(TransportConfig())
        mounted.register_fetch(pb.COMMIT, lambda req: pb.Envelope(kind=pb.COMMIT, meta={"from": "coordinator"}))
        server.mount("coordinator", mounted)
        with PeerClient(f"{endpoint}/coordinator") as client:
            assert client.fetch(pb.COMMIT, timeout_s=5).meta["from"] == "coordinator"
        with PeerClient(endpoint) as client, pytest.raises(Refused):
            client.fetch(pb.COMMIT, timeout_s=5)  # the worker's own service serves no COMMIT fetches
        assert agent.stats["dials"] >= 1
    finally:
        agent.close()


def test_a_relay_in_this_process_makes_the_path_reversed(relay: RelayServer, nated) -> None:
    server, _ = nated
    identity = Identity.generate()
    agent = _register(relay, server, identity)
    set_local_relay(relay.lookup)
    try:
        with PeerClient(f"{identity.peer_id}@203.0.113.9:31402") as client:  # a relay we cannot reach
            assert client.path == PATH_REVERSED
            client.ping(timeout_s=5)
        with PeerClient(f"127.0.0.1:{server.port}") as client:
            assert client.path == PATH_DIRECT
    finally:
        set_local_relay(None)
        agent.close()


def test_unknown_peer_is_unreachable_quickly(relay: RelayServer) -> None:
    with PeerClient(f"{'ab' * 10}@{relay.local_address}") as client, pytest.raises(PeerUnreachable):
        client.ping(timeout_s=3)


def test_registration_needs_the_peer_ids_key(relay: RelayServer, nated) -> None:
    server, _ = nated
    victim, thief = Identity.generate(), Identity.generate()
    agent = _register(relay, server, victim)
    try:
        def attempt(peer_id: str, key: bytes, sign_with: Identity) -> str:
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
                f = s.makefile("rwb")
                f.write(f"{MAGIC} REGISTER {peer_id}\n".encode())
                f.flush()
                nonce = f.readline().decode().split()[1]
                sig = sign_with.private_key.sign(b"tasklet-relay-register:" + nonce.encode())
                f.write(b"KEY " + base64.b64encode(key) + b"\nSIG " + base64.b64encode(sig) + b"\nPROOF -\n")
                f.flush()
                return f.readline().decode().strip()

        assert attempt(victim.peer_id, thief.public_key, thief).startswith("DENIED")  # key of another id
        assert attempt(victim.peer_id, victim.public_key, thief).startswith("DENIED")  # signature by another key
        assert relay.registered(victim.peer_id)
        assert attempt(thief.peer_id, thief.public_key, thief) == "OK"  # its own id is fine
    finally:
        agent.close()


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(2)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def test_strangers_are_bounded(nated) -> None:
    limits = RelayLimits(handshake_timeout_s=0.5, max_pending_handshakes=2, max_line_bytes=64)
    relay = RelayServer("127.0.0.1", 0, limits)
    relay.start()
    try:
        idle = [socket.create_connection(("127.0.0.1", relay.port)) for _ in range(2)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", relay.port))
        assert _closed_by_peer(extra), "a third silent connection was held"
        time.sleep(0.8)  # the silent ones are dropped after the handshake timeout
        assert all(_closed_by_peer(s) for s in idle)
        with socket.create_connection(("127.0.0.1", relay.port), timeout=2) as s:
            s.sendall(b"X" * 200 + b"\n")  # over the line limit
            assert _closed_by_peer(s)
        for s in [*idle, extra]:
            s.close()
    finally:
        relay.close()


def test_check_tells_whether_a_port_is_open(relay: RelayServer, nated) -> None:
    server, _ = nated
    assert check_reachable(relay.local_address, server.port) == (True, "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert check_reachable(relay.local_address, free) == (False, "127.0.0.1")


def test_a_peer_follows_its_relays_when_one_goes_away(nated) -> None:
    from tasklet.peer.node.reachability import Reach

    server, _ = nated
    first, second = RelayServer("127.0.0.1", 0), RelayServer("127.0.0.1", 0)
    first.start()
    second.start()
    identity = Identity.generate()
    agent = RelayAgent(identity, [first.local_address, second.local_address], f"127.0.0.1:{server.port}")
    agent.start()
    try:
        deadline = time.monotonic() + 10
        while len(agent.registered()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        reach = Reach(f"{identity.peer_id}@{first.local_address}", reachable=False, agent=agent)
        assert reach.refresh() is False  # still held by the relay it publishes
        first.close()
        deadline = time.monotonic() + 10
        while first.local_address in agent.registered() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reach.refresh() is True
        assert reach.endpoint == f"{identity.peer_id}@{second.local_address}"
        with PeerClient(reach.endpoint) as client:
            client.ping(timeout_s=5)
    finally:
        agent.close()
        second.close()


def test_adverts_and_link_reports_carry_reachability() -> None:
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.swarm.adverts import Advert, LinkReport

    device = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
    pid = "0123456789abcdef0123"
    nated = Advert(pid, f"{pid}@198.51.100.7:31402", device, 1.0, reachable=False)
    assert Advert.from_record(nated.to_record()) == nated
    public = Advert(pid, "198.51.100.8:31400", device, 1.0, relay="198.51.100.8:31402")
    assert Advert.from_record(public.to_record()).relay == "198.51.100.8:31402"
    for bad in ({"reachable": True, "endpoint": f"{pid}@198.51.100.7:31402"},  # relayed yet "reachable"
                {"reachable": False},  # unreachable yet a direct endpoint
                {"relay": "not an address"},
                {"endpoint": "bad id!@198.51.100.7:31402", "reachable": False}):
        with pytest.raises(ValueError):
            Advert.from_record({**public.to_record(), **bad})
    report = LinkReport(pid, "fedcba9876543210fedc", 0.01, 1e8, True, 1.0, "relayed")
    assert LinkReport.from_record(report.to_record()).path == "relayed"
    with pytest.raises(ValueError, match="link.path"):
        LinkReport.from_record({**report.to_record(), "path": "teleported"})


def test_undialable_setups_are_refused() -> None:
    from tasklet.peer.node.reachability import ReachabilityError, refuse_undialable

    remote = ["/ip4/198.51.100.7/tcp/31401/p2p/12D3KooWH4ecARXxDuWHreqMq8ALtetbyNfvoQLayNHeW39sAAea"]
    local = ["/ip4/127.0.0.1/tcp/31401/p2p/12D3KooWH4ecARXxDuWHreqMq8ALtetbyNfvoQLayNHeW39sAAea"]
    refuse_undialable("127.0.0.1", None, local, False, None)  # a swarm on one machine
    refuse_undialable("0.0.0.0", None, remote, False, None)  # a joiner that lets the relay find its address
    refuse_undialable("0.0.0.0", "198.51.100.9:31400", remote, True, 31402)
    for args in (("127.0.0.1", None, remote, False, None), ("0.0.0.0", "0.0.0.0:31400", remote, False, None),
                 ("0.0.0.0", None, [], True, None), ("0.0.0.0", None, remote, False, 31402)):
        with pytest.raises(ReachabilityError):
            refuse_undialable(*args)
