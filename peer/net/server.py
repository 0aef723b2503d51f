"""The gRPC server of a peer: takes chunked Envelopes and dispatches them to handlers the runtime registers.

Order of checks on a Push, all before any handler sees the message: the call has a deadline, its caller is
authenticated, a place is free among the streams waiting for their first chunk (peer.net.waiting: per caller
and in total), the first chunk has our protocol version and its Kind is admitted from this caller within
`max_envelope_bytes` (before buffering), only then a stream slot is free (in total and of the caller's
quota), chunk sequence numbers count up from 0, the stream carries exactly the announced bytes, the bytes
parse as an Envelope of our protocol version, and a handler exists for its Kind. A Probe waits for its first
chunk the same way; a Fetch, whose request is whole when its handler runs, takes its slot first and its
handler refuses a caller without a role at once.
The handler gets the Envelope as a protocol.message.WireEnvelope (it reads like a pb.Envelope; each tensor's
data arrived into a buffer of its own and decodes without a copy), validates the content (tensors via
protocol.codec.decode_tensor, keys against its state) and may raise:

* protocol.errors.BadMessage  -> INVALID_ARGUMENT with the handler's message,
* protocol.errors.Rejected    -> FAILED_PRECONDITION (e.g. unknown step or micro-batch),
* protocol.errors.Unavailable -> UNAVAILABLE (try later),
* protocol.errors.Forbidden   -> PERMISSION_DENIED (the authenticated caller has the wrong role),
* protocol.errors.Unauthenticated -> UNAUTHENTICATED.

Every call is authenticated first (mutual TLS, see peer.net.tls): the caller's certificate must be trusted
now, and the caller's peer id replaces the self-declared ``Envelope.sender`` / ``FetchRequest.sender`` that
handlers see. A call must carry a deadline of at most ``max_deadline_s``; a caller holds at most
``max_streams_per_peer`` stream slots, and as many places among the streams waiting for a first chunk; a push
is refused from its first chunk when it announces more than the limit of its Kind (``set_push_limit``), and
its buffer grows only with the bytes that arrive.

Any other exception is logged with its traceback and answered with INTERNAL; in every case the server keeps
serving. Handlers run on the server's worker threads (up to `max_concurrent_streams` at once), so they must
be thread-safe, and a slow handler holds a stream slot for as long as it runs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from tasklet.peer.net.allocator import keep_freed_buffers
from tasklet.peer.net.bulk_server import BulkListener
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.counters import TRAFFIC
from tasklet.peer.net.front import GrpcFront
from tasklet.peer.net.idle import IdleWatch
from tasklet.peer.net.limits import ConnectionCap
from tasklet.peer.net.shaping import LinkShaper, take_in
from tasklet.peer.net.statuses import SlotRefusedError, error_of_status, refusal_of
from tasklet.peer.net.waiting import RoomFullError, WaitingRoom
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import (
    ChunkView,
    Reassembler,
    check_version,
    chunk_payload_sizes,
    decode_chunk,
    envelope_kind_prefix,
    iter_segment_chunks,
)
from tasklet.protocol.errors import BadMessage, PeerUnreachable, Rejected
from tasklet.protocol.message import WireEnvelope, envelope_segments

logger = logging.getLogger(__name__)

PushHandler = Callable[[WireEnvelope], None]
FetchHandler = Callable[[pb.FetchRequest], pb.Envelope | WireEnvelope]
Segment = bytes | memoryview
StatusProvider = Callable[[], dict[str, Any]]
ReplyShaperLookup = Callable[[str], LinkShaper | None]
PushAdmission = Callable[[int, str], int]
R = TypeVar("R")
# A deadline further away than this (a day) counts as none: every peer call must be bounded.
MAX_DEADLINE_S = 86_400.0


def kind_value(kind: int | str) -> int:
    """A Kind given as its enum value or its name ("ACTIVATION")."""
    if isinstance(kind, str):
        return pb.Kind.Value(kind)
    pb.Kind.Name(kind)  # raises ValueError for an unknown value
    return kind


def _kind_name(kind: int) -> str:
    try:
        return pb.Kind.Name(kind)
    except ValueError:
        return str(kind)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    if code is not grpc.StatusCode.CANCELLED:  # CANCELLED: the caller went away, nothing was refused
        TRAFFIC.refused(code.name)
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _guarded(context: grpc.ServicerContext, what: str, fn: Callable[[], R]) -> R:
    """Run fn, turning the protocol's typed errors into gRPC statuses (see module docstring)."""
    try:
        return fn()
    except SlotRefusedError as exc:
        _abort(context, exc.code, str(exc))
    except grpc.RpcError:
        # The client went away (cancelled, deadline passed) while we were reading its stream.
        _abort(context, grpc.StatusCode.CANCELLED, f"{what}: the call ended before the message was complete")
    except Exception as exc:
        _abort(context, *refusal_of(what, exc))


