"""The decoder splits into stages that are exact slices of the full model, built anywhere."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tasklet.peer.compute.model import ModelConfig, ModelConfigError, build_stage, lm_loss

CFG = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=11)
SPLITS = [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _tokens(batch: int = 3, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(5))


# Runs both here and in a fresh interpreter, so it must be self-contained source.
DIGEST_SOURCE = '''
import hashlib
from tasklet.peer.compute.model import build_stage


def params_digest(cfg, first, last):
    h = hashlib.sha256()
    for name, p in build_stage(cfg, first, last).state_dict().items():
        h.update(name.encode())
        h.update(p.numpy().tobytes())
    return h.hexdigest()
'''


def _params_digest(cfg: ModelConfig, first: int, last: int) -> str:
    scope: dict[str, object] = {}
    exec(DIGEST_SOURCE, scope)  # our own constant source, shared with the subprocess below
    return scope["params_digest"](cfg, first, last)  # type: ignore[operator]


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "+".join(f"{a}-{b}" for a, b in s))
def test_stage_parameters_are_slices_of_the_full_model(splits: list[tuple[int, int]]) -> None:
    full = build_stage(CFG, 0, CFG.n_layers).state_dict()
    union: dict[str, torch.Tensor] = {}
    for first, last in splits:
        stage = build_stage(CFG, first, last).state_dict()
        assert not set(stage) & set(union), "two stages must not own the same parameter"
        union.update(stage)
    assert set(union) == set(full)
    for name, value in full.items():
        assert torch.equal(union[name], value), name


def test_embeddings_on_first_stage_head_on_last_only() -> None:
    names = [set(build_stage(CFG, a, b).state_dict()) for a, b in [(0, 1), (1, 3), (3, 4)]]
    assert any(n.startswith("embed.") for n in names[0]) and not any(n.startswith("head.") for n in names[0])
    assert not any(n.startswith(("embed.", "head.")) for n in names[1])
    assert {n for n in names[1] if n.startswith("blocks.")} == {n for n in names[1]}
    assert {n.split(".")[1] for n in names[1]} == {"1", "2"}, "blocks keep their global layer index"
    assert "head.lm.weight" in names[2] and not any(n.startswith("embed.") for n in names[2])


@pytest.mark.parametrize("splits", SPLITS[1:], ids=lambda s: "+".join(f"{a}-{b}" for a, b in s))
def test_composed_stage_forwards_equal_the_full_forward(splits: list[tuple[int, int]]) -> None:
    ids = _tokens()
    expected = build_stage(CFG, 0, CFG.n_layers)(ids)
    h = ids
    for first, last in splits:
        h = build_stage(CFG, first, last)(h)
    assert h.shape == (3, 32, 256)
    assert torch.equal(h, expected)


def test_initialisation_is_a_pure_function_of_seed_and_component() -> None:
    again = build_stage(CFG, 1, 3).state_dict()
    for name, value in build_stage(CFG, 1, 3).state_dict().items():
        assert torch.equal(again[name], value)
    other_seed = build_stage(ModelConfig(**{**CFG.to_dict(), "seed": 12}), 1, 3).state_dict()
    assert not torch.equal(other_seed["blocks.1.fc.weight"], again["blocks.1.fc.weight"])
    # different layers draw different values even with the same shape and seed
    assert not torch.equal(again["blocks.1.fc.weight"], again["blocks.2.fc.weight"])


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
def test_a_stage_built_in_another_process_is_bit_identical(processes: None) -> None:
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from tasklet.peer.compute.model import ModelConfig\n"
        f"{DIGEST_SOURCE}\n"
        f"print(params_digest(ModelConfig(**{CFG.to_dict()!r}), 1, 3))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == _params_digest(CFG, 1, 3)


def test_initial_loss_is_near_uniform_and_parameter_counts_add_up() -> None:
    model = build_stage(CFG, 0, CFG.n_layers)
    ids = _tokens()
    loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    assert abs(float(loss.detach()) - math.log(256)) < 0.1, "small init: predictions start near uniform"
    expected = CFG.params_embedding() + CFG.n_layers * CFG.params_per_layer() + CFG.params_head()
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"n_layers": 0}, "n_layers"), ({"d_model": 30}, "d_model"), ({"seq_len": -1}, "seq_len"),
     ({"seed": -3}, "seed"), ({"n_heads": 2.5}, "n_heads")],
)
def test_bad_config_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig(**{**CFG.to_dict(), **changes}).validate()  # type: ignore[arg-type]


def test_bad_layer_range_and_unknown_config_key_are_refused() -> None:
    for first, last in [(2, 2), (3, 1), (-1, 2), (0, 5)]:
        with pytest.raises(ModelConfigError, match="layers"):
            build_stage(CFG, first, last)
    with pytest.raises(ModelConfigError, match="n_layer"):
        ModelConfig.from_dict({"n_layer": 3})
    assert ModelConfig.from_dict(CFG.to_dict()) == CFG


def test_stage_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="int64 token ids"):
        build_stage(CFG, 0, 2)(torch.zeros(2, 8, 32))
    with pytest.raises(ValueError, match="exceeds model.seq_len"):
        build_stage(CFG, 0, 2)(torch.zeros(2, 33, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[B, T, 32\]"):
        build_stage(CFG, 2, 4)(torch.zeros(2, 8, 16))
    with pytest.raises(ValueError, match="does not match"):
        lm_loss(torch.zeros(2, 8, 256), torch.zeros(2, 7, dtype=torch.int64))
