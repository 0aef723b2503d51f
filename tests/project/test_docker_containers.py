"""The images for real: the CPU image built from the checkout, a compose swarm and a container volunteer train.

Where podman or docker can run containers (``bash scripts/setup-test-tools.sh`` installs podman as root on
Debian) the session builds ``docker/Dockerfile.cpu`` once (``tests/support/containers.py``); elsewhere these tests skip
with the reason.

* The image: a CPU torch, the unprivileged user, ``peer`` as its entry point; the GPU image's Dockerfile builds
  and runs with the same CPU torch (its CUDA build is ``python -m bench.images --gpu``).
* ``docker/compose.yml`` as an organiser runs it (one compose run): the first peer, the 3 volunteers it says
  and the status screen. Stopping the first peer mid-run (``podman stop``/``docker stop``) writes its
  checkpoint on the ``checkpoints`` volume and ends it cleanly; the volunteers elect a leader among themselves
  and finish the run. Then, with fresh volunteers (so nobody holds a copy of a checkpoint), ``up`` again: the
  restarted first peer resumes from the checkpoint on its volume, trains to the end and saves; the saved
  parameters equal single-process training (computed in the image, on the image's own corpus).
* The same file under Compose 1.x (``docker-compose``, through podman's Docker API here) starts the 3 volunteers
  it says, and the 4 peers train.
* A volunteer container joins a swarm started outside containers, with the README's ``docker run
  --network host`` line; the run's parameters equal single-process training.
* A volunteer container behind the network-namespace bed's NAT (peer/emulation/netbed.py), started with the
  entry point's defaults: reached through the first peer's relay, it trains a stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.images import CPU_TORCH, GPU_STAGES_CPU_IMAGE, build_image, probe_torch
from tasklet.peer.emulation import procs
from tasklet.peer.emulation.multihost import RELAY_PORT, BedPeers, readme_flags
from tasklet.peer.emulation.netbed import NetBed
from tasklet.peer.emulation.reference_check import gap_to_reference
from tests.support.containers import REPO, Engine, Images, compose_project, container_images_fixture, read_json_from
from tests.support.waits import held_within, wait_for_text, wait_until

# the first test also waits for the image build (a cold one: minutes), whichever test that is
pytestmark = [pytest.mark.container, pytest.mark.usefixtures("processes"), pytest.mark.timeout(1800)]

__all__ = ["container_images_fixture"]  # the session fixture, registered by being a name of this module

TOLERANCE = 1e-5
COMPOSE_STEPS = 30  # at ~0.25 s a step, 24 after the stop step: room for a slow `podman logs` and `stop` under load
STOP_AFTER_STEP = 6
HOST_STEPS = 10

# checkpoint_every beyond the run: the only checkpoint on the volume is the one `docker stop` makes; min_peers
# is the first peer and compose's 3 volunteers, so all four train from the first plan however slowly they start
COMPOSE_RUN = f"""\
[run]
run_id = "tasklet"
steps = {COMPOSE_STEPS}
micro_batch = 2
n_microbatches = 4

[model]
n_layers = 2
d_model = 32
n_heads = 4
seq_len = 32

[swarm]
min_peers = 4
heartbeat_s = 1.0
plan_time_limit_s = 1.0
checkpoint_dir = "/tasklet/checkpoints"
checkpoint_every = 1000
save_dir = "/tasklet/checkpoints/final"
leaders = "any"  # the volunteers go on without the first peer (by default they would wait for it)
"""

GAP_SCRIPT = """\
import json, sys
from pathlib import Path
from tasklet.peer.emulation.reference_check import gap_to_reference
gap = gap_to_reference(Path("/tasklet/checkpoints/final"), {steps})
print(json.dumps({{"max_abs": gap.max_abs, "max_rel": gap.max_rel, "losses": len(gap.run["loss"])}}))
"""

STEP_LINE = re.compile(r"leader_role: step (\d+): loss")


def report(request: pytest.FixtureRequest, line: str) -> None:
    """A measured figure, in the test run's output."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[containers] {line}")


