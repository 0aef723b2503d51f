"""A pre-importing, forking launcher of `peer` daemons, so a benchmark of N peers on one machine does not pay N
serial Python start-ups.

Why: on the internet each volunteer starts `peer join` on its own machine, all in parallel; a joiner's own
start-up (the interpreter, importing torch, hivemind and grpc: about 3.5 CPU-seconds) delays only that joiner.
Emulating 32 hosts on 2 cores serializes those start-ups: 31 joiners need about a minute of both cores before
the first protocol message, which measures the emulation, not the swarm. Here one *zygote* process imports the
heavy modules once and forks every daemon from that state. Each child then runs exactly the CLI's code path
(``peer.cli.main(["join", ...])``) as a process of its own, with its own session (process group), its own
identity (keys come from OpenSSL's fork-safe RNG; ``random``, NumPy and torch are reseeded), its own hivemind
DHT process and libp2p daemon, gRPC server and heartbeats, and its own stdout and log file.

What it does not measure: the import time a real host pays (reported by the zygote as ``import_s``, paid once
here and once per host, in parallel, there), and the memory each host would need by itself (children share the
zygote's pages copy-on-write).

Fork safety: the zygote forks only while it runs a single OS thread (it checks ``/proc/self/task`` before
every fork and refuses otherwise) and before any gRPC channel, server, event loop or DHT exists in it; its
environment pins ``OMP_NUM_THREADS=1`` so no BLAS pool is started at import. Variables read at import time
(e.g. ``TASKLET_CLOCK_OFFSET_S``) are the zygote's for every child.

Protocol (the zygote's stdin and stdout, one JSON object a line): the parent writes
``{"argv": [...], "out": PATH, "log": PATH}``; the zygote answers ``{"ready": ..., "import_s": ...}`` once,
then ``{"pid": PID, "tag": ...}`` per fork and ``{"exit": PID, "rc": RC}`` when a child ends. When its stdin
closes or its parent dies (the benchmark ended, even by SIGKILL: a process the parent forked later, such as
a hivemind DHT, may hold the pipe open, so the zygote also watches its parent) or on SIGTERM/SIGINT, the zygote
ends every child's process group (SIGTERM, then SIGKILL) and exits, so nothing it started outlives the
benchmark.

:class:`ForkedPeers` is the parent's side, with the interface of :class:`peer.emulation.procs.PeerProcesses`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tasklet.peer.emulation.procs import JOIN_LINE_PREFIX, JOIN_LINE_TIMEOUT_S, child_env

ZYGOTE_COMMAND = [sys.executable, "-m", "bench.launcher"]
READY_TIMEOUT_S = 120.0  # importing torch + hivemind on a loaded machine
STOP_GRACE_S = 15.0
# everything a daemon imports, lazily included (the leader's scheduler, the runtime, the observer, and
# torch._dynamo, which the worker's warm-up optimizer imports: 2 CPU-seconds per daemon, by py-spy)
PRELOAD = ("tasklet.peer.cli", "tasklet.peer.node.daemon", "tasklet.peer.node.leader_role",
           "tasklet.peer.runtime.lead.driver", "tasklet.peer.observe.node", "tasklet.peer.swarm.status",
           "tasklet.scheduler", "numpy", "torch", "torch._dynamo", "torch.optim", "hivemind", "grpc")


# ------------------------------------------------------------------------------------------------ zygote side
def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: fall back on Python's own count
        return threading.active_count()


def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _run_child(argv: list[str], out: str, log: str) -> None:
    """In the forked child: a session of its own, stdout/stderr to its files, fresh seeds, then the CLI."""
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it for a fresh process
    null = os.open(os.devnull, os.O_RDONLY)
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((null, 0), (out_fd, 1), (log_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    import numpy
    import torch

    numpy.random.seed()  # from OS entropy; Python's random is reseeded by the interpreter at fork
    torch.seed()
    rc = 1
    try:
        from tasklet.peer.cli import main

        sys.argv = ["peer", *argv]
        rc = main(argv)
    except SystemExit as exc:  # argparse errors
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc if isinstance(rc, int) else 1)


def _end_groups(pids: set[int], grace_s: float) -> None:
    """SIGTERM every child's group, reap until ``grace_s``, then SIGKILL the groups of those left."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    continue
            left.discard(pid)
        time.sleep(0.1)
    for pid in pids:  # also the DHT process and p2pd of a child that already exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def zygote() -> int:
    """Import once, then fork one daemon per request line (see the module docstring)."""
    started = time.monotonic()
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: stopping.append(signum))
    _emit({"ready": True, "import_s": round(time.monotonic() - started, 2),
           "import_cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "threads": _os_threads()})
    children: set[int] = set()
    buffer = b""
    stdin = sys.stdin.fileno()
    parent = os.getppid()
    try:
        while not stopping and os.getppid() == parent:  # a killed parent may leave our stdin open (see below)
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                children.discard(pid)
                _emit({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
            try:
                ready, _, _ = select.select([stdin], [], [], 0.2)
            except InterruptedError:
                continue
            if not ready:
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:
                break  # the parent is gone: end everything
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                threads = _os_threads()
                if threads != 1:
                    _emit({"error": f"refusing to fork with {threads} threads running in the launcher",
                           "tag": request.get("tag")})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child([str(a) for a in request["argv"]], str(request["out"]), str(request["log"]))
                children.add(pid)
                _emit({"pid": pid, "tag": request.get("tag")})
    finally:
        _end_groups(children, STOP_GRACE_S)
    return 0


# ------------------------------------------------------------------------------------------------ parent side
class ForkedPeers:
    """`peer` daemons forked by a zygote, peer ``i`` on 127.0.0.{i+2}, its stderr in ``log_dir/peer-{i}.log``
    and its stdout in ``log_dir/peer-{i}.out``; the same methods as ``PeerProcesses`` that the benchmarks use.

    ``import_s``/``import_cpu_s``: what the zygote's imports cost (once here; once per host in a real swarm).
    """

    def __init__(self, log_dir: Path, emulate_tflops: float | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.log_dir = log_dir
        self.emulate_tflops = emulate_tflops
        self.join_line = ""
        self._own_paths: list[str] = []  # `--config RUN.TOML` of `start`, for joiners' local paths
        self.pids: dict[int, int] = {}  # peer index -> pid (= its process group)
        self.exits: dict[int, int] = {}  # pid -> exit status
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._zygote_log: IO[str] = open(log_dir / "launcher.log", "w")  # noqa: SIM115 - closed in close()
        self.zygote = subprocess.Popen(ZYGOTE_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=self._zygote_log, text=True, env=child_env(),
                                       cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
        self._reader = threading.Thread(target=self._read_replies, name="zygote-replies", daemon=True)
        self._reader.start()
        try:
            ready = self._reply("ready", ready_timeout_s)
        except BaseException:
            self.close()
            raise
        self.import_s = float(ready["import_s"])
        self.import_cpu_s = float(ready["import_cpu_s"])

    def __enter__(self) -> ForkedPeers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_replies(self) -> None:
        assert self.zygote.stdout is not None
        for line in self.zygote.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "exit" in msg:
                self.exits[int(msg["exit"])] = int(msg["rc"])
            else:
                self._replies.put(msg)
        self._replies.put({"closed": True})

    def _reply(self, key: str, timeout_s: float) -> dict[str, Any]:
        try:
            msg = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the launcher did not answer within {timeout_s:.0f} s; see "
                               f"{self.log_dir / 'launcher.log'}") from None
        if key not in msg:
            raise RuntimeError(f"the launcher failed: {msg.get('error') or 'it exited'}; see "
                               f"{self.log_dir / 'launcher.log'}")
        return msg

    def spawn(self, i: int, args: Sequence[str]) -> int:
        """Fork ``peer ARGS --host 127.0.0.{i+2} --log-level INFO [--emulate-tflops T]`` as peer ``i``."""
        argv = [*args, "--host", f"127.0.0.{i + 2}", "--log-level", "INFO"]
        if self.emulate_tflops is not None:
            argv += ["--emulate-tflops", str(self.emulate_tflops)]
        request = {"argv": argv, "out": str(self.log_dir / f"peer-{i}.out"),
                   "log": str(self.log_dir / f"peer-{i}.log"), "tag": i}
        assert self.zygote.stdin is not None
        self.zygote.stdin.write(json.dumps(request) + "\n")
        self.zygote.stdin.flush()
        pid = int(self._reply("pid", 30.0)["pid"])
        self.pids[i] = pid
        return pid

    def start(self, config: Path, *extra: str, timeout_s: float = JOIN_LINE_TIMEOUT_S) -> str:
        """`peer start` as peer 0; return the DHT address of the join line it prints (kept in ``join_line``)."""
        self._own_paths = ["--config", str(config)]
        pid = self.spawn(0, ["start", "--config", str(config), *extra])
        out = self.log_dir / "peer-0.out"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and pid not in self.exits:
            text = out.read_text() if out.exists() else ""
            line = next((x.strip() for x in text.splitlines() if x.startswith(JOIN_LINE_PREFIX)), "")
            if line and text.endswith("\n"):
                self.join_line = line
                return line.split()[3]
            time.sleep(0.05)
        raise RuntimeError(f"the first peer did not print its join line within {timeout_s:.0f} s "
                           f"(exit status {self.exits.get(pid)}); see {self.log_dir / 'peer-0.log'}")

    def join(self, addr: str, i: int, *extra: str) -> int:
        """`peer join --dht ADDR [--config RUN.TOML]` as peer ``i`` (the run.toml `start` was given names the
        joiner's own paths on this machine)."""
        return self.spawn(i, ["join", "--dht", addr, *self._own_paths, *extra])

    def alive(self) -> int:
        return sum(pid not in self.exits for pid in self.pids.values())

    def log_text(self, i: int) -> str:
        return (self.log_dir / f"peer-{i}.log").read_text()

    def groups(self) -> list[int]:
        """Process groups of the swarm: the zygote's and every peer's (its DHT process and p2pd included)."""
        return [self.zygote.pid, *self.pids.values()]

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """End every peer (SIGTERM, then SIGKILL of its group after ``grace_s``) and the zygote."""
        for pid in self.pids.values():
            if pid not in self.exits:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.alive() and self.zygote.poll() is None:
            time.sleep(0.1)
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if self.zygote.stdin is not None:
                self.zygote.stdin.close()  # the zygote reaps what is left and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.zygote.wait(timeout=grace_s + 5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.zygote.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.zygote.wait(timeout=5)
        if self.zygote.stdout is not None:
            self.zygote.stdout.close()
        self._zygote_log.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python -m bench.launcher  (a zygote driven by bench.launcher.ForkedPeers over stdin/stdout)",
              file=sys.stderr)
        return 2
    return zygote()


if __name__ == "__main__":
    sys.exit(main())
