"""Turn measured runs into the headline's figures: per-plan summaries, the random median, the targets, a table.

Pure functions over plain data (no processes, no clock), so the arithmetic of the report is tested on its own.

The figures, and why each is defined the way it is:

* ``measured_step_s``: median step time after warm-up. The median, not the mean, because a loaded shared
  machine adds rare long stalls that say nothing about the placement.
* ``tokens_per_s = tokens_per_step / measured_step_s``: every plan trains the same global batch per step.
* random placement is one plan family with several seeds; its entry is the run of the *median* seed (by
  measured step time), so its losses, phases and prediction are those of a real run rather than a blend.
* speed-up = random / scheduled, measured and predicted; the target says the runtime realises the
  scheduler's promise "within 20 %": ``measured_speedup / predicted_speedup >= 0.8``, the same 20 % band as
  the per-run measured/predicted target.
* phases: the pipeline phase (step start to the last commit, when the coordinator starts the averaging) and
  the averaging phase, measured and as the ``full`` model predicts them (``pipeline_s``, ``dp_s``). When a
  total disagrees, they say which part of the model (pipeline schedule or gradient sync) is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bench.headline.run import PlanRun
from bench.headline.setup import PLAN_NAMES, Candidate, median_index

RATIO_TOLERANCE = 0.20


@dataclass
class RunSummary:
    """One run's figures (one candidate plan trained once)."""

    name: str
    label: str
    pipelines: list[list[int]]
    stages: list[tuple[int, int]]
    measured_step_s: float
    predicted_step_s: float
    tokens_per_s: float
    losses: list[float]
    step_s: list[float]
    ended_at_s: list[float]
    measured_pipeline_s: float
    measured_dp_s: float
    predicted_pipeline_s: float
    predicted_dp_s: float
    overrun_ops: int
    compute_ops: int

    @property
    def ratio(self) -> float:
        return self.measured_step_s / self.predicted_step_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "ratio": self.ratio,
            "tokens_per_s": self.tokens_per_s,
            "losses": self.losses,
            "step_s": self.step_s,
            "ended_at_s": self.ended_at_s,
            "phases": {"measured_pipeline_s": self.measured_pipeline_s, "measured_dp_s": self.measured_dp_s,
                       "predicted_pipeline_s": self.predicted_pipeline_s, "predicted_dp_s": self.predicted_dp_s},
            "overrun_ops": self.overrun_ops,
            "compute_ops": self.compute_ops,
            "plan": {"stages": [list(s) for s in self.stages], "pipelines": self.pipelines},
        }


