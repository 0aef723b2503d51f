"""A relay of our own for peers nobody can dial (behind NAT): connection reversal and relayed TCP.

Why not libp2p: hivemind's p2pd relays reset bulk streams and never hole-punched in our test bed (see
docs/operating.md, "Behind NAT"). This relay carries the *unchanged* gRPC bytes of our data plane, so every
deadline, size limit and validation of peer.net stays, and end-to-end TLS stays end to end (the relay sees
only what the two peers send).

Roles (all TCP, one optional port on a public peer, ``--relay-port``):

* A peer behind NAT (:class:`RelayAgent`) keeps an outbound *control connection* to one or more relays and
  registers under its peer id: the relay sends a fresh nonce, the agent answers with its public key and a
  signature of the nonce by its identity key (peer.identity.keys); the relay checks that the key hashes to
  the claimed peer id and that the signature verifies. A later registration of the same id (a restart)
  replaces the earlier one; nobody without the key can take it over.
* A client (any peer's gRPC channel, see peer.net.endpoint) connects to the relay and sends ``CONNECT
  <peer id>.tasklet:1 HTTP/1.1`` (gRPC's built-in HTTP proxy support). The relay tells the registered peer
  ``DIAL <token>`` over its control connection; the peer opens a new connection to the relay, sends ``ACCEPT
  <token>``, and splices it onto its own gRPC server; the relay answers the client ``200`` and splices the
  two connections. When the client *is* the relay (a public peer reaching a NAT'd one registered with it),
  the path is reversed: the NAT'd peer dialled the client directly.
* ``CHECK <port>``: the relay tries to open a TCP connection to the asker's own address (as the relay sees
  it) at that port and answers ``OPEN <ip>`` or ``CLOSED <ip>``: how a peer learns whether others can dial it
  (only the asker's own address, so the relay cannot be used to scan third parties).

Membership (a swarm with a join secret): the relay and its members derive a *relay key* from the secret
(:func:`relay_key`, the secret itself never travels). A registration carries ``PROOF`` = HMAC(relay key,
peer id | nonce), so only a member can be reached through the relay; a CONNECT carries the credentials of
:func:`connect_credentials` in its ``Proxy-Authorization`` header (gRPC sends the user:password of its
``grpc.http_proxy`` URL there), so only members can open tunnels (anyone else: ``407``). An open swarm's
relay has no key and asks for neither.

Bounds on what anyone can make a relay hold (:class:`RelayLimits`): one deadline for a connection's whole
request (its lines and its answer to the nonce, however slowly the bytes come), request connections per
source network and in all (once the members' hosts are known, strangers together a quarter: ``set_members``),
registrations, dials waiting for their dial-back, CONNECTs per target and second, spliced connections per
registered peer and in all, and an idle timeout on every spliced connection. So the
relay's threads are at most ``max_pending_handshakes + max_waiting_total + max_registrations + 2 * max_splices``
+ 2 and its descriptors (:meth:`RelayLimits.descriptors`) at most ``max_pending_handshakes + max_waiting_total +
max_registrations + 2 * max_splices`` + 1 whatever the load (:meth:`RelayLimits.within` fits them to a budget).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from hivemind.utils.crypto import RSAPublicKey

from tasklet.peer.identity.keys import Identity, peer_id_from_public_key
from tasklet.peer.net.endpoint import RELAY_AUTHORITY_SUFFIX
from tasklet.peer.net.limits import ConnectionCap

log = logging.getLogger(__name__)

MAGIC = "TASKLET-RELAY/1"
SIGN_PREFIX = b"tasklet-relay-register:"
CONNECT_USER = "tasklet"
SPLICE_BUFFER = 256 * 1024


@dataclass(frozen=True)
class RelayLimits:
    """Everything a relay holds for strangers is bounded by these (see the module docstring)."""

    max_line_bytes: int = 1024
    max_header_lines: int = 16
    handshake_timeout_s: float = 10.0  # for a connection's whole request (its lines, its answer to the nonce)
    max_pending_handshakes: int = 64  # connections that have not said what they want yet
    max_handshakes_per_source: int = 16  # of those, from one source network (peer.net.limits.network_of)
    connects_per_s: float = 20.0  # CONNECTs to one registered peer per second (a burst of 2 s worth passes)
    max_registrations: int = 256
    max_waiting_dials: int = 16  # per registered peer: clients waiting for its dial-back
    max_waiting_total: int = 64  # clients waiting for a dial-back, all peers together
    dial_back_timeout_s: float = 10.0
    max_splices_per_peer: int = 64
    max_splices: int = 1024
    idle_timeout_s: float = 600.0  # a spliced connection with no byte either way for this long is closed
    ping_interval_s: float = 15.0  # keepalive on control connections; a dead one ends the registration
    check_timeout_s: float = 3.0

    def descriptors(self) -> int:
        """The most file descriptors the relay holds at once (see the module docstring)."""
        return (self.max_pending_handshakes + self.max_waiting_total + self.max_registrations
                + 2 * self.max_splices + 1)

    def within(self, budget: int) -> RelayLimits:
        """These limits with the splices (then the registrations) cut so that :meth:`descriptors` <= ``budget``."""
        fixed = self.max_pending_handshakes + self.max_waiting_total + 1
        registrations = max(1, min(self.max_registrations, (budget - fixed) // 4))
        splices = max(1, min(self.max_splices, (budget - fixed - registrations) // 2))
        return replace(self, max_registrations=registrations, max_splices=splices,
                       max_splices_per_peer=min(self.max_splices_per_peer, splices))


class RelayProtocolError(ValueError):
    """The other side broke the relay protocol (the connection is closed)."""


def relay_key(secret: str, run_id: str) -> bytes:
    """The key a sealed swarm's relay and members share, derived from the join secret (never sent itself)."""
    return hmac.new(secret.encode(), b"tasklet relay key\x00" + run_id.encode(), hashlib.sha256).digest()


