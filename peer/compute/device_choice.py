"""``--device auto|cpu|cuda`` and ``--precision fp32|bf16|fp16``: resolution and validation.

Only the *choice* of device and dtype lives here; measuring a device (TFLOP/s, memory) is
``peer/compute/device_probe.py``.

Untested on this project's CI machines (CPU only): the CUDA branches (``cuda`` availability, bf16 support
query). They use only public ``torch.cuda`` calls that exist since torch 1.10.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(ValueError):
    """A device or precision choice is invalid or unavailable; the message names the option."""


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when a CUDA GPU is present, else ``cpu``; ``cpu``; ``cuda`` or ``cuda:N``.

    Asking for CUDA explicitly on a machine without it is an error rather than a silent CPU fallback: a
    volunteer who passed ``--device cuda`` wants to know their GPU is not being used.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        try:
            device = torch.device(spec)
        except RuntimeError as exc:
            raise DeviceError(f"--device {spec!r} is not a valid CUDA device name") from exc
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {spec}: no CUDA GPU is available on this machine (try --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) present")
        return device
    raise DeviceError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")


def resolve_dtype(precision: str) -> torch.dtype:
    """Compute dtype of a precision name (``fp32``, ``bf16``, ``fp16``)."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise DeviceError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}") from None


def check_precision(precision: str, device: torch.device) -> torch.dtype:
    """Validate that ``device`` can compute in ``precision``; return the dtype.

    bf16 needs an Ampere-or-newer GPU on CUDA. On the CPU, bf16 and fp16 are correct but usually slower than
    fp32 (no fast half-precision kernels on most CPUs), so they are allowed with a warning: tests use them to
    exercise the fp32-master-copy logic.
    """
    dtype = resolve_dtype(precision)
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"--precision bf16: GPU {torch.cuda.get_device_name(device)} does not support bf16")
    if device.type == "cpu" and dtype != torch.float32:
        log.warning("precision %s on the CPU is emulated and slow; fp32 is recommended there", precision)
    return dtype


def default_precision(device: torch.device) -> str:
    """bf16 on a GPU that supports it (half the activation traffic, no loss scaling needed), else fp32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"
