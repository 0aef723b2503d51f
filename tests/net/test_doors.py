"""The doors strangers knock on, in-process: the relay's membership proofs, request deadline, slots per source
and CONNECT rate; connection caps of the HTTP, bulk-lane and gRPC ports;
the join secret from a file or the environment."""

from __future__ import annotations

import base64
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tasklet.peer.config import SECRET_ENV, ConfigError, resolve_secret
from tasklet.peer.identity.keys import Identity
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.endpoint import set_relay_credentials
from tasklet.peer.net.limits import ConnectionCap, network_of, raise_nofile
from tasklet.peer.net.relay import (
    MAGIC,
    RelayAgent,
    RelayLimits,
    RelayServer,
    connect_credentials,
    registration_proof,
    relay_key,
)
from tasklet.peer.net.server import PeerServer
from tasklet.peer.observe import http as observe_http
from tasklet.protocol.errors import PeerUnreachable
from tests.support.waits import held_within

RUN = "doors-run"
KEY = relay_key("open sesame", RUN)


def _closed_within(s: socket.socket, timeout_s: float) -> bool:
    s.settimeout(timeout_s)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture(name="sealed_relay")
def sealed_relay_fixture():
    relay = RelayServer("127.0.0.1", 0, RelayLimits(handshake_timeout_s=1.0, dial_back_timeout_s=2.0,
                                                    max_handshakes_per_source=3, connects_per_s=2.0), key=KEY)
    relay.start()
    yield relay
    relay.close()


@pytest.fixture(name="server")
def server_fixture():
    server = PeerServer(TransportConfig())
    server.start()
    yield server
    server.stop()


def _register_raw(relay: RelayServer, identity: Identity, proof_key: bytes | None) -> str:
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
        f = s.makefile("rwb")
        f.write(f"{MAGIC} REGISTER {identity.peer_id}\n".encode())
        f.flush()
        nonce = f.readline().decode().split()[1]
        sig = identity.private_key.sign(b"tasklet-relay-register:" + nonce.encode())
        proof = "-" if proof_key is None else registration_proof(proof_key, identity.peer_id, nonce)
        f.write(b"KEY " + base64.b64encode(identity.public_key) + b"\nSIG " + base64.b64encode(sig) + b"\n")
        f.write(f"PROOF {proof}\n".encode())
        f.flush()
        return f.readline().decode().strip()


def test_a_sealed_relay_registers_only_members(sealed_relay: RelayServer) -> None:
    stranger = Identity.generate()
    assert _register_raw(sealed_relay, stranger, None).startswith("DENIED not a member")
    assert _register_raw(sealed_relay, stranger, relay_key("guess", RUN)).startswith("DENIED not a member")
    assert _register_raw(sealed_relay, stranger, relay_key("open sesame", "other-run")).startswith("DENIED")
    assert not sealed_relay.registered(stranger.peer_id)
    assert sealed_relay.stats["denied"] == 3
    member = Identity.generate()
    assert _register_raw(sealed_relay, member, KEY) == "OK"


def _connect(relay: RelayServer, peer_id: str, auth: str | None) -> str:
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
        head = f"CONNECT {peer_id}.tasklet:1 HTTP/1.1\r\nHost: x\r\n"
        if auth is not None:
            head += f"Proxy-Authorization: Basic {base64.b64encode(auth.encode()).decode()}\r\n"
        s.sendall((head + "\r\n").encode())
        return s.makefile("rb").readline().decode().strip()


