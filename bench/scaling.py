"""Scaling, measured: tokens/s of real worker processes on the emulated world-wide network, N = 4 to 32 peers.

``python -m bench.scaling [--json] [--peers 4,8,16,32] [--steps N] [--quick] [--png PATH] [--log-dir DIR]``

For each N, one worker process per peer (``peer.emulation.local.LocalSwarm``, the workers, coordinator and
driver the daemons of ``peer swarm`` run), links shaped per directed pair to the ``worldwide_geo_distributed``
scenario and compute stretched to each device's emulated speed, trains the same small GPT under three
placements of its 4 stages x N/4 replicas:

* ``scheduled``: ``scheduler.plan`` with the shipped compression space (placement, activation codec and sync
  chosen together under the 2 % loss-penalty limit), run with what it chose;
* ``random``: ``scheduler.baselines.random_plan`` (seed ``random_seed``), exact training;
* ``exact``: ``scheduler.plan`` without compression: the best exact plan the search finds.

Each row carries the measured seconds per step (after warm-up, the median over whole sync periods of each
period's mean, so that a DiLoCo run counts its outer rounds), tokens/s, the cost model's prediction of that run
(``scheduler.compression.predict``, which is ``cost_full`` for exact training), the ``full`` model's lower bound
for exact training of that split (``scheduler.bound.lower_bound``), and ``efficiency``: measured tokens/s over
the sum of the devices' emulated throughput (each device's TFLOP/s over the model's training FLOPs per token,
3 x forward), the analogue of MFU. ``headline_16`` compares scheduled and random at 16 peers, measured and
predicted.

The world: peers are taken city by city, round robin over the scenario's 8 cities (N = 4: one in each of 4
cities; 8: one per city; 16: two; 32: four). Two peers of one city share a fast link (2 Gbit/s, 5 ms), cities
are 0.34-1.16 Gbit/s and 11-238 ms apart. Scales, stated in every result: bandwidth x ``bandwidth_scale`` and
device speed x ``tflops_scale`` (the model is thousands of times smaller than the paper's, so at the scenario's
own Gbit/s only the delays would count). Weak scaling: each pipeline gets ``microbatches_per_pipeline``
micro-batches per step, so the global batch grows with N.

Every figure depends on this machine's load: the workers' real compute must stay under the emulated time
(``overrun_ops`` counts the ops that did not), and the shapers and gRPC share the cores. Each row records the
load average before and after its run.

Time dilation (``--dilation K``, per size with ``--dilation 32=8``): the emulated world runs K times slower
(bandwidth and device speed / K, one-way delays x K), so that N processes on few cores can keep every emulated
op; every figure is then reported in the emulated world's seconds (wall seconds / K; ``wall_step_s`` keeps the
wall figure), so rows of different K compare. What is not dilated: the leader's control rounds and each
message's real handling (loopback gRPC), which weigh 1/K as much in a dilated row; the prediction's control
term is real seconds too, so measured over predicted stays a like-for-like ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.headline.run import PlanRun, run_plan
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.emulation.network import scaled_cluster
from tasklet.peer.node.planning import workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler import Cluster, Plan, Workload, plan
from tasklet.scheduler.baselines import random_plan
from tasklet.scheduler.bound import lower_bound
from tasklet.scheduler.cluster import load_scenario
from tasklet.scheduler.compression import Choice, CompressionSpace, PenaltyTable, SyncOption, timing_for
from tasklet.scheduler.compression import predict as choice_predict

log = logging.getLogger("bench.scaling")

SCENARIO = "worldwide_geo_distributed"
PLACEMENTS = ("scheduled", "random", "exact")
DEFAULT_PNG = Path("docs/scaling.png")
RUN_ATTEMPTS = 2  # a run is retried once: N torch processes starting on a loaded 2-core machine can time out


class ScalingConfigError(ValueError):
    """A benchmark setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class ScalingConfig:
    """Every choice the figures depend on; defaults are the published run."""

    peers: tuple[int, ...] = (4, 8, 16, 32)
    stages: int = 4
    bandwidth_scale: float = 0.003
    tflops_scale: float = 3e-5
    model: ModelConfig = field(default_factory=lambda: ModelConfig(n_layers=4, d_model=64, n_heads=4,
                                                                   seq_len=64, seed=0))
    micro_batch: int = 4
    microbatches_per_pipeline: int = 4
    seed: int = 0
    steps: int = 5
    warmup_steps: int = 1
    random_seed: int = 0
    search_time_limit_s: float = 10.0
    placements: tuple[str, ...] = PLACEMENTS
    step_timeout_s: float = 300.0
    dilation: tuple[tuple[int, float], ...] = ()  # (N, K): run N peers' world K times slower (default 1)

    def dilation_for(self, n: int) -> float:
        return dict(self.dilation).get(n, 1.0)

    def validate(self) -> ScalingConfig:
        if not self.peers or any(n < self.stages or n % self.stages for n in self.peers):
            raise ScalingConfigError(f"peers: each N must be a positive multiple of the {self.stages} stages, "
                                     f"got {list(self.peers)}")
        if max(self.peers) > 64:
            raise ScalingConfigError("peers: the scenario has 64 devices")
        if not (self.bandwidth_scale > 0 and self.tflops_scale > 0):
            raise ScalingConfigError("bandwidth_scale/tflops_scale: must be positive")
        if self.warmup_steps < 0 or self.steps <= self.warmup_steps:
            raise ScalingConfigError(f"steps: need more than the {self.warmup_steps} warm-up step(s)")
        if any(k < 1.0 or not math.isfinite(k) for _, k in self.dilation):
            raise ScalingConfigError(f"dilation: each K must be a finite number >= 1, got {list(self.dilation)}")
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad or not self.placements:
            raise ScalingConfigError(f"placements: must be among {PLACEMENTS}, got {list(self.placements)}")
        return self

    def quick(self) -> ScalingConfig:
        """Four peers, three steps: a check that it all runs (about a minute)."""
        return replace(self, peers=(4,), steps=3, search_time_limit_s=2.0)

    def spec(self, replicas: int, choice: Choice | None = None, penalties: PenaltyTable | None = None) -> RunSpec:
        extra: dict[str, Any] = {}
        if choice is not None and not choice.is_exact:
            d = choice.to_dict(penalties)
            extra = {"compression": d["compression"], "sync_period": d["sync_period"],
                     "pseudo_grad_compression": d["pseudo_grad_compression"], "outer_overlap": d["outer_overlap"]}
            extra.update({k: d[k] for k in ("outer_lr", "outer_momentum") if k in d})
        return RunSpec(run_id="bench-scaling", model=self.model, seed=self.seed, micro_batch=self.micro_batch,
                       n_microbatches=self.microbatches_per_pipeline * replicas, **extra).validate()


