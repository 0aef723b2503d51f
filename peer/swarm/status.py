"""`peer status`: join the DHT as a client, read adverts, links, the plan and progress, and show the swarm.

A client node takes no work and announces nothing; it only reads. Everything it shows comes from signed
records (and, with a join secret, MAC-checked ones), so a status screen cannot be spoofed by a peer that
is not part of the swarm; like a peer, it elects the leader from the live records and shows only that
leader's plan and progress (``peer.swarm.plans``, ``peer.swarm.progress``). Nothing it shows holds the
join secret: the run record never carries it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import compute_share
from tasklet.peer.swarm.charter import LeaderPolicy, waiting_line
from tasklet.peer.swarm.credit import credit_rows
from tasklet.peer.swarm.dht import DHTConfig, start_dht
from tasklet.peer.swarm.election import bootstrap_credited, credited_of, elect
from tasklet.peer.swarm.membership import Membership, PeerEntry
from tasklet.peer.swarm.plans import PlanBoard, PlanRecord
from tasklet.peer.swarm.progress import ProgressBoard
from tasklet.peer.timing import now

VIEW_REUSE_S = 1.0


def listen_host(dht_peers: list[str]) -> str:
    """127.0.0.1 when every multiaddr to join is a loopback one, else 0.0.0.0."""
    hosts = [m.split("/")[2] for m in dht_peers if m.count("/") >= 2]
    return "127.0.0.1" if hosts and all(h.startswith("127.") or h == "::1" for h in hosts) else "0.0.0.0"


@dataclass
class SwarmStatus:
    """What `peer status` shows; ``to_json()`` is the documented machine format."""

    peers: list[dict[str, Any]]
    plan: dict[str, Any]
    progress: dict[str, Any]
    links: dict[str, Any]
    leadership: dict[str, Any] | None = None  # the organiser, who may lead, and "waiting" while no steward lives
    sync: dict[str, Any] | None = None  # how replicas synchronise, from the run record (:func:`sync_summary`)

    def to_json(self) -> dict[str, Any]:
        return {
            "peers": self.peers,
            "plan": self.plan,
            "step": self.progress.get("step"),
            "loss": self.progress.get("loss"),
            "tokens_per_s": self.progress.get("tokens_per_s"),
            "state": self.progress.get("state"),
            # why the leader pauses, since and until when (DHT time), or None; work a healed partition discarded
            "paused": self.progress.get("paused"),
            "discarded": self.progress.get("discarded"),
            "links": self.links,
            "credit": credit_summary(self.progress),
            "leadership": self.leadership,
            "sync": self.sync,
        }


class StatusReader:
    """A read-only view of one run in a DHT."""

    def __init__(self, dht_peers: list[str], run_id: str = "tasklet", secret: str | None = None) -> None:
        self.identity = Identity.generate()
        # libp2p dials out from its listen address: a client bound to loopback cannot reach a swarm on another
        # machine, so it listens on every interface unless the swarm it joins is on this machine.
        config = DHTConfig(initial_peers=tuple(dht_peers), host=listen_host(dht_peers), client_mode=True)
        self.dht = start_dht(config, self.identity)
        self.membership = Membership(self.dht, run_id, self.identity, secret)
        self.board = PlanBoard(self.dht, run_id, None, secret, elector=self.elected)
        self.progress = ProgressBoard(self.dht, run_id, None, secret)
        self._view: tuple[float, list[PeerEntry]] = (-1.0, [])
        self._policy: tuple[float, LeaderPolicy | None] = (-1.0, None)
        self.sync: dict[str, Any] | None = None  # from the run record, read with the policy

    def live_entries(self) -> list[PeerEntry]:
        """The live peers; one DHT read serves every caller within ``VIEW_REUSE_S`` (a status screen asks
        for them, the election and the plan and progress filters in quick succession)."""
        at, entries = self._view
        if time.monotonic() - at > VIEW_REUSE_S:
            entries = self.membership.live_entries()
            self._view = (time.monotonic(), entries)
        return list(entries)

    def elected(self) -> str | None:
        """The leader as elected from the live records now, with the testimony of the credited peers only
        (those of the plan followed, before any: of the newest self-consistent plan; ``peer.swarm.election``)."""
        entries = self.live_entries()
        followed = self.board.followed()
        credited = credited_of(followed.plan) if followed is not None else bootstrap_credited(
            entries, [(p.leader_id, p.plan) for p in self.board.plans()])
        return elect(entries, credited, self.policy(), followed.leader_id if followed is not None else None)

    def policy(self) -> LeaderPolicy | None:
        """Who may lead, from the organiser's signed run record and stewards records (read at most every few
        seconds; None while no run record is readable)."""
        at, policy = self._policy
        if time.monotonic() - at > VIEW_REUSE_S * 5:
            record = self.membership.get_run_record()
            if record is not None:
                swarm = record.config.get("swarm")
                leaders = swarm.get("leaders") if isinstance(swarm, dict) else None
                added = self.membership.read_stewards(record.organiser) or ()
                policy = LeaderPolicy.from_record(record.organiser, leaders, added)
                self.sync = sync_summary(record.config)
            self._policy = (time.monotonic(), policy)
        return policy

    def leadership(self, entries: list[PeerEntry]) -> dict[str, Any] | None:
        policy = self.policy()
        if policy is None:
            return None
        live = {e.advert.peer_id for e in entries if e.advert.role == "worker"}
        waiting = not policy.any and bool(live) and not live & set(policy.stewards)
        return {"organiser": policy.organiser, "leaders": "any" if policy.any else list(policy.stewards),
                "live_stewards": sorted(live & set(policy.stewards)),
                "waiting": waiting_line(policy) if waiting else None}

    def latest_plan(self) -> PlanRecord | None:
        return self.board.latest()

    def read_progress(self) -> dict[str, Any] | None:
        """Progress of the leader of the plan followed (before any plan: of the elected leader)."""
        plan = self.board.latest()
        return self.progress.read(plan.leader_id if plan is not None else self.elected())

    def close(self) -> None:
        self.dht.shutdown()

    def __enter__(self) -> StatusReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> SwarmStatus:
        at = now()
        entries = self.live_entries()
        latest = self.board.latest()
        plan = latest.plan if latest else {}
        where: dict[str, tuple[int, int]] = {}
        for r, pipe in enumerate(plan.get("pipelines", [])):
            for s, pid in enumerate(pipe):
                where[pid] = (s, r)
        links = self.membership.links()
        inbound: dict[str, set[str]] = {}  # peer id -> how the others' probes reached it
        for r in links:
            if r.measured:
                inbound.setdefault(r.dst, set()).add(r.path)
        peers = []
        for e in entries:
            a = e.advert
            stage, replica = where.get(a.peer_id, (None, None))
            peers.append(
                {
                    "peer_id": a.peer_id,
                    "device": a.device.name,
                    "tflops": a.device.tflops,
                    "emulated": a.device.emulated,
                    "memory_gb": round(a.device.memory_bytes / 1e9, 2),
                    "stage": stage,
                    "replica": replica,
                    "last_seen_s": round(e.last_seen_s(at), 2),
                    "endpoint": a.endpoint,
                    "region": a.extra.get("region"),
                    "reachable": a.reachable,
                    "relay": a.relay or None,
                    "paths": sorted(inbound.get(a.peer_id, ())),
                    "compute_share": compute_share(a.extra),
                }
            )
        bws = [r.bandwidth_bps for r in links if r.measured]
        rtts = [r.rtt_s for r in links if r.measured]
        link_summary = {
            "measured": len(bws),
            "pairs": len(entries) * max(0, len(entries) - 1),
            "median_bandwidth_mbps": round(statistics.median(bws) / 1e6, 2) if bws else None,
            "median_rtt_ms": round(statistics.median(rtts) * 1e3, 2) if rtts else None,
            "by_path": _by_path(links),
        }
        plan_out = {
            "epoch": latest.epoch if latest else None,
            "leader": latest.leader_id if latest else None,
            "pipelines": plan.get("pipelines"),
            "stages": plan.get("stages"),
        }
        progress = self.progress.read(latest.leader_id if latest is not None else self.elected())
        elected = self.elected()
        if latest is not None and elected not in (None, latest.leader_id):
            # a new leader that has not planned yet (taking over, or paused without a quorum) says why
            newer = self.progress.read(elected)
            if newer and newer.get("state") == "paused":
                progress = newer
        credited = {row["peer_id"]: row["microbatches"] for row in credit_rows((progress or {}).get("credit"))}
        for peer in peers:  # each live peer's verified micro-batches, from the leader's signed record
            peer["credit_microbatches"] = credited.get(peer["peer_id"], 0)
        return SwarmStatus(peers, plan_out, progress or {}, link_summary, self.leadership(entries), self.sync)


def sync_summary(run_config: object) -> dict[str, Any] | None:
    """How the run's replicas synchronise, from its record's ``run`` section: ``{"period": H, "codec": C,
    "overlap": bool}`` (period 1: exact averaging every step, codec None, no overlap; ``overlap``: the outer round
    lands one inner step late, hidden behind it); None when the record lacks it or holds a value of another type."""
    run = run_config.get("run") if isinstance(run_config, dict) else None
    if not isinstance(run, dict):
        return None
    period = run.get("sync_period", 1)
    codec = run.get("pseudo_grad_compression", "none")
    overlap = run.get("outer_overlap", False)
    if isinstance(period, bool) or not isinstance(period, int) or period < 1 or not isinstance(codec, str) \
            or not isinstance(overlap, bool):
        return None
    return {"period": period, "codec": None if period == 1 else codec[:16], "overlap": overlap and period > 1}


def sync_line(sync: dict[str, Any]) -> str:
    """``sync_summary`` in words."""
    if sync["period"] == 1:
        return "sync: exact gradient averaging every step"
    codec = "fp32" if sync["codec"] == "none" else sync["codec"]
    overlap = "landing one step late, behind compute" if sync["overlap"] else "not overlapped"
    return f"sync: DiLoCo, outer round every {sync['period']} steps, {inert(codec)} pseudo-gradients, {overlap}"


def _by_path(links: list) -> dict[str, dict[str, Any]]:
    """Measured links grouped by path kind (direct, reversed, relayed, punched): count, median Mbit/s and RTT."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.path for r in links if r.measured}):
        group = [r for r in links if r.measured and r.path == kind]
        out[kind] = {
            "links": len(group),
            "median_bandwidth_mbps": round(statistics.median(r.bandwidth_bps for r in group) / 1e6, 2),
            "median_rtt_ms": round(statistics.median(r.rtt_s for r in group) * 1e3, 2),
        }
    return out


