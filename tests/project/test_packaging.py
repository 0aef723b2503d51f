"""What `pip install .` (or `pipx install .`) puts on a volunteer's machine: one import package, ``tasklet``.

The folders ``peer/``, ``protocol/`` and ``scheduler/`` stay at the top of the checkout and pyproject.toml maps
them to ``tasklet.peer``, ``tasklet.protocol`` and ``tasklet.scheduler``; PyPI has packages named ``peer``,
``protocol`` and ``scheduler``, which an install of ours must never shadow. ``bench`` is not shipped. That a
non-editable install trains is tests/project/test_docker.py's (docker/install.sh, then a two-peer swarm); here: the
wheel built from a fresh clone, its names, and ``peer --help`` from it in a fresh virtualenv with nothing else
installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.newcomer import Clone

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("peer", "protocol", "scheduler")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.unit
def test_pyproject_maps_every_package_folder_under_tasklet() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    folders = {".".join(("tasklet", *p.parent.relative_to(REPO).parts))
               for top in SHIPPED for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert set(setuptools["packages"]) == folders, "pyproject.toml's package list and the folders differ"
    assert setuptools["package-dir"] == {f"tasklet.{top}": top for top in SHIPPED}
    assert not any(name.split(".")[0] != "tasklet" for name in setuptools["packages"])
    assert _pyproject()["project"]["scripts"]["peer"] == "tasklet.peer.cli:main"


def _source_copy(clone: Path, dest: Path) -> Path:
    """The clone's committed files, copied: the build writes its own folders there, not into the shared clone."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=clone, capture_output=True, check=True,
                            timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = clone / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_the_wheel_ships_only_tasklet_and_peer_help_runs_from_it(newcomer: Clone, tmp_path: Path) -> None:
    src = _source_copy(newcomer.root, tmp_path / "src")
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("tasklet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"tasklet", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    assert not any(n.startswith(("bench/", "tasklet/bench/", "tests/", "tasklet/tests/")) for n in names)
    for data in ("tasklet/protocol/tasklet.proto", "tasklet/scheduler/data/dtfm_scenarios.json",
                 "tasklet/peer/observe/static/index.html", "tasklet/peer/cli.py"):
        assert data in names, f"{data} is not in the wheel"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                                "--disable-pip-version-check", str(wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    away = tmp_path / "elsewhere"  # not the checkout: nothing of ours on sys.path but the install
    away.mkdir()
    helped = subprocess.run([str(venv / "bin" / "peer"), "--help"], cwd=away, capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "peer join --dht ADDR" in helped.stdout
    probe = ("import importlib.util as u, json; print(json.dumps({n: u.find_spec(n) is not None for n in "
             "('tasklet', 'tasklet.peer', 'tasklet.protocol', 'tasklet.scheduler', 'peer', 'protocol', "
             "'scheduler', 'bench')}))")
    found = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=away, capture_output=True, text=True,
                           timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == ('{"tasklet": true, "tasklet.peer": true, "tasklet.protocol": true, '
                                    '"tasklet.scheduler": true, "peer": false, "protocol": false, '
                                    '"scheduler": false, "bench": false}')
