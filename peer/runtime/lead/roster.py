"""The plan as the leader sees it: which worker holds which (stage, pipeline), and under which certificate.

One immutable snapshot per plan (``Coordinator.assign`` replaces it whole), so that a reader — the step machine,
a gRPC handler, the liveness loop — always sees one plan, never half of two.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from tasklet.peer.runtime.spec import Assignment
from tasklet.protocol.errors import Forbidden


@dataclass(frozen=True)
class Roster:
    """Workers of one plan by endpoint (``assignments``) and their peer ids (``peer_ids``, from certificates)."""

    assignments: dict[str, Assignment] = field(default_factory=dict)
    peer_ids: dict[str, str] = field(default_factory=dict)

    @property
    def n_pipelines(self) -> int:
        return max((a.n_replicas for a in self.assignments.values()), default=0)

    def members(self, pipelines: Iterable[int], dead: Collection[str] = (), first: bool | None = None) -> list[str]:
        """Live workers of ``pipelines`` (only first stages, or only the others, when ``first`` is set)."""
        wanted = set(pipelines)
        return [ep for ep, a in self.assignments.items()
                if a.replica in wanted and ep not in dead and (first is None or a.is_first == first)]

    def pipelines_of(self, endpoints: Iterable[str]) -> set[int]:
        """The pipelines the given workers of the plan belong to (others are ignored)."""
        return {self.assignments[ep].replica for ep in endpoints if ep in self.assignments}

    def alive_pipelines(self, dead: Collection[str]) -> list[int]:
        """Pipelines none of whose members is dead."""
        broken = self.pipelines_of(dead)
        return [r for r in range(self.n_pipelines) if r not in broken]

    def endpoint_of(self, stage: int, replica: int) -> str | None:
        return next((ep for ep, a in self.assignments.items() if a.stage == stage and a.replica == replica), None)

    def is_last(self, endpoint: str | None) -> bool:
        a = self.assignments.get(endpoint or "")
        return a is not None and a.is_last

    def who(self, endpoint: str) -> str:
        """A worker's identity for the referee and the credit record: its peer id (else, locally, its endpoint)."""
        return self.peer_ids.get(endpoint, endpoint)

    def member(self, caller: str, stage: int, replica: int, what: str, own_id: str) -> str:
        """The endpoint of (stage, replica), if ``caller`` is the peer the plan puts there (``own_id``: the leader's,
        whose own worker's assignment may carry no certificate); else Forbidden naming ``what`` was refused."""
        endpoint = self.endpoint_of(stage, replica)
        if endpoint is None or self.peer_ids.get(endpoint, own_id) != caller:
            raise Forbidden(f"{what} for stage {stage} of pipeline {replica} is taken only from the worker the plan "
                            f"puts there; peer {caller} is not")
        return endpoint
