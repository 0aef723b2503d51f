"""The model part of a run for a Hugging Face family: a config dict, an optional checkpoint, a fingerprint.

:class:`HFModelSpec` travels inside the ``RunSpec`` (JSON), so every peer builds its stage from the same config
without sharing a file; a checkpoint is a *local* folder every peer holds at the same path, checked against the
run's fingerprint. It offers the same duck-typed surface as the byte GPT's ``ModelConfig`` (``n_layers``,
``d_model``, ``seq_len``, ``vocab_size``, ``validate``, ``to_dict``, ``build_stage``), which is all the stage
runtime needs.

What :func:`resolve_model` changes in a config, and why (each logged once): dropout is set to 0 (a forward pass
must be a deterministic function of parameters and input, or a redone task would differ); tied input/output
embeddings are untied unless ``tie=True`` (they live on different stages; the head starts as a copy of the
embedding, so the model is the same at step 0, and the exported config says ``tie_word_embeddings: false``).
With ``tie=True`` — what a run file asks for unless it runs DiLoCo — the config stays tied: the first stage's
embedding and the last stage's head are two copies of one weight whose gradients are summed
(``peer.compute.hf.tied``; between the stages by ``peer.runtime.stage.tied``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasklet.peer.compute.hf.layout import Layout, ModelSourceError, build_meta_model, find_layout

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# upper bounds of a config's shape, by transformers' standard names (far above any model trained today; a spec
# from the network is hostile)
MAX_SHAPE = {"num_hidden_layers": 1024, "hidden_size": 1 << 16, "num_attention_heads": 1024, "vocab_size": 1 << 22,
             "max_position_embeddings": 1 << 21}
_DROPPED_KEYS = ("transformers_version", "id2label", "label2id", "_name_or_path", "dtype", "torch_dtype")


def config_value(config: dict[str, Any], key: str) -> Any:
    """A config field by transformers' standard name (``hidden_size``), whatever the family calls it (GPT-2's
    ``n_embd``): the config class's ``attribute_map`` says."""
    if key in config:
        return config[key]
    from transformers import CONFIG_MAPPING

    try:
        attribute_map = CONFIG_MAPPING[config.get("model_type")].attribute_map
    except KeyError:
        return None
    return config.get(attribute_map.get(key, key))


def shape_value(config: dict[str, Any], key: str, where: str) -> int:
    """A positive integer field of the config, or a one-line error naming it."""
    value = config_value(config, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelSourceError(f"{where}: {key}: must be a positive integer, got {value!r}")
    return value


def _to_config(config: dict[str, Any], where: str) -> Any:
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ModelSourceError(f"{where}: model_type: missing (not a transformers config.json?)")
    try:
        config_obj = AutoConfig.for_model(model_type, **cfg)
    except (TypeError, ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSourceError(f"{where}: model_type: {model_type!r} is not a transformers model ({first})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config_obj), None)
    # sdpa where the family supports it (every stage and the reference use the same kernels); else eager (Gemma-2)
    config_obj._attn_implementation = "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"
    return config_obj


@functools.lru_cache(maxsize=32)
def _layout_cached(config_json: str, where: str) -> Layout:
    config_obj = _to_config(json.loads(config_json), where)
    return find_layout(build_meta_model(config_obj, where), config_obj, where)


def layout_of(config: dict[str, Any], where: str) -> Layout:
    """The :class:`Layout` of a normalised config dict (built once per process for the same config)."""
    return _layout_cached(json.dumps(config, sort_keys=True), where)


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
    keep_tied: bool = False  # the config stays tied (gradients summed between first and last stage)
    kind: str = field(default="hf", init=False)

    @property
    def layout(self) -> Layout:
        return layout_of(self.config, self.source or "model")

    @property
    def n_layers(self) -> int:
        return int(config_value(self.config, "num_hidden_layers"))

    @property
    def d_model(self) -> int:
        return int(config_value(self.config, "hidden_size"))

    @property
    def n_heads(self) -> int:
        return int(config_value(self.config, "num_attention_heads"))

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def validate(self) -> HFModelSpec:
        where = self.source or "model"
        if not isinstance(self.config.get("model_type"), str):
            raise ModelSourceError(f"{where}: model_type: missing (not a transformers config.json?)")
        for key in MAX_SHAPE:
            if key == "max_position_embeddings" and config_value(self.config, key) is None:
                continue  # no learned or rotary position limit in the config
            value = shape_value(self.config, key, where)
            if value > MAX_SHAPE[key]:  # a spec arrives over the network: bound what building a stage costs
                raise ModelSourceError(f"{where}: {key}: {value} exceeds the supported {MAX_SHAPE[key]}")
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ModelSourceError(f"{where}: seq_len: must be a positive integer, got {self.seq_len!r}")
        positions = config_value(self.config, "max_position_embeddings")
        if positions is not None and self.seq_len > positions:
            raise ModelSourceError(f"{where}: max_position_embeddings: {positions} positions, "
                                   f"fewer than the run's seq_len {self.seq_len}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ModelSourceError(f"{where}: seed: must be a non-negative integer, got {self.seed!r}")
        layout_of(self.config, where)  # a spec from the network: its layout is refused here, not in a stage
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
        """The transformers config object (sdpa attention where the family has it, which every stage and the
        reference use)."""
        return _to_config(self.config, self.source or "model")

    def build_stage(self, first_layer: int, last_layer: int) -> Any:
        from tasklet.peer.compute.hf.stage import HFStageModule

        return HFStageModule(self, first_layer, last_layer)

    def stage_shapes(self, first_layer: int, last_layer: int) -> list[tuple[str, Any]]:
        """Parameter names and shapes of a stage in flat order, without allocating or reading weights."""
        from tasklet.peer.compute.hf.stage import HFStageModule

        module = HFStageModule(self, first_layer, last_layer, materialise=False)
        return [(n, p.shape) for n, p in module.named_parameters()]


def read_config(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelSourceError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ModelSourceError(f"{path}: expected a JSON object")
    return doc


def normalise_config(raw: dict[str, Any], where: str, tie: bool = False) -> tuple[dict[str, Any], bool]:
    """Validate through transformers, find the layout (or refuse), and return (config dict as JSON, whether it
    tied embeddings)."""
    config = _to_config(raw, where)
    meta = build_meta_model(config, where)
    arch = type(meta).__name__
    wrong = [a for a in (raw.get("architectures") or []) if a != arch]
    if wrong:
        raise ModelSourceError(f"{where}: architectures: {wrong[0]!r} is not supported (expected {arch}, the causal "
                               f"LM of model_type {config.model_type!r})")
    find_layout(meta, config, where)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and not tie:
        log.warning("%s: input and output embeddings are untied for training (asked for: a DiLoCo run); the head "
                    "starts as a copy of the embedding and the exported model is untied", where)
        config.tie_word_embeddings = False
    for key, value in sorted(config.to_dict().items()):
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value:
            log.info("%s: %s set to 0 (a forward pass must be deterministic)", where, key)
            setattr(config, key, 0.0)
    out = json.loads(json.dumps(config.to_dict(), default=str))
    for key in _DROPPED_KEYS:
        out.pop(key, None)
    out["architectures"] = [arch]
    return out, tied
