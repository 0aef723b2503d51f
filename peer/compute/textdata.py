"""Training text from local files — plain text, JSONL (a named text field) or Parquet — tokenized and packed.

Why it is built this way:

* **Streamed, then memory-mapped.** Documents are read with ``datasets`` in streaming mode (never the whole
  corpus in memory), tokenized in batches and appended, each followed by the tokenizer's separator (EOS), to one
  flat int32 token file in a cache folder. Training reads that file through ``np.memmap``: the operating system
  pages in the windows a micro-batch touches, nothing more.
* **Packing = windows over the packed stream.** A micro-batch row is ``seq_len + 1`` consecutive tokens at an
  offset hashed from (seed, step, micro-batch, row) — :func:`peer.compute.data.microbatch` unchanged — so
  micro-batches stay pure functions of their ids and documents are packed back to back without padding.
* **Fingerprint = sha256 of the token stream**, so it covers the files, the text field and the tokenizer at
  once; every peer compares it with the run's before it joins, as for the byte corpus.
* The byte-level tokenizer on plain text (or the standard library) keeps the original byte corpus, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasklet.peer.compute.data import Corpus, CorpusError
from tasklet.peer.compute.family import family_of
from tasklet.peer.compute.tokenize import ByteTokenizer, Tokenizer, check_vocab, load_tokenizer

log = logging.getLogger(__name__)

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BATCH_DOCS = 256
FORMAT = 1


def cache_root() -> Path:
    return Path(os.environ.get("TASKLET_CACHE", Path.home() / ".cache" / "tasklet")) / "tokens"


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = sorted((p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise CorpusError(f"corpus folder {root} holds no files")
    return files


def _builder(files: list[Path]) -> str:
    kinds = {BUILDERS.get(p.suffix.lower(), "text") for p in files}
    if len(kinds) > 1:
        raise CorpusError(f"corpus {files[0].parent}: mixes {', '.join(sorted(kinds))} files; give one kind")
    return kinds.pop()


def _documents(files: list[Path], builder: str, text_field: str) -> Iterator[str]:
    """The texts, one per record (JSONL/Parquet) or paragraph (plain text), streamed in file order."""
    from datasets import load_dataset

    for path in files:
        kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            ds = load_dataset(builder, data_files=str(path), split="train", streaming=True, **kwargs)
            field = "text" if builder == "text" else text_field
            for i, record in enumerate(ds, start=1):
                if field not in record:
                    raise CorpusError(f"{path}: record {i} has no field {field!r} "
                                      f"(fields: {', '.join(sorted(record)) or 'none'})")
                text = record[field]
                if not isinstance(text, str):
                    raise CorpusError(f"{path}: record {i} field {field!r} is {type(text).__name__}, not text")
                yield text
        except CorpusError:
            raise
        except Exception as exc:  # datasets/pyarrow raise many kinds on malformed files
            raise CorpusError(f"{path}: cannot read as {builder} ({str(exc).splitlines()[0][:200]})") from None


def _cache_key(files: list[Path], builder: str, text_field: str, tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(f"{FORMAT}/{builder}/{text_field}/{tokenizer.fingerprint}".encode())
    for p in files:
        st = p.stat()
        h.update(f"\0{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def tokenize_to_file(documents: Iterator[str], tokenizer: Tokenizer, out: Path) -> tuple[int, str]:
    """Tokenize and pack ``documents`` into ``out`` (int32); return (number of tokens, sha256 of the bytes)."""
    h = hashlib.sha256()
    n = 0
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    batch: list[str] = []
    with tmp.open("wb") as fh:
        def flush() -> None:
            nonlocal n
            for ids in tokenizer.encode_batch(batch):
                arr = np.asarray([*ids, *tokenizer.separator], dtype=np.int32).tobytes()
                fh.write(arr)
                h.update(arr)
                n += len(arr) // 4
            batch.clear()

        try:
            for text in documents:
                batch.append(text)
                if len(batch) >= BATCH_DOCS:
                    flush()
            flush()
        except BaseException:
            fh.close()
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, out)
    return n, h.hexdigest()


def _cached_tokens(key: str, documents: Iterator[str], tokenizer: Tokenizer, what: str,
                   cache: Path | None) -> Corpus:
    folder = cache or cache_root()
    folder.mkdir(parents=True, exist_ok=True)
    data_path, meta_path = folder / f"{key}.bin", folder / f"{key}.json"
    meta: dict[str, Any] | None = None
    if meta_path.is_file() and data_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = None
    if meta is None or meta.get("tokens") != data_path.stat().st_size // 4:
        log.info("tokenizing %s with %s", what, tokenizer.source)
        n, digest = tokenize_to_file(documents, tokenizer, data_path)
        meta = {"tokens": n, "fingerprint": digest, "source": what}
        meta_path.write_text(json.dumps(meta))
    if meta["tokens"] < 2:
        raise CorpusError(f"corpus {what} holds no text")
    mapped = np.memmap(data_path, dtype=np.int32, mode="c")  # copy-on-write: torch wants a writable buffer
    return Corpus(data=torch.from_numpy(mapped), source=f"{what} ({meta['tokens']} tokens)",
                  fingerprint=meta["fingerprint"])


def open_tokens(source: str, tokenizer: Tokenizer, text_field: str = "text",
                cache: Path | None = None) -> Corpus:
    """The token corpus of a file or folder (tokenized once into the cache, then memory-mapped)."""
    root = Path(source).expanduser()
    if not root.exists():
        raise CorpusError(f"corpus path {root} does not exist")
    files = _files(root)
    builder = _builder(files)
    key = _cache_key(files, builder, text_field, tokenizer)
    what = f"{root} ({builder}" + (f", field {text_field!r})" if builder != "text" else ")")
    return _cached_tokens(key, _documents(files, builder, text_field), tokenizer, what, cache)


def stdlib_tokens(tokenizer: Tokenizer, cache: Path | None = None) -> Corpus:
    """The standard library corpus (a few MB, read as today) tokenized with ``tokenizer``, by paragraph."""
    raw = Corpus.from_stdlib()
    key = hashlib.sha256(f"{FORMAT}/stdlib/{raw.fingerprint}/{tokenizer.fingerprint}".encode()).hexdigest()[:32]
    text = bytes(raw.data.numpy()).decode("utf-8", errors="replace")
    return _cached_tokens(key, iter(text.split("\n\n")), tokenizer, "stdlib", cache)


def load_corpus(source: str | None, tokenizer: str | None = None, text_field: str = "text",
                model: Any = None, cache: Path | None = None) -> Corpus:
    """The run's corpus: ``source`` None/"stdlib" or a path, tokenized with ``tokenizer`` (None: bytes).

    ``model`` (a spec of a registered family) is checked to embed every token id.
    """
    tok = load_tokenizer(tokenizer)
    if model is not None:
        check_vocab(tok, int(model.vocab_size), family_of(model).describe(model))
    if isinstance(tok, ByteTokenizer):
        if source is None or source == "stdlib":
            return Corpus.from_stdlib()
        files = _files(Path(source).expanduser()) if Path(source).expanduser().exists() else []
        if not files or _builder(files) == "text":
            return Corpus.from_path(source)
    if source is None or source == "stdlib":
        return stdlib_tokens(tok, cache)
    return open_tokens(source, tok, text_field, cache)
