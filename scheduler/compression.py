"""Compression options the scheduler chooses together with the placement, and what each costs.

Two kinds of option (names match the runtime's: ``protocol.lowbit``, ``RunSpec``):

* **activation compression per stage boundary** (activations forward, activation gradients backward):
  ``none`` (the training dtype, ``Workload.act_bytes``), ``fp16`` (2 B/element), ``int8`` (1 B + a float32
  scale per block of 64), ``int4`` (0.5 B + scale), ``int2`` (0.25 B + scale). Encoding and decoding cost
  ``CODEC_FLOPS_PER_ELEMENT`` on each side, charged as compute to the two stages of the boundary.
* **data-parallel sync**: ``exact`` (every step, fp32 gradients: today's runtime) or a DiLoCo outer loop with
  period ``H`` whose pseudo-gradients travel as ``none`` (fp32), ``int8``, ``topk`` (1/64 of the entries as
  index + value, error feedback) or ``topk2`` / ``topk4`` (each block of 64's largest entry in 2 / 4 bits,
  error feedback). The sync term of the ``full`` model (reduce-scatter + all-gather) is then paid once per
  ``H`` steps, with the compressed bytes: per step it costs ``sync(bytes) / H``. A sparse codec's all-gather
  carries the members' summed shard exactly (up to D entries per 64 at 8 bytes each, at most fp32):
  :func:`sync_bytes_factor`. A DiLoCo option may be ``-late`` (``SyncOption.overlap``, the runtime's
  ``outer_overlap``): the round lands one inner step late, so its bytes and its codec travel while that step
  computes, and a round costs only what exceeds one inner step's pipeline time (``max(0, round - pipe) / H``).
  That hides the round from links and peers that are both shared with the inner step's activations only in the
  model's ideal: the model does not charge the contention.

Quality: compressing costs loss. ``PenaltyTable`` holds measured relative loss penalties (final loss after N
steps vs exact training, ``bench.bandwidth`` writes ``data/loss_penalties.json``): each activation option alone
(every boundary, exact sync), each sync option alone, and ``joint`` entries for activation + DiLoCo measured
*together* (penalties of different kinds do not add: int4 + DiLoCo H=32 measured 11 % where the sum said 5.5 % on one
seed, and 9.1 % against 4.5 + 3.7 % over 3 seeds).
A choice's penalty is looked up, never summed: its activation part is the most aggressive codec on any boundary
(a boundary compressed less is assumed to cost no more: the uniform choice bounds the mix), and a combination of
compressed activations with DiLoCo needs its ``joint`` entry. Anything unmeasured is never chosen. The search
keeps the penalty under ``CompressionSpace.max_loss_penalty``.

Per layout the cheapest feasible choice is exact and cheap: the pipeline phase depends only on the activation
option, and the sync phase and the control rounds only on the sync option (``total = pipeline_s + dp_s +
control``), so each uniform activation option costs one pipeline prediction and each pseudo-gradient encoding
one sync computation. The search's objective counts an option's control rounds beyond exact training's only
(the exact ones are a constant of the split, left out so that the lower bound stays tight); a prediction
(:func:`predict`) counts them all. The search uses
that; on the final layout :func:`refine` then sets each boundary on its own (a fast hop need not compress).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import cost_full
from .cluster import Cluster
from .errors import PlanningError
from .plan import Plan
from .schedule import EXACT_ROUNDS, Timing, control_time, stage_flops, sync_times, timing
from .workload import Workload

ACTIVATION_OPTIONS = ("none", "fp16", "int8", "int4", "int2")
PSEUDO_GRAD_OPTIONS = ("none", "int8", "topk", "topk2", "topk4")
SPARSE_OPTIONS = ("topk", "topk2", "topk4")
GROUP_BLOCKS = 64  # blocks sharing one scale in topk2 / topk4 (protocol.sparse)
BLOCK_SIZE = 64
CODEC_FLOPS_PER_ELEMENT = 8.0  # absmax, scale, noise, round, pack (and the inverse): a few ops per element
# An outer round's pseudo-gradient codec runs on the worker's CPU, not the emulated device. Each member encodes
# its pseudo-gradient and the summed shard and decodes what it receives: about 2 round trips of its stage's
# parameters per round, one at the contribution's codec and one at the summed shard's (int8 for int8; an exact
# top-k of a sparse sum for the sparse codecs). Encode + decode per element on one thread at the size where it
# matters (16 M elements, out of cache; `python -m bench.codec`): int8 6.7 ns, top-k 27.6 ns, topk2 / topk4
# 6.2-6.3 ns, the sparse sum 6.9 ns; the charge is the mean of a round's two passes, rounded up.
CODEC_S_PER_ELEMENT = {"int8": 7e-9, "topk": 18e-9, "topk2": 7e-9, "topk4": 7e-9}
OUTER_CODEC_PASSES = 2.0
DILOCO_ROUND_END_ROUNDS = 2  # the outer round's reduce and its apply, once per H steps
DILOCO_INNER_ROUNDS = 2  # start_step and the inner step's merged reduce-and-apply, every step
PENALTY_PATH = Path(__file__).with_name("data") / "loss_penalties.json"


def bytes_per_element(option: str, dtype_bytes: float) -> float:
    """Wire bytes per element (scales included); ``none`` sends the tensor's own dtype."""
    if option == "none":
        return float(dtype_bytes)
    if option == "fp16":
        return 2.0
    if option == "int8":
        return 1.0 + 4.0 / BLOCK_SIZE
    if option == "int4":
        return 0.5 + 4.0 / BLOCK_SIZE
    if option == "int2":
        return 0.25 + 4.0 / BLOCK_SIZE
    if option == "topk":
        return 8.0 / BLOCK_SIZE
    if option in ("topk2", "topk4"):  # a byte offset and a 2 / 4-bit code per block, a float32 scale per group
        return (1.0 + (2 if option == "topk2" else 4) / 8) / BLOCK_SIZE + 4.0 / (BLOCK_SIZE * GROUP_BLOCKS)
    raise PlanningError("compression", f"unknown option {option!r}")


