"""Device facts a peer announces: name, memory and a *measured* matmul throughput.

The scheduler places tasklets by compute speed, so the figure it gets must be something the device really
does, not the vendor's peak. We time square matrix multiplications: an ``n x n`` by ``n x n`` product does
``n`` multiply-adds for each of the ``n**2`` outputs, that is ``2 * n**3`` floating point operations, so

    TFLOP/s = 2 * n**3 * repeats / seconds / 1e12.

Small matrices under-use a GPU (launch overhead and too few tiles to fill the SMs), large ones may not fit,
so several sizes are tried and the best figure kept; each size is warmed up first (kernel selection, clock
ramp-up, allocator) and timed over a few runs of which the best is kept, because interference from other
processes only ever makes a run slower. On a GPU (CUDA, ROCm or Apple's MPS) the dtype is bf16 when the
device supports it (fp16 otherwise): that is what transformer training runs in. On CPU it is fp32 with the
torch thread count currently set (peers of a local swarm use one thread each).

``DeviceInfo.kind`` names the backend (``peer.compute.device_choice``): cuda, rocm, mps or cpu. A ROCm GPU is
driven through ``torch.cuda`` like an NVIDIA one, so the CUDA timing path measures both. An Apple GPU shares
the host's memory: its figure is what Metal recommends a process use (``torch.mps.recommended_max_memory``),
or the host's memory where torch is too old to say (``mps_memory`` gives the note).

``emulate_tflops`` replaces the measurement by a declared figure, for local swarms where many peers share a
few cores and a measurement would say nothing about the GPU being emulated; the result is marked so.

Run ``python -m tasklet.peer.compute.device_probe [--json]`` to see what this machine measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from tasklet.peer.compute.device_choice import BACKENDS, backend_of, mps_bf16_refusal, torch_device

logger = logging.getLogger(__name__)

DEVICE_KINDS = BACKENDS  # what an advert's device kind may be: cuda, rocm, mps, cpu


@dataclass(frozen=True)
class DeviceInfo:
    """What a peer knows about its compute device; this is what its advert carries."""

    name: str
    kind: str  # the backend: "cuda" | "rocm" | "mps" | "cpu" (DEVICE_KINDS)
    memory_bytes: int
    tflops: float
    measured: bool  # tflops comes from a timed matmul on this device
    emulated: bool  # tflops is a declared figure (local swarm), not this device's speed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MatmulTiming:
    """One timed configuration: ``repeats`` products of ``size x size`` matrices took ``seconds``."""

    size: int
    repeats: int
    seconds: float

    @property
    def tflops(self) -> float:
        return 2.0 * self.size**3 * self.repeats / self.seconds / 1e12


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or whatever ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_memory_bytes() -> int:
    """Total RAM: MemTotal from /proc/meminfo (kB), else physical pages x page size."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _time_cpu(size: int, repeats: int) -> float:
    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    torch.mm(a, b)  # warm-up: allocation and BLAS kernel choice
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return time.perf_counter() - start


