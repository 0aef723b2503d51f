"""The headline, measured: a scheduled swarm against random placement on an emulated world-wide network.

``python -m bench.headline [--json] [--quick] [--steps N] [--random-seeds K] [--png PATH]``
``python -m bench.headline --replot SAVED.json [--png PATH]`` redraws the figure and table of a saved result.

Eight real worker processes (one per city of the paper's ``worldwide_geo_distributed`` scenario, see
``bench.headline.setup`` for the world and its scales) train the same small GPT, with the same seed, under
three placements of its 4 stages x 2 replicas: the scheduler's plan (``full`` cost model), random placement
(median of K seeds) and rank order. Each run is real: gRPC between processes, link shaping per directed pair,
emulated device speed, the task pool, gradient averaging. For each plan the bench reports the measured
seconds per step (median after warm-up), tokens/s, the ``full`` model's prediction and measured/predicted,
checks the issue's targets, and draws ``docs/headline.png`` (throughput; loss against wall-clock time).

Progress goes to stderr; stdout carries the table (or, with ``--json``, one JSON object whose ``plans`` maps
``scheduled``/``random``/``rank_order`` to ``{measured_step_s, predicted_step_s, tokens_per_s, losses, ...}``,
plus ``bandwidth_scale``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.headline.plot import write_png
from bench.headline.report import RunSummary, representatives, summarise, summary_from_dict, table, targets
from bench.headline.run import PlanRun, run_plan
from bench.headline.setup import Candidate, HeadlineConfig, HeadlineConfigError, prepare
from tasklet.peer.runtime.lead.coordinator import StepReport
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler import Cluster, PlanningError, Workload

log = logging.getLogger("bench.headline")

DEFAULT_PNG = Path("docs/headline.png")
RUN_ATTEMPTS = 2  # a run is retried once: on a loaded shared machine 8 workers importing torch can time out


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run_one(cfg: HeadlineConfig, spec: RunSpec, cluster: Cluster, workload: Workload, candidate: Candidate,
             tag: str, log_dir: str | None) -> tuple[PlanRun, int]:
    """Train one candidate, retrying once if the swarm fails; returns the run and the attempts it took."""
    def on_step(r: StepReport) -> None:
        _progress(f"{tag} step {r.step + 1}/{cfg.steps}: {r.seconds:.2f} s, loss {r.loss:.4f}, "
                  f"micro-batches per pipeline {r.microbatches_per_pipeline}")

    for attempt in range(1, RUN_ATTEMPTS + 1):
        try:
            return run_plan(spec, cluster, workload, candidate.plan, cfg.steps, on_step=on_step,
                            log_dir=log_dir), attempt
        except RuntimeError as exc:  # workers that did not start, a step that failed
            if attempt == RUN_ATTEMPTS:
                raise RuntimeError(f"{candidate.label}: {exc}") from exc
            _progress(f"{tag} failed ({exc}); retrying once")
    raise AssertionError("unreachable")


def run_headline(cfg: HeadlineConfig, png: Path | None = None, log_dir: str | None = None) -> dict[str, Any]:
    """Plan, train every candidate, summarise; the JSON-ready result (and the PNG if ``png``)."""
    started = time.monotonic()
    spec, cluster, workload, candidates = prepare(cfg)
    _progress(f"planned in {time.monotonic() - started:.1f} s: "
              + ", ".join(f"{c.label} {c.plan.pipelines} predicts {c.predicted_step_s:.2f} s" for c in candidates))
    runs: list[RunSummary] = []
    attempts: dict[str, int] = {}
    for i, c in enumerate(candidates, 1):
        tag = f"[{i}/{len(candidates)}] {c.label}"
        run, attempts[c.label] = _run_one(cfg, spec, cluster, workload, c, tag, log_dir)
        runs.append(summarise(c, run, cfg.warmup_steps, cfg.tokens_per_step))
        s = runs[-1]
        _progress(f"{tag}: {s.measured_step_s:.2f} s/step measured, {s.predicted_step_s:.2f} s predicted "
                  f"(x{s.ratio:.2f}), overrun ops {s.overrun_ops}/{s.compute_ops}")
    reps = representatives(runs)
    out: dict[str, Any] = {
        "plans": {name: {"measured_step_s": r.measured_step_s, "predicted_step_s": r.predicted_step_s,
                         "tokens_per_s": r.tokens_per_s, "losses": r.losses,
                         **{k: v for k, v in r.as_dict().items() if k not in ("losses",)}}
                  for name, r in reps.items()},
        "bandwidth_scale": cfg.bandwidth_scale,
        "tflops_scale": cfg.tflops_scale,
        "scenario": cfg.scenario,
        "devices": [{"device": i, "scenario_device": d, "city": cluster.regions[i]} for i, d in enumerate(cfg.devices)],
        "delay_ms_range": _off_diagonal_range(cluster.delay_s, 1e-3),
        "bandwidth_mbps_range": _off_diagonal_range(cluster.bandwidth_bps, 1e6),
        "emulated_tflops": float(cluster.tflops[0]),
        "model": asdict(cfg.model),
        "stages": cfg.stages, "replicas": cfg.replicas, "micro_batch": cfg.micro_batch,
        "n_microbatches": cfg.n_microbatches, "tokens_per_step": cfg.tokens_per_step,
        "steps": cfg.steps, "warmup_steps": cfg.warmup_steps, "random_seeds": list(cfg.random_seeds),
        "targets": targets(reps, runs),
        "runs": [r.as_dict() for r in runs],
        "attempts": attempts,
        "table": table(runs, reps),
        "seconds": time.monotonic() - started,
    }
    if png is not None:
        out["png"] = str(write_png(png, reps, runs, cfg.tokens_per_step, _subtitle(out)))
    return out


def _subtitle(out: dict[str, Any]) -> str:
    return (f"{out['stages']} stages x {out['replicas']} replicas, one peer per city of {out['scenario']}; "
            f"bandwidth x{out['bandwidth_scale']:g}, TFLOP/s x{out['tflops_scale']:g}, delays as measured")


def replot(saved: Path, png: Path | None) -> dict[str, Any]:
    """Rebuild the table (and the figure, if ``png``) of a result saved with ``--json``."""
    try:
        out = json.loads(saved.read_text())
        runs = [summary_from_dict(d) for d in out["runs"]]
        tokens_per_step = int(out["tokens_per_step"])
        _subtitle(out)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--replot {saved}: {exc}") from None
    reps = representatives(runs)
    out["table"] = table(runs, reps)
    out.pop("png", None)
    if png is not None:
        out["png"] = str(write_png(png, reps, runs, tokens_per_step, _subtitle(out)))
    return out


def _off_diagonal_range(matrix: np.ndarray, unit: float) -> list[float]:
    """[min, max] of the links between distinct devices, divided by ``unit``."""
    off = matrix[~np.eye(matrix.shape[0], dtype=bool)] / unit
    return [float(off.min()), float(off.max())]


def _human(out: dict[str, Any]) -> str:
    t = out["targets"]
    sp = t["speedup"]
    ratio = t["measured_over_predicted"]
    loss = t["losses_agree"]
    ov = t["overrun_ops"]
    lines = [
        f"world: {out['scenario']}, cities {[d['city'] for d in out['devices']]}; one-way delay "
        f"{out['delay_ms_range'][0]:.0f}-{out['delay_ms_range'][1]:.0f} ms (as measured), bandwidth "
        f"{out['bandwidth_mbps_range'][0]:.2f}-{out['bandwidth_mbps_range'][1]:.2f} Mbit/s "
        f"(scenario x{out['bandwidth_scale']:g}), {out['emulated_tflops']:.2g} TFLOP/s per device "
        f"(V100 x{out['tflops_scale']:g})",
        "",
        out["table"],
        "",
        f"speed-up scheduled vs random: measured x{sp['measured']:.2f}, predicted x{sp['predicted']:.2f} "
        f"(measured/predicted {sp['measured_over_predicted']:.2f}) -> target {'met' if sp['met'] else 'MISSED'}",
        f"measured/predicted within 20% for every run: {'met' if ratio['met'] else 'MISSED'} "
        f"({', '.join(f'{k} {v:.2f}' for k, v in ratio['per_run'].items())})",
        f"loss curves agree: max |difference| {loss['max_abs_diff']:.2e} -> {'met' if loss['met'] else 'MISSED'}",
        f"ops whose real compute overran the emulated device: {ov['total']} of {ov['compute_ops']}",
    ]
    if "png" in out:
        lines.append(f"figure: {out['png']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only one JSON object on stdout")
    parser.add_argument("--quick", action="store_true",
                        help="3 steps, one random seed, no figure unless --png is given (about a minute or two)")
    parser.add_argument("--steps", type=int, help="steps per run, the first is warm-up (default 6)")
    parser.add_argument("--random-seeds", type=int, metavar="K", help="random placements to run (default 3)")
    parser.add_argument("--bandwidth-scale", type=float, help="multiply every bandwidth (default 0.01)")
    parser.add_argument("--tflops-scale", type=float, help="multiply every device's TFLOP/s (default 1e-5)")
    parser.add_argument("--png", type=Path, help=f"write the figure here (default {DEFAULT_PNG}, none with --quick)")
    parser.add_argument("--log-dir", help="keep each worker's log in this folder")
    parser.add_argument("--replot", type=Path, metavar="SAVED_JSON",
                        help="run nothing: redraw the figure and table of a result saved with --json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    if args.replot is not None:
        try:
            out = replot(args.replot, args.png if args.png is not None else DEFAULT_PNG)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(out) if args.json else _human(out))
        return 0

    cfg = HeadlineConfig()
    if args.quick:
        cfg = cfg.quick()
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.random_seeds is not None:
        if args.random_seeds < 1:
            parser.error("--random-seeds: must be at least 1")
        cfg = replace(cfg, random_seeds=tuple(range(args.random_seeds)))
    if args.bandwidth_scale is not None:
        cfg = replace(cfg, bandwidth_scale=args.bandwidth_scale)
    if args.tflops_scale is not None:
        cfg = replace(cfg, tflops_scale=args.tflops_scale)
    try:
        cfg.validate()
    except HeadlineConfigError as exc:
        parser.error(str(exc))
    png = args.png if args.png is not None else (None if args.quick else DEFAULT_PNG)
    try:
        out = run_headline(cfg, png=png, log_dir=args.log_dir)
    except (PlanningError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out) if args.json else _human(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