def inert(text: str) -> str:
    """``text`` with every control or format character (escape sequences, newlines, bidi overrides) shown as a
    ``\\xNN`` / ``\\uNNNN`` escape: adverts, plans and reasons are other peers' words, printed on the reader's
    terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def format_status(st: SwarmStatus) -> str:
    """A readable screen: progress, plan, then one line per peer."""
    p, plan = st.progress, st.plan
    lines = []
    loss = p.get("loss")
    lines.append(
        f"run: step {p.get('step', '-')}, loss {loss:.4f}"
        if isinstance(loss, float)
        else f"run: step {p.get('step', '-')}, loss -"
    )
    if p.get("tokens_per_s"):
        lines[-1] += f", {p['tokens_per_s']:.0f} tokens/s, {p.get('step_s', 0):.2f} s/step"
    lines[-1] += f" ({p.get('state', 'forming')})"
    if st.leadership and st.leadership.get("waiting"):
        lines.append(str(st.leadership["waiting"]))
    paused = p.get("paused")
    if isinstance(paused, dict):
        lines.append(_paused_line(paused))
    discarded = p.get("discarded")
    if isinstance(discarded, dict):
        lines.append(f"healed partition: discarded {discarded.get('steps')} step(s) of the side of "
                     f"{str(discarded.get('leader'))[:12]} (plan epoch {discarded.get('epoch')}, step "
                     f"{discarded.get('step')}); kept epoch {discarded.get('kept_epoch')}, "
                     f"step {discarded.get('kept_step')}")
    if st.sync:
        lines.append(sync_line(st.sync))
    lines.append(
        f"plan: epoch {plan.get('epoch')}, leader {str(plan.get('leader'))[:12]}, "
        f"{len(plan.get('pipelines') or [])} pipeline(s) x {len(plan.get('stages') or [])} stage(s)"
    )
    lk = st.links
    lines.append(
        f"links: {lk['measured']}/{lk['pairs']} measured, median {lk['median_bandwidth_mbps']} Mbit/s, "
        f"median RTT {lk['median_rtt_ms']} ms"
    )
    if len(lk.get("by_path") or {}) > 1 or set(lk.get("by_path") or {}) - {"direct"}:
        lines.append("paths: " + ", ".join(
            f"{kind} {v['links']} ({v['median_bandwidth_mbps']} Mbit/s, {v['median_rtt_ms']} ms)"
            for kind, v in lk["by_path"].items()))
    lines.append(f"{'peer':<14}{'device':<22}{'TFLOP/s':>9}  {'stage':>5} {'repl':>4}  {'seen':>6}  "
                 f"{'credit':>7}  {'busy':>5}  {'reached':<22}region")
    for peer in st.peers:
        tf = f"{peer['tflops']:.4g}" + ("*" if peer["emulated"] else "")
        stage = "-" if peer["stage"] is None else str(peer["stage"])
        rep = "-" if peer["replica"] is None else str(peer["replica"])
        share = peer.get("compute_share")
        busy = "-" if share is None else f"{share:.0%}"
        lines.append(
            f"{peer['peer_id'][:12]:<14}{peer['device'][:21]:<22}{tf:>9}  {stage:>5} {rep:>4}  "
            f"{peer['last_seen_s']:>5.1f}s  {peer.get('credit_microbatches', 0):>7}  {busy:>5}  {_reached(peer):<22}"
            f"{peer['region'] or '-'}"
        )
    if any(peer["emulated"] for peer in st.peers):
        lines.append("* emulated TFLOP/s")
    lines.append("credit: verified micro-batches in the leader's signed record (`peer credits` lists every identity)")
    return "\n".join(inert(line) for line in lines)


def credit_summary(progress: dict[str, Any]) -> dict[str, Any]:
    """The contribution record of a progress record, checked (``peer.swarm.credit``): per identity, most credited
    first, and the run's totals. What `peer status --json` and `peer credits --json` print."""
    record = progress.get("credit")
    rows = credit_rows(record)
    totals = record if isinstance(record, dict) else {}

    def count(key: str) -> int:
        value = totals.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

    return {"leader": progress.get("leader"), "step": progress.get("step"), "peers": rows,
            "total_microbatches": count("total_microbatches"), "steps": count("steps"),
            "evicted_microbatches": count("evicted_microbatches")}


