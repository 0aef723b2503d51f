"""``--device auto|cuda|rocm|mps|cpu`` on machines this one pretends to be (tests/support/fake_devices.py): the
backend ``auto`` picks, the torch device each maps to, the refusals that name what is missing, what the probe
measures and what the advert carries."""

from __future__ import annotations

import pytest
import torch

from tasklet.peer.cli import build_parser
from tasklet.peer.compute import device_choice
from tasklet.peer.compute.device_choice import (
    DEVICE_CHOICES,
    DeviceError,
    backend_of,
    backend_of_device,
    check_precision,
    default_precision,
    resolve_device,
    runtime_version,
)
from tasklet.peer.compute.device_probe import DEVICE_KINDS, DeviceInfo, cpu_memory_bytes, measure_device, mps_memory
from tasklet.peer.swarm.adverts import device_from_record
from tests.support.fake_devices import GiB, fake_cuda_api, fake_mps, fake_rocm, no_gpu

MPS = torch.device("mps")


# ---------------------------------------------------------------------------------------------- choice
def test_auto_prefers_a_gpu_then_mps_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu(monkeypatch)
    assert backend_of("auto") == "cpu" and resolve_device("auto") == torch.device("cpu")
    fake_mps(monkeypatch)
    assert backend_of("auto") == "mps" and resolve_device("auto") == MPS
    fake_rocm(monkeypatch)  # a GPU behind torch.cuda wins over MPS (both are never present, but the order is set)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert backend_of("auto") == "rocm" and resolve_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert backend_of("auto") == "cuda"


def test_rocm_runs_on_torchs_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch, count=2)
    assert resolve_device("rocm") == torch.device("cuda")
    assert resolve_device("ROCm:1") == torch.device("cuda", 1)
    assert backend_of_device(torch.device("cuda", 1)) == "rocm"
    assert runtime_version("rocm") == "HIP 6.2.41133"
    with pytest.raises(DeviceError, match="only 2 ROCM device"):
        resolve_device("rocm:2")
    with pytest.raises(DeviceError, match=r"--device cuda: this torch is its ROCm \(HIP\) build; use --device rocm"):
        resolve_device("cuda")


def test_rocm_asked_of_a_cuda_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda_api(monkeypatch, "NVIDIA GeForce RTX 3070", 8 * GiB, hip=None, cuda="12.1")
    assert backend_of("cuda:0") == "cuda" and runtime_version("cuda") == "CUDA 12.1"
    with pytest.raises(DeviceError, match="--device rocm: this torch is its CUDA build; use --device cuda"):
        resolve_device("rocm")


@pytest.mark.parametrize("built", [True, False])
def test_mps_asked_where_there_is_none_names_why(monkeypatch: pytest.MonkeyPatch, built: bool) -> None:
    no_gpu(monkeypatch)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: built)
    why = "this Mac's GPU is not available to torch" if built else "this torch has no MPS backend"
    with pytest.raises(DeviceError, match=f"--device mps: {why}"):
        resolve_device("mps")
    with pytest.raises(DeviceError, match="--device rocm: no ROCm GPU"):
        resolve_device("rocm")


@pytest.mark.parametrize("spec", ["tpu", "mps:0", "cpu:1", "cuda:x", "rocm:", "gpu"])
def test_malformed_device_values_are_refused(spec: str) -> None:
    with pytest.raises(DeviceError, match="--device must be auto, cuda, rocm, mps, cpu"):
        backend_of(spec)


def test_cli_takes_every_choice_and_nothing_else() -> None:
    parser = build_parser()
    for command in (["start", "--config", "run.toml"], ["doctor"]):
        for choice in DEVICE_CHOICES:
            assert parser.parse_args([*command, "--device", choice]).device == choice
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--device", "tpu"])


# ------------------------------------------------------------------------------------------- precision
def test_bf16_on_mps_with_a_torch_too_old_to_ask_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mps(monkeypatch, macos14=None)
    with pytest.raises(DeviceError, match=r"--precision bf16: torch \S+ is too old for bf16 on MPS"):
        check_precision("bf16", MPS)
    assert check_precision("fp16", MPS) == torch.float16
    assert default_precision(MPS) == "fp32"


def test_bf16_on_mps_before_macos_14_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mps(monkeypatch, macos14=False)
    with pytest.raises(DeviceError, match="bf16 on MPS needs macOS 14 or newer"):
        check_precision("bf16", MPS)
    fake_mps(monkeypatch, macos14=True)
    assert check_precision("bf16", MPS) == torch.bfloat16
    assert default_precision(MPS) == "bf16"


def test_bf16_follows_what_the_rocm_gpu_says(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch, bf16=False)
    with pytest.raises(DeviceError, match="GPU AMD Radeon RX 7900 XTX does not support bf16"):
        check_precision("bf16", torch.device("cuda"))
    fake_rocm(monkeypatch, bf16=True)
    assert default_precision(torch.device("cuda")) == "bf16"


# ----------------------------------------------------------------------------------- probe and advert
def test_rocm_probe_says_rocm_in_the_advert(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch, memory=24 * GiB)
    info = measure_device("auto", seconds=0.1)
    assert (info.kind, info.name, info.memory_bytes) == ("rocm", "AMD Radeon RX 7900 XTX", 24 * GiB)
    assert info.measured and info.tflops == pytest.approx(2 * 4096**3 * 10 / 0.01 / 1e12, rel=1e-3)
    assert device_from_record(info.to_dict()) == info  # what peers read back from the DHT
    emulated = measure_device("rocm", emulate_tflops=3.0)
    assert emulated.kind == "rocm" and emulated.emulated and emulated.tflops == 3.0


def test_mps_probe_times_the_apple_gpu_in_bf16_within_metals_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_mps(monkeypatch, recommended=12 * GiB, macos14=True, tflops=7.0)
    info = measure_device("mps", seconds=0.1)
    assert (info.kind, info.name, info.memory_bytes) == ("mps", "Apple M2 Pro", 12 * GiB)
    assert info.measured and not info.emulated and info.tflops == pytest.approx(7.0, rel=1e-3)
    assert {dtype for _, dtype in calls} == {torch.bfloat16}
    assert all(3 * n * n * 2 <= 12 * GiB / 4 for n, _ in calls)  # a quarter of the memory Metal grants, at most
    assert device_from_record(info.to_dict()).kind == "mps"


def test_mps_without_a_memory_query_falls_back_to_the_host_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_mps(monkeypatch, recommended=None, macos14=None)
    memory, note = mps_memory()
    assert memory == cpu_memory_bytes() > 0
    assert note is not None and "torch.mps.recommended_max_memory" in note and "host's memory" in note
    info = measure_device("mps", seconds=0.1)
    assert info.memory_bytes == memory
    assert {dtype for _, dtype in calls} == {torch.float16}  # no bf16 on this torch: the probe times fp16


def test_advert_kinds_are_the_backends_and_the_record_keeps_its_fields() -> None:
    assert set(DEVICE_KINDS) == {"cuda", "rocm", "mps", "cpu"} == set(device_choice.BACKENDS)
    info = DeviceInfo("x", "mps", 2**33, 1.0, True, False)
    assert set(info.to_dict()) == {"name", "kind", "memory_bytes", "tflops", "measured", "emulated"}
    with pytest.raises(ValueError, match="device.kind"):
        device_from_record({**info.to_dict(), "kind": "metal"})
