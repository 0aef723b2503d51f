"""Recovery from peers that vanish: time from a kill to the next committed micro-batch of the lost work, and
throughput under churn.

``python -m bench.recovery [--json] [--quick]``

Kill runs: a local swarm (real worker processes on loopback, 2 stages x 3 pipelines of a small GPT, compute
emulated at a fixed TFLOP/s) trains a fixed number of steps while a killer thread SIGKILLs a random planned
worker every 1-3 s and starts a fresh one in its place (a new peer joining). For each kill, *recovery* is the
time from the kill until a micro-batch of the lost work is committed again by someone else: the first commit
of a requeued micro-batch, or — when the kill left nothing to requeue (between steps) — the first commit after
the re-plan. It includes detection (a failed send confirmed by a ping, or two missed heartbeats), requeueing,
re-planning and state hand-over. Kills every 1-3 s can take every replica of a stage before a replacement
holds its state (the replacement is still fetching it when its source dies): the run then rolls back to the
newest checkpoint (written every ``CHECKPOINT_EVERY`` steps, copied to two peers) and redoes the steps since;
``rollbacks`` and ``steps_redone`` count them. At the end the run's parameters are compared with plain single-process
training on the same data: ``max_param_rel_diff`` (per tensor, relative to its largest entry).

Leader lost with its disk (``leader_disk_*``; ``--leader-disk-only`` runs just this): bench.leader_loss's
scenario — the leader's host, its checkpoint folder and the other replica of a stage die at once; a new leader
on another host fetches the newest checkpoint copy a peer holds and resumes from it. ``leader_disk_resume_s``
is the time from the new leader's start to its first finished step (fetching the copy, re-planning, the
workers loading the checkpoint, one step). ``--leader-disk-bed`` runs the same on the network-namespace bed
with real daemons (bench.leader_loss.run_bed_leader_loss; root): ``leader_disk_bed_resume_s`` is the time from
the kill of the leader's daemon to the new leader's first finished step, so it also counts failure detection,
the election and the takeover.

Churn runs: the same swarm for a fixed wall time, once undisturbed and once with one worker killed and
replaced every ``--churn-period`` seconds; the figure is tokens/s over the whole run.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.leader_loss import run_bed_leader_loss, run_leader_loss
from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig, unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.emulation.local import LinkModel, LocalSwarm, RunResult
from tasklet.peer.runtime.spec import RunSpec

SPEC = RunSpec(run_id="bench-recovery", model=ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=1),
               optim=OptimConfig(lr=3e-3, eps=1e-3), seed=3, micro_batch=2, n_microbatches=12)
STAGES = [(0, 2), (2, 4)]
INITIAL = (STAGES, [[0, 1], [2, 3], [4, 5]])
FORWARD_FLOPS = 2.4e6
SLOW = LinkModel(tflops=[2e-4] * 256)  # ~12 ms forward, ~24 ms backward per micro-batch
HEARTBEAT_S = 2.0
CHECKPOINT_EVERY = 10  # kill runs checkpoint this often: a wiped stage rolls back at most this many steps
TOKENS_PER_STEP = SPEC.micro_batch * SPEC.n_microbatches * SPEC.model.seq_len


class Recorder:
    """Timestamps (monotonic) of the coordinator's events and the driver's re-plans."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[float, str, dict[str, Any]]] = []

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name in ("commit", "requeue", "dead", "replan"):
            with self.lock:
                self.events.append((time.monotonic(), name, dict(info)))

    def recovery_after(self, t_kill: float) -> float | None:
        """Seconds from ``t_kill`` to the first commit of work lost to that kill (see the module docstring)."""
        with self.lock:
            later = [e for e in self.events if e[0] >= t_kill]
        requeued: set[tuple[int, int]] = set()
        replanned_at = None
        for t, name, info in later:
            if name == "requeue" and not requeued and replanned_at is None:
                requeued = {(info["step"], mb) for mb in info["microbatches"]}
            elif name == "replan" and replanned_at is None:
                replanned_at = t
            elif name == "commit" and info.get("result") == "committed":
                if (info["step"], info["microbatch"]) in requeued:
                    return t - t_kill
                if replanned_at is not None and t >= replanned_at and not requeued:
                    return t - t_kill
        return None


