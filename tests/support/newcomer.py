"""Test helper: the repository as a newcomer gets it — a fresh ``git clone`` with a freshly made ``.venv``.

Installing torch, hivemind and gRPC into a new virtualenv takes one to two minutes here, so a test session
makes one clone and one virtualenv and every test of ``tests/project/test_docs.py`` and
``tests/project/test_docker.py`` reuses them. A session that will use it starts making it in the background as
soon as its tests are collected (``tests/conftest.py``), while the in-process tests run; the first test that asks
waits for it. The virtualenv
is a real, isolated one made by the project's own ``scripts/setup.sh`` from a plain ``python3``: no
``--system-site-packages``, which would hide a missing dependency behind the developer's installed packages.

The clone is not deleted when the session ends: deleting the 1.9 GB of files just written took 64-166 s here
(more than making them), while pytest deletes the same tree in about 4 s once it is older, when it rotates its
base temporary directories (the newest 3 are kept). A CI machine is thrown away anyway.

The clone is of the committed tree: files that are not committed yet are not in it, as for anyone who clones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT_S = 480.0  # the clone and scripts/setup.sh, from their start


@dataclass(frozen=True)
class Clone:
    root: Path
    setup_seconds: float
    setup_log: str

    @property
    def python(self) -> Path:
        return self.root / ".venv" / "bin" / "python"


_clone: Clone | None = None
_failure: str | None = None


def newcomer_env(tmp: Path) -> dict[str, str]:
    """The environment of someone who has never run this project: no activated virtualenv, no PYTHONPATH, the
    developer's .venv off PATH; temporary files (the swarm's logs and results) go to ``tmp``."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    own_bin = str(REPO / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != own_bin)
    env["TMPDIR"] = str(tmp)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclass
class _Setup:
    """A clone being made and set up, in a process group of its own: ``log`` collects its output."""

    proc: subprocess.Popen[bytes]
    base: Path
    log: Path
    started: float


_setup: _Setup | None = None


def _start(base: Path) -> _Setup:
    root, tmp = base / "tasklet", base / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    log = base / "setup.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", 'git clone --quiet "$1" "$2" && cd "$2" && exec bash scripts/setup.sh', "newcomer",
             str(REPO), str(root)],
            env=newcomer_env(tmp), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return _Setup(proc, base, log, time.monotonic())


def prepare_in_background(base: Path) -> None:
    """Start the session's clone and set-up now, before any test runs, so that it overlaps the tests that come
    first (the in-process ones leave a core idle: about 0.8 of 2 in use); :func:`fresh_clone` waits for it.
    Started from a pytest hook, not from a test: the in-process tests refuse to start processes."""
    global _setup
    if _setup is None and _clone is None:
        _setup = _start(base)


def stop_background() -> None:
    """End a set-up still running (the session ended first): its whole process group."""
    if _setup is not None and _setup.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_setup.proc.pid, signal.SIGKILL)
        _setup.proc.wait()


def fresh_clone(base: Path) -> Clone:
    """Clone this repository into ``base`` (created if missing) and run ``scripts/setup.sh`` there, once per
    session (or wait for :func:`prepare_in_background` to finish doing so).

    Raises RuntimeError with the tail of the setup log if cloning or setting up fails (and keeps failing for
    every later caller, without trying again)."""
    global _clone, _failure, _setup
    if _clone is not None:
        return _clone
    if _failure is not None:
        raise RuntimeError(_failure)
    if _setup is None or _setup.base != base:
        stop_background()
        _setup = _start(base)
    root = base / "tasklet"
    try:
        rc = _setup.proc.wait(timeout=max(1.0, SETUP_TIMEOUT_S - (time.monotonic() - _setup.started)))
    except subprocess.TimeoutExpired:
        stop_background()
        _failure = f"cloning and scripts/setup.sh took longer than {SETUP_TIMEOUT_S:.0f} s"
        raise RuntimeError(_failure) from None
    seconds = time.monotonic() - _setup.started
    log = _setup.log.read_text(encoding="utf-8", errors="replace")
    if rc != 0 or not (root / ".venv" / "bin" / "peer").exists():
        _failure = f"cloning and scripts/setup.sh in a fresh clone failed (exit {rc}):\n{log[-4000:]}"
        raise RuntimeError(_failure)
    _clone = Clone(root=root, setup_seconds=seconds, setup_log=log)
    return _clone


@pytest.fixture(scope="session", name="newcomer")
def newcomer_fixture(tmp_path_factory: pytest.TempPathFactory, processes: None) -> Clone:
    """The session's fresh clone with its own virtualenv (made by the first test that asks)."""
    return fresh_clone(tmp_path_factory.getbasetemp() / "newcomer")  # left to pytest's rotation (see above)
