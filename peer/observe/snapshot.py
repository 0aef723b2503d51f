"""One picture of the swarm as JSON: peers, the plan grid, every measured link, the loss and throughput curves.

This is what the dashboard's ``/api/swarm`` returns (the page draws nothing else). It is built from the same
signed records as `peer status` (adverts, link reports, the plan board, the leader's progress record), read
through a :class:`SwarmSource`: a read-only `peer dashboard` builds one from a ``StatusReader``, a daemon
from its own membership and boards. Plans and progress records are signed by swarm members but still
untrusted input: every field is type-checked and every list bounded before it reaches the page.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.utils import get_dht_time

from tasklet.peer.swarm.adverts import LinkReport, compute_share
from tasklet.peer.swarm.credit import credit_rows
from tasklet.peer.swarm.membership import PeerEntry
from tasklet.peer.swarm.plans import PlanRecord
from tasklet.peer.swarm.status import StatusReader, sync_summary

MAX_HISTORY = 5000  # steps of loss history shown (the leader publishes at most 2000)
MAX_PIPELINES = 256
MAX_STAGES = 256


@dataclass(frozen=True)
class SwarmSource:
    """The reads a snapshot needs; each may hit the DHT (and returns the last good value when it times out)."""

    entries: Callable[[], list[PeerEntry]]
    links: Callable[[], list[LinkReport]]
    plan: Callable[[], PlanRecord | None]
    progress: Callable[[], dict[str, Any] | None]
    run_config: Callable[[], dict[str, Any] | None]
    # who may lead and whether the swarm waits for a steward (peer.swarm.status.StatusReader.leadership)
    leadership: Callable[[], dict[str, Any] | None] = lambda: None

    @classmethod
    def from_reader(cls, reader: StatusReader) -> SwarmSource:
        m = reader.membership
        return cls(reader.live_entries, m.links, reader.latest_plan, reader.read_progress, m.get_run,
                   lambda: reader.leadership(reader.live_entries()))


def _num(value: object) -> float | None:
    """A finite number, else None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object, limit: int = 200) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def tokens_per_step(run_config: dict[str, Any] | None) -> int | None:
    """micro_batch x n_microbatches x seq_len of the published run, or None when the record lacks them."""
    if not isinstance(run_config, dict):
        return None
    run, model = run_config.get("run"), run_config.get("model")
    if not isinstance(run, dict) or not isinstance(model, dict):
        return None
    parts = [_int(run.get("micro_batch")), _int(run.get("n_microbatches")), _int(model.get("seq_len"))]
    if any(p is None or p <= 0 for p in parts):
        return None
    return parts[0] * parts[1] * parts[2]  # type: ignore[operator]


def _plan(record: PlanRecord | None) -> dict[str, Any]:
    if record is None:
        return {"epoch": None, "leader": None, "stages": [], "pipelines": [], "reason": None, "step": None}
    plan = record.plan
    stages = []
    for item in (plan.get("stages") or [])[:MAX_STAGES] if isinstance(plan.get("stages"), list) else []:
        if isinstance(item, list) and len(item) == 2 and all(_int(x) is not None for x in item):
            stages.append([item[0], item[1]])
    pipelines = []
    raw = plan.get("pipelines") if isinstance(plan.get("pipelines"), list) else []
    for pipe in raw[:MAX_PIPELINES]:
        if isinstance(pipe, list):
            pipelines.append([_str(pid, 64) or "?" for pid in pipe[:MAX_STAGES]])
    return {
        "epoch": record.epoch,
        "leader": record.leader_id,
        "stages": stages,
        "pipelines": pipelines,
        "reason": _str(plan.get("reason")),
        "step": _int(plan.get("step")),
    }


