"""The leader's host dies together with its disk, on the network-namespace test bed (issue #13).

Four real `peer` daemons on four bed hosts. Each host has a disk of its own: the run's ``checkpoint_dir`` is
one path, and every peer's process bind-mounts its host's folder there (a mount namespace per host, as
separate machines would have), so the leader's checkpoints and the copies the others keep live on different
disks. The plan is one pipeline of three stages (three peers) and a spare; the leader holds a stage, checkpoints
every ``CHECKPOINT_EVERY`` steps and copies every checkpoint to the two other workers of its plan.

Then the leader's host dies: its daemon is killed, its link goes down and its disk is deleted. Its stage has no
other replica. The three survivors are a quorum of the previous plan; the elder leads, finds no holder of the
lost stage and no checkpoint on its own disk, fetches the newest verified copy from a peer, rolls the run back
to it (the log says how many steps are redone) and trains to the end. The final parameters equal
single-process training (no micro-batch lost or counted twice across the rollback).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from peer.emulation.multihost import BedPeers
from peer.emulation.netbed import Host, NetBed
from peer.emulation.procs import PEER_COMMAND, child_env, launch, write_small_config
from peer.emulation.reference_check import gap_to_reference

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
STEPS = 14
CHECKPOINT_EVERY = 3
EMULATE_TFLOPS = "0.0002"  # about a second a step: the kill lands between two checkpoints
LEADER_TFLOPS = "0.0006"  # the fastest device: the planner gives it a stage (the slowest is the spare)


class DiskPeers(BedPeers):
    """One `peer` per bed host, listening on the host's address, with ``disks/<host>`` mounted at ``mount``."""

    def __init__(self, log_dir: Path, disks: Path, mount: Path) -> None:
        super().__init__(log_dir)
        self.disks, self.mount = disks, mount

    def disk(self, host: Host) -> Path:
        return self.disks / host.name

    def spawn(self, host: Host, args: list[str]) -> subprocess.Popen[str]:
        """``ip netns exec`` gives the process a mount namespace of its own: the bind mount stays in it."""
        self.disk(host).mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        mount = ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
                 str(self.disk(host)), str(self.mount)]
        tflops = LEADER_TFLOPS if args[0] == "start" else EMULATE_TFLOPS
        cmd = host.cmd(*mount, *PEER_COMMAND, *args, "--host", host.addr, "--dht-host", host.addr,
                       "--emulate-tflops", tflops, "--log-level", "INFO")
        proc, log = launch(cmd, self.log_dir / f"{host.name}.log", env=child_env(), cwd=REPO)
        assert log is not None
        self._logs.append(log)
        self.procs[host.name] = proc
        return proc


_STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO peer.node.leader_role: step (\d+):", re.M)


def _stamp(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1e3


def wait_for(what: str, timeout_s: float, check) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_leader_host_and_disk_die_new_leader_resumes_from_a_copy(bed: NetBed, tmp_path: Path) -> None:
    save, mount, disks = tmp_path / "result", tmp_path / "disk", tmp_path / "disks"
    mount.mkdir()
    extra = (f"save_dir = {json.dumps(str(save))}\ncheckpoint_dir = {json.dumps(str(mount / 'ckpt'))}\n"
             f"checkpoint_every = {CHECKPOINT_EVERY}\ncheckpoint_copies = 2\n")
    cfg = write_small_config(tmp_path, steps=STEPS, min_peers=4, stages=3, extra=extra)
    hosts = [bed.add_public(f"pub{i}") for i in range(4)]
    peers = DiskPeers(tmp_path / "logs", disks, mount)
    try:
        dht0 = peers.start(hosts[0], cfg)
        for host in hosts[1:]:
            peers.join(host, dht0)
            time.sleep(1.0)  # the join order is the seniority: pub1 is next in line
        leader_log = lambda: peers.log("pub0")  # noqa: E731
        # the leader trains, and a checkpoint of step CHECKPOINT_EVERY (or later) reached another peer's disk
        wait_for("a checkpoint copied to a peer", 240,
                 lambda: re.search(r"checkpoint of step \d+ copied to", leader_log()) is not None)
        assert "this peer (" in leader_log() and "leads the swarm" in leader_log()
        copied = max(int(s) for s in re.findall(r"checkpoint of step (\d+) copied to", leader_log()))
        wait_for("a step past the copied checkpoint", 120,
                 lambda: any(int(s) > copied for _, s in _STEP.findall(leader_log())))
        plan = re.findall(r"plan epoch \d+ \(start\): stages .*, pipelines (\[.*\]), continuing", leader_log())
        assert plan and len(json.loads(plan[0])) == 1, f"expected one pipeline and a spare: {plan}"

        # the leader's host dies: process, link and disk
        peers.kill("pub0")
        t_dead = time.time()
        killed_at = max(int(s) for _, s in _STEP.findall(leader_log()))
        hosts[0].run("ip", "link", "set", "eth0", "down")
        shutil.rmtree(peers.disk(hosts[0]))
        assert any(any(peers.disk(h).glob("ckpt/copies/run-*/step-*")) for h in hosts[1:]), "no copy on a survivor"

        codes = peers.wait_all(240)
        assert codes == {"pub0": codes["pub0"], "pub1": 0, "pub2": 0, "pub3": 0}, \
            f"{codes}:\n{peers.log('pub1')[-3000:]}\n{peers.log('pub2')[-2000:]}"
        new_log = peers.log("pub1")
        assert "run finished" in new_log, new_log[-3000:]
        fetched = re.search(r"using the checkpoint copy of step (\d+) fetched from", new_log)
        assert fetched, new_log[-3000:]
        rolled = re.search(r"rolling back to the checkpoint of step (\d+), redoing (\d+) step\(s\)", new_log)
        assert rolled, new_log[-3000:]
        back_to, redone = int(rolled.group(1)), int(rolled.group(2))
        assert back_to == int(fetched.group(1)) >= copied and back_to % CHECKPOINT_EVERY == 0
        assert redone >= 1 and back_to + redone >= killed_at
        # the new leader's first finished step after the kill: the time to resume
        after = sorted(_stamp(t) for t, s in _STEP.findall(new_log) if _stamp(t) > t_dead)
        assert after, new_log[-3000:]
        resume_s = after[0] - t_dead
        # the new leader keeps the fetched copy on its own disk
        assert any(peers.disk(hosts[1]).joinpath("ckpt").glob("step-*"))
    finally:
        peers.close()
    gap = gap_to_reference(save, STEPS)
    assert len(gap.run["loss"]) == STEPS
    assert gap.max_abs < 1e-5, f"{gap.max_abs:.2e} off single-process training (relative {gap.max_rel:.2e})"
    assert gap.loss_rel < 1e-5
    print(f"\nleader host+disk loss on the bed: killed after step {killed_at}, the new leader fetched the copy of "
          f"step {back_to} and redid {redone} step(s); first step {resume_s:.1f} s after the kill; final "
          f"parameters within {gap.max_abs:.2e} (abs) / {gap.max_rel:.2e} (rel) of single-process training")
