"""A stage worker's current assignment as one immutable snapshot (:class:`Tasklet`)."""

from __future__ import annotations

from dataclasses import dataclass

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.stage import StageCompute
from tasklet.peer.runtime.outer import OuterState
from tasklet.peer.runtime.roles import Roles
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.exchange import GradientExchange
from tasklet.peer.runtime.wire import make_key
from tasklet.protocol import tasklet_pb2 as pb


@dataclass(frozen=True)
class Tasklet:
    """The current assignment as one immutable snapshot (peer.runtime.stage.worker, "State")."""

    spec: RunSpec
    assignment: Assignment
    compute: StageCompute
    exchange: GradientExchange
    corpus: Corpus | None
    roles: Roles
    outer: OuterState | None = None  # DiLoCo (spec.sync_period > 1): this replica's outer-loop state

    def key(self, step: int, mb: int = -1) -> pb.Key:
        a = self.assignment
        return make_key(self.spec.run_id, a.epoch, step, mb, a.stage, a.replica)
