"""The leader's host dies together with its disk: a new leader on another host resumes from a checkpoint copy.

Used by ``tests/runtime/test_checkpoint_copies.py`` and ``python -m bench.recovery`` (``leader_disk_resume_s``).

The swarm: five stage workers in this process (real gRPC over loopback with mutual TLS, real torch), each
keeping checkpoint copies in its own folder. Leader 1 (a coordinator and a run driver, checkpoint folder D1)
trains 2 stages x 2 pipelines ``[[w0, w1], [w2, w3]]``, checkpoints every 2 steps and copies each checkpoint to
``copies`` other workers. Then its host dies: its coordinator and worker w0 stop and D1 is deleted; w2, the
other replica of stage 0, dies with it, so stage 0 has no replica left. Leader 2, on another host with an empty
checkpoint folder, takes over the run at the step leader 1 reached: no live peer holds stage 0, so it fetches
the newest copy from the live peers, rolls the run back to it (the log says how many steps are redone) and
trains to the end on ``[[w4, w1]]``. ``resume_s`` is the time from leader 2's start to its first finished step.

The same on the network-namespace test bed (:func:`run_bed_leader_loss`, used by
``tests/swarms/test_netbed_leader_loss.py`` and ``python -m bench.recovery --leader-disk-bed``): four real `peer`
daemons on four bed hosts, each with a disk of its own (every peer's process bind-mounts its host's folder at
the run's ``checkpoint_dir``, in the mount namespace ``ip netns exec`` gives it). The plan is one pipeline of
three stages and a spare; the leader (the fastest device, so it holds a stage) checkpoints every
``BED_CHECKPOINT_EVERY`` steps and copies each checkpoint to the two other workers. Then its host dies: the
daemon is killed, the link goes down, the disk is deleted. Its stage has no other replica; the three survivors
are a quorum, elect a leader, which fetches the newest copy, rolls back (the log says how many steps are redone)
and trains to the end. ``resume_s`` there is the time from the kill to the new leader's first finished step:
failure detection, election, the copy fetched, the re-plan and one step.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig, unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.emulation.local import chunk_planner
from tasklet.peer.emulation.multihost import BedPeers
from tasklet.peer.emulation.netbed import Host, NetBed
from tasklet.peer.emulation.procs import PEER_COMMAND, child_env, launch, write_small_config
from tasklet.peer.emulation.reference_check import ReferenceGap, gap_to_reference
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.lead.coordinator import Coordinator
from tasklet.peer.runtime.lead.driver import DriverConfig, Pipelines, RunDriver, RunEvents, Stages
from tasklet.peer.runtime.lead.recovery import Inherited
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.worker import StageWorker

SPEC = RunSpec(run_id="leader-loss", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=4)
STAGES: Stages = [(0, 1), (1, 2)]


@dataclass
class LeaderLossResult:
    first_run_steps: int  # steps leader 1 finished before its host died
    events: RunEvents  # leader 2's
    resume_s: float  # leader 2's start to its first finished step
    states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    max_param_rel_diff: float = 0.0  # against single-process training of the same steps


def _driver(workers: dict[int, StageWorker], planner: Any, cfg: DriverConfig,
            epoch: int = 0, inherited: Inherited | None = None) -> tuple[RunDriver, Coordinator]:
    coordinator = Coordinator(SPEC, liveness_interval_s=60.0)
    coordinator.start()
    endpoints = {d: w.server.endpoint for d, w in workers.items()}
    n = max(endpoints) + 1
    table = [endpoints.get(d, "127.0.0.1:1") for d in range(n)]

    def assignments(stages: Stages, pipelines: Pipelines, epoch: int) -> dict[str, Assignment]:
        return build_assignments(SPEC, stages, pipelines, table, coordinator.endpoint, epoch)

    return RunDriver(SPEC, coordinator, lambda: dict(endpoints), planner, assignments, cfg, epoch=epoch,
                     inherited=inherited), coordinator


def _inherited(driver: RunDriver) -> Inherited:
    """What a new leader reads from its predecessor's signed progress record (peer.node.leader_role)."""
    return Inherited(checkpoint_digests=driver.recovery.checkpoint_digests,
                     checkpoint_manifests=driver.recovery.checkpoint_manifests)