def summary_from_dict(d: dict[str, Any]) -> RunSummary:
    """Inverse of :meth:`RunSummary.as_dict` (to redraw a figure from a saved ``--json`` result)."""
    try:
        ph = d["phases"]
        return RunSummary(
            name=str(d["name"]), label=str(d["label"]), pipelines=[list(p) for p in d["plan"]["pipelines"]],
            stages=[(int(a), int(b)) for a, b in d["plan"]["stages"]], measured_step_s=float(d["measured_step_s"]),
            predicted_step_s=float(d["predicted_step_s"]), tokens_per_s=float(d["tokens_per_s"]),
            losses=[float(x) for x in d["losses"]], step_s=[float(x) for x in d["step_s"]],
            ended_at_s=[float(x) for x in d["ended_at_s"]], measured_pipeline_s=float(ph["measured_pipeline_s"]),
            measured_dp_s=float(ph["measured_dp_s"]), predicted_pipeline_s=float(ph["predicted_pipeline_s"]),
            predicted_dp_s=float(ph["predicted_dp_s"]), overrun_ops=int(d["overrun_ops"]),
            compute_ops=int(d["compute_ops"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"runs[]: not a saved headline run ({type(exc).__name__}: {exc})") from None


def summarise(candidate: Candidate, run: PlanRun, warmup_steps: int, tokens_per_step: int) -> RunSummary:
    measured = run.measured_step_s(warmup_steps)
    phases = run.measured_phases(warmup_steps)
    pred = candidate.predicted
    return RunSummary(
        name=candidate.name, label=candidate.label, pipelines=[list(p) for p in candidate.plan.pipelines],
        stages=[tuple(s) for s in candidate.plan.stages], measured_step_s=measured,
        predicted_step_s=candidate.predicted_step_s,
        tokens_per_s=tokens_per_step / measured, losses=list(run.losses), step_s=list(run.step_seconds),
        ended_at_s=list(run.ended_at_s), measured_pipeline_s=phases.pipeline_s, measured_dp_s=phases.dp_s,
        predicted_pipeline_s=float(pred["pipeline_s"]), predicted_dp_s=float(pred["dp_s"]),
        overrun_ops=run.overrun_ops, compute_ops=run.compute_ops)


def representatives(runs: list[RunSummary]) -> dict[str, RunSummary]:
    """One run per plan family: the only one, or for ``random`` the run of the median seed."""
    out: dict[str, RunSummary] = {}
    for name in PLAN_NAMES:
        family = [r for r in runs if r.name == name]
        if not family:
            raise ValueError(f"no run of plan {name!r}")
        out[name] = family[median_index([r.measured_step_s for r in family])]
    return out


def max_loss_difference(runs: list[RunSummary]) -> float:
    """Largest |loss_a(step) - loss_b(step)| over every pair of runs and every step they share."""
    worst = 0.0
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            for x, y in zip(a.losses, b.losses, strict=False):
                worst = max(worst, abs(x - y)) if math.isfinite(x) and math.isfinite(y) else math.inf
    return worst


def targets(reps: dict[str, RunSummary], runs: list[RunSummary], loss_tolerance: float = 1e-3) -> dict[str, Any]:
    """The issue's three targets, each with the figures it was decided on."""
    sched, rand = reps["scheduled"], reps["random"]
    predicted = rand.predicted_step_s / sched.predicted_step_s
    measured = rand.measured_step_s / sched.measured_step_s
    ratios = {r.label: r.ratio for r in runs}
    loss_diff = max_loss_difference(runs)
    return {
        "speedup": {"predicted": predicted, "measured": measured, "measured_over_predicted": measured / predicted,
                    "met": measured / predicted >= 1 - RATIO_TOLERANCE},
        "measured_over_predicted": {"per_run": ratios,
                                    "met": all(abs(x - 1) <= RATIO_TOLERANCE for x in ratios.values())},
        "losses_agree": {"max_abs_diff": loss_diff, "tolerance": loss_tolerance, "met": loss_diff <= loss_tolerance},
        "overrun_ops": {"total": sum(max(r.overrun_ops, 0) for r in runs),
                        "compute_ops": sum(r.compute_ops for r in runs),
                        "missing_status": any(r.overrun_ops < 0 for r in runs)},
    }


def table(runs: list[RunSummary], reps: dict[str, RunSummary]) -> str:
    """A Markdown table: one row per run, the representative of each family marked."""
    head = ("| plan | pipelines (device per stage) | measured s/step | predicted (full) | measured/predicted "
            "| tokens/s | pipeline phase meas./pred. | averaging meas./pred. |")
    rows = [head, "|" + " --- |" * 8]
    chosen = {id(r) for r in reps.values()}
    for r in runs:
        mark = " (median)" if r.name == "random" and id(r) in chosen and sum(x.name == "random" for x in runs) > 1 \
            else ""
        rows.append(f"| {r.label}{mark} | {r.pipelines} | {r.measured_step_s:.2f} | {r.predicted_step_s:.2f} | "
                    f"{r.ratio:.2f} | {r.tokens_per_s:.0f} | "
                    f"{r.measured_pipeline_s:.2f} / {r.predicted_pipeline_s:.2f} | "
                    f"{r.measured_dp_s:.2f} / {r.predicted_dp_s:.2f} |")
    return "\n".join(rows)
