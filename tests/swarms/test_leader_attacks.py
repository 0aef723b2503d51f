"""Elected members that lead to harm: every honest worker refuses their orders and the run ends as it should.

Real `peer` processes with the organiser's opt-in ``[swarm] leaders = "any"``; the attackers are real `peer join`s
with patched methods, as volunteers running a modified client would. Attacker A joins second, attacker B third,
so once the organiser's peer is killed the members elect A (the oldest by the others' testimony), and B after it.
As leader, A orders in every assignment a learning rate 1,000x the signed one, spot checks off, a model twice as
wide (over twice the memory of the signed one), and its stage state fetched from a canary port; B never plans,
and its beats say the run is "done" at the step it took over. Every honest worker refuses each order (the fields
named in its log) and the early "done", never dials the canary, deposes each attacker in turn, and none leaves
before the signed last step: an honest survivor takes over and the saved parameters equal single-process training
within 1e-5. The honest peers' peak resident memory is measured and bounded. The test fails loudly if either
attacker never led.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tasklet.peer.emulation.procs import PeerProcesses, child_env, launch, poll_until, write_small_config
from tasklet.peer.emulation.reference_check import gap_to_reference

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

STEPS = 10
HONEST = (3, 4)  # peers 1 and 2 are the attackers A and B
RSS_LIMIT_MB = 2500  # a tiny model's peer (torch, gRPC, the DHT's child process not counted) stays far below
PATCHED = '''\
"""A volunteer's modified client that, once it leads, orders harm; then the ordinary CLI."""
import dataclasses
import sys

from tasklet.peer.node.leader_role import LeaderRole
from tasklet.peer.runtime import control as ctl
from tasklet.peer.swarm.progress import ProgressBoard

MODE, CANARY = sys.argv.pop(1), sys.argv.pop(1)
honest_envelope = ctl.StageAssignment.to_envelope


def to_envelope(self):
    spec = self.run
    bad = dataclasses.replace(spec, optim=dataclasses.replace(spec.optim, lr=spec.optim.lr * 1000), spot_check=0.0,
                              model=dataclasses.replace(spec.model, d_model=spec.model.d_model * 2))
    source = ctl.StateSource(kind=ctl.SourceKind.FETCH, step=self.source.step, endpoint=CANARY, grant="forged")
    return honest_envelope(dataclasses.replace(self, run=bad, source=source))


honest_publish = ProgressBoard.publish


def publish(self, payload):
    return honest_publish(self, {**payload, "state": "done"})  # its beats say "done" at whatever step it is at


if MODE == "orders":
    ctl.StageAssignment.to_envelope = to_envelope
else:  # it leads without ever planning: its beat is all the followers see of it
    ProgressBoard.publish = publish
    LeaderRole._lead = lambda self: self.stop_event.wait()

from tasklet.peer.cli import main

sys.exit(main())
'''


class Canary:
    """A TCP port nobody of the run has: it counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def test_an_elected_member_ordering_harm_is_refused_by_every_honest_worker(tmp_path: Path) -> None:
    cfg = write_small_config(tmp_path, steps=STEPS, min_peers=5, stages=1, leaders="any")
    script = tmp_path / "patched_peer.py"
    script.write_text(PATCHED)
    canary = Canary()
    saves = {i: tmp_path / f"result-{i}" for i in HONEST}
    peaks: dict[int, float] = {}
    try:
        with PeerProcesses(tmp_path, emulate_tflops=0.0001) as procs:  # about a second a step
            addr = procs.start(cfg)
            for i, mode in ((1, "orders"), (2, "done")):  # A, then B: the order of their seniority
                cmd = [sys.executable, str(script), mode, canary.endpoint, "join", "--dht", addr, "--config", str(cfg),
                       "--host", f"127.0.0.{i + 2}", "--log-level", "INFO", "--emulate-tflops", "0.0001"]
                proc, log = launch(cmd, procs.log_dir / f"peer-{i}.log", env=child_env())
                procs._logs.append(log)
                procs.procs.append(proc)
                poll_until(lambda i=i: {"up": "announced" in procs.log_text(i)}, lambda s: s["up"], 60, "a join")
            for i in HONEST:
                procs.join(addr, i, "--save-dir", str(saves[i]))
            # the organiser's log says when the five (min_peers) train: a `peer status` per poll is slow enough
            # under load for the ten steps to end before the organiser is killed
            poll_until(lambda: {"log": procs.log_text(0)}, lambda s: "leader_role: step 2:" in s["log"], 180,
                       "five peers training")
            procs.kill(0)  # the organiser's peer dies: under "any" the members elect the oldest, attacker A
            for i in (1, 2):
                poll_until(lambda i=i: {"led": "leads the swarm" in procs.log_text(i)}, lambda s: s["led"], 90,
                           f"attacker {'AB'[i - 1]} to lead (it never reached its position)")
            honest = {i: procs.procs[i] for i in HONEST}
            deadline = time.monotonic() + 300
            while any(p.poll() is None for p in honest.values()) and time.monotonic() < deadline:
                for i, p in honest.items():  # sampled until they exit: the peak of the whole run
                    peaks[i] = max(peaks.get(i, 0.0), peak_rss_mb(p.pid))
                time.sleep(1.0)
            codes = {i: p.wait(timeout=30) for i, p in honest.items()}
            logs = {i: procs.log_text(i) for i in (1, 2, *HONEST)}
    finally:
        canary.close()
    a, b = (next(line.split("peer ")[1].split()[0] for line in logs[i].splitlines() if "announced:" in line)
            for i in (1, 2))
    assert f"this peer ({a}) leads the swarm" in logs[1] and f"this peer ({b}) leads the swarm" in logs[2]
    assert codes == dict.fromkeys(HONEST, 0), {i: logs[i][-3000:] for i in HONEST}
    print(f"\nhonest peers' peak resident memory: {peaks} MB; canary connections: {canary.connections}")
    assert canary.connections == 0, "an honest worker dialled the address the attacker named"
    for i in HONEST:
        refusals = [line for line in logs[i].splitlines() if f"refused an assignment from peer {a[:16]}" in line]
        assert refusals, f"peer {i} took attacker A's assignment:\n{logs[i][-3000:]}"
        assert all(field in refusals[0] for field in ("optim.lr", "spot_check", "model.")), refusals[0]
        assert f"refused an order of the leader {a}" in logs[i]
        assert f"refused an order of the leader {b}: it reported the run done at step" in logs[i]
        assert f"the run is done (step {STEPS})" in logs[i] or f"run finished: {STEPS} steps" in logs[i]
        assert 0 < peaks[i] < RSS_LIMIT_MB, peaks
    saved = [save for save in saves.values() if (save / "run.json").exists()]
    assert len(saved) == 1, "one honest survivor led to the end and saved"
    gap = gap_to_reference(saved[0], STEPS)
    assert gap.max_abs < 1e-5, f"final parameters differ from single-process training by {gap.max_abs:.2e}"
    assert gap.run["config"]["optim"]["lr"] == pytest.approx(1e-3)
