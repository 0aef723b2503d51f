"""Synthetic large scenarios (for the 1,024-device benchmark): datacenters and home clusters on a map.

Regions get random positions on a 2-D map of about 200 ms across; the one-way delay between two regions is
2 ms plus the distance, the bandwidth falls with distance. Datacenter regions have fast, short links inside
(100 Gbit/s, 0.05 ms), home regions slow ones (0.5 Gbit/s, 10 ms), and a home uplink caps any link that
touches a home region at 0.3 Gbit/s. Deterministic for a seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def geo_scenario(n_devices: int = 1024, n_datacenters: int = 8, n_homes: int = 8, seed: int = 0
                 ) -> dict[str, Any]:
    """A region-level scenario dict in the schema of ``shared/scenarios``."""
    rng = np.random.default_rng(seed)
    n_regions = n_datacenters + n_homes
    names = [f"dc{i}" for i in range(n_datacenters)] + [f"home{i}" for i in range(n_homes)]
    pos = rng.uniform(0.0, 100.0, size=(n_regions, 2))
    dist = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=2)
    delay = 2.0 + dist
    bw = np.clip(2.0 - dist / 80.0, 0.3, 2.0)
    home = np.array([n.startswith("home") for n in names])
    bw[home, :] = np.minimum(bw[home, :], 0.3)
    bw[:, home] = np.minimum(bw[:, home], 0.3)
    for r in range(n_regions):
        delay[r, r] = 10.0 if home[r] else 0.05
        bw[r, r] = 0.5 if home[r] else 100.0
    region_of = np.sort(rng.integers(n_regions, size=n_devices))
    return {
        "devices": n_devices,
        "matrix_level": "region",
        "regions": names,
        "device_region": [names[i] for i in region_of],
        "delay_ms": np.round(delay, 3).tolist(),
        "bandwidth_gbps": np.round(bw, 4).tolist(),
        "notes": f"synthetic: {n_datacenters} datacenters + {n_homes} home clusters, seed {seed}",
    }


def hetero_scenario(n_devices: int = 64, n_regions: int = 10, seed: int = 0) -> dict[str, Any]:
    """A device-level scenario with uneven devices: the harder case for the search.

    Regions (datacenter, university or home, at random) sit on the same kind of map as :func:`geo_scenario`;
    every device also has its own access link (datacenter 10-100, university 1-10, home 0.1-1 Gbit/s), a
    pair's bandwidth being the smallest of the two access links and the regions' link, and its own speed and
    memory (V100, A100, RTX 3090 or T4 figures). No two devices are alike, so no layout ties with another.
    """
    rng = np.random.default_rng(seed)
    kinds = rng.choice(["dc", "uni", "home"], size=n_regions, p=[0.3, 0.4, 0.3])
    pos = rng.uniform(0.0, 100.0, size=(n_regions, 2))
    dist = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=2)
    delay = 2.0 + dist
    bw = np.clip(2.0 - dist / 80.0, 0.3, 2.0)
    inside = {"dc": (0.05, 100.0), "uni": (1.0, 10.0), "home": (10.0, 1.0)}
    access_range = {"dc": (10.0, 100.0), "uni": (1.0, 10.0), "home": (0.1, 1.0)}
    for r, k in enumerate(kinds):
        delay[r, r], bw[r, r] = inside[str(k)]
    region_of = np.sort(rng.integers(n_regions, size=n_devices))
    lo_hi = np.array([access_range[str(kinds[r])] for r in region_of])
    access = np.exp(rng.uniform(np.log(lo_hi[:, 0]), np.log(lo_hi[:, 1])))
    dev_bw = np.minimum(bw[np.ix_(region_of, region_of)], np.minimum(access[:, None], access[None, :]))
    dev_delay = delay[np.ix_(region_of, region_of)] + rng.uniform(0.0, 1.0, size=(n_devices, n_devices))
    gpus = [(50.0, 32.0), (120.0, 80.0), (35.0, 24.0), (25.0, 16.0)]
    pick = rng.integers(len(gpus), size=n_devices)
    names = [f"{k}{r}" for r, k in enumerate(kinds)]
    return {
        "devices": n_devices,
        "matrix_level": "device",
        "regions": names,
        "device_region": [names[r] for r in region_of],
        "delay_ms": np.round(dev_delay, 3).tolist(),
        "bandwidth_gbps": np.round(dev_bw, 4).tolist(),
        "tflops": [gpus[i][0] for i in pick],
        "memory_gb": [gpus[i][1] for i in pick],
        "notes": f"synthetic heterogeneous: {n_regions} regions, per-device access links and GPUs, seed {seed}",
    }