def city_devices(world: Cluster, n: int) -> list[int]:
    """The first ``n`` devices taken round robin over the scenario's cities (in the scenario's city order)."""
    cities = list(dict.fromkeys(world.regions))
    by_city = [[i for i in range(world.n) if world.regions[i] == c] for c in cities]
    order = [devs[k] for k in range(max(len(d) for d in by_city)) for devs in by_city if k < len(devs)]
    if n > len(order):
        raise ScalingConfigError(f"peers: the scenario has {len(order)} devices, asked for {n}")
    return order[:n]


def build_cluster(cfg: ScalingConfig, n: int) -> Cluster:
    """The ``n`` peers' world as emulated: scaled, and slowed ``cfg.dilation_for(n)`` times."""
    world = load_scenario(SCENARIO)
    k = cfg.dilation_for(n)
    return scaled_cluster(world.subset(city_devices(world, n)), cfg.bandwidth_scale / k, cfg.tflops_scale / k,
                          delay_scale=k)


SECONDS_KEYS = ("predicted_step_s", "lower_bound_step_s", "predicted_pipeline_s", "predicted_dp_s",
                "measured_step_s", "measured_pipeline_s", "measured_dp_s")


def undilated(row: dict[str, Any], k: float) -> dict[str, Any]:
    """A row measured in a world ``k`` times slower, in the emulated world's seconds (``wall_step_s`` kept)."""
    out = dict(row, time_dilation=k, wall_step_s=row.get("measured_step_s"))
    if k == 1.0:
        return out
    for key in SECONDS_KEYS:
        if out.get(key) is not None:
            out[key] = out[key] / k
    if out.get("step_seconds"):
        out["step_seconds"] = [seconds / k for seconds in out["step_seconds"]]
    if out.get("tokens_per_s") is not None:
        out["tokens_per_s"] = out["tokens_per_s"] * k
    out["device_tokens_per_s_sum"] = out["device_tokens_per_s_sum"] * k
    prof = dict(out["profile"])
    prof["round_trip"] = {key: v / k for key, v in prof["round_trip"].items()}
    for key in ("queue_s", "averaging_s", "control_rounds_s", "control_s_not_emulated", "leader_rtt_s"):
        prof[key] = prof[key] / k
    out["profile"] = prof
    return out