def planned_workers(swarm: LocalSwarm) -> list[int]:
    coord = swarm.coordinator
    live = swarm.workers.live()
    return [d for d, ep in live.items() if ep in coord.assignments and ep not in coord.dead]


def killer(swarm: LocalSwarm, rec: Recorder, n_kills: int, rng: random.Random, steps: int,
           kills: list[tuple[float, int]], stop: threading.Event) -> None:
    """Kill a random planned worker every 1-3 s (after it recovered from the last kill), replace it."""
    while len(kills) < n_kills and not stop.wait(rng.uniform(1.0, 3.0)):
        driver = swarm.driver
        if driver is None or driver.trained < 1:
            continue  # let the first plan form and train a step first
        if driver.trained >= steps - 3:
            return
        victims = planned_workers(swarm)
        if not victims:
            continue
        victim = rng.choice(victims)
        t = time.monotonic()
        swarm.workers.kill(victim)
        kills.append((t, victim))
        deadline = time.monotonic() + 60
        while rec.recovery_after(t) is None and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
        # a fresh peer takes the dead one's place (planned in at the next step boundary); starting a process
        # takes seconds, so it happens beside the next kill rather than before it
        threading.Thread(target=swarm.workers.add, daemon=True).start()


def max_rel_diff(result: RunResult, reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    seen: set[int] = set()
    for (stage, _), state in sorted(result.states.items()):
        if stage in seen:
            continue
        seen.add(stage)
        a, b = STAGES[stage]
        for name, got in unflatten_stage(SPEC.model, a, b, state["params"]).items():
            ref = reference[name]
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst


def kill_run(n_kills: int, steps: int, seed: int, reference: dict[str, torch.Tensor],
             say: Any) -> tuple[list[float], float, bool, list[dict[str, Any]]]:
    """One kill run; also the rollbacks it took (a stage whose every replica died before a replacement held its
    state rolls back to the newest checkpoint, written every ``CHECKPOINT_EVERY`` steps and copied to peers)."""
    rec = Recorder()
    kills: list[tuple[float, int]] = []
    stop = threading.Event()
    with (tempfile.TemporaryDirectory(prefix="bench-recovery-") as ckpt,
          LocalSwarm(SPEC, 6, links=SLOW, forward_flops=lambda a, b: FORWARD_FLOPS, heartbeat_s=HEARTBEAT_S) as swarm):
        swarm.coordinator.on_event = rec
        thread = threading.Thread(target=killer, args=(swarm, rec, n_kills, random.Random(seed), steps, kills, stop),
                                  daemon=True)
        thread.start()
        try:
            result = swarm.train(INITIAL, steps, on_replan=lambda info: rec("replan", info), checkpoint_dir=ckpt,
                                 checkpoint_every=CHECKPOINT_EVERY)
        finally:
            stop.set()
            thread.join(timeout=120)
    recoveries = [r for t, _ in kills if (r := rec.recovery_after(t)) is not None]
    if len(recoveries) < len(kills):
        say(f"  {len(kills) - len(recoveries)} kill(s) without a measurable recovery")
    diff = max_rel_diff(result, reference)
    rollbacks = result.events.rollbacks
    say(f"  run {seed}: {len(kills)} kills, recoveries {', '.join(f'{r:.2f}' for r in recoveries)} s; "
        f"{len(result.events.replans) - 1} re-plans; {len(rollbacks)} rollback(s) {rollbacks}; "
        f"max param diff vs undisturbed {diff:.2e}")
    return recoveries, diff, len(result.reports) == steps, rollbacks


def churn_run(duration_s: float, period_s: float | None, say: Any) -> float:
    """tokens/s of a run of ``duration_s`` wall seconds, with a kill + replacement every ``period_s``."""
    stop = threading.Event()
    with LocalSwarm(SPEC, 6, links=SLOW, forward_flops=lambda a, b: FORWARD_FLOPS, heartbeat_s=HEARTBEAT_S) as swarm:
        def churn() -> None:
            rng = random.Random(7)
            while period_s and not stop.wait(period_s):
                victims = planned_workers(swarm)
                if victims:
                    swarm.workers.kill(rng.choice(victims))
                    swarm.workers.add()

        def end() -> None:
            if not stop.wait(duration_s) and swarm.driver is not None:
                swarm.driver.cfg.steps = swarm.driver.trained + 1  # finish the step under way, then stop

        started = time.monotonic()
        threads = [threading.Thread(target=churn, daemon=True), threading.Thread(target=end, daemon=True)]
        for t in threads:
            t.start()
        try:
            result = swarm.train(INITIAL, 100_000, collect_states=False)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        wall = time.monotonic() - started
    tps = len(result.reports) * TOKENS_PER_STEP / wall
    label = f"churn every {period_s:g} s" if period_s else "no churn"
    say(f"  {label}: {len(result.reports)} steps in {wall:.1f} s"
        f" = {tps:.0f} tokens/s")
    return tps


def run(kills: int, runs: int, steps: int, churn_s: float, period_s: float, say: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    say(f"reference: single-process training, {steps} steps")
    corpus = Corpus.load(SPEC.corpus)
    reference, _ = train_reference(SPEC.model, SPEC.optim, corpus, SPEC.seed, steps, SPEC.n_microbatches,
                                   SPEC.micro_batch)
    per_run = max(1, kills // runs)
    recoveries: list[float] = []
    diffs: list[float] = []
    completed = 0
    rollbacks: list[dict[str, Any]] = []
    for r in range(runs):
        say(f"kill run {r + 1}/{runs}: {per_run} kills over {steps} steps")
        rec, diff, ok, rolled = kill_run(per_run, steps, r, reference, say)
        recoveries += rec
        diffs.append(diff)
        completed += ok
        rollbacks += rolled
    say(f"churn: {churn_s:.0f} s without churn, then with a kill every {period_s:.0f} s")
    calm = churn_run(churn_s, None, say)
    churned = churn_run(churn_s, period_s, say)
    leader = leader_disk_run(say)
    return {
        "kills": len(recoveries),
        "median_recovery_s": statistics.median(recoveries) if recoveries else None,
        "max_recovery_s": max(recoveries) if recoveries else None,
        "runs_completed": completed,
        "max_param_rel_diff": max(diffs) if diffs else None,
        "heartbeat_s": HEARTBEAT_S,
        "rollbacks": len(rollbacks),
        "steps_redone": sum(int(r["redone"]) for r in rollbacks),
        "recoveries_s": recoveries,
        "tokens_per_s_no_churn": calm,
        "tokens_per_s_churn": churned,
        "churn_period_s": period_s,
        **leader,
    }


def leader_disk_run(say: Any) -> dict[str, Any]:
    """The leader's host dies with its disk (bench.leader_loss): seconds from the new leader's start to its first
    step, resumed from a checkpoint copy a peer held; the steps redone; the parameter difference at the end."""
    say("leader loss: the leader's host and disk die with a stage's other replica; a new leader resumes from a copy")
    with tempfile.TemporaryDirectory(prefix="bench-leader-loss-") as tmp:
        result = run_leader_loss(Path(tmp))
    rollback = result.events.rollbacks[0] if result.events.rollbacks else {}
    return {
        "leader_disk_resume_s": round(result.resume_s, 3),
        "leader_disk_steps_redone": rollback.get("redone"),
        "leader_disk_copy_step": None if result.events.fetched_copy is None else result.events.fetched_copy["step"],
        "leader_disk_max_param_rel_diff": result.max_param_rel_diff,
    }


def leader_disk_bed_run(say: Any) -> dict[str, Any]:
    """The bed variant (real daemons, a disk per host): kill of the leader to the new leader's first step."""
    from tasklet.peer.emulation.netbed import open_bed, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench.recovery --leader-disk-bed: network namespaces unavailable: {reason}")
    say("leader loss on the netns bed: 4 daemons, the leader's daemon, link and disk die; a new leader resumes")
    with tempfile.TemporaryDirectory(prefix="bench-leader-loss-bed-") as tmp, open_bed() as bed:
        r = run_bed_leader_loss(bed, Path(tmp))
    return {
        "leader_disk_bed_resume_s": None if r.resume_s is None else round(r.resume_s, 2),
        "leader_disk_bed_steps_redone": r.steps_redone,
        "leader_disk_bed_copy_step": r.fetched_step,
        "leader_disk_bed_killed_after_step": r.killed_after_step,
        "leader_disk_bed_max_param_abs_diff": None if r.gap is None else r.gap.max_abs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--quick", action="store_true", help="4 kills, short churn runs (a smoke run)")
    parser.add_argument("--kills", type=int, default=20, help="kills in total (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=2, help="kill runs the kills are spread over (default: 2)")
    parser.add_argument("--steps", type=int, default=120, help="steps per kill run (default: %(default)s)")
    parser.add_argument("--churn-seconds", type=float, default=120.0, help="length of each churn run (default: 120)")
    parser.add_argument("--churn-period", type=float, default=30.0, help="seconds between churn kills (default: 30)")
    parser.add_argument("--leader-disk-only", action="store_true",
                        help="only the leader-lost-with-its-disk figures (a few seconds)")
    parser.add_argument("--leader-disk-bed", action="store_true",
                        help="only the leader-lost-with-its-disk figures on the netns bed, real daemons (root; ~90 s)")
    args = parser.parse_args(argv)
    if args.leader_disk_bed:
        logging.basicConfig(level=logging.ERROR)
        print(json.dumps(leader_disk_bed_run(lambda line: print(line, file=sys.stderr))))
        return 0
    if args.leader_disk_only:
        logging.basicConfig(level=logging.ERROR)
        torch.set_num_threads(1)
        print(json.dumps(leader_disk_run(lambda line: print(line, file=sys.stderr))))
        return 0
    if args.quick:
        args.kills, args.runs, args.steps, args.churn_seconds, args.churn_period = 4, 1, 50, 30.0, 10.0
    logging.basicConfig(level=logging.ERROR)

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    out = run(args.kills, args.runs, args.steps, args.churn_seconds, args.churn_period, say)
    if args.json:
        keys = ("kills", "median_recovery_s", "max_recovery_s", "runs_completed", "max_param_rel_diff")
        print(json.dumps({**{k: out[k] for k in keys}, **{k: v for k, v in out.items() if k not in keys}}))
        return 0
    say("")
    if not out["kills"]:
        say("no kill landed (the runs were too short); use more --steps")
        return 1
    say(f"recovery over {out['kills']} kills (heartbeat {HEARTBEAT_S:g} s): median {out['median_recovery_s']:.2f} s, "
        f"max {out['max_recovery_s']:.2f} s")
    say(f"runs completed: {out['runs_completed']}/{args.runs}; max parameter difference vs undisturbed training: "
        f"{out['max_param_rel_diff']:.2e}")
    say(f"leader lost with its disk: resumed from a peer's checkpoint copy of step {out['leader_disk_copy_step']} "
        f"in {out['leader_disk_resume_s']:.2f} s to the first step, {out['leader_disk_steps_redone']} step(s) redone")
    say(f"throughput: {out['tokens_per_s_no_churn']:.0f} tokens/s without churn, {out['tokens_per_s_churn']:.0f} "
        f"with a kill every {args.churn_period:g} s ({out['tokens_per_s_churn'] / out['tokens_per_s_no_churn']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
