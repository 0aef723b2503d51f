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
