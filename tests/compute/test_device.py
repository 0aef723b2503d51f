"""Device measurement: the real CPU path, the emulated figure, the CLI, and the CUDA glue on a mocked GPU.

The other backends (ROCm, MPS) and the choice between them: tests/compute/test_device_backends.py (in-process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tasklet.peer.compute import device_probe as device_mod
from tasklet.peer.compute.device_probe import MatmulTiming, _cuda_sizes, measure_device

# starts real processes (tests/support/processes.py)
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.light_processes]


def test_cpu_measurement_is_real():
    info = measure_device("cpu", seconds=0.3)
    assert info.kind == "cpu" and info.measured and not info.emulated
    # A CPU core does between ~1 GFLOP/s and ~10 TFLOP/s of fp32 matmul; anything outside is a bug.
    assert 1e-3 < info.tflops < 10
    assert info.memory_bytes > 2**28
    assert info.name


def test_emulated_figure_is_marked_and_not_measured():
    info = measure_device("auto" if not torch.cuda.is_available() else "cpu", emulate_tflops=42.5)
    assert info.tflops == 42.5 and info.emulated and not info.measured


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, "device must be"),
        ({"emulate_tflops": 0.0}, "emulate_tflops"),
        ({"emulate_tflops": float("nan")}, "emulate_tflops"),
        ({"seconds": 0}, "seconds"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure_device(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        measure_device("cuda")


def test_matmul_flop_count():
    # 2 * n^3 flops per product: 10 products of 1000x1000 in 1 s = 2e10 flop/s = 0.02 TFLOP/s.
    assert MatmulTiming(1000, 10, 1.0).tflops == pytest.approx(0.02)


def test_cuda_sizes_leave_memory_free():
    sizes = _cuda_sizes(free_bytes=80 * 2**30, element_bytes=2)
    assert sizes == (2048, 4096, 8192)
    assert all(3 * n * n * 2 <= 80 * 2**30 / 4 for n in sizes)
    assert _cuda_sizes(free_bytes=100 * 2**20, element_bytes=2) == (2048,)
    assert _cuda_sizes(free_bytes=2**20, element_bytes=2) == (1024,)


def test_cuda_path_with_a_mocked_gpu(monkeypatch):
    """The CUDA branch's glue (name, memory, sizes, best-of) with torch.cuda mocked: no GPU here."""

    class Props:
        name = "Mock H100"
        total_memory = 80 * 2**30

    peak = 400e12
    calls = []

    def fake_time(size, repeats, dtype, device):
        calls.append((size, dtype))
        # Small sizes reach a smaller fraction of the peak, as on a real GPU.
        efficiency = {1024: 0.3, 2048: 0.5, 4096: 0.8, 8192: 0.9}[size]
        return 2 * size**3 * repeats / (peak * efficiency)

    class NullContext:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", NullContext)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(device_mod, "_time_cuda", fake_time)

    info = measure_device("auto", seconds=0.1)
    assert (info.name, info.kind, info.memory_bytes) == ("Mock H100", "cuda", 80 * 2**30)
    assert info.measured and not info.emulated
    assert info.tflops == pytest.approx(0.9 * peak / 1e12, rel=1e-3)
    assert {size for size, _ in calls} == {2048, 4096, 8192}
    assert {dtype for _, dtype in calls} == {torch.bfloat16}

    emulated = measure_device("cuda:0", emulate_tflops=7.0)
    assert emulated.name == "Mock H100" and emulated.tflops == 7.0 and emulated.emulated


def test_cli_prints_json():
    result = subprocess.run(
        [sys.executable, "-m", "tasklet.peer.compute.device_probe", "--json", "--device", "cpu", "--seconds", "0.2"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    info = json.loads(result.stdout)
    assert info["kind"] == "cpu" and info["measured"] is True and info["tflops"] > 0


def test_cli_bad_device_is_one_line_error():
    result = subprocess.run(
        [sys.executable, "-m", "tasklet.peer.compute.device_probe", "--device", "tpu"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: --device must be") and "Traceback" not in result.stderr
