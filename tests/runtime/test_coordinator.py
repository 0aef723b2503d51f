"""The coordinator on its own, over real gRPC on loopback, against scripted workers.

A scripted worker does no compute: it is a real gRPC server that answers the coordinator's control messages
the way a one-stage pipeline would (lease, report a loss, commit; ``reduced``; ``synced``), records what it
was told, and can misbehave on cue (commit twice, die holding a lease, fail its averaging). That isolates the
coordinator's own rules — exactly-once commits, requeueing a dead pipeline's work, apply only after every
stage reduced, strict decoding of reports — from the stage workers' compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tasklet.peer.net.client import PeerClient
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.lead.coordinator import Coordinator, StepFailedError
from tasklet.peer.runtime.lead.pacing import SAT_OUT_DECAY
from tasklet.peer.runtime.wire import make_key
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Refused, TransportError
from tests.support.scripted import EPOCH, SPEC, Script, ScriptedWorker


@pytest.fixture
def swarm(request) -> Iterator[tuple[Coordinator, list[ScriptedWorker]]]:
    """A coordinator (liveness checks every 0.2 s) and two one-stage pipelines of scripted workers."""
    scripts: list[Script] = getattr(request, "param", [Script(), Script()])
    coordinator = Coordinator(SPEC, liveness_interval_s=0.2)
    coordinator.start()
    workers = [ScriptedWorker(s) for s in scripts]
    try:
        endpoints = [w.start() for w in workers]
        pipelines = [[d] for d in range(len(workers))]
        coordinator.assign(build_assignments(SPEC, [(0, 2)], pipelines, endpoints, coordinator.endpoint, EPOCH))
        yield coordinator, workers
    finally:
        coordinator.close()
        for w in workers:
            w.stop()

def observe(coordinator: Coordinator) -> list[tuple[str, dict, bool]]:
    """Record every event, and whether the coordinator's lock was free while its observer ran."""
    seen: list[tuple[str, dict, bool]] = []

    def lock_is_free() -> bool:
        got: list[bool] = []

        def probe() -> None:  # another thread: an RLock held by the observer's own thread would let it in
            if coordinator._cond.acquire(timeout=2.0):
                coordinator._cond.release()
                got.append(True)
            else:
                got.append(False)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return got[0]

    coordinator.on_event = lambda name, info: seen.append((name, info, lock_is_free()))
    return seen

def test_step_commits_each_microbatch_once_and_applies_after_every_stage_reduced(swarm) -> None:
    coordinator, workers = swarm
    events = observe(coordinator)
    report = coordinator.run_step(0, timeout_s=30)
    assert sum(report.microbatches_per_pipeline.values()) == SPEC.n_microbatches
    assert report.loss == pytest.approx(sum(range(SPEC.n_microbatches)) / SPEC.n_microbatches)
    assert report.requeued == 0 and report.dropped_pipelines == []
    committed = sorted(i["microbatch"] for n, i, _ in events if n == "commit" and i["result"] == "committed")
    assert committed == list(range(SPEC.n_microbatches)), "every micro-batch committed exactly once"
    assert all(free for _, _, free in events), "an observer was called with the coordinator's lock held"
    reduces = []
    for w in workers:
        assert w.ops() == [ctl.Op.START_STEP, ctl.Op.REDUCE, ctl.Op.APPLY]
        reduce = next(m for _, m in w.received if isinstance(m, ctl.Reduce))
        reduces.append(reduce)
        assert reduce.participants == (0, 1)
        assert sorted(reduce.assignment) == list(range(SPEC.n_microbatches))
        assert sum(1 for p in reduce.assignment.values() if p == w.assignment.assignment.replica) == \
            report.microbatches_per_pipeline.get(w.assignment.assignment.replica, 0)
    assert reduces[0] == reduces[1], "both stages got the same commit record"
    last_reduced = max(w.reduced_at for w in workers if w.reduced_at is not None)
    applied = [t for w in workers for t, m in w.received if isinstance(m, ctl.Apply)]
    assert min(applied) > last_reduced, "apply went out before every stage had reduced"

