"""Crash-safe checkpoints: a write killed half-way, a damaged newest checkpoint, pruning, hostile manifests,
and ``--resume`` through the run driver taking the previous checkpoint and saying so."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasklet.peer.runtime.checkpoints import CheckpointDamagedError, CheckpointStore
from tasklet.peer.runtime.lead.driver import DriverConfig
from tests.support.driver import FakePlanner, make_driver
from tests.support.waits import wait_until


def state(step: int, n: int = 64, seed: int | None = None) -> dict:
    g = torch.Generator().manual_seed(step if seed is None else seed)
    return {"params": torch.randn(n, generator=g), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
            "step": step}


def meta(step: int) -> dict:
    return {"run": {"run_id": "t"}, "stages": [[0, 1], [1, 2]], "step": step}


def write(store: CheckpointStore, step: int) -> Path:
    return store.write(step, {0: state(step), 1: state(step, seed=step + 1000)}, meta(step))


def test_write_read_prune_and_latest_pointer(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (2, 4, 6):
        write(store, step)
    assert store.steps() == [4, 6], "only the newest two are kept"
    assert (tmp_path / "latest").read_text().strip() == "step-000006"
    ckpt = store.newest_valid()
    assert ckpt is not None and ckpt.step == 6 and ckpt.skipped == []
    assert torch.equal(ckpt.states[0]["params"], state(6)["params"])
    assert not list(tmp_path.glob(".*tmp*")), "no temp files left behind"


def test_damaged_newest_falls_back_to_the_previous_and_says_so(tmp_path, caplog) -> None:
    store = CheckpointStore(tmp_path)
    write(store, 2)
    newest = write(store, 4)
    data = (newest / "stage-1.pt").read_bytes()
    (newest / "stage-1.pt").write_bytes(data[: len(data) // 2])  # truncated after the fact
    with caplog.at_level(logging.WARNING):
        ckpt = store.newest_valid()
    assert ckpt is not None and ckpt.step == 2
    assert [s for s, _ in ckpt.skipped] == [4]
    assert "checkpoint of step 4 is damaged" in caplog.text and "of step 2" in caplog.text
    # same bytes, different content: a checksum mismatch, not only a size mismatch
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    (newest / "stage-1.pt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointDamagedError, match="checksum"):
        store.load(4)


def test_a_checkpoint_whose_stage_states_are_of_another_step_is_damaged(tmp_path, caplog) -> None:
    """A folder of step 4 holding a stage trained to step 3 (read while a step was ending) is never served as
    step 4: the previous checkpoint is used instead."""
    store = CheckpointStore(tmp_path)
    write(store, 2)
    store.write(4, {0: state(4), 1: state(3)}, meta(4))
    with caplog.at_level(logging.WARNING):
        ckpt = store.newest_valid()
    assert ckpt is not None and ckpt.step == 2 and [s for s, _ in ckpt.skipped] == [4]
    with pytest.raises(CheckpointDamagedError, match="other steps"):
        store.load(4)


def test_hostile_manifest_cannot_point_outside_its_folder(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    folder = write(store, 2)
    (tmp_path / "secret").write_text("x")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../secret"] = {"sha256": "0", "size": 1}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointDamagedError, match="invalid checkpoint file name"):
        store.read_files(2)
    assert store.newest_valid() is None


WRITER = """
import sys, torch
from pathlib import Path
from tasklet.peer.runtime.checkpoints import CheckpointStore
store = CheckpointStore(Path(sys.argv[1]))
big = {"params": torch.randn(8_000_000), "step": 4}
print("writing", flush=True)
store.write(4, {0: big, 1: big}, {"run": {"run_id": "t"}, "stages": [[0, 1], [1, 2]], "step": 4})
print("done", flush=True)
"""


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
def test_a_write_killed_midway_leaves_the_previous_checkpoint_in_force(tmp_path, processes: None) -> None:
    store = CheckpointStore(tmp_path)
    write(store, 2)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        wait_until(lambda: any(p.stat().st_size > 0 for p in tmp_path.glob(".tmp-*/*")),  # mid-way through the files
                   60, "the writer starts writing", 0.005, alive=proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "latest").read_text().strip() == "step-000002"
    ckpt = store.newest_valid()
    assert ckpt is not None and ckpt.step == 2
    write(store, 6)  # the next write clears the leftovers
    assert not list(tmp_path.glob(".tmp-*"))


def test_resume_takes_the_previous_checkpoint_when_the_newest_is_damaged(workers, tmp_path, caplog) -> None:  # noqa: F811
    planner = FakePlanner()
    driver, coordinator = make_driver(workers[:1], planner,
                                      DriverConfig(steps=4, checkpoint_dir=tmp_path, checkpoint_every=2))
    try:
        driver.run()
    finally:
        coordinator.close()
    assert driver.events.checkpoints == [2, 4]
    stage = tmp_path / "step-000004" / "stage-0.pt"
    stage.write_bytes(stage.read_bytes()[:100])  # the newest checkpoint was interrupted mid-write
    driver, coordinator = make_driver(workers[1:2], planner, DriverConfig(steps=5, checkpoint_dir=tmp_path))
    try:
        with caplog.at_level(logging.WARNING):
            reports = driver.run(resume=True)
    finally:
        coordinator.close()
    assert driver.events.resumed_from == {"step": 2, "skipped_damaged": [4]}
    assert [r.step for r in reports] == [2, 3, 4]
    assert "resuming from the checkpoint of step 2" in caplog.text and "[4] are damaged" in caplog.text


def test_a_checkpoint_error_does_not_stop_the_run(workers, tmp_path) -> None:  # noqa: F811
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the checkpoint folder should be")
    driver, coordinator = make_driver(workers[:1], FakePlanner(),
                                      DriverConfig(steps=3, checkpoint_dir=blocked, checkpoint_every=1))
    try:
        reports = driver.run()
    finally:
        coordinator.close()
    assert [r.step for r in reports] == [0, 1, 2]
    assert [e["step"] for e in driver.events.checkpoint_errors] == [1, 2, 3]
    assert driver.events.checkpoints == []


def test_the_checkpoint_a_roll_back_may_need_is_kept_beyond_keep(tmp_path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.pin = 3  # a live worker's first unverified work was applied in step 3: the checkpoint of step 2 is clean
    for step in (1, 2, 4, 5, 6):
        write(store, step)
    assert store.steps() == [2, 5, 6], "the newest two and the newest at or before the pin; one extra at most"
    store.pin = None
    write(store, 7)
    assert store.steps() == [6, 7]
