"""What `peer join` shows: the phase state machine and its lines (a fake clock), quiet off a terminal and a bar
on one, JSON lines for machines, the fetch's rate and ETA, hostile text made inert, and the daemon-side watch
that derives the waiting reasons and this peer's own rates from what the daemon knows."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tasklet.peer.node.join_watch import JoinWatch, WatchSources, report_end
from tasklet.peer.node.roles import State
from tasklet.peer.observe.logs import CleanFormatter, JsonFormatter, clean
from tasklet.peer.observe.phases import FETCH_HOLD_S, JSON_PROGRESS_S, FetchProgress, Phase, PhaseReporter

MB = 1_000_000
HOSTILE = "evil\x1b[2J\x1b]0;owned\x07\u202edevice"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_line_per_phase_change_and_nothing_else_off_a_terminal() -> None:
    clock, out = Clock(), io.StringIO()
    phases = PhaseReporter.for_stream(out, enabled=True, json_log=False)
    assert phases.mode == "plain"
    phases.clock, phases.started = clock, clock.t
    phases.measuring("this device: matmul speed and memory")
    clock.t += 1.5
    phases.waiting("waiting for a leader to be elected")
    phases.waiting("waiting for a leader to be elected")  # the same reason: no line
    clock.t += 2
    phases.waiting("waiting for the leader's first plan")
    for done in range(0, 45 * MB + 1, 5 * MB):  # ten chunks: one line at the start, one at the end
        phases.fetch_progress("stage 1 (layers 2..3) from 10.0.0.5:4101", done or 1, 45 * MB)
        clock.t += 1
    phases.training("stage 1 (layers 2..3) of pipeline 0, plan epoch 1", steps_per_s=None)
    for _ in range(5):  # rates move: quiet
        clock.t += 2
        phases.training("stage 1 (layers 2..3) of pipeline 0, plan epoch 1", steps_per_s=0.5, tokens_per_s=2048.0,
                        busy_share=0.63, device_share=None)
    phases.done("the run is over")
    phases.waiting("anything after the end")  # done is final
    phases.fetch_progress("stage 0", 1, 2)
    lines = lines_of(out)
    assert lines == [
        "[    0.0s] measuring: this device: matmul speed and memory",
        "[    1.5s] waiting for a plan: waiting for a leader to be elected",
        "[    3.5s] waiting for a plan: waiting for the leader's first plan",
        "[    3.5s] fetching: stage 1 (layers 2..3) from 10.0.0.5:4101, 45.0 MB",
        "[   12.5s] fetching: stage 1 (layers 2..3) from 10.0.0.5:4101: complete, 45.0 MB in 9.0 s (5.0 MB/s)",
        "[   13.5s] training: stage 1 (layers 2..3) of pipeline 0, plan epoch 1",
        "[   23.5s] done: the run is over (trained at 0.5 steps/s, 2048 tokens/s, compute 63% busy)",
    ]
    assert [e.phase for e in phases.events] == [Phase.MEASURING, Phase.WAITING, Phase.WAITING, Phase.FETCHING,
                                                 Phase.TRAINING, Phase.DONE]


def test_a_fetch_holds_its_phase_until_training_or_until_it_stalls() -> None:
    clock, out = Clock(), io.StringIO()
    phases = PhaseReporter("plain", out, clock=clock)
    phases.fetch_progress("stage 0 from a", 10, 100)
    clock.t += 1
    phases.waiting("waiting for this peer's assignment of plan epoch 2")  # the worker holds no stage yet
    assert phases.phase is Phase.FETCHING
    phases.fetch_progress("stage 0 from a", 100, 100)
    clock.t += FETCH_HOLD_S / 2
    phases.waiting("waiting for this peer's assignment of plan epoch 2")  # loading what came: still held
    assert phases.phase is Phase.FETCHING
    phases.fetch_progress("stage 0 from a", 5, 100)  # a new fetch of the same stage (a retry) starts over
    assert sum("fetching: stage 0 from a, 100 B" in line for line in lines_of(out)) == 2
    clock.t += FETCH_HOLD_S + 1  # no byte for long: the fetch failed
    phases.waiting("waiting for the next plan: plan epoch 3 has no place for this peer")
    assert phases.phase is Phase.WAITING
    phases.fetch_progress("stage 1 from b", 1, 10)
    phases.training("stage 1 of pipeline 0, plan epoch 3")  # training ends a fetch at once
    assert phases.phase is Phase.TRAINING


def test_the_rate_and_eta_of_a_fetch() -> None:
    f = FetchProgress("stage 0", total=100 * MB, started=10.0)
    assert f.rate(10.0) is None and f.eta_s(10.0) is None
    f.done = 25 * MB
    assert f.rate(20.0) == pytest.approx(2.5 * MB)
    assert f.eta_s(20.0) == pytest.approx(30.0)
    assert f.fields(20.0) == {"bytes_done": 25 * MB, "bytes_total": 100 * MB, "bytes_per_s": 2.5 * MB, "eta_s": 30.0}
    f.done = 100 * MB
    assert f.eta_s(30.0) == 0.0
    assert FetchProgress("x", total=0, started=0.0, done=5).eta_s(1.0) is None  # no total announced: no ETA


def test_a_terminal_gets_a_bar_that_redraws_in_place() -> None:
    clock, out = Clock(), Terminal()
    phases = PhaseReporter.for_stream(out, enabled=True, json_log=False)
    assert phases.fancy
    phases.clock = clock
    phases.waiting("waiting for the leader's first plan")
    for done in range(1, 41):
        clock.t += 0.25
        phases.fetch_progress("stage 0 from a", done * MB, 40 * MB)
        phases._bar._progress.refresh()  # what rich's refresh thread does ten times a second
    text = out.getvalue()
    phases.training("stage 0 of pipeline 0, plan epoch 1", steps_per_s=1.25, run_step=3, run_steps=10)
    phases._bar._progress.refresh()
    phases.left("stopped before the end of the run")
    assert "waiting for a plan: waiting for the leader's first plan" in text
    assert "fetching" in text and "MB/s" in text and "ETA" in text and "/40.0 MB" in text
    assert text.count("\x1b[") > 20  # cursor movement: the bar redraws in place
    assert "step 3/10" in out.getvalue() and "1.25 steps/s" in out.getvalue()
    assert phases._bar._progress is None  # the bar is gone once the peer left


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_json_lines_carry_the_phase_and_its_figures(json_log: io.StringIO) -> None:
    clock = Clock()
    phases = PhaseReporter.for_stream(Terminal(), enabled=True, json_log=True)  # JSON even on a terminal
    assert phases.mode == "json"
    phases.clock, phases.started = clock, clock.t
    phases.waiting("waiting for the leader's first plan")
    for done in range(1, 21):
        clock.t += 1
        phases.fetch_progress("stage 0 from a", done * MB, 20 * MB)
    phases.training("stage 0 of pipeline 0, plan epoch 1", steps_per_s=0.5, tokens_per_s=100.0, busy_share=0.9,
                    device_share=None)
    clock.t += JSON_PROGRESS_S
    phases.training("stage 0 of pipeline 0, plan epoch 1", steps_per_s=0.75, tokens_per_s=150.0, busy_share=0.8,
                    device_share=None, loss=float("nan"))
    logging.getLogger("tasklet.peer.node.daemon").warning("a plain record: %s", HOSTILE)
    records = [json.loads(line) for line in json_log.getvalue().splitlines()]
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    events = [r for r in records if r["logger"] == "tasklet.peer.phase"]
    assert [(r["event"], r["phase"]) for r in events][:2] == [("phase", "waiting"), ("phase", "fetching")]
    fetch = [r for r in events if r["phase"] == "fetching"]
    assert fetch[-1]["event"] == "fetched" and fetch[-1]["bytes_done"] == fetch[-1]["bytes_total"] == 20 * MB
    progress = [r for r in fetch if r["event"] == "progress"]
    assert progress and len(progress) <= 20 / JSON_PROGRESS_S + 1  # throttled, not one per chunk
    assert progress[0]["eta_s"] == pytest.approx((20 - progress[0]["bytes_done"] / MB) / 1.0, abs=0.2)
    train = [r for r in events if r["phase"] == "training"]
    assert train[0]["event"] == "phase" and train[0]["steps_per_s"] == 0.5 and train[0]["device_share"] is None
    assert train[-1]["event"] == "progress" and train[-1]["steps_per_s"] == 0.75 and train[-1]["loss"] is None
    plain = records[-1]
    assert plain["level"] == "WARNING" and plain["logger"] == "tasklet.peer.node.daemon"
    assert "\x1b" not in plain["msg"] and "\\x1b[2J" in plain["msg"] and "\\u202e" in plain["msg"]
    assert plain["ts"].endswith("Z")


def test_a_hostile_reason_is_printed_inert() -> None:
    for out in (io.StringIO(), Terminal()):
        phases = PhaseReporter.for_stream(out, enabled=True, json_log=False)
        phases.waiting(f"the swarm is paused: {HOSTILE}")
        phases.fetch_progress(f"stage 0 from {HOSTILE}", 1, 10)
        phases.close()
        text = out.getvalue()
        assert "\x1b[2J" not in text and "\x1b]0;" not in text and "\x07" not in text and "\u202e" not in text
        assert "evil\\x1b[2J\\x1b]0;owned\\x07\\u202edevice" in text
    assert clean("a" * 500, limit=10) == "a" * 10 + "..."
    assert clean("line\n\tnext\r", keep="\n\t") == "line\n\tnext\\x0d"
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "device %s", (HOSTILE,), None)
    assert "\x1b" not in CleanFormatter("%(message)s").format(record)


def test_off_keeps_the_state_and_says_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    phases = PhaseReporter.for_stream(io.StringIO(), enabled=False, json_log=True)
    phases.measuring("this device")
    phases.fetch_progress("stage 0", 3, 3)
    report_end(phases, done=False, error="leader failed: boom")
    assert phases.mode == "off" and phases.phase is Phase.LEFT and phases.reason == "leader failed: boom"
    assert capsys.readouterr() == ("", "")
    phases.fetch_progress("stage 0", "a lot", None)  # type: ignore[arg-type]  # nothing raises, ever


# ------------------------------------------------------------------------------------------- the daemon's watch
class FakeDaemon:
    """What the watch reads, set by each test."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {"stage": None}
        self.state, self.waiting_line = State.FOLLOWER, None
        self.beat: dict[str, Any] | None = None
        self.elected: str | None = "leader"
        self.leading, self.plan, self.paused_by = False, None, None
        self.rounds, self.peers, self.memory = 1, 3, None

    def sources(self) -> WatchSources:
        return WatchSources(
            worker_status=lambda: self.status, role_state=lambda: self.state, waiting_line=lambda: self.waiting_line,
            beat=lambda: self.beat, elected=lambda: self.elected, leading=lambda: self.leading,
            followed_plan=lambda: self.plan, paused_by=lambda: self.paused_by, probe_rounds=lambda: self.rounds,
            peers_live=lambda: self.peers, memory_bytes=lambda: self.memory)


