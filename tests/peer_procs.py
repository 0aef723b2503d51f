"""Test helper: start `peer` processes on loopback and make sure every one of them ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

from peer.emulation.procs import kill_group, read_line, stop_all

PEER = [sys.executable, "-m", "peer.cli"]


def write_config(folder: Path, steps: int, *, secret: str = "", min_peers: int = 1, stages: int = 0,
                 heartbeat_s: float = 1.0, tflops: float | None = None, extra: str = "") -> Path:
    """A small run.toml: 4-layer GPT, 8 micro-batches of 2 sequences of 32 tokens."""
    lines = ["[run]", 'run_id = "tasklet"', f"steps = {steps}", "micro_batch = 2", "n_microbatches = 8",
             "[model]", "n_layers = 4", "d_model = 32", "seq_len = 32",
             "[swarm]", f"min_peers = {min_peers}", f"stages = {stages}", f"heartbeat_s = {heartbeat_s}",
             f"secret = {json.dumps(secret)}", "plan_time_limit_s = 1.0"]
    path = folder / "run.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


class PeerProcs:
    """Peer processes of one test; ``close()`` (or ``with``) kills whatever is still running."""

    def __init__(self, folder: Path, tflops: float = 0.001) -> None:
        self.folder = folder
        self.tflops = str(tflops)
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[IO[str]] = []

    def __enter__(self) -> PeerProcs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[str]:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 - closed in close()
        self.logs.append(log)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        # own process group: the peer's children (hivemind's DHT process, the libp2p daemon) die with it
        proc = subprocess.Popen([*PEER, *args], stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self, config: Path, *extra: str, host: str = "127.0.0.2", timeout: float = 90.0) -> str:
        """`peer start`; return the DHT address from its join line."""
        proc = self.spawn(["start", "--config", str(config), "--host", host, "--emulate-tflops", self.tflops,
                           "--log-level", "INFO", *extra], "peer-0")
        line = read_line(proc, timeout)
        if not line.startswith("peer join --dht "):
            raise RuntimeError(f"peer start printed {line!r}; see {self.folder / 'peer-0.log'}")
        return line.split()[3]

    def join(self, addr: str, i: int, *extra: str) -> subprocess.Popen[str]:
        return self.spawn(["join", "--dht", addr, "--host", f"127.0.0.{i + 2}", "--emulate-tflops", self.tflops,
                           "--log-level", "INFO", *extra], f"peer-{i}")

    def kill(self, i: int) -> None:
        """SIGKILL peer ``i`` and everything it started: a machine that vanished."""
        kill_group(self.procs[i])
        self.procs[i].wait(timeout=10)

    def join_address(self, i: int) -> str:
        """The DHT address peer ``i`` logged ("others can join through this peer: peer join --dht ADDR")."""
        for line in self.log_text(i).splitlines():
            if "others can join through this peer: peer join --dht " in line:
                return line.split("--dht ")[1].split()[0]
        raise RuntimeError(f"peer {i} logged no join address")

    def log_text(self, i: int) -> str:
        return (self.folder / f"peer-{i}.log").read_text()

    def close(self) -> None:
        stop_all(self.procs, 15.0)
        for f in self.logs:
            f.close()
