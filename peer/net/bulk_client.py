"""A peer's bulk lane, client side: a few open connections to one peer's lane, one push at a time on each.

Why and the wire format: peer.net.bulk_wire. The sender hands the kernel (or TLS) each tensor's own memory: the
Envelope's segments (protocol.message) are sent as they are, in pieces of at most ``chunk_bytes``, and between
pieces the client looks for an early reply, so a push the peer refuses from its first bytes stops there.

TLS is the gRPC channel's: our certificate, the peer's pinned (or any trusted one), the fixed peer name. A lane
that cannot be reached or whose handshake fails raises LaneUnusableError before any byte of the push was sent:
the caller then sends it through gRPC, which has every check too (peer.net.client).
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from tasklet.peer.identity.certs import SERVER_NAME
from tasklet.peer.net.bulk_server import IDLE_TIMEOUT_S
from tasklet.peer.net.bulk_wire import HEAD, HEAD_MAGIC, REPLY, LaneClosedError, read_reply
from tasklet.peer.net.statuses import error_of_status
from tasklet.peer.net.tls import TlsContext
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol.errors import PeerUnreachable

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
# A lane whose connection attempt timed out (a firewall that drops all but the gRPC port) is skipped by every
# client of this process for this long, so that new clients (one per plan and neighbour) do not each wait for it.
# A refused connection (a peer restarting) only turns the lane off for the client that met it.
UNUSABLE_FOR_S = 600.0
REUSE_WITHIN_S = IDLE_TIMEOUT_S * 0.8  # an idle connection older than this is closed, never reused
_LATE_REPLY_S = 1.0  # after a failed send: how long to look for the refusal that ended it


class LaneUnusableError(ConnectionError):
    """No connection to the lane could be opened (nothing of the push was sent); ``timed_out``: nobody answered."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class StaleConnectionError(ConnectionError):
    """A connection kept from an earlier push failed before any answer: the peer closed it while it was idle
    (its close had not reached us yet). The push may go again on a fresh connection."""


_unusable: dict[tuple[str, int], float] = {}  # lane address -> until when it is skipped (time.monotonic)
_unusable_lock = threading.Lock()


def mark_unusable(address: tuple[str, int]) -> None:
    with _unusable_lock:
        _unusable[address] = time.monotonic() + UNUSABLE_FOR_S


def usable(address: tuple[str, int]) -> bool:
    """False while a lane at this address is known to be out of reach (see UNUSABLE_FOR_S)."""
    with _unusable_lock:
        until = _unusable.get(address)
        if until is not None and until <= time.monotonic():
            del _unusable[address]
            until = None
    return until is None


def pieces(segments: Sequence[bytes | memoryview], piece_bytes: int) -> Iterator[memoryview]:
    """Views of the segments, in order, each at most ``piece_bytes`` long (nothing copied)."""
    for segment in segments:
        view = memoryview(segment).cast("B") if isinstance(segment, memoryview) else memoryview(segment)
        for start in range(0, view.nbytes, piece_bytes):
            yield view[start : start + piece_bytes]


class BulkLane:
    """Connections from this process to one peer's bulk lane at ``host:port`` (thread-safe)."""

    def __init__(self, endpoint: str, host: str, port: int, tls: TlsContext | None, pinned: bytes | None) -> None:
        self.endpoint = endpoint
        self.address = (host, port)
        self._context = None if tls is None else tls.ssl_client_context(pinned)
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []  # open connections and when they were last used
        self._closed = False

    def push(self, parts: Iterable[memoryview], total: int, deadline: float, fresh: bool = False) -> int:
        """Send one serialized Envelope of ``total`` bytes; return the bytes the peer acknowledged. ``fresh``:
        on a new connection, not one kept from an earlier push.

        Raises LaneUnusableError (nothing sent), StaleConnectionError (a kept connection the peer had closed),
        or the peer's answer as Refused / PeerUnreachable."""
        conn, kept = self._take(deadline, fresh)
        try:
            code, received, message = self._exchange(conn, parts, total, deadline)
        except TimeoutError:
            _close(conn)
            raise PeerUnreachable(self.endpoint, "DEADLINE_EXCEEDED: bulk push not answered in time") from None
        except (OSError, LaneClosedError) as exc:
            _close(conn)
            if kept:
                raise StaleConnectionError(f"a kept bulk lane connection was closed ({exc})") from None
            raise PeerUnreachable(self.endpoint, f"bulk lane connection lost ({exc})") from None
        if code.value[0] != 0:
            _close(conn)
            raise error_of_status(code, message, self.endpoint)
        self._give_back(conn)
        return received

    def _exchange(
        self, conn: socket.socket, parts: Iterable[memoryview], total: int, deadline: float
    ) -> tuple[object, int, str]:
        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return remaining

        conn.settimeout(left())
        conn.sendall(HEAD.pack(HEAD_MAGIC, PROTOCOL_VERSION, max(1, int(left() * 1000)), total))
        early = b""
        try:
            for part in parts:
                early = _early_reply(conn)
                if early:  # the peer answered before the end: a refusal, read below
                    break
                conn.settimeout(left())
                conn.sendall(part)
        except OSError:
            conn.settimeout(min(_LATE_REPLY_S, left()))
            return read_reply(conn)  # the refusal that closed the connection, if it came through
        conn.settimeout(left())
        return read_reply(conn, early)

    # --- connections --------------------------------------------------------------------------------------
    def _take(self, deadline: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A connection, and whether it was kept from an earlier push."""
        now = time.monotonic()
        with self._lock:
            while self._idle and not fresh:
                conn, used = self._idle.pop()
                if now - used < REUSE_WITHIN_S and not _readable(conn):  # readable when idle: closed by the peer
                    return conn, True
                _close(conn)
        return self._connect(min(CONNECT_TIMEOUT_S, max(0.001, deadline - now))), False

    def _connect(self, timeout: float) -> socket.socket:
        try:
            raw = socket.create_connection(self.address, timeout=timeout)
        except OSError as exc:
            message = f"cannot connect to the bulk lane at {self.address}: {exc}"
            raise LaneUnusableError(message, timed_out=isinstance(exc, TimeoutError)) from exc
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is None:
                return raw
            return self._context.wrap_socket(raw, server_hostname=SERVER_NAME)
        except (OSError, ssl.SSLError) as exc:
            _close(raw)
            raise LaneUnusableError(f"TLS with the bulk lane at {self.address} failed: {exc}") from exc

    def _give_back(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((conn, time.monotonic()))
                return
        _close(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            _close(conn)


def _early_reply(conn: socket.socket) -> bytes:
    """The first bytes of a reply that arrived while we send, else b"" (a TLS record that carries no data, such
    as a session ticket, makes the socket readable too: it is consumed here and ignored)."""
    if not _readable(conn):
        return b""
    conn.setblocking(False)
    try:
        data = conn.recv(REPLY.size)
    except (ssl.SSLWantReadError, BlockingIOError):
        return b""
    finally:
        conn.setblocking(True)
    if not data:
        raise LaneClosedError("the peer closed the connection during the push")
    return data


def _readable(conn: socket.socket) -> bool:
    if isinstance(conn, ssl.SSLSocket) and conn.pending():
        return True
    try:
        return bool(select.select([conn], [], [], 0)[0])
    except (OSError, ValueError):
        return True  # closed: reading tells what happened


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        logger.debug("closing a bulk lane connection failed", exc_info=True)
