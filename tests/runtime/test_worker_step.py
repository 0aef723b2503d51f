"""The peer side of a step without gRPC or threads: :class:`WorkerStep`'s transitions one by one, then whole
steps of 2 pipelines x 2 stages in virtual time with a death injected at every boundary between transitions.

The virtual run (``tests/support/virtual_run.py``) wires the real parts of a worker — :class:`Intake`,
:class:`ComputeLoop`, :class:`GradientSync`, :class:`WorkerStep` and a tiny real :class:`StageCompute` — through
a fake outbox that delivers each message to its receiver's intake at once, and plays the coordinator's side
(task pool, drop, new attempt, reduce, apply, a new leader's assignment; a DiLoCo inner step's reduce and apply as
one round, as the step machine sends them) itself. One transition is one queued task run, one reduce phase of one
replica, or one coordinator action; a death of each participant (every worker, and the coordinator) is injected
right before and right after each of them. Whatever the moment, the run must account every micro-batch exactly
once: no replica reports an error, the replicas of a stage agree bitwise, and their parameters match a clean run's.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.reference import train_diloco_reference
from tasklet.peer.compute.stage import StageCompute, StageComputeConfig
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.stage.exchange import GradientExchange
from tasklet.peer.runtime.stage.outbox import DeviceClock
from tasklet.peer.runtime.stage.step import Phase, Work, WorkerStep
from tasklet.peer.runtime.stage.sync import GradientSync
from tasklet.peer.runtime.wire import envelope
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor
from tasklet.protocol.errors import Rejected
from tests.support.virtual_run import (
    COORDINATOR,
    COORDINATOR_DIES,
    ENDPOINTS,
    PIPELINES,
    SPEC,
    STAGES,
    VirtualClock,
    VirtualRun,
    done_future,
    no_load,
)

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------- WorkerStep alone
def started(step: int = 0, attempt: int = 0) -> WorkerStep:
    s = WorkerStep()
    s.reset(pipeline=1)
    s.start_step(step, attempt, trained_steps=step)
    return s


def test_start_step_refuses_an_older_step_a_step_not_trained_to_and_a_step_dropped_from() -> None:
    s = started(3)
    with pytest.raises(Rejected, match="before the current step 3"):
        s.start_step(2, 0, trained_steps=3)
    with pytest.raises(Rejected, match="has trained 3 steps"):
        s.start_step(5, 0, trained_steps=3)
    s.drop(3)
    with pytest.raises(Rejected, match="pipeline 1 was dropped from step 3"):
        s.start_step(3, 1, trained_steps=3)
    s.start_step(4, 0, trained_steps=4)  # the next step starts clean
    assert (s.step, s.attempt, s.dropped, s.phase) == (4, 0, False, Phase.RUNNING)


def test_a_new_round_of_the_step_keeps_its_micro_batches_and_resets_the_in_flight_count() -> None:
    s = started(0)
    s.start_step(0, 0, 0, feed=True)
    s.lease(0, 0, 5)
    s.start_step(0, 1, 0, feed=True)
    assert (s.attempt, s.inflight, s.known) == (1, 0, {5})
    with pytest.raises(Rejected, match="no longer feeding step 0 attempt 0"):
        s.lease(0, 0, 6)  # the feeder of the abandoned attempt stops


def test_a_step_with_a_gradient_awaiting_apply_cannot_be_left() -> None:
    s = started(0)
    s.reduced(0, torch.zeros(2))
    with pytest.raises(Rejected, match="cannot start step 1"):
        s.start_step(1, 0, trained_steps=1)


def test_activations_and_gradients_are_taken_once_per_micro_batch_and_never_for_a_dropped_step() -> None:
    s = started(2)
    with pytest.raises(Rejected, match="step 1 is not the current step 2"):
        s.take_activation(1, 0)
    s.take_activation(2, 0)
    with pytest.raises(Rejected, match="already forwarded"):
        s.take_activation(2, 0)
    with pytest.raises(Rejected, match="never forwarded"):
        s.take_grad(2, 1)
    s.take_grad(2, 0)
    with pytest.raises(Rejected, match="already arrived"):
        s.take_grad(2, 0)
    s.drop(2)
    assert s.phase is Phase.DROPPED and s.known == set()
    with pytest.raises(Rejected, match="dropped from step 2"):
        s.take_activation(2, 3)
    assert not s.runs(Work.FORWARD, 2) and not s.runs(Work.BACKWARD, 2) and s.runs(Work.REDUCE, 2)
    assert not s.runs(Work.APPLY, 1)
    # left out of steps 3 and 4 (no start_step while syncing), it is told to reload their results
    assert s.runs(Work.RESYNC, 3) and s.runs(Work.RESYNC, 4) and s.runs(Work.RESYNC, 2)
    assert not s.runs(Work.RESYNC, 1) and not s.runs(Work.REDUCE, 3)


def test_shards_of_a_stale_or_far_round_are_refused() -> None:
    s = started(0, attempt=3)
    s.check_shard(0, 3)
    s.check_shard(0, 5)
    with pytest.raises(Rejected, match="attempt 2 is not within 2 of the current attempt 3"):
        s.check_shard(0, 2)
    with pytest.raises(Rejected, match="attempt 6"):
        s.check_shard(0, 6)
    with pytest.raises(Rejected, match="step 1 is not the current step 0"):
        s.check_shard(1, 3)


def test_a_shard_that_ran_ahead_of_this_peers_own_start_is_early_not_refused_at_once() -> None:
    s = started(4, attempt=0)
    # a restart's reduce (attempt 3) from a replica that heard of the restart (attempt 2) before this peer did
    assert s.early(4, 3) and s.early(4, 4)
    assert not s.early(4, 2) and not s.early(4, 5)  # within the window already; or more than one restart ahead
    assert s.early(5, 1) and not s.early(5, 5) and not s.early(6, 1) and not s.early(3, 1)  # the next step only
    s.start_step(4, 2, trained_steps=4)
    assert not s.early(4, 3)
    s.check_shard(4, 3)


def test_reduce_needs_the_started_step_and_exactly_the_committed_micro_batches() -> None:
    s = started(0)
    with pytest.raises(Rejected, match="a reduce of step 1, the current step is 0"):
        s.check_accumulated(1, [0], [0])
    with pytest.raises(Rejected, match=r"accumulator holds micro-batches \[0, 1\], the pool committed \[1\] for "
                                       r"pipeline 1"):
        s.check_accumulated(0, [1], [1, 0])
    assert s.check_accumulated(0, [2, 0], [0, 2]) == [0, 2]


def test_apply_needs_a_reduced_gradient_once_and_a_repeat_only_re_reports() -> None:
    s = started(0)
    with pytest.raises(Rejected, match="apply of step 0, but no reduced gradient"):
        s.apply(0, trained_steps=0)
    s.reduced(0, torch.ones(3), count=2)
    summed, count = s.apply(0, trained_steps=0) or (None, None)
    assert torch.equal(summed, torch.ones(3)) and count == 2 and s.pending_apply == 0
    s.applied(0)
    with pytest.raises(Rejected, match="was not awaiting apply"):
        s.applied(0)  # a second apply of the same gradient
    assert s.apply(0, trained_steps=1) is None  # a repeated apply after success: nothing to apply
    with pytest.raises(Rejected, match="apply of step 3"):
        s.apply(3, trained_steps=1)


def test_the_outer_round_takes_its_average_once_and_only_for_the_current_step() -> None:
    s = started(1)
    with pytest.raises(Rejected, match="outer round of step 0"):
        s.outer_round(0, 1)
    s.outer_round(1, 2)
    s.outer_round(1, 1)
    assert s.attempt == 2  # a restart never goes back
    s.outer_reduced(1, torch.ones(2), torch.zeros(2))
    assert s.phase is Phase.OUTER_REDUCED
    assert s.take_outer(0) is None and s.outer_pending is None  # a mismatched apply loses it
    s.outer_reduced(1, torch.ones(2), torch.zeros(2))
    assert s.take_outer(1) is not None and s.take_outer(1) is None


def test_an_overlapped_outer_round_stays_in_flight_while_the_next_step_runs() -> None:
    s = started(1)
    s.outer_round(1, 2)  # the round of step 1 starts; then step 2 (the worker trained step 1) starts beside it
    s.start_step(2, 0, trained_steps=2, feed=True)
    assert s.outer_live and s.outer_step == 1 and s.attempt == 0
    s.check_shard(1, 2)  # the round's shards still fit, by the round's attempt ...
    s.check_shard(2, 0)  # ... and the new step's by its own
    with pytest.raises(Rejected, match="attempt 1 is not within 2 of the current attempt 2"):
        s.check_shard(1, 1)
    assert s.runs(Work.REDUCE, 1) and s.runs(Work.APPLY, 1)  # its restart and its landing are not stale
    assert not s.runs(Work.FORWARD, 1)
    s.outer_round(1, 3)  # restarted after a death while step 2 computes
    with pytest.raises(Rejected, match="attempt 2"):
        s.outer_reduced(1, torch.ones(2), torch.zeros(2), attempt=2)  # the abandoned attempt's late result
    s.outer_reduced(1, torch.ones(2), torch.zeros(2), attempt=3)
    with pytest.raises(Rejected, match="outer round of step 0"):
        s.outer_round(0, 4)
    assert s.take_outer(1) is not None
    assert not s.outer_live and not s.runs(Work.REDUCE, 1)
    with pytest.raises(Rejected, match="step 1 is not the current step 2"):
        s.check_shard(1, 3)
    s.reset(0)
    assert not s.outer_live


def test_a_new_assignment_forgets_the_step() -> None:
    s = started(4)
    s.reduced(4, torch.ones(1))
    s.reset(pipeline=0)
    assert (s.step, s.pending, s.phase, s.pipeline) == (-1, None, Phase.IDLE, 0)


# -------------------------------------------------------------------------------------- virtual run
@pytest.fixture(autouse=True)
def _no_real_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reduce that would wait for a message never sent fails at once (as a reported error) instead of
    after REDUCE_WAIT_S: the virtual run only resumes a reduce phase whose messages are all there."""
    monkeypatch.setattr("tasklet.peer.runtime.stage.sync.REDUCE_WAIT_S", 0.0)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.from_stdlib(max_bytes=1 << 16)


