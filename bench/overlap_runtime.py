"""The outer round behind compute, timed end to end: the scheduler's DiLoCo choice with its outer round in step
against the same choice landing one inner step late (``RunSpec.outer_overlap``), on the emulated 8-peer
world-wide swarm of real worker processes that ``bench.bandwidth --measured`` uses.

    python -m bench.overlap --runtime [--json] [--steps N] [--period H] [--quick]

Both runs use the scheduler's placement and choice for the 1.3B GPT at the 2 % loss limit (``--period``
replaces its H), on the small wide model, links and devices of ``bench.bandwidth_measured.MeasuredConfig``; the
late run differs only in ``outer_overlap``. Reported per run: the mean seconds per step after the first (process
warm-up), the steps that end a round apart from the others, the ``full`` model's prediction of the same run
(``scheduler.compression.predict``: a ``-late`` option costs ``max(0, round - inner step) / H``), and the
losses. The loss these runs reach is not the comparison (a few dozen steps, one seed): ``bench.overlap`` measures
what landing late costs in loss, and ``bench.bandwidth`` puts it in the table the scheduler reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
from typing import Any

from bench.bandwidth_measured import MeasuredConfig, claim_choice, world
from bench.headline.run import PlanRun, run_plan
from tasklet.peer.emulation.network import scaled_cluster
from tasklet.scheduler.compression import Choice, PenaltyTable, SyncOption, predict
from tasklet.scheduler.plan import Plan, even_stages

log = logging.getLogger("bench.overlap")
RUNTIME_STEPS = 16


def _split(r: PlanRun, period: int) -> dict[str, float | None]:
    """Mean seconds of the steps after the first, and of those ending a round and the others apart."""
    secs = list(enumerate(r.step_seconds))[1:]
    ends = [s for k, s in secs if (k + 1) % period == 0]
    inner = [s for k, s in secs if (k + 1) % period != 0]
    return {"mean": statistics.fmean(s for _, s in secs),
            "round_end": statistics.fmean(ends) if ends else None,
            "other": statistics.fmean(inner) if inner else None}


def runtime(cfg: MeasuredConfig, steps: int = RUNTIME_STEPS, period: int | None = None,
            log_dir: str | None = None) -> dict[str, Any]:
    """The two runs and their figures (module docstring)."""
    layout, choice = claim_choice(cfg.search_time_limit_s)
    layout = Plan(even_stages(cfg.n_layers, 4), layout.pipelines)  # the small model: one layer per stage
    sync = choice.sync if period is None else SyncOption(period, choice.sync.pseudo_grad_compression or "int8")
    if sync.period < 2:
        raise ValueError(f"the choice {sync.name} has no outer round to overlap; pass --period H (H >= 2)")
    in_step = Choice(choice.activation, sync)
    late = Choice(choice.activation, dataclasses.replace(sync, overlap=True))
    penalties = PenaltyTable.load()
    cluster = scaled_cluster(world(), cfg.bandwidth_scale, cfg.tflops_scale)
    workload = cfg.workload()
    base = cfg.spec(in_step, penalties)  # the outer setting the in-step option was measured with, for both
    load = [os.getloadavg()[0]]
    runs: dict[str, PlanRun] = {}
    for name, c in (("in_step", in_step), ("late", late)):
        spec = dataclasses.replace(base, run_id=f"bench-overlap-{name}", outer_overlap=c.sync.overlap).validate()
        log.info("%s: %s on %s", name, c.to_dict(), layout.pipelines)
        runs[name] = run_plan(spec, cluster, workload, layout, steps, step_timeout_s=cfg.step_timeout_s,
                              log_dir=None if log_dir is None else f"{log_dir}/{name}",
                              on_step=lambda r, n=name: log.info("  %s step %d: %.2f s, loss %.4f", n, r.step + 1,
                                                                 r.seconds, r.loss))
        load.append(os.getloadavg()[0])
    out: dict[str, Any] = {"choice": {n: c.to_dict() for n, c in (("in_step", in_step), ("late", late))},
                           "pipelines": layout.pipelines, "steps": steps, "step_s": {}}
    for name, c in (("in_step", in_step), ("late", late)):
        pred = predict(cluster, workload, layout, c)
        measured = _split(runs[name], sync.period)
        out["step_s"][name] = {**measured, "predicted": float(pred["total_s"]),
                               "predicted_pipeline_s": float(pred["pipeline_s"]),
                               "predicted_dp_s": float(pred["dp_s"]),
                               "measured_over_predicted": measured["mean"] / float(pred["total_s"])}
    st = out["step_s"]
    out["measured_speedup"] = st["in_step"]["mean"] / st["late"]["mean"]
    out["predicted_speedup"] = st["in_step"]["predicted"] / st["late"]["predicted"]
    out["losses"] = {n: r.losses for n, r in runs.items()}
    out["step_seconds"] = {n: r.step_seconds for n, r in runs.items()}
    out["overrun_ops"] = {n: r.overrun_ops for n, r in runs.items()}
    out["config"] = dataclasses.asdict(cfg)
    out["load_average"] = [round(x, 2) for x in load]
    return out


def summary(out: dict[str, Any]) -> str:
    st = out["step_s"]

    def row(n: str) -> str:
        s = st[n]
        ends = "-" if s["round_end"] is None else f"{s['round_end']:.2f}"
        other = "-" if s["other"] is None else f"{s['other']:.2f}"
        return (f"{n:8s} {s['mean']:6.2f} s/step (round end {ends}, other {other}); predicted {s['predicted']:.2f}"
                f" (x{s['measured_over_predicted']:.3f})")

    return "\n".join([f"choice {out['choice']['late']['sync']} on {out['pipelines']}, {out['steps']} steps",
                      row("in_step"), row("late"),
                      f"speed-up {out['measured_speedup']:.3f}x measured, {out['predicted_speedup']:.3f}x predicted",
                      f"load average {out['load_average']}"])
