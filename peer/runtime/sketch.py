"""Sketches of a micro-batch's inter-stage tensors, and how two of them are compared (the spot checks).

A stage reports, for each micro-batch it worked on, a *sketch* of what it received and what it sent: for each
point (``act_in``, ``act_out``, ``grad_in``, ``grad_out``) ``K`` projections of the tensor on Gaussian weights
seeded by (run, step, micro-batch, point), and its root mean square. The leader compares the sketches of two
pipelines that ran the same micro-batch (a spot check, ``peer.runtime.lead.spot``) and, within one pipeline,
what a sender says it sent with what its receiver says it received. Why projections: a few hundred bytes per
micro-batch and stage instead of the tensor, and a change of relative size ``c`` moves each projection by
about ``c`` x the RMS, so it is seen unless ``c`` is under the tolerance.

Tolerance (``tolerance``): honest copies differ by the round-off of different kernels, thread counts and
devices. Measured on the test models (fp32, CPU, 1 vs 2 threads, and against float64): the relative change of
the activations is ~1e-7 and of the activation gradients ~1e-6 per stage; through a few stages and a GPU's
other reduction orders we allow 1e-3 of the RMS in fp32 (TF32 matmuls, which change ~1e-3 relatively, are off
by default in torch), and 5e-2 in bf16/fp16 (the format's own step is 8e-3). Lossy activation compression
adds its own error on the link between a sender and its receiver (``link_tolerance``; int8 and below: links
are not checked).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

K = 4  # projections per point
POINTS = ("act_in", "act_out", "grad_in", "grad_out")
PER_POINT = K + 1  # K projections and the RMS
MAX_VALUES = len(POINTS) * PER_POINT
_TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
# the wire's error between a sender's and its receiver's view, relative to the RMS: ~5x what was measured on a
# Gaussian tensor (fp16 2e-4, int8 6e-3 of the RMS, more with outliers; int4 0.16, int2 and top-k ~1)
_LINK = {"none": 0.0, "fp16": 2e-3, "bf16": 2e-2}
CHUNK = 1 << 16  # weights are drawn in chunks of this many values (bounded memory whatever the tensor's size)


def seed_of(run_id: str, step: int, microbatch: int, point: str, stage: int) -> int:
    """The projections' seed of ``point`` of ``stage`` for one micro-batch: the same on every pipeline, and the
    same for a sender's and its receiver's view of one tensor (the activation from stage s to s + 1, the
    activation gradient from s to s - 1)."""
    link = {"act_out": f"act{stage}", "act_in": f"act{stage - 1}", "grad_out": f"grad{stage}",
            "grad_in": f"grad{stage + 1}"}.get(point, point)
    digest = hashlib.sha256(f"{run_id}|{step}|{microbatch}|{link}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sketch(tensor: torch.Tensor, seed: int, k: int = K) -> tuple[float, ...]:
    """``k`` projections of ``tensor`` (flattened, fp32 on the host) on seeded standard Gaussian weights, each
    divided by sqrt(n), then the RMS: ``k + 1`` numbers of the scale of the tensor's values."""
    flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
    n = flat.numel()
    if n == 0:
        return (0.0,) * (k + 1)
    gen = torch.Generator().manual_seed(seed)
    sums = torch.zeros(k, dtype=torch.float64)
    for start in range(0, n, CHUNK):
        part = flat[start:start + CHUNK]
        weights = torch.randn((k, part.numel()), generator=gen, dtype=torch.float32)
        sums += (weights @ part).double()
    rms = float(flat.double().pow(2).mean().sqrt())
    return (*(float(s) / math.sqrt(n) for s in sums), rms)


def tolerance(precision: str) -> float:
    """The relative difference (of the RMS) two honest copies may show at one point."""
    return _TOLERANCE.get(precision, _TOLERANCE["bf16"])


def link_tolerance(precision: str, compression: str) -> float:
    """The same for a sender's and its receiver's sketch of one tensor: the compression's error added. The
    integer and top-k codecs change a tensor by more than a cheater needs to (int8's error grows with the
    tensor's outliers): their links are not checked (infinite tolerance); the copies still are."""
    return tolerance(precision) + _LINK.get(compression, math.inf)


def agree(a: Sequence[float], b: Sequence[float], tol: float) -> bool:
    """Whether two sketches of one point are the same tensor within ``tol`` of the larger RMS (every projection
    and the RMS itself). Sketches of different lengths, or with a value that is not finite, disagree."""
    if len(a) != len(b) or not a:
        return False
    if not all(math.isfinite(v) for v in (*a, *b)):
        return False
    scale = max(abs(a[-1]), abs(b[-1]), 1e-30)
    return all(abs(x - y) <= tol * scale for x, y in zip(a, b, strict=True))
