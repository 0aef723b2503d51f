"""Container engines for the tests: whether one can run containers here, and the project's images, built once.

``container_images`` (a session fixture) finds podman or docker, makes the base image when it is missing (no
image registry is reachable on these machines: Debian bookworm from ``mmdebstrap``, then ``import``; the
Dockerfiles' ``PYTHON_IMAGE``), builds the CPU image from this checkout once per test session (the engine's
layer cache makes a rerun fast) and reports its facts: build time, size. A test that uses it skips, with the
reason, where no engine can run a container; ``bash scripts/setup-test-tools.sh`` installs podman as root on
Debian.

The engine and the builds are bench/images.py's (``python -m bench.images`` measures the same images): pip
inside the build sees what pip sees here, this machine's pip configuration files and the wheel folders, local
indexes, constraints and CA bundle they name, mounted read-only (``podman build -v``; docker's builder takes no
mounts and uses the public indexes). The CPU image's torch is the local ``torch==2.13.0+cpu`` wheel where there is
one; the build itself fails on any other torch (``TORCH_BUILD=cpu``).

:class:`ComposeProject` runs ``docker/compose.yml`` under a project name of the test's own with
``podman-compose`` or ``docker compose``, and removes every container, volume (named and anonymous) and
network of that project when closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.images import (
    BASE_IMAGE,
    CPU_IMAGE,
    CPU_TORCH,
    REPO,
    Engine,
    EngineError,
    build_base,
    build_image,
    find_engine,
)

__all__ = ["BASE_IMAGE", "CPU_IMAGE", "Engine", "find_engine"]


@dataclass(frozen=True)
class Images:
    """The images a session built, and what the build measured."""

    engine: Engine
    cpu: str
    base_s: float | None  # None: the base image was there already
    build_s: float
    size_bytes: int
    torch_line: str  # docker/install.sh's "[install] done: torch ..." line, empty when the layer was cached


def images(engine: Engine, log_dir: Path) -> Images:
    """The base image (made when missing) and the CPU image, built from the checkout; skips where the engine
    cannot run a container."""
    try:
        base_s = None if engine.has_image(BASE_IMAGE) else build_base(engine)
    except EngineError as exc:
        pytest.skip(str(exc))
    probe = engine.run("run", "--rm", BASE_IMAGE, "true", check=False, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{engine.name} cannot run a container: {probe.stderr.strip()[-500:]}")
    built = build_image(engine, "docker/Dockerfile.cpu", CPU_IMAGE, CPU_TORCH, log_dir / "build-cpu.log")
    return Images(engine, CPU_IMAGE, base_s, built.seconds, built.size_bytes, built.torch_line)


@pytest.fixture(scope="session", name="container_images")
def container_images_fixture(processes: None, tmp_path_factory: pytest.TempPathFactory,
                             request: pytest.FixtureRequest) -> Images:
    """The CPU image, built once per session (skips with the reason where no engine can run containers)."""
    engine, reason = find_engine()
    if engine is None:
        pytest.skip(f"no container engine: {reason}")
    built = images(engine, tmp_path_factory.mktemp("images"))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    facts = (f"[containers] {engine.name}: {built.cpu} built in {built.build_s:.0f} s "
             f"(base image: {'cached' if built.base_s is None else f'{built.base_s:.0f} s'}), "
             f"{built.size_bytes / 1e9:.2f} GB; {built.torch_line or 'install layer cached'}")
    if reporter is not None:
        reporter.write_line(facts)
    else:
        print(facts)
    return built


class ComposeProject:
    """``docker/compose.yml`` under a project name of its own; :meth:`close` removes all it made."""

    def __init__(self, engine: Engine, name: str, env: Mapping[str, str], files: tuple[str, ...] = ("compose.yml",),
                 command: list[str] | None = None):
        self.engine = engine
        self.name = name
        self.env = dict(os.environ, **env)
        try:
            self.base = [*(command or engine.compose_command()), "-p", name]
        except EngineError as exc:
            pytest.skip(str(exc))
        for f in files:
            self.base += ["-f", str(REPO / "docker" / f)]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout, env=self.env,
                              cwd=REPO)
        if check and proc.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return proc

    def containers(self, service: str = "") -> list[str]:
        """Names of this project's containers (of one service), running or not, in name order."""
        filters = ["--filter", f"label=com.docker.compose.project={self.name}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = self.engine.run("ps", "-a", *filters, "--format", "{{.Names}}", timeout=60).stdout
        return sorted(out.split())

    def logs(self, container: str) -> str:
        proc = self.engine.run("logs", container, check=False, timeout=60)
        return proc.stdout + proc.stderr

    def state(self, container: str) -> tuple[str, int]:
        """``(status, exit code)`` of a container."""
        out = self.engine.run("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container).stdout
        status, code = out.split()
        return status, int(code)

    def volume(self, name: str) -> str:
        return f"{self.name}_{name}"

    def close(self) -> None:
        self.engine.remove(*self.containers())
        self("down", "-v", "-t", "5", check=False, timeout=300)
        for kind, listing in (("volume", ["volume", "ls", "-q"]), ("network", ["network", "ls", "--format",
                                                                               "{{.Name}}"])):
            names = self.engine.run(*listing, timeout=60).stdout.split()
            mine = [n for n in names if n.startswith(f"{self.name}_")]
            if mine:
                self.engine.run(kind, "rm", "-f", *mine, check=False, timeout=60)


@contextlib.contextmanager
def compose_project(engine: Engine, name: str, env: Mapping[str, str],
                    command: list[str] | None = None) -> Iterator[ComposeProject]:
    project = ComposeProject(engine, name, env, command=command)
    try:
        yield project
    finally:
        project.close()


def read_json_from(engine: Engine, image: str, volumes: Mapping[str, str], script: str,
                   timeout: float = 300) -> dict:
    """Run ``python -c script`` in ``image`` with ``volumes`` (name -> path, read-only); its last stdout line
    parsed as JSON."""
    mounts = [arg for vol, path in volumes.items() for arg in ("-v", f"{vol}:{path}:ro")]
    proc = engine.run("run", "--rm", "--entrypoint", "/opt/tasklet/bin/python", *mounts, image, "-c", script,
                      timeout=timeout, check=False)
    assert proc.returncode == 0, f"python in {image} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