def _time_cuda(size: int, repeats: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    out = torch.empty(size, size, dtype=dtype, device=device)
    for _ in range(3):  # warm-up: cuBLAS heuristics, clocks, allocator
        torch.mm(a, b, out=out)
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        torch.mm(a, b, out=out)
    stop.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(stop) / 1e3  # elapsed_time is in milliseconds


def _best_over(sizes: tuple[int, ...], runs: int, seconds: float, timer) -> MatmulTiming:
    """Best TFLOP/s over sizes and runs, within roughly ``seconds`` of timing in total.

    Each size first runs once to estimate the cost of one product, then ``repeats`` is chosen so one run
    takes about ``seconds / (len(sizes) * runs)``: long enough that timer resolution does not matter.
    """
    budget = seconds / (len(sizes) * runs)
    best: MatmulTiming | None = None
    for size in sizes:
        probe = max(timer(size, 1), 1e-6)
        repeats = int(min(max(budget / probe, 1), 10_000))
        for _ in range(runs):
            timing = MatmulTiming(size, repeats, max(timer(size, repeats), 1e-9))
            if best is None or timing.tflops > best.tflops:
                best = timing
    assert best is not None
    return best


def _cuda_sizes(free_bytes: int, element_bytes: int) -> tuple[int, ...]:
    """Sizes whose three matrices use at most a quarter of free memory (leave room for others)."""
    fitting = [n for n in (2048, 4096, 8192) if 3 * n * n * element_bytes <= free_bytes / 4]
    return tuple(fitting) or (1024,)


def _measure_cuda(device: torch.device, seconds: float) -> tuple[str, int, MatmulTiming]:
    with torch.cuda.device(device):  # is_bf16_supported() asks the *current* device
        props = torch.cuda.get_device_properties(device)
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        free_bytes, _total = torch.cuda.mem_get_info(device)
        sizes = _cuda_sizes(free_bytes, torch.finfo(dtype).bits // 8)
        timing = _best_over(sizes, 3, seconds, lambda n, r: _time_cuda(n, r, dtype, device))
    logger.info("cuda %s: best %.1f TFLOP/s (%s, n=%d)", props.name, timing.tflops, dtype, timing.size)
    return props.name, int(props.total_memory), timing


def mps_name() -> str:
    """The Apple GPU's name as Metal gives it (newer torch), else the chip's from sysctl, else a generic one."""
    get_name = getattr(torch.backends.mps, "get_name", None)
    if get_name is not None:
        try:
            return str(get_name()) or "Apple GPU"
        except RuntimeError:
            pass
    try:
        chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        chip = ""
    return f"{chip} GPU" if chip else "Apple GPU"


def mps_memory() -> tuple[int, str | None]:
    """Bytes of memory an MPS peer may plan with, and a note when that is a fallback.

    MPS shares the host's memory; Metal recommends how much of it one process should use (the working-set
    size), which torch exposes as ``torch.mps.recommended_max_memory`` in newer releases. Without it the
    host's memory is the only figure, larger than what the GPU will be given: the note says so.
    """
    recommended = getattr(torch.mps, "recommended_max_memory", None)
    if recommended is not None:
        try:
            return int(recommended()), None
        except RuntimeError:
            pass
    return cpu_memory_bytes(), (f"torch {torch.__version__} cannot query Metal's recommended working set "
                                "(torch.mps.recommended_max_memory); the host's memory, which MPS shares, is shown")


def _time_mps(size: int, repeats: int, dtype: torch.dtype) -> float:
    a = torch.randn(size, size, dtype=dtype, device="mps")
    b = torch.randn(size, size, dtype=dtype, device="mps")
    out = torch.empty(size, size, dtype=dtype, device="mps")
    for _ in range(3):  # warm-up: kernel compilation, allocator
        torch.mm(a, b, out=out)
    torch.mps.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b, out=out)
    torch.mps.synchronize()  # the products are queued; the clock stops when the GPU is done
    return time.perf_counter() - start


def _measure_mps(seconds: float) -> tuple[str, int, MatmulTiming]:
    dtype = torch.bfloat16 if mps_bf16_refusal() is None else torch.float16
    memory, _note = mps_memory()
    sizes = _cuda_sizes(memory, torch.finfo(dtype).bits // 8)  # unified memory: the same quarter rule
    timing = _best_over(sizes, 3, seconds, lambda n, r: _time_mps(n, r, dtype))
    name = mps_name()
    logger.info("mps %s: best %.1f TFLOP/s (%s, n=%d)", name, timing.tflops, dtype, timing.size)
    return name, memory, timing


def measure_device(
    device: str = "auto", emulate_tflops: float | None = None, seconds: float = 1.0
) -> DeviceInfo:
    """Measure the compute device: ``device`` is a ``--device`` value (auto, cuda[:N], rocm[:N], mps, cpu).

    ``seconds`` bounds the time spent timing matmuls (roughly; warm-ups come on top). With
    ``emulate_tflops`` no timing is done: the figure is declared and marked ``emulated``. A device that is
    not there raises ``DeviceError`` (a ValueError) saying which and what to pass instead.
    """
    if emulate_tflops is not None and (not math.isfinite(emulate_tflops) or emulate_tflops <= 0):
        raise ValueError(f"emulate_tflops must be a positive number, got {emulate_tflops!r}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    kind = backend_of(device)

    if kind in ("cuda", "rocm"):  # a ROCm GPU answers through torch.cuda too
        target = torch_device(kind, device)
        if emulate_tflops is not None:
            props = torch.cuda.get_device_properties(target)
            return DeviceInfo(props.name, kind, int(props.total_memory), float(emulate_tflops), False, True)
        name, memory, timing = _measure_cuda(target, seconds)
        return DeviceInfo(name, kind, memory, round(timing.tflops, 4), True, False)

    if kind == "mps":
        if emulate_tflops is not None:
            return DeviceInfo(mps_name(), "mps", mps_memory()[0], float(emulate_tflops), False, True)
        name, memory, timing = _measure_mps(seconds)
        return DeviceInfo(name, "mps", memory, round(timing.tflops, 4), True, False)

    name, memory = cpu_name(), cpu_memory_bytes()
    if emulate_tflops is not None:
        return DeviceInfo(name, "cpu", memory, float(emulate_tflops), False, True)
    timing = _best_over((256, 512, 1024), 2, seconds, _time_cpu)
    logger.info("cpu %s: best %.3f TFLOP/s (fp32, n=%d)", name, timing.tflops, timing.size)
    return DeviceInfo(name, "cpu", memory, round(timing.tflops, 6), True, False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasklet.peer.compute.device_probe",
                                     description="Measure this device's speed.")
    parser.add_argument("--device", default="auto",
                        help="auto, cuda[:N], rocm[:N], mps or cpu (default: auto)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time budget for the matmul timing")
    parser.add_argument("--emulate-tflops", type=float, default=None, help="declare this figure instead")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        info = measure_device(args.device, args.emulate_tflops, args.seconds)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info.to_dict()))
    else:
        how = "emulated" if info.emulated else "measured" if info.measured else "declared"
        print(f"{info.name} [{info.kind}]  memory {info.memory_bytes / 2**30:.1f} GiB  "
              f"{info.tflops:.3f} TFLOP/s ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