def format_credits(summary: dict[str, Any], me: str | None = None) -> str:
    """The contribution record as a table (only ``me``'s row when given): verified micro-batches, their share of
    all credited work, steps, plans, training seconds, activation bytes served, exclusions and the last one's reason."""
    rows = summary["peers"]
    credited = sum(r["microbatches"] for r in rows) + summary["evicted_microbatches"]
    lines = [f"credit signed by leader {str(summary.get('leader'))[:12]} at step {summary.get('step')}: "
             f"{summary['total_microbatches']} micro-batches in {summary['steps']} applied steps, "
             f"{len(rows)} identities"]
    if me is not None:
        rows = [r for r in rows if r["peer_id"] == me]
        if not rows:
            return "\n".join(inert(line) for line in
                             [*lines, f"{me[:46]}: no credit in the record (no verified work yet, or not this run)"])
    lines.append(f"{'peer':<48}{'micro-batches':>14}{'share':>8}{'steps':>7}{'plans':>7}{'train s':>10}"
                 f"{'served MB':>11}{'excluded':>10}  last exclusion")
    for r in rows:
        share = f"{100 * r['microbatches'] / credited:.1f}%" if credited else "-"
        lines.append(f"{r['peer_id'][:46]:<48}{r['microbatches']:>14}{share:>8}{r['steps']:>7}{r['plans']:>7}"
                     f"{r['train_s']:>10.1f}{r['bytes_served'] / 1e6:>11.1f}{r['excluded']:>10}  "
                     f"{r['last_exclusion'] or '-'}")
    return "\n".join(inert(line) for line in lines)


def _paused_line(paused: dict[str, Any]) -> str:
    """Why the swarm is paused, since when and when it goes on by itself (``[swarm] quorum_wait_s``)."""
    at = now()
    since, until = paused.get("since"), paused.get("until")
    ago = f"{at - since:.0f} s ago" if isinstance(since, (int, float)) else "?"
    if not isinstance(until, (int, float)):  # waiting for enough peers to hold the stages: no deadline
        return f"paused {ago}: {paused.get('reason', '?')}; continues when enough peers are live"
    left = max(0.0, until - at)
    return f"paused {ago}: {paused.get('reason', '?')}; continues with the peers present in {left:.0f} s"


def _reached(peer: dict[str, Any]) -> str:
    """How the others reach a peer: its measured paths (direct / reversed / relayed), '-' before any probe;
    a peer behind NAT is marked 'nat:'."""
    paths = "/".join(peer.get("paths") or []) or "-"
    return paths if peer.get("reachable", True) else f"nat:{paths}"


def status_json(st: SwarmStatus) -> str:
    return json.dumps(st.to_json(), indent=1)
