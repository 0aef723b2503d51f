"""The memory flood of issue #12 against a real worker process: what others can make a worker hold is bounded.

The attack: many Push streams whose first chunk announces a 1 GiB message, then stall. Before the fix the
server allocated the announced size at once (48 streams: 48 GiB). Now:

* a stranger (no trusted certificate) never gets past the TLS handshake: the worker holds nothing;
* the worker's coordinator (a peer with a role) announcing 1 GiB is refused on the first chunk, over the
  Kind's limit (peer.runtime.bounds);
* the coordinator announcing a message within the limit and stalling holds at most its quota of streams,
  each with only the bytes it actually sent.

The worker's resident memory (VmRSS of its process) is read before and after each flood.

The same flood on the worker's bulk lane (peer.net.bulk_server: pushes over a socket of its own, beside gRPC,
same checks) must stay within the same bounds: a stranger and a plaintext client never get past the TLS
handshake, idle connections beyond the lane's cap are closed at once, and the coordinator is refused or held
to its quota of stream slots exactly as on gRPC.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tasklet.peer.emulation.local import LocalWorkers
from tasklet.peer.identity.certs import SERVER_NAME
from tasklet.peer.net.bulk_wire import HEAD, HEAD_MAGIC, read_reply
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.endpoint import parse_endpoint
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime.bounds import ASSIGNMENT_BYTES
from tasklet.peer.runtime.stage.worker import WORKER_TRANSPORT
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb

pytestmark = pytest.mark.usefixtures("processes")

MIB = 1 << 20
STREAMS = 48
# The documented bound (README, "What others can make a worker hold"): a stranger, nothing; a peer with a
# role, at most every stream slot x (its Kind's limit + one gRPC message of max_message_bytes).
STRANGER_BOUND = 32 * MIB  # slack for gRPC's per-connection state and the allocator, not message buffers
ROLE_BOUND = WORKER_TRANSPORT["max_concurrent_streams"] * (ASSIGNMENT_BYTES + WORKER_TRANSPORT["max_message_bytes"])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _settle(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the process's resident memory stops moving (less than 1 MiB over 2 s)."""
    deadline = time.monotonic() + timeout_s
    last = _rss(pid)
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = _rss(pid)
        if abs(now - last) < MIB:
            return
        last = now


def _chunk(total: int, payload_bytes: int) -> bytes:
    # an Envelope prefix (protocol_version, kind STAGE_ASSIGNMENT) so the kind is readable from the first chunk
    prefix = bytes([0x08, PROTOCOL_VERSION, 0x10, pb.STAGE_ASSIGNMENT])
    payload = prefix + bytes(payload_bytes - len(prefix))
    return pb.Chunk(protocol_version=PROTOCOL_VERSION, total_bytes=total, seq=0, payload=payload).SerializeToString()


def _flood(endpoint: str, tls: TlsContext | None, total: int, first: int, release: threading.Event) -> list:
    """Open STREAMS pushes announcing ``total`` bytes, send ``first`` bytes each, stall until ``release``."""
    options = [("grpc.max_send_message_length", 16 * MIB)]
    channel = grpc.insecure_channel(endpoint, options=options) if tls is None else tls.channel(endpoint, options)
    push = channel.stream_unary("/tasklet.v1.Peer/Push", request_serializer=None,
                                response_deserializer=pb.Ack.FromString)

    def stalled() -> Iterator[bytes]:
        yield _chunk(total, first)
        release.wait(60)

    futures = [push.future(stalled(), timeout=90) for _ in range(STREAMS)]
    time.sleep(3.0)  # let every stream reach the server and be read (or refused)
    return [channel, futures]


def _outcome(futures: list) -> dict[str, int]:
    codes: dict[str, int] = {}
    for f in futures:
        try:
            f.result(timeout=90)
            name = "OK"
        except grpc.RpcError as exc:
            name = exc.code().name
        codes[name] = codes.get(name, 0) + 1
    return codes