def test_the_leaders_step_record_goes_out_with_every_start_step_over_the_wire(swarm) -> None:
    """The record of the steps trained so far reaches each worker before the step it could apply (a takeover's
    bound, peer.node.step_record): set on the coordinator between steps, carried by the next start_step."""
    coordinator, workers = swarm
    coordinator.run_step(0, timeout_s=30)
    coordinator.note_trained("signed record of 1 step")
    coordinator.run_step(1, timeout_s=30)
    for w in workers:
        starts = [m for _, m in w.received if isinstance(m, ctl.StartStep)]
        assert [(m.step, m.record) for m in starts] == [(0, ""), (1, "signed record of 1 step")]


@pytest.mark.parametrize("swarm", [[Script(commit_twice=True), Script(commit_twice=True)]], indirect=True)
def test_duplicate_commit_is_answered_as_such_and_not_counted(swarm) -> None:
    coordinator, workers = swarm
    report = coordinator.run_step(0, timeout_s=30)
    replies = [r for w in workers for r in w.commit_replies]
    assert replies.count("committed") == SPEC.n_microbatches
    assert replies.count("duplicate") == SPEC.n_microbatches
    assert sum(report.microbatches_per_pipeline.values()) == SPEC.n_microbatches

def test_a_pipeline_paced_out_of_a_step_stays_out_of_the_next(swarm) -> None:
    # pipeline 1 measured 30 s per micro-batch: it would not finish one before pipeline 0 finishes them all.
    # It leases nothing, so this step measures nothing for it: its figure is carried over (shrunk), not
    # forgotten; forgetting it would hand the slow pipeline work again every other step.
    coordinator, _ = swarm
    coordinator.pacing.pipeline_service_s = (coordinator.epoch, {0: 0.001, 1: 30.0})
    reports = [coordinator.run_step(step, timeout_s=30) for step in (0, 1)]
    assert [r.microbatches_per_pipeline for r in reports] == [{0: SPEC.n_microbatches}] * 2
    epoch, figures = coordinator.pacing.pipeline_service_s
    assert epoch == coordinator.epoch and figures[1] == pytest.approx(30.0 * SAT_OUT_DECAY**2)
    assert 0 < figures[0] < 1.0, "the pipeline that worked is measured afresh"

_first_lease = threading.Event()

@pytest.mark.parametrize(
    "swarm",
    [[Script(wait_before_leasing=_first_lease), Script(die_after_leases=1, leased_first=_first_lease)]],
    indirect=True,
)
def test_dead_pipeline_work_is_requeued_and_the_step_finishes_without_it(swarm) -> None:
    coordinator, workers = swarm
    # the death path, not speculation: an idle pipeline 0 would copy the dead one's micro-batch after 0.25 s
    # (scripted commits take milliseconds), often before the liveness checks find the death
    coordinator.pacing.speculation = False
    events = observe(coordinator)
    report = coordinator.run_step(0, timeout_s=30)
    assert workers[1].dead
    assert report.dropped_pipelines == [1]
    assert report.requeued >= 1
    assert report.microbatches_per_pipeline == {0: SPEC.n_microbatches}, "the survivor redid the lost work"
    names = [n for n, _, _ in events]
    # "dead" is emitted by the thread that found the death, "requeue" by the step loop: either may come first
    assert "dead" in names and "requeue" in names
    assert names.index("requeue") < names.index("reduce"), "the lost work was requeued before the averaging"
    requeued = next(i for n, i, _ in events if n == "requeue")
    assert requeued["pipeline"] == 1 and requeued["microbatches"]
    assert all(free for _, _, free in events)
    reduce = next(m for _, m in workers[0].received if isinstance(m, ctl.Reduce))
    assert reduce.participants == (0,)
    assert coordinator.dead == {workers[1].server.endpoint}
    assert "liveness" in coordinator.dead_reasons[workers[1].server.endpoint]

@pytest.mark.parametrize("swarm", [[Script(), Script(fail_reduce=True)]], indirect=True)
def test_error_while_averaging_fails_the_step(swarm) -> None:
    coordinator, _ = swarm
    with pytest.raises(StepFailedError, match="boom"):
        coordinator.run_step(0, timeout_s=30)

