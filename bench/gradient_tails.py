"""Honest gradient spikes against the exchange's norm check: how large an honest replica's part gets.

``python -m bench.gradient_tails [--json] [--presets a,b] [--steps N] [--micro-batch B] [--microbatches M]``

Each tiny Hugging Face preset (as ``tests/swarms/test_hf_equivalence.py`` trains it: 32-token sequences, AdamW at
lr 3e-3, eps 1e-3) is trained in one process along single-process training's path, keeping every micro-batch's
gradient apart. At every step, for each stage of a 2-stage split and every way of sharing the step's micro-batches
between 2 replicas (each with at least one, as the task pool may share them), each owner's view of its shard is
built as the exchange builds it and handed to the norm check's own ``NormCheck.ratios``: a sender's norm per
micro-batch over the larger of the others' median and the owner's whole gradient per micro-batch. ``worst`` is
the largest ratio met, ``at`` the step, stage and shares where, and ``over`` the share of (step, sharing, owner)
views in which an honest sender's ratio was above each k: a k below ``worst`` refuses honest work, which sidelines
an honest member. ``direction_refused``: the share of the same views in which the direction test (the run's
default z; only contributions of at least ``checks.MIN_DIRECTION_TOKENS`` tokens are tested, so none at 64-token
micro-batches of fewer than 4) refused an honest sender. A tied head's gradient is counted at the embedding's stage.
CPU, one torch thread.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

import torch

from tasklet.peer.compute.data import Corpus, microbatch
from tasklet.peer.compute.family import family_of
from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.compute.model import lm_loss
from tasklet.peer.compute.reference import reference_adamw
from tasklet.peer.compute.stage import OptimConfig, shard_bounds
from tasklet.peer.runtime.choices import GRAD_OUTLIER_FACTOR
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.runtime.stage.gradient_checks import (
    AttemptView,
    CheckSettings,
    DirectionCheck,
    NormCheck,
    OutlierContributionError,
)

PRESETS = ("tiny-llama", "tiny-mistral", "tiny-gpt2", "tiny-gemma2", "tiny-olmo2", "tiny-granite")
TIED = {"tiny-gemma2", "tiny-granite"}
STAGES = ((0, 2), (2, 4))
KS = (10.0, 100.0, GRAD_OUTLIER_FACTOR)  # 10: the check's earlier default


def spec_for(preset: str, micro_batch: int, microbatches: int) -> RunSpec:
    return RunSpec(run_id=f"tails-{preset}", model=resolve_model(preset, seq_len=32, seed=5, tie=preset in TIED),
                   optim=OptimConfig(lr=3e-3, eps=1e-3), seed=11, micro_batch=micro_batch,
                   n_microbatches=microbatches)


def views(per: list[torch.Tensor], step: int, settings: CheckSettings
          ) -> list[tuple[AttemptView, tuple[tuple[int, ...], ...]]]:
    """Every owner's view of its shard, for every sharing of the micro-batches between two replicas."""
    n = len(per)
    bounds = shard_bounds(per[0].numel(), 2)
    out = []
    for split in itertools.product((0, 1), repeat=n):
        mine = tuple(tuple(m for m in range(n) if split[m] == r) for r in (0, 1))
        if not all(mine):
            continue
        sums = [torch.stack([per[m] for m in mine[r]]).sum(0) for r in (0, 1)]
        for owner, (lo, hi) in enumerate(bounds):
            contributions = {r: (sums[r][lo:hi], list(mine[r])) for r in (0, 1)}
            view = AttemptView((step, 1), owner, (0, 1), contributions, float(sums[owner].norm()) / len(mine[owner]),
                               n, {}, {}, settings)
            out.append((view, mine))
    return out


def measure(preset: str, steps: int, micro_batch: int, microbatches: int) -> dict[str, Any]:
    spec = spec_for(preset, micro_batch, microbatches)
    model_spec = spec.model
    corpus = Corpus.load(spec.corpus)
    model, forward = family_of(model_spec).full_model(model_spec)
    named = list(model.named_parameters())
    params = dict(named)
    stage_names = [[n for n, _ in model_spec.build_stage(a, b).named_parameters() if n in params] for a, b in STAGES]
    optimizer = reference_adamw(model, spec.optim)
    worst, at, seen, unrelated = 0.0, {}, 0, 0
    over = dict.fromkeys(KS, 0)
    settings = CheckSettings(direction_z=spec.grad_direction_z, tokens_per_microbatch=micro_batch * model_spec.seq_len)
    direction = DirectionCheck()
    for step in range(steps):
        per_stage: list[list[torch.Tensor]] = [[] for _ in STAGES]
        total = {n: torch.zeros_like(p) for n, p in named}
        for mb in range(microbatches):
            inputs, targets = microbatch(corpus, spec.seed, step, mb, micro_batch, model_spec.seq_len)
            model.zero_grad(set_to_none=True)
            lm_loss(forward(inputs), targets).backward()
            for s, names in enumerate(stage_names):
                per_stage[s].append(torch.cat([params[n].grad.reshape(-1) if params[n].grad is not None
                                               else torch.zeros(params[n].numel()) for n in names]))
            for n, p in named:
                if p.grad is not None:
                    total[n] += p.grad
        for n, p in named:
            p.grad = total[n] / microbatches  # the step single-process training takes
        optimizer.step()
        for s, per in enumerate(per_stage):
            for view, mine in views(per, step, settings):
                ratio = max(NormCheck.ratios(view).values())
                seen += 1
                try:
                    direction.inspect(view)
                except OutlierContributionError:
                    unrelated += 1
                for k in KS:
                    over[k] += ratio > k
                if ratio > worst:
                    worst, at = ratio, {"step": step, "stage": s, "owner": view.replica, "shares": mine}
    return {"preset": preset, "steps": steps, "tokens_per_microbatch": micro_batch * model_spec.seq_len,
            "worst": round(worst, 2), "at": at, "views": seen,
            "over": {f"{k:g}": round(over[k] / max(1, seen), 5) for k in KS},
            "direction_refused": round(unrelated / max(1, seen), 5)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gradient_tails", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated tiny presets")
    parser.add_argument("--steps", type=int, default=40, help="training steps per preset (default 40)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4, at most 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per preset")
    args = parser.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    if unknown := sorted(set(presets) - set(PRESETS)):
        parser.error(f"unknown presets {unknown}; choose from {', '.join(PRESETS)}")
    if not (1 <= args.steps <= 10_000 and 1 <= args.micro_batch <= 64 and 2 <= args.microbatches <= 8):
        parser.error("need 1 <= --steps <= 10000, 1 <= --micro-batch <= 64, 2 <= --microbatches <= 8")
    torch.set_num_threads(1)
    for preset in presets:
        row = measure(preset, args.steps, args.micro_batch, args.microbatches)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            over = ", ".join(f"k={k}: {v:.2%}" for k, v in row["over"].items())
            print(f"{preset:13s} {row['tokens_per_microbatch']} tokens/micro-batch, {row['steps']} steps: worst "
                  f"honest ratio {row['worst']:g} (step {row['at'].get('step')}, stage {row['at'].get('stage')}, "
                  f"shares {row['at'].get('shares')}); views over k: {over}; refused by the direction test: "
                  f"{row['direction_refused']:.2%}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
