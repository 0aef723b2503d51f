"""Hugging Face families in the swarm: throughput of a tiny Llama, and the plan of a Llama-3-8B-shaped model.

``python -m bench.models [--json] [--steps N] [--plan-seconds S]``

1. **Tiny Llama, 4 peers.** The ``tiny-llama`` preset (4 layers, hidden 128, 4 query / 2 key-value heads,
   SwiGLU) trained by 4 worker processes on loopback — 2 stages x 2 replicas, gRPC between them, no link
   shaping or compute emulation — against single-process training of transformers' ``LlamaForCausalLM`` on the
   same batches, on this machine. Tokens per step = micro_batch x n_microbatches x seq_len; the first step is a
   warm-up and not counted. Both use torch's default thread count. On a small CPU box the comparison says how
   much the pipeline's transport and bookkeeping cost against the parallelism of four processes, nothing
   about GPUs; under load from other work the figures are noisy.
2. **Llama-3-8B plan.** The ``llama-3-8b`` shape (bf16, 2048-token sequences, 256 micro-batches of 1: a 0.5 M
   token batch) planned by the scheduler on the bundled ``worldwide_geo_distributed`` scenario (64 devices of
   32 GB): predicted step time, stages x replicas, and the search's wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from peer.compute.data import Corpus
from peer.compute.hf import resolve_model
from peer.compute.reference import train_reference
from peer.compute.stage import OptimConfig
from peer.emulation.local import train_plan
from peer.runtime.spec import RunSpec
from scheduler import plan
from scheduler.cluster import load_scenario
from scheduler.model_workload import model_preset

SEQ_LEN, MICRO_BATCH, N_MICROBATCHES = 64, 4, 8
STAGES, PIPELINES = [(0, 2), (2, 4)], [[0, 1], [2, 3]]


def tiny_llama(steps: int) -> dict[str, float]:
    spec = RunSpec(run_id="bench-models", model=resolve_model("tiny-llama", seq_len=SEQ_LEN, seed=0),
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
        "swarm_step_s": swarm_step,
        "swarm_tokens_per_s": tokens / swarm_step,
        "single_process_step_s": single_step,
        "single_process_tokens_per_s": tokens / single_step,
        "swarm_loss_first": result.losses[0],
        "swarm_loss_last": result.losses[-1],
    }


def llama_8b_plan(time_limit_s: float) -> dict[str, object]:
    cluster = load_scenario("worldwide_geo_distributed")
    workload = model_preset("llama-3-8b", precision="bf16")
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
    parser.add_argument("--plan-seconds", type=float, default=20.0,
                        help="time limit of the 8B plan's search (default: 20)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is a warm-up)")
    logging.basicConfig(level=logging.WARNING)
    out = {"tiny_llama_4_peers": tiny_llama(args.steps), "llama_3_8b_plan": llama_8b_plan(args.plan_seconds)}
    if args.json:
        print(json.dumps(out))
        return 0
    t, p = out["tiny_llama_4_peers"], out["llama_3_8b_plan"]
    print(f"tiny Llama, 2 stages x 2 replicas on loopback: {t['swarm_step_s']:.3f} s/step, "
          f"{t['swarm_tokens_per_s']:.0f} tokens/s (loss {t['swarm_loss_first']:.3f} -> {t['swarm_loss_last']:.3f})")
    print(f"single process (transformers' LlamaForCausalLM): {t['single_process_step_s']:.3f} s/step, "
          f"{t['single_process_tokens_per_s']:.0f} tokens/s")
    print(f"Llama-3-8B shape ({p['params_b']:.2f} B params, bf16) on worldwide_geo_distributed ({p['devices']} "
          f"devices): {p['stages']} stages x {p['replicas']} replicas, predicted {p['predicted_step_s']:.1f} s/step, "
          f"search {p['search_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
