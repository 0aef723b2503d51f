"""Stragglers: the step time of one swarm without a straggler, with one (its compute stretched 5x from step 2 on),
and with the straggler left out of the plan from the start.

``python -m bench.stragglers [--json] [--steps N] [--pipelines P] [--timeline]``

The swarm: a local swarm of worker processes on loopback (2 stages x P pipelines of a small GPT plus one spare
device, compute emulated at a fixed TFLOP/s, same seed and data in every run). In the straggler run, device 1
(stage 1 of pipeline 0) is a volunteer whose GPU gets busy: from step 2 on it computes at a fifth of the others'
speed (``peer.emulation.faults.BusyGpuClock``), after the coordinator measured it healthy in steps 0 and 1.
What the runtime does about it: in its first slow step (step 2), once the loss of its pipeline's oldest
micro-batch is 1.25x later than the usual forward latency (or its head 1.5x later than the usual head latency),
the pool gives that pipeline no more work; with free work left and nothing committed, the pipeline is given up at
once and its micro-batches go to the others (2 pipelines); with nothing free, pipelines holding at most one
micro-batch copy what it holds (speculation, first commit wins; ``speculated`` counts the copies, in every run,
4 pipelines). The overtaken pipeline reloads its stage in the background, off the step's end. After that step
the driver reports it (over 2^2 = 4x its stage's median, counting the op it is still running: one step is
enough) and the next plan puts the spare in its place. ``step_s_*`` is wall-clock
seconds per step from the end of step 0 to the end of the last step (re-plans and state hand-over included;
step 0 is left out of every run alike: process warm-up), ``worst_step_*`` the slowest such step, and
``first_slow_step_s_*`` step 2 (the straggler's first slow step, before anything knew it was slow; step 2 of
the other runs for comparison). ``--timeline`` prints who took which micro-batch when, per step (the profile of
a slow step). The run's parameters are compared with single-process training (``max_param_rel_diff``):
speculation must not count a micro-batch twice. ``--pipelines P`` runs P pipelines (and one spare); the default
is 4. With P pipelines a 5x straggler leaves (P - 1 + 1/5) / P of the swarm's throughput, so a step it takes
part in cannot be faster than about P / (P - 0.8) times the step without it (+67 % for 2 pipelines, +25 % for
4), whatever the scheduling: at P = 2 only its replacement keeps a step within the issue's +30 %, at P = 4 its first
slow step can too (the other 3 pipelines carry its share; the copies start when the healthy pipelines still
have their last micro-batch in flight). The first step of the plan that replaces it pays the re-plan and new
links (about +20-25 % at P = 4).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig, unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.emulation.faults import BusyGpuClock
from tasklet.peer.emulation.local import LinkModel, LocalSwarm, RunResult
from tasklet.peer.runtime.lead.driver import Pipelines, Stages
from tasklet.peer.runtime.spec import RunSpec

SPEC = RunSpec(run_id="bench-stragglers", model=ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=1),
               optim=OptimConfig(lr=3e-3, eps=1e-3), seed=3, micro_batch=2, n_microbatches=8)
STAGES = [(0, 2), (2, 4)]
FORWARD_FLOPS = 2.4e6
FAST_TFLOPS = 4e-5  # ~60 ms forward, ~120 ms backward per stage and micro-batch
SLOWDOWN = BusyGpuClock.BUSY_SLOWDOWN
SLOW_FROM_STEP = BusyGpuClock.BUSY_FROM_STEP  # the straggler's first slow step (after warm-up and one measured)
STRAGGLER = 1  # stage 1 of pipeline 0
N_DEVICES = 5  # device 4 is the spare
WITH_ALL = (STAGES, [[0, 1], [2, 3]])
WITHOUT_STRAGGLER = (STAGES, [[0, 4], [2, 3]])


def layout(pipelines: int) -> tuple[int, tuple[Stages, Pipelines], tuple[Stages, Pipelines]]:
    """Devices, the plan with the straggler (device 1) and the plan with the spare (the last device) instead."""
    plan = [[2 * i, 2 * i + 1] for i in range(pipelines)]
    spare = 2 * pipelines
    return spare + 1, (STAGES, plan), (STAGES, [[spare if d == STRAGGLER else d for d in p] for p in plan])


def links(n_devices: int = N_DEVICES) -> LinkModel:
    """Every device declares the same speed; the straggler's slowdown is its fault (``busy-gpu``)."""
    return LinkModel(tflops=[FAST_TFLOPS] * n_devices)


