"""Small helpers for the child processes Tasklet starts (local swarms, tests, benchmarks).

Two things every launcher needs and must get right: reading a child's announcement line without hanging
forever when the child dies or stays silent, and ending a child *with everything it started* — a peer's
hivemind DHT runs in a process of its own and would outlive a SIGKILLed peer otherwise, so peers are started
in their own process group and the group is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time


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
