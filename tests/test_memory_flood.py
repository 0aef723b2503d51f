"""The memory flood of issue #12 against a real worker process: what others can make a worker hold is bounded.

The attack: many Push streams whose first chunk announces a 1 GiB message, then stall. Before the fix the
server allocated the announced size at once (48 streams: 48 GiB). Now:

* a stranger (no trusted certificate) never gets past the TLS handshake: the worker holds nothing;
* the worker's coordinator (a peer with a role) announcing 1 GiB is refused on the first chunk, over the
  Kind's limit (peer.runtime.bounds);
* the coordinator announcing a message within the limit and stalling holds at most its quota of streams,
  each with only the bytes it actually sent.

The worker's resident memory (VmRSS of its process) is read before and after each flood.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from peer.emulation.local import LocalWorkers
from peer.net.tls import TlsContext
from peer.runtime.bounds import ASSIGNMENT_BYTES
from peer.runtime.worker import WORKER_TRANSPORT
from protocol import PROTOCOL_VERSION
from protocol import tasklet_pb2 as pb

pytestmark = pytest.mark.integration

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
            assert set(codes) == {"INVALID_ARGUMENT"}  # over the Kind's limit, from the first chunk
        else:  # the stalled streams: at most the per-peer quota was let in, the rest refused at once
            assert codes.get("RESOURCE_EXHAUSTED", 0) >= STREAMS - WORKER_TRANSPORT["max_streams_per_peer"]
    time.sleep(1.0)
    assert _rss(pid) > 0  # the worker is alive and serving