def test_cpu_image(container_images: Images) -> None:
    engine, image = container_images.engine, container_images.cpu
    assert "CUDA None" in container_images.torch_line or not container_images.torch_line, container_images.torch_line
    probe = ("import json, os, torch, tasklet.peer as peer; print(json.dumps({'cuda': torch.version.cuda,"
             " 'torch': torch.__version__, 'uid': os.getuid(), 'peer': peer.__file__}))")
    out = engine.run("run", "--rm", "--entrypoint", "/opt/tasklet/bin/python", image, "-c", probe).stdout
    facts = json.loads(out.strip().splitlines()[-1])
    assert facts["cuda"] is None, f"the CPU image has a CUDA torch: {facts}"
    assert facts["torch"].startswith("2.13.0"), facts
    assert facts["uid"] == 10001, "the peer runs unprivileged"
    assert "/opt/tasklet/" in facts["peer"] and "site-packages" in facts["peer"], facts
    helped = engine.run("run", "--rm", image, "--help").stdout
    assert "peer" in helped and "join" in helped
    # at most a few GB: a CUDA torch would add several
    assert container_images.size_bytes < 2.5e9, f"{container_images.size_bytes / 1e9:.2f} GB"


def test_gpu_dockerfile_builds_and_runs_with_a_cpu_torch(container_images: Images, tmp_path: Path,
                                                          request: pytest.FixtureRequest) -> None:
    """docker/Dockerfile's own stages with the CPU torch (its CUDA build is several GB more; bench.images builds
    it): its build stage is the CPU image's (the cache serves it), its runtime stage is its own, and the image
    runs the peer unprivileged with the NVIDIA toolkit's variables set."""
    engine = container_images.engine
    built = build_image(engine, "docker/Dockerfile", GPU_STAGES_CPU_IMAGE, CPU_TORCH, tmp_path / "build.log")
    try:
        facts = probe_torch(engine, GPU_STAGES_CPU_IMAGE)
        assert facts["cuda"] is None and facts["torch"].startswith("2.13.0"), facts
        assert facts["uid"] == 10001 and facts["nvidia"] == "all", facts
        layers = {tag: engine.run("image", "inspect", "--format", "{{json .RootFS.Layers}}", tag).stdout
                  for tag in (container_images.cpu, GPU_STAGES_CPU_IMAGE)}
        venv_layer = json.loads(layers[container_images.cpu])[2]  # base, user and folders, /opt/tasklet
        assert venv_layer in json.loads(layers[GPU_STAGES_CPU_IMAGE]), "the two images do not share the venv layer"
        assert "join" in engine.run("run", "--rm", GPU_STAGES_CPU_IMAGE, "--help").stdout
    finally:
        engine.run("rmi", GPU_STAGES_CPU_IMAGE, check=False, timeout=300)
    report(request, f"docker/Dockerfile with a CPU torch built in {built.seconds:.0f} s, "
                    f"{built.size_bytes / 1e9:.2f} GB")