@pytest.fixture
def worker() -> Iterator[tuple[str, int, TlsContext]]:
    coordinator = TlsContext.generate()
    with LocalWorkers(1, coordinator_cert=coordinator.certificate_text) as workers:
        coordinator.trust_only([workers.certificates[workers.endpoints[0]]])
        _settle(workers.procs[0].pid)  # the worker's warm-up (torch's lazy initialisation) is over
        yield workers.endpoints[0], workers.procs[0].pid, coordinator


def test_flood_of_announced_gigabytes_stays_within_the_documented_bound(worker) -> None:
    endpoint, pid, coordinator = worker
    for attacker, total, first, bound in [
        (TlsContext.generate(), 1 << 30, 4 * MIB, STRANGER_BOUND),  # a stranger
        (None, 1 << 30, 4 * MIB, STRANGER_BOUND),  # plaintext
        (coordinator, 1 << 30, MIB, ROLE_BOUND),  # a role, but 1 GiB is over the Kind's limit
        (coordinator, ASSIGNMENT_BYTES, ASSIGNMENT_BYTES - 4096, ROLE_BOUND),  # within the limit, stalled
    ]:
        before = _rss(pid)
        release = threading.Event()
        channel, futures = _flood(endpoint, attacker, total, first, release)
        grown = _rss(pid) - before
        release.set()
        codes = _outcome(futures)
        channel.close()
        who = "stranger" if attacker is not coordinator else "coordinator"
        print(f"{who}: announced {total / MIB:.0f} MiB x {STREAMS}, RSS grew {grown / MIB:.1f} MiB "
              f"(bound {bound / MIB:.0f} MiB), outcomes {codes}")
        assert grown < bound, (who, total, grown)
        assert "OK" not in codes  # nothing was delivered
        if attacker is not coordinator:
            assert set(codes) == {"UNAVAILABLE"}  # refused in the handshake
        elif total > ASSIGNMENT_BYTES:
            # over the Kind's limit, from the first chunk; streams beyond the caller's quota at that instant are
            # refused before their size is read (RESOURCE_EXHAUSTED: how many depends on the threads' timing)
            assert codes.get("INVALID_ARGUMENT", 0) > 0
            assert set(codes) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
        else:  # the stalled streams: at most the per-peer quota was let in, the rest refused at once
            assert codes.get("RESOURCE_EXHAUSTED", 0) >= STREAMS - WORKER_TRANSPORT["max_streams_per_peer"]
    time.sleep(1.0)
    assert _rss(pid) > 0  # the worker is alive and serving


# --- the same flood on the bulk lane ----------------------------------------------------------------------------
LANE_CONNECTIONS = 2 * WORKER_TRANSPORT["max_concurrent_streams"]  # BulkListener.max_connections


def _lane_address(endpoint: str, coordinator: TlsContext) -> tuple[str, int]:
    """The worker's lane, as its BulkLane call (over the coordinator's authenticated channel) names it."""
    with PeerClient(endpoint, TransportConfig(tls=coordinator)) as client:
        lane = client._bulk_lane(5.0)
        assert lane is not None, "the worker has no bulk lane"
        return lane.address


def _lane_flood(address: tuple[str, int], tls: TlsContext | None, n: int, total: int, first: int) -> list:
    """Open ``n`` lane connections (mutual TLS with ``tls``'s certificate; None: plaintext) that each send a head
    announcing ``total`` bytes and the first ``first`` of them (``total`` 0: nothing at all), then stall. An entry
    is None where the server ended the connection while we sent."""
    context = None if tls is None else tls.ssl_client_context()
    head = HEAD.pack(HEAD_MAGIC, PROTOCOL_VERSION, 60_000, total)
    prefix = bytes([0x08, PROTOCOL_VERSION, 0x10, pb.STAGE_ASSIGNMENT])  # the Kind, readable from the first bytes
    data = head + prefix + bytes(first - len(prefix)) if total else b""
    conns: list[socket.socket | None] = []
    for _ in range(n):
        sock = None
        try:
            sock = socket.create_connection(address, timeout=5)
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=SERVER_NAME)
            sock.sendall(data)
            conns.append(sock)
        except OSError:  # refused in the handshake (or right after it, TLS 1.3), or closed for the cap
            if sock is not None:
                sock.close()
            conns.append(None)
    return conns


