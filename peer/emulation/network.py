"""The bridge between the scheduler's model of a cluster and a local emulated swarm.

A local swarm runs real processes on one machine, so the devices and links of a scenario are *emulated*:
each worker stretches its compute to the declared TFLOP/s and shapes what it sends to the scenario's
bandwidth and delay. The scheduler predicts the same run from the same numbers. Keeping the translation in one
place (this module) means a prediction and the run it predicts cannot silently disagree on units.

Scaling: real scenarios (10 Gbit/s links, 100 TFLOP/s GPUs, billion-parameter models) do not fit on a laptop
CPU. ``bandwidth_scale`` and ``tflops_scale`` multiply every link's bandwidth and every device's speed, so a
scaled-down model keeps the scenario's *ratios* (which links are slow, which devices are fast). Whoever
reports a result must say which scales it used.
"""

from __future__ import annotations

import numpy as np

from peer.runtime.assign import LinkModel
from scheduler import Cluster


def scaled_cluster(cluster: Cluster, bandwidth_scale: float = 1.0, tflops_scale: float = 1.0) -> Cluster:
    """The same cluster with every bandwidth and device speed multiplied (delays unchanged)."""
    if not (bandwidth_scale > 0 and tflops_scale > 0):
        raise ValueError("bandwidth_scale and tflops_scale must be positive")
    return Cluster(delay_s=cluster.delay_s.copy(), bandwidth_bps=cluster.bandwidth_bps * bandwidth_scale,
                   tflops=cluster.tflops * tflops_scale, memory_bytes=cluster.memory_bytes.copy(),
                   regions=list(cluster.regions), labels=list(cluster.labels), name=cluster.name)


def link_model(cluster: Cluster) -> LinkModel:
    """What the workers emulate for ``cluster``: its bandwidth (bit/s), one-way delays (s) and TFLOP/s."""
    bw = np.array(cluster.bandwidth_bps, dtype=float)
    delay = np.array(cluster.delay_s, dtype=float)
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(delay, 0.0)
    return LinkModel(bandwidth_bps=bw.tolist(), delay_s=delay.tolist(), tflops=[float(x) for x in cluster.tflops])