def _history(progress: dict[str, Any], per_step: int | None) -> dict[str, list]:
    """Per-step loss, seconds and tokens/s from the history the leader carries in every progress record."""
    hist = progress.get("history")
    out: dict[str, list] = {"step": [], "loss": [], "step_s": [], "tokens_per_s": []}
    if not isinstance(hist, dict):
        return out
    first = _int(hist.get("from")) or 0
    losses = hist.get("loss") if isinstance(hist.get("loss"), list) else []
    secs = hist.get("step_s") if isinstance(hist.get("step_s"), list) else []
    for k, (loss, sec) in enumerate(zip(losses[-MAX_HISTORY:], secs[-MAX_HISTORY:], strict=False)):
        loss_v, sec_v = _num(loss), _num(sec)
        if loss_v is None:
            continue
        out["step"].append(first + max(0, len(losses) - MAX_HISTORY) + k)
        out["loss"].append(loss_v)
        out["step_s"].append(sec_v)
        out["tokens_per_s"].append(round(per_step / sec_v, 1) if per_step and sec_v else None)
    return out


def build_snapshot(source: SwarmSource, run_id: str) -> dict[str, Any]:
    """The whole picture, read now (four or five DHT reads)."""
    now = get_dht_time()
    entries = source.entries()
    links = source.links()
    plan = _plan(source.plan())
    progress = source.progress() or {}
    run_config = source.run_config()
    where: dict[str, tuple[int, int]] = {}
    for r, pipe in enumerate(plan["pipelines"]):
        for s, pid in enumerate(pipe):
            where[pid] = (s, r)
    live = {e.advert.peer_id for e in entries}
    reached: dict[str, int] = {}
    for report in links:
        if report.measured and report.src in live:
            reached[report.dst] = reached.get(report.dst, 0) + 1
    peers = []
    for e in entries:
        a, d = e.advert, e.advert.device
        stage, replica = where.get(a.peer_id, (None, None))
        layers = plan["stages"][stage] if stage is not None and stage < len(plan["stages"]) else None
        peers.append(
            {
                "peer_id": a.peer_id,
                "role": a.role,
                "device": d.name,
                "kind": d.kind,
                "tflops": d.tflops,
                "emulated": d.emulated,
                "memory_gb": round(d.memory_bytes / 1e9, 2),
                "region": _str(a.extra.get("region"), 64),
                "endpoint": a.endpoint,
                "stage": stage,
                "replica": replica,
                "layers": layers,
                "last_seen_s": round(e.last_seen_s(now), 2),
                "reached_by": reached.get(a.peer_id, 0),
                "leader": a.peer_id == plan["leader"],
                "compute_share": compute_share(a.extra),
            }
        )
    link_rows = [
        {
            "src": r.src,
            "dst": r.dst,
            "bandwidth_mbps": round(r.bandwidth_bps / 1e6, 3),
            "rtt_ms": round(r.rtt_s * 1e3, 2),
            "measured": r.measured,
        }
        for r in links
        if r.src in live and r.dst in live
    ]
    run_section = run_config.get("run") if isinstance(run_config, dict) else None
    leadership = source.leadership() or {}
    waiting = _str(leadership.get("waiting"), 200)
    return {
        "run": run_id,
        "time": time.time(),
        "state": "waiting" if waiting else _str(progress.get("state"), 32) or ("forming" if entries else "unknown"),
        "waiting": waiting,
        "step": _int(progress.get("step")),
        "steps": _int(run_section.get("steps")) if isinstance(run_section, dict) else None,
        "loss": _num(progress.get("loss")),
        "tokens_per_s": _num(progress.get("tokens_per_s")),
        "step_s": _num(progress.get("step_s")),
        "peers": peers,
        "plan": plan,
        "links": link_rows,
        "history": _history(progress, tokens_per_step(run_config)),
        "credit": _credit(progress.get("credit")),
        "sync": sync_summary(run_config),
    }


def _credit(record: object) -> list[dict[str, Any]]:
    """The leader's contribution record (``peer.swarm.credit``), checked and bounded like the rest of the page's
    input: one row per identity, most verified micro-batches first."""
    return [{k: row[k] for k in ("peer_id", "microbatches", "steps", "plans", "train_s", "bytes_served",
                                 "excluded", "last_exclusion")} for row in credit_rows(record)]
