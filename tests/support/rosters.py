"""A plan's roster for the leader side's unit tests: ``n`` pipelines of two one-layer stages, the worker of stage
``s`` in pipeline ``r`` named ``ep(s, r)`` (shared by the step machine's tests and the evidence tests)."""

from __future__ import annotations

from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.spec import Assignment

N_STAGES = 2


def ep(stage: int, pipeline: int) -> str:
    return f"s{stage}p{pipeline}"


def make_roster(n_pipelines: int, n_stages: int = N_STAGES) -> Roster:
    assignments = {}
    for r in range(n_pipelines):
        for s in range(n_stages):
            assignments[ep(s, r)] = Assignment(
                epoch=1, stage=s, replica=r, n_stages=n_stages, n_replicas=n_pipelines, layers=(s, s + 1),
                group=tuple(ep(s, q) for q in range(n_pipelines)), coordinator="lead",
                prev=ep(s - 1, r) if s > 0 else None, next=ep(s + 1, r) if s < n_stages - 1 else None)
    return Roster(assignments)