@pytest.fixture(scope="module")
def clean(corpus: Corpus) -> dict[str, torch.Tensor]:
    """Each stage's parameters after one clean step of the virtual run."""
    run = VirtualRun(SPEC, corpus)
    run.begin(0)
    run.run_to_end()
    return {ep: n.t.compute.flat_params().clone() for ep, n in run.nodes.items() if n.t is not None}


def _errors(run: VirtualRun) -> list[Any]:
    return [(ep, m) for ep, m in run.log if isinstance(m, ctl.TaskError)]


def _clean_ticks(corpus: Corpus) -> int:
    run = VirtualRun(SPEC, corpus)
    run.begin(0)
    n = 0
    while run.tick():
        n += 1
    return n


def test_a_clean_step_emits_the_expected_commands(corpus: Corpus, clean: dict[str, torch.Tensor]) -> None:
    run = VirtualRun(SPEC, corpus)
    run.begin(0)
    run.run_to_end()
    assert _errors(run) == [] and not run.failed
    assert sorted(run.pool.record) == [0, 1, 2, 3]
    for p in range(2):
        first, last = run.pipeline_nodes(p)
        share = sorted(mb for mb, q in run.pool.record.items() if q == p)
        assert sorted(mb for to, kind, _, mb in first.outbox.sent if kind == "ACTIVATION") == share
        assert sorted(mb for to, kind, _, mb in last.outbox.sent if kind == "ACTIVATION_GRAD") == share
        assert sorted(m.microbatch for m in last.outbox.reports if isinstance(m, ctl.Loss)) == share
        for node in (first, last):
            assert [type(m).__name__ for m in node.outbox.reports if not isinstance(m, ctl.Loss)] == [
                "Reduced", "Synced"]
            # the contribution, the summed shard, the all-gather digest
            assert [k for _, k, _, _ in node.outbox.sent if k.endswith("SHARD")] == [
                "GRAD_SHARD", "PARAM_SHARD", "PARAM_SHARD"]
    for stage in range(2):
        a, b = (run.nodes[ENDPOINTS[PIPELINES[p][stage]]] for p in range(2))
        assert run.synced[a.endpoint] == run.synced[b.endpoint] and run.synced[a.endpoint][0] == 1


