"""``--device auto|cuda|rocm|mps|cpu`` and ``--precision fp32|bf16|fp16``: resolution and validation.

Only the *choice* of device and dtype lives here; measuring a device (TFLOP/s, memory) is
``peer/compute/device_probe.py``.

Four backends, each named for what the volunteer installed, because the name is what ``peer doctor`` prints
and what the advert shows:

* ``cuda``: an NVIDIA GPU under torch's CUDA build (``torch.version.cuda`` set).
* ``rocm``: an AMD GPU under torch's ROCm build. It drives the GPU through the same ``torch.cuda`` API (HIP
  stands in for CUDA), so its torch device is still ``cuda``; it is recognised by ``torch.version.hip``.
* ``mps``: an Apple GPU through Metal (``torch.backends.mps``), torch device ``mps``.
* ``cpu``.

``auto`` takes the first present of cuda/rocm, mps, cpu. Naming a backend that is not there is an error
rather than a silent CPU fallback: a volunteer who passed ``--device rocm`` wants to know their GPU is unused.

Untested on this project's CI machines (CPU only): the GPU branches run here against fakes of the
``torch.cuda``, ``torch.version`` and ``torch.backends.mps`` calls they use (tests/compute/test_device_backends.py).
"""

from __future__ import annotations

import logging
import platform

import torch

log = logging.getLogger(__name__)

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("cuda", "rocm", "mps", "cpu")  # the order ``auto`` tries them in, cuda and rocm being exclusive
DEVICE_CHOICES = ("auto", *BACKENDS)  # what ``--device`` takes (cuda and rocm also as ``cuda:N`` / ``rocm:N``)


class DeviceError(ValueError):
    """A device or precision choice is invalid or unavailable; the message names the option."""


def gpu_backend() -> str | None:
    """``cuda`` or ``rocm`` when torch sees a GPU through its ``torch.cuda`` API, else None."""
    if not torch.cuda.is_available():
        return None
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def mps_available() -> bool:
    """Whether torch can use an Apple GPU through Metal (False on torch builds without the MPS backend)."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def auto_backend() -> str:
    """The backend ``--device auto`` picks: cuda or rocm, then mps, then cpu."""
    return gpu_backend() or ("mps" if mps_available() else "cpu")


def backend_of(spec: str) -> str:
    """The backend a ``--device`` value asks for (``auto`` resolved), checked to be present here.

    Raises DeviceError naming the option and, where it helps, the value that would work.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        return auto_backend()
    name, colon, index = spec.partition(":")
    if name not in BACKENDS or (colon and (name not in ("cuda", "rocm") or not index.isdigit())):
        raise DeviceError(f"--device must be auto, cuda, rocm, mps, cpu, cuda:N or rocm:N, got {spec!r}")
    if name == "cpu":
        return "cpu"
    if name == "mps":
        if not mps_available():
            built = getattr(getattr(torch.backends, "mps", None), "is_built", lambda: False)()
            why = "this Mac's GPU is not available to torch" if built else "this torch has no MPS backend"
            raise DeviceError(f"--device mps: {why} (MPS needs Apple silicon and macOS 12.3+; try --device cpu)")
        return "mps"
    found = gpu_backend()
    if found is None:
        gpu = "CUDA" if name == "cuda" else "ROCm"
        raise DeviceError(f"--device {spec}: no {gpu} GPU is available on this machine (try --device cpu)")
    if found != name:
        build = "ROCm (HIP)" if found == "rocm" else "CUDA"
        raise DeviceError(f"--device {spec}: this torch is its {build} build; use --device {found} or auto")
    if index and int(index) >= torch.cuda.device_count():
        raise DeviceError(f"--device {spec}: only {torch.cuda.device_count()} {name.upper()} device(s) present")
    return name


def torch_device(backend: str, spec: str = "") -> torch.device:
    """The torch device of a backend: ``cuda`` for both cuda and rocm (with ``spec``'s index, if any)."""
    if backend in ("cuda", "rocm"):
        _, _, index = spec.strip().lower().partition(":")
        return torch.device("cuda", int(index)) if index else torch.device("cuda")
    return torch.device(backend)


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device of a ``--device`` value: ``auto``, ``cuda[:N]``, ``rocm[:N]``, ``mps`` or ``cpu``."""
    return torch_device(backend_of(spec), spec)


def backend_of_device(device: torch.device) -> str:
    """The backend behind a torch device (a ``cuda`` device is rocm under torch's ROCm build)."""
    if device.type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device.type


def runtime_version(backend: str) -> str:
    """The runtime a backend runs on, in one phrase: ``CUDA 12.4``, ``HIP 6.2.41133``, ``macOS 14.5``, or the
    CPU's torch. For a CUDA GPU this is the version torch was built for; the driver's is peer doctor's check."""
    if backend == "cuda":
        return f"CUDA {torch.version.cuda}"
    if backend == "rocm":
        return f"HIP {torch.version.hip}"
    if backend == "mps":
        return f"macOS {platform.mac_ver()[0] or 'unknown'} (Metal), torch {torch.__version__}"
    return f"torch {torch.__version__}"


def resolve_dtype(precision: str) -> torch.dtype:
    """Compute dtype of a precision name (``fp32``, ``bf16``, ``fp16``)."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise DeviceError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}") from None


def mps_bf16_refusal() -> str | None:
    """Why MPS cannot compute in bf16 here, or None when it can: torch's MPS bf16 kernels need macOS 14, and a
    torch too old to ask the macOS version (``torch.backends.mps.is_macos_or_newer``) predates them."""
    newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
    if newer is None:
        return f"torch {torch.__version__} is too old for bf16 on MPS; upgrade torch or use fp16/fp32"
    if not newer(14, 0):
        return f"bf16 on MPS needs macOS 14 or newer, this is macOS {platform.mac_ver()[0] or 'unknown'}"
    return None


def precision_refusal(precision: str, device: torch.device) -> str | None:
    """One line saying why ``device`` cannot compute in ``precision``, or None when it can."""
    dtype = resolve_dtype(precision)
    if dtype != torch.bfloat16:
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"GPU {torch.cuda.get_device_name(device)} does not support bf16"
    if device.type == "mps":
        return mps_bf16_refusal()
    return None


def check_precision(precision: str, device: torch.device) -> torch.dtype:
    """Validate that ``device`` can compute in ``precision``; return the dtype.

    bf16 needs an Ampere-or-newer NVIDIA GPU, an AMD GPU that torch says supports it, or MPS on macOS 14. On
    the CPU, bf16 and fp16 are correct but usually slower than fp32 (no fast half-precision kernels on most
    CPUs), so they are allowed with a warning: tests use them to exercise the fp32-master-copy logic.
    """
    dtype = resolve_dtype(precision)
    refusal = precision_refusal(precision, device)
    if refusal is not None:
        raise DeviceError(f"--precision {precision}: {refusal}")
    if device.type == "cpu" and dtype != torch.float32:
        log.warning("precision %s on the CPU is emulated and slow; fp32 is recommended there", precision)
    return dtype


def default_precision(device: torch.device) -> str:
    """bf16 on a GPU that supports it (half the activation traffic, no loss scaling needed), else fp32."""
    if device.type in ("cuda", "mps") and precision_refusal("bf16", device) is None:
        return "bf16"
    return "fp32"
