"""DiLoCo-style sync (``RunSpec.sync_period > 1``, peer.runtime.outer) over real processes: 2 stages x 2
pipelines as 4 worker processes on loopback, gRPC between them, against the single-process replay of the same
algorithm fed the run's own record of which pipeline committed which micro-batches in every inner step.

Every parameter must match within 1e-5 (relative to the tensor's largest entry, as in test_equivalence), the
replicas of a stage must be bit-identical after the last outer round, and the loss curves must agree. With a
pseudo-gradient codec the reference applies the same codec, shard by shard, and the runs take two micro-batches
a step, so that the order a pipeline sums its gradients in cannot move a value across a rounding boundary (see
the test).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig, unflatten_stage
from tasklet.peer.compute.reference import train_diloco_reference, train_reference
from tasklet.peer.compute.stage import OptimConfig, shard_bounds
from tasklet.peer.emulation.local import LinkModel, LocalSwarm, RunResult
from tasklet.peer.runtime.outer import BLOCK_SIZE, OuterState, allgather_codec, assignment_record, roundtrip
from tasklet.peer.runtime.spec import RunSpec, SpecError
from tasklet.scheduler.compression import PenaltyTable, SyncOption

pytestmark = pytest.mark.exact_processes  # every check is a replay's equality: lane 1 (tests/conftest.py)

STEPS = 6
SPEC = RunSpec(run_id="diloco", model=ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=5),
               optim=OptimConfig(lr=3e-3, eps=1e-3), seed=11, micro_batch=2, n_microbatches=4,
               sync_period=3, outer_lr=0.7, outer_momentum=0.9)
STAGES = [(0, 2), (2, 4)]
PIPELINES = [[0, 1], [2, 3]]
# the H = 2 outer setting the shipped penalty table was measured with (bench.bandwidth tunes it; the scheduler's
# choice at the 2 % limit carries it into the run): the runtime must reproduce its replay with exactly that
SHIPPED_H2 = PenaltyTable.load().outer_for(SyncOption(2, "int8"))


def _errors(result: RunResult, ref_params: dict[int, dict[str, torch.Tensor]], spec: RunSpec,
            trained: dict[int, int] | None = None) -> torch.Tensor:
    """Per entry, |runtime - reference| / the tensor's largest entry, over every stage and pipeline. ``trained``:
    the steps a pipeline's states trained (all ``STEPS`` unless it says otherwise)."""
    out = []
    for s, (a, b) in enumerate(STAGES):
        for r in sorted(r for st, r in result.states if st == s):
            state = result.states[(s, r)]
            assert state["step"] == (trained or {}).get(r, STEPS)
            for name, value in unflatten_stage(spec.model, a, b, state["params"]).items():
                ref = ref_params[r][name]
                out.append(((value - ref).abs() / ref.abs().max().clamp_min(1e-12)).reshape(-1))
    return torch.cat(out)


def _run(spec: RunSpec) -> tuple[RunResult, list[dict], tuple[dict[int, dict[str, torch.Tensor]], list[float]]]:
    torch.set_num_threads(1)
    # a long heartbeat: on a loaded machine a missed ping would make a live worker "die" mid-round (handled, but
    # then the run is the kill test's, not this one's)
    with LocalSwarm(spec, 4, heartbeat_s=5.0) as swarm:
        result = swarm.train((STAGES, PIPELINES), STEPS)
    record = json.loads(json.dumps(assignment_record(result.reports)))  # it survives JSON (run.json, a bench)
    return result, record, train_diloco_reference(spec, record, STAGES, Corpus.load(spec.corpus))


def _apart(record: list[dict]) -> bool:
    """Some step's micro-batches were committed by both pipelines (they really trained apart)."""
    return any(len(set(e["commits"].values())) == 2 for e in record)


def _run_apart(spec: RunSpec, tries: int = 3) -> tuple[RunResult, list[dict], tuple]:
    """``_run``, again (at most ``tries`` runs) while one pipeline happened to take every micro-batch: with two
    micro-batches a step, which pipeline leases them is the machine's timing, and a run without both training is a
    weaker test, not a failure of the runtime. The checks after it are the same for every run."""
    for _ in range(tries - 1):
        got = _run(spec)
        if _apart(got[1]):
            return got
    return _run(spec)


def _check_record(result: RunResult, record: list[dict], spec: RunSpec) -> None:
    assert [e["step"] for e in record] == list(range(STEPS))
    for e in record:
        # exactly once: every micro-batch of every inner step committed by one pipeline
        assert sorted(int(mb) for mb in e["commits"]) == list(range(spec.n_microbatches))
        assert e["applied"] == [0, 1]
        assert (e["outer"] is not None) == ((e["step"] + 1) % spec.sync_period == 0)
    for s in range(len(STAGES)):
        assert torch.equal(result.states[(s, 0)]["params"], result.states[(s, 1)]["params"]), f"stage {s}"
    # the pipelines really trained apart: a run where one pipeline did everything would be a weaker test
    assert _apart(record)