def test_compose_swarm_trains_survives_stop_and_resumes(container_images: Images, tmp_path: Path,
                                                        request: pytest.FixtureRequest) -> None:
    engine = container_images.engine
    run_file = tmp_path / "run.toml"
    run_file.write_text(COMPOSE_RUN)
    run_file.chmod(0o644)  # read by the container's unprivileged user
    env = {"TASKLET_RUN_FILE": str(run_file), "TASKLET_VOLUNTEERS": "3"}
    with compose_project(engine, f"tasklet-test-{os.getpid()}", env) as project:
        start = time.monotonic()
        project("up", "-d", "--no-build")
        [first] = project.containers("first")
        volunteers = project.containers("volunteer")
        assert len(volunteers) == 3, f"compose started {volunteers}, not the 3 volunteers the file says"
        [status] = project.containers("status")

        def trained() -> int:
            steps = [int(s) for s in STEP_LINE.findall(project.logs(first))]
            return max(steps, default=-1) + 1

        def everything() -> str:
            return "\n".join(f"--- {c}\n{project.logs(c)[-2500:]}" for c in project.containers())

        # 1. all four peers train
        wait_until(lambda: trained() >= STOP_AFTER_STEP, 300, f"step {STOP_AFTER_STEP}", 1.0, detail=everything)
        first_log = project.logs(first)
        assert "4 peers live" in first_log or "over 4 peers" in first_log, first_log[-3000:]
        assert "--resume: no usable checkpoint" in first_log, "a fresh volume has no checkpoint: start at step 0"

        # 2. docker stop: the first peer writes its checkpoint on the volume and ends cleanly
        before_stop = trained()
        stop_start = time.monotonic()
        engine.run("stop", "-t", "60", first, timeout=120)
        stop_s = time.monotonic() - stop_start
        assert project.state(first) == ("exited", 0), project.logs(first)[-3000:]
        written = [int(s) for s in re.findall(r"checkpoint of step (\d+) written", project.logs(first))]
        assert len(written) == 1 and written[0] >= before_stop, f"checkpoints written: {written}"
        stopped_at = written[0]
        latest = read_json_from(engine, container_images.cpu, {project.volume("checkpoints"): "/tasklet/checkpoints"},
                                "import json; from pathlib import Path; "
                                "print(json.dumps(Path('/tasklet/checkpoints/latest').read_text().strip()))")
        assert latest == f"step-{stopped_at:06d}", latest

        # 3. the volunteers elect a leader among themselves and finish the run without the first peer
        wait_until(lambda: all(project.state(v)[0] == "exited" for v in volunteers), 300, "the volunteers finish", 1.0,
                   detail=everything)
        assert [project.state(v)[1] for v in volunteers] == [0, 0, 0], everything()
        finished = [v for v in volunteers if f"run finished: {COMPOSE_STEPS} steps" in project.logs(v)]
        assert len(finished) == 1, f"one volunteer leads to the end, not {finished}:\n{everything()}"
        takeover_s = time.monotonic() - start

        # 4. fresh volunteers (no checkpoint copies anywhere), `up` again: the same first container restarts and
        #    resumes from the checkpoint on its volume
        engine.remove(*volunteers)
        project("up", "-d", "--no-build")
        assert project.containers("first") == [first], "the first peer's container is restarted, not replaced"
        assert len(project.containers("volunteer")) == 3
        wait_until(lambda: project.state(first)[0] == "exited", 400, "the restarted first peer finishes", 1.0,
                   detail=everything)
        first_log = project.logs(first)
        assert project.state(first) == ("exited", 0), first_log[-3000:]
        assert f"resuming from the checkpoint of step {stopped_at}" in first_log, first_log[-3000:]
        assert f"run finished: {COMPOSE_STEPS} steps" in first_log

        # 5. the saved parameters equal single-process training, in the image (its Python is its corpus)
        gap = read_json_from(engine, container_images.cpu, {project.volume("checkpoints"): "/tasklet/checkpoints"},
                             GAP_SCRIPT.format(steps=COMPOSE_STEPS))
        assert gap["losses"] == COMPOSE_STEPS - stopped_at, gap  # run.json has the losses of the resumed run
        assert gap["max_abs"] < TOLERANCE, f"parameters {gap['max_abs']:.2e} off single-process training"
        status_log = project.logs(status)
        assert "plan: epoch" in status_log and "leader" in status_log, status_log[-2000:]
        total_s = time.monotonic() - start
    report(request, f"compose ({engine.name}): up to takeover finish {takeover_s:.0f} s, stop {stop_s:.1f} s, "
                    f"whole test {total_s:.0f} s; stopped at step {stopped_at}, gap {gap['max_abs']:.1e}")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _shared_corpus(tmp_path: Path) -> Path:
    """A text file for both sides: the image's Python differs from this one, and so do their standard
    libraries (the default corpus), which peers would refuse each other for."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text())
    corpus.chmod(0o644)  # read by the container's unprivileged user
    return corpus


def _host_run(tmp_path: Path, corpus: Path, save: Path, extra_swarm: str = "") -> Path:
    config = tmp_path / "run.toml"
    config.write_text(f"""\