def test_connect_only_between_members_and_rate_limited_per_target(sealed_relay: RelayServer, server) -> None:
    member = Identity.generate()
    agent = RelayAgent(member, [sealed_relay.local_address], f"127.0.0.1:{server.port}", key=KEY)
    agent.start()
    try:
        assert agent.wait_registered(10), "a member's agent did not register"
        assert _connect(sealed_relay, member.peer_id, None).startswith("HTTP/1.1 407")
        assert _connect(sealed_relay, member.peer_id, "tasklet:wrong").startswith("HTTP/1.1 407")
        # a member's client through gRPC's own proxy support: the credentials ride in the proxy URL
        set_relay_credentials(connect_credentials(KEY))
        try:
            with PeerClient(f"{member.peer_id}@{sealed_relay.local_address}") as client:
                client.ping(timeout_s=10)
        finally:
            set_relay_credentials(None)
        with PeerClient(f"{member.peer_id}@{sealed_relay.local_address}") as client, pytest.raises(PeerUnreachable):
            client.ping(timeout_s=3)  # the same call without credentials
        # 2 CONNECTs a second with bursts of 4: a flood is answered 429 and the relay keeps serving
        answers = [_connect(sealed_relay, member.peer_id, connect_credentials(KEY)) for _ in range(12)]
        assert any(a.startswith("HTTP/1.1 429") for a in answers), answers
        time.sleep(1.5)
        assert _connect(sealed_relay, member.peer_id, connect_credentials(KEY)).startswith("HTTP/1.1 200")
    finally:
        agent.close()


def test_the_request_deadline_holds_however_slowly_bytes_come(sealed_relay: RelayServer) -> None:
    """A byte every 0.3 s would reset a per-read timeout forever; the request's deadline (1 s) cuts it."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", sealed_relay.port), timeout=5) as s:
        closed = False
        for _ in range(20):
            try:
                s.sendall(b"C")
            except OSError:
                closed = True
                break
            if _closed_within(s, 0.3):
                closed = True
                break
        assert closed, "a trickling request was held past its deadline"
    assert time.monotonic() - started < 3.0


def test_request_slots_per_source_address(sealed_relay: RelayServer) -> None:
    silent = [socket.create_connection(("127.0.0.1", sealed_relay.port)) for _ in range(3)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", sealed_relay.port))
        assert _closed_within(extra, 0.5), "a 4th request connection from one address was held"
        extra.close()
        assert sealed_relay.stats["refused"] >= 1
        # another source address (127.0.0.2 is loopback too) still gets a slot
        other = socket.create_connection(("127.0.0.1", sealed_relay.port), source_address=("127.0.0.2", 0))
        assert not _closed_within(other, 0.3)
        other.close()
    finally:
        for s in silent:
            s.close()


def test_the_relay_keeps_its_request_slots_for_members_once_it_knows_them() -> None:
    """Strangers from many networks hold at most a quarter of the request slots; a member's address (a public
    member's CONNECT, a NAT'd member's re-registration from its ``dials_from``) still gets one."""
    relay = RelayServer("127.0.0.1", 0, RelayLimits(handshake_timeout_s=5.0, max_pending_handshakes=16,
                                                    max_handshakes_per_source=8), key=KEY)
    relay.start()
    try:
        relay.set_members(["127.0.0.2"])
        _strangers_take_their_share_and_a_member_gets_in(relay.port, relay.slots.stranger_total, members=6)
    finally:
        relay.close()


def _strangers_take_their_share_and_a_member_gets_in(port: int, stranger_total: int, members: int) -> None:
    """One connection from each of ``stranger_total + 2`` stranger addresses: two are closed; then ``members``
    from the member's address 127.0.0.2 all stay."""
    held: list[socket.socket] = []
    try:
        strangers = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{i}", 0))
                     for i in range(3, 3 + stranger_total + 2)]
        held += strangers
        time.sleep(0.3)
        assert sum(_closed_within(c, 0.5) for c in strangers) == 2, "strangers held more than their share"
        ours = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
                for _ in range(members)]
        held += ours
        assert not any(_closed_within(c, 0.3) for c in ours), "a member was refused while strangers held theirs"
    finally:
        for c in held:
            c.close()


