"""A device order that depends on what the devices are, not on the ids they were listed under.

The search is deterministic for a seed, but its random moves name positions, so the same scenario under
another numbering of its devices follows another path and may end elsewhere (a few percent apart on
heterogeneous scenarios when time ends the search). Planning over the devices sorted by a key computed from
their own figures -- speed, memory, and the sorted rows and columns of their delay and bandwidth matrices
(each projected onto one fixed random vector, so a row is one number) -- makes the search's input identical
under any permutation of ids, up to the order of devices whose keys tie exactly. Those are devices with
identical figures; in region-level scenarios they are interchangeable (swapping two of them changes no cost),
so the search's costs are the same whatever order they keep.
"""

from __future__ import annotations

import numpy as np

from .cluster import Cluster

_PROJECTION_SEED = 20220  # fixed: every call projects onto the same vector


def _row_keys(mat: np.ndarray, proj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = np.array(mat, dtype=float)
    np.fill_diagonal(m, 0.0)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.sort(m, axis=1) @ proj, np.sort(m, axis=0).T @ proj


def canonical_order(cluster: Cluster) -> np.ndarray:
    """Device ids sorted by (speed, memory, delay and bandwidth profiles); ties keep their listed order."""
    n = cluster.n
    proj = np.random.default_rng(_PROJECTION_SEED).uniform(0.5, 1.5, size=n)
    d_out, d_in = _row_keys(cluster.delay_s, proj)
    b_out, b_in = _row_keys(cluster.bandwidth_bps / 1e9, proj)
    # np.lexsort: the last key is the primary one; it is stable, so exact ties keep the listed order
    return np.lexsort((b_in, d_in, b_out, d_out, cluster.memory_bytes, cluster.tflops)).astype(int)