def registration_proof(key: bytes, peer_id: str, nonce: str) -> str:
    """What a member sends with its registration: binds the peer id and the relay's fresh nonce."""
    return hmac.new(key, f"register\x00{peer_id}\x00{nonce}".encode(), hashlib.sha256).hexdigest()


def connect_credentials(key: bytes) -> str:
    """``user:password`` a member's client sends with a CONNECT (peer.net.endpoint.set_relay_credentials)."""
    return f"{CONNECT_USER}:{hmac.new(key, b'connect', hashlib.sha256).hexdigest()}"


def _read_line(sock: socket.socket, limit: int, deadline: float | None = None) -> str:
    """One line without its end, read byte-wise so nothing after it is consumed; bounded by ``limit`` and,
    when given, by the monotonic ``deadline`` for the whole line however slowly its bytes come."""
    out = bytearray()
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RelayProtocolError("request deadline passed")
            sock.settimeout(left)
        b = sock.recv(1)
        if not b:
            raise RelayProtocolError("connection closed")
        if b == b"\n":
            return out.decode("ascii", errors="replace").rstrip("\r")
        out += b
        if len(out) > limit:
            raise RelayProtocolError(f"line longer than {limit} bytes")


def _send_line(sock: socket.socket, text: str) -> None:
    sock.sendall(text.encode("ascii") + b"\n")


