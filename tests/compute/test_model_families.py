"""A model family added in one place trains through the registry (``peer.compute.family``).

The family here is what a new decoder family is: a spec, a stage module and a :class:`ModelFamily` subclass, added
with one :func:`register` call, nothing else in the peer edited. Its run travels as JSON (the run record, the
stage assignment) and comes back by its ``kind``; the single-process reference trains it, and so does a real
two-stage pipeline of in-process stage workers and a real coordinator over gRPC on loopback, to within 1e-5 of
the reference. The registry refuses an unknown kind by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.family import (
    FamilyError,
    ModelFamily,
    ModelMismatchError,
    family_by_kind,
    family_of,
    kinds,
    model_from_config,
    register,
    unregister,
)
from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.compute.model import ModelConfig, component_seed, unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.config import RunConfig
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.bounds import model_numel
from tasklet.peer.runtime.lead.coordinator import Coordinator
from tasklet.peer.runtime.lead.driver import DriverConfig, Pipelines, RunDriver, Stages
from tasklet.peer.runtime.spec import Assignment, RunSpec, SpecError
from tasklet.peer.runtime.stage.worker import StageWorker

KIND = "tiny-mixer"
STEPS = 4
STAGES: Stages = [(0, 1), (1, 3)]


@dataclass(frozen=True)
class MixerSpec:
    """A decoder of ``n_layers`` causal-mixing blocks: each adds a linear map of the running mean of the tokens
    so far, then an MLP (a decoder without attention, small enough to read here)."""

    n_layers: int = 3
    d_model: int = 16
    seq_len: int = 16
    vocab_size: int = 256
    seed: int = 0
    n_heads: int = 1  # for the scheduler's GPT-shaped estimate (ModelFamily.workload)

    def validate(self) -> MixerSpec:
        if min(self.n_layers, self.d_model, self.seq_len, self.vocab_size) < 1:
            raise ValueError("model: every size must be positive")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def build_stage(self, first_layer: int, last_layer: int) -> MixerStage:
        return MixerStage(self, first_layer, last_layer)

    def stage_shapes(self, first_layer: int, last_layer: int) -> list[tuple[str, torch.Size]]:
        return [(n, p.shape) for n, p in self.build_stage(first_layer, last_layer).named_parameters()]


class MixerStage(nn.Module):
    """Blocks ``[first, last)``, the embedding on the first stage, norm and head on the last; every parameter
    seeded by its global name, so any split of the layers starts from the same weights."""

    def __init__(self, spec: MixerSpec, first: int, last: int) -> None:
        super().__init__()
        d = spec.d_model
        self.embed = nn.Embedding(spec.vocab_size, d) if first == 0 else None
        self.blocks = nn.ModuleDict({str(i): nn.ModuleDict({"mix": nn.Linear(d, d, bias=False),
                                                             "up": nn.Linear(d, 2 * d, bias=False),
                                                             "down": nn.Linear(2 * d, d, bias=False)})
                                     for i in range(first, last)})
        self.norm = nn.LayerNorm(d) if last == spec.n_layers else None
        self.head = nn.Linear(d, spec.vocab_size, bias=False) if last == spec.n_layers else None
        with torch.no_grad():
            for name, p in self.named_parameters():
                gen = torch.Generator().manual_seed(component_seed(spec.seed, name))
                p.copy_(torch.ones(p.shape) if name == "norm.weight" else torch.zeros(p.shape) if name == "norm.bias"
                        else torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            running_mean = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device)[:, None]
            h = h + block["mix"](running_mean)
            h = h + block["down"](F.gelu(block["up"](h)))
        return self.head(self.norm(h)) if self.head is not None else h


class MixerFamily(ModelFamily):
    """The family: its kind, its spec class, and reading a spec from a run record's dict."""

    kind = KIND
    spec_type = MixerSpec

    def from_dict(self, data: dict[str, Any]) -> MixerSpec:
        return MixerSpec(**{k: v for k, v in data.items() if k != "kind"})

    def from_config(self, section: Any, seed: int, tie: bool) -> MixerSpec | None:
        return MixerSpec(seq_len=section.seq_len, seed=seed) if section.config == KIND else None


SPEC = RunSpec(run_id="family", model=MixerSpec(seed=3), optim=OptimConfig(lr=3e-3, eps=1e-3), seed=7, micro_batch=2,
               n_microbatches=4)


@pytest.fixture(scope="module", autouse=True)
def mixer_family() -> Iterator[ModelFamily]:
    family = register(MixerFamily())
    try:
        yield family
    finally:
        unregister(KIND)


