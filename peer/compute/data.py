"""Training data: a byte-level tokenizer, a corpus, and micro-batches that are pure functions of their ids.

Why these choices:

* **Byte-level tokens** (vocabulary 256) need no vocabulary file, so every peer tokenises identically.
* **The default corpus is the Python standard library's own ``.py`` sources**: text that every machine running
  the daemon already has, so a swarm can train without anyone downloading a data set. Peers on different
  Python versions have different standard libraries, so the corpus exposes a :attr:`Corpus.fingerprint`
  (sha256 of its bytes) that the daemon compares before admitting a peer.
* **A micro-batch is a pure function of (seed, step, micro-batch id)** (docs/architecture.md, "Invariants"):
  whoever re-does a task after a peer died reads exactly the same tokens. Offsets are derived from sha256
  rather than from a PRNG, so they do not depend on the version of numpy or torch installed on a peer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_STDLIB_BYTES = 4 << 20  # a few MB: loads in well under a second, far more than a test run reads
DEFAULT_PATH_BYTES = 256 << 20
SNIFF_BYTES = 8192
# Folders inside the stdlib directory that hold installed (machine-specific) packages or bulky test data.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
)


class CorpusError(ValueError):
    """The corpus source is missing, empty or holds no text; the message names the path."""


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as int64 token ids in ``[0, 256)``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Inverse of :func:`encode`; byte sequences that are not valid UTF-8 (a sample cut mid-character) are
    replaced rather than raising, because generated or sliced text can end anywhere."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    if any(not 0 <= v < 256 for v in values):
        raise ValueError("token ids must lie in [0, 256) for the byte-level tokenizer")
    return bytes(values).decode("utf-8", errors="replace")


def _looks_binary(path: Path) -> bool:
    """A file is binary when its first 8 KiB contain a NUL byte (the heuristic git and grep use)."""
    with path.open("rb") as fh:
        return b"\0" in fh.read(SNIFF_BYTES)


def _walk_sorted(root: Path, excluded: frozenset[str] = frozenset()) -> list[Path]:
    """All regular files under ``root`` in a platform-independent order (sorted POSIX relative paths).

    Hidden files and folders (``.git``) are skipped. ``os.walk`` order depends on the file system, so the
    list is sorted explicitly; otherwise two peers with the same files could build different corpora.
    """
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in excluded)
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _concat(paths: list[Path], max_bytes: int) -> bytes:
    """Concatenate files (separated by a newline) up to ``max_bytes``, truncating the last one."""
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError as exc:  # unreadable file inside a folder: skip it, but say so
            log.warning("skipping unreadable corpus file %s: %s", path, exc)
            continue
        if not data:
            continue
        piece = data + b"\n"
        chunks.append(piece[: max_bytes - total])
        total += len(chunks[-1])
    return b"".join(chunks)


@dataclass(frozen=True, eq=False)
class Corpus:
    """The training text as a flat uint8 tensor, with a description of where it came from.

    Compare corpora by :attr:`fingerprint` (``eq=False``: comparing tensors with ``==`` is elementwise).
    """

    data: torch.Tensor  # uint8 [N]
    source: str
    fingerprint: str  # sha256 hex of the bytes

    @classmethod
    def from_bytes(cls, raw: bytes, source: str = "<bytes>") -> Corpus:
        if not raw:
            raise CorpusError(f"corpus {source} is empty")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
        return cls(data=data, source=source, fingerprint=hashlib.sha256(raw).hexdigest())

    @classmethod
    def from_stdlib(cls, max_bytes: int = DEFAULT_STDLIB_BYTES) -> Corpus:
        """The standard library's ``.py`` files (no installed packages, no test suite), sorted, capped."""
        root = Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise CorpusError(f"Python standard library not found at {root}; give a text file or folder")
        paths = [p for p in _walk_sorted(root, _STDLIB_EXCLUDED_DIRS) if p.suffix == ".py"]
        raw = _concat(paths, max_bytes)
        return cls.from_bytes(raw, source=f"stdlib:{root} ({len(raw)} bytes)")

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], max_bytes: int = DEFAULT_PATH_BYTES) -> Corpus:
        """A text file, or every text file under a folder (sorted; binary files skipped)."""
        root = Path(path).expanduser()
        if not root.exists():
            raise CorpusError(f"corpus path {root} does not exist")
        if root.is_file():
            if _looks_binary(root):
                raise CorpusError(f"corpus file {root} is binary, not text")
            return cls.from_bytes(_concat([root], max_bytes), source=str(root))
        if not root.is_dir():
            raise CorpusError(f"corpus path {root} is neither a file nor a folder")
        candidates = _walk_sorted(root)
        texts = [p for p in candidates if not _looks_binary(p)]
        if not texts:
            what = "only binary files" if candidates else "no files"
            raise CorpusError(f"corpus folder {root} holds {what}; give a folder with text files")
        skipped = len(candidates) - len(texts)
        if skipped:
            log.info("corpus %s: skipped %d binary file(s)", root, skipped)
        return cls.from_bytes(_concat(texts, max_bytes), source=str(root))

    @classmethod
    def load(cls, source: str | None = None) -> Corpus:
        """``None`` or ``"stdlib"`` -> the standard library; anything else is a path."""
        if source is None or source == "stdlib":
            return cls.from_stdlib()
        return cls.from_path(source)

    def __len__(self) -> int:
        return int(self.data.numel())


def _offset(seed: int, step: int, microbatch_id: int, row: int, n_starts: int) -> int:
    """Start of one row: sha256 of the ids, reduced modulo the number of valid starts.

    The hash is 256 bits, so the modulo bias is below ``n_starts / 2**256``: negligible.
    """
    digest = hashlib.sha256(f"tasklet-data/{seed}/{step}/{microbatch_id}/{row}".encode()).digest()
    return int.from_bytes(digest, "little") % n_starts


def microbatch(
    corpus: Corpus, seed: int, step: int, microbatch_id: int, micro_batch: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``microbatch_id`` of step ``step``: ``(inputs, targets)``, int64 ``[B, T]`` each.

    Row ``i`` starts at an offset that depends only on ``(seed, step, microbatch_id, i)``, and ``targets`` is
    ``inputs`` shifted left by one token (next-token prediction), which needs ``T + 1`` bytes per row.
    """
    for name, value in (("step", step), ("microbatch_id", microbatch_id), ("seed", seed)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch} and {seq_len}")
    n_starts = len(corpus) - seq_len
    if n_starts < 1:
        raise CorpusError(f"corpus {corpus.source} has {len(corpus)} bytes; need at least seq_len + 1")
    rows = [corpus.data[o : o + seq_len + 1] for o in
            (_offset(seed, step, microbatch_id, i, n_starts) for i in range(micro_batch))]
    windows = torch.stack(rows).to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