@pytest.fixture
def watched() -> tuple[FakeDaemon, JoinWatch, PhaseReporter, Clock]:
    from tasklet.peer.compute.model import ModelConfig
    from tasklet.peer.runtime.spec import RunSpec

    clock, fake = Clock(), FakeDaemon()
    phases = PhaseReporter("off", clock=clock)
    spec = RunSpec(run_id="w", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), micro_batch=2)
    return fake, JoinWatch("me", spec, 10, fake.sources(), phases, clock=clock), phases, clock


def test_the_watch_says_why_this_peer_waits(watched: tuple[FakeDaemon, JoinWatch, PhaseReporter, Clock]) -> None:
    from tasklet.peer.swarm.plans import PlanRecord

    fake, watch, phases, _ = watched
    seen = []

    def look() -> str:
        watch.tick()
        seen.append(phases.phase)
        return phases.reason

    fake.rounds = 0
    assert look() == "links to 2 other peer(s): round-trip time, bandwidth" and phases.phase is Phase.MEASURING
    fake.rounds, fake.elected = 1, None
    assert look() == "waiting for a leader to be elected"
    fake.elected = "leader"
    assert look() == "waiting for the leader's first plan"
    fake.plan = PlanRecord(3, "leader", {"pipelines": [["leader", "other"]], "stages": [[0, 1], [1, 2]]})
    assert look() == "waiting for the next plan: plan epoch 3 has no place for this peer"
    fake.memory = 1000  # bytes: no stage of the plan fits
    assert look().startswith("no stage fits this device's memory: stage ")
    fake.memory, fake.plan = None, PlanRecord(3, "leader", {"pipelines": [["leader", "me"]], "stages": "junk"})
    assert look() == "waiting for this peer's assignment of plan epoch 3"
    fake.beat = {"state": "paused", "paused": {"reason": HOSTILE}}
    assert look() == "the swarm is paused: evil\\x1b[2J\\x1b]0;owned\\x07\\u202edevice"
    fake.state, fake.waiting_line = State.WAITING, "waiting for a leader the organiser trusts: 1 steward, none live"
    assert look() == "waiting for a leader the organiser trusts: 1 steward, none live"
    fake.paused_by = "schedule"
    assert look() == "paused outside the --schedule hours"
    assert set(seen[1:]) == {Phase.WAITING}
    fake.status = {"stage": "not an int"}  # nothing a status says makes the watch raise
    watch.sources = WatchSources(*(lambda: 1 / 0 for _ in range(11)))  # type: ignore[arg-type, misc]
    watch.tick()


