"""Command line: ``python -m tasklet.scheduler plan ...`` and ``python -m tasklet.scheduler bench ...``.

Bad input ends with one line ``error: <field>: <reason>`` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from .api import ALGORITHMS, COST_MODELS, plan
from .cluster import Cluster, load_scenario
from .errors import PlanningError
from .plan import Plan
from .workload import Workload


def _region_summary(cluster: Cluster, devices: list[int]) -> str:
    c = Counter(cluster.regions[d] for d in devices)
    return ", ".join(f"{r} x{k}" if k > 1 else r for r, k in c.most_common())


def format_plan(cluster: Cluster, p: Plan) -> str:
    lines = [f"scenario {cluster.name}: {cluster.n} devices, {p.n_stages} stages x {p.n_replicas} replicas"]
    lines.append("stages (layers; data-parallel group's regions):")
    for s, (a, b) in enumerate(p.stages):
        lines.append(f"  stage {s}: layers {a}-{b - 1}; {_region_summary(cluster, p.group(s))}")
    lines.append("pipelines (devices; regions):")
    for r, pipe in enumerate(p.pipelines):
        lines.append(f"  pipeline {r}: {pipe}; {_region_summary(cluster, pipe)}")
    pr = p.predicted
    parts = ", ".join(f"{k} {v:.4f} s" for k, v in pr.items() if k.endswith("_s") and isinstance(v, float))
    lines.append(f"predicted ({pr.get('cost_model')}): {parts}")
    sr = p.search
    lines.append(f"search: {sr.get('algorithm')}; {sr.get('evaluations')} evaluations in "
                 f"{sr.get('seconds')} s ({sr.get('cpu_seconds')} s CPU), seed {sr.get('seed')}")
    if "lower_bound" in sr:
        lines.append(f"lower bound {sr['lower_bound']:.4f} s: gap {100 * sr['gap']:.1f} %"
                     + (f"; search stopped by {sr['stopped_by']}" if sr.get("stopped_by") else ""))
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    cluster = load_scenario(args.scenario)
    workload = Workload.resolve(args.workload)
    if args.stages is not None or args.replicas is not None:
        workload = workload.with_split(args.stages or workload.stages, args.replicas or workload.replicas)
    if args.time_limit is not None and not args.time_limit > 0:
        raise PlanningError("time-limit", "must be > 0 seconds")
    if not 0.0 <= args.gap < 1.0:
        raise PlanningError("gap", "must be in [0, 1)")
    p = plan(cluster, workload, cost_model=args.cost_model, seed=args.seed, time_limit_s=args.time_limit,
             algorithm=args.algorithm, gap=args.gap)
    print(json.dumps(p.to_dict()) if args.json else format_plan(cluster, p))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import format_stop_table, format_table, run_bench, run_stop_bench

    if args.baselines:
        result = run_bench(quick=args.quick, seeds=args.seeds, scenarios_path=args.scenarios,
                           large=not args.no_large, synthetic_64=not args.no_synthetic)
        print(json.dumps(result, indent=1) if args.json else format_table(result))
        return 0
    models = ("dtfm", "full") if args.cost_model == "both" else (args.cost_model,)
    stop = run_stop_bench(quick=args.quick, scenarios_path=args.scenarios, large=not args.no_large,
                          cost_models=models, permutations=args.seeds)
    print(json.dumps(stop, indent=1) if args.json else format_stop_table(stop))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tasklet.scheduler", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan", help="place tasklets on the devices of a scenario")
    pp.add_argument("--scenario", required=True, help="FILE[:NAME] or a scenario name of the shared file")
    pp.add_argument("--workload", default="gpt3-xl-dtfm", help="preset name or FILE.json")
    pp.add_argument("--stages", type=int)
    pp.add_argument("--replicas", type=int)
    pp.add_argument("--cost-model", choices=COST_MODELS, default="full")
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--algorithm", choices=ALGORITHMS, default="memetic",
                    help="memetic (default) or ils (the previous iterated local search)")
    pp.add_argument("--time-limit", type=float,
                    help="cap on search seconds (default: 5 s for 64 devices, x sqrt(devices / 64)); the search "
                         "also has an evaluation budget sized to end in about 60%% of it on a 2-core machine, so "
                         "the same scenario gives the same plan on every run, whatever the device numbering")
    pp.add_argument("--gap", type=float, default=0.02,
                    help="stop once the plan is proven within this fraction of optimal (default 0.02; 0: never)")
    pp.add_argument("--json", action="store_true")
    pp.set_defaults(func=cmd_plan)
    bp = sub.add_parser("bench", help="how the search stops (cost over time, bound, gap, re-plans); "
                        "--baselines: vs the paper's search and baselines")
    bp.add_argument("--baselines", action="store_true", help="the comparison with random, rank order, the "
                    "paper's search and our ILS instead")
    bp.add_argument("--cost-model", choices=(*COST_MODELS, "both"), default="both",
                    help="cost model(s) of the stopping benchmark (default both)")
    bp.add_argument("--quick", action="store_true", help="smaller budgets (paper GA: 500 candidates); the "
                    "stopping benchmark skips the 256 / 1,024-device scenarios")
    bp.add_argument("--seeds", type=int, default=3, help="device numberings (shuffles) per scenario")
    bp.add_argument("--scenarios", default=None, help="scenarios file (default: shared / packaged)")
    bp.add_argument("--no-large", action="store_true", help="skip the synthetic 256 / 1,024-device scenarios")
    bp.add_argument("--no-synthetic", action="store_true", help="skip the synthetic 64-device scenarios")
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(func=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # argparse already printed a one-line usage error
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except PlanningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
