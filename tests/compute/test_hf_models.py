"""Hugging Face families in-process: stage splits against transformers, per-stage checkpoint reads, export and
generate, tokenized JSONL/Parquet data, and the one-line errors for bad input (each names the file and field)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tasklet.peer.compute.data import microbatch
from tasklet.peer.compute.hf import ModelSourceError, resolve_model
from tasklet.peer.compute.hf.export import export, generate, write_result
from tasklet.peer.compute.hf.stage import full_model
from tasklet.peer.compute.model import unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig, StageCompute, StageComputeConfig
from tasklet.peer.compute.textdata import load_corpus
from tasklet.peer.compute.tokenize import TokenizerError
from tasklet.peer.emulation.procs import PEER_COMMAND as PEER
from tests.support.hf import make_tokenizer, save_model, write_jsonl, write_parquet

OPTIM = OptimConfig(lr=3e-3, eps=1e-3)
SPLIT = [(0, 1), (1, 3), (3, 4)]


def train_stages(model, corpus, steps: int, n_mb: int = 2, mb_size: int = 2) -> list[StageCompute]:
    """A 3-stage pipeline driven by hand (no transport): forward down, loss, backward up, update."""
    stages = [StageCompute(StageComputeConfig(model, a, b, OPTIM)) for a, b in SPLIT]
    for step in range(steps):
        for mb in range(n_mb):
            x, y = microbatch(corpus, 3, step, mb, mb_size, model.seq_len)
            for s in stages[:-1]:
                x = s.forward(mb, x)
            _, g = stages[-1].forward_loss(mb, x, y)
            for s in reversed(stages[:-1]):
                g = s.backward(mb, g)
        for s in stages:
            s.apply_update(s.accumulated_grad(), n_mb)
    return stages


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    make_tokenizer(root / "tok")
    write_jsonl(root / "docs.jsonl")
    write_parquet(root / "docs.parquet")
    return root


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-mistral", "tiny-gemma2", "tiny-olmo2",
                                    "tiny-granite", "tiny-qwen3"])
def test_three_stage_split_trains_like_transformers(preset: str) -> None:
    torch.set_num_threads(1)
    model = resolve_model(preset, seq_len=32, seed=2)
    corpus = load_corpus(None)
    ref, losses = train_reference(model, OPTIM, corpus, 3, 3, 2, 2)
    stages = train_stages(model, corpus, 3)
    for s, (a, b) in zip(stages, SPLIT, strict=True):
        for name, value in unflatten_stage(model, a, b, s.flat_params()).items():
            assert float((value - ref[name]).abs().max()) < 1e-5, name
    assert losses[-1] < losses[0]


def test_seeded_init_does_not_depend_on_the_split() -> None:
    model = resolve_model("tiny-gpt2", seq_len=16, seed=9)
    whole = dict(model.build_stage(0, 4).named_parameters())
    for a, b in SPLIT:
        for name, p in model.build_stage(a, b).named_parameters():
            assert torch.equal(p, whole[name]), name
    # GPT-2 ties its embeddings: untied at load, the head starts as a copy of the token embedding
    assert torch.equal(whole["lm_head.weight"], whole["transformer.wte.weight"])
    assert model.config["tie_word_embeddings"] is False and model.tied


@pytest.mark.parametrize(("preset", "tie"), [("tiny-llama", False), ("tiny-gemma2", True)])
def test_each_stage_reads_only_its_tensors_from_a_sharded_checkpoint(preset: str, tie: bool, tmp_path: Path) -> None:
    folder = save_model(tmp_path / "m", preset, max_shard_size="60KB" if tie else "150KB", tie=tie)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3, "the test needs a checkpoint of several shards"
    assert ("lm_head.weight" in index) != tie  # a tied checkpoint holds the embedding only
    model = resolve_model(str(folder), seq_len=32)
    assert model.checkpoint == str(folder.resolve()) and model.tied == tie
    reference = full_model(resolve_model(str(folder), seq_len=32))
    hf = reference.state_dict()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    for a, b in [(0, 2), (2, 4)]:
        stage = model.build_stage(a, b)
        names = {n for n, _ in stage.named_parameters()}
        wanted = {"model.embed_tokens.weight" if n not in index else n for n in names}  # a tied head: the embedding
        assert set(stage.loaded_from.read_names) == wanted  # exactly its own tensors, each read once
        assert len(stage.loaded_from.read_names) == len(names)
        assert set(stage.loaded_from.opened_files) == {index[n] for n in wanted}  # only the shards holding them
        assert set(stage.loaded_from.opened_files) != set(index.values())
        for n, p in stage.named_parameters():
            assert torch.equal(p, saved[n]) and torch.equal(p, hf[n]), n


@pytest.mark.light_processes  # in-process training and export, then one `peer generate`, no swarm: lane 1
def test_export_loads_with_from_pretrained_and_matches_the_pipeline(
    files: Path, tmp_path: Path, processes: None
) -> None:
    torch.set_num_threads(1)
    model = resolve_model("tiny-llama", seq_len=32, seed=4)
    corpus = load_corpus(str(files / "docs.jsonl"), str(files / "tok"), "text", model, cache=tmp_path / "cache")
    stages = train_stages(model, corpus, 2)
    spec = {"model": model.to_dict(), "tokenizer": str(files / "tok")}
    params = {i: unflatten_stage(model, a, b, s.flat_params())
              for i, (s, (a, b)) in enumerate(zip(stages, SPLIT, strict=True))}
    out = export(write_result(tmp_path / "result", spec, params), tmp_path / "exported")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(out))("def main():\n    return 0")["input_ids"]])
    x = ids
    with torch.no_grad():
        for s in stages:
            x = s.module(x)
        err = float((loaded(input_ids=ids).logits - x).abs().max())
    assert err < 1e-5, f"exported logits differ from the pipeline's by {err:.2e}"
    text = generate(out, "def ", max_new_tokens=8)
    assert text.startswith("def ") and len(text) > 4
    cli = subprocess.run([*PEER, "generate", "--model", str(out), "--prompt", "import",
                          "--max-new-tokens", "5"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("import") and len(cli.stdout.strip()) > len("import")


def test_jsonl_and_parquet_tokenize_to_the_same_stream(files: Path, tmp_path: Path) -> None:
    model = resolve_model("tiny-gpt2", seq_len=16)
    a = load_corpus(str(files / "docs.jsonl"), str(files / "tok"), "text", model, cache=tmp_path)
    b = load_corpus(str(files / "docs.parquet"), str(files / "tok"), "text", model, cache=tmp_path)
    assert a.fingerprint == b.fingerprint and torch.equal(a.data, b.data)
    again = load_corpus(str(files / "docs.jsonl"), str(files / "tok"), "text", model, cache=tmp_path)  # cached
    for mb in range(3):
        assert torch.equal(microbatch(a, 1, 2, mb, 2, 16)[0], microbatch(again, 1, 2, mb, 2, 16)[0])
    assert int(a.data.max()) < model.vocab_size and a.data.dtype == torch.int32
    cached, maps = [str(p) for p in tmp_path.glob("*.bin")], Path("/proc/self/maps").read_text()
    assert len(cached) == 2 and all(path in maps for path in cached)  # memory-mapped token files, not heap copies


# ------------------------------------------------------------------------------------------------ bad input
def test_missing_shard_is_one_line_naming_it(tmp_path: Path) -> None:
    folder = save_model(tmp_path / "m", "tiny-gpt2", max_shard_size="100KB")
    shard = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (folder / shard).unlink()
    with pytest.raises(ModelSourceError) as info:
        resolve_model(str(folder), seq_len=16)
    assert str(info.value) == (f"{folder / shard}: missing shard (listed in {folder / 'model.safetensors.index.json'}"
                               " weight_map)")


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(files: Path, tmp_path: Path) -> None:
    cfg = {**resolve_model("tiny-gpt2", 16).config, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = resolve_model(str(tmp_path / "config.json"), seq_len=16)
    with pytest.raises(TokenizerError, match=r"tok/tokenizer.json: vocabulary of 400 tokens does not fit the "
                                             r"model's vocab_size 300 \(.*config.json\)"):
        load_corpus(str(files / "docs.jsonl"), str(files / "tok"), "text", model, cache=tmp_path)


def test_jsonl_without_the_text_field_is_refused(files: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "other.jsonl", field="body")
    with pytest.raises(ValueError, match=rf"^{path}: record 1 has no field 'text' \(fields: body, id\)$"):
        load_corpus(str(path), str(files / "tok"), "text", resolve_model("tiny-gpt2", 16), cache=tmp_path)


def test_a_spec_from_the_network_with_an_absurd_shape_is_refused() -> None:
    from tasklet.peer.runtime.spec import RunSpec, SpecError

    d = RunSpec(model=resolve_model("tiny-llama", 16)).to_dict()
    d["model"]["config"]["num_hidden_layers"] = 10**9
    with pytest.raises(SpecError, match="num_hidden_layers: 1000000000 exceeds the supported 1024"):
        RunSpec.from_dict(d)
    d["model"]["config"].update(num_hidden_layers=4, model_type="bert")
    with pytest.raises(SpecError, match="BertLMHeadModel cannot be cut into pipeline stages: no token embedding"):
        RunSpec.from_dict(d)


def test_a_peer_whose_checkpoint_differs_from_the_runs_refuses_to_build_its_stage(tmp_path: Path) -> None:
    import shutil

    folder = save_model(tmp_path / "m", "tiny-gpt2", max_shard_size="150KB")
    model = resolve_model(str(folder), seq_len=16)  # what the run published
    shutil.rmtree(folder)
    save_model(folder, "tiny-gpt2", max_shard_size="400KB")  # this peer holds another save of it
    with pytest.raises(ModelSourceError, match=r"this peer's checkpoint \(fingerprint \w+\) differs from the run's"):
        model.build_stage(0, 2)
