"""Plain single-process training of the full model: the yardstick of the equivalence invariant.

Deliberately the textbook loop — one ``nn.Module``, ``loss.backward()`` accumulating into ``.grad``,
``torch.optim.AdamW`` — sharing with the stage runtime only what defines the *problem* (model, data order,
loss, which parameters are decayed, the clip formula), never the machinery (flat buffers, the exactly-once
sum, master copies). A bug in that machinery then shows up as a difference.

Each step uses micro-batches ``0..n_microbatches-1`` of :func:`peer.compute.data.microbatch`, and its loss is the mean
of their losses, so the gradient is ``(1/n) sum_m dL_m/dθ`` — what the pipeline computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from tasklet.peer.compute.data import Corpus, microbatch
from tasklet.peer.compute.family import ModelSpec, family_of
from tasklet.peer.compute.model import is_weight_decayed, lm_loss
from tasklet.peer.compute.stage import OptimConfig, clip_coefficient, shard_bounds
from tasklet.protocol import SPARSE_COMPRESSIONS as ERROR_FEEDBACK_COMPRESSIONS
from tasklet.protocol.codec import DEFAULT_BLOCK_SIZE, decode_tensor, encode_tensor

log = logging.getLogger(__name__)


def train_reference(
    model_cfg: ModelSpec,
    optim_cfg: OptimConfig,
    corpus: Corpus,
    seed: int,
    steps: int,
    n_microbatches: int,
    micro_batch: int,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train the full model for ``steps`` steps on the CPU in fp32; return ``(state_dict, per_step_losses)``.

    The state dict's names are the full model's (``blocks.3.fc.weight``), i.e. the same names a stage uses.
    The model is what the spec's family gives (``ModelFamily.full_model``): the one stage holding every layer, or
    for a Hugging Face model transformers' own ``AutoModelForCausalLM`` started from the same weights, so the
    comparison also checks the stage split against the library.
    """
    model_cfg.validate()
    optim_cfg.validate()
    if steps < 0 or n_microbatches < 1 or micro_batch < 1:
        raise ValueError(f"need steps >= 0, n_microbatches >= 1, micro_batch >= 1; got {steps}, "
                         f"{n_microbatches}, {micro_batch}")
    model, forward = family_of(model_cfg).full_model(model_cfg)
    named = list(model.named_parameters())
    optimizer = reference_adamw(model, optim_cfg)
    losses: list[float] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for mb in range(n_microbatches):
            inputs, targets = microbatch(corpus, seed, step, mb, micro_batch, model_cfg.seq_len)
            loss = lm_loss(forward(inputs), targets)
            (loss / n_microbatches).backward()
            step_loss += float(loss.detach())
        if optim_cfg.grad_clip is not None:
            norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for _, p in named if p.grad is not None))
            coef = clip_coefficient(norm, optim_cfg.grad_clip)
            if coef < 1.0:
                for _, p in named:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        optimizer.step()
        losses.append(step_loss / n_microbatches)
        log.debug("reference step %d loss %.6f", step, losses[-1])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def groupings_of(record: Sequence[dict[str, Any]], steps: int, n_microbatches: int) -> list[list[list[int]]] | None:
    """Each step's micro-batches per pipeline (pipelines ascending, micro-batches ascending) from a run's replayable
    record (``peer.runtime.outer.assignment_record``), or None when the record does not hold exactly steps
    ``0..steps-1`` each committing every micro-batch once (a record begun by a later leader, say)."""
    if len(record) != steps or [int(e["step"]) for e in record] != list(range(steps)):
        return None
    groupings = []
    for entry in record:
        commits = {int(mb): int(p) for mb, p in entry["commits"].items()}
        if sorted(commits) != list(range(n_microbatches)):
            return None
        groupings.append([sorted(mb for mb, q in commits.items() if q == p) for p in sorted(set(commits.values()))])
    return groupings