def run_leader_loss(root: Path, steps: int = 5, die_after: int = 3, checkpoint_every: int = 2,
                    copies: int = 3) -> LeaderLossResult:
    """Run the scenario in ``root`` (workers' copy folders and the leaders' checkpoint folders)."""
    torch.set_num_threads(1)
    workers = {d: StageWorker(peer_id=f"w{d}", checkpoint_copies=root / f"w{d}-copies") for d in range(5)}
    for w in workers.values():
        w.start()
    try:
        first = {d: workers[d] for d in range(4)}
        plan1 = [[0, 1], [2, 3]]
        driver1, coordinator1 = _driver(first, lambda live, stages: (list(STAGES), plan1),
                                        DriverConfig(steps=die_after, checkpoint_dir=root / "leader1",
                                                     checkpoint_every=checkpoint_every, checkpoint_copies=copies))
        try:
            driver1.run()
            driver1.wait_for_copies(300.0)
        finally:
            coordinator1.close()
        _check_a_survivor_holds_a_copy(driver1, {workers[d].server.endpoint for d in (1, 3)})
        # the leader's host dies with its disk, and with it the other replica of stage 0
        workers[0].stop()
        workers[2].stop()
        shutil.rmtree(root / "leader1")
        survivors = {d: workers[d] for d in (1, 3, 4)}

        def planner(live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
            # stage 0 on the newcomer w4, stage 1 on w1 (which still holds it)
            order = [4, 1] + [d for d in live if d not in (4, 1)]
            return chunk_planner([d for d in order if d in live], stages or STAGES, SPEC.model.n_layers, 2)

        # a new leader plans above its predecessor's epoch (the daemon reads it from the plan board)
        driver2, coordinator2 = _driver(survivors, planner, DriverConfig(steps=steps, checkpoint_dir=root / "leader2",
                                                                         checkpoint_copies=copies), epoch=driver1.epoch,
                                     inherited=_inherited(driver1))
        started = time.monotonic()
        first_done: list[float] = []
        driver2.on_step = lambda report: first_done.append(time.monotonic()) if not first_done else None
        try:
            driver2.run(takeover=(die_after, STAGES))
            states = coordinator2.live_states(every_replica=True)
        finally:
            coordinator2.close()
        result = LeaderLossResult(die_after, driver2.events, first_done[0] - started, states)
        result.max_param_rel_diff = max_rel_diff(states, steps)
        return result
    finally:
        for w in workers.values():
            w.stop()


@dataclass
class HalfLossResult:
    peers: int
    resume_s: float  # leader 2's start to its first finished step
    steps_redone: int
    rolled_back_to: int | None
    max_param_rel_diff: float


def run_half_loss(root: Path, n_peers: int, steps: int = 6, die_after: int = 3,
                  checkpoints: bool = True) -> HalfLossResult:
    """Half the swarm vanishes with the leader: ``n_peers`` workers train 2 stages x ``n_peers / 2`` pipelines
    under leader 1 (checkpoints every 2 steps, copied to every other worker); then leader 1's host and every
    replica of stage 0 (half the peers) die, and a new leader takes over with the other half: stage 0 is
    wiped, so it rolls back to the newest copy a survivor holds and trains to the end. In one process: the
    time counts the takeover (status queries, the copy fetched, the re-plan, the workers loading the
    checkpoint, one step), not failure detection, the election or ``quorum_wait_s`` (seconds each, on
    real daemons: the bed test measures them). ``checkpoints=False``: leader 1 writes none, so the run rolls
    back to step 0 (the seeded initial state)."""
    torch.set_num_threads(1)
    workers = {d: StageWorker(peer_id=f"w{d}", checkpoint_copies=root / f"w{d}-copies") for d in range(n_peers)}
    for w in workers.values():
        w.start()
    try:
        plan1 = [[2 * r, 2 * r + 1] for r in range(n_peers // 2)]
        driver1, coordinator1 = _driver(workers, lambda live, stages: (list(STAGES), plan1),
                                        DriverConfig(steps=die_after,
                                                     checkpoint_dir=root / "leader1" if checkpoints else None,
                                                     checkpoint_every=2 if checkpoints else 0,
                                                     checkpoint_copies=n_peers - 1 if checkpoints else 0))
        try:
            driver1.run()
            driver1.wait_for_copies(300.0)
        finally:
            coordinator1.close()
        dying = [d for d in workers if d % 2 == 0]  # every replica of stage 0, the leader's host among them
        if checkpoints:
            _check_a_survivor_holds_a_copy(driver1, {workers[d].server.endpoint for d in workers if d not in dying})
        for d in dying:
            workers[d].stop()
        shutil.rmtree(root / "leader1", ignore_errors=True)
        survivors = {d: w for d, w in workers.items() if d not in dying}

        def planner(live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
            return chunk_planner(live, stages or STAGES, SPEC.model.n_layers, 2)

        driver2, coordinator2 = _driver(survivors, planner, DriverConfig(
            steps=steps, checkpoint_dir=root / "leader2" if checkpoints else None, checkpoint_copies=0),
            epoch=driver1.epoch, inherited=_inherited(driver1))
        started = time.monotonic()
        first_done: list[float] = []
        driver2.on_step = lambda report: first_done.append(time.monotonic()) if not first_done else None
        try:
            driver2.run(takeover=(die_after, STAGES))
            states = coordinator2.live_states(every_replica=True)
        finally:
            coordinator2.close()
        rollback = driver2.events.rollbacks[0] if driver2.events.rollbacks else {}
        return HalfLossResult(n_peers, first_done[0] - started, int(rollback.get("redone", 0)),
                              rollback.get("to_step"), max_rel_diff(states, steps))
    finally:
        for w in workers.values():
            w.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.leader_loss [--json] [--peers 4 8 16]``: the half-the-swarm case for each size."""
    import argparse
    import logging
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description=run_half_loss.__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16], help="swarm sizes (even)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    out: dict[str, Any] = {"half_the_swarm": []}
    for n in args.peers:
        with tempfile.TemporaryDirectory(prefix=f"bench-half-loss-{n}-") as tmp:
            r = run_half_loss(Path(tmp), n)
        row = {"peers": n, "takeover_to_step_s": round(r.resume_s, 3), "steps_redone": r.steps_redone,
               "rolled_back_to": r.rolled_back_to, "max_param_rel_diff": r.max_param_rel_diff}
        out["half_the_swarm"].append(row)
        if not args.json:
            print(f"{n} peers, half die with the leader: first step {r.resume_s:.2f} s after the takeover began, "
                  f"{r.steps_redone} step(s) redone from the copy of step {r.rolled_back_to}, parameters within "
                  f"{r.max_param_rel_diff:.1e} of single-process training", file=sys.stderr)
    print(json.dumps(out))
    return 0


def _check_a_survivor_holds_a_copy(driver: RunDriver, survivors: set[str]) -> None:
    """The scenario needs a copy on a worker that outlives the host: copies go to the lowest-RTT workers, so
    with fewer than 3 copies both can land on w0 and w2, which die (a scenario error, not a recovery failure)."""
    if not driver.events.copies:
        raise RuntimeError("leader 1 made no checkpoint copy before its host died")
    last = driver.events.copies[-1]
    if not survivors & set(last["peers"]):
        raise RuntimeError(f"the copy of step {last['step']} reached only {last['peers']} (errors: {last['errors']}),"
                           " none of which survives the host; use copies >= 3")


def max_rel_diff(states: dict[tuple[int, int], dict[str, Any]], steps: int) -> float:
    reference, _ = train_reference(SPEC.model, SPEC.optim, Corpus.load(SPEC.corpus), SPEC.seed, steps,
                                   SPEC.n_microbatches, SPEC.micro_batch)
    worst = 0.0
    for (stage, _), state in states.items():
        a, b = STAGES[stage]
        for name, got in unflatten_stage(SPEC.model, a, b, state["params"]).items():
            ref = reference[name]
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst


# ------------------------------------------------------------------------------------------------ on the bed
REPO = Path(__file__).resolve().parent.parent
BED_STEPS = 14
BED_CHECKPOINT_EVERY = 3
BED_TFLOPS = "0.0002"  # about a second a step: the kill lands between two checkpoints
BED_LEADER_TFLOPS = "0.0006"  # the fastest device: the planner gives it a stage (the slowest is the spare)
_STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO tasklet.peer.node.leader_role: step (\d+):", re.M)
_COPIED = re.compile(r"checkpoint of step (\d+) copied to")


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
        tflops = BED_LEADER_TFLOPS if args[0] == "start" else BED_TFLOPS
        cmd = host.cmd(*mount, *PEER_COMMAND, *args, "--host", host.addr, "--dht-host", host.addr,
                       "--emulate-tflops", tflops, "--log-level", "INFO")
        proc, log = launch(cmd, self.log_dir / f"{host.name}.log", env=child_env(), cwd=REPO)
        assert log is not None
        self._logs.append(log)
        self.procs[host.name] = proc
        return proc


@dataclass
class BedLeaderLoss:
    """What the bed scenario saw; ``logs`` by host name (pub0 the dead leader; ``new_leader`` the survivor that
    finished the run: the elder, pub1, unless the election saw it late)."""

    plan_pipelines: list[list[int]]
    copied_before_kill: int  # the newest checkpoint step copied to peers before the kill
    killed_after_step: int  # the last step the dead leader logged
    survivor_has_copy: bool
    exit_codes: dict[str, int | None]
    logs: dict[str, str]
    new_leader: str | None = None
    fetched_step: int | None = None  # the copy the new leader fetched
    rolled_back_to: int | None = None
    steps_redone: int | None = None
    resume_s: float | None = None  # kill to the new leader's first finished step
    new_leader_kept_copy: bool = False
    gap: ReferenceGap | None = None
    dead: list[str] = field(default_factory=list)  # the hosts killed (pub0, and its stage twin)


def _stamp(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1e3


def _wait(what: str, timeout_s: float, check: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def _twin_host(logs: dict[str, str], plan: list[list[int]]) -> str:
    """The host holding the leader's (pub0's) stage in the other pipeline. Device ids are the peer ids' sorted
    order (``LeaderRole.live_devices``; the first plan waits for all four peers)."""
    ids = {name: re.search(r"peer (\w+) announced:", text) for name, text in logs.items()}
    host_of = {m.group(1): name for name, m in ids.items() if m}
    devices = sorted(host_of)
    where = {devices[d]: (r, s) for r, pipe in enumerate(plan) for s, d in enumerate(pipe)}
    r0, s0 = where[next(pid for pid, name in host_of.items() if name == "pub0")]
    return next(host_of[pid] for pid, (r, s) in where.items() if s == s0 and r != r0)


def run_bed_leader_loss(bed: NetBed, root: Path, twin: bool = False, quorum_wait_s: float = 300.0) -> BedLeaderLoss:
    """Run the bed scenario (module docstring) in ``bed``; files under ``root``. Every peer is killed at the end.

    ``twin``: half the swarm dies: two stages x two pipelines, and the other replica of the leader's stage dies
    with it (process, link, disk). The two survivors hold no quorum of the plan's four members: they pause
    ``quorum_wait_s`` (``[swarm] quorum_wait_s``) and go on in a new epoch from the newest copy."""
    save, mount, disks = root / "result", root / "disk", root / "disks"
    mount.mkdir(parents=True)
    extra = (f"save_dir = {json.dumps(str(save))}\ncheckpoint_dir = {json.dumps(str(mount / 'ckpt'))}\n"
             f"checkpoint_every = {BED_CHECKPOINT_EVERY}\ncheckpoint_copies = 2\nquorum_wait_s = {quorum_wait_s}\n")
    cfg = write_small_config(root, steps=BED_STEPS, min_peers=4, stages=2 if twin else 3, leaders="any", extra=extra)
    hosts = [bed.add_public(f"pub{i}") for i in range(4)]
    peers = DiskPeers(root / "logs", disks, mount)
    try:
        dht0 = peers.start(hosts[0], cfg)
        for host in hosts[1:]:
            peers.join(host, dht0)
            time.sleep(1.0)  # the join order is the seniority: pub1 is next in line
        leader_log = lambda: peers.log("pub0")  # noqa: E731
        _wait("a checkpoint copied to two peers", 240, lambda: _COPIED.search(leader_log()) is not None)
        copied = max(int(s) for s in _COPIED.findall(leader_log()))
        _wait("a step past the copied checkpoint", 120,
              lambda: any(int(s) > copied for _, s in _STEP.findall(leader_log())))
        plan = re.findall(r"plan epoch \d+ \(start\): stages .*, pipelines (\[.*\]), continuing", leader_log())
        # the leader's host dies: process, link and disk (and with ``twin`` the other replica of its stage)
        dying = [hosts[0]]
        if twin:
            dying.append(bed.hosts[_twin_host({h.name: peers.log(h.name) for h in hosts}, json.loads(plan[0]))])
        for host in dying:
            peers.kill(host.name)
        t_dead = time.time()
        killed_at = max(int(s) for _, s in _STEP.findall(leader_log()))
        for host in dying:
            host.run("ip", "link", "set", "eth0", "down")
            shutil.rmtree(peers.disk(host))
        survivors = [h for h in hosts if h not in dying]
        has_copy = any(any(peers.disk(h).glob("ckpt/copies/*/step-*")) for h in survivors)
        codes = peers.wait_all(240 + quorum_wait_s)
        out = BedLeaderLoss(json.loads(plan[0]) if plan else [], copied, killed_at, has_copy, codes,
                            {h.name: peers.log(h.name) for h in hosts}, dead=[h.name for h in dying])
        out.new_leader = next((h.name for h in survivors if "run finished" in out.logs[h.name]), None)
        new_log = out.logs.get(out.new_leader or "", "")
        fetched = re.search(r"using the checkpoint copy of step (\d+) fetched from", new_log)
        rolled = re.search(r"rolling back to the checkpoint of step (\d+), redoing (\d+) step\(s\)", new_log)
        out.fetched_step = int(fetched.group(1)) if fetched else None
        if rolled:
            out.rolled_back_to, out.steps_redone = int(rolled.group(1)), int(rolled.group(2))
        after = sorted(_stamp(t) for t, _ in _STEP.findall(new_log) if _stamp(t) > t_dead)
        out.resume_s = after[0] - t_dead if after else None
        out.new_leader_kept_copy = out.new_leader is not None and any(
            peers.disk(bed.hosts[out.new_leader]).glob("ckpt/step-*"))
    finally:
        peers.close()
    if out.new_leader is not None and codes.get(out.new_leader) == 0 and (save / "run.json").exists():
        out.gap = gap_to_reference(save, BED_STEPS)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
