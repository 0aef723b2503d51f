"""The control plane at a thousand peers, simulated: time to the first plan, re-plan time under churn, the
leader's DHT messages per second, the scheduler's time at that size, and how a plan from sampled links
compares with one from the full matrix.

``python -m bench.controlplane [--peers 1000] [--seed 0] [--window 60] [--compare-seeds 3] [--json]``

Runs ``peer.emulation.cpsim`` (the real membership, read policy, election, plan board, progress board and
planner against an in-memory DHT in virtual time, with Weibull churn of volunteer machines; see its module
docstrings for the models and their sources). Figures (virtual seconds unless said otherwise):

* ``first_plan_s``: from the first peer's start (the initial peers start within ``join_spread_s``) to the
  first plan in the DHT;
* ``replan_s_median``: from a plan member's departure (crash or leave, including the leader's) to the first
  plan without it, median over the departures in the churn window (``departures_replanned``; ``replans``
  plans were made for them);
* ``leader_msgs_per_s``: DHT calls (gets and stores) of the leader per second over the churn window;
  ``leader_rpcs_per_s`` counts each call's Kademlia hops; ``worker_msgs_per_s_median`` is a worker's;
* ``plan_cost_ratio_sampled_vs_full``: at the end, plans from the leader's view (the link reports in the
  DHT, every other pair estimated) and plans from the true matrix (same peers and split), one of each per seed
  of ``compare_seeds`` with ``compare_evaluations`` of search (offline, not charged to the simulated planner),
  all costed on the true network with the ``full`` model: the best sampled plan's cost over the best
  full-matrix plan's. At a thousand devices one bounded search is noisy, so a single pair would measure the
  search more than the estimate; ``plan_cost_ratio_seeds`` gives the per-seed ratios and
  ``full_matrix_plan_spread`` the worst over the best full-matrix plan (the search's own noise);
* ``scheduler_s_median`` / ``scheduler_s_max``: real CPU seconds of each plan and re-plan at this size (the
  only figures that vary between runs with the same seed; they depend on the machine's load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from tasklet.peer.emulation.cpsim.churn import ChurnModel
from tasklet.peer.emulation.cpsim.sim import SimConfig, simulate


def run(peers: int, seed: int = 0, window_s: float = 60.0, evaluations: int = 50,
        session_scale_s: float | None = None, compare_seeds: int = 3, compare_evaluations: int = 1000
        ) -> dict[str, Any]:
    cfg = SimConfig(peers=peers, seed=seed, churn_window_s=window_s, plan_evaluations=evaluations,
                    stages=8 if peers >= 64 else 4, compare_seeds=tuple(range(compare_seeds)),
                    compare_evaluations=compare_evaluations)
    if session_scale_s is not None:
        cfg = replace(cfg, churn=ChurnModel(scale_s=session_scale_s))
    wall = time.monotonic()
    result = simulate(cfg)
    out = result.summary()
    out["scheduler_s_median"] = round(statistics.median(result.scheduler_s), 3) if result.scheduler_s else None
    out["scheduler_s_max"] = round(max(result.scheduler_s), 3) if result.scheduler_s else None
    out["plans"] = len(result.scheduler_s)
    out["wall_s"] = round(time.monotonic() - wall, 1)
    out["config"] = {"peers": peers, "seed": seed, "window_s": window_s, "plan_evaluations": evaluations,
                     "stages": cfg.stages, "session": f"Weibull(k={cfg.churn.shape}, scale={cfg.churn.scale_s:g} s)",
                     "graceful_fraction": cfg.churn.graceful_fraction, "plan_charge_s": cfg.plan_charge_s,
                     "compare_seeds": compare_seeds, "compare_evaluations": compare_evaluations}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=1000, help="initial swarm size (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="every random draw comes from it (default: 0)")
    parser.add_argument("--window", type=float, default=60.0,
                        help="virtual seconds of churn simulated after the first plan (default: %(default)s)")
    parser.add_argument("--evaluations", type=int, default=50,
                        help="the scheduler's search budget per plan, in evaluations (default: %(default)s)")
    parser.add_argument("--session-scale", type=float, default=None,
                        help="scale of the Weibull session length in seconds (default: 3600)")
    parser.add_argument("--compare-seeds", type=int, default=3,
                        help="seeds of the offline sampled-vs-full comparison, each for both plans (default: 3)")
    parser.add_argument("--compare-evaluations", type=int, default=1000,
                        help="search budget of each plan of that comparison (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    args = parser.parse_args(argv)
    if args.peers < 4:
        parser.error("--peers must be at least 4")
    if args.window <= 0 or args.evaluations < 1 or args.compare_evaluations < 1:
        parser.error("--window must be positive and --evaluations and --compare-evaluations at least 1")
    if args.compare_seeds < 1:
        parser.error("--compare-seeds must be at least 1")
    out = run(args.peers, args.seed, args.window, args.evaluations, args.session_scale, args.compare_seeds,
              args.compare_evaluations)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:34s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
