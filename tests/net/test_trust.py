"""Trust on the data plane (issue #12): identity-bound certificates, mutual TLS, authorization by role.

In-process, with real gRPC over loopback TCP and a distinct identity (key, certificate) for every party: a
coordinator, four workers of a 2-stage x 2-pipeline plan, a stranger nobody trusts. A worker with a valid key
but the wrong role is refused with PERMISSION_DENIED and changes nothing; a stranger never gets past the TLS
handshake; a peer dropped from the trust set is refused on the connection it already holds; and the plan still
trains a step afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
import torch

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.identity.certs import (
    fingerprint,
    make_certificate,
    peer_id_of_certificate,
    pem_from_text,
    pem_to_text,
)
from tasklet.peer.identity.keys import Identity
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.lead.coordinator import Coordinator
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.runtime.stage.worker import StageWorker
from tasklet.peer.runtime.wire import envelope, make_key
from tasklet.peer.swarm.adverts import Advert
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import PeerUnreachable, Refused, TransportError

SPEC = RunSpec(run_id="trust", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8),
               micro_batch=2, n_microbatches=4)
SHAPE = (SPEC.micro_batch, SPEC.model.seq_len, SPEC.model.d_model)
EPOCH = 1


# ---------------------------------------------------------------------------------------------- certificates
@pytest.mark.unit
def test_certificate_is_bound_to_the_identity_key() -> None:
    identity = Identity.generate()
    cert = make_certificate(identity)
    assert peer_id_of_certificate(cert) == identity.peer_id
    assert make_certificate(identity) == cert  # deterministic: a restarted peer keeps its fingerprint
    assert pem_from_text(pem_to_text(cert)) == cert
    assert len(fingerprint(cert)) == 64
    assert peer_id_of_certificate(make_certificate(Identity.generate())) != identity.peer_id
    # a leaf, not an authority: a trusted peer's certificate can never vouch for a certificate of another key
    from cryptography import x509

    constraints = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is False


@pytest.mark.unit
def test_advert_refuses_a_certificate_of_another_key() -> None:
    from tasklet.peer.compute.device_probe import DeviceInfo

    me, other = Identity.generate(), Identity.generate()
    device = DeviceInfo("cpu", "cpu", 1 << 30, 1.0, measured=True, emulated=False)
    ok = Advert(me.peer_id, "127.0.0.1:5000", device, 1.0, cert=pem_to_text(make_certificate(me)))
    assert Advert.from_record(ok.to_record()).cert == ok.cert
    with pytest.raises(ValueError, match="advert.cert"):
        Advert(me.peer_id, "127.0.0.1:5000", device, 1.0, cert=pem_to_text(make_certificate(other)))


# ---------------------------------------------------------------------------------------------- transport
@pytest.fixture
def echo() -> Iterator[tuple[PeerServer, TlsContext, list[pb.Envelope]]]:
    server_tls = TlsContext.generate()
    server = PeerServer(TransportConfig(tls=server_tls))
    got: list[pb.Envelope] = []
    server.register_push(pb.OTHER, got.append)
    server.start()
    try:
        yield server, server_tls, got
    finally:
        server.stop(grace=0)


def _client(server: PeerServer, tls: TlsContext | None, expect: str = "") -> PeerClient:
    return PeerClient(server.endpoint, TransportConfig(tls=tls), sender="forged-name", expect_peer=expect)


def test_mutual_tls_authenticates_the_caller_and_refuses_strangers(echo) -> None:
    server, server_tls, got = echo
    member, stranger = TlsContext.generate(), TlsContext.generate()
    server_tls.trust_only([member.certificate], group="swarm")  # joins after the server started
    member.trust_only([server_tls.certificate])
    with _client(server, member, expect=server_tls.peer_id) as client:
        client.push(pb.Envelope(kind=pb.OTHER, sender="coordinator"), timeout_s=5)
    assert [e.sender for e in got] == [member.peer_id]  # the certificate's peer id, never the claimed sender

    stranger.trust_only([server_tls.certificate])
    with _client(server, stranger) as client, pytest.raises(PeerUnreachable):
        client.push(pb.Envelope(kind=pb.OTHER), timeout_s=5)  # refused in the TLS handshake
    with _client(server, None) as client, pytest.raises(PeerUnreachable):
        client.ping(timeout_s=5)  # plaintext never reaches a handler
    member.trust_only([stranger.certificate], group="other")
    with _client(server, member, expect=stranger.peer_id) as client, pytest.raises(PeerUnreachable):
        client.ping(timeout_s=5)  # pinned to another peer's certificate: the server is not that peer
    with _client(server, member, expect="0" * 20) as client, pytest.raises(PeerUnreachable):
        client.ping(timeout_s=5)  # an expected peer nobody trusts: fails closed
    assert len(got) == 1


def test_a_peer_dropped_from_the_trust_set_is_refused_on_its_open_connection(echo) -> None:
    server, server_tls, got = echo
    member = TlsContext.generate().trust_only([server_tls.certificate])
    server_tls.trust.set_group("swarm", [member.certificate])
    with _client(server, member) as client:
        client.ping(timeout_s=5)
        server_tls.trust.set_group("swarm", [])  # its advert expired
        with pytest.raises(Refused) as info:
            client.push(pb.Envelope(kind=pb.OTHER), timeout_s=5)
    assert info.value.code == "UNAUTHENTICATED" and "not trusted" in info.value.detail
    assert got == []


# ---------------------------------------------------------------------------------------------- roles
class Plan:
    """A coordinator and four workers (pipelines [[w0, w1], [w2, w3]]), each with its own identity."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.coordinator = Coordinator(SPEC, tls=TlsContext.generate(), liveness_interval_s=0.5)
        self.coordinator.start()
        ctls = self.coordinator.tls
        self.workers = []
        for _ in range(4):
            tls = TlsContext.generate().trust_only([ctls.certificate])
            worker = StageWorker(tls=tls, controllers=(ctls.peer_id,))
            worker.start()
            self.workers.append(worker)
        endpoints = [w.server.endpoint for w in self.workers]
        certs = {w.server.endpoint: w.tls.certificate_text for w in self.workers}
        certs[self.coordinator.endpoint] = ctls.certificate_text
        self.assignments = build_assignments(
            SPEC, [(0, 1), (1, 2)], [[0, 1], [2, 3]], endpoints, self.coordinator.endpoint, epoch=EPOCH,
            certificates=certs,
        )
        self.coordinator.assign(self.assignments)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.coordinator.close()

    def client(self, target: StageWorker | Coordinator, as_worker: int) -> PeerClient:
        """A client to ``target`` speaking with worker ``as_worker``'s key (a member, maybe in the wrong role)."""
        endpoint = target.server.endpoint if isinstance(target, StageWorker) else target.endpoint
        return PeerClient(endpoint, TransportConfig(tls=self.workers[as_worker].tls))


