"""`python -m bench.gradient_tails --json`: tiny Llama's honest spike at step 3 is above the norm check's earlier
k of 10 (that refusal sidelined an honest member in a CI run) and far below the default k."""

from __future__ import annotations

import json

import pytest

from bench import gradient_tails
from tasklet.peer.runtime.choices import GRAD_OUTLIER_FACTOR


def test_tiny_llamas_honest_spike_is_above_the_old_k_and_under_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    gradient_tails.main(["--json", "--presets", "tiny-llama", "--steps", "4"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["preset"] == "tiny-llama" and row["tokens_per_microbatch"] == 64
    assert row["views"] == 4 * 2 * (2 ** 4 - 2) * 2, "steps x stages x sharings x owners"
    assert 10 < row["worst"] < GRAD_OUTLIER_FACTOR / 10, row
    assert row["at"]["step"] == 3 and row["at"]["stage"] == 0 and row["at"]["shares"] == [[0, 1, 2], [3]], row
    assert row["over"]["10"] > 0 and row["over"][f"{GRAD_OUTLIER_FACTOR:g}"] == 0
    assert row["direction_refused"] == 0, "contributions of under 256 tokens are never direction-tested"


def test_unknown_presets_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gradient_tails.main(["--presets", "tiny-llama,gpt-9"])
    assert "gpt-9" in capsys.readouterr().err