def sync_bytes_factor(option: str, members: int, param_bytes: float) -> float:
    """Bytes of an outer round's two phases against exact training's, as the one factor both phases scale by:
    the reduce-scatter sends contributions under ``option``; the all-gather sends the summed shard, which for a
    sparse codec holds up to ``members`` entries per block and goes as an exact top-k (8 bytes an entry, at
    most fp32: ``peer.runtime.outer.allgather_codec``)."""
    scatter = bytes_per_element(option, param_bytes)
    gather = min(members * 8.0 / BLOCK_SIZE, 4.0) if option in SPARSE_OPTIONS else scatter
    return (scatter + gather) / 2 / param_bytes


@dataclass(frozen=True)
class SyncOption:
    """Every step exact (``period`` 1, ``none``), or DiLoCo with period H and a pseudo-gradient encoding;
    ``overlap``: the outer round lands one inner step late, travelling while that step computes (the runtime's
    ``outer_overlap``)."""

    period: int = 1
    pseudo_grad_compression: str = "none"
    overlap: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.period, int) or self.period < 1:
            raise PlanningError("sync_period", f"must be a positive integer, got {self.period!r}")
        if self.pseudo_grad_compression not in PSEUDO_GRAD_OPTIONS:
            have, got = ", ".join(PSEUDO_GRAD_OPTIONS), self.pseudo_grad_compression
            raise PlanningError("pseudo_grad_compression", f"must be one of {have}, got {got!r}")
        if self.period == 1 and self.pseudo_grad_compression != "none":
            raise PlanningError("pseudo_grad_compression", "exact sync (period 1) sends fp32 gradients")
        if self.period == 1 and self.overlap:
            raise PlanningError("overlap", "exact sync (period 1) has no outer round to overlap")

    @property
    def name(self) -> str:
        if self.period == 1:
            return "exact"
        return f"diloco-H{self.period}-{self.pseudo_grad_compression}" + ("-late" if self.overlap else "")

    @classmethod
    def parse(cls, name: str) -> SyncOption:
        if name == "exact":
            return cls()
        parts = name.split("-")
        late = len(parts) == 4 and parts[3] == "late"
        if len(parts) != 3 + late or parts[0] != "diloco" or not parts[1].startswith("H") \
                or not parts[1][1:].isdigit():
            raise PlanningError("sync", f"expected 'exact' or 'diloco-H<period>-<encoding>[-late]', got {name!r}")
        return cls(int(parts[1][1:]), parts[2], late)