def _hang_up(sock: socket.socket) -> None:
    """Shut down, then close: a thread blocked reading the socket wakes up and the other side sees the end
    (a bare close() from another thread does neither)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _nodelay(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def splice(a: socket.socket, b: socket.socket, idle_timeout_s: float, on_close: Callable[[], None] | None = None,
           name: str = "splice") -> None:
    """Copy bytes both ways between two connected sockets in two threads; close both when either side ends or
    nothing moved for ``idle_timeout_s``; then call ``on_close``."""
    _nodelay(a)
    _nodelay(b)
    last = [time.monotonic()]
    done = threading.Event()
    remaining = [2]
    lock = threading.Lock()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(min(30.0, idle_timeout_s))
        try:
            while not done.is_set():
                try:
                    data = src.recv(SPLICE_BUFFER)
                except TimeoutError:
                    if time.monotonic() - last[0] > idle_timeout_s:
                        break
                    continue
                if not data:
                    break
                last[0] = time.monotonic()
                dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
        except OSError:
            done.set()
        finally:
            with lock:
                remaining[0] -= 1
                last_one = remaining[0] == 0
            if last_one or done.is_set():
                done.set()
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.close()
                if last_one and on_close is not None:
                    on_close()

    threading.Thread(target=pump, args=(a, b), name=f"{name}-ab", daemon=True).start()
    threading.Thread(target=pump, args=(b, a), name=f"{name}-ba", daemon=True).start()


@dataclass
class _Registration:
    peer_id: str
    control: socket.socket
    send_lock: threading.Lock
    splices: int = 0
    waiting: int = 0
    alive: bool = True

    def end(self) -> None:
        """The registration is over (unregistered, or replaced by a newer one of the same peer)."""
        self.alive = False

    def splice_closed(self) -> None:
        self.splices -= 1


class RelayServer:
    """The relay service of a public peer (see the module docstring); ``start()`` then ``close()``."""

    def __init__(self, host: str, port: int, limits: RelayLimits | None = None, key: bytes | None = None) -> None:
        """``key``: the swarm's :func:`relay_key` (None: an open swarm, registrations and CONNECTs unproven)."""
        self.host, self.port = host, port
        self.limits = limits or RelayLimits()
        self._key = key
        self._connect_auth = (
            None if key is None else "Basic " + base64.b64encode(connect_credentials(key).encode()).decode()
        )
        self._lock = threading.Lock()
        # request connections in progress: per network, and once the members are known a quarter for strangers
        self.slots = ConnectionCap(self.limits.max_pending_handshakes, self.limits.max_handshakes_per_source)
        self._buckets: dict[str, tuple[float, float]] = {}  # _lock: peer id -> (CONNECT tokens, at)
        self._registrations: dict[str, _Registration] = {}  # _lock
        self._pending: dict[str, tuple[str, threading.Event, list[socket.socket]]] = {}  # _lock: token -> dial
        self._splices = 0  # _lock
        self._waiting = 0  # _lock: clients waiting for a dial-back, all peers
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self.stats = {"connects": 0, "refused": 0, "registrations": 0, "checks": 0, "denied": 0}

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> int:
        sock = socket.create_server((self.host, self.port), reuse_port=False, backlog=128)
        self._sock = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="relay-accept", daemon=True).start()
        threading.Thread(target=self._ping_loop, name="relay-ping", daemon=True).start()
        log.info("relay listening on %s:%d", self.host, self.port)
        return self.port

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        with self._lock:
            regs = list(self._registrations.values())
            self._registrations.clear()
        for reg in regs:
            _hang_up(reg.control)

    @property
    def local_address(self) -> str:
        """Where a client in this process reaches the relay."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("::1" if self.host == "::" else self.host)
        return f"{host}:{self.port}"

    def registered(self, peer_id: str) -> bool:
        with self._lock:
            reg = self._registrations.get(peer_id)
            return reg is not None and reg.alive

    def lookup(self, peer_id: str) -> str | None:
        """The local address of this relay if ``peer_id`` is registered here (peer.net.endpoint hook)."""
        return self.local_address if self.registered(peer_id) else None

    # ---- connections ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            source = str(addr[0])  # counted per network, members apart (peer.net.limits.ConnectionCap)
            if not self.slots.admit(source):
                self.stats["refused"] += 1
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            try:
                threading.Thread(target=self._handle, args=(conn, addr), name="relay-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse this one, keep serving
                self._release_slot(source)
                with contextlib.suppress(OSError):
                    conn.close()

    def _release_slot(self, source: str) -> None:
        self.slots.release(source)

    def set_members(self, hosts: list[str]) -> None:
        """The hosts of the swarm's live members (a NAT'd one's ``dials_from`` included): their requests (a
        public member's CONNECT, a NAT'd member's re-registration) keep most of the request slots."""
        self.slots.set_members(hosts)

    def _handle(self, conn: socket.socket, addr: tuple) -> None:
        """Read what the connection wants (bounded in size and time) and hand it to the right role."""
        keep = False
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release_slot(str(addr[0]))

        deadline = time.monotonic() + self.limits.handshake_timeout_s
        try:
            first = _read_line(conn, self.limits.max_line_bytes, deadline)
            if first.startswith("CONNECT "):
                keep = self._on_connect(conn, first, release, deadline)
            elif first.startswith(MAGIC + " "):
                keep = self._on_command(conn, addr, first[len(MAGIC) + 1 :], release, deadline)
            else:
                raise RelayProtocolError(f"unknown request {first[:40]!r}")
        except (OSError, RelayProtocolError, ValueError) as exc:
            log.debug("relay: connection from %s ended: %s", addr[0], exc)
        finally:
            release()
            if not keep:
                with contextlib.suppress(OSError):
                    conn.close()

    def _on_command(self, conn: socket.socket, addr: tuple, command: str, release: Callable[[], None],
                    deadline: float) -> bool:
        verb, _, arg = command.partition(" ")
        if verb == "REGISTER":
            return self._on_register(conn, arg, release, deadline)
        if verb == "ACCEPT":
            return self._on_accept(conn, arg)
        if verb == "CHECK":
            self._on_check(conn, addr[0], arg)
            return False
        raise RelayProtocolError(f"unknown command {verb[:20]!r}")

    def _on_check(self, conn: socket.socket, ip: str, arg: str) -> None:
        if not arg.isdigit() or len(arg) > 5 or not 0 < int(arg) <= 65535:
            raise RelayProtocolError("CHECK needs a port")
        self.stats["checks"] += 1
        try:
            with socket.create_connection((ip, int(arg)), timeout=self.limits.check_timeout_s):
                pass
            _send_line(conn, f"OPEN {ip}")
        except OSError:
            _send_line(conn, f"CLOSED {ip}")

    def _on_register(self, conn: socket.socket, arg: str, release: Callable[[], None], deadline: float) -> bool:
        peer_id = arg.strip()
        nonce = secrets.token_hex(16)
        _send_line(conn, f"NONCE {nonce}")
        key_line = _read_line(conn, 4 * self.limits.max_line_bytes, deadline)
        sig_line = _read_line(conn, 4 * self.limits.max_line_bytes, deadline)
        proof_line = _read_line(conn, self.limits.max_line_bytes, deadline)
        if not key_line.startswith("KEY ") or not sig_line.startswith("SIG ") or not proof_line.startswith("PROOF "):
            raise RelayProtocolError("expected KEY, SIG and PROOF lines")
        if self._key is not None:  # the cheap check first: a stranger costs an HMAC, not an RSA verification
            expected = registration_proof(self._key, peer_id, nonce)
            if not hmac.compare_digest(expected, proof_line[6:].strip()):
                self.stats["denied"] += 1
                _send_line(conn, "DENIED not a member of this swarm (wrong or missing join secret)")
                return False
        public_key = base64.b64decode(key_line[4:], validate=True)
        signature = base64.b64decode(sig_line[4:], validate=True)
        if peer_id_from_public_key(public_key) != peer_id:
            _send_line(conn, "DENIED the key is not this peer id's")
            return False
        try:
            valid = RSAPublicKey.from_bytes(public_key).verify(SIGN_PREFIX + nonce.encode(), signature)
        except Exception:  # a malformed key
            valid = False
        if not valid:
            _send_line(conn, "DENIED bad signature")
            return False
        with self._lock:
            old = self._registrations.get(peer_id)
            if old is None and len(self._registrations) >= self.limits.max_registrations:
                full = True
            else:
                full = False
                reg = _Registration(peer_id, conn, threading.Lock())
                if old is not None:
                    reg.splices = old.splices
                    old.end()
                self._registrations[peer_id] = reg
        if full:
            _send_line(conn, "DENIED relay full")
            return False
        if old is not None:
            _hang_up(old.control)
        self.stats["registrations"] += 1
        conn.settimeout(None)
        _send_line(conn, "OK")
        release()
        log.info("relay: peer %s registered", peer_id)
        threading.Thread(target=self._watch_control, args=(reg,), name="relay-control", daemon=True).start()
        return True

    def _watch_control(self, reg: _Registration) -> None:
        """Read the control connection until it ends (PONGs only); then drop the registration."""
        try:
            reg.control.settimeout(3 * self.limits.ping_interval_s)
            while True:
                line = _read_line(reg.control, self.limits.max_line_bytes)
                if line != "PONG":
                    raise RelayProtocolError(f"unexpected {line[:20]!r} on a control connection")
        except (OSError, RelayProtocolError):
            pass
        finally:
            with self._lock:
                if self._registrations.get(reg.peer_id) is reg:
                    del self._registrations[reg.peer_id]
                    self._buckets.pop(reg.peer_id, None)
                reg.end()
            with contextlib.suppress(OSError):
                reg.control.close()
            log.info("relay: peer %s unregistered", reg.peer_id)

    def _ping_loop(self) -> None:
        while not self._stop.wait(self.limits.ping_interval_s):
            with self._lock:
                regs = list(self._registrations.values())
            for reg in regs:
                self._send_control(reg, "PING")

    @staticmethod
    def _send_control(reg: _Registration, line: str) -> bool:
        try:
            with reg.send_lock:
                _send_line(reg.control, line)
            return True
        except OSError:
            return False

    def _on_connect(self, conn: socket.socket, first: str, release: Callable[[], None], deadline: float) -> bool:
        """An HTTP CONNECT from a client: have the target peer dial back, then splice."""
        parts = first.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise RelayProtocolError("malformed CONNECT line")
        authorization = ""
        for _ in range(self.limits.max_header_lines):  # the rest of the request head; only the proxy credentials
            line = _read_line(conn, self.limits.max_line_bytes, deadline)
            if line == "":
                break
            name, _, value = line.partition(":")
            if name.strip().lower() == "proxy-authorization":
                authorization = value.strip()
        else:
            raise RelayProtocolError("too many header lines")
        self.stats["connects"] += 1
        if self._connect_auth is not None and not hmac.compare_digest(authorization.encode(),
                                                                      self._connect_auth.encode()):
            self.stats["denied"] += 1
            conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
            return False
        authority = parts[1]
        peer_id = authority[: -len(RELAY_AUTHORITY_SUFFIX)] if authority.endswith(RELAY_AUTHORITY_SUFFIX) else ""
        token = secrets.token_hex(16)
        arrived = threading.Event()
        box: list[socket.socket] = []
        with self._lock:
            reg = self._registrations.get(peer_id)
            error = ""
            if reg is None or not reg.alive:
                error = "404 Not Found"
            elif not self._take_connect_token(peer_id):
                error = "429 Too Many Requests"
            elif reg.waiting >= self.limits.max_waiting_dials or reg.splices >= self.limits.max_splices_per_peer \
                    or self._splices >= self.limits.max_splices or self._waiting >= self.limits.max_waiting_total:
                error = "503 Service Unavailable"
            else:
                reg.waiting += 1
                self._waiting += 1
                self._pending[token] = (peer_id, arrived, box)
        if error:
            self.stats["refused"] += 1
            conn.sendall(f"HTTP/1.1 {error}\r\n\r\n".encode())
            return False
        release()
        try:
            if not self._send_control(reg, f"DIAL {token}") or not arrived.wait(self.limits.dial_back_timeout_s):
                conn.sendall(b"HTTP/1.1 504 Gateway Timeout\r\n\r\n")
                return False
        finally:
            with self._lock:
                reg.waiting -= 1
                self._waiting -= 1
                self._pending.pop(token, None)
        back = box[0]
        with self._lock:
            reg.splices += 1
            self._splices += 1
        try:
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        except OSError:
            back.close()
            self._splice_closed(reg)
            return False
        conn.settimeout(None)
        back.settimeout(None)
        splice(conn, back, self.limits.idle_timeout_s, lambda: self._splice_closed(reg), name="relay")
        return True

    def _take_connect_token(self, peer_id: str) -> bool:
        """A token bucket per registered peer (call under ``_lock``): ``connects_per_s``, bursts of 2 s worth."""
        rate = self.limits.connects_per_s
        at = time.monotonic()
        tokens, last = self._buckets.get(peer_id, (2 * rate, at))
        tokens = min(2 * rate, tokens + (at - last) * rate)
        if tokens < 1:
            self._buckets[peer_id] = (tokens, at)
            return False
        self._buckets[peer_id] = (tokens - 1, at)
        return True

    def _splice_closed(self, reg: _Registration) -> None:
        with self._lock:
            reg.splice_closed()
            self._splices -= 1

    def _on_accept(self, conn: socket.socket, token: str) -> bool:
        """A registered peer's dial-back for ``token`` (an unguessable one-time secret sent only to it)."""
        with self._lock:
            pending = self._pending.pop(token.strip(), None)
        if pending is None:
            raise RelayProtocolError("unknown or expired token")
        _, arrived, box = pending
        box.append(conn)
        arrived.set()
        return True


