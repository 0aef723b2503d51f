"""Laggards: replicas that missed a step, and how they get back in sync without holding the step for them.

The live workers of a pipeline dropped from a step without a death (overtaken by a speculative copy, a lease
past its deadline) did not apply it: they are told to reload their stage from a replica that did, and the step
ends without waiting for that (a straggler finishes its slow op first, which would hold the step for it).
Until every member of such a pipeline reports the replica's parameters hash, the pipeline is *syncing*: it
gets no ``start_step``, no lease and no place in a reduce, so a pipeline out of sync never commits work; once
in sync it joins the running step (``start_step`` while the step still computes) or the next one.

After every apply the replicas of a stage are also compared by parameters hash (:func:`judge_stage`). A stage's
parameters change only through the apply every replica computes, or through a reload the leader decided by its
own computation, never by counting reports alone, since two colluders are a majority of three:

* the leader holds a replica of the stage (its own worker): its own apply decides; the others reload from it;
* otherwise the leader fetches the disputed replicas' states and hashes their bytes itself. A replica whose bytes
  do not hash to what it reported lied about its parameters: it is excluded and counts for nothing (so colluders
  that report one false hash neither rewrite the honest replica nor get it excluded for not reaching it). Among
  the rest, a hash that the leader verified and that a strict majority of at least 3 replicas holds is the one the
  others reload (a replica that alone applied something else: a fault, a wrong tied-embedding gradient);
* anything else (two replicas, a tie, verified hashes without such a majority) is **disputed**: nobody is rewritten,
  the stage is logged, emitted (``disputed``) and left out of the hashes the leader signs for the step.

Tests: ``tests/runtime/test_lead_evidence.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tasklet.peer.compute.stage import flat_digest
from tasklet.peer.net.client import PeerClient
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.lead.liveness import Liveness
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.lead.step import Event
from tasklet.peer.timing import CONTROL_TIMEOUT_S, WORKER_FETCH_STATE_TIMEOUT_S
from tasklet.protocol.errors import TransportError

log = logging.getLogger(__name__)

SYNC_LIMIT_S = CONTROL_TIMEOUT_S + WORKER_FETCH_STATE_TIMEOUT_S  # a laggard told to resync reports in sync within this
Hashes = dict[str, tuple[int, str]]  # endpoint -> (trained steps, params hash), as the running step received them
Layers = tuple[int, int]


@dataclass(frozen=True)
class Digests:
    """The parameters hash per stage (layers) the run's replicas agreed on after ``step`` trained steps (or the
    previous leader recorded): a peer's claim to hold a stage at that step must match it."""

    step: int = -1
    by_layers: dict[Layers, str] = field(default_factory=dict)

    def at(self, trained: int) -> dict[Layers, str]:
        """The hashes if they describe ``trained`` steps, else none."""
        return self.by_layers if trained == self.step else {}


def stage_digests(roster: Roster, members: Sequence[str], hashes: Hashes, trained: int) -> dict[Layers, str]:
    """Layers -> the parameters hash a strict majority of the stage's replicas among ``members`` reported at
    ``trained`` steps (a stage without one is left out). The leader signs these in its progress record: a later
    claim to hold the stage at that step must match them (peer.node.leader_role.judge_claims)."""
    votes: dict[Layers, dict[str, int]] = {}
    counts: dict[Layers, int] = {}
    for ep in members:
        a = roster.assignments.get(ep)
        if a is None:
            continue
        counts[a.layers] = counts.get(a.layers, 0) + 1
        seen = hashes.get(ep)
        if seen is not None and seen[0] == trained:
            votes.setdefault(a.layers, {})[seen[1]] = votes.get(a.layers, {}).get(seen[1], 0) + 1
    out = {}
    for layers, tally in votes.items():
        digest, n = max(tally.items(), key=lambda kv: kv[1])
        if 2 * n > counts[layers]:
            out[layers] = digest
    return out


