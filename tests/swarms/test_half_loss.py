"""Half the swarm dies with the leader, every replica of stage 0 among them (bench.leader_loss.run_half_loss, in
one process): the new leader rolls back to the newest copy a survivor holds, or to step 0 when no checkpoint
was ever written (a wiped stage never ends the run), and the result equals single-process training."""

from __future__ import annotations

from pathlib import Path

from bench.leader_loss import run_half_loss


def test_a_wiped_stage_rolls_back_to_the_newest_copy(tmp_path: Path) -> None:
    r = run_half_loss(tmp_path, 4)
    assert r.rolled_back_to == 2 and r.steps_redone == 1  # the copy of step 2; step 2 is redone
    assert r.max_param_rel_diff < 1e-5


def test_a_wiped_stage_without_any_checkpoint_redoes_the_run_from_step_0(tmp_path: Path) -> None:
    r = run_half_loss(tmp_path, 4, checkpoints=False)
    assert r.rolled_back_to == 0 and r.steps_redone == 3
    assert r.max_param_rel_diff < 1e-5
