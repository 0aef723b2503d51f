"""The scheduler's workload of Hugging Face families: parameter counts equal transformers' own, memory grows with
the run's precision as the runtime holds it, the presets plan, and a stage never lands where it does not fit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.emulation.procs import PEER_COMMAND
from tasklet.peer.node.planning import check_model_fits, workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler import Cluster, PlanningError, plan
from tasklet.scheduler.model_workload import from_hf_config, model_preset


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-gemma2", "tiny-olmo2", "tiny-granite",
                                    "tiny-qwen3", "llama-3.2-1b", "olmo-2-1b", "llama-3-8b", "gpt3-xl"])
def test_parameter_counts_equal_transformers(preset: str) -> None:
    model = resolve_model(preset, seq_len=16)
    w = workload_for(RunSpec(model=model, micro_batch=2, n_microbatches=4))
    n = model.n_layers
    for a, b in [(0, 1), (1, n - 1), (n - 1, n), (0, n)]:
        counted = sum(int(np.prod(shape)) for _, shape in model.stage_shapes(a, b))
        assert w.stage_params(a, b) == counted, (preset, a, b)


def test_memory_follows_precision_and_in_flight_micro_batches() -> None:
    cfg = resolve_model("llama-3.2-1b", seq_len=2048).config
    fp32 = from_hf_config(cfg, 2048, 2, 64, "fp32")
    bf16 = from_hf_config(cfg, 2048, 2, 64, "bf16")
    params = fp32.stage_params(2, 6)
    assert fp32.stage_memory_bytes(2, 6, 0) == params * 20  # master, gradient, accumulated gradient, 2 moments
    assert bf16.stage_memory_bytes(2, 6, 0) == params * 22  # + the bf16 compute copy
    assert fp32.stage_memory_bytes(2, 6, 3) > fp32.stage_memory_bytes(2, 6, 1) > fp32.stage_memory_bytes(2, 6, 0)
    assert fp32.stage_forward_flops(0, 16) > 6 * 1.2e9 * 2 * 2048 / 3  # ~ 2 x params x tokens at least


def test_a_stage_is_never_planned_on_a_device_it_does_not_fit() -> None:
    w = model_preset("gpt3-xl", precision="bf16")
    n = 12
    memory = np.where(np.arange(n) % 3 == 0, 4e9, 40e9)  # every third device is too small for any stage
    cluster = Cluster(delay_s=np.full((n, n), 0.01) - np.eye(n) * 0.01, bandwidth_bps=np.full((n, n), 1e9),
                      tflops=np.full(n, 100.0), memory_bytes=memory, regions=["-"] * n, labels=None, name="mixed")
    p = plan(cluster, w, cost_model="full", seed=0, time_limit_s=3.0)
    for pipe in p.pipelines:
        for s, device in enumerate(pipe):
            a, b = p.stages[s]
            assert w.stage_memory_bytes(a, b, in_flight=len(p.stages) - s) <= memory[device]


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
def test_a_model_that_fits_no_device_is_refused_in_one_line(tmp_path: Path, processes: None) -> None:
    spec = RunSpec(model=resolve_model("llama-3-8b", seq_len=2048), micro_batch=1, n_microbatches=8)
    refused = r"^memory_gb: preset llama-3-8b: the smallest stage \(layer \d+ with the (embeddings|head)\) needs "
    with pytest.raises(PlanningError, match=refused):
        check_model_fits(spec, [8e9, 16e9])
    check_model_fits(spec, [80e9])
    scenario = tmp_path / "small.json"
    scenario.write_text('{"devices": 2, "delay_ms": [[0, 10], [10, 0]], "bandwidth_gbps": [[1, 1], [1, 1]], '
                        '"memory_gb": [0.001, 0.002]}')
    cli = subprocess.run([*PEER_COMMAND, "swarm", "--peers", "2", "--scenario", str(scenario),
                          "--model", "tiny-llama"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peer: error: memory_gb: preset tiny-llama: the smallest stage")
    assert "swarm:" not in cli.stdout  # refused before any peer started


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2", "tiny-gemma2"])
def test_half_precision_keeps_fp32_master_weights(preset: str, precision: str) -> None:
    from tasklet.peer.compute.data import Corpus, microbatch
    from tasklet.peer.compute.stage import OptimConfig, StageCompute, StageComputeConfig

    torch.set_num_threads(1)
    model = resolve_model(preset, seq_len=32, seed=1)
    stage = StageCompute(StageComputeConfig(model, 0, model.n_layers, OptimConfig(lr=3e-3), precision=precision))
    assert stage.dtype != torch.float32 and stage.flat_params().dtype == torch.float32
    if model.layout.rotary:  # rotary frequencies stay fp32 in a half-precision stage
        assert stage.module.rotary_emb.inv_freq.dtype == torch.float32
    corpus = Corpus.load(None)
    losses = []
    for step in range(4):
        x, y = microbatch(corpus, 0, 0, 0, 4, 32)  # the same batch: the loss must fall
        loss, _ = stage.forward_loss(0, x, y)
        stage.apply_update(stage.accumulated_grad(), 1)
        losses.append(loss)
        assert step == stage.step - 1
    assert losses[-1] < losses[0]
