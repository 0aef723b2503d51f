"""Taking an assignment: fencing an older plan out, building or keeping the stage, loading its state from its
source, and serving this peer's stage state to others (a newcomer's fetch, with a grant when it is outside our
plan's roles).

A state source says where a new tasklet's parameters come from: ``keep`` (this peer already holds the stage at
the run's trained step), ``init`` (step 0: the seeded initialiser, identical everywhere), or ``fetch`` from an
endpoint (a live replica of the stage, or the coordinator serving a checkpoint) — checked to be at the expected
step before it is accepted. The stage held before the last assignment is kept for hand-over: during a re-plan
two peers may fetch from each other while each takes its new assignment (a swap of stages).

A leader's order is a claim, checked before anything is allocated or dialled (:meth:`StageTaker.check`): its
run spec must be this peer's own signed one field for field (the leader only adds grants to a state source, so
any other difference, a learning rate, a trust setting or a shape, is a lie); the stage must fit this peer's
memory limit; and every endpoint the order makes this worker dial (neighbours, replicas, the coordinator, a
state source, a resync source) must pass ``may_dial``: the daemon's check that it is a live advert of the run
with the certificate the order names for it. A refusal is :class:`~protocol.errors.Rejected`, one line.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.family import ModelMismatchError, family_of
from tasklet.peer.compute.hf import ModelSourceError
from tasklet.peer.compute.stage import StageCompute, StageComputeConfig
from tasklet.peer.compute.textdata import load_corpus
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.bounds import stage_memory_bytes, state_bytes
from tasklet.peer.runtime.outer import OuterState
from tasklet.peer.runtime.roles import Roles
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.exchange import GradientExchange
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.tied import tied_end
from tasklet.peer.runtime.stage_state import state_envelope, state_from_envelope
from tasklet.peer.runtime.wire import make_key
from tasklet.peer.timing import WORKER_FETCH_STATE_TIMEOUT_S
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage, Forbidden, Rejected, TransportError

log = logging.getLogger(__name__)

# A state fetch refused or unreachable is retried this long: during a re-plan the source may take its own new
# assignment (which trusts and authorizes us) a moment after ours arrives.
FETCH_STATE_RETRY_S = 15.0

Held = tuple[StageCompute, int, "OuterState | None"]  # (compute, stage index, outer state)
# (endpoint, peer id the order names for it, "" when none) -> whether this worker may dial it
DialCheck = Callable[[str, str], bool]
FetchProgress = Callable[[str, int, int], None]  # (which stage from where, bytes so far, bytes in all); never raises


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
    ``trust_group`` names this worker's plan peers in the TLS trust store; ``stopped`` ends a fetch's retries.

    What an order is checked against (module docstring): ``local``, this peer's own signed spec (None: the
    order's spec is taken as sent, as in-process tests do); ``memory_limit_bytes``, the most device memory a
    stage may need here (None: no bound); ``may_dial`` (None: any endpoint may be dialled)."""

    def __init__(self, config: TransportConfig, tls: TlsContext, peer_id: str, device: str, trust_group: str,
                 lock: threading.Lock, stopped: threading.Event, memory_limit_bytes: int | None = None) -> None:
        self.config, self.tls, self.peer_id, self.device = config, tls, peer_id, device
        self.trust_group, self.lock, self.stopped = trust_group, lock, stopped
        self.corpus: Corpus | None = None  # the worker's state lock
        self.local: RunSpec | None = None  # the worker's state lock: this peer's own files (with_local_files)
        self.memory_limit_bytes = memory_limit_bytes
        self.may_dial: DialCheck | None = None
        self.on_fetch: FetchProgress | None = None  # told the bytes of each state fetch as they arrive (a display)
        self._holdings: dict[tuple[int, int], Held] = {}  # lock: the current stage and the one held before

    def use_corpus(self, corpus: Corpus | None, local: RunSpec | None) -> None:
        """Take ``corpus`` as already loaded and ``local`` as this peer's own signed spec (its files, and what
        an order's spec is checked against); call under the worker's state lock."""
        self.corpus, self.local = corpus, local

    def limit_memory(self, limit_bytes: int | None) -> None:
        """Refuse a stage that needs more device memory than ``limit_bytes`` (None: no bound)."""
        self.memory_limit_bytes = limit_bytes

    def check_dials_with(self, may_dial: DialCheck | None) -> None:
        """Vet every endpoint an order makes this worker dial with ``may_dial`` (None: any endpoint)."""
        self.may_dial = may_dial

    def show_fetches_with(self, on_fetch: FetchProgress | None) -> None:
        """Tell ``on_fetch`` the bytes of each state fetch as they arrive (None: nobody)."""
        self.on_fetch = on_fetch

    def check(self, msg: ctl.StageAssignment) -> RunSpec:
        """The spec ``msg`` is taken with (this peer's own files), once every claim of the order is checked;
        nothing is allocated or dialled here. Raises Rejected naming what does not fit."""
        spec, a, source = with_local_files(msg.run, self.local), msg.assignment, msg.source
        if self.local is not None:
            require_signed_spec(spec, self.local)
        if self.may_dial is not None:
            ids = Roles.of(a, self.tls).ids
            for endpoint, role in order_endpoints(spec, a, source):
                self.require_dialable(endpoint, ids.get(endpoint, ""), role)
        if source.kind is not ctl.SourceKind.KEEP and self.memory_limit_bytes is not None:
            need = stage_memory_bytes(spec, a.layers, in_flight=a.n_stages - a.stage)
            if need > self.memory_limit_bytes:
                raise Rejected(f"stage {a.stage} (layers {list(a.layers)}) needs about {need / 2**30:.3g} GiB, over "
                               f"this peer's memory limit of {self.memory_limit_bytes / 2**30:.3g} GiB")
        return spec

    def require_dialable(self, endpoint: str, peer_id: str, role: str) -> None:
        """Refuse (Rejected) an order that would make this worker dial ``endpoint`` as ``role`` when ``may_dial``
        does not vouch for it (with the peer id the order names for it), before any connection is attempted."""
        if self.may_dial is not None and not self.may_dial(endpoint, peer_id):
            raise Rejected(f"the order names {endpoint[:MAX_SHOWN]} as {role}, which is not a live advert of this "
                           f"run with the certificate the order names for it (peer {peer_id[:16] or 'none'}); "
                           "refused before dialling it")

    def build(self, msg: ctl.StageAssignment, old: Tasklet | None, checked: RunSpec | None = None) -> Tasklet:
        """The tasklet of ``msg`` (call with the worker's state lock held: it may build or load a stage);
        ``checked``: what :meth:`check` returned for ``msg`` (None: it is checked here)."""
        spec, assignment, source = checked or self.check(msg), msg.assignment, msg.source
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
            if outer is not None:  # an overlapped outer round in flight does not survive a new plan
                outer.forget_round()
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
        self.require_dialable(endpoint, roles.ids.get(endpoint, ""), "a state source")  # a resync's source too
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
                    progress=None if self.on_fetch is None else partial(
                        self.on_fetch, f"stage {a.stage} (layers {a.layers[0]}..{a.layers[1] - 1}) from {endpoint}"),
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


