"""Prometheus metrics: the transport's counters over real gRPC, and a live daemon's /metrics scraped over HTTP
and parsed with prometheus-client's own parser (step, loss, tokens/s, bytes per message kind, micro-batches,
plan epoch, refused messages by reason); the leader's TensorBoard event files read back with tensorboard's
event reader while the run goes on.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tasklet.peer.emulation.procs import PeerProcesses, write_small_config
from tasklet.peer.identity.certs import make_certificate
from tasklet.peer.identity.keys import Identity
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.observe.http import ObserveServer
from tasklet.peer.observe.metrics import NodeMetrics
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import encode_tensor
from tasklet.protocol.errors import BadMessage, PeerUnreachable, Refused


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return samples(reply.read().decode())


def _activation(n: int = 1000) -> pb.Envelope:
    env = pb.Envelope(kind=pb.ACTIVATION)
    env.key.step = 0
    env.tensors.append(encode_tensor("h", torch.zeros(n), "none"))
    return env


def _refuse(_: pb.Envelope) -> None:
    raise BadMessage("tensors", "not what this test wants")


@pytest.mark.unit
def test_transport_counters_reach_the_metrics_endpoint() -> None:
    """Bytes pushed by kind, on both sides, and refusals by gRPC status, through a NodeMetrics /metrics server."""
    server = PeerServer()
    server.register_push("ACTIVATION", lambda env: None)
    server.register_push("ACTIVATION_GRAD", _refuse)
    server.start()
    metrics = NodeMetrics(worker_stats=lambda: {"forward": 7, "backward": 5, "busy_s": 1.5})
    http = ObserveServer("127.0.0.1", 0, {"/metrics": metrics.render})
    try:
        before = scrape(f"{http.url}metrics")
        env = _activation()
        with PeerClient(server.endpoint, sender="tester") as client:
            client.push(env, timeout_s=10)
            size = len(env.SerializeToString())  # as sent: push stamped the protocol version and the sender
            grad = _activation()
            grad.kind = pb.ACTIVATION_GRAD
            with pytest.raises(Refused) as refused:
                client.push(grad, timeout_s=10)
            with pytest.raises(Refused):
                client.push(pb.Envelope(kind=pb.STAGE_STATE), timeout_s=10)  # no handler: FAILED_PRECONDITION
        metrics.observe_progress({"epoch": 1, "step": 3, "loss": 4.5, "tokens_per_s": 900.0, "step_s": 0.5},
                                 peers_live=2, is_leader=True)
        metrics.observe_progress({"epoch": 2, "step": 4, "loss": 4.4}, peers_live=2, is_leader=True)
        after = scrape(f"{http.url}metrics")
    finally:
        http.close()
        server.stop()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # one process plays both ends: what the client sent, the server received
    assert delta("tasklet_net_sent_bytes_total", kind="ACTIVATION") == size
    assert delta("tasklet_net_received_bytes_total", kind="ACTIVATION") == size
    assert delta("tasklet_net_sent_messages_total", kind="ACTIVATION_GRAD") == 1
    assert delta("tasklet_net_refused_messages_total", reason=refused.value.code) == 1
    assert refused.value.code == "INVALID_ARGUMENT"
    assert delta("tasklet_net_refused_messages_total", reason="FAILED_PRECONDITION") == 1
    assert after[("tasklet_microbatches_computed_total", (("pass", "forward"),))] == 7
    assert after[("tasklet_compute_busy_seconds_total", ())] == 1.5
    assert after[("tasklet_step", ())] == 4 and after[("tasklet_loss", ())] == 4.4
    assert after[("tasklet_tokens_per_second", ())] == 900.0
    assert after[("tasklet_plan_epoch", ())] == 2 and after[("tasklet_replans_total", ())] == 1
    assert after[("tasklet_is_leader", ())] == 1 and after[("tasklet_peers_live", ())] == 2


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures("processes")
def test_a_live_daemon_serves_metrics_and_the_leader_writes_tensorboard_events(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    cfg = write_small_config(tmp_path, steps=1000, min_peers=2, stages=2,
                             extra=f'[log]\ntensorboard_dir = "{tb}"\n')
    metrics_port, grpc_port = _free_port("127.0.0.2"), _free_port("127.0.0.2")
    url = f"http://127.0.0.2:{metrics_port}/metrics"
    with PeerProcesses(tmp_path, emulate_tflops=0.001) as procs:
        first_key = tmp_path / "peer-0.key"
        addr = procs.start(cfg, "--metrics-port", str(metrics_port), "--port", str(grpc_port),
                           "--identity", str(first_key))
        member_key = tmp_path / "peer-1.key"
        procs.join(addr, 1, "--identity", str(member_key))
        deadline = time.monotonic() + 180
        got: dict = {}
        while time.monotonic() < deadline:
            got = scrape(url)
            if got.get(("tasklet_step", ()), 0) >= 4:
                break
            time.sleep(1.0)
        assert got.get(("tasklet_step", ()), 0) >= 4, f"no training seen in /metrics: {sorted(got)[:40]}"
        # a stranger never gets past the TLS handshake; a member's push for another run: refused and counted
        with pytest.raises(PeerUnreachable), PeerClient(f"127.0.0.2:{grpc_port}", sender="stranger") as client:
            client.push(_activation(), timeout_s=10)
        member = TlsContext(Identity.load(member_key)).trust_only([make_certificate(Identity.load(first_key))])
        with pytest.raises(Refused), PeerClient(f"127.0.0.2:{grpc_port}", TransportConfig(tls=member)) as client:
            client.push(_activation(), timeout_s=10)
        time.sleep(0.5)
        got = scrape(url)
        assert got[("tasklet_loss", ())] > 0 and got[("tasklet_tokens_per_second", ())] > 0
        assert got[("tasklet_plan_epoch", ())] >= 1 and got[("tasklet_peers_live", ())] == 2
        assert got[("tasklet_is_leader", ())] == 1  # the first peer is the oldest: it leads
        sent = {dict(k[1]).get("kind"): v for k, v in got.items() if k[0] == "tasklet_net_sent_bytes_total"}
        received = {dict(k[1]).get("kind"): v for k, v in got.items() if k[0] == "tasklet_net_received_bytes_total"}
        pipeline = ("ACTIVATION", "ACTIVATION_GRAD")
        assert sum(sent.get(k, 0) for k in pipeline) > 0 and sum(received.get(k, 0) for k in pipeline) > 0, sent
        assert sent.get("PROBE", 0) > 0 or received.get("PROBE", 0) > 0, "link probes are counted"
        computed = got[("tasklet_microbatches_computed_total", (("pass", "forward"),))]
        assert computed >= 8, "two stages x 8 micro-batches a step: the first peer computed some"
        refused = sum(v for k, v in got.items() if k[0] == "tasklet_net_refused_messages_total")
        assert refused >= 1
        print(f"first peer after step {got[('tasklet_step', ())]:.0f}: {computed:.0f} forward passes, "
              f"sent {sent}, refused {refused:.0f}")

        events = EventAccumulator(str(tb))
        events.Reload()
        tags = events.Tags()["scalars"]
        assert {"train/loss", "train/tokens_per_s", "train/step_s", "swarm/plan_epoch"} <= set(tags)
        losses = events.Scalars("train/loss")
        assert len(losses) >= 3 and [e.step for e in losses[:3]] == [0, 1, 2]
        assert all(e.value > 0 for e in losses)
        assert all(e.value > 0 for e in events.Scalars("train/tokens_per_s"))
