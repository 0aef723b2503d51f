"""Checkpoints, and where a lost stage's state comes back from when no live replica holds it.

The leader writes a checkpoint every ``checkpoint_every`` steps (and on request): it fetches each stage's state
from one replica whose parameters hash to what the replicas agreed on, writes it durably through
:class:`peer.runtime.checkpoints.CheckpointStore` (fsynced, checksummed, atomic ``latest``, the newest
``checkpoint_keep`` kept, and the one a roll-back for unverified work would need), and copies it to
``checkpoint_copies`` other peers in the background. A failure is logged and counted, never fatal.

A roll-back or a resume takes the newest checkpoint that verifies, this leader's own or a copy a live peer holds.
A peer's copy is a claim: its step must not pass the step the run's leader recorded, its manifest must be the one
the leader signed (before any byte of it is deserialised) and its stages must hash to what the leader recorded.
:class:`Recovery` owns all of that: the store, the checkpoint found and not yet loaded, and the hashes and
manifests of the newest checkpoints the leader signs in its progress record (a new leader inherits its
predecessor's, :class:`Inherited`).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasklet.peer.compute.stage import flat_digest
from tasklet.peer.runtime.checkpoints import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    sha256_of,
    store_copy,
)
from tasklet.peer.runtime.lead.coordinator import Coordinator
from tasklet.peer.runtime.lead.resync import Digests
from tasklet.peer.runtime.lead.step import StepFailedError
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.timing import COPY_TIMEOUT_S

log = logging.getLogger(__name__)

KEPT_DIGESTS = 4  # checkpoints whose stage hashes the leader keeps and signs in its progress record

Stages = list[tuple[int, int]]
# live_states(at_step=, accept=) -> (stage, replica) -> state: the coordinator's
LiveStates = Callable[..., dict[tuple[int, int], dict[str, Any]]]


@dataclass
class RunEvents:
    """What happened during a run, for logs, status and benchmarks."""

    replans: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_errors: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: dict[str, Any] | None = None  # the checkpoint a resume used, and the newer ones it skipped
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # slow workers reported to the planner
    copies: list[dict[str, Any]] = field(default_factory=list)  # checkpoint copies sent: step, peers, errors
    fetched_copy: dict[str, Any] | None = None  # a checkpoint this leader fetched from a peer (its disk had none)

    def resumed(self, step: int, skipped_damaged: list[int]) -> None:
        """A resume started from the checkpoint of ``step``, passing over the damaged newer ones."""
        self.resumed_from = {"step": step, "skipped_damaged": skipped_damaged}

    def fetched(self, step: int, source: str) -> None:
        """This leader uses the checkpoint copy of ``step`` it fetched from ``source``."""
        self.fetched_copy = {"step": step, "from": source}


@dataclass(frozen=True)
class Inherited:
    """What the run's previous leader signed in its progress record, which a new leadership starts from: the step it
    recorded (no checkpoint copy a peer offers is believed beyond it), the stage hashes it signed for the step a
    takeover starts from (a holder's claim must match them), and its newest checkpoints' stage hashes and
    manifests (a copy must match them)."""

    step: int | None = None
    digests: Digests = field(default_factory=Digests)
    checkpoint_digests: dict[int, dict[tuple[int, int], str]] = field(default_factory=dict)
    checkpoint_manifests: dict[int, str] = field(default_factory=dict)



class Recovery:
    """A run's checkpoints and its roll-back points (module docstring). ``coordinator``: the plan's workers, their
    states and copies; ``peers()``: the live peers that may hold a copy; ``earliest_unverified()``: the first step
    of unverified work a live worker applied (its checkpoint is kept); ``events``: the run's record."""

    def __init__(self, spec: RunSpec, coordinator: Coordinator, store: CheckpointStore | None, copies: int,
                 events: RunEvents, inherited: Inherited, peers: Callable[[], list[str]],
                 earliest_unverified: Callable[[], int | None]) -> None:
        self.spec, self.coordinator, self.store, self.copies = spec, coordinator, store, copies
        self.events, self._peers, self._earliest_unverified = events, peers, earliest_unverified
        # the step the run's leader last recorded and signed (a new leader reads it from its predecessor's progress
        # record): no checkpoint copy a peer offers is believed beyond it
        self.recorded_step: int | None = inherited.step
        # step -> the stage hashes of the checkpoints written (or the previous leader recorded): a copy must match
        self.checkpoint_digests: dict[int, dict[tuple[int, int], str]] = dict(inherited.checkpoint_digests)
        self.checkpoint_manifests: dict[int, str] = dict(inherited.checkpoint_manifests)  # step -> manifest sha256
        self._found: Checkpoint | None = None  # the checkpoint latest() verified, until loaded
        self._replicating: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- writing
    def write(self, step: int, stages: Stages, digests: Digests) -> Path | None:
        """Write every stage's state at ``step`` (one replica each); return the folder (None: no checkpoint folder,
        or it failed: logged and counted in ``events.checkpoint_errors``, never fatal)."""
        if self.store is None or not stages:
            return None
        try:
            states = _every_stage(verified_states(self.coordinator.live_states, stages, digests, step), stages, step)
            meta = {"run": self.spec.to_dict(), "stages": stages, "step": step}
            # the checkpoint a roll-back for a live worker's unverified work would need is kept (one at most)
            self.store.keep_for_rollback(self._earliest_unverified())
            step_dir = self.store.write(step, {stage: st for (stage, _), st in states.items()}, meta)
        except Exception as exc:  # a checkpoint error must not kill the leader
            log.error("checkpoint of step %d failed: %s", step, exc)
            self.events.checkpoint_errors.append({"step": step, "error": str(exc)[:500]})
            return None
        self.events.checkpoints.append(step)
        if stage_digests := digests.at(step):  # the newest few, for the progress record
            self.checkpoint_digests = _newest(self.checkpoint_digests, step, stage_digests)
        self.checkpoint_manifests = _newest(self.checkpoint_manifests, step, _manifest_of(step_dir))
        log.info("checkpoint of step %d written to %s", step, step_dir)
        if self.copies > 0:
            self._replicate(step)
        return step_dir

    def _replicate(self, step: int) -> None:
        """Copy the checkpoint of ``step`` to ``copies`` peers in the background (:func:`_send_copies`)."""
        assert self.store is not None
        self._replicating = threading.Thread(
            target=_send_copies, name=f"copy-{step}", daemon=True,
            args=(self.coordinator, self.store, step, self.copies, self._replicating, self.events.copies))
        self._replicating.start()

    def wait_for_copies(self, timeout_s: float | None = None) -> None:
        """Wait until the last checkpoint's copies were sent (tests; a leader leaving gracefully)."""
        if self._replicating is not None:
            self._replicating.join(timeout_s)

    # ------------------------------------------------------------------------------------------- reading
    def latest(self, ask_peers: bool = False, at_most: int | None = None) -> int | None:
        """The step of the newest checkpoint that verifies (damaged newer ones are skipped, and logged), of at
        most ``at_most`` (a roll-back's: the trained step), else of at most the step the run recorded.
        ``ask_peers``: also the newest copy live peers hold, when newer than this disk's (a new leader on another
        host, or one whose disk was lost)."""
        at_most = self.recorded_step if at_most is None else at_most
        ckpt = None if self.store is None else self.store.newest_valid(at_most)
        if ask_peers:
            fetched = self._fetch_copy(newer_than=-1 if ckpt is None else ckpt.step, at_most=at_most)
            if fetched is not None:
                ckpt = fetched
        if ckpt is None:
            return None
        self._found = ckpt
        return ckpt.step

    def skipped(self) -> list[int]:
        """The damaged checkpoints newer than the one :meth:`latest` found."""
        return [] if self._found is None else [s for s, _ in self._found.skipped]

    def rollback_point(self, at_most: int) -> int:
        """Where a roll-back goes: the newest verified checkpoint (a peer's copy too) of at most ``at_most``, else 0
        (every peer rebuilds step 0 from the seed: :meth:`seeded`)."""
        self._found = None
        return self.latest(ask_peers=True, at_most=at_most) or 0

    def seeded(self, step: int) -> bool:
        """A roll-back to ``step`` starts from the seeded initial state: step 0, and no checkpoint of it found."""
        return step == 0 and self._found is None

    def load(self, step: int, stages: Stages | None) -> Stages:
        """Read the checkpoint of ``step`` and let the coordinator serve it to the workers that will fetch it; its
        stages (which must be the run's ``stages``, when known)."""
        if self._found is not None and self._found.step == step:
            ckpt = self._found
        else:
            assert self.store is not None
            ckpt = self.store.load(step)
        self._found = None
        where = f"of step {step}"
        if ckpt.meta.get("run") != self.spec.to_dict():
            raise StepFailedError(f"checkpoint {where} belongs to a different run configuration")
        found = [tuple(x) for x in ckpt.meta["stages"]]
        if stages is not None and found != stages:
            raise StepFailedError(f"checkpoint {where} has stages {found}, the run has {stages}")
        self.coordinator.serve_checkpoint(ckpt.states)
        return found  # type: ignore[return-value]

    def _fetch_copy(self, newer_than: int, at_most: int | None = None) -> Checkpoint | None:
        """The newest checkpoint copy of this run among live peers (verified), if newer than ``newer_than``;
        stored on this leader's disk when it has a checkpoint folder. A peer's step is a claim: one beyond
        ``at_most`` (the run's recorded step, or the step a roll-back starts from) is not fetched."""
        steps: list[tuple[int, str]] = []
        for ep in self._peers():
            try:
                steps.append((self.coordinator.checkpoint_step(ep), ep))
            except Exception as exc:  # no copy there, or unreachable
                log.info("no checkpoint copy on %s: %s", ep, exc)
        for step, ep in sorted(steps, key=lambda x: (-x[0], x[1])):  # the newest first; fetch only what is used
            if at_most is not None and step > at_most:
                log.warning("%s offers a checkpoint copy of step %d, beyond step %d the run recorded; not used",
                            ep, step, at_most)
                continue
            if step <= newer_than:
                return None
            try:
                got, files = self.coordinator.fetch_checkpoint(ep)
            except Exception as exc:
                log.warning("fetching the checkpoint copy of step %d from %s failed: %s", step, ep, exc)
                continue
            if got != step:
                log.warning("%s offered a checkpoint copy of step %d and sent one of step %d; not used", ep, step, got)
                continue
            ckpt = self.store_fetched(got, files, ep) if got > newer_than else None
            if ckpt is not None:
                return ckpt
        return None

    def store_fetched(self, step: int, files: dict[str, bytes], source: str) -> Checkpoint | None:
        """Verify a fetched copy (and keep it on this leader's disk when it has a checkpoint folder)."""
        with tempfile.TemporaryDirectory(prefix="tasklet-copy-") as tmp:
            try:  # verified apart first: a copy that fails never lands among this disk's checkpoints
                _match_manifest(files, self.checkpoint_manifests.get(step))
                store_copy(CheckpointStore(Path(tmp)), step, files)
                ckpt = CheckpointStore(Path(tmp)).load(step)
                _match_digests(ckpt, self.checkpoint_digests.get(step, {}))
                if self.store is not None:
                    store_copy(self.store, step, files)
            except CheckpointError as exc:
                log.error("the checkpoint copy of step %d from %s does not verify: %s", step, source, exc)
                return None
        log.warning("using the checkpoint copy of step %d fetched from %s", step, source)
        self.events.fetched(step, source)
        return ckpt


def _send_copies(coordinator: Coordinator, store: CheckpointStore, step: int, n: int,
                  previous: threading.Thread | None, copies: list[dict[str, Any]]) -> None:
    """Copy the checkpoint of ``step`` to ``n`` live peers (after ``previous`` replication ends); the record of
    what went where is appended to ``copies``."""
    if previous is not None:
        previous.join()
    record: dict[str, Any] = {"step": step, "peers": [], "errors": {}}
    try:
        files = store.read_files(step)
    except CheckpointError as exc:
        record["errors"]["local"] = str(exc)
        copies.append(record)
        return
    tried: list[str] = []
    while len(record["peers"]) < n:
        targets = coordinator.copy_targets(n - len(record["peers"]), exclude=tried)
        if not targets:
            break
        for ep in targets:
            tried.append(ep)
            try:
                coordinator.push_checkpoint(ep, step, files, COPY_TIMEOUT_S)
                record["peers"].append(ep)
            except Exception as exc:  # another peer is tried; the leader trains on regardless
                record["errors"][ep] = str(exc)[:300]
    copies.append(record)
    if len(record["peers"]) < n:
        log.error("checkpoint of step %d: copied to %d peer(s) of %d wanted (%s)", step,
                  len(record["peers"]), n, record["errors"] or "no other live worker")
    else:
        log.info("checkpoint of step %d copied to %s", step, record["peers"])


def verified_states(live_states: LiveStates, stages: Stages, digests: Digests,
                    step: int) -> dict[tuple[int, int], dict[str, Any]]:
    """One state per stage at ``step`` (for a checkpoint or the final save) whose parameters hash to what the
    stage's replicas agreed on, when that is known: a replica serving the leader other parameters than it
    reported is passed over for another. ``live_states``: the coordinator's."""
    want = digests.at(step)

    def accept(stage: int, state: dict[str, Any]) -> bool:
        h = want.get(tuple(stages[stage])) if 0 <= stage < len(stages) else None  # type: ignore[arg-type]
        return h is None or flat_digest(state["params"]) == h

    return live_states(at_step=step, accept=accept)


def _every_stage(states: dict, stages: Stages, step: int) -> dict:
    """``states`` ((stage, endpoint) -> state) when every stage answered, else CheckpointError."""
    missing = set(range(len(stages))) - {stage for stage, _ in states}
    if missing:
        raise CheckpointError(f"stages {sorted(missing)} did not answer at step {step}")
    return states


def _newest(table: dict[int, Any], step: int, value: Any) -> dict[int, Any]:
    """``table`` with ``value`` at ``step`` (unless None), keeping the KEPT_DIGESTS newest steps (what a progress
    record signs)."""
    return table if value is None else dict(sorted({**table, step: value}.items())[-KEPT_DIGESTS:])


def _manifest_of(step_dir: Path) -> str | None:
    """The sha256 of a checkpoint's manifest; None when the folder is already pruned (an older step written after a
    roll-back, not among the checkpoints kept)."""
    try:
        return sha256_of(step_dir / MANIFEST)
    except OSError:
        return None


def _match_manifest(files: dict[str, bytes], want: str | None) -> None:
    """A copy's manifest must be the one the leader signed for its step, before any file is deserialised: the
    manifest names every file's sha256 (``store_copy`` checks them), so no byte a member chose reaches
    ``torch.load``."""
    if want is None:
        raise CheckpointError("no leader signed a manifest of that step")
    if hashlib.sha256(files.get(MANIFEST, b"")).hexdigest() != want:
        raise CheckpointError(f"its manifest is not the one the leader signed ({want[:12]})")


def _match_digests(ckpt: Checkpoint, want: dict[tuple[int, int], str]) -> None:
    """A checkpoint copy's stage parameters must hash to what the leader recorded for its step (when it did)."""
    for stage, layers in enumerate(tuple(x) for x in ckpt.meta.get("stages", [])):
        h = want.get(layers)  # type: ignore[arg-type]
        if h is not None and stage in ckpt.states and flat_digest(ckpt.states[stage]["params"]) != h:
            raise CheckpointError(f"stage {stage}'s parameters are not the ones the leader recorded for step "
                                  f"{ckpt.step} ({h})")