VICTIMS = [*ENDPOINTS, COORDINATOR_DIES]


@pytest.mark.parametrize("victim", VICTIMS)
def test_a_death_before_or_after_any_transition_keeps_every_micro_batch_counted_once(
    corpus: Corpus, clean: dict[str, torch.Tensor], victim: str
) -> None:
    """Boundary ``k`` is right after transition ``k`` and right before ``k + 1``: every one is tried."""
    ticks = _clean_ticks(corpus)
    assert ticks > 30
    for k in range(ticks + 1):
        run = VirtualRun(SPEC, corpus)
        run.begin(0)
        for _ in range(k):
            run.tick()
        applied_before = {ep for ep, (trained, _) in run.synced.items() if trained == 1}
        run.kill(victim)
        run.run_to_end()
        where = f"{victim} dies after transition {k}"
        assert _errors(run) == [], where
        survivors = [n for n in run.live() if n.t is not None]
        if run.failed:
            assert not applied_before, where
            assert all(n.t.compute.step == 0 for n in survivors), where  # type: ignore[union-attr]
            continue
        took_step = [n for n in survivors if n.t.compute.step == 1]  # type: ignore[union-attr]
        assert took_step, where
        for node in took_step:  # exactly once: the sum of every micro-batch's gradient, once, as a clean run
            assert node.t is not None
            assert torch.allclose(node.t.compute.flat_params(), clean[node.endpoint], atol=1e-6), where
            assert [type(m).__name__ for m in node.outbox.reports].count("Synced") == 1, where
        for stage in range(2):
            hashes = {run.synced[n.endpoint][1] for n in took_step if n.t.assignment.stage == stage}  # type: ignore[union-attr]
            assert len(hashes) <= 1, where
        for node in survivors:
            if node not in took_step:  # a dropped pipeline's survivor: its work thrown away, nothing applied
                assert node.t is not None and node.t.compute.accumulated() == set(), where
                assert node.step.dropped and not any(
                    isinstance(m, ctl.Synced) for m in node.outbox.reports), where
        if not applied_before:
            assert sorted(run.pool.record) == [0, 1, 2, 3], where


