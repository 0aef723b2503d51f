"""Pipeline efficiency: measured step time of a 4-process run against the scheduler's ``full`` prediction.

``python -m bench.pipeline [--json] [--steps N]``

Four worker processes on loopback form 2 stages x 2 replicas of a small GPT. The emulated cluster has two
"regions" (fast links inside, slow across) and devices of different emulated speed; the scheduler places the
tasklets, predicts the iteration time with its ``full`` cost model, and the swarm then trains for real:
gRPC, link shaping, emulated compute, task pool, reduce-scatter/all-gather. The figure of merit is
measured / predicted (target: within 15 %). The first step is a warm-up and is not counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import numpy as np

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.emulation.local import train_plan
from tasklet.peer.emulation.network import link_model
from tasklet.peer.node.planning import workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler import Cluster, plan
from tasklet.scheduler.cost_full import predict

MODEL = ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64, seed=0)
SPEC = RunSpec(run_id="bench-pipeline", model=MODEL, seed=0, micro_batch=4, n_microbatches=8)


def bench_cluster() -> Cluster:
    """Two regions of two devices: 5 ms / 100 Mbit/s inside a region, 25 ms / 25 Mbit/s across.

    TFLOP/s are emulated and tiny (a CPU emulates a slow device): a stage's forward takes tens of ms.
    """
    region = [0, 0, 1, 1]
    same = np.equal.outer(region, region)
    delay = np.where(same, 0.005, 0.025)
    bw = np.where(same, 100e6, 25e6)
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bw, np.inf)
    return Cluster(delay_s=delay, bandwidth_bps=bw, tflops=np.array([0.0020, 0.0015, 0.0020, 0.0010]),
                   memory_bytes=np.full(4, 8e9), regions=["a", "a", "b", "b"],
                   name="bench-pipeline")


def run(steps: int) -> dict[str, object]:
    cluster = bench_cluster()
    workload = workload_for(SPEC, stages=2, replicas=2)
    p = plan(cluster, workload, cost_model="full", seed=0, time_limit_s=5)
    predicted = predict(cluster, workload, p)
    result = train_plan(SPEC, p.stages, p.pipelines, steps, links=link_model(cluster),
                        forward_flops=workload.stage_forward_flops, collect_states=False)
    measured = statistics.median(result.step_seconds[1:])
    return {
        "measured_step_s": measured,
        "predicted_step_s": float(predicted["total_s"]),
        "ratio": measured / float(predicted["total_s"]),
        "step_s": result.step_seconds,
        "losses": result.losses,
        "plan": {"stages": p.stages, "pipelines": p.pipelines},
        "predicted": {k: predicted[k] for k in ("pipeline_s", "dp_s", "microbatches")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="training steps, the first is warm-up (default: 6)")
    parser.add_argument("--json", action="store_true", help="print only a JSON object")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is a warm-up)")
    logging.basicConfig(level=logging.WARNING)
    out = run(args.steps)
    if args.json:
        print(json.dumps({"measured_step_s": out["measured_step_s"], "predicted_step_s": out["predicted_step_s"]}))
        return 0
    print(f"plan: stages {out['plan']['stages']}, pipelines {out['plan']['pipelines']}")
    print(f"{'measured step (median)':<28}{out['measured_step_s']:.3f} s")
    print(f"{'predicted (full model)':<28}{out['predicted_step_s']:.3f} s")
    print(f"{'measured / predicted':<28}{out['ratio']:.3f}")
    print(f"per-step seconds: {', '.join(f'{s:.3f}' for s in out['step_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