def _report(control: bytes, epoch: int = EPOCH, kind: int = pb.CONTROL) -> pb.Envelope:
    """A report envelope whose ``control`` field (8) holds these raw bytes: what a hostile peer can send (fields
    this version does not know travel as protobuf's unknown fields)."""
    head = pb.Envelope(kind=kind, key=make_key(SPEC.run_id, epoch, 0, stage=0, replica=0)).SerializeToString()
    return pb.Envelope.FromString(head + b"\x42" + bytes([len(control)]) + control)


def _op(msg: ctl.Message) -> bytes:
    return msg.to_pb().SerializeToString()


BAD_REPORTS = {
    "no operation": (_report(b""), "INVALID_ARGUMENT", "holds no operation"),
    "an operation of a later version": (_report(b"\xa0\x06\x01"), "INVALID_ARGUMENT", "holds no operation"),
    "a worker's op": (_report(_op(ctl.StartStep(0))), "INVALID_ARGUMENT", "not accepted here"),
    "the pool's reply as a report": (_report(b"\x6a\x02\x08\x01"), "INVALID_ARGUMENT", "not a control operation"),
    "not Kind CONTROL": (_report(_op(ctl.Loss(0, 1, 1.0)), kind=pb.OTHER), "FAILED_PRECONDITION", "takes no OTHER"),
    "stale epoch": (_report(_op(ctl.Loss(0, 1, 1.0)), epoch=0), "FAILED_PRECONDITION", "epoch 0"),
}

@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_malformed_report_is_refused_naming_the_field_and_changes_nothing(swarm, case: str) -> None:
    coordinator, _ = swarm
    env, code, needle = BAD_REPORTS[case]
    with PeerClient(coordinator.endpoint, sender="hostile") as client:
        with pytest.raises(Refused) as err:
            client.push(env, timeout_s=10)
        assert err.value.code == code
        assert needle in err.value.detail, err.value.detail
        # a fetch of a Kind that is no task pool operation is refused the same way
        with pytest.raises(TransportError, match="serves no"):
            client.fetch(pb.OTHER, make_key(SPEC.run_id, EPOCH, 0), timeout_s=10)
    assert coordinator.dead == frozenset()
    report = coordinator.run_step(0, timeout_s=30)  # the coordinator still works
    assert sum(report.microbatches_per_pipeline.values()) == SPEC.n_microbatches


@pytest.mark.parametrize("swarm", [[Script(), Script(hold_s={0: 0.8})]], indirect=True)
def test_a_plans_first_step_speculates_on_nothing_without_a_prediction_or_a_finished_step(swarm) -> None:
    # a healthy pipeline on longer links is slower than the others from its first micro-batch on; before one step
    # has measured head latencies (and with no predicted figure) nobody can tell it from a straggler, so it is
    # neither copied nor given up on. The lease-to-commit times of the fast pipeline's first commits are no
    # yardstick for its head (CI: the headline bench's step 0 gave up such a pipeline against them).
    coordinator, _ = swarm
    report = coordinator.run_step(0, timeout_s=30)
    assert report.dropped_pipelines == [] and report.requeued == 0 and report.speculated == 0
    assert set(report.commits.values()) == {0, 1}, "the slower pipeline's work counted"


@pytest.mark.parametrize("swarm", [[Script(hold_s={1: 0.15}), Script(hold_s={0: 3.0}, resync_delay_s=0.5)]],
                         indirect=True)
