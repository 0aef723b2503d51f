"""From a plan to what each device does: one :class:`Assignment` per device endpoint.

Production code (the leader role) and the local harness (``peer.emulation``) both turn a plan into
assignments here, so a local run and a real swarm cannot disagree on what a plan means. An assignment says
nothing of emulated links or speeds: an emulated worker has its own network model and device clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tasklet.peer.runtime.spec import Assignment, RunSpec


def build_assignments(
    spec: RunSpec,
    stages: Sequence[tuple[int, int]],
    pipelines: Sequence[Sequence[int]],
    endpoints: Sequence[str],
    coordinator: str,
    epoch: int = 1,
    forward_flops: Callable[[int, int], float] | None = None,
    leader: str = "",
    certificates: Mapping[str, str] | None = None,
) -> dict[str, Assignment]:
    """Turn a plan (``pipelines[r][s]`` = device) into one Assignment per device endpoint (``leader``: the
    peer id of the leader making the plan, by which workers order plans of equal epochs).

    ``certificates`` (endpoint -> certificate text, see peer.net.tls.pem_to_text) of the workers and the
    coordinator go into every assignment with the plan's layout, so each worker knows who may send it what
    (Assignment.peers and .plan).
    """
    n_stages, n_replicas = len(stages), len(pipelines)
    out: dict[str, Assignment] = {}
    plan = {endpoints[dev]: (int(stages[s][0]), int(stages[s][1])) for pipe in pipelines for s, dev in enumerate(pipe)}
    peers = {ep: certificates[ep] for ep in [*plan, coordinator] if certificates and ep in certificates}
    for r, pipe in enumerate(pipelines):
        if len(pipe) != n_stages:
            raise ValueError(f"pipeline {r} has {len(pipe)} stages, the plan has {n_stages}")
        for s, dev in enumerate(pipe):
            group = tuple(endpoints[pipelines[q][s]] for q in range(n_replicas))
            a, b = stages[s]
            out[endpoints[dev]] = Assignment(
                epoch=epoch,
                stage=s,
                replica=r,
                n_stages=n_stages,
                n_replicas=n_replicas,
                layers=(a, b),
                group=group,
                coordinator=coordinator,
                prev=endpoints[pipe[s - 1]] if s > 0 else None,
                next=endpoints[pipe[s + 1]] if s < n_stages - 1 else None,
                forward_flops=forward_flops(a, b) if forward_flops else 0.0,
                leader=leader,
                peers=peers,
                plan=plan,
                pipeline=tuple(endpoints[d] for d in pipe),
            ).validate()
    return out