class SubstitutePlanner:
    """Keeps the previous plan's slots and puts a spare where a device is gone (the straggler left out), so a
    replacement moves one device, not the whole plan (the daemon's cost-model planner does this with moves)."""

    def __init__(self, initial: tuple[Stages, Pipelines]) -> None:
        self.pipelines = [list(p) for p in initial[1]]

    def __call__(self, live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
        assert stages is not None
        spares = [d for d in live if all(d not in p for p in self.pipelines)]
        pipelines = []
        for p in self.pipelines:
            p = [d if d in live else (spares.pop(0) if spares else -1) for d in p]
            if -1 not in p:
                pipelines.append(p)
        self.pipelines = pipelines
        return list(stages), pipelines


class Timeline:
    """Who took which micro-batch when, per step: the coordinator's lease and commit events (``--timeline``),
    the profile that shows where a slow step's time goes (a pipeline paced out, a copy, a requeue)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.rows: list[tuple[float, str, dict[str, Any]]] = []

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name in ("lease", "commit", "requeue", "reduce", "apply"):
            self.rows.append((time.monotonic() - self.t0, name, info))

    def lines(self) -> list[str]:
        out, starts = [], {}
        for t, name, info in self.rows:
            step = info.get("step")
            starts.setdefault(step, t)
            what = {"lease": "lease  mb {microbatch} -> pipeline {pipeline}", "commit": "commit mb {microbatch} "
                    "<- pipeline {pipeline} ({result})", "requeue": "requeue {microbatches} of pipeline {pipeline}",
                    "reduce": "reduce, participants {participants}", "apply": "apply"}[name].format(**info)
            spec = " (speculative copy)" if info.get("speculative") else ""
            out.append(f"step {step} +{t - starts[step]:6.3f} s  {what}{spec}")
        return out


def run(straggler: bool, initial: tuple[Stages, Pipelines], steps: int, n_devices: int = N_DEVICES,
        timeline: Timeline | None = None) -> tuple[RunResult, list[float], LocalSwarm]:
    """Train ``steps`` steps; return the result and the wall seconds of each step after step 0 (from the end of
    the step before: re-plans between steps count)."""
    ends: list[float] = []
    faults = {STRAGGLER: "busy-gpu"} if straggler else None
    with LocalSwarm(SPEC, n_devices, links=links(n_devices), forward_flops=lambda a, b: FORWARD_FLOPS,
                    heartbeat_s=1.0, faults=faults) as swarm:
        swarm.coordinator.on_event = timeline
        result = swarm.train(initial, steps, planner=SubstitutePlanner(initial),
                             on_step=lambda report: ends.append(time.monotonic()))
    return result, [b - a for a, b in zip(ends, ends[1:], strict=False)], swarm


def max_rel_diff(result: RunResult, reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for (stage, _), state in result.states.items():
        a, b = STAGES[stage]
        for name, got in unflatten_stage(SPEC.model, a, b, state["params"]).items():
            ref = reference[name]
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--pipelines", type=int, default=4, help="pipelines of 2 stages, plus a spare (default 4)")
    parser.add_argument("--timeline", action="store_true",
                        help="also print each run's leases and commits per step (to stderr)")
    args = parser.parse_args(argv)
    if args.pipelines < 2 or args.steps < SLOW_FROM_STEP + 2:
        parser.error(f"--pipelines must be at least 2 and --steps at least {SLOW_FROM_STEP + 2}")
    n_devices, with_all, without_straggler = layout(args.pipelines)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    reference, _ = train_reference(SPEC.model, SPEC.optim, Corpus.load(SPEC.corpus), SPEC.seed, args.steps,
                                   SPEC.n_microbatches, SPEC.micro_batch)
    out: dict[str, Any] = {}
    details: dict[str, Any] = {}
    worst: dict[str, float] = {}
    median_no = 0.0
    for name, straggler, initial in (("no_straggler", False, with_all), ("with_straggler", True, with_all),
                                     ("straggler_excluded", True, without_straggler)):
        timeline = Timeline() if args.timeline else None
        result, walls, swarm = run(straggler, initial, args.steps, n_devices, timeline)
        if timeline is not None:
            print(f"--- {name}", *timeline.lines(), sep="\n", file=sys.stderr)
        out[f"step_s_{name}"] = round(sum(walls) / len(walls), 3)
        worst[name] = max(walls)
        out[f"first_slow_step_s_{name}"] = round(walls[SLOW_FROM_STEP - 1], 3)  # walls[i] is step i + 1
        if name == "no_straggler":
            median_no = statistics.median(walls)
        events = swarm.driver.events if swarm.driver else None
        details[name] = {
            "speculated": sum(r.speculated for r in result.reports),
            "speculated_per_step": [r.speculated for r in result.reports],
            "speculation_won": sum(r.speculation_won for r in result.reports),
            "requeued": sum(r.requeued for r in result.reports),
            "stragglers_reported": [] if events is None else [e["step"] for e in events.stragglers],
            "replans": [] if events is None else [e["reason"] for e in events.replans],
            "max_param_rel_diff": max_rel_diff(result, reference),
            "step_walls_s": [round(w, 3) for w in walls],
            "step0_s": round(result.reports[0].seconds, 3),  # process warm-up, left out of every run alike
        }
    out["slowdown_with_straggler_pct"] = round(100 * (out["step_s_with_straggler"] / out["step_s_no_straggler"] - 1),
                                               1)
    out["worst_step_s_no_straggler"] = round(worst["no_straggler"], 3)
    out["worst_step_s_with_straggler"] = round(worst["with_straggler"], 3)
    out["worst_step_slowdown_pct"] = round(100 * (worst["with_straggler"] / median_no - 1), 1)
    out["first_slow_step_slowdown_pct"] = round(100 * (out["first_slow_step_s_with_straggler"] / median_no - 1), 1)
    out["details"] = details
    if args.json:
        print(json.dumps(out))
        return 0
    for key, value in out.items():
        if key != "details":
            print(f"{key:32s} {value}")
    for name, d in details.items():
        print(f"{name:20s} {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
