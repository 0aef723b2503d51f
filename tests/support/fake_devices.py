"""Fakes of the torch device APIs Tasklet reads, so the CUDA, ROCm and MPS branches run on a CPU-only machine.

Only torch's own entry points are replaced (``torch.cuda.*``, ``torch.version.cuda/hip``, ``torch.backends.mps``,
``torch.mps``) plus the matmul timers of ``peer.compute.device_probe``, which would need the real device: what
Tasklet does with the answers (choice, refusals, the advert, the doctor's report) is the real code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tasklet.peer.compute import device_probe

GiB = 1 << 30


def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA/ROCm GPU and no MPS: a plain CPU machine, whatever this one is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def fake_cuda_api(monkeypatch: pytest.MonkeyPatch, name: str, memory: int, *, hip: str | None, cuda: str | None,
                  bf16: bool = True, count: int = 1) -> None:
    """A GPU behind ``torch.cuda``: NVIDIA under a CUDA build (``hip`` None) or AMD under a ROCm build."""
    props = SimpleNamespace(name=name, total_memory=memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    timing = device_probe.MatmulTiming(size=4096, repeats=10, seconds=0.01)
    monkeypatch.setattr(device_probe, "_measure_cuda", lambda _device, _seconds: (name, memory, timing))


def fake_rocm(monkeypatch: pytest.MonkeyPatch, memory: int = 24 * GiB, bf16: bool = True, count: int = 1) -> None:
    """An AMD GPU under torch's ROCm build: ``torch.cuda`` answers, ``torch.version.hip`` is set."""
    fake_cuda_api(monkeypatch, "AMD Radeon RX 7900 XTX", memory, hip="6.2.41133", cuda=None, bf16=bf16, count=count)


def fake_mps(monkeypatch: pytest.MonkeyPatch, *, recommended: int | None = 12 * GiB, macos14: bool | None = True,
             tflops: float = 7.0) -> list[tuple[int, torch.dtype]]:
    """An Apple GPU through MPS, on a torch as new or old as asked, with no CUDA.

    ``recommended``: what ``torch.mps.recommended_max_memory`` answers; None: a torch without it. ``macos14``:
    what ``torch.backends.mps.is_macos_or_newer(14, 0)`` answers; None: a torch without that call. Returns the
    list the fake matmul timer appends ``(size, dtype)`` to.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "get_name", lambda: "Apple M2 Pro", raising=False)
    if macos14 is None:
        monkeypatch.delattr(torch.backends.mps, "is_macos_or_newer", raising=False)
    else:
        monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos14, raising=False)
    if recommended is None:
        monkeypatch.delattr(torch.mps, "recommended_max_memory", raising=False)
    else:
        monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: recommended, raising=False)
    calls: list[tuple[int, torch.dtype]] = []

    def timer(size: int, repeats: int, dtype: torch.dtype) -> float:
        calls.append((size, dtype))
        return 2 * size**3 * repeats / (tflops * 1e12)

    monkeypatch.setattr(device_probe, "_time_mps", timer)
    return calls
