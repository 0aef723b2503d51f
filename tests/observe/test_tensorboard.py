"""The leader's scalar writer: TensorBoard event files read back with tensorboard's own event reader; nothing
written when unconfigured; a folder it cannot write or a W&B it cannot import is a warning, not a failure."""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tasklet.peer.observe.scalars import ScalarWriter


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_are_read_back_by_tensorboard(tmp_path: Path) -> None:
    writer = ScalarWriter(str(tmp_path / "tb"), run_name="r")
    assert writer.enabled
    for step in range(5):
        writer.add(step, {"train/loss": 5.0 - 0.5 * step, "train/tokens_per_s": 1000.0 + step,
                          "train/skipped": math.nan if step % 2 else None})
    # readable before close: every add is flushed, so a leader that dies loses nothing already written
    got = read_scalars(tmp_path / "tb")
    assert got["train/loss"] == [(s, pytest.approx(5.0 - 0.5 * s)) for s in range(5)]
    assert [v for _, v in got["train/tokens_per_s"]] == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
    assert "train/skipped" not in got  # None and NaN are not scalars
    writer.close()
    writer.add(9, {"train/loss": 1.0})  # after close: ignored, no error
    assert len(read_scalars(tmp_path / "tb")["train/loss"]) == 5


def test_a_second_writer_adds_a_file_and_tensorboard_shows_one_curve(tmp_path: Path) -> None:
    """A leader that takes over writes next to its predecessor's events (as on a machine that ran both)."""
    first = ScalarWriter(str(tmp_path))
    first.add(0, {"train/loss": 3.0})
    first.close()
    second = ScalarWriter(str(tmp_path))
    second.add(1, {"train/loss": 2.5})
    second.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert [s for s, _ in read_scalars(tmp_path)["train/loss"]] == [0, 1]


def test_unconfigured_writes_nothing(tmp_path: Path) -> None:
    writer = ScalarWriter("", "")
    assert not writer.enabled
    writer.add(0, {"train/loss": 1.0})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="tasklet.peer.observe.scalars"):
        writer = ScalarWriter(str(blocker / "tb"))
    assert not writer.enabled
    assert "cannot write TensorBoard events" in caplog.text
    writer.add(0, {"train/loss": 1.0})


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_configured_but_not_installed_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tasklet.peer.observe.scalars"):
        writer = ScalarWriter("", "my-project")
    assert not writer.enabled
    assert "wandb package is not installed" in caplog.text
