"""Real `peer` processes on the hosts of a network-namespace test bed (peer/emulation/netbed.py), started with the
README's internet commands; used by tests/swarms/test_multihost.py and bench/reachability.py.

Every peer runs ``ip netns exec <host> peer start|join --host 0.0.0.0 --port 31400 --bulk-port 31403
--dht-host 0.0.0.0 --dht-port 31401 --announce ADDR:31400`` (``ADDR`` the host's public address, its router's for a
home host), logs to ``log_dir/<host>.log`` and is killed with its whole process group at the end.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path
from typing import IO

from tasklet.peer.emulation.netbed import Host
from tasklet.peer.emulation.procs import (
    JOIN_LINE_PREFIX,
    PEER_COMMAND,
    child_env,
    kill_group,
    launch,
    organiser_flag,
    read_line,
)
from tasklet.peer.emulation.reference_check import gap_to_reference

REPO = Path(__file__).resolve().parents[2]
GRPC_PORT, DHT_PORT, RELAY_PORT, BULK_PORT = 31400, 31401, 31402, 31403


def readme_flags(host: Host, announce: bool = True) -> list[str]:
    """The README's flags for a peer on ``host`` (``announce``: with --announce of the address others see)."""
    flags = ["--host", "0.0.0.0", "--port", str(GRPC_PORT), "--bulk-port", str(BULK_PORT), "--dht-host", "0.0.0.0",
             "--dht-port", str(DHT_PORT)]
    return [*flags, "--announce", f"{host.addr}:{GRPC_PORT}"] if announce else flags


class BedPeers:
    """`peer` processes in a bed; ``close()`` kills them all (the bed also kills what is left in its hosts)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self._logs: list[IO[str]] = []
        self._own_paths: list[str] = []  # `--config RUN.TOML` of `start`: the joiners' local paths (shared disk)
        self.join_line = ""  # what `peer start` printed (its --organiser goes to every joiner)

    def spawn(self, host: Host, args: list[str]) -> subprocess.Popen[str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = host.cmd(*PEER_COMMAND, *args, "--log-level", "INFO")
        proc, log = launch(cmd, self.log_dir / f"{host.name}.log", env=child_env(), cwd=REPO)
        assert log is not None
        self._logs.append(log)
        self.procs[host.name] = proc
        return proc

    def start(self, host: Host, config: Path, *flags: str, timeout_s: float = 120) -> str:
        """`peer start` on ``host``; the DHT address of the join line it prints."""
        self._own_paths = ["--config", str(config)]
        proc = self.spawn(host, ["start", "--config", str(config), *flags])
        line = read_line(proc, timeout_s, JOIN_LINE_PREFIX)
        if not line:
            raise RuntimeError(f"peer start on {host.name} printed no join line (exit {proc.poll()}):\n"
                               f"{self.log(host.name)[-3000:]}")
        self.join_line = line
        return line.split()[3]

    def join(self, host: Host, dht: str, *flags: str) -> subprocess.Popen[str]:
        return self.spawn(host, ["join", "--dht", dht, *organiser_flag(self.join_line), *self._own_paths, *flags])

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_all(self, timeout_s: float) -> dict[str, int | None]:
        """Wait until every peer exits (or the time is up); their exit codes (None: still running)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return {name: proc.poll() for name, proc in self.procs.items()}

    def kill(self, name: str) -> None:
        kill_group(self.procs[name])
        self.procs[name].wait(timeout=10)

    def stop(self, name: str, grace_s: float = 30.0) -> int | None:
        """Ask ``name`` to leave the swarm (SIGTERM, as a volunteer's Ctrl-C); killed if it has not exited within
        ``grace_s``. Its exit code (None: killed)."""
        proc = self.procs[name]
        proc.terminate()
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill(name)
            return None

    def close(self) -> None:
        for proc in self.procs.values():
            kill_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()
        for log in self._logs:
            log.close()
        self._logs = []

    def __enter__(self) -> BedPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_config(folder: Path, steps: int, min_peers: int, save: Path, stages: int = 0,
                 extra: str = "") -> Path:
    """A small run (4-layer GPT) that CPU peers train in about a second a step, saving to ``save``."""
    lines = ["[run]", 'run_id = "tasklet"', f"steps = {steps}", "micro_batch = 2", "n_microbatches = 8",
             "[model]", "n_layers = 4", "d_model = 32", "seq_len = 32",
             "[swarm]", f"min_peers = {min_peers}", f"stages = {stages}", "heartbeat_s = 1.0",
             "plan_time_limit_s = 1.0", f"save_dir = {json.dumps(str(save))}"]
    path = folder / "run.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def max_error_vs_reference(save: Path, steps: int) -> tuple[float, dict]:
    """The largest absolute difference between the saved parameters and single-process training, and run.json.

    Absolute, not relative to each tensor's scale: a tensor that is still near zero after a few steps (a bias)
    would turn float summation order into a large relative figure."""
    gap = gap_to_reference(save, steps)
    return gap.max_abs, gap.run


_STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO tasklet.peer.node.leader_role: "
                        r"step (\d+):", re.M)


def step_times(log: str) -> dict[int, float]:
    """Step -> the wall-clock time (seconds since the epoch) a leader's log says it was done (the last, if redone)."""
    return {int(step): time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3
            for stamp, ms, step in _STEP_LINE.findall(log)}


def steps_per_s(log: str, start: float, end: float) -> float:
    """Steps a leader's log says were done between wall-clock times ``start`` and ``end``, per second."""
    done = sum(1 for t in step_times(log).values() if start < t <= end)
    return done / max(1e-9, end - start)
