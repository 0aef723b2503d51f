"""Laggards: replicas that missed a step, and how they get back in sync without holding the step for them.

The live workers of a pipeline dropped from a step without a death (overtaken by a speculative copy, a lease
past its deadline) did not apply it: they are told to reload their stage from a replica that did, and the step
ends without waiting for that (a straggler finishes its slow op first, which would hold the step for it).
Until every member of such a pipeline reports the replica's parameters hash, the pipeline is *syncing*: it
gets no ``start_step``, no lease and no place in a reduce, so a pipeline out of sync never commits work; once
in sync it joins the running step (``start_step`` while the step still computes) or the next one.

After every apply the replicas of a stage are also compared by parameters hash: one that differs from its
group's strict majority reloads from the majority, and is excluded if it still differs.

:class:`LaggardSync` is a part of :class:`peer.runtime.lead.coordinator.Coordinator` (a mixin), split off so that
each module reads in one sitting; it uses the coordinator's lock, assignments, dead set and clients.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from peer.runtime import control as ctl
from peer.runtime.lead.step import StepPhase, StepState
from peer.runtime.spec import Assignment, RunSpec
from peer.timing import CONTROL_TIMEOUT_S, WORKER_FETCH_STATE_TIMEOUT_S
from protocol.errors import TransportError

log = logging.getLogger(__name__)


class LaggardSync:
    """Resyncing replicas that missed a step or diverged (module docstring). The attributes declared here are
    the coordinator's, as are the methods it calls without defining them (``_client``, ``_submit``, ``_emit``,
    ``_alive``, ``declare_dead``, ``_confirm_death``, ``_members``, ``_broadcast_quietly``, ``dead``)."""

    spec: RunSpec
    epoch: int
    assignments: dict[str, Assignment]
    dead_reasons: dict[str, str]
    _cond: threading.Condition
    _dead: set[str]
    _state: StepState | None
    # endpoint -> ((trained steps, params hash) it must reach, when told); guarded by _cond
    _pending_sync: dict[str, tuple[tuple[int, str], float]]

    def _check_replicas(self, state: StepState, step: int, members: list[str], deadline: float) -> None:
        """After an apply, the replicas of each stage must hold bitwise the same parameters. A replica whose
        hash differs from its group's strict majority reloads the stage from a replica in the majority; one
        that still differs afterwards is excluded. Without a strict majority (two replicas disagreeing) the
        coordinator cannot tell who is right: it logs the divergence and goes on."""
        with self._cond:
            hashes = {ep: state.hashes.get(ep) for ep in members}
            stages = {ep: self.assignments[ep].stage for ep in members if ep in self.assignments}
        resyncs: dict[str, tuple[int, str]] = {}
        for stage in sorted(set(stages.values())):
            group = [ep for ep, s in stages.items() if s == stage and hashes.get(ep) is not None]
            votes: dict[tuple[int, str], list[str]] = {}
            for ep in group:
                votes.setdefault(hashes[ep], []).append(ep)  # type: ignore[arg-type]
            if len(votes) < 2:
                continue
            winner, holders = max(votes.items(), key=lambda kv: len(kv[1]))
            if 2 * len(holders) <= len(group):
                log.error("step %d: replicas of stage %d disagree with no majority: %s", step, stage, votes)
                self._emit([("divergent", {"step": step, "stage": stage})])
                continue
            for ep in group:
                if hashes[ep] != winner:
                    log.warning("step %d: %s's stage %d parameters differ from the majority's; resyncing from %s",
                                step, ep, stage, holders[0])
                    resyncs[ep] = (winner[0], holders[0])
        self._resync(state, step, resyncs, hashes, deadline, "stage parameters still differ from the group's "
                     f"majority after step {step}")

    def _catch_up(self, state: StepState, step: int, members: list[str]) -> None:
        """Live workers of pipelines dropped from the step without a death (overtaken by a speculative copy, a
        lease past its deadline), or that sat it out syncing, did not apply it: they reload their stage from a
        replica that did, in the background (module docstring, "Laggards"); their pipelines sync meanwhile."""
        with self._cond:
            left_out = state.dropped | state.syncing
            laggards = [ep for ep, a in self.assignments.items()
                        if a.replica in left_out and ep not in self._dead and ep not in members]
            hashes = {ep: state.hashes.get(ep) for ep in members}
            stage_of = {ep: a.stage for ep, a in self.assignments.items()}
            epoch = self.epoch
        resyncs: dict[str, tuple[int, str]] = {}
        for ep in laggards:
            source = next((m for m in members if stage_of.get(m) == stage_of[ep] and hashes.get(m)), None)
            if source is None:
                self.declare_dead(ep, f"missed step {step} and no replica of its stage can hand it over")
                continue
            resyncs[ep] = (hashes[source][0], source)  # type: ignore[index]
        if not resyncs:
            return
        log.info("step %d: %s missed the step; reloading from a replica in the background", step, sorted(resyncs))
        with self._cond:
            for ep, (_, source) in resyncs.items():
                self._pending_sync[ep] = (hashes[source], time.monotonic())  # type: ignore[assignment]
        self._emit([("resync", {"step": step, "endpoints": sorted(resyncs), "background": True})])
        for ep, (trained, source) in resyncs.items():
            self._submit(self._tell_resync, ep, epoch, step, trained, source)

    def _tell_resync(self, endpoint: str, epoch: int, step: int, trained: int, source: str) -> None:
        """Send one laggard its resync (background); one that cannot be told is checked for death."""
        try:
            env = ctl.encode(ctl.Resync(step, trained, source), self.spec.run_id, epoch, step)
            self._client(endpoint).push(env, timeout_s=CONTROL_TIMEOUT_S)
        except TransportError as exc:
            self._confirm_death(endpoint, f"resync failed: {exc}")

    def _syncing_pipelines(self) -> set[int]:
        """Pipelines with a live member still reloading its stage (``_cond`` held). One that has not reported in
        sync within a control deadline plus a state fetch's is declared dead (it left its pipeline for good)."""
        now, limit = time.monotonic(), CONTROL_TIMEOUT_S + WORKER_FETCH_STATE_TIMEOUT_S
        for ep, (_, since) in list(self._pending_sync.items()):
            if ep in self._dead or ep not in self.assignments:
                del self._pending_sync[ep]
            elif now - since > limit:
                del self._pending_sync[ep]
                self._dead.add(ep)
                self.dead_reasons[ep] = f"did not reload its stage within {limit:.0f} s"
                log.warning("worker %s declared dead: %s", ep, self.dead_reasons[ep])
        return {self.assignments[ep].replica for ep in self._pending_sync}

    def _on_caught_up(self, sender: str | None, msg: ctl.Synced) -> bool:
        """A Synced report of a laggard: in sync when its hash is the one it was told to reach. Its pipeline
        joins the running step once no member is left syncing (``start_step`` first, then no longer left out).
        False: not a laggard's report (the step's own handling applies)."""
        with self._cond:
            pending = self._pending_sync.get(sender or "")
            if pending is None:
                return False
            if (msg.trained_steps, msg.params_hash) != pending[0]:
                return True  # an older resync's answer, or not there yet: still syncing
            del self._pending_sync[sender]  # type: ignore[arg-type]
            replica = self.assignments[sender].replica  # type: ignore[index]
            state = self._state
            still = {self.assignments[ep].replica for ep in self._pending_sync}
            rejoin = (state is not None and replica in state.syncing and replica not in still
                      and state.phase is StepPhase.COMPUTE)
            log.info("%s reloaded its stage (%d steps)", sender, msg.trained_steps)
            self._cond.notify_all()
        if rejoin and state is not None:
            self._submit(self._rejoin, state, replica)
        return True

    def _rejoin(self, state: StepState, replica: int) -> None:
        """Start the running step on a pipeline that is in sync again; it leases only once every member has the
        step (a reduce sent before would be dropped by a member still in the step before)."""
        with self._cond:
            if self._state is not state or state.phase is not StepPhase.COMPUTE:
                return
            step, rnd = state.pool.step, state.round
        members = self._members([replica])
        self._broadcast_quietly(members, ctl.StartStep(step, rnd), step)  # every member has the step first
        with self._cond:
            if self._state is not state or state.phase is not StepPhase.COMPUTE or state.round != rnd:
                return  # too late for this step: it joins the next one
            state.syncing.discard(replica)
        firsts = [ep for ep in members if self.assignments[ep].is_first]
        self._broadcast_quietly(firsts, ctl.StartStep(step, rnd, feed=True), step)
        log.info("step %d: pipeline %d is in sync again and joins the step", step, replica)

    def wait_in_sync(self, timeout_s: float = CONTROL_TIMEOUT_S + WORKER_FETCH_STATE_TIMEOUT_S) -> bool:
        """Wait until no laggard is left reloading its stage (the end of a run, before its states are read)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_sync or all(ep in self._dead
                                                                            for ep in self._pending_sync),
                                       timeout=timeout_s)

    def _resync(self, state: StepState, step: int, resyncs: dict[str, tuple[int, str]],
                hashes: dict[str, tuple[int, str] | None], deadline: float, failure: str) -> None:
        """Tell each endpoint to reload its stage from ``source`` at ``trained`` steps; wait until its hash is
        the source's; one that does not get there is excluded."""
        if not resyncs:
            return
        with self._cond:
            for ep in resyncs:
                state.hashes.pop(ep, None)
            epoch = self.epoch
        self._emit([("resync", {"step": step, "endpoints": sorted(resyncs)})])

        def tell(ep: str) -> None:
            # A laggard may be unreachable (partitioned, or dead and not yet noticed): one ping first, so that it
            # costs a ping timeout, not a control deadline; and every laggard at once, never one after another.
            if not self._alive(ep):
                self.declare_dead(ep, f"{failure}: it does not answer")
                return
            trained, source = resyncs[ep]
            try:
                env = ctl.encode(ctl.Resync(step, trained, source), self.spec.run_id, epoch, step)
                self._client(ep).push(env, timeout_s=CONTROL_TIMEOUT_S)
            except TransportError as exc:
                self._confirm_death(ep, f"resync failed: {exc}")

        with ThreadPoolExecutor(max_workers=min(8, len(resyncs)), thread_name_prefix="resync") as pool:
            list(pool.map(tell, list(resyncs)))
        for ep, (_, source) in resyncs.items():
            good = hashes[source]
            with self._cond:
                ok = self._cond.wait_for(lambda ep=ep, good=good: state.hashes.get(ep) == good or ep in self._dead,
                                         timeout=max(0.0, deadline - time.monotonic()))
            if not ok or ep in self.dead:
                self.declare_dead(ep, failure)
