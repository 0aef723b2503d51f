"""What hiding DiLoCo's outer round behind the next round's compute costs in loss, and what each pseudo-gradient
codec costs, on the small model ``bench.bandwidth`` measures penalties with.

    python -m bench.overlap [--json] [--seeds K] [--periods 2,16,32] [--codecs int8,topk2] [--modes sync,...]
                            [--tau T] [--steps N] [--quick]
    python -m bench.overlap --runtime [--json] [--steps N] [--period H] [--quick]   (bench/overlap_runtime.py)

For every period H and codec: DiLoCo with the outer step taken at each round's end (``sync``); one round late
(round k's average applied at the end of round k + 1), either ``delayed`` (each pipeline goes on with its own
progress of round k + 1) or ``eager`` (a provisional outer step with its own fresh pseudo-gradient for its share
and the others' previous ones for theirs); and ``streaming`` (the average lands ``--tau`` inner steps into the
next round, each pipeline keeping its progress of those steps) (``bench.bandwidth.OuterLoop``), each against
exact training on the same seed (paired), on
``seeds`` measurement seeds. The gap is the relative validation loss after ``steps`` steps (mean of the
evaluations in the last quarter; a run with a round pending is evaluated with that round applied, as the run
ends). The outer optimizer of each period is the one the shipped penalty table measured it with, else the
DiLoCo paper's lr 0.7 / momentum 0.9. Runs go in parallel (2 forked processes).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from bench import bandwidth as bw
from tasklet.peer.compute.data import Corpus
from tasklet.scheduler.compression import Choice, PenaltyTable, SyncOption

log = logging.getLogger("bench.overlap")
PERIODS = (2, 16, 32)
CODECS = ("int8", "topk2")
# the outer step at the round's end; one round late, two ways; tau inner steps late (bench.bandwidth.OuterLoop)
MODES = ("sync", "delayed", "eager", "streaming")
TAU = 1
SEEDS = 3


def outer_setting(table: PenaltyTable, sync: SyncOption) -> tuple[float, float]:
    """(outer lr, momentum) the shipped table measured ``sync`` (or its int8 twin) with; else 0.7 / 0.9."""
    for s in (sync, SyncOption(sync.period, "int8")):
        got = table.outer_for(s)
        if "outer_lr" in got:
            return float(got["outer_lr"]), float(got.get("outer_momentum", 0.0))
    return 0.7, 0.9


def run(cfg: bw.TrainConfig, periods: tuple[int, ...], codecs: tuple[str, ...], seeds: int,
        modes: tuple[str, ...] = MODES, tau: int = TAU) -> dict[str, Any]:
    torch.set_num_threads(1)
    raw = Corpus.from_stdlib(cfg.corpus_bytes).data.numpy().tobytes()
    cut = int(len(raw) * 0.9)
    bw._CORPORA = (Corpus.from_bytes(raw[:cut], "stdlib[:90%]"), Corpus.from_bytes(raw[cut:], "stdlib[90%:]"))
    n_b = len(cfg.stages) - 1
    table = PenaltyTable.load()
    seed_list = [cfg.seed + i for i in range(seeds)]
    jobs: list[tuple[Any, ...]] = [(replace(cfg, seed=s), Choice.exact(n_b + 1), cfg.steps, None, f"exact-{s}", None)
                                   for s in seed_list]
    rows = []
    for h in periods:
        for codec in codecs:
            sync = SyncOption(h, codec)
            lr, mom = outer_setting(table, sync)
            rows.append({"period": h, "codec": codec, "outer_lr": lr, "outer_momentum": mom})
            for mode in modes:
                for s in seed_list:
                    c = replace(cfg, seed=s, outer_lr=lr, outer_momentum=mom, overlap="" if mode == "sync" else mode,
                                overlap_steps=tau)
                    jobs.append((c, Choice(("none",) * n_b, sync), cfg.steps, None, f"{sync.name}-{mode}-{s}", None))
    t0 = time.perf_counter()
    log.info("%d training runs of %d steps on seeds %s", len(jobs), cfg.steps, seed_list)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        curves = {c.name: c for c in pool.map(bw._train_job, jobs)}
    final = {name: c.final(cfg.steps, cfg.final_window) for name, c in curves.items()}
    for row in rows:
        name = SyncOption(row["period"], row["codec"]).name
        for mode in modes:
            gaps = [final[f"{name}-{mode}-{s}"] / final[f"exact-{s}"] - 1 for s in seed_list]
            row[f"{mode}_gap"] = round(statistics.fmean(gaps), 5)
            row[f"{mode}_gaps_per_seed"] = [round(g, 5) for g in gaps]
        for mode in modes[1:]:
            row[f"{mode}_cost"] = round(row[f"{mode}_gap"] - row["sync_gap"], 5)
    return {"steps": cfg.steps, "seeds": seed_list, "modes": list(modes), "tau": tau, "rows": rows,
            "seconds": round(time.perf_counter() - t0, 1),
            "gap": "relative validation-loss gap to exact training on the same seed, mean over seeds"}


def table(result: dict[str, Any]) -> str:
    late = result["modes"][1:]
    names = {"streaming": f"streaming, tau {result['tau']}"}
    lines = [f"{result['steps']} steps, seeds {result['seeds']} ({result['seconds']} s)",
             "| H | codec | outer lr / momentum | in step | " + " | ".join(f"{names.get(m, m)} (cost)" for m in late)
             + " |", "| --- " * (4 + len(late)) + "|"]
    for r in result["rows"]:
        cells = [f"{r[f'{m}_gap']:+.2%} ({r[f'{m}_cost']:+.2%})" for m in late]
        head = f"| {r['period']} | {r['codec']} | {r['outer_lr']} / {r['outer_momentum']} | {r['sync_gap']:+.2%} | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError("periods must be at least 2")
    return values


def _codecs(text: str) -> tuple[str, ...]:
    values = tuple(text.split(","))
    for v in values:
        try:
            SyncOption(2, v)
        except Exception as exc:  # PlanningError names the options
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return values


def _modes(text: str) -> tuple[str, ...]:
    values = tuple(text.split(","))
    if values[0] != "sync" or len(set(values)) != len(values) or not set(values) <= set(MODES):
        raise argparse.ArgumentTypeError(f"expected sync, then some of {', '.join(MODES[1:])}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="measurement seeds (default %(default)s)")
    parser.add_argument("--periods", type=_ints, default=PERIODS, help="sync periods H (default 2,16,32)")
    parser.add_argument("--codecs", type=_codecs, default=CODECS, help="pseudo-gradient codecs (default int8,topk2)")
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default 256; quick: 16)")
    parser.add_argument("--modes", type=_modes, default=MODES, help="sync first, then any of delayed, eager, "
                        "streaming (default: all)")
    parser.add_argument("--tau", type=int, default=TAU, help="streaming: inner steps the average may take, below "
                        "every H (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (seconds; for tests)")
    parser.add_argument("--runtime", action="store_true", help="time the outer round in step against landing one "
                        "inner step late on the emulated 8-peer swarm of real processes (bench/overlap_runtime.py; "
                        "--steps: steps of each run, default 16; --period: the choice's H replaced)")
    parser.add_argument("--period", type=int, default=None, help="--runtime: DiLoCo period H (default: the "
                        "scheduler's choice)")
    args = parser.parse_args(argv)
    if args.runtime:
        return _runtime(args, parser)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if not 1 <= args.tau < min(args.periods):
        parser.error("--tau must be at least 1 and below every period")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = bw.QUICK if args.quick else bw.TrainConfig()
    if args.steps is not None:
        if args.steps < 2:
            parser.error("--steps must be at least 2")
        cfg = replace(cfg, steps=args.steps)
    result = run(cfg, args.periods, args.codecs, args.seeds, args.modes, args.tau)
    print(json.dumps(result) if args.json else table(result))
    return 0


def _runtime(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from bench import overlap_runtime as rt
    from bench.bandwidth_measured import MeasuredConfig

    if args.period is not None and args.period < 2:
        parser.error("--period must be at least 2 (an outer round to overlap)")
    steps = args.steps if args.steps is not None else (4 if args.quick else rt.RUNTIME_STEPS)
    if steps < 2:
        parser.error("--steps must be at least 2")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    out = rt.runtime(MeasuredConfig().small() if args.quick else MeasuredConfig(), steps, args.period)
    print(json.dumps(out) if args.json else rt.summary(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