SERVICE = pb.DESCRIPTOR.services_by_name["Peer"].full_name


class _Servicer:
    """The gRPC side of PeerServer (the methods of service Peer); all state lives in the PeerServer.

    Push requests and Fetch replies travel as raw bytes and are (de)serialized by protocol.chunking's
    copy-avoiding Chunk codec; the other calls use the generated message classes.
    """

    def __init__(self, owner: PeerServer) -> None:
        self._owner = owner

    def _require_deadline(self, context: grpc.ServicerContext, what: str) -> str:
        """Refuse a call without a deadline or with one beyond max_deadline_s; return the caller's peer id."""
        # gRPC reports a call without deadline as one due in the far future (or None in some versions).
        remaining = context.time_remaining()
        if remaining is None or remaining > MAX_DEADLINE_S:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{what}: calls without a deadline are refused")
        limit = self._owner.config.max_deadline_s
        if remaining > limit + 1.0:
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: a deadline of {remaining:.0f} s exceeds this peer's limit of {limit:.0f} s",
            )
        return self._caller(context, what)

    def _caller(self, context: grpc.ServicerContext, what: str) -> str:
        """The authenticated peer id of the caller (mutual TLS), checked on every call: a peer that left the
        trust set is refused on a connection it opened before. Plaintext servers (benchmarks) return ""."""
        tls = self._owner.config.tls
        if tls is None:
            return ""
        caller = tls.caller(context)
        if caller is None:
            _abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{what}: the caller's certificate is not trusted here (no live advert or assignment names it)",
            )
        return caller

    def _stream_slot(self, context: grpc.ServicerContext, what: str, caller: str = "") -> None:
        """Take a stream slot, and one of the caller's own quota (release with ``_owner._release``)."""
        refusal = self._owner._take_stream_slot(what, caller)
        if refusal is not None:
            _abort(context, *refusal)

    def _wait_for_first_chunk(self, context: grpc.ServicerContext, what: str, caller: str) -> tuple[WaitingRoom, int]:
        """A place among the streams waiting for their first chunk (peer.net.waiting), or the call refused."""
        room = self._owner._waiting_room
        try:
            return room, room.enter(caller, context)
        except RoomFullError as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.per_caller else grpc.StatusCode.UNAVAILABLE
            _abort(context, code, f"{what}: {exc}")

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.Ack:  # noqa: N802
        caller = self._require_deadline(context, "Push")
        owner = self._owner
        room, place = self._wait_for_first_chunk(context, "Push", caller)
        held: list[bool] = []

        def admitted() -> None:  # the first chunk's Kind is admitted from this caller: now a stream slot
            room.leave(place)
            owner._admit_stream("Push", caller)
            held.append(True)

        idle = owner._idle
        token = idle.watch(context)
        try:
            chunks = _decoded(idle.moving(token, request_iterator))
            return _guarded(context, "Push", lambda: owner._deliver(chunks, caller, admitted))
        finally:
            idle.done(token)
            room.leave(place)
            if held:
                owner._release(caller)

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        caller = self._require_deadline(context, "Fetch")
        if self._owner.config.tls is not None:
            request.sender = caller  # the authenticated caller, never what the request claims
        self._stream_slot(context, "Fetch", caller)
        idle, token = self._owner._idle, -1
        try:
            segments, total = _guarded(context, "Fetch", lambda: self._owner._fetch(request))
            shaper = self._owner._reply_shaper(request.sender)
            chunk_bytes = self._owner.config.chunk_bytes
            token = idle.watch(context)  # from here on the caller's reading is what moves the stream
            if shaper is None:
                yield from idle.moving(token, iter_segment_chunks(segments, chunk_bytes))
            else:
                chunk_bytes = shaper.chunk_bytes(chunk_bytes)
                sizes = chunk_payload_sizes(total, chunk_bytes)
                chunks = iter_segment_chunks(segments, chunk_bytes)
                yield from idle.moving(token, shaper.shape(chunks, lambda _: next(sizes), total_bytes=total))
        finally:
            idle.done(token)
            self._owner._release(caller)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingReply:  # noqa: N802
        caller = self._require_deadline(context, "Ping")
        if self._owner.config.tls is not None:
            request.sender = caller
        _guarded(context, "Ping", lambda: check_version("ping.protocol_version", request.protocol_version))
        shaper = self._owner._reply_shaper(request.sender)
        if shaper is not None:
            shaper.wait_delay(shaper.now())
        return pb.PingReply(protocol_version=PROTOCOL_VERSION, echo_sent_ns=request.sent_ns)

    def Probe(  # noqa: N802
        self, request_iterator: Iterator[pb.ProbeChunk], context: grpc.ServicerContext
    ) -> pb.ProbeReply:
        caller = self._require_deadline(context, "Probe")
        owner = self._owner
        room, place = self._wait_for_first_chunk(context, "Probe", caller)
        held: list[bool] = []

        def slotted(chunks: Iterator[pb.ProbeChunk]) -> Iterator[pb.ProbeChunk]:  # a slot from the first chunk
            for chunk in chunks:
                if not held:
                    room.leave(place)
                    owner._admit_stream("Probe", caller)
                    held.append(True)
                yield chunk

        idle = owner._idle
        token = idle.watch(context)
        try:
            return _guarded(context, "Probe", lambda: owner._probe(slotted(idle.moving(token, request_iterator))))
        finally:
            idle.done(token)
            room.leave(place)
            if held:
                owner._release(caller)

    def BulkLane(self, request: pb.BulkLaneRequest, context: grpc.ServicerContext) -> pb.BulkLaneReply:  # noqa: N802
        self._require_deadline(context, "BulkLane")
        _guarded(context, "BulkLane", lambda: check_version("bulk_lane.protocol_version", request.protocol_version))
        return pb.BulkLaneReply(protocol_version=PROTOCOL_VERSION, port=self._owner.bulk_port)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:  # noqa: N802
        self._require_deadline(context, "Status")
        _guarded(context, "Status", lambda: check_version("status.protocol_version", request.protocol_version))
        return pb.StatusReply(protocol_version=PROTOCOL_VERSION, json=_guarded(context, "Status", self._owner._status))


