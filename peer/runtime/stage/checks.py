"""Checks of a replica group's averaging against a member that lies: the direction test of a contribution and
the all-gather digest of a summed shard. Pure functions of tensors, so both ends compute them bitwise alike.

**Direction** (:func:`unrelatedness`). Before an owner sums the contributions to its shard it asks, of each, whether
it bears any relation to the others' sum: the shard's common support (where both are non-zero: an embedding row
only one side's tokens touched is no evidence either way) is cut into blocks, and in each block the cosine between the
contribution and the others' sum is scaled by ``sqrt(block size)``. For a contribution independent of the others
(noise, whatever its norm) each scaled cosine is about a standard normal, so their mean magnitude is
``sqrt(2/pi)`` = 0.80 with a spread of ``0.60 / sqrt(blocks)``. An honest gradient is correlated with the
others' (positively or negatively: small pipelines' gradients can point away from each other) in most blocks,
and its mean magnitude is far larger once the contribution covers enough tokens (2.2 to 7 on the test models
from 256 tokens up, docs/security.md; a single 16-token micro-batch scored 0.99, so smaller contributions are not
tested). A contribution whose mean magnitude is below ``0.80 + z * 0.60 / sqrt(blocks)`` is refused. It is a
test of *relatedness*, not of agreement: a sign-flipped or rescaled honest gradient passes it (the norm check
bounds the rescaling).

**All-gather digest** (:func:`shard_digest`). After the all-gather every participant holds the owners' summed
shards. For each shard it sends every participant ``K`` random projections of *its own contribution* to that
shard, with weights seeded by a hash of the summed shard as received: the owner had to fix the sum before the
weights existed. A receiver then checks that the projections of the summed shard equal the sum of the
contributors' projections within the float32 rounding bound of a ``D``-term sum; the owner checks each
contributor's projections against the contribution it actually received, so a contributor that lies about its
digest is caught by an honest owner.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

from peer.compute.stage import shard_bounds

DIGEST_K = 4  # random projections per shard: a forger's chance per try is about (tolerance / change)^K
_CHUNK = 1 << 16  # elements of weights generated at a time (scratch memory stays in cache)
_EPS32 = float(torch.finfo(torch.float32).eps)
_MIN_BLOCK = 128  # elements per block of the direction test
_MAX_BLOCKS = 64
MIN_BLOCKS = 16  # fewer blocks than this (a common support under 2,048 elements): no direction test
# a contribution of fewer tokens than this gets no direction test: one 16-token micro-batch of a tiny model scored
# as low as noise does (0.99 against 0.80), while every contribution of 256 tokens or more measured scored >= 2.2
MIN_DIRECTION_TOKENS = 256
_NULL_MEAN, _NULL_SD = math.sqrt(2 / math.pi), math.sqrt(1 - 2 / math.pi)


def unrelatedness(x: torch.Tensor, others: torch.Tensor) -> tuple[float, int] | None:
    """The mean over blocks of the common support of ``|cos(x_b, others_b)| * sqrt(len_b)`` and the blocks it is
    over; None when there are too few of them for the test. See the module docstring for its meaning."""
    both = (x != 0) & (others != 0)  # the common support: rows of an embedding only one side used say nothing
    x, others = x[both], others[both]
    n = x.numel()
    blocks = min(_MAX_BLOCKS, n // _MIN_BLOCK)
    if blocks < MIN_BLOCKS:
        return None
    scaled = []
    for lo, hi in shard_bounds(n, blocks):
        a, b = x[lo:hi].double(), others[lo:hi].double()
        den = float(a.norm() * b.norm())
        if den > 0 and math.isfinite(den):
            scaled.append(abs(float(a @ b)) / den * math.sqrt(hi - lo))
    if len(scaled) < MIN_BLOCKS:
        return None
    return sum(scaled) / len(scaled), len(scaled)


def direction_threshold(z: float, blocks: int) -> float:
    """The least mean scaled cosine over ``blocks`` blocks a contribution needs: ``z`` standard errors above
    what noise gets."""
    return _NULL_MEAN + z * _NULL_SD / math.sqrt(blocks)


def digest_seed(tag: tuple[int, int], owner: int, summed: torch.Tensor) -> str:
    """The hex seed of shard ``owner``'s digest: a hash of the attempt, the owner and the summed shard's bytes."""
    h = hashlib.sha256(b"tasklet/allgather-digest")
    h.update(struct.pack("<qqq", tag[0], tag[1], owner))
    h.update(summed.detach().cpu().contiguous().to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def shard_digest(x: torch.Tensor, seed: str) -> tuple[list[float], list[float]]:
    """``K`` random projections of ``x`` (Gaussian weights seeded by ``seed``, float64 sums) and the same
    projections of ``|x|`` with ``|weights|`` (the scale that bounds a float32 sum's rounding)."""
    g = torch.Generator().manual_seed(int(seed, 16) & ((1 << 63) - 1))
    proj = torch.zeros(DIGEST_K, dtype=torch.float64)
    mag = torch.zeros(DIGEST_K, dtype=torch.float64)
    flat = x.detach().cpu().reshape(-1)
    for lo in range(0, flat.numel(), _CHUNK):
        part = flat[lo:lo + _CHUNK].double()
        w = torch.randn(DIGEST_K, part.numel(), generator=g, dtype=torch.float32).double()
        proj += w @ part
        mag += w.abs() @ part.abs()
    return proj.tolist(), mag.tolist()


def sum_mismatch(summed: torch.Tensor, seed: str, contributions: list[tuple[list[float], list[float]]],
                 owner_index: int) -> float:
    """How far the summed shard's projections are from the sum of the contributors' (``contributions`` in
    participant order, the owner's at ``owner_index``), in units of the rounding tolerance; above 1: not the
    sum. The owner's own magnitude is not trusted: the tolerance bounds it by the sum's and the others'."""
    proj, mag = shard_digest(summed, seed)
    d = len(contributions)
    worst = 0.0
    for k in range(DIGEST_K):
        claimed = sum(c[0][k] for c in contributions)
        others = sum(c[1][k] for i, c in enumerate(contributions) if i != owner_index)
        # a D-term float32 sum (in order) is off by at most (D-1) u of its terms' magnitudes (u = eps / 2, the
        # unit round-off), |own| <= |sum| + |others|; 1.5 covers that bound's second-order term and the float64
        # projections' own rounding
        tol = 1.5 * max(1, d - 1) * (_EPS32 / 2) * (mag[k] + 2.0 * others) + 1e-9 * (mag[k] + others) + 1e-30
        worst = max(worst, abs(proj[k] - claimed) / tol)
    return worst


def digest_matches(x: torch.Tensor, seed: str, claimed: tuple[list[float], list[float]]) -> bool:
    """Whether ``claimed`` is the digest of ``x`` (the owner checking a contributor's word)."""
    proj, mag = shard_digest(x, seed)
    tol = [1e-9 * m + 1e-30 for m in mag]
    return all(abs(a - b) <= t for a, b, t in zip(proj, claimed[0], tol, strict=True)) and all(
        abs(a - b) <= t for a, b, t in zip(mag, claimed[1], tol, strict=True))