def _lane_outcome(conns: list) -> dict[str, int]:
    """Per connection: the code the server answered, CLOSED (ended without an answer) or STALLED (still held)."""
    live = [c for c in conns if c is not None]
    readable = set(select.select(live, [], [], 1.0)[0]) if live else set()
    codes = {"CLOSED": len(conns) - len(live)} if len(live) < len(conns) else {}
    for conn in live:
        if conn not in readable and not (isinstance(conn, ssl.SSLSocket) and conn.pending()):
            name = "STALLED"
        else:
            try:
                conn.settimeout(2.0)
                name = read_reply(conn)[0].name
            except OSError:  # TLS alert, reset, end of stream (LaneClosedError)
                name = "CLOSED"
        codes[name] = codes.get(name, 0) + 1
    return codes


def _pushes(endpoint: str, coordinator: TlsContext) -> int:
    """Pushes the worker has delivered to its handlers so far (its Status call)."""
    with PeerClient(endpoint, TransportConfig(tls=coordinator)) as client:
        return client.status(timeout_s=10)["transport"]["pushes"]


def _stranger(coordinator: TlsContext) -> TlsContext:
    """An identity the worker does not trust, that trusts the worker (so that only the worker's check stops it)."""
    worker_certs = [coordinator.trust.certificate(p) for p in coordinator.trust.peers() if p != coordinator.peer_id]
    return TlsContext.generate().trust_only([c for c in worker_certs if c is not None])


def test_lane_flood_stays_within_the_documented_bound(worker) -> None:
    endpoint, pid, coordinator = worker
    address = _lane_address(endpoint, coordinator)
    assert address[0] == parse_endpoint(endpoint).host
    delivered = _pushes(endpoint, coordinator)
    quota = WORKER_TRANSPORT["max_streams_per_peer"]
    for who, attacker, n, total, first, bound in [
        ("stranger", _stranger(coordinator), STREAMS, 1 << 30, 4 * MIB, STRANGER_BOUND),
        ("plaintext", None, STREAMS, 1 << 30, 4 * MIB, STRANGER_BOUND),
        ("idle", None, LANE_CONNECTIONS + 16, 0, 0, STRANGER_BOUND),  # never even start the handshake
        ("coordinator, 1 GiB", coordinator, STREAMS, 1 << 30, MIB, ROLE_BOUND),
        ("coordinator, stalled", coordinator, STREAMS, ASSIGNMENT_BYTES, ASSIGNMENT_BYTES - 4096, ROLE_BOUND),
    ]:
        before = _rss(pid)
        conns = _lane_flood(address, attacker, n, total, first)
        try:
            time.sleep(1.0)  # let the worker read (or refuse) what was sent
            grown = _rss(pid) - before
            codes = _lane_outcome(conns)
        finally:
            for conn in conns:
                if conn is not None:
                    conn.close()
        print(f"lane, {who}: {n} connections announcing {total / MIB:.0f} MiB, RSS grew {grown / MIB:.1f} MiB "
              f"(bound {bound / MIB:.0f} MiB), outcomes {codes}")
        assert grown < bound, (who, grown)
        assert "OK" not in codes  # nothing was delivered
        if who in ("stranger", "plaintext"):
            assert set(codes) == {"CLOSED"}  # ended in the TLS handshake, never answered
        elif who == "idle":  # the lane's cap: what it holds open before any handshake is bounded
            assert codes.get("STALLED", 0) <= LANE_CONNECTIONS and codes.get("CLOSED", 0) >= 16
        elif total > ASSIGNMENT_BYTES:  # over the Kind's limit, from the first piece (or over the quota at once)
            assert codes.get("INVALID_ARGUMENT", 0) > 0
            assert set(codes) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
        else:  # the stalled requests: at most the per-peer quota was let in, the rest refused at once
            assert codes.get("STALLED", 0) <= quota
            assert codes.get("RESOURCE_EXHAUSTED", 0) >= STREAMS - quota
            assert set(codes) <= {"STALLED", "RESOURCE_EXHAUSTED"}
    assert _pushes(endpoint, coordinator) == delivered  # and the worker still answers