@pytest.mark.usefixtures("processes")
def test_diloco_two_pipelines_match_single_process_replay() -> None:
    result, record, (ref_params, ref_losses) = _run(SPEC)
    _check_record(result, record, SPEC)
    err = _errors(result, ref_params, SPEC)
    assert float(err.max()) < 1e-5, f"differs by {float(err.max()):.2e} of a tensor's largest entry"
    for step, (got, want) in enumerate(zip(result.losses, ref_losses, strict=True)):
        assert got == pytest.approx(want, rel=1e-5), f"step {step}: loss {got} vs reference {want}"
    assert ref_losses[-1] < ref_losses[0]
    # and it is not exact training: the same steps with every-step averaging end elsewhere
    exact, _ = train_reference(SPEC.model, SPEC.optim, Corpus.load(SPEC.corpus), SPEC.seed, STEPS,
                               SPEC.n_microbatches, SPEC.micro_batch)
    a, b = STAGES[0]
    diloco = unflatten_stage(SPEC.model, a, b, result.states[(0, 0)]["params"])
    assert max(float((diloco[n] - exact[n]).abs().max()) for n in diloco) > 1e-3


@pytest.mark.usefixtures("processes")
def test_overlapped_outer_round_lands_a_step_late_and_matches_its_replay() -> None:
    spec = dataclasses.replace(SPEC, run_id="diloco-overlap", outer_overlap=True)
    result, record, (ref_params, ref_losses) = _run(spec)
    # the round of step 2 travelled while step 3 computed and landed after it; the run's last round (step 5)
    # landed in step, so that the run ends with every replica at the anchor
    assert [(e["step"], e["outer"] is not None, e["outer_of"]) for e in record] == [
        (0, False, None), (1, False, None), (2, False, None), (3, True, 2), (4, False, None), (5, True, None)]
    assert all(sorted(int(mb) for mb in e["commits"]) == list(range(spec.n_microbatches)) for e in record)
    for s in range(len(STAGES)):
        assert torch.equal(result.states[(s, 0)]["params"], result.states[(s, 1)]["params"]), f"stage {s}"
    err = _errors(result, ref_params, spec)
    assert float(err.max()) < 1e-5, f"differs by {float(err.max()):.2e} of a tensor's largest entry"
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    # and the run really was the late algorithm: the same work with the round landing in step ends elsewhere
    in_step = [dict(e, outer=record[3]["outer"], outer_of=None) if e["step"] == 2 else
               dict(e, outer=None, outer_of=None) if e["step"] == 3 else e for e in record]
    sync_params, _ = train_diloco_reference(spec, in_step, STAGES, Corpus.load(spec.corpus))
    assert max(float((sync_params[0][n] - ref_params[0][n]).abs().max()) for n in ref_params[0]) > 1e-4


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(("codec", "period", "outer_lr", "outer_momentum"),
                         [("int8", 3, 0.7, 0.9), ("topk2", 3, 0.7, 0.9),
                          ("int8", 2, SHIPPED_H2["outer_lr"], SHIPPED_H2["outer_momentum"])],
                         ids=["int8", "topk2", "int8-H2-shipped"])
