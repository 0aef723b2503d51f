"""Terminal progress: one plain line per new step when the output is not a terminal; a rich bar when it is,
with log lines routed above the bar while it is live and the handlers restored afterwards."""

from __future__ import annotations

import io
import logging

from tasklet.peer.observe.progress import ProgressDisplay, progress_line


def test_plain_lines_once_per_step_when_not_a_terminal() -> None:
    lines: list[str] = []
    stream = io.StringIO()  # not a terminal
    with ProgressDisplay(20, stream=stream, plain=lines.append, started=0.0) as display:
        assert not display.fancy
        display.update(None)
        display.update(3, loss=5.4321, step_s=0.5, tokens_per_s=1234.0, epoch=1, peers=4)
        display.update(3, loss=5.4321, step_s=0.5, tokens_per_s=1234.0, epoch=1, peers=4)  # same step: silent
        display.update(4, loss=None, epoch=1, peers=3)
    assert len(lines) == 2
    assert lines[0].endswith("plan epoch 1: step 3/20, loss 5.4321, 0.50 s/step, 1234 tokens/s (4 peers live)")
    assert lines[1].endswith("plan epoch 1: step 4/20, loss - (3 peers live)")
    assert stream.getvalue() == ""


def test_plain_lines_go_to_the_stream_by_default() -> None:
    stream = io.StringIO()
    with ProgressDisplay(None, stream=stream) as display:
        display.update(1, loss=2.0)
    assert "step 1, loss 2.0000" in stream.getvalue()
    assert progress_line(1.0, 2, 5).endswith("plan epoch None: step 2/5, loss -")


def test_a_bar_on_a_terminal_with_logs_above_it() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        display = ProgressDisplay(10, stream=stream, fancy=True)
        assert display.fancy
        assert handler.stream is not stream, "log lines must go through the live display while it runs"
        display.update(3, loss=4.25, tokens_per_s=900.0, epoch=2, peers=4)
        logging.getLogger("tasklet.peer.test").warning("a log line during training")
        display.close()
        assert handler.stream is stream
    finally:
        root.removeHandler(handler)
    out = stream.getvalue()
    assert "training" in out and "3/10" in out and "loss 4.2500" in out and "4 peers" in out
    assert "a log line during training" in out