EXACT = SyncOption()
# fp32 pseudo-gradients and H = 128 are left out: bench.bandwidth does not measure them, so they could never be
# chosen (``CompressionSpace.default`` narrows this further to what the shipped table measured)
DEFAULT_SYNC = (EXACT, *(SyncOption(h, c) for h in (2, 8, 16, 32) for c in ("int8", "topk")))


@dataclass(frozen=True)
class Choice:
    """What the scheduler chose besides the placement: one activation option per boundary, and the sync."""

    activation: tuple[str, ...]
    sync: SyncOption = EXACT

    @classmethod
    def exact(cls, n_stages: int) -> Choice:
        return cls(("none",) * max(0, n_stages - 1), EXACT)

    @property
    def is_exact(self) -> bool:
        return self.sync == EXACT and all(a == "none" for a in self.activation)

    def to_dict(self, penalties: PenaltyTable | None = None) -> dict[str, Any]:
        """Field names as in ``RunSpec``: ``compression`` when every boundary agrees, ``sync_period`` etc."""
        uniform = len(set(self.activation)) <= 1
        out: dict[str, Any] = {
            "activation": list(self.activation),
            "compression": (self.activation[0] if self.activation else "none") if uniform else "per-boundary",
            "sync": self.sync.name,
            "sync_period": self.sync.period,
            "pseudo_grad_compression": self.sync.pseudo_grad_compression,
            "outer_overlap": self.sync.overlap,
        }
        if penalties is not None and self.sync.period > 1:
            out.update(penalties.outer_for(self.sync))
        return out

    @property
    def strongest_activation(self) -> str:
        """The most aggressive codec on any boundary (``none`` when there is no boundary)."""
        return max(self.activation, key=ACTIVATION_OPTIONS.index, default="none")

    @property
    def penalty_key(self) -> str:
        """The measured entry that bounds this choice's penalty: ``<activation>+<sync>`` (``joint``)."""
        return f"{self.strongest_activation}+{self.sync.name}"


@dataclass
class PenaltyTable:
    """Measured relative loss penalties (0 = no loss): ``activation[option]`` (exact sync), ``sync[name]`` (no
    activation compression) and ``joint["<activation>+<sync name>"]`` (both, measured together).

    ``outer``: the DiLoCo outer optimizer the sync penalties were measured with, per sync name
    (``{"diloco-H32-int8": {"outer_lr": .., "outer_momentum": ..}}``), or one setting for every period
    (``{"outer_lr": .., "outer_momentum": ..}``, the older form).
    """

    activation: dict[str, float]
    sync: dict[str, float]
    outer: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    joint: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.activation = {"none": 0.0, **self.activation}
        self.sync = {"exact": 0.0, **self.sync}
        for kind, table in (("activation", self.activation), ("sync", self.sync), ("joint", self.joint)):
            for k, v in table.items():
                if not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise PlanningError(f"penalties.{kind}.{k}", f"must be a finite number, got {v!r}")

    def penalty(self, choice: Choice) -> float:
        """The measured penalty bounding ``choice`` (see the module doc); inf when it was not measured."""
        act, sync = choice.strongest_activation, choice.sync
        if sync == EXACT:
            return float(self.activation.get(act, math.inf))
        if act == "none":
            return float(self.sync.get(sync.name, math.inf))
        return float(self.joint.get(choice.penalty_key, math.inf))

    def measured_syncs(self) -> tuple[SyncOption, ...]:
        """The DiLoCo options with a measured penalty, alone or jointly with an activation codec."""
        names = {k for k in self.sync if k != "exact"} | {k.split("+", 1)[1] for k in self.joint if "+" in k}
        return tuple(sorted((SyncOption.parse(n) for n in names), key=lambda s: (s.period, s.pseudo_grad_compression)))

    def outer_for(self, sync: SyncOption) -> dict[str, float]:
        """The outer optimizer setting that ``sync``'s penalty was measured with (empty when unknown)."""
        if "outer_lr" in self.outer:
            return {k: self.outer[k] for k in ("outer_lr", "outer_momentum") if k in self.outer}
        got = self.outer.get(sync.name)
        return dict(got) if isinstance(got, dict) else {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PenaltyTable:
        if not isinstance(d, dict) or not isinstance(d.get("activation"), dict) or not isinstance(d.get("sync"), dict):
            raise PlanningError("penalties", "needs objects 'activation' and 'sync'")
        if not isinstance(d.get("joint", {}), dict) or not isinstance(d.get("outer", {}), dict):
            raise PlanningError("penalties", "'joint' and 'outer' must be objects")
        return cls(activation=dict(d["activation"]), sync=dict(d["sync"]), outer=dict(d.get("outer", {})),
                   meta=dict(d.get("meta", {})), joint=dict(d.get("joint", {})))

    @classmethod
    def load(cls, path: str | Path | None = None) -> PenaltyTable:
        p = Path(path) if path is not None else PENALTY_PATH
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError as exc:
            raise PlanningError("penalties", f"no such file: {p}") from exc
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanningError("penalties", f"cannot read {p}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {"activation": self.activation, "sync": self.sync, "joint": self.joint, "outer": self.outer,
                "meta": self.meta}


@dataclass
class CompressionSpace:
    """The options the search may choose from and the loss-quality limit (relative penalty, 0.02 = 2 %).

    ``min_gain``: a choice with more loss penalty is taken only when it makes the step at least this much
    (relative) faster: on fast links the exact plan wins instead of a compression that saves microseconds.
    """

    penalties: PenaltyTable
    max_loss_penalty: float = 0.02
    activation: tuple[str, ...] = ACTIVATION_OPTIONS
    sync: tuple[SyncOption, ...] = DEFAULT_SYNC
    min_gain: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.max_loss_penalty, (int, float)) and self.max_loss_penalty >= 0):
            raise PlanningError("max_loss_penalty", f"must be a non-negative number, got {self.max_loss_penalty!r}")
        if not (isinstance(self.min_gain, (int, float)) and 0 <= self.min_gain < 1):
            raise PlanningError("min_gain", f"must be in [0, 1), got {self.min_gain!r}")
        for a in self.activation:
            if a not in ACTIVATION_OPTIONS:
                raise PlanningError("activation", f"unknown option {a!r} (have {', '.join(ACTIVATION_OPTIONS)})")

    @classmethod
    def default(cls, max_loss_penalty: float = 0.02) -> CompressionSpace:
        """The shipped table, and the sync options it measured (an unmeasured one could never be chosen)."""
        table = PenaltyTable.load()
        return cls(table, max_loss_penalty, sync=(EXACT, *table.measured_syncs()))


