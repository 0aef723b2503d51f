"""Tasklet's container images, built from the checkout and measured: size, build time, torch, start-up.

``python -m bench.images [--json] [--gpu]`` finds podman or docker, makes the base image when it is missing (no
image registry is reachable on the development machines: Debian bookworm from ``mmdebstrap``, then ``import``;
the Dockerfiles' ``PYTHON_IMAGE``) and builds:

* ``cpu``: ``docker/Dockerfile.cpu``, torch from this machine's wheels (a local ``torch==2.13.0+cpu``);
* ``gpu-stages-cpu``: ``docker/Dockerfile`` (the GPU image's stages) with the same CPU torch: the build stage is
  ``Dockerfile.cpu``'s word for word, so the builder's cache serves it and the run shows the GPU image's own
  final stage working;
* ``gpu`` (with ``--gpu``): ``docker/Dockerfile`` as a volunteer builds it, a CUDA torch from the package
  registry (pip sees this machine's configuration but not its wheel folders, whose ``+cpu`` wheel would satisfy
  ``torch==2.13.0`` first). Several GB; minutes.

For each: build seconds, size, torch version and CUDA build from a run of the image, and the start-up time of a
first peer (``run -d ... start`` with docker/run.toml to "peer server listening"). Prints one JSON object. The
same code builds the images of the container tests (tests/support/containers.py).
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BASE_IMAGE = "localhost/tasklet-base:bookworm"
CPU_IMAGE = "localhost/tasklet:cpu"
GPU_STAGES_CPU_IMAGE = "localhost/tasklet:gpu-stages-cpu"
GPU_IMAGE = "localhost/tasklet:gpu"
# what the base image holds: the Python that the Dockerfiles' python:3.11-slim base would give, from Debian
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
PIP_CONFIG_FILES = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf")
PIP_PATH_KEYS = ("cert", "client-cert", "find-links", "index-url", "extra-index-url", "constraint")
CPU_TORCH = {"TORCH_SPEC": "torch==2.13.0+cpu", "TORCH_BUILD": "cpu", "TORCH_INDEX": ""}
GPU_TORCH = {"TORCH_SPEC": "torch==2.13.0", "TORCH_BUILD": "cuda", "TORCH_INDEX": ""}
TORCH_PROBE = ("import json, os, torch, tasklet.peer as peer; print(json.dumps({'cuda': torch.version.cuda,"
               " 'torch': torch.__version__, 'uid': os.getuid(), 'peer': peer.__file__,"
               " 'nvidia': os.environ.get('NVIDIA_VISIBLE_DEVICES')}))")


class EngineError(RuntimeError):
    """No engine, or an engine that cannot do what was asked (with the reason)."""


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
            raise EngineError("podman-compose is not installed (bash scripts/setup.sh installs it into .venv)")
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
    return None, "; ".join(reasons) + " (bash scripts/setup-test-tools.sh installs podman as root on Debian)"




def build_base(engine: Engine) -> float:
    """Make :data:`BASE_IMAGE` from Debian's packages (``mmdebstrap``); the seconds it took."""
    mmdebstrap = shutil.which("mmdebstrap")
    if not mmdebstrap:
        raise EngineError(f"no {BASE_IMAGE} and no mmdebstrap to make it "
                          "(bash scripts/setup-test-tools.sh installs it)")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tasklet-base-") as tmp:
        tar = Path(tmp) / "base.tar"
        proc = subprocess.run([mmdebstrap, "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(tar)],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise EngineError(f"mmdebstrap could not make the base image: {proc.stderr.strip()[-500:]}")
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




def pip_mounts(local_wheels: bool = True) -> list[str]:
    """``-v`` arguments that give pip in a build this machine's pip configuration: its files, and every local
    path they or the ``PIP_*`` variables name (wheel folders, local indexes, constraints, the CA bundle).
    ``local_wheels=False`` leaves the wheel folders (``find-links``) out: their ``torch-X+cpu`` wheel would satisfy
    ``torch==X`` ahead of the registry's CUDA build."""
    mounts: dict[str, str] = {}
    skip = set() if local_wheels else {"find-links"}
    values = [v for k, v in os.environ.items()
              if k.startswith("PIP_") and k.removeprefix("PIP_").lower().replace("_", "-") not in skip]
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
            values += [parser[section][k] for k in PIP_PATH_KEYS if k in parser[section] and k not in skip]
    for value in values:
        for path in _paths_in(value):
            mounts.setdefault(str(path), str(path))
    return [arg for host, inside in sorted(mounts.items()) for arg in ("-v", f"{host}:{inside}:ro")]


@dataclass(frozen=True)
class Built:
    """One image built from the checkout."""

    tag: str
    seconds: float
    size_bytes: int
    torch_line: str  # docker/install.sh's "[install] done: torch ..." line, empty when the layer was cached


def build_image(engine: Engine, dockerfile: str, tag: str, torch_args: Mapping[str, str], log: Path,
                local_wheels: bool = True) -> Built:
    """Build ``tag`` from ``dockerfile`` of the checkout on :data:`BASE_IMAGE`; fails with the log's end."""
    args = ["build", "-f", dockerfile, "-t", tag, "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}"]
    for key, value in torch_args.items():
        args += ["--build-arg", f"{key}={value}"]
    if engine.name == "podman":
        args += pip_mounts(local_wheels)
    before = engine.run("image", "inspect", "--format", "{{.Id}}", tag, check=False, timeout=60).stdout.strip()
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run([engine.path, *args, str(REPO)], stdout=out, stderr=subprocess.STDOUT, text=True,
                              timeout=3600, cwd=REPO)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise EngineError(f"{tag} did not build from {dockerfile} (exit {proc.returncode}); end of {log}:\n"
                          f"{text[-4000:]}")
    after = engine.run("image", "inspect", "--format", "{{.Id}}", tag, timeout=60).stdout.strip()
    if before and before != after:  # the image the tag named before: replaced, untagged, of no further use
        engine.run("rmi", before, check=False, timeout=300)
    done = [line for line in text.splitlines() if line.startswith("[install] done:")]
    size = int(engine.run("image", "inspect", "--format", "{{.Size}}", tag, timeout=60).stdout.strip())
    return Built(tag, seconds, size, done[-1] if done else "")


def probe_torch(engine: Engine, image: str) -> dict[str, Any]:
    """What the image's Python has: torch version and CUDA build, the user id, where ``peer`` is installed."""
    out = engine.run("run", "--rm", "--entrypoint", "/opt/tasklet/bin/python", image, "-c", TORCH_PROBE,
                     timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def startup_seconds(engine: Engine, image: str) -> float:
    """Seconds from ``run -d`` of a first peer (``start``, docker/run.toml) in ``image`` to "peer server listening"."""
    name = f"tasklet-startup-{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    engine.run("run", "-d", "--name", name, "--init", "-v", f"{REPO / 'docker' / 'run.toml'}:/tasklet/run.toml:ro",
               image, "start", "--config", "/tasklet/run.toml", "--log-level", "INFO", timeout=120)
    try:
        while time.monotonic() - start < 300:
            proc = engine.run("logs", name, check=False, timeout=60)
            if "peer server listening" in proc.stdout + proc.stderr:
                return time.monotonic() - start
            time.sleep(0.2)
        raise EngineError(f"{image}: no peer listening 300 s after run -d")
    finally:
        engine.remove(name)


def dangling(engine: Engine) -> list[str]:
    """Ids of untagged images (build stages kept as the builder's cache)."""
    out = engine.run("images", "-q", "--filter", "dangling=true", check=False, timeout=60).stdout
    return out.split()


def measure(gpu: bool, log_dir: Path) -> dict[str, Any]:
    engine, reason = find_engine()
    if engine is None:
        raise EngineError(f"no container engine: {reason}")
    base_s = None if engine.has_image(BASE_IMAGE) else build_base(engine)
    wanted = [("cpu", "docker/Dockerfile.cpu", CPU_IMAGE, CPU_TORCH, True),
              ("gpu-stages-cpu", "docker/Dockerfile", GPU_STAGES_CPU_IMAGE, CPU_TORCH, True)]
    if gpu:
        wanted.append(("gpu", "docker/Dockerfile", GPU_IMAGE, GPU_TORCH, False))
    result: dict[str, Any] = {"engine": engine.name, "base_image_s": base_s, "images": {}}
    for key, dockerfile, tag, torch_args, local in wanted:
        print(f"[images] building {tag} from {dockerfile} ...", file=sys.stderr, flush=True)
        before = set(dangling(engine))
        built = build_image(engine, dockerfile, tag, torch_args, log_dir / f"build-{key}.log", local_wheels=local)
        if key == "gpu":  # its build stage (several GB) serves no other image: not kept as cache
            result["gpu_build_stage_removed"] = [i for i in dangling(engine) if i not in before]
            engine.run("rmi", *result["gpu_build_stage_removed"], check=False, timeout=300)
        facts = probe_torch(engine, tag)
        result["images"][key] = {"tag": tag, "dockerfile": dockerfile, "build_s": round(built.seconds, 1),
                                 "size_gb": round(built.size_bytes / 1e9, 2), "torch": facts["torch"],
                                 "cuda": facts["cuda"], "uid": facts["uid"], "nvidia_env": facts["nvidia"],
                                 "install": built.torch_line, "startup_s": round(startup_seconds(engine, tag), 1)}
        print(f"[images] {key}: {json.dumps(result['images'][key])}", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--gpu", action="store_true", help="also build the GPU image (a CUDA torch: several GB)")
    p.add_argument("--keep", action="store_true", help="keep the gpu images (default: removed after measuring)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tasklet-images-") as tmp:
        try:
            result = measure(args.gpu, Path(tmp))
        except EngineError as exc:
            print(f"bench.images: {exc}", file=sys.stderr)
            return 1
    if not args.keep:
        engine, _ = find_engine()
        if engine is not None:
            engine.run("rmi", GPU_STAGES_CPU_IMAGE, GPU_IMAGE, check=False, timeout=300)
    if args.json:
        print(json.dumps(result))
    else:
        for key, row in result["images"].items():
            print(f"{key:15s} {row['size_gb']:5.2f} GB  built in {row['build_s']:6.1f} s  torch {row['torch']}"
                  f" (CUDA {row['cuda']})  peer listening {row['startup_s']:.1f} s after run -d")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
