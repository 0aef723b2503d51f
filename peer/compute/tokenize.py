"""Tokenizers: byte-level by default (no files), or a local Hugging Face tokenizer folder via AutoTokenizer.

Every peer must tokenise identically, so a tokenizer has a :attr:`fingerprint` (sha256 of its files) that goes
into the corpus fingerprint, and its vocabulary is checked against the model's before anything trains.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Protocol

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "vocab.txt")


class TokenizerError(ValueError):
    """A tokenizer folder cannot be used; the message names the folder or file and the field."""


class Tokenizer(Protocol):
    source: str
    fingerprint: str
    vocab_size: int  # ids lie in [0, vocab_size)
    separator: list[int]  # appended after every document when packing

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; documents separated by a newline (what the byte GPT has always read)."""

    source = "bytes"
    fingerprint = "bytes"
    vocab_size = 256
    separator = [10]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer folder read with transformers' AutoTokenizer (local files only)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise TokenizerError(f"{path}: tokenizer folder does not exist")
        files = [path / f for f in TOKENIZER_FILES if (path / f).is_file()]
        if not files:
            raise TokenizerError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
        from transformers import AutoTokenizer

        try:
            self.tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise TokenizerError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0]})") from None
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        self.source, self.fingerprint = str(path.resolve()), h.hexdigest()
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id
        self.separator = [int(eos)] if eos is not None else self.tok.encode("\n", add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))


def load_tokenizer(folder: str | None) -> Tokenizer:
    """``None`` (or ``""``): byte-level; otherwise a local tokenizer folder."""
    return ByteTokenizer() if not folder else HFTokenizer(folder)


def check_vocab(tokenizer: Tokenizer, model_vocab: int, model_source: str) -> None:
    """Refuse a tokenizer that emits ids the model has no embedding for (one line, naming both)."""
    if tokenizer.vocab_size > model_vocab:
        where = f"{tokenizer.source}/tokenizer.json" if tokenizer.source != "bytes" else "byte-level tokenizer"
        raise TokenizerError(f"{where}: vocabulary of {tokenizer.vocab_size} tokens does not fit the model's "
                             f"vocab_size {model_vocab} ({model_source})")
