"""Container engines for the tests: whether one can run containers here, and the project's images, built once.

``container_images`` (a session fixture) finds podman or docker, makes the base image when it is missing (no
image registry is reachable on these machines: Debian bookworm from ``mmdebstrap``, then ``import``; the
Dockerfiles' ``PYTHON_IMAGE``), builds the CPU image from this checkout once per test session (the engine's
layer cache makes a rerun fast) and reports its facts: build time, size. A test that uses it skips, with the
reason, where no engine can run a container; ``bash scripts/setup.sh`` installs podman as root on Debian.

pip inside the build sees what pip sees here: this machine's pip configuration files, and the wheel folders,
local indexes, constraints and CA bundle they name, mounted read-only into the build (``podman build -v``;
docker's builder takes no mounts and uses the public indexes). The CPU image's torch is the local
``torch==2.13.0+cpu`` wheel where there is one; the build itself fails on any other torch (``TORCH_BUILD=cpu``).

:class:`ComposeProject` runs ``docker/compose.yml`` under a project name of the test's own with
``podman-compose`` or ``docker compose``, and removes every container, volume (named and anonymous) and
network of that project when closed.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/tasklet-base:bookworm"
CPU_IMAGE = "localhost/tasklet:cpu"
# what the base image holds: the Python that the Dockerfiles' python:3.11-slim base would give, from Debian
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
PIP_CONFIG_FILES = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf")
PIP_PATH_KEYS = ("cert", "client-cert", "find-links", "index-url", "extra-index-url", "constraint")


@dataclass(frozen=True)
class Engine:
    """A container engine's command line (``podman`` or ``docker``)."""

    name: str
    path: str

    def run(self, *args: str, timeout: float = 120, check: bool = True,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else dict(env))
        if check and proc.returncode != 0:
            raise RuntimeError(f"{self.name} {' '.join(args[:6])} exited {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return proc

    def has_image(self, image: str) -> bool:
        return self.run("image", "inspect", image, check=False, timeout=60).returncode == 0

    def compose_command(self) -> list[str]:
        """``podman-compose`` (the project's virtualenv first, then PATH) or ``docker compose``."""
        if self.name == "docker":
            return [self.path, "compose"]
        beside = Path(sys.executable).parent / "podman-compose"
        found = str(beside) if beside.exists() else shutil.which("podman-compose")
        if not found:
            pytest.skip("podman-compose is not installed (bash scripts/setup.sh installs it into .venv)")
        return [found]

    def remove(self, *containers: str) -> None:
        """Remove containers, running or not, with their anonymous volumes."""
        if containers:
            self.run("rm", "-f", "-v", *containers, check=False, timeout=120)


def find_engine() -> tuple[Engine | None, str]:
    """The first engine that answers ``info``, or ``None`` and why there is none."""
    reasons = []
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if not path:
            reasons.append(f"no {name} on PATH")
            continue
        try:
            proc = subprocess.run([path, "info"], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            reasons.append(f"`{name} info` did not answer in 60 s")
            continue
        if proc.returncode == 0:
            return Engine(name, path), ""
        reasons.append(f"`{name} info` failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return None, "; ".join(reasons) + " (bash scripts/setup.sh installs podman as root on Debian)"


def build_base(engine: Engine) -> float:
    """Make :data:`BASE_IMAGE` from Debian's packages (``mmdebstrap``); the seconds it took."""
    mmdebstrap = shutil.which("mmdebstrap")
    if not mmdebstrap:
        pytest.skip(f"no {BASE_IMAGE} and no mmdebstrap to make it (bash scripts/setup.sh installs it)")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tasklet-base-") as tmp:
        tar = Path(tmp) / "base.tar"
        proc = subprocess.run([mmdebstrap, "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(tar)],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.skip(f"mmdebstrap could not make the base image: {proc.stderr.strip()[-500:]}")
        engine.run("import", str(tar), BASE_IMAGE, timeout=300)
    return time.monotonic() - start


def _paths_in(value: str) -> list[Path]:
    """Local paths in a pip setting; for a local index (``.../simple``) the folder above, which also holds the
    files its pages link to (``../files/...``)."""
    paths = []
    for word in value.split():
        word = word.removeprefix("file://").rstrip("/")
        path = Path(word)
        if word.startswith("/") and path.exists():
            paths.append(path.parent if path.name == "simple" else path)
    return paths


def pip_mounts() -> list[str]:
    """``-v`` arguments that give pip in a build this machine's pip configuration: its files, and every local
    path they or the ``PIP_*`` variables name (wheel folders, local indexes, constraints, the CA bundle)."""
    mounts: dict[str, str] = {}
    values = [v for k, v in os.environ.items() if k.startswith("PIP_")]
    for name in PIP_CONFIG_FILES:
        path = Path(name).expanduser()
        if not path.is_file():
            continue
        inside = "/root/" + str(path.relative_to(Path.home())) if name.startswith("~") else str(path)
        mounts[str(path)] = inside
        parser = configparser.ConfigParser(interpolation=None)
        with contextlib.suppress(configparser.Error):
            parser.read(path)
        for section in parser.sections():
            values += [parser[section][k] for k in PIP_PATH_KEYS if k in parser[section]]
    for value in values:
        for path in _paths_in(value):
            mounts.setdefault(str(path), str(path))
    return [arg for host, inside in sorted(mounts.items()) for arg in ("-v", f"{host}:{inside}:ro")]


@dataclass(frozen=True)
class Images:
    """The images a session built, and what the build measured."""

    engine: Engine
    cpu: str
    base_s: float | None  # None: the base image was there already
    build_s: float
    size_bytes: int
    torch_line: str  # docker/install.sh's "[install] done: torch ..." line, empty when the layer was cached


def build_cpu_image(engine: Engine, log: Path) -> tuple[float, str]:
    """Build :data:`CPU_IMAGE` from the checkout; the seconds it took and install.sh's last line."""
    args = ["build", "-f", "docker/Dockerfile.cpu", "-t", CPU_IMAGE, "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}",
            # the machine's own indexes (pip configuration), not PyTorch's CPU index: it is not reachable here
            "--build-arg", "TORCH_INDEX="]
    if engine.name == "podman":
        args += pip_mounts()
    before = engine.run("image", "inspect", "--format", "{{.Id}}", CPU_IMAGE, check=False, timeout=60).stdout.strip()
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run([engine.path, *args, str(REPO)], stdout=out, stderr=subprocess.STDOUT, text=True,
                              timeout=1800, cwd=REPO)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise AssertionError(f"the CPU image did not build (exit {proc.returncode}); end of {log}:\n{text[-4000:]}")
    after = engine.run("image", "inspect", "--format", "{{.Id}}", CPU_IMAGE, timeout=60).stdout.strip()
    if before and before != after:  # the image the tag named before: replaced, untagged, of no further use
        engine.run("rmi", before, check=False, timeout=300)
    done = [line for line in text.splitlines() if line.startswith("[install] done:")]
    return seconds, done[-1] if done else ""


def images(engine: Engine, log_dir: Path) -> Images:
    """The base image (made when missing) and the CPU image, built from the checkout; skips where the engine
    cannot run a container."""
    base_s = None if engine.has_image(BASE_IMAGE) else build_base(engine)
    probe = engine.run("run", "--rm", BASE_IMAGE, "true", check=False, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{engine.name} cannot run a container: {probe.stderr.strip()[-500:]}")
    build_s, torch_line = build_cpu_image(engine, log_dir / "build-cpu.log")
    size = int(engine.run("image", "inspect", "--format", "{{.Size}}", CPU_IMAGE).stdout.strip())
    return Images(engine, CPU_IMAGE, base_s, build_s, size, torch_line)


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

    def __init__(self, engine: Engine, name: str, env: Mapping[str, str], files: tuple[str, ...] = ("compose.yml",)):
        self.engine = engine
        self.name = name
        self.env = dict(os.environ, **env)
        self.base = [*engine.compose_command(), "-p", name]
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
def compose_project(engine: Engine, name: str, env: Mapping[str, str]) -> Iterator[ComposeProject]:
    project = ComposeProject(engine, name, env)
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
