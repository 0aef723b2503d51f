"""The set-up scripts touch what the README says they touch: ``scripts/demo.sh`` (and the ``scripts/setup.sh`` it
runs) only the checkout's virtualenv, even as root; the test suite's system tools (apt-get, /usr/local/bin,
/etc/containers) only ``scripts/setup-test-tools.sh``, which ``scripts/test.sh`` runs.

The scripts run for real, on a PATH that holds nothing but the few tools they need and recording stand-ins: a
``python3`` that makes a stand-in virtualenv (its ``python`` and ``peer`` record their arguments and succeed, so
no package is installed and no swarm starts), ``id`` saying root (or not), and ``apt-get``, ``apt``, ``dpkg``,
``sudo``, ``podman``, ``runc``, ``mmdebstrap``, ``chromium``, ``nft`` and ``docker-compose`` that record the call
and fail (``apt-get update`` succeeds, so that the install it guards is tried). The full demo is
tests/project/test_docs.py's, from a fresh clone.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.system_watch import SYSTEM_TOOLS, forbidding, script, snapshot

# runs bash (tests/support/processes.py)
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.light_processes]

REPO = Path(__file__).resolve().parents[2]
REAL_TOOLS = ("bash", "sh", "dirname", "grep", "mkdir", "cp")


def _bed(tmp: Path, uid: int, stand_ins: tuple[str, ...] = SYSTEM_TOOLS) -> tuple[dict[str, str], Path]:
    """A PATH of real basics and recording stand-ins for ``stand_ins`` (the other system tools are absent);
    returns the environment and the folder of call logs."""
    bin_dir, logs, templates = tmp / "bin", tmp / "logs", tmp / "templates"
    for d in (bin_dir, logs, templates):
        d.mkdir()
    for tool in REAL_TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed to run the set-up scripts"
        (bin_dir / tool).symlink_to(found)
    forbidding(bin_dir, logs, stand_ins)
    script(bin_dir / "id", f'if [ "$1" = "-u" ]; then echo {uid}; else echo "uid={uid}"; fi\n')
    script(templates / "python", f'echo "$*" >> "{logs}/venv-python"\n')
    script(templates / "peer", f'echo "$*" >> "{logs}/peer"\n')
    script(bin_dir / "python3", f'echo "$*" >> "{logs}/python3"\n'
            f'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then\n  mkdir -p "$3/bin"\n'
            f'  cp "{templates}/python" "{templates}/peer" "$3/bin/"\nfi\n')
    env = {"PATH": str(bin_dir), "HOME": str(tmp / "home"), "TMPDIR": str(tmp), "LC_ALL": "C"}
    return env, logs


def _log(logs: Path, name: str) -> list[str]:
    path = logs / name
    return path.read_text().splitlines() if path.exists() else []


def test_demo_setup_as_root_writes_only_its_virtualenv(tmp_path: Path) -> None:
    # no runc: a set-up that wrongly writes the runc wrapper (it needs podman and runc) must not get to do it
    env, logs = _bed(tmp_path, uid=0, stand_ins=tuple(t for t in SYSTEM_TOOLS if t != "runc"))
    venv = tmp_path / "checkout-venv"
    env["VENV"] = str(venv)
    before = snapshot()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--steps", "1"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _log(logs, "system") == [], f"demo.sh ran system tools: {_log(logs, 'system')}\n{proc.stderr}"
    assert snapshot() == before, "demo.sh changed /usr/local or /etc"
    # it made the virtualenv, installed the checkout into it, and started the swarm from it
    assert _log(logs, "python3") == [f"-m venv {venv}"]
    pip = [line for line in _log(logs, "venv-python") if line.startswith("-m pip install")]
    assert any(line.endswith("-e .[dev]") for line in pip), pip
    assert _log(logs, "peer") == ["swarm --peers 4 --scenario worldwide_geo_distributed --steps 5 --steps 1"]


def test_test_tools_script_holds_the_apt_calls_and_tolerates_their_failure(tmp_path: Path) -> None:
    env, logs = _bed(tmp_path, uid=0, stand_ins=("apt-get", "apt", "dpkg", "sudo"))  # a machine without the tools
    before = snapshot()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup-test-tools.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # a failed apt-get leaves the tests that need the tool to skip
    installs = " ".join(line for line in _log(logs, "system") if line.startswith("apt-get") and "install" in line)
    for package in ("nftables", "chromium", "podman", "runc", "mmdebstrap", "docker-compose"):
        assert package in installs, installs
    assert "the container tests will skip" in proc.stderr
    # no podman was installed (apt-get failed), so no runc wrapper was written
    assert snapshot() == before


@pytest.mark.parametrize(("uid", "skip_apt"), [(1000, ""), (0, "1")])
def test_test_tools_script_leaves_the_system_alone_unless_root_asks(tmp_path: Path, uid: int, skip_apt: str) -> None:
    env, logs = _bed(tmp_path, uid=uid)
    if skip_apt:
        env["SKIP_APT"] = skip_apt
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup-test-tools.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _log(logs, "system") == []


def _commands(script: str) -> str:
    """The script without its comments (a ``#`` at a line's start or after a space)."""
    return "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in (REPO / "scripts" / script).read_text().splitlines())


def test_who_runs_what() -> None:
    demo, setup, tests = _commands("demo.sh"), _commands("setup.sh"), _commands("test.sh")
    for name, text in (("demo.sh", demo), ("setup.sh", setup)):
        assert not re.search(r"apt-get|\bapt\b|dpkg|sudo|/etc/|/usr/local|setup-test-tools", text), name
    assert "scripts/setup.sh" in demo
    # the suite's tools come first, so that setup.sh finds podman and puts podman-compose into .venv
    assert tests.index("scripts/setup-test-tools.sh") < tests.index("scripts/setup.sh")