@pytest.fixture(scope="module", name="reference")
def reference_fixture() -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.set_num_threads(1)
    return train_reference(SPEC.model, SPEC.optim, Corpus.load(SPEC.corpus), SPEC.seed, STEPS, SPEC.n_microbatches,
                           SPEC.micro_batch)


def test_the_registry_lists_the_built_in_families_and_the_new_one() -> None:
    assert kinds()[:2] == ["gpt", "hf"]
    assert KIND in kinds()
    assert family_of(SPEC.model) is family_by_kind(KIND)
    with pytest.raises(FamilyError, match=KIND):
        register(MixerFamily())  # one family per kind


def test_an_unknown_kind_is_refused_by_name() -> None:
    d = SPEC.to_dict()
    d["model"]["kind"] = "no-such-family"
    with pytest.raises(SpecError, match=r"model\.kind: unknown model family 'no-such-family' \(known: gpt, hf"):
        RunSpec.from_dict(d)
    with pytest.raises(FamilyError, match="object is no registered family's spec"):
        family_of(object())


def test_the_run_travels_as_json_and_comes_back_by_its_kind() -> None:
    d = SPEC.to_dict()
    assert d["model"]["kind"] == KIND
    assert RunSpec.from_dict(d) == SPEC
    # the byte GPT's dict stays as run records always had it: no kind, read back as a byte GPT
    gpt = RunSpec().to_dict()["model"]
    assert "kind" not in gpt and family_of(RunSpec.from_dict(RunSpec().to_dict()).model).kind == "gpt"
    assert model_numel(SPEC.model) == sum(p.numel() for p in SPEC.model.build_stage(0, 3).parameters())


def test_a_leaders_model_paths_give_way_to_this_peers_own_files_of_the_same_model() -> None:
    hf = resolve_model("tiny-llama", seq_len=16)
    family = family_of(hf)
    sent, own = replace(hf, checkpoint="/leader/disk", source="leader's"), replace(hf, checkpoint="/own", source="own")
    taken = family.with_local_files(sent, own)
    assert (taken.checkpoint, taken.source, taken.fingerprint) == ("/own", "own", hf.fingerprint)
    for other in (replace(hf, fingerprint="f" * 64), ModelConfig()):
        with pytest.raises(ModelMismatchError, match="is not this peer's"):
            family.with_local_files(sent, other)
    assert family_of(SPEC.model).with_local_files(SPEC.model, None) is SPEC.model  # nothing read from disk


def test_a_run_file_names_the_family_it_registered() -> None:
    config = RunConfig.from_dict({"run": {"run_id": "x", "steps": 1}, "model": {"config": KIND, "seq_len": 12}}, "t")
    assert config.spec().model == MixerSpec(seq_len=12, seed=0)
    section = RunConfig.from_dict({"run": {"run_id": "x", "steps": 1}}, "t").model
    assert family_of(model_from_config(section, 0, tie=True)).kind == "gpt"


def test_the_reference_trains_it(reference) -> None:
    _, losses = reference
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)  # small random weights: near-uniform predictions


def test_a_two_stage_pipeline_trains_it_as_the_reference_does(reference) -> None:
    workers = [StageWorker(peer_id=f"w{i}") for i in range(len(STAGES))]
    coordinator = Coordinator(SPEC, liveness_interval_s=60.0)
    try:
        for w in workers:
            w.start()
        coordinator.start()
        endpoints = [w.server.endpoint for w in workers]

        def planner(live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
            return list(stages or STAGES), [sorted(live)]

        def assignments(stages: Stages, pipelines: Pipelines, epoch: int) -> dict[str, Assignment]:
            return build_assignments(SPEC, stages, pipelines, endpoints, coordinator.endpoint, epoch)

        driver = RunDriver(SPEC, coordinator, lambda: dict(enumerate(endpoints)), planner, assignments,
                           DriverConfig(steps=STEPS, step_timeout_s=60))
        reports = driver.run()
        states = coordinator.live_states(every_replica=True)
    finally:
        coordinator.close()
        for w in workers:
            w.stop()
    ref_params, ref_losses = reference
    for got, want in zip([r.loss for r in reports], ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    seen = set()
    for s, (a, b) in enumerate(STAGES):
        assert states[(s, 0)]["step"] == STEPS
        for name, value in unflatten_stage(SPEC.model, a, b, states[(s, 0)]["params"]).items():
            err = float((value - ref_params[name]).abs().max() / ref_params[name].abs().max().clamp_min(1e-12))
            assert err < 1e-5, f"{name}: {err:.2e} off single-process training"
            seen.add(name)
    assert seen == set(ref_params)