MAX_SHOWN = 60  # characters of a value or an endpoint a refusal quotes


def order_endpoints(spec: RunSpec, a: Assignment, source: ctl.StateSource) -> list[tuple[str, str]]:
    """(endpoint, role) of every peer an assignment makes this worker dial: the coordinator (reports, leases),
    its neighbours (activations and their gradients), its stage's other replicas (shards, resyncs), the other end
    of its pipeline (a tied weight's gradient) and the state source; never its own endpoint."""
    own = a.group[a.replica]
    named: list[tuple[str | None, str]] = [(a.coordinator, "the coordinator"), (a.prev, "the upstream neighbour"),
                                           (a.next, "the downstream neighbour")]
    named += [(ep, f"replica {r} of this stage") for r, ep in enumerate(a.group) if r != a.replica]
    end = tied_end(spec, a)
    if end is not None:
        named.append((end.partner, "the other end of this pipeline"))
    if source.kind is ctl.SourceKind.FETCH:
        named.append((source.endpoint, "the state source"))
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for endpoint, role in named:
        if endpoint is not None and endpoint != own and endpoint not in seen:
            seen.add(endpoint)
            out.append((endpoint, role))
    return out


def spec_differences(sent: RunSpec, own: RunSpec) -> list[str]:
    """The fields (``optim.lr``, ``spot_check``, ``model.config``...) where ``sent`` differs from ``own``, each
    with both values; compared as their JSON, the form a spec travels in (a tuple and a list agree)."""
    a, b = _plain(sent.to_dict()), _plain(own.to_dict())
    out: list[str] = []
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out += [_shown(f"{key}.{k}", x.get(k), y.get(k))
                    for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)]
        else:
            out.append(_shown(key, x, y))
    return out


def require_signed_spec(spec: RunSpec, own: RunSpec) -> None:
    """Refuse (Rejected, one line naming the fields) an order whose run spec, with this peer's own files, is not
    this peer's signed spec: the leader never changes a field of it, so any difference is not the run joined."""
    differ = spec_differences(spec, own)
    if differ:
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise Rejected(f"the order's run spec differs from this peer's signed run in {'; '.join(differ[:4])}{more}")


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, sort_keys=True))


def _shown(name: str, sent: Any, own: Any) -> str:
    return f"{name} {json.dumps(sent)[:MAX_SHOWN]} (signed {json.dumps(own)[:MAX_SHOWN]})"


def with_local_files(spec: RunSpec, local: RunSpec | None) -> RunSpec:
    """An assignment's spec with this peer's own corpus, tokenizer and model checkpoint paths (``local``, the
    daemon's spec; None: the assignment's as sent). Why: a leader's paths name files on its own disk, and
    following them would let it make this peer read where it says. The fingerprints must agree."""
    if local is None:
        return spec
    model = spec.model
    try:
        model = family_of(model).with_local_files(model, local.model)
    except ModelMismatchError as exc:
        raise Rejected(str(exc)) from None
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