def _method_handlers(servicer: _Servicer) -> dict[str, grpc.RpcMethodHandler]:
    """Method table of service Peer. A None (de)serializer passes raw bytes through."""
    return {
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None, response_serializer=pb.Ack.SerializeToString
        ),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch, request_deserializer=pb.FetchRequest.FromString, response_serializer=None
        ),
        "Ping": grpc.unary_unary_rpc_method_handler(
            servicer.Ping,
            request_deserializer=pb.PingRequest.FromString,
            response_serializer=pb.PingReply.SerializeToString,
        ),
        "Probe": grpc.stream_unary_rpc_method_handler(
            servicer.Probe,
            request_deserializer=pb.ProbeChunk.FromString,
            response_serializer=pb.ProbeReply.SerializeToString,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusReply.SerializeToString,
        ),
        "BulkLane": grpc.unary_unary_rpc_method_handler(
            servicer.BulkLane,
            request_deserializer=pb.BulkLaneRequest.FromString,
            response_serializer=pb.BulkLaneReply.SerializeToString,
        ),
    }


def _decoded(raws: Iterator[bytes]) -> Iterator[ChunkView]:
    """The chunks of a gRPC push, parsed without copying; each message's bytes are let go before the next."""
    for raw in raws:
        chunk = decode_chunk(raw)
        del raw
        yield chunk
        del chunk


def service_name(route: str = "") -> str:
    """The gRPC service path of a route: the peer's own service, or a server mounted under ``route``."""
    return f"{SERVICE}.{route}" if route else SERVICE


