"""Test helper: the repository as a newcomer gets it — a fresh ``git clone`` with a freshly made ``.venv``.

Installing torch, hivemind and gRPC into a new virtualenv takes one to two minutes here, so a test session
makes one clone and one virtualenv (the first test that asks pays for it) and every test of
``tests/test_docs.py`` and ``tests/test_docker.py`` reuses them. The virtualenv is a real, isolated one made by
the project's own ``scripts/setup.sh`` from a plain ``python3``: no ``--system-site-packages``, which would hide
a missing dependency behind the developer's installed packages.

The clone is not deleted when the session ends: deleting the 1.9 GB of files just written took 64-166 s here
(more than making them), while pytest deletes the same tree in about 4 s once it is older, when it rotates its
base temporary directories (the newest 3 are kept). A CI machine is thrown away anyway.

The clone is of the committed tree: files that are not committed yet are not in it, as for anyone who clones.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT_S = 480.0


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


def fresh_clone(base: Path) -> Clone:
    """Clone this repository into ``base`` (created if missing) and run ``scripts/setup.sh`` there, once per
    session.

    Raises RuntimeError with the tail of the setup log if cloning or setting up fails (and keeps failing for
    every later caller, without trying again)."""
    global _clone, _failure
    if _clone is not None:
        return _clone
    if _failure is not None:
        raise RuntimeError(_failure)
    root = base / "tasklet"
    tmp = base / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(root)], check=True, capture_output=True,
                       text=True, timeout=120)
        started = time.monotonic()
        proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=newcomer_env(tmp), capture_output=True,
                              text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        _failure = f"git clone failed: {exc.stderr.strip()}"
        raise RuntimeError(_failure) from None
    except subprocess.TimeoutExpired as exc:
        _failure = f"{exc.cmd} took longer than {exc.timeout:.0f} s"
        raise RuntimeError(_failure) from None
    seconds = time.monotonic() - started
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not (root / ".venv" / "bin" / "peer").exists():
        _failure = f"scripts/setup.sh in a fresh clone failed (exit {proc.returncode}):\n{log[-4000:]}"
        raise RuntimeError(_failure)
    _clone = Clone(root=root, setup_seconds=seconds, setup_log=log)
    return _clone


@pytest.fixture(scope="session", name="newcomer")
def newcomer_fixture(tmp_path_factory: pytest.TempPathFactory, processes: None) -> Clone:
    """The session's fresh clone with its own virtualenv (made by the first test that asks)."""
    return fresh_clone(tmp_path_factory.getbasetemp() / "newcomer")  # left to pytest's rotation (see above)