@dataclass
class Candidate:
    """A placement to run: its plan, what it sends (the compression choice) and what the model predicts."""

    placement: str
    plan: Plan
    choice: Choice
    predicted: dict[str, Any]

    @property
    def sync_period(self) -> int:
        return self.choice.sync.period


def candidates(cfg: ScalingConfig, cluster: Cluster, workload: Workload) -> list[Candidate]:
    """The placements of ``cfg.placements`` for this cluster, each with its prediction."""
    exact = Choice.exact(cfg.stages)
    out: list[Candidate] = []
    for name in cfg.placements:
        if name == "scheduled":
            p = plan(cluster, workload, cost_model="full", seed=cfg.seed, time_limit_s=cfg.search_time_limit_s,
                     compression=CompressionSpace.default())
            choice = p.predicted.get("choice") or exact
            if isinstance(choice, dict):  # the plan records the choice as its dict form
                choice = _choice_from_dict(choice)
        elif name == "random":
            p, choice = random_plan(cluster, workload, cfg.random_seed), exact
        else:
            p = plan(cluster, workload, cost_model="full", seed=cfg.seed, time_limit_s=cfg.search_time_limit_s)
            choice = exact
        p.validate(cluster.n, workload.n_layers)
        layout = Plan([tuple(s) for s in p.stages], [list(r) for r in p.pipelines])
        out.append(Candidate(name, layout, choice, choice_predict(cluster, workload, layout, choice)))
    return out


def _choice_from_dict(d: dict[str, Any]) -> Choice:
    return Choice(tuple(d["activation"]), SyncOption.parse(d["sync"]))


