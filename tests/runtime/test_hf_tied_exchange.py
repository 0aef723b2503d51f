"""The runtime's side of tied embeddings (peer.runtime.stage.tied): which stage holds an end of the tie and who
its partner is, the mailbox that holds the other end's gradient, and the refusals of a worker's intake — only
the other end of this pipeline may send it, for this pipeline, of the tied weight's exact float32 size, finite,
once per attempt — each refused with a clear status, nothing held. The whole exchange in a swarm is in
tests/swarms/test_hf_equivalence.py (Gemma-2 and Granite, 2 stages x 2 replicas, against transformers' tied model)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.compute.stage import StageCompute, StageComputeConfig
from tasklet.peer.config import RunConfig
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.bounds import ENVELOPE_SLACK_BYTES, push_limits
from tasklet.peer.runtime.roles import Roles
from tasklet.peer.runtime.spec import Assignment, RunSpec, SpecError
from tasklet.peer.runtime.stage import intake as intake_module
from tasklet.peer.runtime.stage.exchange import ExchangeTimeoutError, GradientExchange
from tasklet.peer.runtime.stage.gradient_checks import ExchangeAbortedError
from tasklet.peer.runtime.stage.intake import Intake
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.step import WorkerStep
from tasklet.peer.runtime.stage.tied import TiedEnd, combine, sum_with_other_end, tied_end, tied_envelope
from tasklet.peer.runtime.wire import make_key, tensor_named
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor
from tasklet.protocol.errors import BadMessage, Forbidden, Rejected

pytestmark = pytest.mark.unit

ENDPOINTS = ["w0", "w1", "w2", "w3"]
IDS = {ep: f"peer-{ep}" for ep in ENDPOINTS}
TIED = RunSpec(run_id="tied", model=resolve_model("tiny-gpt2", seq_len=16, seed=1, tie=True))
UNTIED = RunSpec(run_id="tied", model=resolve_model("tiny-gpt2", seq_len=16, seed=1))
TWO_BY_TWO = ([(0, 2), (2, 4)], [[0, 1], [2, 3]])


def assignments(spec: RunSpec, stages: list[tuple[int, int]], pipelines: list[list[int]]) -> dict[str, Assignment]:
    return build_assignments(spec, stages, pipelines, ENDPOINTS, "coordinator")


def test_each_pipeline_ties_its_first_stage_to_its_own_last_stage() -> None:
    a = assignments(TIED, *TWO_BY_TWO)
    vocab, d = TIED.model.vocab_size, TIED.model.d_model
    ends = {ep: tied_end(TIED, a[ep]) for ep in ENDPOINTS}
    assert ends["w0"] is not None and ends["w1"] is not None
    assert (ends["w0"].partner, ends["w1"].partner, ends["w2"].partner, ends["w3"].partner) == ("w1", "w0", "w3", "w2")
    assert ends["w0"].first and not ends["w1"].first and ends["w1"].partner_stage == 0
    assert ends["w0"].numel == ends["w1"].numel == vocab * d
    # the slice is where the stage keeps the embedding (first) and the head (last)
    first = StageCompute(StageComputeConfig(TIED.model, 0, 2)).named_params()["transformer.wte.weight"]
    flat = StageCompute(StageComputeConfig(TIED.model, 0, 2)).flat_params()
    assert torch.equal(flat[ends["w0"].lo:ends["w0"].hi], first.reshape(-1))
    last = StageCompute(StageComputeConfig(TIED.model, 2, 4))
    head = last.named_params()["lm_head.weight"].reshape(-1)
    assert torch.equal(last.flat_params()[ends["w1"].lo:ends["w1"].hi], head)


def test_no_end_for_an_untied_model_a_middle_stage_or_one_stage() -> None:
    assert all(tied_end(UNTIED, a) is None for a in assignments(UNTIED, *TWO_BY_TWO).values())
    three = assignments(TIED, [(0, 1), (1, 3), (3, 4)], [[0, 1, 2]])
    assert tied_end(TIED, three["w1"]) is None and tied_end(TIED, three["w0"]) is not None
    one = assignments(TIED, [(0, 4)], [[0], [1]])
    assert all(tied_end(TIED, a) is None for a in one.values())  # one stage holds the weight once


def test_an_assignment_without_its_pipeline_is_refused_for_a_tied_model() -> None:
    a = assignments(TIED, *TWO_BY_TWO)["w0"]
    bare = Assignment.from_dict({**a.to_dict(), "pipeline": []})
    with pytest.raises(Rejected, match="assignment.pipeline"):
        tied_end(TIED, bare)
    with pytest.raises(SpecError, match="assignment.pipeline"):  # a pipeline that does not hold this worker
        Assignment.from_dict({**a.to_dict(), "pipeline": ["w2", "w1"]})


def test_both_ends_compute_the_same_bits() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g) * 1e-3
    first, last = torch.cat([torch.ones(5), a]), torch.cat([b, torch.ones(7)])
    combine(TiedEnd(5, 1005, True, "w1", 1), first, b.clone())
    combine(TiedEnd(0, 1000, False, "w0", 0), last, a.clone())
    assert torch.equal(first[5:], last[:1000]) and torch.equal(first[5:], a + b)
    assert torch.equal(first[:5], torch.ones(5)) and torch.equal(last[1000:], torch.ones(7))


def test_diloco_and_a_tied_model_are_refused_and_a_run_file_keeps_exact_runs_tied() -> None:
    with pytest.raises(SpecError, match="sync_period"):
        RunSpec(run_id="t", model=TIED.model, sync_period=4).validate()
    raw = {"run": {"run_id": "r", "steps": 1, "sync_period": 1}, "model": {"config": "tiny-gpt2", "seq_len": 16}}
    assert RunConfig.from_dict(raw).spec().model.keep_tied
    raw["run"]["sync_period"] = 4
    assert not RunConfig.from_dict(raw).spec().model.keep_tied  # DiLoCo: untied, as before


# ------------------------------------------------------------------------------------------- the mailbox
def mailbox(numel: int = 6) -> GradientExchange:
    return GradientExchange(0, 100, tied=TiedEnd(10, 10 + numel, True, "w1", 1))


def test_the_mailbox_holds_one_finite_float32_tied_gradient_per_attempt() -> None:
    box = mailbox()
    for bad, why in ((torch.zeros(5), "float32\\[6\\]"), (torch.zeros(6, dtype=torch.float64), "float32\\[6\\]"),
                     (torch.zeros(2, 3), "float32\\[6\\]"), (torch.tensor([0.0] * 5 + [float("nan")]), "NaN")):
        with pytest.raises(BadMessage, match=why):
            box.put_tied((0, 1), bad)
    box.put_tied((0, 1), torch.ones(6))
    with pytest.raises(BadMessage, match="already arrived"):
        box.put_tied((0, 1), torch.zeros(6))
    assert torch.equal(box.take_tied((0, 1), 1.0), torch.ones(6))
    with pytest.raises(BadMessage, match="no tied weight"):
        GradientExchange(0, 100).put_tied((0, 1), torch.ones(6))


def test_taking_waits_with_a_deadline_and_an_abandoned_attempt_lets_go() -> None:
    box = mailbox()
    started = time.monotonic()
    with pytest.raises(ExchangeTimeoutError, match="tied gradient"):
        box.take_tied((0, 1), 0.2)
    assert time.monotonic() - started < 2.0
    threading.Timer(0.1, box.abort_before, ((0, 2),)).start()
    with pytest.raises(ExchangeAbortedError):
        box.take_tied((0, 1), 10.0)
    with pytest.raises(BadMessage, match="abandoned"):
        box.put_tied((0, 1), torch.ones(6))


def test_mail_of_earlier_steps_and_attempts_is_dropped() -> None:
    box = mailbox()
    box.put_tied((0, 1), torch.ones(6))
    box.put_tied((0, 2), torch.full((6,), 2.0))
    box.put_tied((1, 1), torch.full((6,), 3.0))  # a new step: step 0's mail goes
    assert list(box._tied_mail) == [(1, 1)]
    box.put_tied((1, 3), torch.full((6,), 4.0))
    assert float(box.take_tied((1, 3), 1.0)[0]) == 4.0 and not box._tied_mail


# ---------------------------------------------------------------------------------------- the intake
class Reports:
    def __init__(self) -> None:
        self.sent: list[ctl.Message] = []

    def report(self, t: Any, msg: ctl.Message) -> Future[None]:
        self.sent.append(msg)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def worker(endpoint: str, spec: RunSpec = TIED) -> tuple[Intake, Tasklet, Reports]:
    a = assignments(spec, *TWO_BY_TWO)[endpoint]
    compute = StageCompute(StageComputeConfig(spec.model, *a.layers))
    exchange = GradientExchange(a.replica, compute.numel, tied=tied_end(spec, a))
    t = Tasklet(spec, a, compute, exchange, None, Roles(IDS[endpoint], IDS, dict(a.plan)))
    step, cond, reports = WorkerStep(), threading.Condition(), Reports()
    step.reset(a.replica)
    step.start_step(0, 0, trained_steps=0)
    intake = Intake(None, frozenset(), False, lambda: t, step, cond, reports, lambda task: None)  # type: ignore[arg-type]
    return intake, t, reports


def tied_from(sender: str, stage: int, replica: int, grad: torch.Tensor, attempt: str = "1", step: int = 0,
              run: str = "tied") -> pb.Envelope:
    env = tied_envelope(make_key(run, 1, step, -1, stage, replica), 0, grad)
    env.meta["attempt"] = attempt
    env.sender = IDS[sender]
    return env


@pytest.fixture(scope="module", name="first")
def first_fixture() -> tuple[Intake, Tasklet, Reports]:
    return worker("w0")


def test_the_other_end_of_the_pipeline_is_heard(first: tuple[Intake, Tasklet, Reports]) -> None:
    intake, t, _ = first
    numel = t.exchange.tied.numel
    g = torch.randn(numel)
    intake.tied_grad(tied_from("w1", 1, 0, g))
    assert torch.equal(t.exchange.take_tied((0, 1), 1.0), g)
    limit = push_limits(t.spec, t.compute.numel)[pb.TIED_GRAD]
    assert limit == numel * 4 + ENVELOPE_SLACK_BYTES  # bounded by the tied weight, not the stage
    assert intake.admit_push(pb.TIED_GRAD, IDS["w1"]) == limit


@pytest.mark.parametrize(("case", "error", "match"), [
    ("a replica of this stage", Forbidden, "tied embedding"),
    ("another pipeline's last stage", Forbidden, "tied embedding"),
    ("the wrong stage in its key", Rejected, "other end of this pipeline"),
    ("another pipeline in its key", Rejected, "other end of this pipeline"),
    ("another run", Rejected, "not this peer's"),
    ("another step", Rejected, "not the current step"),
    ("an attempt far ahead", Rejected, "attempt"),
    ("an attempt that is no number", BadMessage, "meta.attempt"),
    ("the wrong size", BadMessage, "shape"),
    ("the wrong dtype", BadMessage, "dtype"),
    ("a NaN", BadMessage, "NaN|finite"),
])
def test_a_bad_tied_gradient_is_refused_and_nothing_is_held(first: tuple[Intake, Tasklet, Reports], case: str,
                                                            error: type[Exception], match: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake_module, "EARLY_SHARD_WAIT_S", 0.1)  # the next step's shard waits for its start
    intake, t, _ = first
    n = t.exchange.tied.numel
    ok = torch.zeros(n)
    env = {
        "a replica of this stage": lambda: tied_from("w2", 1, 0, ok),
        "another pipeline's last stage": lambda: tied_from("w3", 1, 0, ok),
        "the wrong stage in its key": lambda: tied_from("w1", 0, 0, ok),
        "another pipeline in its key": lambda: tied_from("w1", 1, 1, ok),
        "another run": lambda: tied_from("w1", 1, 0, ok, run="other"),
        "another step": lambda: tied_from("w1", 1, 0, ok, step=1),
        "an attempt far ahead": lambda: tied_from("w1", 1, 0, ok, attempt="9"),
        "an attempt that is no number": lambda: tied_from("w1", 1, 0, ok, attempt="x"),
        "the wrong size": lambda: tied_from("w1", 1, 0, torch.zeros(n + 1)),
        "the wrong dtype": lambda: tied_from("w1", 1, 0, torch.zeros(n, dtype=torch.float64)),
        "a NaN": lambda: tied_from("w1", 1, 0, torch.full((n,), float("nan"))),
    }[case]()
    with pytest.raises(error, match=match):
        intake.tied_grad(env)
    assert not t.exchange._tied_mail, "a refused message must leave nothing held"


def test_a_shard_ahead_of_this_peers_start_waits_for_it_and_is_refused_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's restart (attempt 2) and its reduce (attempt 3) reached the other end first: its shard waits
    for this peer's own start instead of being refused (the push was lost, the reduce waited out its deadline)."""
    monkeypatch.setattr(intake_module, "EARLY_SHARD_WAIT_S", 0.5)
    intake, t, _ = worker("w0")
    n = t.exchange.tied.numel
    g = torch.randn(n)
    pushed: Future[None] = Future()

    def push() -> None:
        try:
            intake.tied_grad(tied_from("w1", 1, 0, g, attempt="3"))
            pushed.set_result(None)
        except Exception as exc:  # noqa: BLE001 - handed to the test's thread
            pushed.set_exception(exc)

    thread = threading.Thread(target=push)
    thread.start()
    time.sleep(0.1)
    assert not pushed.done(), "the early shard must wait, not be refused"
    with intake.cond:
        intake.step.start_step(0, 2, trained_steps=0)
        intake.cond.notify_all()
    pushed.result(timeout=5)
    thread.join()
    assert torch.equal(t.exchange.take_tied((0, 3), 1.0), g)
    started = time.monotonic()
    with pytest.raises(Rejected, match="attempt 7 is not within 2 of the current attempt 2"):
        intake.tied_grad(tied_from("w1", 1, 0, g, attempt="7"))  # a second restart ahead: refused at once
    with pytest.raises(Rejected, match="attempt 6 is not within 2"):
        intake.tied_grad(tied_from("w1", 1, 0, g, attempt="6"))  # early, but no start came: refused after the wait
    assert 0.4 < time.monotonic() - started < 3.0
    assert not t.exchange._tied_mail


