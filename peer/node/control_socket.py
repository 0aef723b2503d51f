"""The owner's local control of a running peer: `peer pause`, `peer resume`, `peer control status`.

A running daemon listens on a unix socket in its state folder (``--state-dir``, default ``~/.tasklet``),
``control-PEERID.sock``, created owner-only (the folder 0700 when we create it, the socket 0600) and answering
only connections whose credentials (``SO_PEERCRED``) carry this process's user id: the owner of the machine,
nobody else, and nothing over the network. One request per connection, one line of at most
:data:`MAX_REQUEST` bytes read within :data:`REQUEST_TIMEOUT_S`; the answer is one JSON line.

Pausing is a departure, not a fault: the peer writes its tombstone (``Membership.leave``), the leader notices at
its next step boundary and re-plans without it (the step under way finishes with it, and its state is served
to whoever takes its place), and nothing is held against it. Resuming announces it again as a newcomer (a fresh
``started_at``, so it does not take the lead back), and the next plan that can use it does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from tasklet.peer.node.schedule import Schedule, action, leaves_at

log = logging.getLogger(__name__)

MAX_REQUEST = 64
REQUEST_TIMEOUT_S = 2.0
ANSWER_TIMEOUT_S = 10.0
COMMANDS = ("pause", "resume", "status")
SCHEDULE_CHECK_S = 5.0  # how often the schedule is compared with the clock (a window ends this late at most)
REFUSED_RETRY_S = 60.0  # after a refused pause (this peer leads), the schedule asks again this much later


class ControlError(RuntimeError):
    """The control socket cannot be opened or asked; the message says why in one line."""


def default_state_dir() -> Path:
    return Path(os.path.expanduser("~")) / ".tasklet"


def socket_path(state_dir: Path, peer_id: str) -> Path:
    return state_dir / f"control-{peer_id}.sock"


MAX_SUN_PATH = 107  # bytes of a unix socket's address (sockaddr_un.sun_path, 108 with its NUL)


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """The address to bind or connect ``path`` by: itself, or, when it is longer than a unix socket's address
    may be (a deep ``--state-dir``), the same file through an open handle on its folder (``/proc/self/fd/N/NAME``,
    Linux), valid while the block runs."""
    if len(os.fsencode(path)) <= MAX_SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        short = f"/proc/self/fd/{fd}/{path.name}"
        if len(os.fsencode(short)) > MAX_SUN_PATH or not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENAMETOOLONG, f"the path is {len(os.fsencode(path))} bytes, over a unix socket's "
                                              f"{MAX_SUN_PATH}; give a shorter --state-dir")
        yield short
    finally:
        os.close(fd)


class PauseState:
    """Whether the owner paused this peer; the daemon supplies how to leave and how to come back.

    ``leave()`` writes the tombstone; ``rejoin()`` announces the peer again; ``refusal()`` says why the peer
    cannot pause now (it leads the swarm, say) or returns None.
    """

    def __init__(self, leave: Callable[[], None], rejoin: Callable[[], None],
                 refusal: Callable[[], str | None]) -> None:
        self._leave, self._rejoin, self._refusal = leave, rejoin, refusal
        self._lock = threading.Lock()
        self.paused = False
        self.paused_by = ""  # "owner" (`peer pause`) or "schedule" (--schedule)

    def handle(self, command: str, by: str = "owner") -> dict[str, Any]:
        """``by``: who asks; the schedule resumes only what it paused, an owner's pause stays."""
        with self._lock:
            if command == "status":
                return {"ok": True, "paused": self.paused}
            if command == "pause":
                if self.paused:
                    return {"ok": True, "paused": True, "note": "already paused"}
                why = self._refusal()
                if why:
                    return {"ok": False, "paused": False, "error": why}
                self._leave()
                self.paused, self.paused_by = True, by
                log.warning("paused by the %s: left the swarm; the leader re-plans at its next step boundary", by)
                return {"ok": True, "paused": True}
            if command == "resume":
                if not self.paused:
                    return {"ok": True, "paused": False, "note": "not paused"}
                self._rejoin()
                self.paused, self.paused_by = False, ""
                log.warning("resumed by the %s: announced again; the next plan that can use this peer will", by)
                return {"ok": True, "paused": False}
        return {"ok": False, "error": f"unknown command (one of {', '.join(COMMANDS)})"}