# -------------------------------------------------------------------------------------------- DiLoCo
DILOCO = replace(SPEC, run_id="virtual-diloco", sync_period=2, outer_lr=0.7, outer_momentum=0.9)


_REFERENCES: dict[str, dict[int, dict[str, torch.Tensor]]] = {}


def _reference(record: list[dict[str, Any]], corpus: Corpus) -> dict[int, dict[str, torch.Tensor]]:
    """The single-process replay of ``record`` (many deaths leave the same record: replayed once)."""
    key = json.dumps(record, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_diloco_reference(DILOCO, record, STAGES, corpus)[0]
    return _REFERENCES[key]


@pytest.mark.parametrize("victim", [ENDPOINTS[1], ENDPOINTS[2], COORDINATOR_DIES])
def test_diloco_a_death_in_the_round_s_last_inner_step_or_its_outer_round(corpus: Corpus, victim: str) -> None:
    """Inner step 0 runs clean; a death at every boundary of inner step 1 and the outer round after it. The
    dropped pipeline sits out the rest of the round; the outer average covers the others once."""
    base = VirtualRun(DILOCO, corpus)
    base.begin(0)
    base.run_to_end()
    base.begin(1)
    ticks = 0
    while base.tick():
        ticks += 1
    assert base.phase == "outer-apply" and base.records[-1]["outer"] == [0, 1]
    for k in range(0, ticks + 1, 2):
        run = VirtualRun(DILOCO, corpus)
        run.begin(0)
        run.run_to_end()
        run.begin(1)
        for _ in range(k):
            run.tick()
        run.kill(victim)
        run.run_to_end()
        where = f"{victim} dies after transition {k} of step 1"
        assert _errors(run) == [], where
        if run.failed:
            continue
        record = run.records
        if record[-1]["outer"] is None:  # the outer round never completed: nothing averaged
            continue
        ref = _reference(record, corpus)
        for p in record[-1]["outer"]:
            for node in [n for n in run.pipeline_nodes(p) if n.alive]:
                assert node.t is not None
                for name, value in node.t.compute.named_params().items():
                    assert torch.allclose(value, ref[p][name], atol=1e-5), (where, p, name)


# --------------------------------------------------------------------------------------------- the seams
def test_a_busy_gpu_is_a_clock_that_slows_ops_from_its_step_on_in_virtual_time() -> None:
    from tasklet.peer.emulation.faults import BusyGpuClock
    from tasklet.peer.emulation.network import DeclaredSpeedClock

    class VirtualBusyClock(BusyGpuClock, VirtualClock):
        def __init__(self, tflops: float) -> None:
            BusyGpuClock.__init__(self, tflops)
            VirtualClock.__init__(self)

    a = replace(build_assignments(SPEC, STAGES, PIPELINES, ENDPOINTS, COORDINATOR)[ENDPOINTS[0]],
                forward_flops=1e6)
    clock = VirtualBusyClock(1e-6)  # a forward takes 1 s
    assert clock.finish(a, 1, clock.now(), 2.0) == (2.0, False)  # healthy before BUSY_FROM_STEP
    start = clock.now()
    assert clock.finish(a, BusyGpuClock.BUSY_FROM_STEP, start, 1.0) == (BusyGpuClock.BUSY_SLOWDOWN, False)
    start = clock.now()
    clock.t += 3.0  # the op itself took longer than its emulated time
    assert DeclaredSpeedClock.finish(clock, a, 0, start, 1.0) == (3.0, True)
    assert DeviceClock.finish(clock, a, 0, clock.now(), 1.0) == (0.0, False)  # a real device only measures


def test_a_tampering_outbox_changes_only_the_gradients_it_sends() -> None:
    from tasklet.peer.emulation.faults import HUGE_GRAD_FACTOR, HugeGradOutbox, NanGradOutbox

    class Capture:
        def __init__(self) -> None:
            self.envs: list[pb.Envelope] = []

        def push_async(self, env: pb.Envelope, timeout_s: float) -> Future[None]:
            self.envs.append(env)
            return done_future()

    key = pb.Key(run_id="r", step=0)
    huge = torch.full((4,), 2.0 * HUGE_GRAD_FACTOR)
    for cls, kinds, check in ((NanGradOutbox, (pb.ACTIVATION_GRAD, pb.GRAD_SHARD), lambda x: bool(x.isnan().all())),
                              (HugeGradOutbox, (pb.GRAD_SHARD,), lambda x: bool(torch.equal(x, huge)))):
        outbox, sink = cls.__new__(cls), Capture()
        outbox.client = lambda endpoint, sink=sink: sink  # type: ignore[method-assign]
        outbox.stopped = threading.Event()
        for kind in (pb.ACTIVATION, pb.ACTIVATION_GRAD, pb.GRAD_SHARD):
            outbox.send(None, "peer:1", envelope(kind, key, {"grad": torch.full((4,), 2.0)}))  # type: ignore[arg-type]
        for env in sink.envs:
            x = decode_tensor(env.tensors[0], allow_nonfinite=True)
            assert check(x) if env.kind in kinds else torch.equal(x, torch.full((4,), 2.0)), (cls, env.kind)


def test_a_laggard_several_steps_behind_reloads_the_told_step_and_never_goes_back() -> None:
    """Its earlier reloads outlasted steps: told the newest step, it loads that state whatever it holds now; a
    resync to a step older than its own is refused."""
    compute = StageCompute(StageComputeConfig(ModelConfig(n_layers=1, d_model=8, n_heads=2, seq_len=4), 0, 1))
    compute.step = 2
    loads: list[tuple[str, int]] = []

    def load(c: StageCompute, source: str, _spec: object, _a: object, trained: int) -> None:
        loads.append((source, trained))
        c.step = trained

    sent: list[ctl.Message] = []
    outbox = SimpleNamespace(report=lambda _t, msg: sent.append(msg))
    sync = GradientSync(WorkerStep(), threading.Condition(), outbox, lambda: "me", load)  # type: ignore[arg-type]
    t = SimpleNamespace(assignment=SimpleNamespace(group=["me", "other"]), compute=compute, spec=None, outer=None)
    sync.resync(t, 4, ctl.Resync(4, 5, "other"))  # type: ignore[arg-type]
    assert loads == [("other", 5)] and compute.step == 5
    [synced] = sent
    assert isinstance(synced, ctl.Synced) and synced.trained_steps == 5
    with pytest.raises(Rejected, match="this stage has trained 5 steps"):
        sync.resync(t, 3, ctl.Resync(3, 4, "other"))  # type: ignore[arg-type]
    with pytest.raises(Rejected, match="not another replica"):
        sync.resync(t, 5, ctl.Resync(5, 6, "me"))  # type: ignore[arg-type]


def _lone_stage(n_stages: int) -> tuple[GradientSync, SimpleNamespace, StageCompute, list[ctl.Message], list[object]]:
    """A group of one replica of stage 0 of an ``n_stages`` pipeline, with one micro-batch accumulated; its
    reports to the leader and its sends to other peers are recorded."""
    compute = StageCompute(StageComputeConfig(ModelConfig(n_layers=1, d_model=8, n_heads=2, seq_len=4), 0, 1))
    tokens = torch.randint(0, 256, (2, 4))
    compute.forward_loss(0, tokens, torch.roll(tokens, -1, 1))
    step = WorkerStep()
    step.reset(pipeline=0)
    step.start_step(0, 0, trained_steps=0)
    reports: list[ctl.Message] = []
    sends: list[object] = []
    outbox = SimpleNamespace(report=lambda _t, msg: reports.append(msg), send=lambda *a: sends.append(a))
    sync = GradientSync(step, threading.Condition(), outbox, lambda: "me", no_load)  # type: ignore[arg-type]
    t = SimpleNamespace(assignment=SimpleNamespace(replica=0, group=["me"], n_stages=n_stages), compute=compute,
                        outer=None, exchange=GradientExchange(0, compute.numel, 10.0),
                        spec=SimpleNamespace(n_microbatches=1), key=lambda s, mb=-1: pb.Key(run_id="r", step=s,
                                                                                            microbatch=mb))
    return sync, t, compute, reports, sends


def test_an_apply_with_the_reduce_is_taken_by_a_lone_one_stage_pipeline_and_refused_by_any_other() -> None:
    """An exact step's apply may come with its reduce (one control round trip less) only where nothing crosses
    replicas or stages: a leader that sends it to a stage of a longer pipeline is refused, nothing applied."""
    sync, t, compute, reports, _ = _lone_stage(n_stages=1)
    before = compute.flat_params()
    sync.reduce(t, 0, ctl.Reduce(0, 0, (0,), {0: 0}, apply=True))  # type: ignore[arg-type]
    assert [type(m) for m in reports] == [ctl.Synced], "one report: synced, no reduced"
    assert compute.step == 1 and not torch.equal(compute.flat_params(), before)
    assert reports[0].trained_steps == 1 and reports[0].params_hash == compute.params_digest()
    sync, t, compute, reports, _ = _lone_stage(n_stages=2)
    with pytest.raises(Rejected, match="only to a pipeline of one stage"):
        sync.reduce(t, 0, ctl.Reduce(0, 0, (0,), {0: 0}, apply=True))  # type: ignore[arg-type]
    assert reports == [] and compute.step == 0


def test_a_group_of_one_keeps_its_own_sum_without_computing_or_sending_a_digest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica of a stage: the reduce-scatter and all-gather stay local and the digest phase, O(stage size)
    of host work with nobody to check it against, is skipped: the sum kept is the replica's own gradient."""
    from tasklet.peer.runtime.stage import checks

    def no_digest(*_args: object) -> None:
        raise AssertionError("a group of one computed a digest")

    monkeypatch.setattr(checks, "shard_digest", no_digest)
    monkeypatch.setattr(checks, "digest_seed", no_digest)
    sync, t, compute, reports, sends = _lone_stage(n_stages=1)
    own = compute.accumulated_grad()
    sync.reduce(t, 0, ctl.Reduce(0, 0, [0], {0: 0}))  # type: ignore[arg-type]
    assert sends == [] and [type(m) for m in reports] == [ctl.Reduced]
    summed, _count = sync.step.apply(0, compute.step) or (None, 0)
    assert summed is not None and torch.equal(summed, own)
