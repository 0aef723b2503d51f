"""The gRPC client of a peer: one PeerClient per destination endpoint.

Every call has a deadline (the caller's `timeout_s`, else config.default_timeout_s). gRPC failures come back
as the protocol's typed errors: `Refused` when the peer answered no (INVALID_ARGUMENT, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED, INTERNAL, ...; it carries the peer's one-line message), `PeerUnreachable` when it did
not answer (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED).

Backpressure: at most `config.max_inflight_pushes` pushes to this peer are unfinished at any time; a further
push blocks until one finishes, for at most its own timeout, then raises `Backpressure`. The caller that
produces faster than the link carries is thus slowed to the link's pace, with bounded memory.

Link emulation: with a `LinkShaper`, everything this client sends is held back by the link's delay and paced
by its rate (see peer.net.shaping); share one shaper between all clients that talk to the same destination.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc

from tasklet.peer.net.allocator import keep_freed_buffers
from tasklet.peer.net.bulk_client import (
    BulkLane,
    LaneUnusableError,
    StaleConnectionError,
    mark_unusable,
    pieces,
    usable,
)
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.counters import TRAFFIC
from tasklet.peer.net.endpoint import EndpointError, dial_plan, parse_endpoint, proxy_url
from tasklet.peer.net.local import DEADLINES, caller_id, local_server, settle_from
from tasklet.peer.net.server import PeerServer, _kind_name, kind_value, service_name
from tasklet.peer.net.shaping import LinkShaper, take_in
from tasklet.peer.net.statuses import error_of_status
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import Reassembler, check_version, chunk_payload_sizes, decode_chunk, iter_segment_chunks
from tasklet.protocol.errors import Backpressure, PeerUnreachable, Refused, TransportError
from tasklet.protocol.message import WireEnvelope, envelope_segments

logger = logging.getLogger(__name__)

PROBE_CHUNK_BYTES = 256 * 1024
# Slack on top of a call's own deadline when waiting for its future: gRPC enforces the deadline itself, this
# only guards against a future that never resolves.
_RESULT_SLACK_S = 5.0


def map_rpc_error(exc: grpc.RpcError, endpoint: str) -> TransportError:
    """The typed error for a failed gRPC call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = (exc.details() if hasattr(exc, "details") else None) or str(code)
    return error_of_status(code, detail, endpoint)


