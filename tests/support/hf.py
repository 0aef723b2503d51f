"""Local files for the Hugging Face tests — nothing downloaded: a BPE tokenizer trained here with
``tokenizers``, tiny models saved by transformers from a config, JSONL and Parquet corpora."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

SAMPLE_DOCS = [
    f"Document {i}: the swarm trains a model on volunteer machines, stage by stage, step {i}." for i in range(200)
]


def stdlib_text(limit: int = 200_000) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join(p.read_text(errors="replace") for p in sorted(root.glob("[a-c]*.py")))[:limit]


def make_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE tokenizer on local text and save it as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([stdlib_text(), *SAMPLE_DOCS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, field: str = "text", docs: list[str] = SAMPLE_DOCS) -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, field: str = "text", docs: list[str] = SAMPLE_DOCS) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), str(path))
    return path


def save_model(folder: Path, preset: str, seed: int = 0, max_shard_size: str | None = None, tie: bool = False) -> Path:
    """A tiny model from a preset config, saved by transformers (sharded when max_shard_size is given; ``tie``:
    a tied model, whose checkpoint holds no head)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasklet.peer.compute.hf import resolve_model

    torch.manual_seed(seed)
    spec = resolve_model(preset, seq_len=32, tie=tie)
    model = AutoModelForCausalLM.from_config(spec.hf_config())
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return folder
