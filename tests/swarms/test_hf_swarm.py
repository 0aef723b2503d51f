"""End to end through whole daemons, as a new user would: a tiny Gemma-2 built by transformers from a config and
saved as a sharded pretrained folder (tied embeddings), a locally trained tokenizer and a JSONL file;
`peer swarm --model DIR --tokenizer DIR --data FILE.jsonl` fine-tunes it (tied: the first stage's embedding and the
last stage's head stay one weight, over emulated world-wide links), `peer export` writes a folder that
transformers loads, whose logits equal the trained stages' forward, and `peer generate` prints text from it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasklet.peer.compute.hf.export import read_result
from tasklet.peer.runtime.spec import RunSpec
from tests.support.hf import make_tokenizer, save_model, write_jsonl

pytestmark = pytest.mark.usefixtures("processes")


def peer(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tasklet.peer.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
def test_swarm_trains_a_hugging_face_model_that_exports_and_generates(tmp_path: Path) -> None:
    tok, data = make_tokenizer(tmp_path / "tok"), write_jsonl(tmp_path / "docs.jsonl")
    result, exported = tmp_path / "result", tmp_path / "exported"
    pretrained = save_model(tmp_path / "gemma2", "tiny-gemma2", max_shard_size="100KB", tie=True)
    run = peer("swarm", "--peers", "2", "--scenario", "worldwide_geo_distributed", "--steps", "2", "--stages", "2",
               "--model", str(pretrained), "--tokenizer", str(tok), "--data", str(data), "--seq-len", "32",
               "--save", str(result), "--log-dir", str(tmp_path / "logs"), "--timeout", "400", timeout=500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(r"^trained 2 steps in [\d.]+ s: loss [\d.]+ -> [\d.]+", run.stdout, re.M), run.stdout

    out = peer("export", str(result), str(exported), timeout=120)
    assert out.returncode == 0, out.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(model).__name__ == "Gemma2ForCausalLM"
    spec_dict, params = read_result(result)
    spec = RunSpec.from_dict(spec_dict)
    assert spec.tokenizer == str(tok.resolve()) and spec.model.source == str(pretrained / "config.json")
    assert spec.model.checkpoint == str(pretrained.resolve()) and spec.model.tied and spec.model.keep_tied
    # trained tied: the first stage's embedding and the last stage's head stayed one weight
    assert torch.equal(params["model.embed_tokens.weight"], params["lm_head.weight"])
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(exported))("Document 7: the swarm")["input_ids"]])
    x = ids
    with torch.no_grad():
        for a, b in [(0, 2), (2, 4)]:
            stage = spec.model.build_stage(a, b)
            stage.load_state_dict({n: params[n] for n, _ in stage.named_parameters()}, strict=False)
            x = stage(x)
        assert float((model(input_ids=ids).logits - x).abs().max()) < 1e-5
    gen = peer("generate", "--model", str(exported), "--prompt", "Document", "--max-new-tokens", "6", timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("Document") and len(gen.stdout.rstrip("\n")) > len("Document")
