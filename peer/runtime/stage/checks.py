"""Checks of a replica group's averaging against a member that lies: the direction test of a contribution and
the all-gather digest of a summed shard. Pure functions of tensors, so both ends compute them bitwise alike.

**Direction** (:func:`unrelatedness`). Before an owner sums the contributions to its shard it asks, of each, whether
it bears any relation to the others' sum: the shard is cut into blocks of positions, and in each block the cosine
between the contribution and the others' sum over the block's common support (where both are non-zero: an embedding
row only one side's tokens touched is no evidence either way; a block with under 128 such elements is left out) is
scaled by ``sqrt(support size)``. For a contribution independent of the others
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
weights existed. Each projection's weights are a product ``a[i] * b[j]`` of two seeded Gaussian vectors, with the
shard read as rows of ``DIGEST_ROW`` elements (``i`` the column, ``j`` the row): ``b . (X a)``, so generating
them costs ``K (DIGEST_ROW + rows)`` random numbers instead of ``K`` per element, and the projection is one
float64 matrix product (docs/security.md gives what the product weights cost a forger). A receiver then checks
that the projections of the summed shard equal the sum of the contributors' projections within the float32
rounding bound of a ``D``-term sum; the owner checks each contributor's projections against the contribution it
actually received, so a contributor that lies about its digest is caught by an honest owner.
"""

from __future__ import annotations

import math
import struct

import torch

from tasklet.peer.compute.stage import bytes_digest, shard_bounds

DIGEST_K = 4  # projections per shard: a forger's chance per try is about (r ln(1/r))^K, r = tolerance / change
DIGEST_ROW = 4096  # elements per row of a shard's product weights
_ROWS_PER_BLOCK = 16  # rows converted to float64 at a time (scratch memory stays in cache)
_EPS32 = float(torch.finfo(torch.float32).eps)
_MIN_BLOCK = 128  # elements per block of the direction test
_MAX_BLOCKS = 64
MIN_BLOCKS = 16  # fewer blocks than this (a common support under 2,048 elements): no direction test
# a contribution of fewer tokens than this gets no direction test: one 16-token micro-batch of a tiny model scored
# as low as noise does (0.99 against 0.80), while every contribution of 256 tokens or more measured scored >= 2.2
MIN_DIRECTION_TOKENS = 256
_NULL_MEAN, _NULL_SD = math.sqrt(2 / math.pi), math.sqrt(1 - 2 / math.pi)


def unrelatedness(x: torch.Tensor, others: torch.Tensor) -> tuple[float, int] | None:
    """The mean over blocks of ``|cos(x_b, others_b)| * sqrt(len_b)``, each block's cosine over its common
    support (``len_b`` elements), and the blocks it is over; None when there are too few of them for the test.
    See the module docstring for its meaning."""
    n = x.numel()
    if n // _MIN_BLOCK < MIN_BLOCKS:
        return None
    scaled = []
    for lo, hi in shard_bounds(n, min(_MAX_BLOCKS, n // _MIN_BLOCK)):
        a, b = x[lo:hi], others[lo:hi]
        a_nz, b_nz = a != 0, b != 0
        if not (bool(a_nz.all()) and bool(b_nz.all())):  # rows of an embedding only one side used say nothing
            both = a_nz & b_nz
            a, b = a[both], b[both]  # compacted only where the support is partial: 5x the cost of a dense block
        if a.numel() < _MIN_BLOCK:
            continue
        a, b = a.double(), b.double()
        den = math.sqrt(float(a @ a) * float(b @ b))
        if den > 0 and math.isfinite(den):
            scaled.append(abs(float(a @ b)) / den * math.sqrt(a.numel()))
    if len(scaled) < MIN_BLOCKS:
        return None
    return sum(scaled) / len(scaled), len(scaled)


def direction_threshold(z: float, blocks: int) -> float:
    """The least mean scaled cosine over ``blocks`` blocks a contribution needs: ``z`` standard errors above
    what noise gets."""
    return _NULL_MEAN + z * _NULL_SD / math.sqrt(blocks)


def digest_seed(tag: tuple[int, int], owner: int, summed: torch.Tensor) -> str:
    """The hex seed of shard ``owner``'s digest: a hash of the attempt, the owner and the summed shard's bytes."""
    host = summed.detach().cpu().to(torch.float32).contiguous().numpy()
    label = b"tasklet/allgather-digest" + struct.pack("<qqq", tag[0], tag[1], owner)
    return bytes_digest(memoryview(host).cast("B"), label)[:16]  # hashed in place: no copy


def shard_digest(x: torch.Tensor, seed: str) -> tuple[list[float], list[float]]:
    """``K`` random projections of ``x`` (product Gaussian weights seeded by ``seed``, float64 sums; module
    docstring) and the same projections of ``|x|`` with ``|weights|`` (the scale that bounds a float32 sum's
    rounding)."""
    g = torch.Generator().manual_seed(int(seed, 16) & ((1 << 63) - 1))
    flat = x.detach().cpu().reshape(-1)
    n = flat.numel()
    width = max(1, min(DIGEST_ROW, n))
    rows = -(-n // width)
    cols = torch.randn(width, DIGEST_K, generator=g, dtype=torch.float32).double()  # a_k, one column each
    row_w = torch.randn(rows, DIGEST_K, generator=g, dtype=torch.float32).double()  # b_k
    cols_abs = cols.abs()
    xa = torch.empty(rows, DIGEST_K, dtype=torch.float64)  # row j: X[j] . a_k
    xa_mag = torch.empty(rows, DIGEST_K, dtype=torch.float64)  # |X[j]| . |a_k|
    whole = n // width
    for r0 in range(0, whole, _ROWS_PER_BLOCK):
        r1 = min(whole, r0 + _ROWS_PER_BLOCK)
        block = flat[r0 * width:r1 * width].view(r1 - r0, width).double()
        torch.mm(block, cols, out=xa[r0:r1])
        torch.mm(block.abs_(), cols_abs, out=xa_mag[r0:r1])
    if whole < rows:  # a last, shorter row
        tail = flat[whole * width:].double()
        xa[whole] = tail @ cols[:tail.numel()]
        xa_mag[whole] = tail.abs() @ cols_abs[:tail.numel()]
    proj = (xa * row_w).sum(0)
    mag = (xa_mag * row_w.abs()).sum(0)
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