class ControlSocket:
    """Serves :class:`PauseState` on a unix socket only this user can reach (see the module docstring)."""

    def __init__(self, path: Path, state: PauseState) -> None:
        self.path, self.state = path, state
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        folder = self.path.parent
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.path.exists() or self.path.is_symlink():
                self.path.unlink()  # a stale socket of an earlier run of this identity
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with _address(self.path) as address:
                sock.bind(address)
            os.chmod(self.path, 0o600)
            sock.listen(4)
        except OSError as exc:
            raise ControlError(f"control socket {self.path}: {exc.strerror or exc}") from None
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="control-socket", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S + 1)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:  # the asker went away: nothing to tell it
                    log.info("control socket: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        uid = _peer_uid(conn)
        if uid is not None and uid != os.getuid():
            _reply(conn, {"ok": False, "error": "only the user running this peer may control it"})
            return
        data = b""
        while b"\n" not in data and len(data) <= MAX_REQUEST:
            chunk = conn.recv(MAX_REQUEST + 1 - len(data))
            if not chunk:
                break
            data += chunk
        line = data.split(b"\n", 1)[0]
        if len(line) > MAX_REQUEST:
            _reply(conn, {"ok": False, "error": f"request longer than {MAX_REQUEST} bytes"})
            return
        command = line.decode("ascii", errors="replace").strip()
        _reply(conn, self.state.handle(command) if command in COMMANDS else
               {"ok": False, "error": f"unknown command {command[:20]!r} (one of {', '.join(COMMANDS)})"})


def _peer_uid(conn: socket.socket) -> int | None:
    """The connecting process's user id (Linux ``SO_PEERCRED``); None where the platform does not say."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _reply(conn: socket.socket, answer: dict[str, Any]) -> None:
    conn.sendall(json.dumps(answer).encode() + b"\n")


def find_socket(state_dir: Path, peer_id: str | None = None) -> Path:
    """The control socket of the one peer running from ``state_dir`` (or of ``peer_id``)."""
    if peer_id:
        path = socket_path(state_dir, peer_id)
        if not path.exists():
            raise ControlError(f"no peer {peer_id} runs with state folder {state_dir} ({path} is missing)")
        return path
    found = [p for p in sorted(state_dir.glob("control-*.sock")) if _answers(p)]  # not a killed peer's
    if not found:
        raise ControlError(f"no running peer found in {state_dir} (start one with `peer join`, or give --state-dir)")
    if len(found) > 1:
        ids = ", ".join(p.stem.removeprefix("control-") for p in found)
        raise ControlError(f"several peers run from {state_dir} ({ids}): name one with --peer ID")
    return found[0]


def _answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(REQUEST_TIMEOUT_S)
            with _address(path) as address:
                sock.connect(address)
        return True
    except OSError:
        return False


def ask(path: Path, command: str, timeout_s: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
    """Send ``command`` to the peer at ``path``; its answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            with _address(path) as address:
                sock.connect(address)
            sock.sendall(command.encode("ascii") + b"\n")
            data = b""
            while not data.endswith(b"\n") and len(data) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise ControlError(f"cannot reach the peer at {path}: {exc.strerror or exc} (is it still running?)") from None
    try:
        answer = json.loads(data.decode())
    except ValueError:
        raise ControlError(f"the peer at {path} answered {data[:60]!r}") from None
    if not isinstance(answer, dict):
        raise ControlError(f"the peer at {path} answered {answer!r:.60}")
    return answer


class OwnerControl:
    """A daemon's owner controls: the control socket (when it has a state folder) and the schedule (when it has
    one, followed on a thread of its own). Pausing leaves the swarm like a departure, resuming announces the
    peer again. ``daemon`` is the :class:`~peer.node.daemon.PeerDaemon` (its options, membership, advert, role)."""

    def __init__(self, daemon: Any, path: Path | None) -> None:
        self.daemon = daemon
        self.schedule: Schedule | None = daemon.opts.schedule
        self.state = PauseState(self._leave, self._rejoin, self._refusal)
        self.socket = None if path is None else ControlSocket(path, self.state)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.socket is not None:
            self.socket.start()
        if self.schedule is not None:
            self._thread = threading.Thread(target=self._follow_schedule, name="schedule", daemon=True)
            self._thread.start()

    def _follow_schedule(self) -> None:
        while True:  # at once (a peer started outside its hours leaves right after announcing), then periodically
            todo = action(self.schedule, datetime.now().astimezone(), self.state.paused,
                          self.state.paused_by == "schedule")
            if todo is not None:
                answer = self.state.handle(todo, by="schedule")
                if not answer.get("ok"):
                    log.warning("schedule: cannot %s: %s", todo, answer.get("error"))
                    if self._stop.wait(REFUSED_RETRY_S):
                        return
            if self._stop.wait(SCHEDULE_CHECK_S):
                return

    @property
    def paused(self) -> bool:
        return self.state.paused

    def _refusal(self) -> str | None:
        role = self.daemon.role
        if role is not None and not role.finished.is_set():
            return ("this peer leads the swarm and cannot pause; stop it instead (it checkpoints and the next "
                    "oldest peer takes the lead)")
        return None

    def _leave(self) -> None:
        self.daemon.membership.leave()

    def _rejoin(self) -> None:
        d = self.daemon
        extra = {k: v for k, v in d.advert.extra.items() if k != "leaves_at"}
        end = leaves_at(self.schedule, datetime.now().astimezone())
        if end is not None:
            extra["leaves_at"] = end
        d.announce_as_newcomer(extra)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.socket is not None:
            self.socket.close()


def open_control(daemon: Any) -> OwnerControl:
    """A daemon's owner controls, started. The control socket exists when the owner gave the peer a state folder
    (``--state-dir``, or the folder of its ``--identity`` file); a throwaway identity (a local swarm) has none."""
    o = daemon.opts
    folder = o.state_dir or (str(Path(o.identity).expanduser().parent) if o.identity else None)
    path = None if folder is None else socket_path(Path(folder).expanduser(), daemon.identity.peer_id)
    control = OwnerControl(daemon, path)
    control.start()
    if path is not None:
        log.info("owner control: `peer pause` / `peer resume` reach this peer at %s", path)
    return control
