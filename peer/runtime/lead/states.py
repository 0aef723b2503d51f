"""Stage states and checkpoint copies, read from and sent to the plan's workers outside any step.

The leader reads the trained stages (checkpoints, the final save, local runs), serves the stages of a
checkpoint it rolls back to, and hands checkpoint copies to other peers. None of that touches the step machine;
it needs only the plan (roster, epoch and who is dead, one snapshot the owner takes under its lock) and a
client per worker. What it holds is its own: the checkpoint it serves and the parameter counts of the stages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from tasklet.peer.net.client import PeerClient
from tasklet.peer.runtime.bounds import stage_numel, state_bytes
from tasklet.peer.runtime.checkpoints import copy_bound_bytes, copy_parts, fetch_copy_files
from tasklet.peer.runtime.lead.roster import Roster
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.runtime.stage_state import state_envelope, state_from_envelope
from tasklet.peer.runtime.wire import make_key
from tasklet.peer.timing import FETCH_STATE_TIMEOUT_S, STATUS_TIMEOUT_S
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Forbidden, Rejected

log = logging.getLogger(__name__)


class StageStates:
    """Stage states by worker, and checkpoint copies. ``plan()`` returns a snapshot of the current (roster, epoch,
    dead workers); ``own_peer_id`` is the leader's (it may read too)."""

    def __init__(self, spec: RunSpec, plan: Callable[[], tuple[Roster, int, frozenset[str]]],
                 client: Callable[[str], PeerClient], own_peer_id: str) -> None:
        self.spec, self._plan = spec, plan
        self._numel: dict[tuple[int, int], int] = {}  # stage layers -> parameters
        self._client, self._own = client, own_peer_id
        self._serving: dict[int, dict[str, Any]] = {}  # stage -> state; replaced whole

    def _epoch(self) -> int:
        return self._plan()[1]

    def serve_checkpoint(self, states: dict[int, dict[str, Any]]) -> None:
        """Serve these stage states (by stage index) to workers told to fetch from the coordinator."""
        self._serving = dict(states)

    def on_state_request(self, request: pb.FetchRequest) -> pb.Envelope:
        """A worker of the plan fetches a served checkpoint stage (only a peer the plan gives that stage)."""
        roster, epoch, _ = self._plan()
        holders = [ep for ep, a in roster.assignments.items() if a.stage == request.key.stage]
        if not any(roster.peer_ids.get(ep, self._own) == request.sender for ep in holders) \
                and request.sender != self._own:
            raise Forbidden(
                f"a checkpoint of stage {request.key.stage} is served only to a peer the plan gives that stage; "
                f"peer {request.sender} is not"
            )
        state = self._serving.get(request.key.stage)
        if state is None:
            raise Rejected(f"the coordinator serves no checkpoint of stage {request.key.stage}")
        return state_envelope(state, self.spec.run_id, epoch, request.key.stage)

    def _state_bytes(self, layers: tuple[int, int]) -> int:
        """The bound of a fetched state of the stage holding ``layers`` (its size, from the model's shapes)."""
        key = (int(layers[0]), int(layers[1]))
        if key not in self._numel:
            self._numel[key] = stage_numel(self.spec.model, key)
        return state_bytes(self._numel[key])

    def fetch_state(self, endpoint: str, timeout_s: float = FETCH_STATE_TIMEOUT_S) -> dict[str, Any]:
        """A worker's stage state (params, AdamW moments, step) as a plain dict of tensors and numbers."""
        a = self._plan()[0].assignments[endpoint]
        env = self._client(endpoint).fetch(
            pb.STAGE_STATE,
            make_key(self.spec.run_id, a.epoch, -1, stage=a.stage),
            meta={"layers": json.dumps(list(a.layers))},
            timeout_s=timeout_s,
            max_bytes=self._state_bytes(a.layers),
        )
        return state_from_envelope(env)

    def live_states(
        self, *, every_replica: bool = False, at_step: int | None = None,
        accept: Callable[[int, dict[str, Any]], bool] | None = None,
    ) -> dict[tuple[int, int], dict[str, Any]]:
        """States of the live workers by (stage, replica): one per stage (the lowest replica that answers, at
        ``at_step`` when given, and whose state ``accept(stage, state)`` takes), or with ``every_replica`` every
        live worker's (a failed fetch then raises).

        The one way checkpoints, the leader's final save and local runs read the trained stages.
        """
        roster, _, dead = self._plan()
        workers = sorted((a.stage, a.replica, ep) for ep, a in roster.assignments.items() if ep not in dead)
        out: dict[tuple[int, int], dict[str, Any]] = {}
        done: set[int] = set()
        for stage, replica, ep in workers:
            if stage in done and not every_replica:
                continue
            try:
                state = self.fetch_state(ep)
            except Exception as exc:
                if every_replica:
                    raise
                log.warning("fetching stage %d from %s failed (%s); trying another replica", stage, ep, exc)
                continue
            if at_step is not None and state["step"] != at_step:
                log.info("%s holds stage %d at step %d, not %d", ep, stage, state["step"], at_step)
                continue
            if accept is not None and not accept(stage, state):
                log.warning("%s serves stage %d with other parameters than its replicas agreed on; not used", ep, stage)
                continue
            out[(stage, replica)] = state
            done.add(stage)
        return out

    def push_checkpoint(self, endpoint: str, step: int, files: dict[str, bytes], timeout_s: float) -> None:
        """Send one checkpoint copy (the worker stores and verifies it before it answers)."""
        client = self._client(endpoint)
        for part in copy_parts(self.spec.run_id, self._epoch(), step, files):  # bounded parts: any size fits
            client.push(part, timeout_s=timeout_s)

    def checkpoint_step(self, endpoint: str, timeout_s: float = STATUS_TIMEOUT_S) -> int:
        """The step of the newest checkpoint copy ``endpoint`` holds (nothing else is sent)."""
        env = self._client(endpoint).fetch(pb.CHECKPOINT, make_key(self.spec.run_id, self._epoch(), -1),
                                           meta={"probe": "1"}, timeout_s=timeout_s)
        try:
            return int(env.meta.get("step", ""))
        except ValueError:
            raise Rejected(f"{endpoint} answered a checkpoint probe without a step") from None

    def fetch_checkpoint(self, endpoint: str, timeout_s: float = FETCH_STATE_TIMEOUT_S) -> tuple[int, dict[str, bytes]]:
        """The newest checkpoint copy ``endpoint`` holds for this run (files, not yet verified here)."""
        client, key = self._client(endpoint), make_key(self.spec.run_id, self._epoch(), -1)
        return fetch_copy_files(lambda meta: client.fetch(pb.CHECKPOINT, key, meta=meta, timeout_s=timeout_s),
                                copy_bound_bytes(self.spec.model))