class PeerClient:
    """Calls one remote PeerServer at `endpoint` ("host:port").

    sender: this process's peer id, stamped on Envelopes that have none and sent with Fetch/Ping/Probe so
    the server can shape its replies back to us (a TLS server replaces it with the authenticated caller).
    shaper: emulation of the link to `endpoint`, or None. expect_peer: the peer id that must answer at
    `endpoint` (its trusted certificate is pinned); default: the peer a relayed endpoint names, else any
    trusted peer.
    """

    def __init__(
        self,
        endpoint: str,
        config: TransportConfig | None = None,
        *,
        shaper: LinkShaper | None = None,
        sender: str = "",
        expect_peer: str = "",
    ) -> None:
        keep_freed_buffers()  # each pushed chunk is a fresh multi-MiB bytes: reuse memory (peer.net.allocator)
        self.endpoint = endpoint
        self.config = config or TransportConfig()
        self.shaper = shaper
        self.sender = sender
        # A relayed endpoint ("PEERID@RELAY:PORT") is reached through the relay's HTTP CONNECT tunnel; a route
        # ("HOST:PORT/coordinator") selects a server mounted on the peer's port (see peer.net.endpoint).
        target, route, proxy, self.path = dial_plan(endpoint)
        options: list[tuple[str, Any]] = list(self.config.grpc_options)
        if proxy is not None:
            options += [("grpc.http_proxy", proxy_url(proxy)), ("grpc.enable_http_proxy", 1)]
        self.expect_peer = expect_peer
        self._pinned: bytes | None = None  # the server certificate this client accepts (None: any trusted one)
        self._channel = self._open_channel(target, options, expect_peer or self._relayed_peer(endpoint))
        service = service_name(route)
        # Push and Fetch move serialized Chunks as raw bytes (see protocol.chunking.encode_chunk).
        self._push = self._channel.stream_unary(
            f"/{service}/Push", request_serializer=None, response_deserializer=pb.Ack.FromString
        )
        self._fetch = self._channel.unary_stream(
            f"/{service}/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=None,
        )
        self._ping = self._channel.unary_unary(
            f"/{service}/Ping",
            request_serializer=pb.PingRequest.SerializeToString,
            response_deserializer=pb.PingReply.FromString,
        )
        self._probe = self._channel.stream_unary(
            f"/{service}/Probe",
            request_serializer=pb.ProbeChunk.SerializeToString,
            response_deserializer=pb.ProbeReply.FromString,
        )
        self._status = self._channel.unary_unary(
            f"/{service}/Status",
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusReply.FromString,
        )
        self._bulk_lane_call = self._channel.unary_unary(
            f"/{service}/BulkLane",
            request_serializer=pb.BulkLaneRequest.SerializeToString,
            response_deserializer=pb.BulkLaneReply.FromString,
        )
        self._inflight = threading.BoundedSemaphore(self.config.max_inflight_pushes)
        # The peer's bulk lane (peer.net.bulk_client): None until asked, False when it has none or we may not use
        # one (a relayed or routed endpoint, or bulk_port None), else the lane. Pushes on it run on _bulk_threads.
        self._lane: BulkLane | bool | None = None if self.config.bulk_port is not None and not route else False
        if proxy is not None:
            self._lane = False
        self._lane_lock = threading.Lock()
        self._bulk_threads: ThreadPoolExecutor | None = None

    def _open_channel(self, target: str, options: list[tuple[str, Any]], expect_peer: str) -> grpc.Channel:
        """Mutual TLS (see peer.net.tls): our certificate; the server must present ``expect_peer``'s (or any
        trusted peer's when none is expected). An expected peer whose certificate is not trusted here fails
        closed: nobody else can answer for it. The name checked is the fixed peer name, so the dialled address
        (direct, reversed or relayed) does not matter."""
        tls = self.config.tls
        if tls is None:
            return grpc.insecure_channel(target, options=options)
        pinned = tls.trust.certificate(expect_peer) if expect_peer else None
        if expect_peer and pinned is None:
            logger.warning("no trusted certificate for peer %s (at %s): calls to it will fail", expect_peer, target)
            pinned = tls.certificate  # only this peer itself could pass: fail closed
        self._pinned = pinned
        return grpc.secure_channel(target, tls.channel_credentials(pinned), options=[*options, *tls.channel_options()])

    @staticmethod
    def _relayed_peer(endpoint: str) -> str:
        """The peer id a relayed endpoint ("PEERID@RELAY:PORT") names, else ""."""
        base = endpoint.partition("/")[0]
        return base.partition("@")[0] if "@" in base else ""

    def _timeout(self, timeout_s: float | None) -> float:
        return self.config.default_timeout_s if timeout_s is None else timeout_s

    def _local(self) -> PeerServer | None:
        """This process's own server behind our endpoint, when a call may skip the network (peer.net.local)."""
        return None if self.shaper is not None else local_server(self.endpoint, self.config.tls)

    def _chunk_bytes(self) -> int:
        size = self.config.chunk_bytes
        return size if self.shaper is None else self.shaper.chunk_bytes(size)

    # --- push ---------------------------------------------------------------------------------------------
    def push_async(self, envelope: pb.Envelope | WireEnvelope, timeout_s: float | None = None) -> Future[None]:
        """Start delivering `envelope`; the Future resolves to None or fails with Refused/PeerUnreachable.

        A WireEnvelope's tensors are sent from their own buffers (see protocol.message): they must not change
        until the Future resolves.

        Blocks (at most timeout_s) while max_inflight_pushes pushes are unfinished: that is the backpressure.
        Stamps protocol_version and sender on the envelope when they are unset. timeout_s covers the wait
        for a slot and the whole call.
        """
        timeout = self._timeout(timeout_s)
        deadline = time.monotonic() + timeout
        if not self._inflight.acquire(timeout=timeout):
            raise Backpressure(
                self.endpoint,
                f"{self.config.max_inflight_pushes} pushes in flight, none finished in {timeout:.3g} s",
            )
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Backpressure(self.endpoint, f"no time left of {timeout:.3g} s after waiting for a push slot")
            if envelope.protocol_version == 0:
                envelope.protocol_version = PROTOCOL_VERSION
            if not envelope.sender:
                envelope.sender = self.sender
            size = envelope.nbytes if isinstance(envelope, WireEnvelope) else envelope.ByteSize()
            TRAFFIC.sent(_kind_name(envelope.kind), size)
            local = self._local()
            if local is not None:
                delivered = local.push_local(envelope, caller_id(self.config.tls))
                delivered.add_done_callback(lambda _: self._inflight.release())  # its handler's thread is free
                answer: Future[None] = Future()
                answer.set_running_or_notify_cancel()
                delivered.add_done_callback(lambda done: settle_from(done, answer))
                DEADLINES.watch(answer, deadline, lambda: PeerUnreachable(
                    self.endpoint, f"DEADLINE_EXCEEDED: push not handled within {timeout:.3g} s"))
                return answer
            lane = self._bulk_lane(remaining) if size >= self.config.bulk_min_bytes else None
            if lane is not None:
                pushed = self._bulk_executor().submit(self._push_on_lane, lane, envelope, deadline)
                pushed.add_done_callback(lambda _: self._inflight.release())
                return pushed
            call = self._push.future(self._push_chunks(envelope), timeout=remaining)
        except BaseException:
            self._inflight.release()
            raise
        result: Future[None] = Future()
        result.set_running_or_notify_cancel()

        def finished(done: grpc.Future) -> None:
            self._inflight.release()
            try:
                done.result()
            except grpc.RpcError as exc:
                result.set_exception(map_rpc_error(exc, self.endpoint))
            except grpc.FutureCancelledError:
                result.set_exception(PeerUnreachable(self.endpoint, "push cancelled"))
            else:
                result.set_result(None)

        call.add_done_callback(finished)
        return result

    def _push_chunks(self, envelope: pb.Envelope | WireEnvelope) -> Iterator[bytes]:
        # Serialising happens when gRPC pulls the first chunk, on gRPC's sending thread, not the caller's.
        sent_at = time.monotonic()
        segments = envelope_segments(envelope)
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in segments)
        chunk_bytes = self._chunk_bytes()
        chunks = iter_segment_chunks(segments, chunk_bytes)
        if self.shaper is None:
            yield from chunks
        else:
            # The message is booked on the link as a whole (FIFO with other messages to this peer), counted
            # in payload bytes (chunk headers are a few bytes per chunk and are not counted).
            sizes = chunk_payload_sizes(total, chunk_bytes)
            yield from self.shaper.shape(chunks, lambda _: next(sizes), sent_at=sent_at, total_bytes=total)

    # --- the bulk lane (peer.net.bulk_client) --------------------------------------------------------------
    def _bulk_lane(self, timeout_s: float) -> BulkLane | None:
        """The peer's bulk lane, asked for once (over this authenticated channel); None when there is none."""
        with self._lane_lock:
            if self._lane is None:
                try:
                    reply = self._bulk_lane_call(
                        pb.BulkLaneRequest(protocol_version=PROTOCOL_VERSION), timeout=min(timeout_s, 5.0)
                    )
                except grpc.RpcError as exc:
                    if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                        self._lane = False  # a peer without the lane: gRPC for good
                    return None  # unreachable now: ask again on the next large push
                try:
                    host = parse_endpoint(self.endpoint).host
                except EndpointError:  # a target gRPC resolves itself (dns:///...): no host for a socket of ours
                    self._lane = False
                    return None
                ok = reply.protocol_version == PROTOCOL_VERSION and 0 < reply.port <= 65535
                ok = ok and usable((host, reply.port))
                self._lane = BulkLane(self.endpoint, host, reply.port, self.config.tls, self._pinned) if ok else False
            return self._lane or None

    def _bulk_executor(self) -> ThreadPoolExecutor:
        with self._lane_lock:
            if self._bulk_threads is None:
                self._bulk_threads = ThreadPoolExecutor(self.config.max_inflight_pushes, thread_name_prefix="bulk-push")
            return self._bulk_threads

    def _push_on_lane(self, lane: BulkLane, envelope: pb.Envelope | WireEnvelope, deadline: float) -> None:
        """One push on the bulk lane (on a lane thread); through gRPC if the lane cannot be reached."""
        sent_at = time.monotonic()
        segments = envelope_segments(envelope)
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in segments)

        def parts() -> Iterator[memoryview]:
            chunks: Iterator[memoryview] = pieces(segments, self._chunk_bytes())
            if self.shaper is None:
                return chunks
            # as _push_chunks: booked whole, released as the link would carry it
            return self.shaper.shape(chunks, lambda view: view.nbytes, sent_at=sent_at, total_bytes=total)

        try:
            try:
                lane.push(parts(), total, deadline)
            except StaleConnectionError:  # the peer closed a kept connection unseen: once more, on a new one
                lane.push(parts(), total, deadline, fresh=True)
            return
        except LaneUnusableError as exc:
            with self._lane_lock:
                if self._lane is lane:
                    logger.warning("%s: bulk lane unusable, pushing through gRPC from now on: %s", self.endpoint, exc)
                    self._lane = False
                    if exc.timed_out:
                        mark_unusable(lane.address)
                    lane.close()
        call = self._push.future(self._push_chunks(envelope), timeout=max(1e-3, deadline - time.monotonic()))
        try:
            call.result()
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self.endpoint) from None

    def push(self, envelope: pb.Envelope | WireEnvelope, timeout_s: float | None = None) -> None:
        """Deliver `envelope` and wait for the peer's acknowledgement (see push_async)."""
        timeout = self._timeout(timeout_s)
        future = self.push_async(envelope, timeout)
        try:
            future.result(timeout=timeout + _RESULT_SLACK_S)
        except FutureTimeout:
            raise PeerUnreachable(self.endpoint, f"push did not finish within {timeout:.3g} s") from None

    # --- fetch --------------------------------------------------------------------------------------------
    def fetch(
        self,
        kind: int | str,
        key: pb.Key | None = None,
        *,
        meta: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> WireEnvelope:
        """Ask the peer for an Envelope of `kind` (e.g. STAGE_STATE) about `key`; checked like a push, and
        received like one (a WireEnvelope: read like a pb.Envelope, its tensors decode without a copy).
        `max_bytes`: the largest reply accepted, for a caller that knows the size (a stage's state); default
        the transport's `max_envelope_bytes`. `progress(bytes so far, bytes announced)` after each chunk.

        Raises Refused/PeerUnreachable, or protocol.errors.BadMessage if the reply stream is malformed.
        """
        timeout = self._timeout(timeout_s)
        request = pb.FetchRequest(
            protocol_version=PROTOCOL_VERSION,
            kind=kind_value(kind),
            sender=self.sender,
            meta=dict(meta or {}),
        )
        if key is not None:
            request.key.CopyFrom(key)
        start = time.monotonic()
        if self.shaper is not None:
            self.shaper.wait_delay(start)
        asm = Reassembler(self.config.max_envelope_bytes if max_bytes is None else max_bytes)
        local = self._local()
        if local is not None:
            answered = local.fetch_local(request, caller_id(self.config.tls))
            try:
                segments, _ = answered.result(timeout=max(1e-3, timeout - (time.monotonic() - start)))
            except FutureTimeout:
                raise PeerUnreachable(self.endpoint, f"DEADLINE_EXCEEDED: no answer within {timeout:.3g} s") from None
            stream = iter_segment_chunks(segments, self.config.chunk_bytes)
        else:
            stream = self._fetch(request, timeout=max(1e-3, timeout - (time.monotonic() - start)))
        try:
            for raw in stream:
                asm.add(decode_chunk(raw))
                if local is None:
                    take_in(len(raw))  # the owner's download cap
                if progress is not None:
                    progress(asm.received, asm.total)
                del raw  # read: free it before gRPC makes the next chunk (memory reused)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self.endpoint) from None
        except Exception:
            if local is None:
                stream.cancel()
            raise
        reply = asm.message()
        TRAFFIC.received(_kind_name(reply.kind), asm.total)
        return reply

    # --- control calls ------------------------------------------------------------------------------------
    def ping(self, timeout_s: float | None = None) -> float:
        """Round-trip time in seconds of a small call (both directions of an emulated link included when the
        server shapes its replies)."""
        timeout = self._timeout(timeout_s)
        start = time.monotonic()
        if self.shaper is not None:
            self.shaper.wait_delay(start)
        request = pb.PingRequest(protocol_version=PROTOCOL_VERSION, sender=self.sender, sent_ns=time.monotonic_ns())
        try:
            reply = self._ping(request, timeout=max(1e-3, timeout - (time.monotonic() - start)))
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self.endpoint) from None
        check_version("ping_reply.protocol_version", reply.protocol_version)
        return time.monotonic() - start

    def probe(self, n_bytes: int, timeout_s: float | None = None) -> float:
        """Bandwidth in bits/s of the link to the peer, from a timed stream of n_bytes.

        The receiver timestamps chunk arrivals; (bytes after the first chunk) / (last - first arrival) is free
        of the link's latency. With a single chunk, falls back to the sender's timing (latency included).
        """
        if n_bytes <= 0:
            raise ValueError(f"n_bytes must be positive, got {n_bytes}")
        timeout = self._timeout(timeout_s)
        chunk = min(PROBE_CHUNK_BYTES, self._chunk_bytes())
        payload = bytes(chunk)

        def chunks() -> Iterator[pb.ProbeChunk]:
            sent = 0
            seq = 0
            while sent < n_bytes:
                size = min(chunk, n_bytes - sent)
                yield pb.ProbeChunk(
                    protocol_version=PROTOCOL_VERSION, seq=seq, sender=self.sender, payload=payload[:size]
                )
                sent += size
                seq += 1

        stream: Iterator[pb.ProbeChunk] = chunks()
        start = time.monotonic()
        if self.shaper is not None:
            stream = self.shaper.shape(stream, lambda c: len(c.payload), sent_at=start)
        try:
            reply = self._probe(stream, timeout=timeout)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self.endpoint) from None
        elapsed = time.monotonic() - start
        TRAFFIC.sent("PROBE", reply.bytes_received)
        check_version("probe_reply.protocol_version", reply.protocol_version)
        span_s = (reply.last_recv_ns - reply.first_recv_ns) / 1e9
        after_first = reply.bytes_received - reply.first_chunk_bytes
        if after_first > 0 and span_s > 0:
            return 8.0 * after_first / span_s
        return 8.0 * reply.bytes_received / max(elapsed, 1e-9)

    def status(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The peer's status as filled by its daemon (plus the transport's counters)."""
        request = pb.StatusRequest(protocol_version=PROTOCOL_VERSION)
        try:
            reply = self._status(request, timeout=self._timeout(timeout_s))
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, self.endpoint) from None
        check_version("status_reply.protocol_version", reply.protocol_version)
        try:
            status = json.loads(reply.json)
        except ValueError as exc:
            raise Refused("INVALID_REPLY", f"status_reply.json: not JSON ({exc})", self.endpoint) from None
        if not isinstance(status, dict):
            raise Refused("INVALID_REPLY", "status_reply.json: not a JSON object", self.endpoint)
        return status

    def close(self) -> None:
        self._channel.close()
        with self._lane_lock:
            lane, threads = self._lane, self._bulk_threads
            self._lane, self._bulk_threads = False, None
        if isinstance(lane, BulkLane):
            lane.close()
        if threads is not None:
            threads.shutdown(wait=False)

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