def test_relay_limits_fit_a_descriptor_budget() -> None:
    limits = RelayLimits().within(600)
    assert limits.descriptors() <= 600
    assert limits.max_splices >= 1 and limits.max_registrations >= 1
    assert RelayLimits().within(10**6) == RelayLimits()
    assert raise_nofile() >= 1024 or raise_nofile() > 0


# ------------------------------------------------------------------------------------------------ ports
def test_connection_cap_per_source_and_in_total() -> None:
    cap = ConnectionCap(total=3, per_source=2)
    assert cap.admit("a") and cap.admit("a") and not cap.admit("a")
    assert cap.admit("b") and not cap.admit("c")
    cap.release("a")
    assert cap.admit("c") and cap.held == 3 and cap.refused == 2


def test_http_server_caps_connections_and_cuts_slow_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe_http, "REQUEST_DEADLINE_S", 1.0)
    srv = observe_http.ObserveServer("127.0.0.1", 0, {"/": lambda: (b"ok", "text/plain")}, max_connections=6,
                                     max_per_source=3)
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", srv.port))
        assert _closed_within(extra, 1.0), "a 4th connection from one address was held"
        extra.close()
        # another address is served meanwhile
        with socket.create_connection(("127.0.0.1", srv.port), source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert other.makefile("rb").readline().startswith(b"HTTP/1.0 200")
        started = time.monotonic()
        for s in idle:  # trickling or silent: cut at the request deadline
            assert _closed_within(s, 3.0)
            s.close()
        assert time.monotonic() - started < 3.0
        body = urllib.request.urlopen(srv.url, timeout=5).read()
        assert body == b"ok"
    finally:
        srv.close()


def test_grpc_port_caps_connections_per_source_and_in_total() -> None:
    server = PeerServer(TransportConfig(max_connections=4))
    server.start()
    front = server._front
    try:
        assert front is not None and front.cap.total == 4 and front.cap.per_source == 3
        conns = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert _closed_within(extra, 1.0), "a fourth connection from one address was kept (per-source cap 3)"
        other = socket.create_connection(("127.0.0.1", server.port), source_address=("127.0.0.2", 0))
        assert not _closed_within(other, 0.3), "another address was refused while the port had room"
        flood = [socket.create_connection(("127.0.0.1", server.port),
                                          source_address=("127.0.0.3", 0)) for _ in range(3)]
        assert sum(_closed_within(c, 0.5) for c in flood) == 3, "the total cap of 4 let more in"
        for c in [*conns, extra, *flood]:
            c.close()
        held_within(lambda: front.held <= 1, 5, 0.05)
        assert front.held == 1, f"{front.held} connections still counted after their sockets closed"
        # what the front admits reaches gRPC: an authenticated call works through it
        with PeerClient(f"127.0.0.1:{server.port}") as client:
            assert client.ping(timeout_s=10) >= 0
        other.close()
    finally:
        server.stop()
    assert not Path(front.socket_path).parent.exists(), "the front's private socket folder was left behind"


def test_bulk_lane_caps_connections_per_source() -> None:
    server = PeerServer(TransportConfig(max_concurrent_streams=2, thread_pool_size=4))
    server.start()
    try:
        lane = server._lane
        assert lane is not None and lane.max_connections == 4 and lane.max_per_source == 3
        conns = [socket.create_connection(("127.0.0.1", server.bulk_port)) for _ in range(3)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", server.bulk_port))
        assert _closed_within(extra, 1.0)
        other = socket.create_connection(("127.0.0.1", server.bulk_port), source_address=("127.0.0.2", 0))
        assert not _closed_within(other, 0.3)
        for c in [*conns, extra, other]:
            c.close()
    finally:
        server.stop()


def test_the_bulk_lane_keeps_its_connections_for_members_once_it_knows_them() -> None:
    """Strangers from any number of networks hold at most their share of the lane; a member's address (a NAT'd
    member's too: its advert's ``dials_from``) still gets in, where counting per network alone shut it out."""
    server = PeerServer(TransportConfig(max_concurrent_streams=8, thread_pool_size=10))
    server.start()
    try:
        lane = server._lane
        assert lane is not None and lane.cap.stranger_total < lane.max_connections
        server.set_members(["127.0.0.2"])
        _strangers_take_their_share_and_a_member_gets_in(server.bulk_port, lane.cap.stranger_total, members=4)
    finally:
        server.stop()


def test_a_nated_member_counts_at_the_doors_from_where_its_relay_saw_it() -> None:
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.node.daemon import member_hosts
    from tasklet.peer.swarm.adverts import Advert

    device = DeviceInfo("cpu", "cpu", 2**30, 0.1, True, False)
    public = Advert("a" * 20, "10.0.0.1:4000", device, 1.0)
    home = Advert("b" * 20, "bbbb@10.0.0.1:4001", device, 1.0, reachable=False, dials_from="198.51.100.7")
    assert member_hosts([public, home]) == ["10.0.0.1", "198.51.100.7"]
    assert Advert.from_record(home.to_record()).dials_from == "198.51.100.7"
    for bad in ("", "10.0.0", "x" * 50, 5, "10.0.0.1:80"):
        with pytest.raises(ValueError, match="dials_from"):
            Advert.from_record({**home.to_record(), "dials_from": bad})


# ------------------------------------------------------------------------------------------------ secret
def test_the_secret_from_a_flag_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("from file\nignored\n")
    assert resolve_secret("flag", None, {SECRET_ENV: "env"}) == "flag"
    assert resolve_secret(None, str(path), {SECRET_ENV: "env"}) == "from file"
    assert resolve_secret(None, None, {SECRET_ENV: "env"}) == "env"
    assert resolve_secret(None, None, {}) is None
    with pytest.raises(ConfigError, match="not both"):
        resolve_secret("flag", str(path), {})
    with pytest.raises(ConfigError, match="missing"):
        resolve_secret(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        resolve_secret(None, str(tmp_path / "empty"), {})


# ------------------------------------------------------------------------------------------------ run record
def test_a_run_record_without_fingerprints_is_refused() -> None:
    from tasklet.peer.config import RunConfig
    from tasklet.peer.node.joining import JoinError, check_files
    from tasklet.peer.swarm.membership import RunRecord

    config = RunConfig.from_dict({"run": {"corpus": "stdlib"}}, where="test")
    published = config.public_dict()
    own = check_files(config, None)
    good = {**published, "fingerprint": own.fingerprint, "model_fingerprint": own.model_fingerprint}
    assert check_files(config, RunRecord(good, 0.0, "x")).fingerprint == own.fingerprint
    for missing in ("fingerprint", "model_fingerprint"):
        record = RunRecord({k: v for k, v in good.items() if k != missing}, 0.0, "x")
        with pytest.raises(JoinError, match="no data or model fingerprint"):
            check_files(config, record)
    with pytest.raises(JoinError, match="no data or model fingerprint"):
        check_files(config, RunRecord({**good, "fingerprint": ""}, 0.0, "x"))


# ------------------------------------------------------------------------------------------------ idle streams
def test_idle_streams_are_cancelled_and_free_their_slots() -> None:
    """Two pushes that open a stream and send nothing wait for their first chunk (holding a place and a thread,
    no stream slot); after stream_idle_s without a byte they are cancelled (their deadline was 60 s) and a real
    push is served."""
    import threading

    import grpc

    from tasklet.protocol import tasklet_pb2 as pb

    got: list[pb.Envelope] = []
    server = PeerServer(TransportConfig(max_concurrent_streams=2, thread_pool_size=4, stream_idle_s=1.0,
                                        bulk_port=None))
    server.register_push(pb.OTHER, got.append)
    server.start()
    release = threading.Event()

    def silent() -> object:
        release.wait(30)
        return
        yield  # a generator that sends nothing

    try:
        with PeerClient(server.endpoint, TransportConfig(bulk_port=None)) as client:
            call = client._channel.stream_unary("/tasklet.v1.Peer/Push", request_serializer=None,
                                                response_deserializer=pb.Ack.FromString)
            started = time.monotonic()
            idle = [call.future(silent(), timeout=60) for _ in range(2)]
            time.sleep(0.3)
            assert server._waiting_room.waiting == 2 and not server._per_peer, "the silent pushes wait, slotless"
            for future in idle:
                with pytest.raises(grpc.RpcError) as info:
                    future.result(timeout=10)
                assert info.value.code() is grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 5.0
            # the client hears CANCELLED before the handler thread has left its place: give it a moment
            held_within(lambda: not server._waiting_room.waiting, 5.0, 0.02)
            assert server._idle.cancelled == 2 and not server._per_peer and server._waiting_room.waiting == 0
            client.push(pb.Envelope(kind=pb.OTHER, meta={"n": "1"}), timeout_s=10)
            assert len(got) == 1
    finally:
        release.set()
        server.stop()


def test_a_network_is_one_source_and_members_keep_most_of_the_port() -> None:
    assert network_of("203.0.113.7") == network_of("203.0.113.250") == "203.0.113.0/24"
    assert network_of("2001:db8:1:ff::1") == network_of("[2001:db8:1:ab::9]") == "2001:db8:1::/56"
    assert network_of("::ffff:203.0.113.9") == "203.0.113.0/24"
    assert network_of("127.0.0.2") != network_of("127.0.0.3"), "each loopback address is a host of its own"
    cap = ConnectionCap(total=8, per_source=3)
    assert cap.stranger_total == 2
    # before the members are known: by network, so three addresses of one /24 use up its share
    strangers = ["198.51.100.1", "198.51.100.2", "198.51.100.3"]
    assert all(cap.admit(a) for a in strangers)
    assert not cap.admit("198.51.100.4"), "a fourth address of the same /24"
    assert cap.admit("2001:db8::1"), "another network is another source"
    for a in [*strangers, "2001:db8::1"]:
        cap.release(a)
    assert cap.held == 0
    # members known: strangers from any number of networks hold at most a quarter of the port, members the rest
    cap.set_members(["203.0.113.7", "[2001:db8:5::7]"])
    assert cap.admit("192.0.2.1") and cap.admit("100.64.0.1")
    assert not cap.admit("100.65.0.1"), "a third stranger network past the strangers' share"
    assert cap.admit("203.0.113.7") and cap.admit("203.0.113.7") and cap.admit("2001:db8:5::7")
    assert not cap.admit("203.0.113.8"), "a member's neighbour is a stranger"
    # released as admitted, even after the member set changed
    cap.set_members([])
    cap.release("203.0.113.7")
    cap.release("192.0.2.1")
    assert cap.held == 3 and cap.admit("100.66.0.1") and not cap.admit("100.67.0.1")


def test_one_stranger_network_holds_an_eighth_of_the_strangers_share() -> None:
    # the gRPC port of a public peer with the common hard limit of 20,000 descriptors: 1,974 connections
    cap = ConnectionCap(total=1974, per_source=1480)
    cap.set_members(["10.77.0.11"])
    assert cap.stranger_total == 493 and cap.per_stranger_network == 61
    rented = [f"10.77.1.{i}" for i in range(10, 14)]  # four addresses of one rented /24
    admitted = sum(cap.admit(rented[i % 4]) for i in range(800))
    assert admitted == 61, "several addresses of one network are one stranger"
    assert cap.admit("10.77.0.101"), "a NAT'd member dialling from its home network still gets in"
    assert all(cap.admit("10.77.0.11") for _ in range(500)), "members keep the rest of the port"
    before = cap.held
    for i in range(8):  # strangers from eight networks together fill the strangers' share, no more
        while cap.admit(f"100.{64 + i}.0.1"):
            pass
    assert cap.held - before == 493 - 62