[run]
run_id = "tasklet"
steps = {HOST_STEPS}
micro_batch = 2
n_microbatches = 4
corpus = {json.dumps(str(corpus))}
[model]
n_layers = 2
d_model = 32
seq_len = 32
[swarm]
min_peers = 2
heartbeat_s = 1.0
plan_time_limit_s = 1.0
save_dir = {json.dumps(str(save))}
{extra_swarm}
""")
    return config


@contextlib.contextmanager
def docker_api(engine: Engine, folder: Path) -> Iterator[str]:
    """A Docker API socket for Compose 1.x: docker's own, or podman's (``podman system service``) for the test."""
    if engine.name == "docker":
        yield os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return
    sock = folder / "docker.sock"
    with (folder / "podman-service.log").open("w") as log:
        service = subprocess.Popen([engine.path, "system", "service", "--time=0", f"unix://{sock}"],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(sock.exists, 30, "podman's Docker API socket", 0.2, alive=service)
        yield f"unix://{sock}"
    finally:
        service.terminate()
        try:
            service.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait(timeout=10)


def test_compose_1_starts_the_volunteers_the_file_says(container_images: Images, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    """Compose 1.x (``docker-compose``, Debian's 1.29) runs the same file through the Docker API (podman's here):
    ``up`` starts the first peer, the 3 volunteers of ``deploy.replicas`` and the status screen, and the first
    peer trains with all 4."""
    compose_1 = shutil.which("docker-compose")
    if compose_1 is None:
        pytest.skip("no docker-compose (bash scripts/setup-test-tools.sh installs Debian's as root)")
    engine = container_images.engine
    run_file = tmp_path / "run.toml"
    run_file.write_text(COMPOSE_RUN)
    run_file.chmod(0o644)
    with docker_api(engine, tmp_path) as host, compose_project(
            engine, f"tasklet-dc-{os.getpid()}", {"TASKLET_RUN_FILE": str(run_file), "DOCKER_HOST": host},
            command=[compose_1]) as project:
        start = time.monotonic()
        up = subprocess.Popen([*project.base, "up", "-d", "--no-build"], env=project.env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # docker-compose starts the volunteers once the first peer is healthy; podman without systemd runs
            # no healthcheck by itself, so the test runs it, as docker's engine would every `interval`
            def up_done() -> bool:
                if up.poll() is not None:
                    return True
                for first in project.containers("first") if engine.name == "podman" else []:
                    engine.run("healthcheck", "run", first, check=False, timeout=60)
                return False

            held_within(up_done, 300 - (time.monotonic() - start), 1.0)  # `up`'s exit status says the rest
            out, _ = up.communicate(timeout=10)
        finally:
            if up.poll() is None:
                up.kill()
                up.wait(timeout=10)
        assert up.returncode == 0, f"docker-compose up exited {up.returncode}:\n{out[-3000:]}"
        volunteers = project.containers("volunteer")
        assert len(volunteers) == 3, f"docker-compose started {volunteers}, not the 3 volunteers the file says"
        assert len(project.containers("first")) == len(project.containers("status")) == 1
        [first] = project.containers("first")

        def everything() -> str:
            return "\n".join(f"--- {c}\n{project.logs(c)[-2500:]}" for c in project.containers())

        wait_until(lambda: STEP_LINE.search(project.logs(first)), 300, "a step over 4 peers", 1.0, detail=everything)
        log = project.logs(first)
        assert "4 peers live" in log or "over 4 peers" in log, log[-3000:]
    report(request, f"docker-compose 1.29 (Docker API of {engine.name}): 4 peers trained "
                    f"{time.monotonic() - start:.0f} s after `up -d`")


def test_volunteer_container_joins_a_host_swarm(container_images: Images, tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    """The README's `docker run --network host ... join` next to a `peer start` outside any container. The
    two Pythons differ, and so do their standard libraries: the run trains a text file both mount."""
    engine = container_images.engine
    corpus, save = _shared_corpus(tmp_path), tmp_path / "save"
    config = _host_run(tmp_path, corpus, save)
    host_ip, box_ip = "127.0.0.81", "127.0.0.82"
    flags = ["--log-level", "INFO"]
    name = f"tasklet-volunteer-{os.getpid()}"
    first, log = procs.launch([*procs.PEER_COMMAND, "start", "--config", str(config), "--host", host_ip,
                               "--dht-host", host_ip, "--port", str(free_port(host_ip)), "--dht-port",
                               str(free_port(host_ip)), "--bulk-port", "off", *flags],
                              tmp_path / "first.log", env=procs.child_env(), cwd=tmp_path)
    assert log is not None
    try:
        line = procs.read_line(first, 120, procs.JOIN_LINE_PREFIX)
        assert line, (tmp_path / "first.log").read_text()[-3000:]
        dht = line.split()[3]
        port = free_port(box_ip)
        engine.run("run", "-d", "--name", name, "--network", "host", "--init",
                   "-v", f"{corpus}:/tasklet/corpus.txt:ro", container_images.cpu,
                   "join", "--dht", dht, "--announce", f"{box_ip}:{port}",
                   "--host", box_ip, "--dht-host", box_ip, "--port", str(port), "--dht-port", str(free_port(box_ip)),
                   "--bulk-port", str(free_port(box_ip)), "--data", "/tasklet/corpus.txt", *flags)

        def box_log() -> str:
            proc = engine.run("logs", name, check=False)
            return proc.stdout + proc.stderr

        startup_s = wait_for_text(box_log, "peer server listening", 180, "the container's peer", 1.0)
        assert first.wait(timeout=400) == 0, (tmp_path / "first.log").read_text()[-3000:]
        wait_until(lambda: engine.run("inspect", "--format", "{{.State.Status}}", name).stdout.strip() == "exited", 120,
                   "the volunteer leaves", 1.0, detail=box_log)
        code = engine.run("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", box_log()[-3000:]
        assert "assigned stage" in box_log(), "the container trained a stage"
    finally:
        procs.kill_group(first)
        first.wait(timeout=10)
        if first.stdout:
            first.stdout.close()
        log.close()
        engine.remove(name)
    gap = gap_to_reference(save, HOST_STEPS)
    assert len(gap.run["loss"]) == HOST_STEPS
    assert gap.max_abs < TOLERANCE, f"parameters {gap.max_abs:.2e} off single-process training"
    report(request, f"container volunteer ({engine.name}): peer listening {startup_s:.1f} s after `run -d`")



def test_volunteer_container_behind_nat(container_images: Images, bed: NetBed, tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:
    """A home volunteer's Docker: the container runs in a host of the network-namespace bed behind a NAT
    router that forwards nothing, started with the entry point's defaults and no --announce. The first peer
    on a public host offers a relay; the container's peer is reached through it and holds a stage."""
    engine = container_images.engine
    corpus, save = _shared_corpus(tmp_path), tmp_path / "save"
    config = _host_run(tmp_path, corpus, save, extra_swarm="stages = 2")
    pub, home = bed.add_public("pub0"), bed.add_home("home0")
    name = f"tasklet-nat-{os.getpid()}"
    with BedPeers(tmp_path / "logs") as peers:
        dht = peers.start(pub, config, *readme_flags(pub), "--relay-port", str(RELAY_PORT))
        try:
            engine.run("run", "-d", "--name", name, "--network", f"ns:/run/netns/{home.ns}", "--init",
                       "-v", f"{corpus}:/tasklet/corpus.txt:ro", container_images.cpu,
                       "join", "--dht", dht, "--data", "/tasklet/corpus.txt", "--log-level", "INFO")

            def box_log() -> str:
                proc = engine.run("logs", name, check=False)
                return proc.stdout + proc.stderr

            def state() -> tuple[str, str]:
                status, code = engine.run("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                                          name).stdout.split()
                return status, code

            # both end when the run does; a container that fails early ends the wait at once
            wait_until(lambda: state()[0] == "exited", 400, "the run ends", 1.0, detail=box_log)
            code = state()[1]
            codes = peers.wait_all(120)
            log = box_log()
        finally:
            engine.remove(name)
    assert codes == {"pub0": 0}, f"{codes}\n{peers.log('pub0')[-3000:]}"
    assert code == "0", log[-3000:]
    assert "reached through relay" in log, log[-3000:]
    assert "assigned stage" in log, "the container behind NAT trained a stage"
    gap = gap_to_reference(save, HOST_STEPS)
    assert gap.max_abs < TOLERANCE, f"parameters {gap.max_abs:.2e} off single-process training"
