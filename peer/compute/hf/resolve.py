"""From what a user names (a preset, a config.json, a Hugging Face folder) to a checked :class:`HFModelSpec`.

Every model goes through the self-check (:mod:`peer.compute.hf.selfcheck`) before any training: kept apart from
:mod:`peer.compute.hf.spec` because the self-check builds stages from specs.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tasklet.peer.compute.hf.checkpoint import Checkpoint, has_weights, model_fingerprint
from tasklet.peer.compute.hf.layout import ModelSourceError
from tasklet.peer.compute.hf.presets import PRESETS
from tasklet.peer.compute.hf.selfcheck import self_check
from tasklet.peer.compute.hf.spec import HFModelSpec, normalise_config, read_config


@functools.lru_cache(maxsize=16)
def resolve_model_cached(source: str, seq_len: int, seed: int = 0, tie: bool = False) -> HFModelSpec:
    """:func:`resolve_model`, once per process for the same arguments (a run config derives its spec often)."""
    return resolve_model(source, seq_len, seed, tie)


def resolve_model(source: str, seq_len: int, seed: int = 0, tie: bool = False) -> HFModelSpec:
    """A preset name, a config.json, or a Hugging Face folder (config.json [+ safetensors]) -> HFModelSpec;
    ``tie``: keep tied embeddings tied (see the module docstring)."""
    checkpoint: Checkpoint | None = None
    if source in PRESETS:
        raw, where = dict(PRESETS[source]), f"preset {source}"
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            where = str(path / "config.json")
            raw = read_config(path / "config.json")
            if has_weights(path):
                checkpoint = Checkpoint(path)
        elif path.suffix == ".json" or path.exists():
            raw, where = read_config(path), str(path)
        else:
            raise ModelSourceError(f"{source}: not a preset ({', '.join(PRESETS)}), a config.json or a model folder")
    config, tied = normalise_config(raw, where, tie)
    spec = HFModelSpec(config=config, seq_len=seq_len, seed=seed,
                       checkpoint=str(checkpoint.folder.resolve()) if checkpoint else None,
                       fingerprint=model_fingerprint(config, checkpoint), source=where, tied=tied,
                       keep_tied=tied and tie)
    spec.validate()
    self_check(config, where, seq_len)  # before any training: the stage cut computes what the model computes
    return spec
