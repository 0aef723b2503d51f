"""Hugging Face families in the swarm: throughput of each family's tiny model, and plans of 1B-class shapes.

``python -m bench.models [--json] [--steps N] [--families a,b] [--plan-seconds S]``

1. **Tiny models, 4 peers.** Each family's tiny preset (``tiny-llama``, ``tiny-mistral``, ``tiny-gpt2``,
   ``tiny-gemma2``, ``tiny-olmo2``, ``tiny-granite``, ``tiny-qwen3``: 4 layers) trained by 4 worker processes on
   loopback — 2 stages x 2 replicas, gRPC between them, no link shaping or compute emulation — against
   single-process training of transformers' own ``*ForCausalLM`` on the same batches, on this machine. Tokens per
   step = micro_batch x n_microbatches x seq_len; the first step is a warm-up and not counted. Both use torch's
   default thread count. Families that tie their embeddings (GPT-2, Gemma-2, Granite) train tied, as a run file
   has them: the first and the last stage of each pipeline exchange the tied weight's gradient every step
   (``tied`` in the output). On a small CPU box the comparison says how much the pipeline's transport and
   bookkeeping cost against the parallelism of four processes, nothing about GPUs; under load from other work
   the figures are noisy.
2. **1B-class plans.** The ``llama-3.2-1b`` and ``olmo-2-1b`` shapes (bf16, 2048-token sequences, 128
   micro-batches of 2: a 0.5 M token batch), their workload measured from the parameter shapes of the model
   transformers builds, planned by the scheduler on the bundled ``worldwide_geo_distributed`` scenario (64
   devices of 32 GB): predicted step time, stages x replicas, and the search's wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.emulation.local import train_plan
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler import plan
from tasklet.scheduler.cluster import load_scenario
from tasklet.scheduler.model_workload import model_preset

SEQ_LEN, MICRO_BATCH, N_MICROBATCHES = 64, 4, 8
STAGES, PIPELINES = [(0, 2), (2, 4)], [[0, 1], [2, 3]]
FAMILIES = ["llama", "mistral", "gpt2", "gemma2", "olmo2", "granite", "qwen3"]
PLANNED = ["llama-3.2-1b", "olmo-2-1b"]


def tiny_family(family: str, steps: int) -> dict[str, float | str | bool]:
    model = resolve_model(f"tiny-{family}", seq_len=SEQ_LEN, seed=0, tie=True)
    spec = RunSpec(run_id=f"bench-models-{family}", model=model,
                   optim=OptimConfig(lr=1e-3), seed=0, micro_batch=MICRO_BATCH, n_microbatches=N_MICROBATCHES)
    tokens = MICRO_BATCH * N_MICROBATCHES * SEQ_LEN
    result = train_plan(spec, STAGES, PIPELINES, steps, collect_states=False)
    swarm_step = statistics.median(result.step_seconds[1:])
    corpus = Corpus.load(None)
    train_reference(spec.model, spec.optim, corpus, 0, 1, N_MICROBATCHES, MICRO_BATCH)  # warm-up
    started = time.perf_counter()
    train_reference(spec.model, spec.optim, corpus, 0, steps - 1, N_MICROBATCHES, MICRO_BATCH)
    single_step = (time.perf_counter() - started) / (steps - 1)
    return {
        "architecture": spec.model.config["architectures"][0],
        "tied": spec.model.keep_tied,
        "params_m": sum(p.numel() for p in spec.model.build_stage(0, spec.model.n_layers).parameters()) / 1e6,
        "swarm_step_s": swarm_step,
        "swarm_tokens_per_s": tokens / swarm_step,
        "single_process_step_s": single_step,
        "single_process_tokens_per_s": tokens / single_step,
        "swarm_loss_first": result.losses[0],
        "swarm_loss_last": result.losses[-1],
    }


def shape_plan(name: str, time_limit_s: float) -> dict[str, object]:
    cluster = load_scenario("worldwide_geo_distributed")
    workload = model_preset(name, precision="bf16")
    started = time.perf_counter()
    p = plan(cluster, workload, cost_model="full", seed=0, time_limit_s=time_limit_s)
    search_s = time.perf_counter() - started
    return {
        "predicted_step_s": float(p.predicted["total_s"]),
        "stages": len(p.stages),
        "replicas": len(p.pipelines),
        "layers_per_stage": [b - a for a, b in p.stages],
        "search_s": search_s,
        "params_b": workload.total_params / 1e9,
        "devices": cluster.n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only a JSON object")
    parser.add_argument("--steps", type=int, default=6, help="training steps, the first one a warm-up (default: 6)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated families to train (default: {','.join(FAMILIES)})")
    parser.add_argument("--plan-seconds", type=float, default=20.0,
                        help="time limit of each plan's search (default: 20)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is a warm-up)")
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"--families: {unknown[0]!r} has no tiny preset (have: {', '.join(FAMILIES)})")
    logging.basicConfig(level=logging.WARNING)
    out = {"tiny_4_peers": {f: tiny_family(f, args.steps) for f in families},
           "plans_worldwide": {name: shape_plan(name, args.plan_seconds) for name in PLANNED}}
    if args.json:
        print(json.dumps(out))
        return 0
    print("tiny models, 2 stages x 2 replicas on loopback, against one process of transformers' model:")
    for family, t in out["tiny_4_peers"].items():
        print(f"  {family:8s} {t['architecture']:20s} {t['params_m']:.2f} M params{' tied' if t['tied'] else ''}: "
              f"swarm {t['swarm_step_s']:.3f} s/step {t['swarm_tokens_per_s']:.0f} tokens/s "
              f"(loss {t['swarm_loss_first']:.3f} -> {t['swarm_loss_last']:.3f}); single process "
              f"{t['single_process_step_s']:.3f} s/step {t['single_process_tokens_per_s']:.0f} tokens/s")
    for name, p in out["plans_worldwide"].items():
        print(f"{name} shape ({p['params_b']:.2f} B params, bf16) on worldwide_geo_distributed ({p['devices']} "
              f"devices): {p['stages']} stages x {p['replicas']} replicas, predicted {p['predicted_step_s']:.1f} "
              f"s/step, search {p['search_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
