"""bench.overlap and the outer loop it measures (bench.bandwidth.OuterLoop): synchronous and one round late."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from bench import bandwidth, overlap
from tasklet.peer.compute.model import ModelConfig
from tasklet.scheduler.compression import SyncOption


def _pipes(cfg: bandwidth.TrainConfig, n: int) -> list[bandwidth._Pipeline]:
    model = ModelConfig(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, seq_len=cfg.seq_len,
                        seed=cfg.seed)
    return [bandwidth._Pipeline(cfg, model, ("none",) * (len(cfg.stages) - 1)) for _ in range(n)]


def _inner_steps(pipes: list[bandwidth._Pipeline], gen: torch.Generator) -> None:
    """Stand-in for a round of inner steps: each pipeline moves its own way."""
    with torch.no_grad():
        for pipe in pipes:
            for p in pipe.params():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def _flat(pipe: bandwidth._Pipeline) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in pipe.params()])


@pytest.mark.unit
def test_overlapped_outer_loop_keeps_own_progress_and_flushes_to_the_average() -> None:
    """With outer lr 1, no momentum and no codec, an outer step is model averaging. One round late, each pipeline
    goes on from the anchor minus its own latest round, and the run's model (the anchor with the pending
    round applied) is then exactly the pipelines' average; synchronous, every pipeline holds the anchor."""
    cfg = replace(bandwidth.QUICK, outer_lr=1.0, outer_momentum=0.0)
    gen = torch.Generator().manual_seed(5)
    for overlap_on in ("", "delayed"):
        pipes = _pipes(cfg, 3)
        loop = bandwidth.OuterLoop(pipes, SyncOption(4, "none"), replace(cfg, overlap=overlap_on))
        for round_no in range(3):
            _inner_steps(pipes, gen)
            before = [_flat(p) for p in pipes]
            loop.round_end()
            after = [_flat(p) for p in pipes]
            mean = torch.stack(before).mean(0)
            if not overlap_on:
                for a in after:
                    assert torch.allclose(a, mean, atol=1e-6), "synchronous: every pipeline holds the average"
            elif round_no == 0:
                for b, a in zip(before, after, strict=True):
                    assert torch.equal(a, b), "the first round's average is still travelling: nothing moves"
            else:
                assert not torch.allclose(after[0], after[1]), "each keeps its own latest round"
            with loop.flushed(pipes[0]):
                assert torch.allclose(_flat(pipes[0]), mean, atol=1e-6), "the run's model is the average"
            assert torch.equal(_flat(pipes[0]), after[0]), "flushed() gives the pipeline back as it was"


@pytest.mark.unit
def test_eager_outer_loop_takes_its_own_share_of_the_first_round_at_once() -> None:
    """Eager, first round: no average has arrived, so a pipeline's estimate is its own pseudo-gradient over M
    (the others' share unknown): with outer lr 1 it goes on from start + its own progress / M."""
    cfg = replace(bandwidth.QUICK, outer_lr=1.0, outer_momentum=0.0, overlap="eager")
    gen = torch.Generator().manual_seed(6)
    pipes = _pipes(cfg, 2)
    start = _flat(pipes[0])
    loop = bandwidth.OuterLoop(pipes, SyncOption(4, "none"), cfg)
    _inner_steps(pipes, gen)
    before = [_flat(p) for p in pipes]
    loop.round_end()
    for b, p in zip(before, pipes, strict=True):
        assert torch.allclose(_flat(p), start + (b - start) / 2, atol=1e-6)
    with loop.flushed(pipes[0]):
        assert torch.allclose(_flat(pipes[0]), (before[0] + before[1]) / 2, atol=1e-6)


@pytest.mark.unit
def test_streaming_outer_loop_lands_the_average_tau_steps_later_keeping_those_steps() -> None:
    """Streaming, outer lr 1, no momentum: at the round's end nothing moves; one inner step later (tau 1) every
    pipeline holds the round's average plus its own progress of that step."""
    cfg = replace(bandwidth.QUICK, outer_lr=1.0, outer_momentum=0.0, overlap="streaming", overlap_steps=1)
    gen = torch.Generator().manual_seed(7)
    pipes = _pipes(cfg, 2)
    loop = bandwidth.OuterLoop(pipes, SyncOption(4, "none"), cfg)
    _inner_steps(pipes, gen)
    loop.after_inner_step()  # nothing pending: nothing happens
    before = [_flat(p) for p in pipes]
    loop.round_end()
    assert all(torch.equal(_flat(p), b) for p, b in zip(pipes, before, strict=True)), "nothing moves yet"
    mean = (before[0] + before[1]) / 2
    with loop.flushed(pipes[0]):
        assert torch.allclose(_flat(pipes[0]), mean, atol=1e-6)
    _inner_steps(pipes, gen)
    own = [_flat(p) - b for p, b in zip(pipes, before, strict=True)]
    loop.after_inner_step()
    for p, step in zip(pipes, own, strict=True):
        assert torch.allclose(_flat(p), mean + step, atol=1e-6)
    with pytest.raises(ValueError, match="streaming"):
        bandwidth.OuterLoop(pipes, SyncOption(4, "none"), replace(cfg, overlap_steps=4))


@pytest.mark.light_processes  # two forked trainers for seconds, no timing asserted: lane 1 (tests/conftest.py)
def test_quick_overlap_bench_prints_sync_and_overlapped_gaps(capsys: pytest.CaptureFixture[str],
                                                             processes: None) -> None:
    assert overlap.main(["--quick", "--json", "--seeds", "1", "--periods", "2", "--codecs", "int8,topk2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["period"], r["codec"]) for r in out["rows"]] == [(2, "int8"), (2, "topk2")]
    assert out["modes"] == list(overlap.MODES) and out["tau"] == 1
    assert "streaming, tau 1 (cost)" in overlap.table(out)
    for r in out["rows"]:
        for mode in ("delayed", "eager", "streaming"):
            assert r[f"{mode}_cost"] == pytest.approx(r[f"{mode}_gap"] - r["sync_gap"], abs=2e-5)
            assert len(r[f"{mode}_gaps_per_seed"]) == len(r["sync_gaps_per_seed"]) == 1
    assert out["rows"][0]["outer_lr"] == 1.5  # H = 2's setting in the shipped table
    for bad in (["--periods", "1"], ["--modes", "delayed"], ["--periods", "2", "--tau", "2"]):
        with pytest.raises(SystemExit):
            overlap.main(bad)


def test_runtime_overlap_at_a_small_size(processes: None) -> None:
    """``--runtime``: the choice in step and landing late, two 8-worker swarms of 3 steps; no timing asserted."""
    from bench.bandwidth_measured import MeasuredConfig
    from bench.overlap_runtime import runtime, summary

    out = runtime(MeasuredConfig().small(), steps=3)
    print(summary(out))
    assert out["choice"]["late"]["sync"].endswith("-late") and out["choice"]["late"]["outer_overlap"] is True
    assert out["choice"]["in_step"]["outer_overlap"] is False
    assert all(len(r) == 3 and all(math.isfinite(x) for x in r) for r in out["losses"].values())
    for name in ("in_step", "late"):
        st = out["step_s"][name]
        assert st["mean"] > 0 and st["predicted"] > 0 and st["round_end"] is not None
    assert out["predicted_speedup"] >= 1.0  # the model never charges a late round more than one in step
