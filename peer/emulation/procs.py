"""The one launcher of the child processes Tasklet starts on this machine (``peer swarm``, tests, benchmarks).

Three things every launcher needs and must get right: starting a child in its own process group with its
stderr in a log file, reading its announcement line without hanging forever when the child dies or stays
silent, and ending the child *with everything it started* — a peer's hivemind DHT runs in a process of its
own and would outlive a SIGKILLed peer otherwise, so the whole group is killed.

:class:`PeerProcesses` runs `peer start` / `peer join` processes on loopback addresses (127.0.0.2, ...) for
``peer swarm`` (``peer.emulation.daemon_swarm``), tests and benchmarks; ``peer.emulation.local`` starts bare
workers with :func:`launch` and :func:`read_line`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

PEER_COMMAND = [sys.executable, "-m", "tasklet.peer.cli"]
JOIN_LINE_TIMEOUT_S = 90.0  # a first peer prints its join line within this (DHT start, device measurement)
JOIN_LINE_PREFIX = "peer join --dht "


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: unbuffered output, one compute thread (children share cores)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(extra or {}))


def launch(
    cmd: Sequence[str],
    log_path: Path | None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    own_group: bool = True,
) -> tuple[subprocess.Popen[str], IO[str] | None]:
    """Start ``cmd`` with stdout piped (text) and stderr in ``log_path`` (or discarded); return it and the log.

    ``own_group``: a new session, so :func:`kill_group` ends the child and every process it started. The
    caller closes the returned log file once the child has ended.
    """
    log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 - the caller closes it
    stderr: IO[str] | int = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=dict(env) if env is not None else child_env(), cwd=cwd,
                            start_new_session=own_group)
    return proc, log


def organiser_flag(join_line: str) -> list[str]:
    """``["--organiser", ID]`` as a join line names it (nothing for a line without one)."""
    words = join_line.split()
    return words[words.index("--organiser"):][:2] if "--organiser" in words[:-1] else []


def read_line(proc: subprocess.Popen[str], timeout_s: float, prefix: str = "") -> str:
    """The first line of ``proc``'s stdout that starts with ``prefix`` (stripped), or "" after ``timeout_s``.

    The read runs in a helper thread, so a child that never prints (or dies) cannot block the caller.
    """
    found: list[str] = []

    def scan() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    reader = threading.Thread(target=scan, name="read-line", daemon=True)
    reader.start()
    reader.join(timeout_s)
    return found[0] if found else ""


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session=True``); quiet if gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_all(procs: list[subprocess.Popen[str]], grace_s: float, *, ask_first: bool = True) -> None:
    """End every process: SIGTERM (at once, or after ``grace_s`` for those that did not exit by themselves when
    ``ask_first`` is False), wait up to ``grace_s`` for a graceful exit, then SIGKILL the process group, so
    nothing a child started survives it."""
    if ask_first:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if ask_first:
                p.kill()
            else:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            p.wait(timeout=5)
        kill_group(p)
        if p.stdout:
            p.stdout.close()


def status_json(addr: str, *extra: str) -> dict:
    """`peer status --dht ADDR --json` (a real CLI process), parsed; AssertionError when it fails."""
    proc = subprocess.run([*PEER_COMMAND, "status", "--dht", addr, "--json", *extra], capture_output=True, text=True,
                          timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def poll_until(read: Callable[[], dict], predicate: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
    """Call ``read`` (e.g. a `peer status --json`) about once a second until ``predicate`` holds; a read that
    fails (a status call timing out on a busy machine, a half-written answer) is retried, not fatal."""
    deadline, last = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            last = read()
        except (AssertionError, json.JSONDecodeError, subprocess.TimeoutExpired):
            time.sleep(1.0)
            continue
        if predicate(last):
            return last
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(last)[:3000]}")


def write_small_config(folder: Path, steps: int, *, secret: str = "", min_peers: int = 1, stages: int = 0,
                       heartbeat_s: float = 1.0, extra: str = "", leaders: str | list[str] | None = None) -> Path:
    """``folder/run.toml`` of a small run (4-layer GPT, 8 micro-batches of 2 sequences of 32 tokens) that a few
    CPU peers train in seconds a step; ``extra`` is appended TOML (to [swarm] unless it opens a section).
    ``leaders``: ``[swarm] leaders`` ("any": a run whose organiser dies goes on under an elected member)."""
    lines = ["[run]", 'run_id = "tasklet"', f"steps = {steps}", "micro_batch = 2", "n_microbatches = 8",
             "[model]", "n_layers = 4", "d_model = 32", "seq_len = 32",
             "[swarm]", f"min_peers = {min_peers}", f"stages = {stages}", f"heartbeat_s = {heartbeat_s}",
             f"secret = {json.dumps(secret)}", "plan_time_limit_s = 1.0"]
    if leaders is not None:
        lines.append(f"leaders = {json.dumps(leaders)}")
    path = folder / "run.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


class PeerProcesses:
    """`peer` processes on loopback, peer ``i`` on 127.0.0.{i+2} logging to ``log_dir/peer-{i}.log``.

    ``emulate_tflops``: every peer emulates a device of that speed (``--emulate-tflops``), else none is passed.
    ``env``: the peers' environment (default :func:`child_env`: one compute thread each, as peers sharing a
    machine's cores need).
    ``close()`` (or ``with``) ends whatever is still running, with everything it started.
    """

    def __init__(self, log_dir: Path, emulate_tflops: float | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.emulate_tflops = emulate_tflops
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []
        self.join_line = ""  # what the first peer printed for others to run
        self._own_paths: list[str] = []  # `--config RUN.TOML` of `start`, for joiners' local paths
        self._logs: list[IO[str]] = []

    def __enter__(self) -> PeerProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, i: int, args: Sequence[str]) -> subprocess.Popen[str]:
        """Run ``peer ARGS --host 127.0.0.{i+2} --log-level INFO [--emulate-tflops T]`` as peer ``i``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [*PEER_COMMAND, *args, "--host", f"127.0.0.{i + 2}", "--log-level", "INFO"]
        if self.emulate_tflops is not None:
            cmd += ["--emulate-tflops", str(self.emulate_tflops)]
        proc, log = launch(cmd, self.log_dir / f"peer-{i}.log", env=self.env)
        assert log is not None
        self._logs.append(log)
        self.procs.append(proc)
        return proc

    def start(self, config: Path, *extra: str, timeout_s: float = JOIN_LINE_TIMEOUT_S) -> str:
        """`peer start` as peer 0; return the DHT address from the join line it prints (kept in ``join_line``)."""
        self._own_paths = ["--config", str(config)]
        proc = self.spawn(0, ["start", "--config", str(config), *extra])
        line = read_line(proc, timeout_s, JOIN_LINE_PREFIX)
        if not line:
            raise RuntimeError(f"the first peer did not print its join line within {timeout_s:.0f} s "
                               f"(exit status {proc.poll()}); see {self.log_dir / 'peer-0.log'}")
        self.join_line = line
        return line.split()[3]

    def join(self, addr: str, i: int, *extra: str) -> subprocess.Popen[str]:
        """`peer join --dht ADDR [--config RUN.TOML]` as peer ``i``: the run.toml `start` was given names the
        joiner's own paths (data, model, checkpoint folder) on this machine."""
        return self.spawn(i, ["join", "--dht", addr, *organiser_flag(self.join_line), *self._own_paths, *extra])

    def kill(self, i: int) -> None:
        """SIGKILL peer ``i`` and everything it started: a machine that vanished."""
        kill_group(self.procs[i])
        self.procs[i].wait(timeout=10)

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def join_address(self, i: int) -> str:
        """The DHT address peer ``i`` logged ("others can join through this peer: peer join --dht ADDR")."""
        for line in self.log_text(i).splitlines():
            if "others can join through this peer: " + JOIN_LINE_PREFIX in line:
                return line.split("--dht ")[1].split()[0]
        raise RuntimeError(f"peer {i} logged no join address")

    def log_text(self, i: int) -> str:
        return (self.log_dir / f"peer-{i}.log").read_text()

    def close(self, grace_s: float = 15.0, *, ask_first: bool = True) -> None:
        """End every peer (see :func:`stop_all`); ``ask_first=False`` gives peers ``grace_s`` to leave by
        themselves first, as they do when their run is done."""
        stop_all(self.procs, grace_s, ask_first=ask_first)
        for f in self._logs:
            f.close()
        self._logs = []


def run_to_end(folder: Path, cfg: Path, peers: int, deadline_s: float, *, device: str = "cpu",
               env: Mapping[str, str] | None = None, poll_s: float = 0.5) -> tuple[bool, list[str]]:
    """``peer start`` on ``cfg`` and ``peers - 1`` joiners, until the first (the leader) exits at the run's end or
    ``deadline_s``; every peer is then stopped. Returns (whether the run ended, each peer's log)."""
    t0 = time.monotonic()
    with PeerProcesses(folder / "logs", env=env) as procs:
        addr = procs.start(cfg, "--device", device)
        for i in range(1, peers):
            procs.join(addr, i, "--device", device)
        while procs.procs[0].poll() is None and time.monotonic() - t0 < deadline_s:
            time.sleep(poll_s)
        finished = procs.procs[0].poll() is not None
        procs.close(grace_s=20.0, ask_first=False)
        return finished, [procs.log_text(i) for i in range(peers)]
