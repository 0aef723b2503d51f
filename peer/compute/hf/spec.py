"""The model part of a run for a Hugging Face family: a config dict, an optional checkpoint, a fingerprint.

:class:`HFModelSpec` travels inside the ``RunSpec`` (JSON), so every peer builds its stage from the same config
without sharing a file; a checkpoint is a *local* folder every peer holds at the same path, checked against the
run's fingerprint. It offers the same duck-typed surface as the byte GPT's ``ModelConfig`` (``n_layers``,
``d_model``, ``seq_len``, ``vocab_size``, ``validate``, ``to_dict``, ``build_stage``), which is all the stage
runtime needs.

What :func:`resolve_model` changes in a config, and why (each logged once): dropout is set to 0 (a forward pass
must be a deterministic function of parameters and input, or a redone task would differ); tied input/output
embeddings are untied (they live on different stages; the head starts as a copy of the embedding, so the model
is the same at step 0, and the exported config says ``tie_word_embeddings: false``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from peer.compute.hf.checkpoint import Checkpoint, has_weights, model_fingerprint
from peer.compute.hf.families import Family, ModelSourceError, family_of, shape_value
from peer.compute.hf.presets import PRESETS

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# upper bounds of a config's shape (far above any model trained today; a spec from the network is hostile)
MAX_SHAPE = {"num_hidden_layers": 1024, "n_layer": 1024, "hidden_size": 1 << 16, "n_embd": 1 << 16,
             "num_attention_heads": 1024, "n_head": 1024, "vocab_size": 1 << 22,
             "max_position_embeddings": 1 << 21, "n_positions": 1 << 21}
_DROPPED_KEYS = ("transformers_version", "id2label", "label2id", "_name_or_path", "dtype", "torch_dtype")


@dataclass(frozen=True)
class HFModelSpec:
    """A transformers causal LM: ``config`` (normalised config.json), trained on ``seq_len``-token sequences."""

    config: dict[str, Any]
    seq_len: int
    seed: int = 0
    checkpoint: str | None = None  # local folder of safetensors every peer holds; None: seeded initialisation
    fingerprint: str = ""  # sha256 of the config and the checkpoint index
    source: str = ""  # what the user named (preset, config.json, folder), for messages
    tied: bool = False  # the original model tied embeddings (the head starts as a copy of the embedding)
    kind: str = field(default="hf", init=False)

    @property
    def family(self) -> Family:
        return family_of(self.config, self.source or "model")

    @property
    def n_layers(self) -> int:
        return int(self.config[self.family.n_layers_key])

    @property
    def d_model(self) -> int:
        return int(self.config[self.family.hidden_key])

    @property
    def n_heads(self) -> int:
        return int(self.config[self.family.heads_key])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def validate(self) -> HFModelSpec:
        where = self.source or "model"
        fam = family_of(self.config, where)
        for key in (fam.n_layers_key, fam.hidden_key, fam.heads_key, "vocab_size", fam.positions_key):
            value = shape_value(self.config, key, where)
            if value > MAX_SHAPE[key]:  # a spec arrives over the network: bound what building a stage costs
                raise ModelSourceError(f"{where}: {key}: {value} exceeds the supported {MAX_SHAPE[key]}")
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ModelSourceError(f"{where}: seq_len: must be a positive integer, got {self.seq_len!r}")
        if self.seq_len > self.config[fam.positions_key]:
            raise ModelSourceError(f"{where}: {fam.positions_key}: {self.config[fam.positions_key]} positions, "
                                   f"fewer than the run's seq_len {self.seq_len}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ModelSourceError(f"{where}: seed: must be a non-negative integer, got {self.seed!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HFModelSpec:
        d = dict(d)
        if d.pop("kind", "hf") != "hf":
            raise ModelSourceError("model.kind: expected 'hf'")
        if not isinstance(d.get("config"), dict):
            raise ModelSourceError("model.config: expected a JSON object")
        try:
            return cls(**d).validate()
        except TypeError as exc:
            raise ModelSourceError(f"model: {exc}") from None

    def hf_config(self) -> Any:
        """The transformers config object (sdpa attention, which every stage and the reference use)."""
        from transformers import AutoConfig

        cfg = dict(self.config)
        model_type = cfg.pop("model_type")
        config = AutoConfig.for_model(model_type, **cfg)
        config._attn_implementation = "sdpa"
        return config

    def build_stage(self, first_layer: int, last_layer: int) -> Any:
        from peer.compute.hf.stage import HFStageModule

        return HFStageModule(self, first_layer, last_layer)

    def stage_shapes(self, first_layer: int, last_layer: int) -> list[tuple[str, Any]]:
        """Parameter names and shapes of a stage in flat order, without allocating or reading weights."""
        from peer.compute.hf.stage import HFStageModule

        module = HFStageModule(self, first_layer, last_layer, materialise=False)
        return [(n, p.shape) for n, p in module.named_parameters()]


def _read_config(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelSourceError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ModelSourceError(f"{path}: expected a JSON object")
    return doc


def normalise_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], bool]:
    """Validate through transformers and return (config dict as JSON, whether it tied embeddings)."""
    fam = family_of(raw, where)
    from transformers import AutoConfig

    cfg = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(fam.name, **cfg)
    except (TypeError, ValueError) as exc:
        raise ModelSourceError(f"{where}: {exc}") from None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        log.warning("%s: input and output embeddings are untied for training (they live on different stages); "
                    "the head starts as a copy of the embedding and the exported model is untied", where)
        config.tie_word_embeddings = False
    for key in fam.dropout_keys:
        if getattr(config, key, 0.0):
            log.info("%s: %s set to 0 (a forward pass must be deterministic)", where, key)
            setattr(config, key, 0.0)
    out = json.loads(json.dumps(config.to_dict(), default=str))
    for key in _DROPPED_KEYS:
        out.pop(key, None)
    out["architectures"] = [family_architecture(fam)]
    return out, tied


def family_architecture(fam: Family) -> str:
    from peer.compute.hf.families import ARCHITECTURES

    return ARCHITECTURES[fam.name]


@functools.lru_cache(maxsize=16)
def resolve_model_cached(source: str, seq_len: int, seed: int = 0) -> HFModelSpec:
    """:func:`resolve_model`, once per process for the same arguments (a run config derives its spec often)."""
    return resolve_model(source, seq_len, seed)


def resolve_model(source: str, seq_len: int, seed: int = 0) -> HFModelSpec:
    """A preset name, a config.json, or a Hugging Face folder (config.json [+ safetensors]) -> HFModelSpec."""
    checkpoint: Checkpoint | None = None
    if source in PRESETS:
        raw, where = dict(PRESETS[source]), f"preset {source}"
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            where = str(path / "config.json")
            raw = _read_config(path / "config.json")
            if has_weights(path):
                checkpoint = Checkpoint(path)
        elif path.suffix == ".json" or path.exists():
            raw, where = _read_config(path), str(path)
        else:
            raise ModelSourceError(f"{source}: not a preset ({', '.join(PRESETS)}), a config.json or a model folder")
    config, tied = normalise_config(raw, where)
    spec = HFModelSpec(config=config, seq_len=seq_len, seed=seed,
                       checkpoint=str(checkpoint.folder.resolve()) if checkpoint else None,
                       fingerprint=model_fingerprint(config, checkpoint), source=where, tied=tied)
    return spec.validate()