@dataclass(frozen=True)
class StageJudgement:
    """What the leader makes of one stage's replica hashes after an apply (:func:`judge_stage`)."""

    how: str  # "agree", "own" (the leader's replica decided), "majority" (verified), "disputed"
    agreed: tuple[int, str] | None = None  # (trained steps, hash) the stage ends on; None when disputed
    resync: dict[str, str] = field(default_factory=dict)  # endpoint -> the replica it reloads from
    liars: dict[str, str] = field(default_factory=dict)  # endpoint -> why: its bytes are not what it reported
    computed: dict[str, str | None] = field(default_factory=dict)  # endpoint -> the hash the leader computed


def judge_stage(reported: dict[str, tuple[int, str]], own: str | None = None,
                served: Callable[[str], str | None] | None = None) -> StageJudgement:
    """Judge one stage's replicas by their reported ``(trained steps, params hash)`` (module docstring).

    ``own``: the leader's own replica of the stage, if it holds one; ``served(endpoint)``: the hash the leader
    computes from the state that replica serves it (None: it could not be fetched), asked only when the reports
    disagree and the leader holds no replica."""
    values = set(reported.values())
    if len(values) < 2:
        return StageJudgement("agree", next(iter(values), None))
    if own is not None and own in reported:
        truth = reported[own]
        return StageJudgement("own", truth, {ep: own for ep, v in reported.items() if v != truth})
    computed = {ep: served(ep) if served is not None else None for ep in sorted(reported)}
    liars = {ep: f"it reported parameters hashing to {reported[ep][1]}, and served the leader parameters hashing "
                 f"to {h}" for ep, h in computed.items() if h is not None and h != reported[ep][1]}
    rest = {ep: v for ep, v in reported.items() if ep not in liars}
    votes: dict[tuple[int, str], list[str]] = {}
    for ep, v in sorted(rest.items()):
        if computed[ep] == v[1]:  # only a hash the leader computed itself counts
            votes.setdefault(v, []).append(ep)
    if len(set(rest.values())) == 1:  # the liars were the whole disagreement
        return StageJudgement("agree", next(iter(rest.values())), liars=liars, computed=computed)
    if votes:
        value, holders = max(votes.items(), key=lambda kv: len(kv[1]))
        if len(rest) >= 3 and 2 * len(holders) > len(rest):
            return StageJudgement("majority", value, {ep: holders[0] for ep, v in rest.items() if v != value},
                                  liars, computed)
    return StageJudgement("disputed", None, liars=liars, computed=computed)