def test_a_stage_without_a_tie_refuses_the_kind() -> None:
    intake, _, _ = worker("w0", UNTIED)
    with pytest.raises(Forbidden):
        intake.admit_push(pb.TIED_GRAD, IDS["w1"])
    with pytest.raises(Rejected, match="no tied weight"):
        intake.tied_grad(tied_from("w1", 1, 0, torch.zeros(4)))
    assert pb.TIED_GRAD not in push_limits(UNTIED, 1000)


def test_the_slice_sent_is_this_ends_own_gradient_whenever_it_leaves() -> None:
    """A message leaves from its tensor's storage, maybe after the sum rewrote ``summed``: what the other end
    receives must still be this end's gradient, not the sum (the copies would part on every used row)."""
    end = TiedEnd(2, 6, True, "w1", 1)
    summed, theirs = torch.arange(8, dtype=torch.float32), torch.full((4,), 100.0)
    sent: list[pb.Envelope] = []
    sum_with_other_end(end, make_key("tied", 1, 0), 3, summed, sent.append, lambda: theirs)
    assert torch.equal(summed[2:6], torch.tensor([102.0, 103.0, 104.0, 105.0]))
    (env,) = sent
    assert env.kind == pb.TIED_GRAD and env.meta["attempt"] == "3"
    assert torch.equal(decode_tensor(tensor_named(env, "grad")), torch.tensor([2.0, 3.0, 4.0, 5.0]))
