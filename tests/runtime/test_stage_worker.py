"""A running stage worker (real gRPC on loopback) refuses every kind of bad message with a gRPC status and a
clear message, keeps serving, and its state is untouched; and it follows only the newest plan epoch."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.net.client import PeerClient
from tasklet.peer.runtime.control import Reduce, StartStep, encode
from tasklet.peer.runtime.lead.coordinator import Coordinator
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.worker import StageWorker
from tasklet.peer.runtime.wire import envelope, make_key
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Refused

SPEC = RunSpec(run_id="badinput", model=ModelConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=2)
SHAPE = (SPEC.micro_batch, SPEC.model.seq_len, SPEC.model.d_model)
LIMIT = 4 << 20


def assignment(worker: StageWorker, coordinator: Coordinator, epoch: int) -> Assignment:
    return Assignment(epoch=epoch, stage=1, replica=0, n_stages=2, n_replicas=1, layers=(2, 4),
                      group=(worker.server.endpoint,), coordinator=coordinator.endpoint, prev="127.0.0.1:9")


@contextlib.contextmanager
def running() -> Iterator[tuple[StageWorker, Coordinator, PeerClient]]:
    """A coordinator, a worker and a client pushing to it, all closed after the block."""
    torch.set_num_threads(1)
    coordinator = Coordinator(SPEC)
    coordinator.start()
    worker = StageWorker(max_envelope_bytes=LIMIT)
    worker.start()
    client = PeerClient(worker.server.endpoint, sender="upstream")
    try:
        yield worker, coordinator, client
    finally:
        client.close()
        worker.stop()
        coordinator.close()


@pytest.fixture
def stage() -> Iterator[tuple[StageWorker, Coordinator, PeerClient]]:
    with running() as (worker, coordinator, client):
        coordinator.assign({worker.server.endpoint: assignment(worker, coordinator, epoch=3)})
        client.push(encode(StartStep(0, 0), SPEC.run_id, 3, 0), timeout_s=10)
        yield worker, coordinator, client


def activation(t: torch.Tensor, step: int = 0, mb: int = 0) -> pb.Envelope:
    return envelope(pb.ACTIVATION, make_key(SPEC.run_id, 3, step, mb, 0, 0), {"hidden": t})


def params(worker: StageWorker) -> torch.Tensor:
    assert worker.compute is not None
    return worker.compute.flat_params()


def raw_size_mismatch() -> pb.Envelope:
    env = activation(torch.zeros(SHAPE))
    env.tensors[0].data = env.tensors[0].data[:-4]
    return env


def wrong_version() -> pb.Envelope:
    env = activation(torch.zeros(SHAPE))
    env.protocol_version = PROTOCOL_VERSION + 1
    return env


BAD = {
    "wrong dtype": (lambda: activation(torch.zeros(SHAPE, dtype=torch.float64)), "INVALID_ARGUMENT", "dtype"),
    "wrong shape": (lambda: activation(torch.zeros(2, 8, 8)), "INVALID_ARGUMENT", "shape"),
    "size mismatch": (raw_size_mismatch, "INVALID_ARGUMENT", "bytes"),
    "oversized": (lambda: activation(torch.zeros(LIMIT // 4 + 1024)), None, "bytes"),
    "unknown step": (lambda: activation(torch.zeros(SHAPE), step=7), "FAILED_PRECONDITION", "step 7"),
    "unknown micro-batch": (lambda: activation(torch.zeros(SHAPE), mb=99), "FAILED_PRECONDITION", "micro-batch 99"),
    "wrong protocol version": (wrong_version, "INVALID_ARGUMENT", "version"),
    "NaN": (lambda: activation(torch.full(SHAPE, float("nan"))), "INVALID_ARGUMENT", "NaN"),
    "inf": (lambda: activation(torch.full(SHAPE, float("inf"))), "INVALID_ARGUMENT", "inf"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_message_refused_state_untouched(stage, case: str) -> None:
    worker, _, client = stage
    make, code, needle = BAD[case]
    before = params(worker)
    with pytest.raises(Refused) as err:
        client.push(make(), timeout_s=20)
    if code is not None:
        assert err.value.code == code
    assert needle.lower() in err.value.detail.lower(), err.value.detail
    assert torch.equal(params(worker), before)
    assert worker.stats["forward"] == 0
    # still serving: a good activation is accepted and computed
    client.push(activation(torch.randn(SHAPE)), timeout_s=20)
    deadline = time.monotonic() + 20
    while worker.stats["forward"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.stats["forward"] == 1


def test_the_newest_step_record_a_start_step_carried_shows_in_the_status(stage) -> None:
    worker, _, client = stage
    assert worker.status()["step_record"] is None, "the fixture's start_step carried none"
    client.push(encode(StartStep(0, 1, record="the record of step 0"), SPEC.run_id, 3, 0), timeout_s=10)
    client.push(encode(StartStep(0, 2), SPEC.run_id, 3, 0), timeout_s=10)  # one without: the newest stays
    assert client.status(timeout_s=10)["step_record"] == "the record of step 0"


def test_older_epoch_assignment_is_refused(stage) -> None:
    worker, coordinator, _ = stage
    with pytest.raises(Exception, match="older than this peer's epoch 3"):
        coordinator.assign({worker.server.endpoint: assignment(worker, coordinator, epoch=2)})
    assert worker.assignment is not None and worker.assignment.epoch == 3
    coordinator.assign({worker.server.endpoint: assignment(worker, coordinator, epoch=4)})
    assert worker.assignment.epoch == 4


def test_plans_are_fenced_by_epoch_then_leader(stage) -> None:
    """Two leaders can never both drive a worker: only a plan newer in (epoch, leader id) is taken."""
    worker, coordinator, _ = stage
    ep = worker.server.endpoint

    def plan(epoch: int, leader: str) -> dict[str, Assignment]:
        return {ep: dataclasses.replace(assignment(worker, coordinator, epoch=epoch), leader=leader)}

    coordinator.assign(plan(5, "bbbb"))
    for epoch, leader in ((5, "bbbb"), (5, "aaaa"), (4, "zzzz")):  # the same plan again, or an older one
        with pytest.raises(Exception, match="is not newer"):
            coordinator.assign(plan(epoch, leader))
        assert (worker.assignment.epoch, worker.assignment.leader) == (5, "bbbb")
    coordinator.assign(plan(5, "cccc"))  # equal epoch, larger leader id: newer
    assert (worker.assignment.epoch, worker.assignment.leader) == (5, "cccc")


def test_stop_lets_go_of_a_reduce_waiting_for_a_replica_that_never_sends() -> None:
    """A reduce waits up to REDUCE_WAIT_S (120 s) for the other replicas' shards. Stopping the worker (the peer
    shuts down) abandons it at once: the compute thread ends within the stop, instead of waking two minutes later
    to report through an outbox already closed."""
    with running() as (worker, coordinator, client):
        a = Assignment(epoch=3, stage=0, replica=0, n_stages=1, n_replicas=2, layers=(0, 4),
                       group=(worker.server.endpoint, "127.0.0.1:9"), coordinator=coordinator.endpoint)
        coordinator.assign({worker.server.endpoint: a})
        client.push(encode(StartStep(0, 0), SPEC.run_id, 3, 0), timeout_s=10)
        client.push(encode(Reduce(0, 1, (0, 1), {}), SPEC.run_id, 3, 0), timeout_s=10)
        deadline = time.monotonic() + 10
        while worker.exchange is None or (0, 1) not in worker.exchange._attempts:  # its own shard is in: it waits
            assert time.monotonic() < deadline, "the reduce did not start"
            time.sleep(0.05)
        started = time.monotonic()
    stopped_s = time.monotonic() - started  # the block's end stops the worker
    assert not worker._compute_thread.is_alive(), "the compute thread still waits for shards"
    assert stopped_s < 5.0, f"stop took {stopped_s:.1f} s"