def train_grouped_reference(
    model_cfg: ModelSpec,
    optim_cfg: OptimConfig,
    corpus: Corpus,
    seed: int,
    groupings: Sequence[Sequence[Sequence[int]]],
    micro_batch: int,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """:func:`train_reference` with each step's micro-batches summed as the run grouped them: ``groupings[step]``
    lists each pipeline's micro-batches; a pipeline's unscaled gradients are summed in that order, the pipelines'
    sums in list order, and the total divided by the step's micro-batch count (the runtime's arithmetic,
    ``peer.compute.stage``). Why: float addition is not associative, and AdamW carries a last-bit difference from
    step to step, so two groupings of one batch can end 1e-5 of a tensor's scale apart after 20 steps; replaying
    the grouping leaves only what the machinery itself adds."""
    model_cfg.validate()
    optim_cfg.validate()
    model, forward = family_of(model_cfg).full_model(model_cfg)
    named = list(model.named_parameters())
    optimizer = reference_adamw(model, optim_cfg)
    losses: list[float] = []
    for step, pipelines in enumerate(groupings):
        n = sum(len(mbs) for mbs in pipelines)
        if n < 1:
            raise ValueError(f"step {step} of the grouping commits no micro-batch")
        total: list[torch.Tensor] | None = None
        step_loss = 0.0
        for mbs in pipelines:
            optimizer.zero_grad(set_to_none=True)
            for mb in mbs:
                inputs, targets = microbatch(corpus, seed, step, mb, micro_batch, model_cfg.seq_len)
                loss = lm_loss(forward(inputs), targets)
                loss.backward()
                step_loss += float(loss.detach())
            part = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
            if total is None:
                total = [g.clone() for g in part]
            else:
                for t, g in zip(total, part, strict=True):
                    t.add_(g)
        assert total is not None
        for (_, p), t in zip(named, total, strict=True):
            p.grad = t.div_(n)
        if optim_cfg.grad_clip is not None:
            norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for _, p in named))
            coef = clip_coefficient(norm, optim_cfg.grad_clip)
            if coef < 1.0:
                for _, p in named:
                    p.grad.mul_(coef)
        optimizer.step()
        losses.append(step_loss / n)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def train_diloco_reference(
    spec: Any,
    record: Sequence[dict[str, Any]],
    stages: Sequence[tuple[int, int]],
    corpus: Corpus | None = None,
) -> tuple[dict[int, dict[str, torch.Tensor]], list[float]]:
    """Replay a DiLoCo run in one process; return ``({pipeline: state_dict}, per_step_losses)``.

    ``spec``: a RunSpec (model, optim, seed, micro_batch, corpus, outer_lr, outer_momentum,
    pseudo_grad_compression are read). ``record``: one entry per inner step, as
    ``peer.runtime.outer.assignment_record`` writes it — ``commits`` (micro-batch -> pipeline), ``applied``
    (pipelines that took the step) and ``outer`` (participants of the outer round the step ended, or None).
    ``stages``: the layer split, which matters for compression (each stage's pseudo-gradient is cut into one
    shard per participant, as the reduce-scatter does).

    Each pipeline is a whole model with its own ``torch.optim.AdamW``; an inner step is its mean loss over the
    micro-batches it committed (no step if none). An outer round: per stage and participant, the pseudo-gradient
    ``anchor - params``, shard by shard through the wire's encode/decode (top-k after adding the pipeline's
    error-feedback residual), summed in participant order, the sum through the wire again, divided by the
    participants; then ``torch.optim.SGD(nesterov=True)`` from the anchor, copied into every participant.
    With overlap (an entry's ``outer_of``: the round of that earlier step lands after this entry's inner step)
    the pseudo-gradients are the participants' parameters at their round's end, and each participant goes on
    from the new anchor plus its own progress since (``anchor + (params - round_end)``).
    """
    model_cfg, optim_cfg, codec = spec.model, spec.optim, spec.pseudo_grad_compression
    corpus = corpus if corpus is not None else Corpus.load(spec.corpus)
    pipelines = sorted({p for e in record for p in (*e["applied"], *(e["outer"] or ()))}
                       | {int(p) for e in record for p in e["commits"].values()})
    models = {r: model_cfg.build_stage(0, model_cfg.n_layers) for r in pipelines}
    inner = {r: reference_adamw(m, optim_cfg) for r, m in models.items()}
    first = models[pipelines[0]] if pipelines else model_cfg.build_stage(0, model_cfg.n_layers)
    anchor = {n: torch.nn.Parameter(p.detach().clone()) for n, p in first.named_parameters()}
    mu = spec.outer_momentum
    outer = torch.optim.SGD(list(anchor.values()), lr=spec.outer_lr, momentum=mu, nesterov=mu > 0)
    names = {s: [n for n, _ in model_cfg.stage_shapes(a, b)] for s, (a, b) in enumerate(stages)}
    residual: dict[tuple[int, int], torch.Tensor] = {}
    round_end: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # a round's last step -> each pipeline then
    losses: list[float] = []
    for entry in record:
        step = int(entry["step"])
        commits = {int(mb): int(p) for mb, p in entry["commits"].items()}
        mb_loss: dict[int, float] = {}
        for r in entry["applied"]:
            mine = sorted(mb for mb, p in commits.items() if p == r)
            inner[r].zero_grad(set_to_none=True)
            for mb in mine:
                inputs, targets = microbatch(corpus, spec.seed, step, mb, spec.micro_batch, model_cfg.seq_len)
                loss = lm_loss(models[r](inputs), targets)
                (loss / len(mine)).backward()
                mb_loss[mb] = float(loss.detach())
            if mine:
                inner[r].step()
        losses.append(sum(mb_loss[mb] for mb in sorted(commits)) / len(commits))
        if (step + 1) % spec.sync_period == 0:  # a round's end: what it sends, whenever its round lands
            round_end[step] = {r: {n: p.detach().clone() for n, p in m.named_parameters()} for r, m in models.items()}
        if not entry["outer"]:
            continue
        of = entry.get("outer_of")
        of = step if of is None else int(of)  # overlap: the round of an earlier step lands after this one
        ends = round_end.pop(of)
        parts = sorted(int(p) for p in entry["outer"])
        for s in names:
            flat_anchor = torch.cat([anchor[n].detach().reshape(-1) for n in names[s]])
            bounds = shard_bounds(flat_anchor.numel(), len(parts))
            sums = [torch.empty(0)] * len(parts)
            for r in parts:
                pseudo = flat_anchor - torch.cat([ends[r][n].reshape(-1) for n in names[s]])
                if codec in ERROR_FEEDBACK_COMPRESSIONS:
                    pseudo = pseudo + residual.get((r, s), torch.zeros_like(pseudo))
                sent = torch.cat([_wire(pseudo[lo:hi], codec) for lo, hi in bounds])
                if codec in ERROR_FEEDBACK_COMPRESSIONS:
                    residual[(r, s)] = pseudo - sent
                for j, (lo, hi) in enumerate(bounds):
                    sums[j] = sent[lo:hi].clone() if r == parts[0] else sums[j].add_(sent[lo:hi])
            average = torch.cat([_wire(x, *_gather_codec(codec, x.numel(), len(parts))) for x in sums])
            average = average / len(parts)
            offset = 0
            for n in names[s]:
                numel = anchor[n].numel()
                anchor[n].grad = average[offset:offset + numel].view(anchor[n].shape).clone()
                offset += numel
        outer.step()
        for r in parts:
            with torch.no_grad():
                for n, p in models[r].named_parameters():
                    if of == step or torch.equal(p, ends[r][n]):
                        p.copy_(anchor[n])
                    else:  # landed late: the new anchor plus this pipeline's progress since the round's end
                        p.copy_(anchor[n] + (p - ends[r][n]))
    return {r: {n: p.detach().clone() for n, p in m.named_parameters()} for r, m in models.items()}, losses


