"""From a plan to what each device does: one :class:`Assignment` per device endpoint.

Production code (the leader role) and the local harness (``peer.emulation``) both turn a plan into
assignments here, so a local run and a real swarm cannot disagree on what a plan means. ``LinkModel`` carries
the emulated link and device figures a worker applies to itself when the run emulates a network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from peer.runtime.spec import Assignment, RunSpec


@dataclass(frozen=True)
class LinkModel:
    """Emulated network and devices: per-pair bandwidth (bit/s) and one-way delay (s), per-device TFLOP/s.

    ``bandwidth_bps[i][j]`` and ``delay_s[i][j]`` describe the directed link i -> j; ``None`` = unshaped.
    """

    bandwidth_bps: Sequence[Sequence[float]] | None = None
    delay_s: Sequence[Sequence[float]] | None = None
    tflops: Sequence[float | None] | None = None


def build_assignments(
    spec: RunSpec,
    stages: Sequence[tuple[int, int]],
    pipelines: Sequence[Sequence[int]],
    endpoints: Sequence[str],
    coordinator: str,
    epoch: int = 1,
    links: LinkModel | None = None,
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
            shaped: dict[str, tuple[float, float]] = {}
            if links is not None and links.bandwidth_bps is not None and links.delay_s is not None:
                for other in {d for p in pipelines for d in p} - {dev}:
                    shaped[endpoints[other]] = (
                        float(links.bandwidth_bps[dev][other]),
                        float(links.delay_s[dev][other]),
                    )
            tflops = (
                None if links is None or links.tflops is None or links.tflops[dev] is None else float(links.tflops[dev])
            )
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
                links=shaped,
                emulate_tflops=tflops,
                forward_flops=forward_flops(a, b) if forward_flops else 0.0,
                leader=leader,
                peers=peers,
                plan=plan,
            ).validate()
    return out