class _Router(grpc.GenericRpcHandler):
    """Dispatches "/tasklet.Peer/<Method>" to the host server and "/tasklet.Peer.<route>/<Method>" to a server
    mounted on it (the coordinator on the leader's worker server), so one port serves both. Routes are looked
    up per call, so a server can be mounted after the host started."""

    def __init__(self, owner: PeerServer) -> None:
        self._owner = owner

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        path = handler_call_details.method or ""
        service, _, method = path.lstrip("/").partition("/")
        if service == SERVICE:
            return self._owner._handlers.get(method)
        if not service.startswith(SERVICE + "."):
            return None
        mounted = self._owner._mounts.get(service[len(SERVICE) + 1 :])
        return None if mounted is None else mounted._handlers.get(method)


class PeerServer:
    """A peer's gRPC server. Register handlers, then `start()`; `stop()` when done (or use `with`).

    Handlers run on server threads (see the module docstring for the errors they may raise).
    """

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config or TransportConfig()
        self._push_handlers: dict[int, PushHandler] = {}
        self._fetch_handlers: dict[int, FetchHandler] = {}
        self._status_provider: StatusProvider | None = None
        self._reply_shapers: ReplyShaperLookup | None = None
        self._streams = threading.BoundedSemaphore(self.config.max_concurrent_streams)
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.port: int | None = None
        self.stats = {"pushes": 0, "push_bytes": 0, "fetches": 0, "probes": 0}
        self._per_peer: dict[str, int] = {}  # _lock: stream slots held per authenticated caller
        self._push_admission: PushAdmission | None = None
        self._handlers = _method_handlers(_Servicer(self))
        self._mounts: dict[str, PeerServer] = {}  # route -> server whose calls this one's port carries
        self._reserved_threads = 0
        self._idle = IdleWatch(self.config.stream_idle_s)  # streams whose bytes stopped moving are cancelled
        # streams before their first chunk: each holds a server thread, so the pool has as many more threads
        self._room = WaitingRoom(self.config.max_concurrent_streams, self.config.streams_per_peer)
        self.route = ""  # set when this server is mounted on another one
        self._host: PeerServer | None = None
        self._front: GrpcFront | None = None  # the port's front door (peer.net.front), while started
        self._lane: BulkListener | None = None
        self._local: ThreadPoolExecutor | None = None  # this process's calls to itself (peer.net.local), while started

    # --- registration -------------------------------------------------------------------------------------
    def register_push(self, kind: int | str, handler: PushHandler) -> None:
        """Call handler(envelope) for every valid pushed Envelope of this Kind (replaces a previous one); the
        envelope is a protocol.message.WireEnvelope, read like a pb.Envelope."""
        with self._lock:
            self._push_handlers[kind_value(kind)] = handler

    def register_fetch(self, kind: int | str, handler: FetchHandler) -> None:
        """Answer Fetch requests of this Kind with handler(request) -> pb.Envelope, or a WireEnvelope (its
        tensors' data sent from their own buffers, see protocol.message)."""
        with self._lock:
            self._fetch_handlers[kind_value(kind)] = handler

    def set_status_provider(self, provider: StatusProvider) -> None:
        """provider() -> JSON-serialisable dict, returned by the Status call."""
        self._status_provider = provider

    def set_reply_shaper(self, lookup: ReplyShaperLookup) -> None:
        """lookup(sender peer id) -> the LinkShaper of the link from this peer back to the sender, or None.

        Applied to what this server sends back: Fetch streams (bandwidth and delay) and Ping replies (delay),
        so that a fetched stage state and a measured RTT see both directions of the emulated link. Push acks
        are not delayed: a pusher learns of delivery after one way plus transmission time.
        """
        self._reply_shapers = lookup

    # --- mounting -----------------------------------------------------------------------------------------
    def reserve_threads(self, n: int) -> None:
        """Add ``n`` threads to the pool (before ``start``) for the calls of servers mounted later."""
        if self._server is not None:
            raise RuntimeError("reserve threads before start()")
        self._reserved_threads += max(0, n)

    def mount(self, route: str, other: PeerServer) -> None:
        """Serve ``other``'s calls on this server's port under ``route`` (its own limits and handlers apply;
        its calls run on this server's threads). ``other`` is never started itself; its endpoint is this
        server's with "/route" appended."""
        if not route or not route.isidentifier():
            raise ValueError(f"route must be an identifier, got {route!r}")
        if other._server is not None:
            raise RuntimeError("a started server cannot be mounted")
        other._mounted(route, self)
        with self._lock:
            self._mounts[route] = other

    def unmount(self, route: str) -> None:
        with self._lock:
            other = self._mounts.pop(route, None)
        if other is not None:
            other._mounted(other.route, None)

    def _mounted(self, route: str, host: PeerServer | None) -> None:
        """This server is served on ``host``'s port under ``route`` (None: no longer)."""
        self.route, self._host = route, host

    def set_push_admission(self, admit: PushAdmission) -> None:
        """admit(kind, caller peer id) -> the largest Envelope of that Kind this caller may push now (capped by
        max_envelope_bytes), or raise Forbidden when the caller has no role for it. Asked on the first chunk,
        before anything is buffered: a peer without a role makes this one hold nothing. E.g. a worker derives an
        activation's bound from its run's model and admits it only from its upstream neighbour."""
        self._push_admission = admit

    @property
    def _waiting_room(self) -> WaitingRoom:
        """The host's room when mounted: a mounted server's calls wait on the host's threads."""
        return self._room if self._host is None else self._host._waiting_room

    def _admit_stream(self, what: str, caller: str) -> None:
        """Take a stream slot for an admitted stream (release with ``_release``), or raise SlotRefusedError."""
        refusal = self._take_stream_slot(what, caller)
        if refusal is not None:
            raise SlotRefusedError(*refusal)

    def _take_stream_slot(self, what: str, caller: str) -> tuple[grpc.StatusCode, str] | None:
        """Take a stream slot and one of the caller's own quota (release with ``_release``); the refusal if none."""
        if not self._streams.acquire(blocking=False):
            return (
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: busy, {self.config.max_concurrent_streams} streams already in progress",
            )
        with self._lock:
            held = self._per_peer.get(caller, 0)
            if held < self.config.streams_per_peer:
                self._per_peer[caller] = held + 1
                return None
        self._streams.release()
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{what}: {held} streams of this peer already in progress (its quota is {self.config.streams_per_peer})",
        )

    @property
    def bulk_port(self) -> int:
        """The port of this server's bulk lane (peer.net.bulk_server), 0 when it has none (or is mounted)."""
        return 0 if self._lane is None else self._lane.port

    def _release(self, caller: str) -> None:
        with self._lock:
            left = self._per_peer.get(caller, 0) - 1
            if left > 0:
                self._per_peer[caller] = left
            else:
                self._per_peer.pop(caller, None)
        self._streams.release()

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        if self._host is not None:
            return f"{self._host.endpoint}/{self.route}"
        if self.port is None:
            raise RuntimeError("the server is not started")
        return f"{self.config.host}:{self.port}"

    def start(self) -> int:
        """Bind and start serving; return the port (the OS picks one when config.port is 0)."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        if self._host is not None:
            raise RuntimeError(f"this server is mounted on {self._host.endpoint}; it is not started itself")
        keep_freed_buffers()  # received chunks reuse memory instead of faulting in fresh pages (peer.net.allocator)
        threads = self.config.thread_pool_size + self._reserved_threads + self._room.total
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="peer-rpc")
        server = grpc.server(self._executor, options=self.config.grpc_options)
        server.add_generic_rpc_handlers((_Router(self),))
        front = GrpcFront(ConnectionCap(self.config.connection_cap, self.config.connections_per_source)) \
            if self.config.front else None
        address = f"{self.config.host}:{self.config.port}" if front is None else front.inner_address
        try:
            if self.config.tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, self.config.tls.server_credentials())
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            port = 0
        if port == 0:
            self._executor.shutdown(wait=False)
            if front is not None:
                front.stop()
            raise OSError(f"cannot listen on {address}")
        if front is not None:
            try:
                port = front.start(self.config.host, self.config.port)
            except OSError as exc:
                server.stop(None)
                self._executor.shutdown(wait=False)
                front.stop()
                raise OSError(f"cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
        self._front = front
        if self.config.bulk_port is not None:
            lane = BulkListener(self)
            try:
                lane.start(self.config.host, self.config.bulk_port)
            except OSError as exc:
                server.stop(None)
                self._executor.shutdown(wait=False)
                if front is not None:
                    front.stop()
                where = f"{self.config.host}:{self.config.bulk_port}"
                raise OSError(f"cannot listen on {where} (bulk lane): {exc}") from exc
            self._lane = lane
        server.start()
        self._idle.start()
        self._local = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="peer-local")
        self._server, self.port = server, port
        logger.info("peer server listening on %s (bulk lane on port %d)", self.endpoint, self.bulk_port)
        return port

    def set_members(self, hosts: list[str]) -> None:
        """The hosts of the swarm's live members: the gRPC port and the bulk lane keep most of their connections
        for them (peer.net.limits.ConnectionCap), whatever strangers hold."""
        front, lane = self._front, self._lane
        if front is not None:
            front.cap.set_members(hosts)
        if lane is not None:
            lane.cap.set_members(hosts)

    def stop(self, grace: float = 1.0) -> None:
        """Stop accepting calls, give running ones `grace` seconds, then cancel them and release the threads.

        Bounded: a handler still running after that (stuck in its own code) is not waited for; its thread
        ends when the handler returns.
        """
        if self._host is not None:
            self._host.unmount(self.route)
            return
        server, self._server = self._server, None
        if server is None:
            return
        lane, self._lane = self._lane, None
        self._idle.close()
        stopped = server.stop(grace)  # both paths get the same grace, side by side
        if lane is not None:
            lane.stop(grace)
        if not stopped.wait(timeout=grace + 5.0):
            logger.warning("peer server on port %s: calls still running %.1f s after stop", self.port, grace + 5)
        front, self._front = self._front, None
        if front is not None:
            front.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        local, self._local = self._local, None
        if local is not None:
            local.shutdown(wait=False, cancel_futures=True)
        logger.info("peer server on port %s stopped", self.port)

    def __enter__(self) -> PeerServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- call bodies (run on server threads) --------------------------------------------------------------
    # --- calls from this process to itself (peer.net.local) ---------------------------------------------------
    def mounted_at(self, route: str) -> PeerServer | None:
        """The server mounted under ``route`` on this one, if any."""
        with self._lock:
            return self._mounts.get(route)

    def _run_local(self, what: str, fn: Callable[[], R]) -> Future[R]:
        """``fn`` on the threads kept for this process's calls to itself (the host's, when mounted)."""
        pool = self._local if self._host is None else self._host._local
        try:
            if pool is None:
                raise RuntimeError("not started")
            return pool.submit(fn)
        except RuntimeError:  # never started, or stopped (its pool shut down) since
            where = self.endpoint if self.port or self._host else "local"
            raise PeerUnreachable(where, f"{what}: not serving") from None

    def push_local(self, envelope: pb.Envelope | WireEnvelope, caller: str) -> Future[None]:
        """Deliver a push of this process to itself: serialised and checked as a gRPC push is, from the first
        chunk's admission and a stream slot of ``caller``'s quota to the handler, on threads of its own; the
        Future fails with the Refused or PeerUnreachable the gRPC path would give."""
        def run() -> None:
            held: list[bool] = []

            def admitted() -> None:
                self._admit_stream("Push", caller)
                held.append(True)

            raws = iter_segment_chunks(envelope_segments(envelope), self.config.chunk_bytes)
            try:
                self._deliver(_decoded(raws), caller, admitted, metered=False)
            except Exception as exc:
                raise self._local_refusal("Push", exc) from None
            finally:
                if held:
                    self._release(caller)

        return self._run_local("Push", run)

    def fetch_local(self, request: pb.FetchRequest, caller: str) -> Future[tuple[list[Segment], int]]:
        """Answer a fetch of this process from itself: a stream slot of ``caller``'s quota, then the handler, on
        threads of its own; the Future holds the reply's pieces (as :meth:`_fetch` gives them) or fails with the
        Refused or PeerUnreachable the gRPC path would give."""
        if self.config.tls is not None:
            request.sender = caller  # the authenticated caller, as on the gRPC path

        def run() -> tuple[list[Segment], int]:
            refusal = self._take_stream_slot("Fetch", caller)
            if refusal is not None:
                raise self._local_refusal("Fetch", SlotRefusedError(*refusal))
            try:
                return self._fetch(request)
            except Exception as exc:
                raise self._local_refusal("Fetch", exc) from None
            finally:
                self._release(caller)

        return self._run_local("Fetch", run)

    def _local_refusal(self, what: str, exc: Exception) -> Exception:
        code, detail = refusal_of(what, exc)
        if code is not grpc.StatusCode.CANCELLED:
            TRAFFIC.refused(code.name)
        return error_of_status(code, detail, self.endpoint)

    def _deliver(self, chunks: Iterator[ChunkView], caller: str = "",
                 admitted: Callable[[], None] | None = None, metered: bool = True) -> pb.Ack:
        """Check, reassemble and hand over one pushed Envelope (chunks from gRPC or from the bulk lane).
        ``admitted()`` is called once the first chunk's Kind is admitted from ``caller`` (gRPC takes the
        stream's slot there; the bulk lane took it from the request's head). ``metered``: the bytes count
        against the owner's download cap (not for a call of this process to itself)."""
        asm: Reassembler | None = None
        announced = pb.KIND_UNSPECIFIED
        for chunk in chunks:
            if asm is None:
                announced = envelope_kind_prefix(chunk.payload)
                limit = self.config.max_envelope_bytes
                if self._push_admission is not None:
                    limit = min(limit, self._push_admission(announced, caller))
                if limit <= 0:
                    raise Rejected(f"envelope.kind: this peer takes no {_kind_name(announced)} messages now")
                asm = Reassembler(limit, what=_kind_name(announced))
                if admitted is not None:
                    admitted()
            asm.add(chunk)
            if metered:
                take_in(len(chunk.payload))  # the owner's download cap: the next chunk is read when it allows
            del chunk  # its bytes are read: free them before the next chunk arrives (memory reused)
        if asm is None:
            raise BadMessage("chunk", "the stream carried no chunk")
        envelope = asm.message()
        if envelope.kind != announced:
            raise BadMessage("envelope.kind", "the kind must be the envelope's first field after the version")
        if self.config.tls is not None:
            envelope.sender = caller  # the authenticated caller, never what the envelope claims
        TRAFFIC.received(_kind_name(envelope.kind), asm.total)
        handler = self._push_handlers.get(envelope.kind)
        if handler is None:
            raise Rejected(f"envelope.kind: this peer takes no {_kind_name(envelope.kind)} messages")
        handler(envelope)
        with self._lock:
            self.stats["pushes"] += 1
            self.stats["push_bytes"] += asm.total
        return pb.Ack(protocol_version=PROTOCOL_VERSION, bytes_received=asm.total)

    def _fetch(self, request: pb.FetchRequest) -> tuple[list[Segment], int]:
        """The reply's serialized form (as pieces, tensors' data not copied) and its size."""
        check_version("fetch.protocol_version", request.protocol_version)
        handler = self._fetch_handlers.get(request.kind)
        if handler is None:
            raise Rejected(f"fetch.kind: this peer serves no {_kind_name(request.kind)} fetches")
        envelope = handler(request)
        if envelope.protocol_version == 0:
            envelope.protocol_version = PROTOCOL_VERSION
        segments = envelope_segments(envelope)
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in segments)
        TRAFFIC.sent(_kind_name(envelope.kind), total)
        with self._lock:
            self.stats["fetches"] += 1
        return segments, total

    def _probe(self, chunks: Iterator[pb.ProbeChunk]) -> pb.ProbeReply:
        reply = pb.ProbeReply(protocol_version=PROTOCOL_VERSION)
        for chunk in chunks:
            now = time.monotonic_ns()
            check_version("probe.protocol_version", chunk.protocol_version)
            size = len(chunk.payload)
            if reply.bytes_received + size > self.config.max_envelope_bytes:
                raise BadMessage(
                    "probe.payload",
                    f"probe longer than this peer's limit of {self.config.max_envelope_bytes}",
                )
            if reply.bytes_received == 0 and reply.first_recv_ns == 0:
                reply.first_recv_ns = now
                reply.first_chunk_bytes = size
            reply.last_recv_ns = now
            reply.bytes_received += size
            take_in(size)  # a probe measures the link as the download cap lets it be used
        TRAFFIC.received("PROBE", reply.bytes_received)
        with self._lock:
            self.stats["probes"] += 1
        return reply

    def _status(self) -> str:
        status: dict[str, Any] = {"protocol_version": PROTOCOL_VERSION, "transport": dict(self.stats)}
        if self._status_provider is not None:
            status.update(self._status_provider())
        return json.dumps(status, default=str)

    def _reply_shaper(self, sender: str) -> LinkShaper | None:
        lookup = self._reply_shapers
        return None if lookup is None or not sender else lookup(sender)
