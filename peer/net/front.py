"""The gRPC port's front door: per-source and total connection caps in front of gRPC.

grpcio offers one connection cap for a whole port (``grpc.max_allowed_incoming_connections``) and no hook
between accept and its TLS handshake, so one address could hold every connection the port allows. The front
listens on the public port itself, admits each connection through a :class:`~peer.net.limits.ConnectionCap`
(per source address and in total) before reading a byte, and splices the admitted ones byte for byte to the
gRPC server listening on a private Unix socket. TLS still ends in gRPC (the front sees only ciphertext), so the
caller's certificate, gRPC's handshake deadline and every check of peer.net.server stay as they were; a
connection gRPC closes (handshake timeout, cap, stop) is closed outside too.

Cost: one event-loop thread per server and three descriptors per admitted connection (outside, inside, and
gRPC's end), which the caps are derived from (peer.net.config). Bytes are copied once more in user space;
large pushes go through the bulk lane beside gRPC and do not pass here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time

from tasklet.peer.net.limits import ConnectionCap

logger = logging.getLogger(__name__)

HIGH_WATER_BYTES = 1 << 20  # bytes one direction may hold in the front before its sender is paused
START_TIMEOUT_S = 10.0
REFUSAL_LOG_S = 10.0  # refusals are logged at most this often (a flood would otherwise cost a log line each)
DRAIN_S = 1.0  # on stop, connections may finish forwarding what gRPC already answered for at most this long


class _End(asyncio.Protocol):
    """One side of a spliced connection; ``other`` is the side its bytes go to."""

    def __init__(self, front: GrpcFront, source: str = "") -> None:
        self.front, self.source = front, source
        self.transport: asyncio.Transport | None = None
        self.other: _End | None = None
        self.early: list[bytes] = []  # bytes that came before the two sides were linked (a few frames at most)
        self.closed = False

    def link(self, other: _End) -> None:
        """From now on this side's bytes go to ``other``."""
        self.other = other

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is None or other.transport is None:
            self.early.append(data)  # bounded: reading is paused until the inside is connected
            return
        other.transport.write(data)

    def pause_writing(self) -> None:  # our outgoing buffer is full: stop reading from the other side
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def eof_received(self) -> bool:
        self._close_other()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._close_other()
        if self.source:
            self.front.cap.release(self.source)
            self.front.forget(self)

    def _close_other(self) -> None:
        other = self.other
        if other is not None and other.transport is not None and not other.transport.is_closing():
            other.transport.close()  # after what it still has to write


class GrpcFront:
    """Listens on ``host:port``, admits connections through ``cap`` and splices them to the Unix socket of the
    gRPC server (``inner_address``). ``start()`` returns the port; ``stop()`` closes everything."""

    def __init__(self, cap: ConnectionCap) -> None:
        self.cap = cap
        self._dir = tempfile.mkdtemp(prefix="tasklet-grpc-")
        os.chmod(self._dir, 0o700)  # only this user may reach gRPC behind the front
        self.socket_path = os.path.join(self._dir, "grpc.sock")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._outside: set[_End] = set()  # loop thread only
        self._refusals_logged = (0.0, 0)  # loop thread only: (when, cap.refused then)
        self.port = 0

    @property
    def inner_address(self) -> str:
        """Where gRPC listens behind the front (a gRPC address)."""
        return f"unix:{self.socket_path}"

    @property
    def held(self) -> int:
        return self.cap.held

    def start(self, host: str, port: int) -> int:
        sock = socket.create_server((host, port), family=_family(host), backlog=512)
        sock.setblocking(False)
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(loop.create_server(self._admit, sock=sock))
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="grpc-front", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S) or failure:
            sock.close()
            raise OSError(f"the gRPC front could not start on {host}:{port}: {failure[:1] or 'timed out'}")
        self.port = sock.getsockname()[1]
        return self.port

    def stop(self, drain_s: float = DRAIN_S) -> None:
        """Stop accepting, let open connections forward what gRPC behind already wrote (an answer sent within the
        server's grace must reach its caller) for at most ``drain_s``, then cut what is left."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(self._drain_then_close(drain_s), loop)
            thread.join(timeout=drain_s + 5.0)
        self._loop = self._thread = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def remember(self, end: _End) -> None:
        self._outside.add(end)

    def forget(self, end: _End) -> None:
        self._outside.discard(end)

    def refused(self, source: str) -> None:
        """Log a refusal, at most once every REFUSAL_LOG_S with the number refused since (loop thread)."""
        at, then = self._refusals_logged
        now = time.monotonic()
        if now - at >= REFUSAL_LOG_S:
            logger.info("gRPC port: connection cap reached (%d in all, %d per source, %d per stranger network): "
                        "%d closed since the last report, the latest from %s", self.cap.total, self.cap.per_source,
                        self.cap.per_stranger_network, self.cap.refused - then, source)
            self._refusals_logged = (now, self.cap.refused)

    # --- on the loop thread -------------------------------------------------------------------------------
    def _admit(self) -> asyncio.Protocol:
        return _Door(self)

    async def _drain_then_close(self, drain_s: float) -> None:
        """Close the listener; wait until every connection closed by itself (gRPC behind has stopped, so its end
        of each pair reaches EOF after its last bytes), or ``drain_s``; then :meth:`_close_all`."""
        assert self._loop is not None
        if self._server is not None:
            self._server.close()
        deadline = self._loop.time() + drain_s
        while self._outside and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        self._close_all()

    def _close_all(self) -> None:
        assert self._loop is not None
        if self._server is not None:
            self._server.close()
        for end in list(self._outside):
            for side in (end, end.other):
                if side is not None and side.transport is not None:
                    side.transport.abort()
        self._loop.stop()

    async def _connect_inside(self, outside: _End) -> None:
        assert self._loop is not None and outside.transport is not None
        try:
            _, inside = await asyncio.wait_for(
                self._loop.create_unix_connection(lambda: _End(self), self.socket_path), START_TIMEOUT_S
            )
        except OSError as exc:  # TimeoutError included
            logger.info("gRPC front: cannot reach gRPC behind it: %s", exc)
            outside.transport.abort()
            return
        assert isinstance(inside, _End)
        if outside.closed:
            if inside.transport is not None:
                inside.transport.close()
            return
        inside.link(outside)
        outside.link(inside)
        assert inside.transport is not None
        # either side may have spoken before they were linked (an HTTP/2 server sends its SETTINGS at once)
        for src, dst in ((outside, inside.transport), (inside, outside.transport)):
            for data in src.early:
                dst.write(data)
            src.early.clear()
        outside.transport.resume_reading()


class _Door(_End):
    """The outside end: admitted by the cap when it connects, refused (closed unread) over it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        if not self.front.cap.admit(source):
            self.front.refused(source)
            transport.abort()
            return
        self.source = source
        self.front.remember(self)
        transport.pause_reading()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        asyncio.ensure_future(self.front._connect_inside(self))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
