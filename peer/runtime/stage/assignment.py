"""Taking an assignment: fencing an older plan out, building or keeping the stage, loading its state from its
source, and serving this peer's stage state to others (a newcomer's fetch, with a grant when it is outside our
plan's roles).

A state source says where a new tasklet's parameters come from: ``keep`` (this peer already holds the stage at
the run's trained step), ``init`` (step 0: the seeded initialiser, identical everywhere), or ``fetch`` from an
endpoint (a live replica of the stage, or the coordinator serving a checkpoint) — checked to be at the expected
step before it is accepted. The stage held before the last assignment is kept for hand-over: during a re-plan
two peers may fetch from each other while each takes its new assignment (a swap of stages).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from peer.compute.data import Corpus
from peer.compute.hf import ModelSourceError
from peer.compute.stage import StageCompute, StageComputeConfig
from peer.compute.textdata import load_corpus
from peer.net import PeerClient, TransportConfig
from peer.net.tls import TlsContext
from peer.runtime import control as ctl
from peer.runtime.bounds import state_bytes
from peer.runtime.outer import OuterState
from peer.runtime.roles import Roles
from peer.runtime.spec import Assignment, RunSpec
from peer.runtime.stage.exchange import GradientExchange
from peer.runtime.stage.snapshot import Tasklet
from peer.runtime.stage.tied import tied_end
from peer.runtime.tasklet import state_envelope, state_from_envelope
from peer.runtime.wire import make_key
from peer.timing import WORKER_FETCH_STATE_TIMEOUT_S
from protocol import tasklet_pb2 as pb
from protocol.errors import BadMessage, Forbidden, Rejected, TransportError

log = logging.getLogger(__name__)

# A state fetch refused or unreachable is retried this long: during a re-plan the source may take its own new
# assignment (which trusts and authorizes us) a moment after ours arrives.
FETCH_STATE_RETRY_S = 15.0

Held = tuple[StageCompute, int, "OuterState | None"]  # (compute, stage index, outer state)


def plan_order(assignment: Assignment) -> tuple[int, str]:
    """Plans are ordered by (epoch, leader id), as on the plan board (peer.swarm.plans)."""
    return assignment.epoch, assignment.leader


def fence(old: Tasklet | None, assignment: Assignment, lost_race: bool = False) -> None:
    """Refuse an assignment whose plan is not newer than the current one: two leaders never both drive a peer."""
    if old is None or plan_order(assignment) > plan_order(old.assignment):
        return
    if lost_race:
        raise Rejected(f"plan epoch {assignment.epoch} of {assignment.leader!r} lost a race to a newer plan")
    raise Rejected(
        f"plan epoch {assignment.epoch} of leader {assignment.leader!r} is not newer: older than this "
        f"peer's epoch {old.assignment.epoch} of leader {old.assignment.leader!r} or equal to it; "
        "a newer leader has taken over"
    )


def require_named_leader(assignment: Assignment, caller: str, own_id: str) -> None:
    """An assignment naming a leader comes from that leader (or this process): a member the worker takes
    control from cannot hand it a plan in another leader's name, which would order above that leader's own."""
    if assignment.leader and caller not in (assignment.leader, own_id):
        raise Forbidden(f"a plan of leader {assignment.leader} is taken only from it; peer {caller} sent it")


class StageTaker:
    """Builds a worker's tasklets and holds its stages (module docstring).

    ``lock`` is the worker's step lock: the held stages change under it together with the current snapshot;
    ``trust_group`` names this worker's plan peers in the TLS trust store; ``stopped`` ends a fetch's retries."""

    def __init__(self, config: TransportConfig, tls: TlsContext, peer_id: str, device: str, trust_group: str,
                 lock: threading.Lock, stopped: threading.Event) -> None:
        self.config, self.tls, self.peer_id, self.device = config, tls, peer_id, device
        self.trust_group, self.lock, self.stopped = trust_group, lock, stopped
        self.corpus: Corpus | None = None  # the worker's state lock
        self.local: RunSpec | None = None  # the worker's state lock: this peer's own files (with_local_files)
        self._holdings: dict[tuple[int, int], Held] = {}  # lock: the current stage and the one held before

    def build(self, msg: ctl.StageAssignment, old: Tasklet | None) -> Tasklet:
        """The tasklet of ``msg`` (call with the worker's state lock held: it may build or load a stage)."""
        spec, assignment, source = with_local_files(msg.run, self.local), msg.assignment, msg.source
        if source.kind is ctl.SourceKind.KEEP:
            same_stage = old is not None and old.spec == spec and old.assignment.layers == assignment.layers
            if old is None or not same_stage or old.compute.step != source.step:
                raise Rejected(
                    f"cannot keep stage {assignment.layers} at step {source.step}: this peer holds "
                    f"{None if old is None else old.assignment.layers} at step "
                    f"{None if old is None else old.compute.step}"
                )
            compute = old.compute
            compute.reset_step()
            outer = old.outer
        else:
            try:
                compute = StageCompute(
                    StageComputeConfig(
                        model=spec.model,
                        first_layer=assignment.layers[0],
                        last_layer=assignment.layers[1],
                        optim=spec.optim,
                        device=self.device or assignment.device,
                        precision=spec.precision,
                    )
                )
            except ModelSourceError as exc:  # e.g. this peer's checkpoint files differ from the run's
                raise Rejected(f"cannot build stage {assignment.layers}: {exc}") from None
            outer = None
            if source.kind is ctl.SourceKind.FETCH:
                assert source.endpoint is not None
                outer = self.load_from(compute, source.endpoint, spec, assignment, source.step, source.grant,
                                       source.params_hash)
        outer = _outer_state(spec, compute, outer)
        if (assignment.is_first or assignment.is_last) and self.corpus is None:
            self.corpus = _load_corpus(spec)
        return Tasklet(
            spec=spec,
            assignment=assignment,
            compute=compute,
            exchange=GradientExchange(assignment.replica, compute.numel, spec.grad_outlier_factor,
                                      spec.grad_direction_z, spec.micro_batch * spec.model.seq_len,
                                      tied_end(spec, assignment)),
            corpus=self.corpus,
            roles=Roles.of(assignment, self.tls),
            outer=outer,
        )

    def hold(self, old: Tasklet | None, new: Tasklet) -> None:
        """Keep the new stage and the one held just before (call with ``lock`` held)."""
        previous = {} if old is None else {old.assignment.layers: (old.compute, old.assignment.stage, old.outer)}
        self._holdings = {**previous, new.assignment.layers: (new.compute, new.assignment.stage, new.outer)}

    def load_from(
        self, compute: StageCompute, endpoint: str, spec: RunSpec, a: Assignment, step: int, grant: str = "",
        params_hash: str = "",
    ) -> OuterState | None:
        """Fetch a stage's state from a live replica (or a checkpoint server) and load it; with DiLoCo, also the
        replica's outer state (round-start parameters, Nesterov buffer) when it has one (a checkpoint has not).
        With ``params_hash`` (what the leader recorded for the stage at ``step``) the parameters must hash to it:
        a source that claimed the stage and serves other parameters is refused, not loaded."""
        want_outer = {"outer": "1"} if spec.sync_period > 1 else {}
        roles = Roles.of(a, self.tls)
        self.tls.trust.add(self.trust_group, a.peers.values())  # the source must be trusted to be dialled
        deadline = time.monotonic() + FETCH_STATE_RETRY_S
        while True:
            client = PeerClient(endpoint, self.config, sender=self.peer_id, expect_peer=roles.ids.get(endpoint, ""))
            try:
                env = client.fetch(
                    pb.STAGE_STATE,
                    make_key(spec.run_id, a.epoch, step, stage=a.stage),
                    meta={"layers": json.dumps(list(a.layers)), **({"grant": grant} if grant else {}), **want_outer},
                    timeout_s=WORKER_FETCH_STATE_TIMEOUT_S,
                    max_bytes=state_bytes(compute.numel),
                )
                break
            except TransportError as exc:
                if time.monotonic() > deadline or self.stopped.is_set():
                    raise Rejected(f"could not fetch stage {a.layers} from {endpoint}: {exc}") from None
                log.info("fetching stage %s from %s: %s; retrying", a.layers, endpoint, exc)
                time.sleep(0.5)
            finally:
                client.close()
        state = state_from_envelope(env)
        if state["step"] != step:
            raise Rejected(f"{endpoint} holds stage {a.layers} at step {state['step']}, expected step {step}")
        try:
            compute.load_state_dict(state)
        except ValueError as exc:
            raise BadMessage("stage_state", str(exc)) from None
        got = compute.params_digest()  # once per load: the Status reply then carries it
        if params_hash and got != params_hash:
            raise Rejected(f"{endpoint} served stage {a.layers} at step {step} with parameters hashing {got}; "
                           f"the leader recorded {params_hash}")
        if "outer_anchor" not in state or "outer_momentum" not in state:
            return None
        for name in ("outer_anchor", "outer_momentum"):
            if state[name].numel() != compute.numel:
                raise BadMessage(f"tensors.{name}", f"{state[name].numel()} values for a stage of {compute.numel}")
        return OuterState.start(state["outer_anchor"], state["outer_momentum"])

    def serve_state(self, request: pb.FetchRequest, current: Callable[[], Tasklet | None],
                    check_grant: Callable[[pb.FetchRequest, Tasklet, tuple[int, int]], None]) -> pb.Envelope:
        """Serve the state of the stage with the requested layers: the current one or the one held just before.

        Deliberately without the state lock: during a re-plan two peers may fetch from each other while each is
        taking its new assignment (a swap of stages); serving the retained previous stage keeps that working.
        """
        try:
            layers = tuple(int(x) for x in json.loads(request.meta.get("layers", "null")))
        except (TypeError, ValueError):
            raise BadMessage("meta.layers", "must be a JSON list [first_layer, last_layer]") from None
        with self.lock:
            held = self._holdings.get(layers)  # type: ignore[arg-type]
            t = current()
        if held is None or t is None:
            raise Rejected(f"this peer holds no stage with layers {list(layers)}")
        if len(layers) != 2:
            raise BadMessage("meta.layers", "must be a JSON list [first_layer, last_layer]")
        try:
            t.roles.require_holder(request.sender, layers, t.assignment.coordinator, "a stage state fetch")  # type: ignore[arg-type]
        except Forbidden:
            if "grant" not in request.meta:
                raise
            check_grant(request, t, layers)  # type: ignore[arg-type]
        compute, stage, outer = held
        outer = outer if request.meta.get("outer") == "1" else None
        return state_envelope(compute.state_dict(), t.spec.run_id, request.key.epoch, stage, outer=outer)


def with_local_files(spec: RunSpec, local: RunSpec | None) -> RunSpec:
    """An assignment's spec with this peer's own corpus, tokenizer and model checkpoint paths (``local``, the
    daemon's spec; None: the assignment's as sent). Why: a leader's paths name files on its own disk, and
    following them would let it make this peer read where it says. The fingerprints must agree."""
    if local is None:
        return spec
    model = spec.model
    if getattr(model, "kind", "") == "hf":
        own_fingerprint = getattr(local.model, "fingerprint", None)
        if own_fingerprint != model.fingerprint:
            raise Rejected(f"the assignment's model (fingerprint {str(model.fingerprint)[:12]}) is not this "
                           f"peer's ({str(own_fingerprint)[:12]})")
        model = replace(model, checkpoint=local.model.checkpoint, source=local.model.source)
    if spec.corpus_fingerprint != local.corpus_fingerprint:
        raise Rejected(f"the assignment's data (fingerprint {spec.corpus_fingerprint[:12]}) is not this peer's "
                       f"({local.corpus_fingerprint[:12]})")
    return replace(spec, model=model, corpus=local.corpus, tokenizer=local.tokenizer)


def _load_corpus(spec: RunSpec) -> Corpus:
    try:
        corpus = load_corpus(spec.corpus, spec.tokenizer, spec.text_field, spec.model)
    except ValueError as exc:  # missing data or tokenizer files on this peer
        raise Rejected(f"cannot load the run's data: {exc}") from None
    if spec.corpus_fingerprint and corpus.fingerprint != spec.corpus_fingerprint:
        raise Rejected(
            f"corpus fingerprint {corpus.fingerprint[:12]} differs from the run's "
            f"{spec.corpus_fingerprint[:12]} (a different Python or data path)"
        )
    return corpus


def _outer_state(spec: RunSpec, compute: StageCompute, fetched: OuterState | None) -> OuterState | None:
    """A new tasklet's outer-loop state (DiLoCo only). Fetched mid-round from a replica, the tasklet restarts the
    round's remaining inner steps from the round-start parameters: the replica it took the state from keeps its
    own inner progress, which must reach the outer average once, not twice."""
    if spec.sync_period <= 1:
        return None
    if fetched is None:
        return OuterState.start(compute.flat_params())
    if not torch.equal(fetched.anchor, compute.flat_params()):  # mid-round (or after a failed outer round)
        compute.set_params(fetched.anchor)
    return fetched