# ------------------------------------------------------------------------------------------------ costs
def timing_for(cluster: Cluster, workload: Workload, plan: Plan, choice: Choice,
               flops: np.ndarray | None = None) -> Timing:
    """The ``full`` model's timing facts with ``choice`` applied (hop bytes, codec compute, amortised sync)."""
    t = _with_activation(cluster, workload, timing(cluster, workload, plan, flops), choice.activation)
    control = control_s(workload, plan.stages, t.m.size, choice.sync)
    if choice.sync != EXACT:
        factor = sync_bytes_factor(choice.sync.pseudo_grad_compression, plan.n_replicas, workload.param_bytes)
        rounds = sync_times(cluster, workload, plan.stages, t.m, factor, digests=False)
        if choice.sync.overlap:  # the round (its bytes and its codec) travels while one inner step computes
            pipe = cost_full.predict_timing(replace(t, sync=np.zeros_like(t.sync), control=0.0))["pipeline_s"]
            rounds = np.maximum(0.0, rounds + codec_s(workload, plan.stages, choice.sync) - pipe)
        t = replace(t, sync=rounds / choice.sync.period)
    return replace(t, control=control)


def codec_s(workload: Workload, stages: list[tuple[int, int]], sync: SyncOption) -> float:
    """Seconds of one outer round's pseudo-gradient codec on the workers' CPU (the largest stage's)."""
    if sync == EXACT or sync.pseudo_grad_compression == "none":
        return 0.0
    elems = max(workload.stage_params(a, b) for a, b in stages)
    return OUTER_CODEC_PASSES * elems * CODEC_S_PER_ELEMENT[sync.pseudo_grad_compression]