def test_diloco_compressed_pseudo_gradients_match_replay_with_the_same_codec(
        codec: str, period: int, outer_lr: float, outer_momentum: float) -> None:
    # two micro-batches of 4 sequences a step (the same tokens as SPEC's four of 2): a pipeline sums at most two
    # gradients, and a + b is b + a bit for bit, so the order it sums them in (which depends on timing) cannot
    # change a bit. With three or more it can, by float round-off, and a codec then turns round-off that lands on
    # one of its rounding boundaries (int8's steps, topk2's levels, a tie for a block's largest entry) into a
    # whole level times the outer step: the test would depend on the machine's load, not on the runtime.
    spec = dataclasses.replace(SPEC, run_id=f"diloco-{codec}-{period}", pseudo_grad_compression=codec,
                               sync_period=period, outer_lr=outer_lr, outer_momentum=outer_momentum,
                               n_microbatches=2, micro_batch=4)
    result, record, (ref_params, ref_losses) = _run_apart(spec)
    _check_record(result, record, spec)
    err = _errors(result, ref_params, spec)
    assert float(err.max()) < 1e-5, f"{float((err >= 1e-5).sum())} of {err.numel()} entries differ by 1e-5 or more"
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def test_sync_options_are_validated() -> None:
    for bad in ({"sync_period": 0}, {"outer_lr": 0.0}, {"outer_momentum": 1.0},
                {"pseudo_grad_compression": "gzip"}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            dataclasses.replace(SPEC, **bad).validate()
    d = SPEC.to_dict()
    assert RunSpec.from_dict(d) == SPEC
    d.pop("sync_period")
    assert RunSpec.from_dict(d).sync_period == 1  # old specs mean exact averaging


def _killed_at(spec: RunSpec, event: str, step: int) -> tuple[RunResult, list[dict]]:
    """Train ``spec`` on slow emulated devices, killing device 3 (stage 1 of pipeline 1) at the first ``event``
    of ``step``; the run and its record."""
    torch.set_num_threads(1)
    with LocalSwarm(spec, 4, links=LinkModel(tflops=[1e-4] * 4), forward_flops=lambda a, b: 2.4e6) as swarm:
        fired = threading.Event()

        def hook(name: str, info: dict) -> None:
            if name == event and info.get("step") == step and not fired.is_set():
                fired.set()
                threading.Thread(target=swarm.workers.kill, args=(3,), daemon=True).start()

        swarm.coordinator.on_event = hook
        result = swarm.train((STAGES, PIPELINES), STEPS)
    assert fired.is_set()
    return result, assignment_record(result.reports)


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(("event", "step", "overlap"), [("lease", 1, False), ("outer", 2, False), ("lease", 1, True)],
                         ids=["mid-inner-step", "mid-outer-round", "mid-inner-step-overlap"])
def test_pipeline_killed_mid_round_sits_the_round_out(event: str, step: int, overlap: bool) -> None:
    """Device 3 (stage 1 of pipeline 1) dies during inner step 1, or during the outer round after step 2.
    Pipeline 1 takes no further inner step and does not join the outer round; its earlier inner work is
    discarded; the leader re-plans at the round boundary (devices 0-2 left: one pipeline, which keeps its
    state). The run's record says all that, and replaying it single-process gives the same parameters. With
    overlap the round of step 2 is in flight when the leader re-plans: it lands first, as a round in step."""
    spec = dataclasses.replace(SPEC, run_id="diloco-kill-overlap", outer_overlap=True) if overlap else SPEC
    result, record = _killed_at(spec, event, step)
    for e in record:
        assert sorted(e["commits"]) == list(range(SPEC.n_microbatches)), "every micro-batch exactly once"
    assert record[0]["applied"] == [0, 1]
    assert record[1]["applied"] == ([0] if event == "lease" else [0, 1])
    assert record[2]["outer"] == [0], "the dead member's pipeline joins no outer round"
    assert all(e["outer_of"] is None for e in record), "a round in flight at a re-plan lands before it, in step"
    assert [e["applied"] for e in record[3:]] == [[0]] * (STEPS - 3)
    assert len(result.events.replans) == 2 and result.events.replans[1]["step"] == SPEC.sync_period
    assert sorted(result.states) == [(0, 0), (1, 0)]
    ref_params, ref_losses = train_diloco_reference(spec, record, STAGES, Corpus.load(SPEC.corpus))
    err = _errors(result, ref_params, spec)
    assert float(err.max()) < 1e-5, f"differs by {float(err.max()):.2e} of a tensor's largest entry"
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.usefixtures("processes")
def test_a_death_while_the_overlapped_round_travels_restarts_it_and_the_run_matches_its_replay() -> None:
    """With overlap, device 3 (stage 1 of pipeline 1) dies while step 3 computes and the round of step 2
    travels: the round is averaged again without pipeline 1 and lands after step 3; the record says so, and
    replaying it gives the same parameters."""
    spec = dataclasses.replace(SPEC, run_id="diloco-overlap-death", outer_overlap=True)
    result, record = _killed_at(spec, "lease", 3)
    for e in record:
        assert sorted(e["commits"]) == list(range(spec.n_microbatches)), "every micro-batch exactly once"
    assert [(e["outer"], e["outer_of"]) for e in record[2:4]] == [(None, None), ([0], 2)]
    assert [e["applied"] for e in record[3:]] == [[0]] * (STEPS - 3)
    # no re-plan before the run's end: pipeline 1's survivor (stage 0) still holds its round-end parameters
    assert sorted(result.states) == [(0, 0), (0, 1), (1, 0)]
    ref_params, ref_losses = train_diloco_reference(spec, record, STAGES, Corpus.load(spec.corpus))
    err = _errors(result, ref_params, spec, trained={1: 3})
    assert float(err.max()) < 1e-5, f"differs by {float(err.max()):.2e} of a tensor's largest entry"
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def test_a_late_outer_step_keeps_each_replicas_progress_since_its_rounds_end() -> None:
    torch.manual_seed(0)
    anchor, end, avg = torch.randn(64), torch.randn(64), torch.randn(64) * 1e-2
    now = end + torch.randn(64) * 1e-3  # one inner step after the round's end
    late, in_step = OuterState.start(anchor), OuterState.start(anchor)
    late.round_end, late.round_end_step = end.clone(), 5
    new = in_step.apply(avg, 0.7, 0.9, torch.zeros(64))
    assert torch.equal(late.land(5, avg, 0.7, 0.9, torch.zeros(64), now), new + (now - end))
    assert torch.equal(late.anchor, new) and late.round_end is None
    # without progress (it landed in step) the result is the anchor itself, bit for bit; a snapshot of another
    # round (a stale one a new plan left behind) is never used
    for step, params in ((5, end), (8, now)):
        other = OuterState.start(anchor)
        other.round_end, other.round_end_step = end.clone(), 5
        got = other.land(step, avg, 0.7, 0.9, torch.zeros(64), params)
        assert torch.equal(got, new)


def test_outer_step_is_torch_nesterov_sgd_and_top_k_all_gather_is_exact() -> None:
    torch.manual_seed(0)
    anchor, grads = torch.randn(1000), [torch.randn(1000) * 1e-2 for _ in range(3)]
    state = OuterState.start(anchor)
    p = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        new = state.apply(g, 0.7, 0.9, state.residual)
        p.grad = g.clone()
        sgd.step()
        assert torch.allclose(new, p.detach(), atol=1e-7, rtol=0)
        assert torch.equal(state.anchor, new)
    # no momentum and an outer lr above 1 (the kind of setting bench.bandwidth tunes at H = 2): plain SGD on the
    # average
    state, p = OuterState.start(anchor), torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([p], lr=1.5)
    for g in grads:
        new = state.apply(g, 1.5, 0.0, state.residual)
        p.grad = g.clone()
        sgd.step()
        assert torch.allclose(new, p.detach(), atol=1e-7, rtol=0)
    assert torch.equal(state.momentum, torch.zeros_like(anchor))
    # top-k with error feedback: per shard exactly k entries sent, the rest kept; the sum of two such shards
    # travels exactly in the all-gather
    # (topk2 / topk4 likewise, their rounding going to the residual too)
    shards = shard_bounds(1000, 2)
    for compression in ("topk", "topk2", "topk4"):
        sums = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            st, params = OuterState.start(torch.zeros(1000)), torch.randn(1000)
            sent, residual = st.contribution(params, shards, compression)
            assert torch.allclose(sent + residual, -params, atol=1e-6), "what is not sent stays in the residual"
            assert int((sent[: shards[0][1]] != 0).sum()) == math.ceil(shards[0][1] / BLOCK_SIZE)
            sums.append(sent[: shards[0][1]])
        summed = sums[0] + sums[1]
        codec, block = allgather_codec(compression, summed.numel(), 2)
        assert codec == "topk", compression
        assert torch.equal(roundtrip(summed, codec, block), summed)


@pytest.mark.usefixtures("processes")
def test_outer_round_with_no_whole_pipeline_left_folds_into_the_next_round() -> None:
    """Devices 1 (stage 1 of pipeline 0) and 2 (stage 0 of pipeline 1) die during the outer round after step 2:
    no pipeline is whole, so that outer round cannot finish. Step 2's inner step stands; the survivors (devices
    0 and 3, one of each stage) keep their local parameters and the round's anchor, form one pipeline, and the
    next outer round (after step 5) covers all six inner steps — no rollback, no lost stage."""
    torch.set_num_threads(1)
    with LocalSwarm(SPEC, 4, links=LinkModel(tflops=[1e-4] * 4), forward_flops=lambda a, b: 2.4e6,
                    heartbeat_s=4.0) as swarm:  # the survivors must not be taken for dead on a loaded machine
        fired = threading.Event()

        def hook(name: str, info: dict) -> None:
            if name == "outer" and info.get("step") == 2 and not fired.is_set():
                fired.set()
                for d in (1, 2):
                    threading.Thread(target=swarm.workers.kill, args=(d,), daemon=True).start()

        swarm.coordinator.on_event = hook
        result = swarm.train((STAGES, PIPELINES), STEPS)
    assert fired.is_set()
    record = assignment_record(result.reports)
    assert [e["step"] for e in record] == list(range(STEPS))
    assert record[2]["outer"] is None and record[5]["outer"] == [0]
    assert not result.events.rollbacks
    assert [r["step"] for r in result.events.replans] == [0, SPEC.sync_period]
    assert result.events.replans[1]["pipelines"] == [[0, 3]]
    assert sorted(result.states) == [(0, 0), (1, 0)] and all(s["step"] == STEPS for s in result.states.values())
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
