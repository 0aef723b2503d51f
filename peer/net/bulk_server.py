"""A peer's bulk lane, server side: large pushes over a TCP (mutual-TLS) socket, checked by the gRPC server's code.

Why and the wire format: peer.net.bulk_wire. What stays the same as a gRPC push, in the same order and mostly the
same code (peer.net.server): the caller is authenticated by its certificate (mutual TLS, peer.net.tls) and must be
trusted *at each request*, not only at the handshake; the request must carry a deadline of at most
``max_deadline_s`` and is cut off when it passes; it takes one of the server's stream slots and one of its caller's
quota once its first chunk's Kind is admitted from the caller (a caller without a role for it never holds one),
refused with UNAVAILABLE / RESOURCE_EXHAUSTED as on gRPC; ``PeerServer._deliver`` reads it: protocol
version, the Kind's limit and the caller's admission from the first bytes (before anything is buffered), exactly
the announced bytes, an Envelope of our version, a handler for its Kind; the handler's typed errors become the
same status codes. A refusal is answered, then the connection is closed.

What a stranger can make the lane hold: at most ``max_connections`` connections, ``max_per_source`` of them (3/4)
from one network, and once the lane knows the members' addresses (``set_members``) a quarter of them from all
strangers together (``peer.net.limits.ConnectionCap``, as at the gRPC port; a connection over a cap is closed at
once, before its handshake), each given
``HANDSHAKE_TIMEOUT_S`` for its whole TLS handshake (one deadline however slowly the bytes come: Python's ssl
times the whole call) and ``IDLE_TIMEOUT_S`` between requests; one thread per connection; a request's memory is
what its checked bytes need, as on gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
import numpy as np

from tasklet.peer.net.bulk_wire import HEAD, HEAD_MAGIC, LaneClosedError, encode_reply, recv_exact
from tasklet.peer.net.config import HANDSHAKE_TIMEOUT_S, SOURCE_SHARE, TransportConfig
from tasklet.peer.net.counters import TRAFFIC
from tasklet.peer.net.limits import ConnectionCap, network_of
from tasklet.peer.net.statuses import refusal_of
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import ChunkView, check_version
from tasklet.protocol.errors import BadMessage

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 300.0  # between requests on an open connection (clients drop theirs sooner, see bulk_client)
FIRST_PIECE_BYTES = 64 << 10  # read before the Kind's limit and the caller's admission are asked
DRAIN_S = 1.0  # after a refusal: read (and drop) what the client still sends, so that it reads our reply
REPLY_TIMEOUT_S = 5.0


class _Refusal(Exception):  # noqa: N818 - a control-flow signal, not an error of the API
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LaneOwner(Protocol):
    """What the lane uses of its PeerServer (peer.net.server): its limits, its stream slots and its push path."""

    config: TransportConfig

    def _admit_stream(self, what: str, caller: str) -> None: ...

    def _release(self, caller: str) -> None: ...

    def _deliver(self, chunks: Iterator[ChunkView], caller: str = "",
                 admitted: Callable[[], None] | None = None) -> pb.Ack: ...


class _Cut(Exception):  # noqa: N818 - a control-flow signal
    """The request did not arrive whole (the connection ended, or its deadline passed): nothing to answer."""


class BulkListener:
    """Accepts bulk-lane connections for ``owner`` (a PeerServer) and delivers their pushes through its checks."""

    def __init__(self, owner: LaneOwner) -> None:
        self._owner = owner
        config = owner.config
        self.max_connections = 2 * config.max_concurrent_streams
        self.max_per_source = max(2, int(self.max_connections * SOURCE_SHARE))
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, socket.socket] = {}  # accepted socket -> what serves it (TLS-wrapped)
        self._sources: dict[socket.socket, str] = {}  # _lock: accepted socket -> its source address
        self.cap = ConnectionCap(self.max_connections, self.max_per_source)  # per network, members apart
        self._busy: set[socket.socket] = set()  # accepted sockets with a request in progress
        self._idle = threading.Condition(self._lock)  # notified when a request ends
        self._stopped = threading.Event()
        self.port = 0

    def start(self, host: str, port: int) -> int:
        sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self._sock, self.port = sock, sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"bulk-accept-{self.port}", daemon=True).start()
        return self.port

    def stop(self, grace: float = 1.0) -> None:
        """Accept nothing more and close idle connections at once; a request in progress gets ``grace`` seconds
        to be answered (as gRPC's own stop gives its calls), then its connection is cut too."""
        self._stopped.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            sock.close()
        with self._lock:
            idle = [raw for raw in self._conns if raw not in self._busy]
            _cut([self._conns.pop(raw) for raw in idle])
            end = time.monotonic() + grace
            while self._busy and (left := end - time.monotonic()) > 0:
                self._idle.wait(left)
            conns, self._conns = list(self._conns.values()), {}
            self._busy.clear()
        _cut(conns)

    # --- connections --------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            sock = self._sock
            if sock is None:
                return
            try:
                conn, addr = sock.accept()
            except OSError:
                return  # closed by stop()
            source = str(addr[0])
            with self._lock:
                full = not self.cap.admit(source)
                if not full:
                    self._conns[conn] = conn
                    self._sources[conn] = source
            if full:
                TRAFFIC.refused("UNAVAILABLE")
                logger.info("bulk lane: connection cap reached (%d in all, %d per source), one more from %s closed",
                            self.max_connections, self.max_per_source, network_of(source))
                _close(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="bulk-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse this connection, keep serving
                with self._lock:
                    self._conns.pop(conn, None)
                    self._forget_source(conn)
                _close(conn)

    def _forget_source(self, raw: socket.socket) -> None:
        """Give back ``raw``'s place in its source's count (call under ``_lock``)."""
        source = self._sources.pop(raw, None)
        if source is not None:
            self.cap.release(source)

    def _serve(self, raw: socket.socket) -> None:
        conn: socket.socket = raw
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self._owner.config.tls
            if tls is not None:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                with self._lock:  # a stop() from now on must reach the wrapped socket (it took over the fd)
                    if raw not in self._conns:
                        return
                    conn = self._conns[raw] = tls.ssl_server_context().wrap_socket(
                        raw, server_side=True, do_handshake_on_connect=False
                    )
                conn.do_handshake()
            while not self._stopped.is_set() and self._serve_one(raw, conn):
                pass
        except (OSError, LaneClosedError, ssl.SSLError) as exc:
            logger.debug("bulk lane connection ended: %s", exc)
        except Exception:
            logger.exception("bulk lane: connection failed")
        finally:
            with self._lock:
                self._conns.pop(raw, None)
                self._forget_source(raw)
                self._busy.discard(raw)
                self._idle.notify_all()
            _close(conn)

    def _caller(self, conn: socket.socket) -> str:
        tls = self._owner.config.tls
        if tls is None:
            return ""  # plaintext lanes (benchmark baselines) are unauthenticated, as plaintext gRPC
        assert isinstance(conn, ssl.SSLSocket)
        caller = tls.peer_of_socket(conn)
        if caller is None:
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                "Push: the caller's certificate is not trusted here (no live advert or assignment names it)",
            )
        return caller

    def _serve_one(self, raw: socket.socket, conn: socket.socket) -> bool:
        """Serve one request; True when the connection stays open for the next."""
        head = bytearray(HEAD.size)
        conn.settimeout(IDLE_TIMEOUT_S)
        try:
            recv_exact(conn, memoryview(head)[:1])
        except LaneClosedError:
            return False  # the client closed an idle connection
        with self._lock:
            if raw not in self._conns:
                return False  # stop() closed it as idle
            self._busy.add(raw)
        try:
            return self._serve_request(conn, head)
        finally:
            with self._lock:
                self._busy.discard(raw)
                self._idle.notify_all()

    def _serve_request(self, conn: socket.socket, head: bytearray) -> bool:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        recv_exact(conn, memoryview(head)[1:])
        magic, version, deadline_ms, total = HEAD.unpack(head)
        owner, caller, slot = self._owner, "", False
        try:
            if magic != HEAD_MAGIC:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "Push: not a bulk-lane request")
            if self._stopped.is_set():
                raise _Refusal(grpc.StatusCode.UNAVAILABLE, "Push: this peer's server is stopping")
            caller = self._caller(conn)
            deadline = time.monotonic() + self._check_deadline(deadline_ms)
            try:
                check_version("chunk.protocol_version", version)
            except BadMessage as exc:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

            def admitted() -> None:  # the first chunk's Kind is admitted from this caller: now a stream slot
                nonlocal slot
                owner._admit_stream("Push", caller)
                slot = True

            try:
                ack = owner._deliver(self._pieces(conn, version, total, deadline), caller, admitted)
            except _Cut as exc:
                logger.info("bulk push from %s cut off: %s", caller or "a plaintext client", exc.__cause__)
                return False
            except Exception as exc:
                raise _Refusal(*refusal_of("Push", exc)) from None
        except _Refusal as refusal:
            if slot:
                owner._release(caller)
                slot = False
            self._refuse(conn, refusal.code, str(refusal))
            return False
        finally:
            if slot:
                owner._release(caller)
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.sendall(encode_reply(grpc.StatusCode.OK, ack.bytes_received))
        return True

    def _check_deadline(self, deadline_ms: int) -> float:
        """The request's deadline in seconds, refused as gRPC refuses one (peer.net.server)."""
        if deadline_ms == 0:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "Push: calls without a deadline are refused")
        seconds, limit = deadline_ms / 1000, self._owner.config.max_deadline_s
        if seconds > limit + 1.0:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Push: a deadline of {seconds:.0f} s exceeds this peer's limit of {limit:.0f} s",
            )
        return seconds

    def _pieces(self, conn: socket.socket, version: int, total: int, deadline: float) -> Iterator[ChunkView]:
        """The request's bytes as the chunks a gRPC push would bring (each a fresh buffer: the reader may keep it),
        the first one small so that the limits are asked before much is read."""
        chunk_bytes = self._owner.config.chunk_bytes
        seq, got = 0, 0
        while True:
            size = min(total - got, FIRST_PIECE_BYTES if seq == 0 else chunk_bytes)
            piece = np.empty(size, np.uint8)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError("the request's deadline passed before it arrived whole")
                conn.settimeout(left)
                recv_exact(conn, memoryview(piece))
            except OSError as exc:  # LaneClosedError and timeouts included
                raise _Cut() from exc
            got += size
            yield ChunkView(version, total, seq, memoryview(piece))
            del piece
            seq += 1
            if got >= total:
                return

    def _refuse(self, conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        """Answer a refusal, then let the client finish what it was sending (dropped) so that it reads it."""
        TRAFFIC.refused(code.name)
        logger.info("bulk push refused (%s): %s", code.name, message)
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.sendall(encode_reply(code, 0, message))
            end = time.monotonic() + DRAIN_S
            sink = bytearray(64 << 10)
            while (left := end - time.monotonic()) > 0:
                conn.settimeout(left)
                if not conn.recv_into(sink):
                    break
        except (OSError, ssl.SSLError):
            pass


def _cut(conns: list[socket.socket]) -> None:
    """Wake the threads blocked reading ``conns`` (close alone does not), then close them."""
    for conn in conns:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(conn, socket.SHUT_RDWR)  # the socket's own, not TLS's close_notify
        _close(conn)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