def test_an_overtaken_pipeline_reloads_in_the_background_and_joins_a_later_step_in_sync(swarm) -> None:
    # pipeline 1 holds its micro-batch 3 s in step 0: pipeline 0 copies it and wins, pipeline 1 is dropped. Its
    # worker reloads the stage (0.5 s) without holding the step's end; step 1 starts without it (no start_step,
    # no lease, not in a reduce while out of sync) and it joins step 1 once it reported the stage in sync.
    coordinator, (fast, slow) = swarm
    coordinator.pacing.predicted_mb_s = 0.05  # speculation on: overdue after the 0.25 s floor
    events = observe(coordinator)
    first = coordinator.run_step(0, timeout_s=30)
    ended = time.monotonic()
    assert first.dropped_pipelines == [1] and first.speculation_won == 1
    assert set(first.commits.values()) == {0} and sorted(first.commits) == list(range(SPEC.n_microbatches))
    assert slow.resynced_at is None, "the step ended without waiting for the overtaken pipeline to reload"
    deadline = time.monotonic() + 5.0
    while not any(isinstance(m, ctl.Resync) for _, m in slow.received) and time.monotonic() < deadline:
        time.sleep(0.01)  # told in the background
    resync = next(m for _, m in slow.received if isinstance(m, ctl.Resync))
    assert (resync.trained_steps, resync.source) == (1, fast.server.endpoint)
    coordinator.pacing.speculation = False  # step 1: pipeline 0 is slowish (0.15 s a micro-batch), not to be copied
    second = coordinator.run_step(1, timeout_s=30)
    assert slow.resynced_at is not None and slow.started[1] > slow.resynced_at, "started only once in sync"
    assert slow.started[1] > ended + 0.3, "step 1 started without it"
    reduce = next(m for _, m in slow.received if isinstance(m, ctl.Reduce) and m.step == 1)
    assert reduce.participants == (0, 1), "in sync again: it joined step 1"
    assert sorted(second.commits) == list(range(SPEC.n_microbatches)) and second.dropped_pipelines == []
    background = [i for n, i, _ in events if n == "resync"]
    assert background == [{"step": 0, "endpoints": [slow.server.endpoint], "background": True}]
    assert coordinator.wait_in_sync(timeout_s=1.0)


@pytest.mark.parametrize("swarm", [[Script(hold_s={2: 0.3}), Script(hold_s={0: 3.0}, resync_delay_s=1.5)]],
                         indirect=True)
def test_a_pipeline_still_reloading_when_a_step_ends_is_told_the_newer_step_and_joins_only_in_sync(swarm) -> None:
    # pipeline 1 is overtaken in step 0; its reload (1.5 s) outlasts step 1, which it sits out: at step 1's end it
    # is told to reload step 2's parameters instead, and joins step 2 only once it reports those
    coordinator, (fast, slow) = swarm
    coordinator.pacing.predicted_mb_s = 0.05
    assert coordinator.run_step(0, timeout_s=30).dropped_pipelines == [1]
    coordinator.pacing.speculation = False
    second = coordinator.run_step(1, timeout_s=30)
    assert slow.resynced_at is None and 1 not in slow.started, "step 1 ran without the pipeline out of sync"
    assert sorted(second.commits) == list(range(SPEC.n_microbatches)) and set(second.commits.values()) == {0}
    third = coordinator.run_step(2, timeout_s=30)
    told = [m.trained_steps for _, m in slow.received if isinstance(m, ctl.Resync)]
    assert told == [1, 2], "told again, to the newer step, when step 1 ended"
    assert 2 in slow.started and slow.started[2] > slow.resynced_at
    assert [m.participants for _, m in slow.received if isinstance(m, ctl.Reduce)] == [(0, 1)], "only step 2's"
    assert sorted(third.commits) == list(range(SPEC.n_microbatches))
    assert coordinator.wait_in_sync(timeout_s=2.0)


_hang = threading.Event()

@pytest.mark.parametrize("swarm", [[Script(hang_start_step=_hang), Script()]], indirect=True)
def test_a_broadcast_stops_waiting_for_a_peer_once_it_is_declared_dead(swarm) -> None:
    # a partition cut the peer while its start_step was on the way: its pings may still be answered from a
    # buffer for a while, but once liveness declares it dead the broadcast must not hold the step for the
    # whole control timeout (30 s) waiting for its answer
    coordinator, workers = swarm
    hung = workers[0].server.endpoint
    done = threading.Event()
    sender = threading.Thread(target=lambda: (coordinator._broadcast([hung], ctl.StartStep(0, 0), 0), done.set()),
                              daemon=True)
    try:
        sender.start()
        deadline = time.monotonic() + 10
        while 0 not in workers[0].started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 0 in workers[0].started, "the start_step never reached the worker"
        assert not done.wait(1.0), "the broadcast returned without an answer from a live peer"
        declared = time.monotonic()
        coordinator.declare_dead(hung, "cut off (test)")
        assert done.wait(5.0), "the broadcast still waits for a peer declared dead"
        assert time.monotonic() - declared < 2.0
    finally:
        _hang.set()
        sender.join(timeout=5)
