"""Byte tokenizer, corpus loading and fingerprints, and micro-batches as pure functions of their ids."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasklet.peer.compute.data import Corpus, CorpusError, decode, encode, microbatch

TEXT = "def f(x):\n    return x + 1  # größer, 数字\n" * 50


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return Corpus.from_stdlib(max_bytes=1 << 20)


def test_tokenizer_round_trips_unicode_and_checks_ids() -> None:
    ids = encode(TEXT)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 256
    assert len(ids) == len(TEXT.encode("utf-8")) > len(TEXT), "non-ASCII characters are several bytes"
    assert decode(ids) == TEXT
    assert decode([0xE6]) == "\ufffd", "a cut multi-byte character decodes to the replacement character"
    with pytest.raises(ValueError, match="256"):
        decode([300])


def test_stdlib_corpus_is_deterministic_capped_and_fingerprinted(stdlib: Corpus) -> None:
    again = Corpus.from_stdlib(max_bytes=1 << 20)
    assert len(stdlib) == 1 << 20 and stdlib.data.dtype == torch.uint8
    assert again.fingerprint == stdlib.fingerprint
    assert stdlib.fingerprint == hashlib.sha256(stdlib.data.numpy().tobytes()).hexdigest()
    text = decode(stdlib.data[:20000])
    assert "import" in text and "def " in text, "the default corpus is Python source"
    smaller = Corpus.from_stdlib(max_bytes=1 << 16)
    assert torch.equal(smaller.data, stdlib.data[: 1 << 16]), "a smaller cap is a prefix of the same stream"
    assert smaller.fingerprint != stdlib.fingerprint


def test_folder_corpus_is_sorted_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("third\n")
    (tmp_path / "a.txt").write_text("first\n")  # written last, read first
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / ".hidden").write_text("never\n")
    corpus = Corpus.from_path(tmp_path)
    assert decode(corpus.data) == "first\n\nsecond\n\nthird\n\n"
    assert corpus.fingerprint == Corpus.from_bytes(b"first\n\nsecond\n\nthird\n\n").fingerprint
    single = Corpus.from_path(tmp_path / "a.txt")
    assert decode(single.data) == "first\n\n"
    assert Corpus.load(str(tmp_path)).fingerprint == corpus.fingerprint
    assert Corpus.load("stdlib").source.startswith("stdlib:")


def test_bad_corpus_paths_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        Corpus.from_path(tmp_path / "missing")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match="empty"):
        Corpus.from_path(tmp_path / "empty.txt")
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(CorpusError, match="binary"):
        Corpus.from_path(tmp_path / "img.png")
    binary_only = tmp_path / "bins"
    binary_only.mkdir()
    (binary_only / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(CorpusError, match="only binary files"):
        Corpus.from_path(binary_only)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CorpusError, match="no files"):
        Corpus.from_path(tmp_path / "nothing")


def test_microbatch_is_a_pure_function_of_its_ids(stdlib: Corpus) -> None:
    x, y = microbatch(stdlib, 1, 5, 3, micro_batch=4, seq_len=16)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the inputs shifted by one token"
    x2, y2 = microbatch(stdlib, 1, 5, 3, micro_batch=4, seq_len=16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # interleaving other calls changes nothing: no hidden generator state
    microbatch(stdlib, 9, 9, 9, micro_batch=2, seq_len=16)
    assert torch.equal(microbatch(stdlib, 1, 5, 3, 4, 16)[0], x)
    for other in [(2, 5, 3), (1, 6, 3), (1, 5, 4)]:
        assert not torch.equal(microbatch(stdlib, *other, micro_batch=4, seq_len=16)[0], x), other
    assert not torch.equal(x[0], x[1]), "rows of a micro-batch differ"


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
def test_microbatch_is_identical_in_another_process(stdlib: Corpus, processes: None) -> None:
    code = (
        "import hashlib\n"
        "from tasklet.peer.compute.data import Corpus, microbatch\n"
        "x, y = microbatch(Corpus.from_stdlib(max_bytes=1 << 20), 1, 5, 3, 4, 16)\n"
        "print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    x, y = microbatch(stdlib, 1, 5, 3, 4, 16)
    assert out.stdout.strip() == hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


def test_microbatch_bad_arguments(stdlib: Corpus) -> None:
    tiny = Corpus.from_bytes(b"0123456789")
    with pytest.raises(CorpusError, match="seq_len"):
        microbatch(tiny, 0, 0, 0, micro_batch=1, seq_len=10)
    assert microbatch(tiny, 0, 0, 0, micro_batch=1, seq_len=9)[0].shape == (1, 9), "exactly enough bytes"
    with pytest.raises(ValueError, match="step"):
        microbatch(stdlib, 0, -1, 0, 1, 8)
    with pytest.raises(ValueError, match="micro_batch"):
        microbatch(stdlib, 0, 0, 0, 0, 8)