@pytest.fixture
def plan() -> Iterator[Plan]:
    p = Plan()
    try:
        yield p
    finally:
        p.close()


def _denied(call) -> Refused:
    with pytest.raises(Refused) as info:
        call()
    assert info.value.code == "PERMISSION_DENIED", info.value
    return info.value


def test_members_in_the_wrong_role_are_refused_and_change_nothing(plan: Plan) -> None:
    w0, w1, w2, _ = plan.workers
    params0 = w0.compute.flat_params().clone()
    before = w0.assignment
    hostile = 3  # worker 3: stage 1 of pipeline 1, a member with a valid key
    with plan.client(w0, hostile) as c:
        takeover = plan.assignments[w0.server.endpoint]
        takeover = type(takeover)(**{**takeover.__dict__, "epoch": 2**62})
        msg = _denied(lambda: c.push(ctl.StageAssignment(SPEC, takeover, ctl.StateSource.init()).to_envelope(),
                                     timeout_s=10))
        assert "coordinator" in msg.detail
        _denied(lambda: c.push(ctl.encode(ctl.Stop(), SPEC.run_id, EPOCH), timeout_s=10))
        _denied(lambda: c.push(ctl.encode(ctl.StartStep(0, 0), SPEC.run_id, EPOCH, 0), timeout_s=10))
        shard = envelope(pb.GRAD_SHARD, make_key(SPEC.run_id, EPOCH, 0, stage=0, replica=1),
                         {"grad": torch.zeros(w0.compute.numel // 2)})
        shard.meta.update({"attempt": "0", "participants": json.dumps([0, 1])})
        msg = _denied(lambda: c.push(shard, timeout_s=10))  # stage 0's group is workers 0 and 2
        _denied(lambda: c.fetch(pb.STAGE_STATE, make_key(SPEC.run_id, EPOCH, -1, stage=0),
                                meta={"layers": json.dumps([0, 1])}, timeout_s=10))
    with plan.client(w1, hostile) as c:  # worker 1 takes activations only from worker 0
        act = envelope(pb.ACTIVATION, make_key(SPEC.run_id, EPOCH, 0, 0, 0, 0), {"hidden": torch.zeros(SHAPE)})
        msg = _denied(lambda: c.push(act, timeout_s=10))
        assert "upstream" in msg.detail
    with plan.client(w2, 1) as c:  # worker 1 is stage 1: not in stage 0's group, no activation gradient to w2
        grad = envelope(pb.ACTIVATION_GRAD, make_key(SPEC.run_id, EPOCH, 0, 0, 1, 1), {"grad": torch.zeros(SHAPE)})
        _denied(lambda: c.push(grad, timeout_s=10))
    with plan.client(plan.coordinator, hostile) as c:
        # report worker 0 as a bad peer while claiming to be worker 1 (stage 1 of pipeline 0)
        bad = ctl.encode(ctl.BadPeer(0, 0, "", "forged"), SPEC.run_id, EPOCH, 0, stage=1, replica=0)
        _denied(lambda: c.push(bad, timeout_s=10))
        _denied(lambda: c.fetch(ctl.pool_kind(ctl.Op.LEASE), make_key(SPEC.run_id, EPOCH, 0, stage=0, replica=0),
                                timeout_s=10))
    assert w0.assignment == before and not w0.stopped.is_set() and plan.coordinator.dead == frozenset()
    assert torch.equal(w0.compute.flat_params(), params0)
    report = plan.coordinator.run_step(0, timeout_s=120)  # training goes on
    assert report.loss == report.loss and set(report.microbatches_per_pipeline) == {0, 1}
    assert plan.coordinator.live_states()  # the coordinator, in its role, may read stage states


def test_a_stranger_is_refused_every_message_kind(plan: Plan) -> None:
    stranger = TlsContext.generate()
    stranger.trust_only([w.tls.certificate for w in plan.workers] + [plan.coordinator.tls.certificate])
    targets = [w.server.endpoint for w in plan.workers] + [plan.coordinator.endpoint]
    for endpoint in targets:
        for tls in (stranger, None):
            with PeerClient(endpoint, TransportConfig(tls=tls), sender="coordinator") as c:
                for kind in pb.Kind.values():
                    with pytest.raises(TransportError):
                        c.push(pb.Envelope(kind=kind, key=make_key(SPEC.run_id, EPOCH, 0)), timeout_s=5)
                    with pytest.raises(TransportError):
                        c.fetch(kind, make_key(SPEC.run_id, EPOCH, 0), timeout_s=5)
                for call in (c.ping, c.status, lambda timeout_s: c.probe(1024, timeout_s=timeout_s)):
                    with pytest.raises(TransportError):
                        call(timeout_s=5)
    assert all(not w.stopped.is_set() and w.assignment.epoch == EPOCH for w in plan.workers)
    report = plan.coordinator.run_step(0, timeout_s=120)
    assert report.loss == report.loss


def test_raw_grpc_from_a_trusted_channel_still_needs_a_role(plan: Plan) -> None:
    """Even bypassing PeerClient, the sender field is ignored: the certificate decides."""
    w0 = plan.workers[0]
    tls = plan.workers[3].tls
    with tls.channel(w0.server.endpoint) as channel:
        ping = channel.unary_unary("/tasklet.v1.Peer/Ping", request_serializer=pb.PingRequest.SerializeToString,
                                   response_deserializer=pb.PingReply.FromString)
        reply = ping(pb.PingRequest(protocol_version=PROTOCOL_VERSION, sender="coordinator"), timeout=5)
        assert reply.protocol_version == PROTOCOL_VERSION
        with pytest.raises(grpc.RpcError) as info:
            ping(pb.PingRequest(protocol_version=PROTOCOL_VERSION), timeout=10_000)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in info.value.details()


# ------------------------------------------------------------------------------------- wrong gradients
class Replicas:
    """One stage, three pipelines, in-process; worker ``faulty`` (if any) sends huge gradient shards."""

    def __init__(self, faulty: int | None = None) -> None:
        from tasklet.peer.emulation.faults import worker_class

        torch.set_num_threads(1)
        self.events: list[tuple[str, dict]] = []
        self.coordinator = Coordinator(SPEC, tls=TlsContext.generate(), liveness_interval_s=0.5)
        self.coordinator.on_event = lambda name, info: self.events.append((name, info))
        self.coordinator.start()
        ctls = self.coordinator.tls
        self.workers = []
        for i in range(3):
            cls = worker_class("huge-grad" if i == faulty else None)
            worker = cls(tls=TlsContext.generate().trust_only([ctls.certificate]), controllers=(ctls.peer_id,))
            worker.start()
            self.workers.append(worker)
        certs = {w.server.endpoint: w.tls.certificate_text for w in self.workers}
        certs[self.coordinator.endpoint] = ctls.certificate_text
        endpoints = [w.server.endpoint for w in self.workers]
        self.coordinator.assign(build_assignments(SPEC, [(0, 2)], [[0], [1], [2]], endpoints,
                                                  self.coordinator.endpoint, epoch=EPOCH, certificates=certs))

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.coordinator.close()


def test_a_replica_whose_parameters_differ_reloads_them_from_the_majority() -> None:
    r = Replicas()
    try:
        r.coordinator.run_step(0, timeout_s=120)
        victim = r.workers[2]
        state = victim.compute.state_dict()
        state["params"] = state["params"] + 1e-3  # a silently wrong apply
        victim.compute.load_state_dict(state)
        r.coordinator.run_step(1, timeout_s=120)
        resyncs = [info for name, info in r.events if name == "resync"]
        assert resyncs == [{"step": 1, "endpoints": [victim.server.endpoint]}]
        reference = r.workers[0].compute.flat_params()
        assert all(torch.equal(w.compute.flat_params(), reference) for w in r.workers)
        assert r.coordinator.dead == frozenset()
    finally:
        r.close()


def test_a_gradient_far_above_the_groups_median_is_refused_and_its_sender_sidelined() -> None:
    """Both other owners refuse it: their reports are testimony, so its sender is left out of the plan (sidelined)
    and its pipeline's work redone by the others, nothing rolled back (peer.runtime.lead.referee)."""
    r = Replicas(faulty=1)
    try:
        report = r.coordinator.run_step(0, timeout_s=120)
        bad = r.workers[1].server.endpoint
        assert bad in r.coordinator.dead and "median" in r.coordinator.dead_reasons[bad]
        assert r.coordinator.verification.take_rollback() is None, "testimony rolls nothing back"
        assert report.dropped_pipelines == [1] and report.loss == report.loss
        assert torch.equal(r.workers[0].compute.flat_params(), r.workers[2].compute.flat_params())
    finally:
        r.close()


@pytest.mark.unit
def test_a_peer_stays_trusted_through_dht_reads_that_miss_its_advert(tmp_path, monkeypatch) -> None:
    """A daemon trusts the certificates of the adverts it reads, and keeps one for at least TRUST_KEEP_MIN_S
    after the advert was last read: while a dead DHT node makes reads and stores time out (5 s each), a live
    peer's connections must not be refused, even with heartbeats of 1 s (adverts living 3 s)."""
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.config import RunConfig
    from tasklet.peer.node import daemon as daemon_module
    from tasklet.peer.node.daemon import PeerDaemon, PeerOptions
    from tasklet.peer.timing import TRUST_KEEP_MIN_S

    config = RunConfig()
    config.swarm.heartbeat_s = 1.0
    peer = PeerDaemon(PeerOptions(identity=str(tmp_path / "id.key")), [], config)
    other = Identity.generate()
    device = DeviceInfo("cpu", "cpu", 1 << 30, 1.0, measured=True, emulated=False)
    advert = Advert(other.peer_id, "127.0.0.1:5000", device, 1.0, cert=pem_to_text(make_certificate(other)))
    clock = [1000.0]
    monkeypatch.setattr(daemon_module.time, "monotonic", lambda: clock[0])
    peer._trust_adverts([advert])
    assert other.peer_id in peer.tls.trust.peers()
    clock[0] += 10.0  # several missed reads: far past the advert's 3 s lifetime
    peer._trust_adverts([])
    assert other.peer_id in peer.tls.trust.peers()
    clock[0] += TRUST_KEEP_MIN_S
    peer._trust_adverts([])
    assert other.peer_id not in peer.tls.trust.peers(), "a peer gone for good is trusted no longer"