def control_s(workload: Workload, stages: list[tuple[int, int]], n_workers: int, sync: SyncOption) -> float:
    """Seconds per step outside the pipeline and the averaging. Exact: the leader's start, reduce and apply
    rounds. DiLoCo: start and the merged inner reduce-and-apply every step, the outer reduce and apply once per
    round, and the outer round's codec on the workers' CPU (the largest stage's), amortised over the period
    (with overlap the codec is part of the round hidden behind an inner step: :func:`timing_for`)."""
    if sync == EXACT:
        return control_time(n_workers, EXACT_ROUNDS)
    rounds = DILOCO_INNER_ROUNDS + DILOCO_ROUND_END_ROUNDS / sync.period
    codec = 0.0 if sync.overlap else codec_s(workload, stages, sync) / sync.period
    return control_time(n_workers, rounds) + codec


def _with_activation(cluster: Cluster, workload: Workload, t: Timing, activation: tuple[str, ...]) -> Timing:
    """``t`` with each boundary's hop bytes and codec compute set by its activation option."""
    m = t.m
    n_st = m.shape[1]
    if len(activation) != n_st - 1:
        raise PlanningError("activation", f"{len(activation)} options for {n_st - 1} boundaries")
    if n_st == 1:
        return t
    elems = workload.micro_batch * workload.seq_len * workload.d_model
    per = np.array([bytes_per_element(a, workload.act_bytes) for a in activation]) * elems
    a, b = m[:, :-1], m[:, 1:]
    xfer_fwd = 8.0 * per[None, :] / cluster.bandwidth_bps[a, b]
    xfer_bwd = 8.0 * per[None, :] / cluster.bandwidth_bps[b, a]
    coded = np.array([x != "none" for x in activation], dtype=float) * elems * CODEC_FLOPS_PER_ELEMENT
    speed = cluster.tflops[m] * 1e12
    codec = np.zeros(m.shape)
    codec[:, :-1] += coded[None, :] / speed[:, :-1]
    codec[:, 1:] += coded[None, :] / speed[:, 1:]
    return replace(t, fwd=t.fwd + codec, bwd=t.bwd + codec, xfer_fwd=xfer_fwd, xfer_bwd=xfer_bwd,
                   hop_fwd=cluster.delay_s[a, b] + xfer_fwd, hop_bwd=cluster.delay_s[b, a] + xfer_bwd)


def predict(cluster: Cluster, workload: Workload, plan: Plan, choice: Choice,
            penalties: PenaltyTable | None = None) -> dict[str, Any]:
    """``cost_full.predict`` of one training step (the mean over a sync period) under ``choice``."""
    out = cost_full.predict_timing(timing_for(cluster, workload, plan, choice))
    out["choice"] = choice.to_dict(penalties)
    out["bytes_per_step"] = bytes_per_step(workload, plan, choice)
    if penalties is not None:
        out["loss_penalty"] = penalties.penalty(choice)
    return out


def bytes_per_step(workload: Workload, plan: Plan, choice: Choice) -> dict[str, float]:
    """Bytes all devices send per training step (mean over a sync period): pipeline hops and DP sync."""
    elems = workload.micro_batch * workload.seq_len * workload.d_model
    pipe = sum(2.0 * elems * bytes_per_element(a, workload.act_bytes) for a in choice.activation)
    pipe *= workload.n_microbatches
    d = plan.n_replicas
    per_elem = workload.param_bytes * (1.0 if choice.sync == EXACT else sync_bytes_factor(
        choice.sync.pseudo_grad_compression, plan.n_replicas, workload.param_bytes))
    # reduce-scatter + all-gather: each member sends (D - 1) shards of P / D in each phase
    params = sum(workload.stage_params(a, b) for a, b in plan.stages)
    sync = 2.0 * (d - 1) * params * per_elem / choice.sync.period if d > 1 else 0.0
    return {"pipeline": float(pipe), "sync": float(sync), "total": float(pipe + sync)}


