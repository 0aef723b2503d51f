"""run.toml: a configuration survives writing and reading back; bad keys and values name what is wrong."""

from __future__ import annotations

import tomllib

import pytest

from tasklet.peer.config import ConfigError, RunConfig


def test_to_toml_round_trips() -> None:
    cfg = RunConfig()
    cfg.run.steps, cfg.model.d_model, cfg.optim.lr = 7, 32, 3e-4
    cfg.emulation.scenario, cfg.emulation.devices = "worldwide_geo_distributed", [0, 8, 16]
    back = RunConfig.from_dict(tomllib.loads(cfg.to_toml()))
    assert back.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(("data", "needle"), [
    ({"run": {"stepz": 3}}, "unknown key 'stepz'"),
    ({"nonsense": {}}, "unknown section [nonsense]"),
    ({"run": {"steps": "3"}}, "steps must be int"),
    ({"emulation": {"devices": [0, "a"]}}, "devices must be a list of integers"),
    ({"run": {"outer_overlap": "yes"}}, "outer_overlap must be bool"),
])
def test_bad_values_name_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(data)
    assert needle in str(err.value)


@pytest.mark.parametrize("swarm", [{"checkpoint_keep": 0}, {"checkpoint_copies": -1}])
def test_checkpoint_retention_and_copies_are_checked(swarm: dict) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"swarm": swarm})
    assert "checkpoint_keep must be >= 1 and checkpoint_copies >= 0" in str(err.value)


def test_checkpoint_retention_and_copies_reach_the_run_driver() -> None:
    cfg = RunConfig.from_dict({"swarm": {"checkpoint_keep": 5, "checkpoint_copies": 0}})
    cfg.validate()
    assert (cfg.swarm.checkpoint_keep, cfg.swarm.checkpoint_copies) == (5, 0)


def test_the_outer_overlap_reaches_the_run_spec() -> None:
    cfg = RunConfig.from_dict({"run": {"sync_period": 4, "pseudo_grad_compression": "int8", "outer_overlap": True}})
    spec = cfg.spec()
    assert (spec.sync_period, spec.outer_overlap) == (4, True)
    assert RunConfig().spec().outer_overlap is False  # in step unless the organiser asks
