"""An outsider process against a live swarm (issue #12): every message kind of the service is refused, nothing
changes, and training goes on to the same parameters as undisturbed single-process training.

The swarm: 2 stages x 2 pipelines as worker processes on loopback, driven by a coordinator in this process,
every connection mutual TLS with per-process identities. While it trains, a separate Python process with an
identity of its own (nobody's trust set holds it, it knows no secret) and then a plaintext client try every
Kind as a Push and as a Fetch, a Ping, a Probe and a Status against every worker and the coordinator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from tasklet.peer.emulation.local import LocalSwarm
from tasklet.protocol import tasklet_pb2 as pb
from tests.support.equivalence import PIPELINES, SPEC, STAGES, STEPS, check_equivalent

pytestmark = pytest.mark.usefixtures("processes")

OUTSIDER = r"""
import json, sys
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.tls import TlsContext
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import TransportError

endpoints, run_id = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for mode, tls in (("tls", TlsContext.generate()), ("plaintext", None)):
    for endpoint in endpoints:
        key = pb.Key(run_id=run_id, epoch=1, step=1, stage=0, replica=0)
        with PeerClient(endpoint, TransportConfig(tls=tls), sender="coordinator") as c:
            calls = {f"push {pb.Kind.Name(k)}": lambda k=k: c.push(pb.Envelope(kind=k, key=key), timeout_s=5)
                     for k in pb.Kind.values()}
            calls.update({f"fetch {pb.Kind.Name(k)}": lambda k=k: c.fetch(k, key, timeout_s=5)
                          for k in pb.Kind.values()})
            calls.update({"ping": lambda: c.ping(timeout_s=5), "status": lambda: c.status(timeout_s=5),
                          "probe": lambda: c.probe(4096, timeout_s=5)})
            for name, call in calls.items():
                try:
                    call()
                    outcome = "ACCEPTED"
                except TransportError as exc:
                    outcome = type(exc).__name__
                results[f"{mode} {endpoint} {name}"] = outcome
print(json.dumps(results))
"""


def test_outsider_is_refused_everything_and_training_is_unchanged(reference) -> None:
    outcomes: dict[str, str] = {}
    attacked = threading.Event()

    with LocalSwarm(SPEC, 4) as swarm:
        targets = [*swarm.workers.endpoints, swarm.coordinator.endpoint]

        def attack(report) -> None:
            if report.step != 2 or attacked.is_set():
                return
            attacked.set()
            proc = subprocess.run([sys.executable, "-c", OUTSIDER, json.dumps(targets), SPEC.run_id],
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            outcomes.update(json.loads(proc.stdout.strip().splitlines()[-1]))

        result = swarm.train((STAGES, PIPELINES), STEPS, on_step=attack)
        assert swarm.coordinator.dead == frozenset()
    assert attacked.is_set()
    n_calls = 2 * len(targets) * (2 * len(pb.Kind.values()) + 3)
    assert len(outcomes) == n_calls
    accepted = [name for name, outcome in outcomes.items() if outcome == "ACCEPTED"]
    assert accepted == [], accepted
    # refused in the TLS handshake: the outsider never reached a handler
    assert set(outcomes.values()) == {"PeerUnreachable"}
    check_equivalent(result, reference)
