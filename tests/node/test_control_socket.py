"""The owner's control socket: owner-only, one bounded request per connection, pause and resume as the daemon's
leave and rejoin, and a refusal (the leader) that changes nothing."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from tasklet.peer.node.control_socket import (
    MAX_REQUEST,
    ControlError,
    ControlSocket,
    PauseState,
    ask,
    find_socket,
    socket_path,
)


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.refuse: str | None = None

    def state(self) -> PauseState:
        return PauseState(lambda: self.log.append("leave"), lambda: self.log.append("rejoin"), lambda: self.refuse)


@pytest.fixture(name="served")
def served_fixture(tmp_path: Path):  # noqa: ANN201
    calls = Calls()
    path = socket_path(tmp_path / "state", "peerA")
    control = ControlSocket(path, calls.state())
    control.start()
    try:
        yield calls, path
    finally:
        control.close()
    assert not path.exists(), "the socket is removed when the daemon stops"


def test_pause_and_resume_leave_and_rejoin_once(served: tuple[Calls, Path]) -> None:
    calls, path = served
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ask(path, "status") == {"ok": True, "paused": False}
    assert ask(path, "pause") == {"ok": True, "paused": True}
    assert ask(path, "pause")["note"] == "already paused"
    assert ask(path, "status")["paused"] is True
    assert ask(path, "resume") == {"ok": True, "paused": False}
    assert ask(path, "resume")["note"] == "not paused"
    assert calls.log == ["leave", "rejoin"]


def test_a_refused_pause_changes_nothing(served: tuple[Calls, Path]) -> None:
    calls, path = served
    calls.refuse = "this peer leads the swarm"
    answer = ask(path, "pause")
    assert answer == {"ok": False, "paused": False, "error": "this peer leads the swarm"}
    assert calls.log == [] and ask(path, "status")["paused"] is False


def test_bad_requests_are_refused_and_the_socket_keeps_serving(served: tuple[Calls, Path]) -> None:
    calls, path = served
    assert "unknown command" in ask(path, "format-disk")["error"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        sock.sendall(b"p" * (MAX_REQUEST * 4))  # no newline, longer than any request
        answer = sock.recv(4096)
    assert b"longer than" in answer
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # says nothing: the read's deadline ends it
        sock.settimeout(10)
        sock.connect(str(path))
        assert sock.recv(4096) == b"", "the server closes a silent connection at its deadline"
    assert ask(path, "status")["ok"] and calls.log == []


def test_find_socket(tmp_path: Path, served: tuple[Calls, Path]) -> None:
    _, path = served
    folder = path.parent
    assert find_socket(folder) == path
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a killed peer's socket: bound, nobody listening
    stale.bind(str(socket_path(folder, "peerDead")))
    stale.close()
    assert find_socket(folder) == path
    other = ControlSocket(socket_path(folder, "peerB"), Calls().state())
    other.start()
    try:
        with pytest.raises(ControlError, match="--peer"):
            find_socket(folder)
        assert find_socket(folder, "peerB") == socket_path(folder, "peerB")
    finally:
        other.close()
    with pytest.raises(ControlError, match="no running peer"):
        find_socket(tmp_path / "empty")
    with pytest.raises(ControlError, match="cannot reach"):
        ask(socket_path(folder, "peerDead"), "status")


def test_a_state_folder_deeper_than_a_unix_socket_address_still_serves(tmp_path: Path) -> None:
    """A unix socket's address holds 107 bytes; a deep --state-dir (a CI worker's temporary folder, a long home)
    made `peer join` fail at start with "AF_UNIX path too long". The socket is bound and reached through an open
    handle on its folder instead."""
    folder = tmp_path / ("deep-" * 12) / "state"
    path = socket_path(folder, "peer" + "0" * 20)
    assert len(str(path).encode()) > 107
    calls = Calls()
    control = ControlSocket(path, calls.state())
    control.start()
    try:
        assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert find_socket(folder) == path
        assert ask(path, "pause") == {"ok": True, "paused": True}
        assert calls.log == ["leave"]
    finally:
        control.close()
    assert not path.exists()
