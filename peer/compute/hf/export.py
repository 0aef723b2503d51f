"""From a run's result folder to a Hugging Face model folder people load with ``from_pretrained``.

A result folder (``[swarm] save_dir``, ``peer swarm --save``) holds ``run.json`` — whose ``spec`` is the run's
RunSpec as JSON, the model config included — and one ``stage-<s>.pt`` per stage (its parameters by full-model
name). The export merges the stages, loads them into transformers' own model class with ``strict`` names (a
missing or extra tensor is an error, not a silently random weight), and writes ``config.json``,
``model.safetensors`` and the tokenizer's files (or ``tasklet_tokenizer.json`` naming the byte-level one).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.compute.hf.layout import ModelSourceError
from tasklet.peer.compute.hf.spec import HFModelSpec

log = logging.getLogger(__name__)

BYTE_TOKENIZER_FILE = "tasklet_tokenizer.json"


def write_result(folder: Path, run_spec: dict[str, Any], stage_params: dict[int, dict[str, torch.Tensor]]) -> Path:
    """A result folder as the leader writes it (run.json with the spec, stage-<s>.pt); used by local runs."""
    folder.mkdir(parents=True, exist_ok=True)
    for stage, named in stage_params.items():
        torch.save({n: t.clone() for n, t in named.items()}, folder / f"stage-{stage}.pt")
    (folder / "run.json").write_text(json.dumps({"spec": run_spec}, indent=1))
    return folder


def read_result(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the run's spec dict, every stage's parameters merged by name)."""
    run_file = folder / "run.json"
    try:
        run = json.loads(run_file.read_text())
    except FileNotFoundError:
        raise ModelSourceError(f"{run_file}: no such file (not a result folder)") from None
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{run_file}: not valid JSON ({exc})") from None
    spec = run.get("spec") if isinstance(run, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise ModelSourceError(f"{run_file}: spec.model: missing (written by an older version?)")
    stages = sorted(folder.glob("stage-*.pt"))
    if not stages:
        raise ModelSourceError(f"{folder}: no stage-*.pt files")
    merged: dict[str, torch.Tensor] = {}
    for path in stages:
        named = torch.load(path, map_location="cpu", weights_only=True)
        overlap = set(named) & set(merged)
        if overlap:
            raise ModelSourceError(f"{path}: tensor {sorted(overlap)[0]} is also in another stage file")
        merged.update(named)
    return spec, merged


def _merge_tied(model: torch.nn.Module, params: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """A tied model's head is the embedding: the last stage's copy must equal the first's, and is dropped."""
    head = model.get_output_embeddings()
    if not model.config.tie_word_embeddings or head is None:
        return params
    head_name = next(n for n, p in model.named_modules() if p is head) + ".weight"
    emb_name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    if head_name in params and emb_name in params:
        if not torch.equal(params[head_name], params[emb_name]):
            err = float((params[head_name] - params[emb_name]).abs().max())
            raise ModelSourceError(f"{folder}: tied {head_name} differs from {emb_name} by {err:.2e} (the tied "
                                   "copies were not updated together)")
        params = {n: t for n, t in params.items() if n != head_name}
    return params


def _quiet() -> None:
    """No progress bars from transformers (the CLI prints one line of its own)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def export(result_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face folder for the run in ``result_dir``; return the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet()

    folder, out = Path(result_dir), Path(out_dir)
    spec_dict, params = read_result(folder)
    model_dict = spec_dict["model"]
    if model_dict.get("kind") != "hf":
        raise ModelSourceError(f"{folder / 'run.json'}: spec.model: the built-in byte GPT is not a Hugging Face "
                               "family; train with --model PRESET|CONFIG|DIR to export")
    spec = HFModelSpec.from_dict({**model_dict, "checkpoint": None})
    model = AutoModelForCausalLM.from_config(spec.hf_config())
    expected = {n for n, _ in model.named_parameters()}
    params = _merge_tied(model, params, folder)
    missing, extra = sorted(expected - set(params)), sorted(set(params) - expected)
    if missing or extra:
        raise ModelSourceError(f"{folder}: stage files {'lack ' + missing[0] if missing else 'hold ' + extra[0]} "
                               f"({len(missing)} missing, {len(extra)} unexpected tensor(s))")
    model.load_state_dict(params, strict=False)
    out.mkdir(parents=True, exist_ok=True)
    model.config.update({"architectures": model_dict["config"].get("architectures")})
    model.save_pretrained(str(out))
    tokenizer = spec_dict.get("tokenizer")
    if tokenizer:
        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(str(out))
    else:
        (out / BYTE_TOKENIZER_FILE).write_text(json.dumps({"kind": "bytes", "vocab_size": 256}) + "\n")
    log.info("exported %s (%d tensors) to %s", spec.source, len(params), out)
    return out


def generate(model_dir: str | Path, prompt: str, max_new_tokens: int = 40, seed: int = 0,
             temperature: float = 1.0, top_k: int = 50) -> str:
    """Sample a continuation of ``prompt`` from an exported (or any local Hugging Face) model folder."""
    from transformers import AutoModelForCausalLM

    from tasklet.peer.compute.tokenize import ByteTokenizer, HFTokenizer, Tokenizer

    _quiet()
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{folder / 'config.json'}: no such file (not a model folder)")
    tok: Tokenizer = ByteTokenizer() if (folder / BYTE_TOKENIZER_FILE).is_file() else HFTokenizer(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{folder}: cannot load the model ({str(exc).splitlines()[0]})") from None
    model.eval()
    ids = tok.encode_batch([prompt])[0] or tok.separator
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=top_k,
                             pad_token_id=tok.separator[0])
    return prompt + tok.decode(out[0, len(ids):].tolist())