class RelayAgent:
    """The NAT'd side: registers with relays and answers their DIALs by splicing onto ``local_target``."""

    def __init__(self, identity: Identity, relays: list[str], local_target: str,
                 max_splices: int = 64, idle_timeout_s: float = RelayLimits.idle_timeout_s,
                 key: bytes | None = None) -> None:
        """``key``: the swarm's :func:`relay_key`, proving membership to the relays (None: an open swarm)."""
        self.identity = identity
        self.key = key
        self.relays = list(relays)
        self.local_target = local_target
        self.max_splices = max_splices
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._registered: dict[str, bool] = dict.fromkeys(self.relays, False)  # _lock
        self._splices = 0  # _lock
        self._stop = threading.Event()
        self._socks: dict[str, socket.socket] = {}
        self.stats = {"dials": 0, "refused": 0}

    def start(self) -> None:
        for relay in self.relays:
            threading.Thread(target=self._keep, args=(relay,), name=f"relay-agent-{relay}", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for sock in list(self._socks.values()):
            _hang_up(sock)

    def registered(self) -> list[str]:
        with self._lock:
            return [r for r in self.relays if self._registered.get(r)]

    def wait_registered(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            got = self.registered()
            if got:
                return got
            time.sleep(0.05)
        return self.registered()

    def _keep(self, relay: str) -> None:
        """Hold a registration with ``relay``; reconnect with back-off when it drops."""
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self._session(relay)
                backoff = 0.5
            except (OSError, RelayProtocolError, ValueError) as exc:
                log.info("relay %s: %s", relay, exc)
            with self._lock:
                self._registered[relay] = False
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _session(self, relay: str) -> None:
        host, _, port = relay.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        self._socks[relay] = sock
        try:
            _send_line(sock, f"{MAGIC} REGISTER {self.identity.peer_id}")
            line = _read_line(sock, 1024)
            if not line.startswith("NONCE "):
                raise RelayProtocolError(f"relay answered {line[:40]!r}")
            nonce = line[6:].strip()
            signature = self.identity.private_key.sign(SIGN_PREFIX + nonce.encode())
            _send_line(sock, "KEY " + base64.b64encode(self.identity.public_key).decode())
            _send_line(sock, "SIG " + base64.b64encode(signature).decode())
            proof = "-" if self.key is None else registration_proof(self.key, self.identity.peer_id, nonce)
            _send_line(sock, "PROOF " + proof)
            answer = _read_line(sock, 1024)
            if answer != "OK":
                raise RelayProtocolError(f"registration refused: {answer[:80]}")
            with self._lock:
                self._registered[relay] = True
            log.info("registered with relay %s", relay)
            sock.settimeout(3 * RelayLimits.ping_interval_s)
            while not self._stop.is_set():
                line = _read_line(sock, 1024)
                if line == "PING":
                    _send_line(sock, "PONG")
                elif line.startswith("DIAL "):
                    threading.Thread(target=self._dial_back, args=(relay, line[5:].strip()),
                                     name="relay-dial", daemon=True).start()
                else:
                    raise RelayProtocolError(f"unexpected {line[:20]!r} from the relay")
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _dial_back(self, relay: str, token: str) -> None:
        with self._lock:
            if self._splices >= self.max_splices or not token.isalnum() or len(token) > 64:
                self.stats["refused"] += 1
                return
            self._splices += 1
        self.stats["dials"] += 1
        back = local = None
        try:
            host, _, port = relay.rpartition(":")
            back = socket.create_connection((host, int(port)), timeout=10)
            lhost, _, lport = self.local_target.rpartition(":")
            local = socket.create_connection((lhost, int(lport)), timeout=10)
            _send_line(back, f"{MAGIC} ACCEPT {token}")
            back.settimeout(None)
            local.settimeout(None)
        except OSError as exc:
            log.info("dial-back to relay %s failed: %s", relay, exc)
            for s in (back, local):
                if s is not None:
                    s.close()
            self._closed()
            return
        splice(back, local, self.idle_timeout_s, self._closed, name="relayed")

    def _closed(self) -> None:
        with self._lock:
            self._splices -= 1


def check_reachable(relay: str, port: int, timeout_s: float = 10.0) -> tuple[bool, str]:
    """Ask ``relay`` to dial this machine's address (as the relay sees it) at ``port``: (open?, that address)."""
    host, _, rport = relay.rpartition(":")
    with socket.create_connection((host, int(rport)), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        _send_line(sock, f"{MAGIC} CHECK {port}")
        answer = _read_line(sock, 256)
    verdict, _, ip = answer.partition(" ")
    if verdict not in ("OPEN", "CLOSED"):
        raise RelayProtocolError(f"relay answered {answer[:40]!r}")
    return verdict == "OPEN", ip.strip()