def profile(cluster: Cluster, workload: Workload, c: Candidate) -> dict[str, Any]:
    """Where one step's time goes, by the ``full`` model's timing of this plan (seconds per step).

    The pipeline phase of the slowest pipeline is split into its first micro-batch's round trip (compute on
    each stage, link serialisation, one-way delays) and what the micro-batches behind it add (``queue_s``: waiting
    on the slowest op or link, or on the window of ``stages`` in flight); ``averaging_s`` is the data-parallel
    phase (amortised over a DiLoCo period); ``control_rounds_s`` the model's leader rounds (their cost on this
    machine, ``scheduler.schedule.control_time``). ``control_s_not_emulated`` is *not* emulated here (the
    coordinator sits on an unshaped loopback address): the feeder holds a window slot until the micro-batch's
    commit returns, and leases the next one after, so each window turn after the first pays a commit and a
    lease round trip to the leader, and the first lease one; the estimate puts the leader at the median one-way
    delay from the pipeline's first stage.
    """
    t = timing_for(cluster, workload, c.plan, c.choice)
    pred = c.predicted
    r = int(max(range(t.replicas), key=lambda i: pred["round_trip_s"][i]))
    k = int(pred["microbatches"][r])
    compute = float((t.fwd[r] + t.bwd[r]).sum())
    wire = float((t.xfer_fwd[r] + t.xfer_bwd[r]).sum()) if t.stages > 1 else 0.0
    delay = float((t.hop_fwd[r] + t.hop_bwd[r]).sum()) - wire if t.stages > 1 else 0.0
    head = int(c.plan.pipelines[r][0])
    others = [float(cluster.delay_s[head, j]) for j in range(cluster.n) if j != head]
    leader_rtt = 2.0 * float(sorted(others)[len(others) // 2]) if others else 0.0
    turns = max(0, -(-k // t.window) - 1)
    return {
        "pipeline": r, "microbatches": k, "window": int(t.window),
        "round_trip": {"compute_s": compute, "wire_s": wire, "delay_s": delay},
        "queue_s": float(pred["pipeline_s"]) - (compute + wire + delay),
        "averaging_s": float(pred["dp_s"]),
        "control_rounds_s": float(pred.get("control_s", 0.0)),
        "control_s_not_emulated": leader_rtt * (1 + 2 * turns),
        "leader_rtt_s": leader_rtt,
        "compute_share": float(pred["compute_s"]) / float(pred["total_s"]),
    }


def device_tokens_per_s(cluster: Cluster, workload: Workload) -> float:
    """Sum over devices of the tokens/s each would train alone at its emulated speed (3 x forward FLOPs)."""
    tokens = workload.micro_batch * workload.seq_len
    flops_per_token = 3.0 * workload.stage_forward_flops(0, workload.n_layers) / tokens
    return float(sum(cluster.tflops)) * 1e12 / flops_per_token


def measured_step_s(run: PlanRun, warmup: int, period: int) -> float:
    """Median over the whole sync periods after warm-up of each period's mean seconds per step: a DiLoCo
    step's time depends on whether its outer round falls in it, and the median keeps one step disturbed by
    this machine's load (a straggler copy, a late worker) from moving the figure; period 1: the median step."""
    kept = run.step_seconds[warmup:]
    chunks = [kept[i:i + period] for i in range(0, len(kept) - period + 1, period)] or [kept]
    return float(statistics.median(statistics.fmean(c) for c in chunks))


def _run(cfg: ScalingConfig, cluster: Cluster, workload: Workload, c: Candidate, replicas: int, k: float,
         log_dir: str | None) -> tuple[PlanRun | None, int, str]:
    spec = cfg.spec(replicas, c.choice, PenaltyTable.load() if not c.choice.is_exact else None)
    error = ""
    for attempt in range(1, RUN_ATTEMPTS + 1):
        try:
            return run_plan(spec, cluster, workload, c.plan, cfg.steps, step_timeout_s=cfg.step_timeout_s * k,
                            log_dir=log_dir,
                            on_step=lambda r: log.info("  step %d: %.2f s, loss %.4f", r.step + 1, r.seconds,
                                                       r.loss)), attempt, ""
        except RuntimeError as exc:  # workers that did not start, a disturbed run, a failed step
            error = str(exc)
            log.warning("%s at %d peers failed (%s)%s", c.placement, cluster.n, exc,
                        "; retrying once" if attempt < RUN_ATTEMPTS else "")
    return None, RUN_ATTEMPTS, error


def measure_size(cfg: ScalingConfig, n: int, log_dir: str | None = None) -> list[dict[str, Any]]:
    """Every placement at ``n`` peers: one row each (in the emulated world's seconds, see ``undilated``)."""
    replicas = n // cfg.stages
    k = cfg.dilation_for(n)
    spec = cfg.spec(replicas)
    cluster = build_cluster(cfg, n)
    workload = workload_for(spec, stages=cfg.stages, replicas=replicas)
    bound = float(lower_bound(cluster, workload, cfg.stages, replicas, "full"))
    ideal = device_tokens_per_s(cluster, workload)
    tokens_per_step = spec.n_microbatches * spec.micro_batch * spec.model.seq_len
    rows: list[dict[str, Any]] = []
    for c in candidates(cfg, cluster, workload):
        log.info("%d peers, %s: %s %s predicts %.2f s/step (wall, dilation x%g)", n, c.placement,
                 c.plan.pipelines, c.choice.to_dict()["sync"], c.predicted["total_s"], k)
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        run, attempts, error = _run(cfg, cluster, workload, c, replicas, k,
                                    None if log_dir is None else f"{log_dir}/n{n}-{c.placement}")
        row: dict[str, Any] = {
            "peers": n, "placement": c.placement, "pipelines": c.plan.pipelines,
            "stages": [list(s) for s in c.plan.stages], "choice": c.choice.to_dict(),
            "predicted_step_s": float(c.predicted["total_s"]), "lower_bound_step_s": bound,
            "predicted_pipeline_s": float(c.predicted["pipeline_s"]), "predicted_dp_s": float(c.predicted["dp_s"]),
            "tokens_per_step": tokens_per_step, "device_tokens_per_s_sum": ideal, "attempts": attempts,
            "profile": profile(cluster, workload, c),
            "load_before": round(load_before, 2),
        }
        if run is None:
            row.update({"error": error, "tokens_per_s": None, "measured_step_s": None, "efficiency": None})
        else:
            step_s = measured_step_s(run, cfg.warmup_steps, c.sync_period)
            busy = sum(float(w.get("busy_s", 0.0)) for w in run.workers)
            row.update({
                "measured_step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                "efficiency": tokens_per_step / step_s / ideal,
                "measured_over_predicted": step_s / float(c.predicted["total_s"]),
                "step_seconds": run.step_seconds, "losses": run.losses,
                "overrun_ops": run.overrun_ops, "compute_ops": run.compute_ops,
                # emulated compute seconds over device-seconds of the whole run: how busy the devices were
                "compute_busy_fraction": busy / (n * sum(run.step_seconds)) if run.step_seconds else math.nan,
                "measured_pipeline_s": run.measured_phases(cfg.warmup_steps).pipeline_s,
                "measured_dp_s": run.measured_phases(cfg.warmup_steps).dp_s,
            })
        row["load_after"] = round(os.getloadavg()[0], 2)
        row["run_s"] = round(time.monotonic() - started, 1)
        row = undilated(row, k)
        rows.append(row)
        log.info("%d peers, %s: %s", n, c.placement, _row_text(row))
    return rows


def _row_text(r: dict[str, Any]) -> str:
    if r.get("measured_step_s") is None:
        return f"failed: {r.get('error')}"
    return (f"{r['measured_step_s']:.2f} s/step measured, {r['predicted_step_s']:.2f} predicted, bound "
            f"{r['lower_bound_step_s']:.2f}; {r['tokens_per_s']:.0f} tokens/s, efficiency {r['efficiency']:.1%}; "
            f"overruns {r['overrun_ops']}/{r['compute_ops']}; load {r['load_before']}->{r['load_after']}")


def headline(rows: list[dict[str, Any]], n: int = 16) -> dict[str, Any] | None:
    """Scheduled against random at ``n`` peers, measured and predicted (None when either did not run)."""
    at = {r["placement"]: r for r in rows if r["peers"] == n}
    if "scheduled" not in at or "random" not in at:
        return None
    s, r = at["scheduled"], at["random"]
    out: dict[str, Any] = {
        "peers": n,
        "predicted_scheduled_over_random": r["predicted_step_s"] / s["predicted_step_s"],
        "scheduled_over_random": (r["measured_step_s"] / s["measured_step_s"]
                                  if r.get("measured_step_s") and s.get("measured_step_s") else None),
    }
    if "exact" in at and at["exact"].get("measured_step_s") and r.get("measured_step_s"):
        out["exact_over_random"] = r["measured_step_s"] / at["exact"]["measured_step_s"]
        out["predicted_exact_over_random"] = r["predicted_step_s"] / at["exact"]["predicted_step_s"]
    return out


def run(cfg: ScalingConfig, png: Path | None = None, log_dir: str | None = None) -> dict[str, Any]:
    cfg.validate()
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for n in cfg.peers:
        rows += measure_size(cfg, n, log_dir)
    out: dict[str, Any] = {
        "rows": rows,
        "headline_16": headline(rows),
        "scenario": SCENARIO,
        "bandwidth_scale": cfg.bandwidth_scale,
        "tflops_scale": cfg.tflops_scale,
        "model": asdict(cfg.model),
        "stages": cfg.stages,
        "micro_batch": cfg.micro_batch,
        "microbatches_per_pipeline": cfg.microbatches_per_pipeline,
        "steps": cfg.steps,
        "warmup_steps": cfg.warmup_steps,
        "dilation": {str(n): cfg.dilation_for(n) for n in cfg.peers},
        "cpu_count": os.cpu_count(),
        "seconds": round(time.monotonic() - started, 1),
    }
    if png is not None:
        out["png"] = str(write_png(png, out))
    return out


def merge(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Saved outputs as one: rows by (peers, placement), the last output's row kept; settings must agree."""
    if not outputs:
        raise ValueError("no outputs to merge")
    same = ("scenario", "bandwidth_scale", "tflops_scale", "model", "stages", "micro_batch",
            "microbatches_per_pipeline")
    for o in outputs[1:]:
        differ = [k for k in same if o.get(k) != outputs[0].get(k)]
        if differ:
            raise ValueError(f"the outputs differ in {', '.join(differ)}: their rows do not compare")
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for o in outputs:
        for r in o["rows"]:
            rows[(int(r["peers"]), str(r["placement"]))] = r
    kept = [rows[k] for k in sorted(rows, key=lambda k: (k[0], PLACEMENTS.index(k[1])))]
    out = dict(outputs[-1], rows=kept, headline_16=headline(kept), merged_from=len(outputs))
    dilation: dict[str, float] = {}
    for r in kept:  # a size whose rows came from runs of different K: the largest (the table has each row's)
        dilation[str(r["peers"])] = max(dilation.get(str(r["peers"]), 1.0), float(r.get("time_dilation", 1.0)))
    out["dilation"] = dilation
    out["seconds"] = sum(float(o.get("seconds", 0.0)) for o in outputs)
    return out


def _dilation_text(dilation: dict[str, float]) -> str:
    """The figure title's note on time dilation: one K for all sizes, or each dilated size's."""
    ks = set(dilation.values())
    if ks <= {1.0}:
        return ""
    if len(ks) == 1:
        return f"; time-dilated x{ks.pop():g}"
    return "; time-dilated " + ", ".join(f"x{k:g} at {n}" for n, k in dilation.items() if k != 1.0)


def write_png(path: Path, out: dict[str, Any]) -> Path:
    """Tokens/s against peers per placement (measured: solid, predicted: dotted) and the devices' sum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {"scheduled": "#1b9e77", "random": "#d95f02", "exact": "#7570b3"}
    rows = out["rows"]
    for name, colour in colours.items():
        mine = sorted((r for r in rows if r["placement"] == name), key=lambda r: r["peers"])
        done = [r for r in mine if r.get("tokens_per_s")]
        if not mine:
            continue
        ax.plot([r["peers"] for r in done], [r["tokens_per_s"] for r in done], "o-", color=colour,
                label=f"{name}, measured")
        ax.plot([r["peers"] for r in mine], [r["tokens_per_step"] / r["predicted_step_s"] for r in mine], ":",
                color=colour, label=f"{name}, predicted")
        eff.plot([r["peers"] for r in done], [100 * r["efficiency"] for r in done], "o-", color=colour, label=name)
    for a in (ax, eff):
        a.set_xscale("log", base=2)
        a.set_xticks(sorted({r["peers"] for r in rows}), [str(n) for n in sorted({r["peers"] for r in rows})])
        a.set_xlabel("peers")
        a.legend(fontsize=7)
    ax.set_ylabel("tokens/s")
    eff.set_ylabel("efficiency: tokens/s over the devices' sum (%)")
    fig.suptitle(f"bench.scaling: {out['scenario']}, bandwidth x{out['bandwidth_scale']:g}, "
                 f"TFLOP/s x{out['tflops_scale']:g}, real processes on {out['cpu_count']} shared cores"
                 + _dilation_text(out.get("dilation", {})), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(out: dict[str, Any]) -> str:
    lines = ["| peers | dilation | placement | choice | measured s/step | predicted | lower bound | tokens/s | "
             "efficiency | overruns | load |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        ok = r.get("measured_step_s") is not None
        lines.append(
            f"| {r['peers']} | x{r.get('time_dilation', 1.0):g} | {r['placement']} | "
            f"{r['choice']['compression']}, {r['choice']['sync']} | "
            + (f"{r['measured_step_s']:.2f} | " if ok else "failed | ")
            + f"{r['predicted_step_s']:.2f} | {r['lower_bound_step_s']:.2f} | "
            + (f"{r['tokens_per_s']:.0f} | {r['efficiency']:.1%} | {r['overrun_ops']}/{r['compute_ops']} | "
               if ok else "- | - | - | ")
            + f"{r['load_before']}-{r['load_after']} |")
    h = out.get("headline_16")
    if h:
        meas = h["scheduled_over_random"]
        lines.append(f"\nheadline at 16 peers: scheduled over random x{meas:.2f} measured"
                     if meas else "\nheadline at 16 peers: not measured")
        lines[-1] += f", x{h['predicted_scheduled_over_random']:.2f} predicted"
    return "\n".join(lines)


def _peers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None


def _dilation(text: str) -> tuple[tuple[int, float], ...]:
    """``K`` (every size: returned as N = 0) or ``N=K,N=K``."""
    try:
        if "=" not in text:
            return ((0, float(text)),)
        return tuple((int(n), float(k)) for n, k in (part.split("=", 1) for part in text.split(",") if part.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or N=K,N=K (e.g. 32=8), got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tokens/s of real peer processes on the emulated world-wide "
                                     "network for N peers: scheduled, random and exact placement")
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--peers", type=_peers, default=None, help="comma-separated N (default 4,8,16,32)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (the first is a warm-up)")
    parser.add_argument("--quick", action="store_true", help="4 peers, 3 steps (for tests)")
    parser.add_argument("--png", type=Path, default=None, help=f"draw the figure (e.g. {DEFAULT_PNG})")
    parser.add_argument("--log-dir", default=None, help="keep each worker's log here")
    parser.add_argument("--dilation", type=_dilation, default=None,
                        help="run the emulated world K times slower so that many processes keep up on few cores: "
                        "K for every size, or N=K,N=K per size (default 1; the published figures used 8, see "
                        "docs/benchmarks/scaling.md); figures are reported in the emulated world's seconds")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: join the rows of saved --json outputs (later files win a (peers, "
                        "placement) both hold), print them and draw --png")
    args = parser.parse_args(argv)
    if args.merge is not None:
        try:
            out = merge([json.loads(path.read_text()) for path in args.merge])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--merge: {exc}")
        if args.png is not None:
            out["png"] = str(write_png(args.png, out))
        print(json.dumps(out) if args.json else table(out))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = ScalingConfig().quick() if args.quick else ScalingConfig()
    if args.peers is not None:
        cfg = replace(cfg, peers=args.peers)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.dilation is not None:
        every = dict(args.dilation).get(0)
        cfg = replace(cfg, dilation=tuple((n, every) for n in cfg.peers) if every is not None else args.dilation)
    try:
        cfg.validate()
    except ScalingConfigError as exc:
        parser.error(str(exc))
    out = run(cfg, args.png, args.log_dir)
    print(json.dumps(out) if args.json else table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
