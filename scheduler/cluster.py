"""Devices and the links between them, loaded from the scenario schema of ``shared/scenarios``.

A scenario gives either region-level matrices (the value for any two distinct devices of regions ``a`` and
``b``, the diagonal being the value inside one region) or device-level N x N matrices. Both are expanded
here into dense N x N arrays in SI units (seconds, bits per second), which is all the cost models need.

Devices without a declared speed default to a V100: 125 TFLOP/s fp16 tensor-core peak times an efficiency of
0.4, i.e. ``DEFAULT_TFLOPS = 50`` achieved TFLOP/s, and ``DEFAULT_MEMORY_GB = 32`` (V100-SXM2-32GB). The
paper's scenarios declare neither (identical V100s), so every compute-dependent figure of the ``full`` model
on them rests on this assumption.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PlanningError

V100_PEAK_TFLOPS = 125.0
V100_EFFICIENCY = 0.4
DEFAULT_TFLOPS = V100_PEAK_TFLOPS * V100_EFFICIENCY
DEFAULT_MEMORY_GB = 32.0

PACKAGED_SCENARIOS = Path(__file__).with_name("data") / "dtfm_scenarios.json"


def default_scenarios_path() -> Path:
    """The scenarios file: ``$TASKLET_SCENARIOS``, else ``<repo>/../shared``, else the packaged copy."""
    env = os.environ.get("TASKLET_SCENARIOS")
    if env:
        return Path(env)
    shared = Path(__file__).resolve().parents[2] / "shared" / "scenarios" / "dtfm_scenarios.json"
    return shared if shared.exists() else PACKAGED_SCENARIOS


@dataclass
class Cluster:
    """N devices: one-way delay (s) and bandwidth (bit/s) of every directed pair, speed and memory of each."""

    delay_s: np.ndarray
    bandwidth_bps: np.ndarray
    tflops: np.ndarray
    memory_bytes: np.ndarray
    regions: list[str]
    labels: list[str] = field(default_factory=list)
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.labels:
            self.labels = [f"{r}#{i}" for i, r in enumerate(self.regions)]

    @property
    def n(self) -> int:
        return int(self.delay_s.shape[0])

    def subset(self, devices: list[int] | np.ndarray) -> Cluster:
        """The cluster restricted to ``devices`` (renumbered 0..k-1 in that order)."""
        idx = np.asarray(devices, dtype=int)
        return Cluster(
            delay_s=self.delay_s[np.ix_(idx, idx)].copy(),
            bandwidth_bps=self.bandwidth_bps[np.ix_(idx, idx)].copy(),
            tflops=self.tflops[idx].copy(),
            memory_bytes=self.memory_bytes[idx].copy(),
            regions=[self.regions[i] for i in idx],
            labels=[self.labels[i] for i in idx],
            name=self.name,
        )

    def transfer_s(self, nbytes: float) -> np.ndarray:
        """Time to move ``nbytes`` over every directed link: delay + bits / bandwidth (0 on the diagonal)."""
        t = self.delay_s + 8.0 * nbytes / self.bandwidth_bps
        np.fill_diagonal(t, 0.0)
        return t

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_scenario(cls, path: str | os.PathLike[str], name: str | None = None) -> Cluster:
        """Load scenario ``name`` from a JSON file; ``name`` may be omitted when the file holds one scenario.

        A file that is itself one scenario (it has a ``devices`` key) is accepted too.
        """
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except FileNotFoundError as exc:
            raise PlanningError("scenario", f"no such file: {p}") from exc
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanningError("scenario", f"cannot read {p}: {exc}") from exc
        if not isinstance(doc, dict):
            raise PlanningError("scenario", "file must hold a JSON object")
        if "devices" in doc:
            scen, label = doc, name or p.stem
        else:
            if name is None:
                if len(doc) != 1:
                    raise PlanningError("scenario", f"file holds {len(doc)} scenarios; pick one with "
                                        f"FILE:NAME ({', '.join(sorted(doc))})")
                name = next(iter(doc))
            if name not in doc:
                raise PlanningError("scenario",
                                    f"no scenario named {name!r} (have: {', '.join(sorted(doc))})")
            scen, label = doc[name], name
        cluster = cls.from_dict(scen)
        cluster.name = label
        return cluster

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        """Validate one scenario dict and expand it to device-level SI matrices."""
        if not isinstance(d, dict):
            raise PlanningError("scenario", "must be a JSON object")
        n = d.get("devices")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PlanningError("devices", f"must be a positive integer, got {n!r}")
        level = d.get("matrix_level", "device")
        if level not in ("region", "device"):
            raise PlanningError("matrix_level", f"must be 'region' or 'device', got {level!r}")

        regions = d.get("regions")
        device_region = d.get("device_region")
        if level == "region":
            if not isinstance(regions, list) or not regions or not all(isinstance(r, str) for r in regions):
                raise PlanningError("regions", "must be a non-empty list of names")
            if len(set(regions)) != len(regions):
                raise PlanningError("regions", "names must be unique")
            size = len(regions)
        else:
            size = n
        if level == "region" or device_region is not None:
            if not isinstance(device_region, list) or len(device_region) != n:
                raise PlanningError("device_region", f"must list the region of each of the {n} devices")
            if regions is not None:
                known = set(regions) if isinstance(regions, list) else set()
                for i, r in enumerate(device_region):
                    if r not in known:
                        raise PlanningError(f"device_region[{i}]", f"unknown region {r!r}")
            dev_regions = [str(r) for r in device_region]
        else:
            dev_regions = ["-"] * n

        delay = _matrix(d, "delay_ms", size, allow_zero=True)
        bw = _matrix(d, "bandwidth_gbps", size, allow_zero=False, skip_diagonal=(level == "device"))
        if level == "region":
            ridx = np.array([regions.index(r) for r in dev_regions])
            delay = delay[np.ix_(ridx, ridx)]
            bw = bw[np.ix_(ridx, ridx)]
        delay_s = delay / 1e3
        bandwidth_bps = bw * 1e9
        np.fill_diagonal(delay_s, 0.0)
        np.fill_diagonal(bandwidth_bps, np.inf)

        tflops = _vector(d, "tflops", n, DEFAULT_TFLOPS)
        memory_gb = _vector(d, "memory_gb", n, DEFAULT_MEMORY_GB)
        return cls(delay_s=delay_s, bandwidth_bps=bandwidth_bps, tflops=tflops,
                   memory_bytes=memory_gb * 1e9, regions=dev_regions, name=str(d.get("name", "scenario")))


def _matrix(d: dict[str, Any], key: str, size: int, *, allow_zero: bool, skip_diagonal: bool = False
            ) -> np.ndarray:
    raw = d.get(key)
    if not isinstance(raw, list) or len(raw) != size:
        raise PlanningError(key, f"must be a {size} x {size} matrix (got {_shape(raw)})")
    for i, row in enumerate(raw):
        if not isinstance(row, list) or len(row) != size:
            raise PlanningError(f"{key}[{i}]", f"row must have {size} entries (got {_shape(row)})")
    out = np.empty((size, size))
    for i, row in enumerate(raw):
        for j, v in enumerate(row):
            if skip_diagonal and i == j:
                out[i, j] = 0.0 if allow_zero else 1.0
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise PlanningError(f"{key}[{i}][{j}]", f"must be a finite number, got {v!r}")
            if v < 0 or (v == 0 and not allow_zero):
                bound = ">= 0" if allow_zero else "> 0"
                raise PlanningError(f"{key}[{i}][{j}]", f"must be {bound}, got {v!r}")
            out[i, j] = float(v)
    return out


def _vector(d: dict[str, Any], key: str, n: int, default: float) -> np.ndarray:
    raw = d.get(key)
    if raw is None:
        return np.full(n, default)
    if not isinstance(raw, list) or len(raw) != n:
        raise PlanningError(key, f"must list one value per device ({n}), got {_shape(raw)}")
    for i, v in enumerate(raw):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise PlanningError(f"{key}[{i}]", f"must be a positive finite number, got {v!r}")
    return np.asarray(raw, dtype=float)


def _shape(x: Any) -> str:
    return f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__


def load_scenario(spec: str) -> Cluster:
    """``FILE:NAME``, ``FILE`` (one scenario) or a bare ``NAME`` from the shared / packaged scenarios."""
    path, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not path:
        path, name = spec, ""
    p = Path(path)
    if p.exists():
        return Cluster.from_scenario(p, name or None)
    if ":" not in spec and not p.suffix:
        return Cluster.from_scenario(default_scenarios_path(), spec)
    raise PlanningError("scenario", f"no such file: {path}")
