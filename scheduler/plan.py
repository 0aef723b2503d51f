"""The output of the scheduler: layer ranges per stage and the device of every (replica, stage) tasklet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import PlanningError


@dataclass
class Plan:
    """``pipelines[r][s]``: device running stage ``s`` of replica ``r``; ``stages[s]``: its layers [a, b)."""

    stages: list[tuple[int, int]]
    pipelines: list[list[int]]
    predicted: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_replicas(self) -> int:
        return len(self.pipelines)

    def matrix(self) -> np.ndarray:
        """The plan as a (replicas x stages) integer array."""
        return np.asarray(self.pipelines, dtype=int).reshape(self.n_replicas, self.n_stages)

    def group(self, s: int) -> list[int]:
        """The data-parallel group of stage ``s``."""
        return [p[s] for p in self.pipelines]

    def validate(self, n_devices: int, n_layers: int | None = None) -> None:
        """Each device at most once, every stage of every pipeline filled, layer ranges tile the model."""
        if not self.stages or not self.pipelines:
            raise PlanningError("pipelines", "plan is empty")
        s = len(self.stages)
        seen: set[int] = set()
        for r, pipe in enumerate(self.pipelines):
            if len(pipe) != s:
                raise PlanningError(f"pipelines[{r}]", f"has {len(pipe)} stages, expected {s}")
            for d in pipe:
                if not isinstance(d, (int, np.integer)) or not 0 <= d < n_devices:
                    raise PlanningError(f"pipelines[{r}]", f"device {d!r} not in 0..{n_devices - 1}")
                if int(d) in seen:
                    raise PlanningError(f"pipelines[{r}]", f"device {d} used twice")
                seen.add(int(d))
        prev = 0
        for i, (a, b) in enumerate(self.stages):
            if a != prev or b <= a:
                raise PlanningError(f"stages[{i}]", f"layers [{a}, {b}) do not continue from {prev}")
            prev = b
        if n_layers is not None and prev != n_layers:
            raise PlanningError("stages", f"cover {prev} layers, model has {n_layers}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": [{"layers": [int(a), int(b)]} for a, b in self.stages],
            "pipelines": [[int(d) for d in p] for p in self.pipelines],
            "predicted": dict(self.predicted),
            "search": dict(self.search),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            stages = [(int(st["layers"][0]), int(st["layers"][1])) for st in d["stages"]]
            pipelines = [[int(x) for x in p] for p in d["pipelines"]]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise PlanningError("plan", f"malformed plan: {exc}") from exc
        return cls(stages=stages, pipelines=pipelines, predicted=dict(d.get("predicted", {})),
                   search=dict(d.get("search", {})))


def even_stages(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_stages`` contiguous ranges differing by at most one layer."""
    if not 1 <= n_stages <= n_layers:
        raise PlanningError("stages", f"{n_stages} stages for {n_layers} layers")
    base, extra = divmod(n_layers, n_stages)
    out, a = [], 0
    for s in range(n_stages):
        b = a + base + (1 if s < extra else 0)
        out.append((a, b))
        a = b
    return out
