"""The load-time self-check: a stage-split forward of the model equals transformers' own forward.

:mod:`peer.compute.hf.layout` finds a model's parts by looking at it, and a stage repeats what the base model does
around its layers; an operation it cannot see (hidden in an unknown family's ``forward``) would make every stage
compute something else than the model, silently. So every model a user names goes through this check before
training: the same architecture with random weights — the config itself when the model is small, else a tiny
copy of it (2 layers, width 64, vocabulary 256) — is run once whole by transformers and once as two stages, on
random tokens, on the CPU (well under a second), and any difference refuses the model with one line.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import torch

from tasklet.peer.compute.hf.layout import ModelSourceError, build_meta_model
from tasklet.peer.compute.hf.spec import HFModelSpec, config_value

log = logging.getLogger(__name__)

FULL_CHECK_MAX_PARAMS = 30_000_000  # above this, the check runs on a tiny copy of the architecture
CHECK_TOKENS = 24
TOLERANCE = 1e-5  # relative to the largest logit: the two computations run the same fp32 kernels
_TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 256}


def _actual_key(config: dict[str, Any], key: str) -> str:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]].attribute_map.get(key, key)


def tiny_copy(config: dict[str, Any]) -> dict[str, Any]:
    """The same architecture at a test size: only shape fields change (under the family's own names)."""
    out = dict(config)
    for key, value in _TINY.items():
        actual = _actual_key(config, key)
        if actual in out and out[actual] is not None:
            out[actual] = value
    kv = _actual_key(config, "num_key_value_heads")
    if kv in config and config[kv] is not None and config[kv] == config.get(_actual_key(config, "num_attention_heads")):
        out[kv] = _TINY["num_attention_heads"]  # multi-head attention stays multi-head
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # special tokens must fit the tiny vocabulary
        if isinstance(out.get(key), int) and out[key] >= _TINY["vocab_size"]:
            out[key] = None
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][: _TINY["num_hidden_layers"]]
    return out


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (norms near 1): a zero-initialised part would hide a difference."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.1 + 1.0 if p.dim() == 1 and name.endswith("weight") else noise * 0.1)


def self_check(config: dict[str, Any], where: str, seq_len: int) -> float:
    """Run the check on a normalised config dict; return the relative difference or raise a one-line
    :class:`ModelSourceError`. Cached per process for the same config."""
    return _self_check(json.dumps(config, sort_keys=True), where, seq_len)


@functools.lru_cache(maxsize=32)
def _self_check(config_json: str, where: str, seq_len: int) -> float:
    with torch.random.fork_rng(devices=[]):  # transformers' own initialisation draws from the global generator
        return _run_check(config_json, where, seq_len)


def _run_check(config_json: str, where: str, seq_len: int) -> float:
    from transformers import AutoModelForCausalLM

    config = json.loads(config_json)
    spec = HFModelSpec(config=config, seq_len=seq_len, source=where)
    meta = build_meta_model(spec.hf_config(), where)
    size = sum(p.numel() for p in meta.parameters())
    if size > FULL_CHECK_MAX_PARAMS:
        spec = HFModelSpec(config=tiny_copy(config), seq_len=seq_len, source=where)
    arch = type(meta).__name__
    tokens = min(seq_len, CHECK_TOKENS)
    ids = torch.randint(0, int(config_value(spec.config, "vocab_size")), (2, tokens),
                        generator=torch.Generator().manual_seed(0))
    try:
        model = AutoModelForCausalLM.from_config(spec.hf_config()).eval()
        _randomise(model, 0)
        weights = model.state_dict()  # a tied head appears under its own name too
        n, x = spec.n_layers, ids
        cuts = [(0, n // 2), (n // 2, n)] if n > 1 else [(0, n)]
        with torch.no_grad():
            want = model(input_ids=ids).logits
            for a, b in cuts:
                stage = spec.build_stage(a, b).eval()
                stage.load_state_dict({k: weights[k] for k, _ in stage.named_parameters()}, strict=False)
                x = stage(x)
    except ModelSourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of an unknown family's code is a refusal, in one line
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise ModelSourceError(f"{where}: self-check: {arch} fails as pipeline stages ({type(exc).__name__}: "
                               f"{first})") from None
    err = float((x - want).abs().max() / want.abs().max().clamp_min(1e-6))
    if not err <= TOLERANCE:
        raise ModelSourceError(f"{where}: self-check: {arch} cut into stages {cuts} computes logits {err:.1e} "
                               f"(relative) away from transformers' forward; it does something around its layers "
                               "that the stage cut does not reproduce")
    log.info("%s: self-check passed: %s as stages %s equals transformers' forward (relative difference %.1e%s)",
             where, arch, cuts, err, ", on a tiny copy of the architecture" if size > FULL_CHECK_MAX_PARAMS else "")
    return err