class CompressedCost:
    """``f(m)``: the cheapest step time of layout ``m`` over the feasible uniform choices (see the module doc)."""

    def __init__(self, cluster: Cluster, workload: Workload, stages: list[tuple[int, int]],
                 space: CompressionSpace) -> None:
        self.cluster, self.workload, self.stages, self.space = cluster, workload, stages, space
        self.flops = stage_flops(workload, stages)
        self.shard_bytes = np.array([workload.stage_param_bytes(a, b) for a, b in stages])
        pen = space.penalties
        limit = space.max_loss_penalty + 1e-12
        n_b = len(stages) - 1
        self.options: list[tuple[str, SyncOption, float, str]] = []  # (activation, sync, penalty, pseudo codec)
        for a in space.activation:
            for s in space.sync:
                p = pen.penalty(Choice((a,) * n_b, s))
                if p <= limit:
                    self.options.append((a, s, p, "exact" if s == EXACT else s.pseudo_grad_compression))
        if not self.options:
            self.options = [("none", EXACT, 0.0, "exact")]  # exact training has no penalty by definition

    def _sync(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per stage, the delays and 8 / bandwidth of every ordered member pair: (S, D, D) each."""
        g = m.T
        delay = self.cluster.delay_s[g[:, :, None], g[:, None, :]]
        inv_bw = 8.0 / self.cluster.bandwidth_bps[g[:, :, None], g[:, None, :]]
        return delay, inv_bw

    def best(self, m: np.ndarray) -> tuple[float, Choice]:
        n_b = len(self.stages) - 1
        d = m.shape[0]
        base = timing(self.cluster, self.workload, Plan(self.stages, m.tolist()), self.flops)
        base = replace(base, sync=np.zeros_like(base.sync))
        pipe: dict[str, float] = {}
        dp: dict[str, float] = {}
        extra: dict[SyncOption, float] = {}
        pairs = self._sync(m) if d > 1 else None
        eye = np.eye(d, dtype=bool)
        scored: list[tuple[float, float, str, SyncOption]] = []
        for a, s, p, codec in self.options:
            if a not in pipe:
                t = _with_activation(self.cluster, self.workload, base, (a,) * n_b)
                pipe[a] = cost_full.predict_timing(t)["pipeline_s"]
            if codec not in dp:
                if pairs is None:
                    dp[codec] = 0.0
                else:
                    f = 1.0 if codec == "exact" else sync_bytes_factor(codec, d, self.workload.param_bytes)
                    x = pairs[0] + pairs[1] * (f * self.shard_bytes / d)[:, None, None]
                    x[:, eye] = 0.0
                    dp[codec] = 2.0 * float(x.max())
            if s not in extra:  # the option's control rounds beyond exact training's (module docstring)
                extra[s] = (control_s(self.workload, self.stages, m.size, s)
                            - control_s(self.workload, self.stages, m.size, EXACT))
            if s.overlap:  # the round and its codec hidden behind one inner step, up to that step's time
                sync_s = max(0.0, dp[codec] + codec_s(self.workload, self.stages, s) - pipe[a]) / s.period
            else:
                sync_s = dp[codec] / s.period
            scored.append((pipe[a] + sync_s + extra[s], p, a, s))
        fastest = min(t for t, *_ in scored)
        # the least penalty among the choices within min_gain of the fastest (then the faster of those)
        t, _, a, s = min((x for x in scored if x[0] <= fastest * (1 + self.space.min_gain)),
                         key=lambda x: (x[1], x[0]))
        return t, Choice((a,) * n_b, s)

    def __call__(self, m: np.ndarray) -> float:
        return self.best(m)[0]


def refine(cluster: Cluster, workload: Workload, plan: Plan, choice: Choice, space: CompressionSpace,
           tol: float | None = None) -> Choice:
    """Per-boundary choice on a fixed layout, by coordinate descent from ``choice``.

    A boundary moves to another option when that makes the step faster (by more than ``tol``) within the
    penalty limit, or keeps its time (within ``tol``, default ``space.min_gain``) at less penalty: a fast hop
    is not compressed.
    """
    pen, limit = space.penalties, space.max_loss_penalty + 1e-12
    tol = space.min_gain if tol is None else tol

    def cost(c: Choice) -> float:
        return float(cost_full.predict_timing(timing_for(cluster, workload, plan, c))["total_s"])

    cur, cur_t = choice, cost(choice)
    for _ in range(3):
        changed = False
        for h in range(len(cur.activation)):
            for opt in space.activation:
                if opt == cur.activation[h]:
                    continue
                acts = list(cur.activation)
                acts[h] = opt
                cand = Choice(tuple(acts), cur.sync)
                p = pen.penalty(cand)
                if p > limit:
                    continue
                ct = cost(cand)
                faster = ct < cur_t * (1 - tol)
                same_cheaper = ct <= cur_t * (1 + tol) and p < pen.penalty(cur) - 1e-12
                if faster or same_cheaper:
                    cur, cur_t, changed = cand, ct, True
        if not changed:
            break
    return cur