class Resync:
    """Resyncing replicas that missed a step or diverged (module docstring).

    Given the run's id, the owner's condition ``step_lock`` (it guards the running step's hashes, and is notified
    when a report arrives: a resync waits on it), the liveness (pings, deaths), a client per worker, a way to run
    work in the background and the observer's ``emit``; ``fetch(endpoint)``: a worker's stage state (the leader
    hashes disputed replicas' bytes itself), ``own(endpoint)``: whether that worker is the leader's own. The
    laggards still reloading are its own, under a lock of its own (a leaf: taken under ``step_lock``, never
    the other way round)."""

    def __init__(self, run_id: str, step_lock: threading.Condition, liveness: Liveness,
                 client: Callable[[str], PeerClient], submit: Callable[..., None],
                 emit: Callable[[Sequence[Event]], None], *,
                 fetch: Callable[[str], dict[str, Any]] | None = None,
                 own: Callable[[str], bool] | None = None) -> None:
        self.run_id, self._step_lock, self._liveness = run_id, step_lock, liveness
        self._client, self._submit, self._emit = client, submit, emit
        self._fetch, self._own = fetch, own
        self._lock = threading.Lock()
        # endpoint -> ((trained steps, params hash) it must reach, when told); _lock
        self._pending: dict[str, tuple[tuple[int, str], float]] = {}

    def new_plan(self) -> None:
        """A new plan: its state sources say who holds what, so no laggard is waited for any more."""
        with self._lock:
            self._pending.clear()

    def laggards(self) -> dict[str, tuple[int, str]]:
        """Endpoint -> the (trained steps, params hash) each laggard still reloading must reach (a snapshot)."""
        with self._lock:
            return {ep: target for ep, (target, _) in self._pending.items()}

    def syncing_pipelines(self, roster: Roster, now: float) -> set[int]:
        """Pipelines with a live member still reloading its stage (``step_lock`` held). One that has not reported
        in sync within a control deadline plus a state fetch's is declared dead (it left its pipeline for good)."""
        limit = SYNC_LIMIT_S
        with self._lock:
            for ep, (_, since) in list(self._pending.items()):
                if self._liveness.is_dead(ep) or ep not in roster.assignments:
                    del self._pending[ep]
                elif now - since > limit:
                    del self._pending[ep]
                    self._liveness.mark(ep, f"did not reload its stage within {limit:.0f} s")
            return roster.pipelines_of(self._pending)

    def caught_up(self, roster: Roster, sender: str, msg: ctl.Synced) -> tuple[bool, int | None]:
        """A Synced report: whether it is a laggard's, and the pipeline it completes (every member in sync again:
        it may join the running step), if any. ``step_lock`` held."""
        with self._lock:
            pending = self._pending.get(sender)
            if pending is None:
                return False, None
            if (msg.trained_steps, msg.params_hash) != pending[0]:
                return True, None  # an older resync's answer, or not there yet: still syncing
            del self._pending[sender]
            still = roster.pipelines_of(self._pending)
        log.info("%s reloaded its stage (%d steps)", sender, msg.trained_steps)
        replica = roster.assignments[sender].replica
        return True, None if replica in still else replica

    def in_sync(self) -> bool:
        """No laggard is left reloading."""
        with self._lock:
            return all(self._liveness.is_dead(ep) for ep in self._pending)

    def check_replicas(self, roster: Roster, epoch: int, step: int, members: list[str], hashes: Hashes,
                       deadline: float) -> dict[Layers, str]:
        """After an apply, the replicas of each stage must hold bitwise the same parameters; where they do not,
        :func:`judge_stage` decides (the leader's own replica, or hashes the leader computed from the served
        bytes with a strict majority of at least 3; never a count of reports alone). A replica it names reloads
        the stage, and is excluded if it still differs afterwards; one that lied about its parameters is
        excluded; a disputed stage is logged and emitted. ``hashes``: the step's, filled under ``step_lock`` as
        Synced reports arrive. Returns the hash each undisputed stage's live replicas then agree on
        (:func:`stage_digests`)."""
        with self._step_lock:
            seen = {ep: hashes.get(ep) for ep in members}
        stages = {ep: roster.assignments[ep].stage for ep in members if ep in roster.assignments}
        resyncs: dict[str, tuple[int, str]] = {}
        disputed: set[int] = set()
        for stage in sorted(set(stages.values())):
            reported = {ep: v for ep, s in stages.items() if s == stage and (v := seen.get(ep)) is not None}
            own = next((ep for ep in reported if self._own is not None and self._own(ep)), None)
            j = judge_stage(reported, own, self._served)
            for ep, why in j.liars.items():
                log.error("step %d: %s lied about its stage %d parameters: %s", step, ep, stage, why)
                self._liveness.declare(ep, f"step {step}: {why}")
            if j.how == "agree" and not j.liars:
                continue
            info = {"step": step, "stage": stage, "how": j.how,
                    "reported": {ep: v[1] for ep, v in sorted(reported.items())},
                    "computed": dict(j.computed), "liars": sorted(j.liars)}
            self._emit([("disputed", info)])
            if j.how == "disputed":
                disputed.add(stage)
                log.error("step %d: replicas of stage %d disagree and the leader cannot decide by its own "
                          "computation; nobody is rewritten: %s", step, stage, info)
                self._emit([("divergent", {"step": step, "stage": stage})])
                continue
            for ep, source in j.resync.items():
                log.warning("step %d: %s's stage %d parameters differ from %s's (%s); resyncing from it",
                            step, ep, stage, source, "the leader's own replica" if j.how == "own"
                            else "a strict majority the leader verified")
                resyncs[ep] = (reported[source][0], source)
        self._resync(epoch, step, resyncs, seen, hashes, deadline,
                     f"stage parameters still differ from the decided ones after step {step}")
        with self._step_lock:
            live = [m for m in members if not self._liveness.is_dead(m)]
            digests = stage_digests(roster, live, hashes, step + 1)
        held = {roster.assignments[m].layers for m in members if stages.get(m) in disputed}
        return {layers: h for layers, h in digests.items() if layers not in held}

    def _served(self, endpoint: str) -> str | None:
        """The parameters hash the leader computes from the state ``endpoint`` serves it (None: not fetched)."""
        if self._fetch is None:
            return None
        try:
            return flat_digest(self._fetch(endpoint)["params"])
        except Exception as exc:  # no answer is no evidence either way
            log.warning("fetching %s's stage state to check its parameters failed: %s", endpoint, exc)
            return None

    def catch_up(self, roster: Roster, epoch: int, step: int, members: list[str], left_out: set[int],
                 hashes: Hashes) -> None:
        """Live workers of ``left_out`` pipelines (dropped from the step without a death, or syncing) did not
        apply it: they reload their stage from a replica that did, in the background; their pipelines sync."""
        with self._step_lock:
            laggards = [ep for ep, a in roster.assignments.items()
                        if a.replica in left_out and not self._liveness.is_dead(ep) and ep not in members]
            seen = {ep: hashes.get(ep) for ep in members}
        stage_of = {ep: a.stage for ep, a in roster.assignments.items()}
        resyncs: dict[str, tuple[int, str]] = {}
        for ep in laggards:
            source = next((m for m in members if stage_of.get(m) == stage_of[ep] and seen.get(m)), None)
            if source is None:
                self._liveness.declare(ep, f"missed step {step} and no replica of its stage can hand it over")
                continue
            resyncs[ep] = (seen[source][0], source)  # type: ignore[index]
        if not resyncs:
            return
        log.info("step %d: %s missed the step; reloading from a replica in the background", step, sorted(resyncs))
        with self._lock:
            for ep, (_, source) in resyncs.items():
                self._pending[ep] = (seen[source], time.monotonic())  # type: ignore[assignment]
        self._emit([("resync", {"step": step, "endpoints": sorted(resyncs), "background": True})])
        for ep, (trained, source) in resyncs.items():
            self._submit(self._tell, ep, epoch, step, trained, source)

    def _tell(self, endpoint: str, epoch: int, step: int, trained: int, source: str) -> None:
        """Send one laggard its resync; one that cannot be told is checked for death."""
        try:
            env = ctl.encode(ctl.Resync(step, trained, source), self.run_id, epoch, step)
            self._client(endpoint).push(env, timeout_s=CONTROL_TIMEOUT_S)
        except TransportError as exc:
            self._liveness.confirm(endpoint, f"resync failed: {exc}")

    def _resync(self, epoch: int, step: int, resyncs: dict[str, tuple[int, str]],
                seen: dict[str, Any], hashes: Hashes, deadline: float, failure: str) -> None:
        """Tell each endpoint to reload its stage from ``source`` at ``trained`` steps; wait until its hash is
        the source's; one that does not get there is excluded."""
        if not resyncs:
            return
        with self._step_lock:
            for ep in resyncs:
                hashes.pop(ep, None)
        self._emit([("resync", {"step": step, "endpoints": sorted(resyncs)})])

        def tell(ep: str) -> None:
            # A laggard may be unreachable (partitioned, or dead and not yet noticed): one ping first, so that it
            # costs a ping timeout, not a control deadline; and every laggard at once, never one after another.
            if not self._liveness.alive(ep):
                self._liveness.declare(ep, f"{failure}: it does not answer")
                return
            self._tell(ep, epoch, step, *resyncs[ep])

        with ThreadPoolExecutor(max_workers=min(8, len(resyncs)), thread_name_prefix="resync") as pool:
            list(pool.map(tell, list(resyncs)))
        for ep, (_, source) in resyncs.items():
            good = seen[source]
            with self._step_lock:
                ok = self._step_lock.wait_for(
                    lambda ep=ep, good=good: hashes.get(ep) == good or self._liveness.is_dead(ep),
                    timeout=max(0.0, deadline - time.monotonic()))
                dead = self._liveness.is_dead(ep)
            if not ok or dead:
                self._liveness.declare(ep, failure)