def test_the_watch_measures_this_peers_own_rates(watched: tuple[FakeDaemon, JoinWatch, PhaseReporter, Clock]) -> None:
    fake, watch, phases, clock = watched
    fake.beat = {"state": "training", "step": 4, "loss": 3.5}
    status = {"stage": 1, "replica": 0, "epoch": 2, "layers": [1, 2], "trained_steps": 4, "forward": 0,
              "busy_s": 0.0}
    fake.status = dict(status)
    watch.tick()
    assert phases.phase is Phase.TRAINING and phases.reason == "stage 1 (layers 1..1) of pipeline 0, plan epoch 2"
    assert phases.fields["steps_per_s"] is None and phases.fields["run_step"] == 4 and phases.fields["run_steps"] == 10
    clock.t += 10
    fake.status = {**status, "trained_steps": 9, "forward": 20, "busy_s": 6.0, "device_share": 0.4}
    watch.tick()
    # 5 steps in 10 s; 20 micro-batches of 2 sequences of 8 tokens; 6 s of compute
    assert phases.fields["steps_per_s"] == 0.5 and phases.fields["tokens_per_s"] == 32.0
    assert phases.fields["busy_share"] == 0.6 and phases.fields["device_share"] == 0.4
    assert phases.fields["loss"] == 3.5
    clock.t += 10
    fake.status = {**status, "epoch": 3, "trained_steps": 9, "forward": 20, "busy_s": 6.0}  # a new plan: anew
    watch.tick()
    assert phases.reason.endswith("plan epoch 3") and phases.fields["steps_per_s"] is None


def test_json_log_is_a_flag_of_start_and_join_and_a_failure_ends_in_json(json_log: io.StringIO,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from tasklet.peer.cli import build_parser, last_line

    parser = build_parser()
    assert parser.parse_args(["join", "--dht", "ADDR", "--json-log"]).json_log
    assert not parser.parse_args(["start", "--config", "run.toml"]).json_log
    last_line(f"leader failed: {HOSTILE}", json_log=True)
    record = json.loads(json_log.getvalue().splitlines()[-1])
    assert record["level"] == "ERROR" and record["msg"].startswith("leader failed: evil\\x1b[2J")
    last_line(f"leader failed: {HOSTILE}", json_log=False)
    assert capsys.readouterr().err == "peer: leader failed: evil\\x1b[2J\\x1b]0;owned\\x07\\u202edevice\n"