def reference_adamw(model: torch.nn.Module, optim_cfg: OptimConfig) -> torch.optim.AdamW:
    """The reference's optimizer of ``model``: ``torch.optim.AdamW``, weight decay on what the stages decay."""
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if is_weight_decayed(n, p)], "weight_decay": optim_cfg.weight_decay},
        {"params": [p for n, p in named if not is_weight_decayed(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim_cfg.lr, betas=optim_cfg.betas,
                             eps=optim_cfg.eps)


def _wire(x: torch.Tensor, codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """What a receiver decodes of ``x`` sent under ``codec`` (the protocol's own encoder and decoder)."""
    if codec == "none":
        return x.clone()
    return decode_tensor(encode_tensor("x", x, codec, block_size=block_size), expect_dtype=torch.float32)


def _gather_codec(codec: str, numel: int, n_participants: int) -> tuple[str, int]:
    """The all-gather's codec of a summed shard: int8 stays int8; a sum of sparse contributions (at most
    n_participants x ceil(numel / block) non-zeros) goes as top-k with a block small enough to keep them all, or
    uncompressed when that block would be below 2."""
    if codec not in ERROR_FEEDBACK_COMPRESSIONS:
        return codec, DEFAULT_BLOCK_SIZE
    block = numel // max(1, n_participants * math.ceil(numel / DEFAULT_BLOCK_SIZE)) if numel else 0
    return ("topk", block) if block >= 2 else ("none", DEFAULT_BLOCK_SIZE)
