"""The receiver's copy-and-check of float32 data in one pass of C (protocol/_copycheck.c), when it was built.

Why: after the copy-free path, one copy per received byte remains, and it is memory-bound; the C routine writes
the tensor's buffer with streaming stores and checks each value for NaN/inf while it is in a register, which
numpy cannot express (see the C file). It is an optional extension: `pip install` builds it where a C compiler
exists, and without it (or with TASKLET_COPYCHECK=numpy in the environment) protocol.message copies and checks
in numpy, with the same result.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

NOT_FINITE = -1
"""What copy_check_f32 returns when an element in the checked range is NaN or +-inf."""


def _load() -> Callable[[int, int, int, int, int], int] | None:
    if os.environ.get("TASKLET_COPYCHECK") == "numpy":  # for comparisons (bench.transport), and a way out
        return None
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_copycheck{suffix}"
        if not path.exists():
            continue
        try:
            fn = ctypes.CDLL(str(path)).tasklet_copy_check_f32
        except (OSError, AttributeError) as exc:
            log.warning("could not load %s (%s); received float32 data is copied and checked in numpy", path, exc)
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        fn.restype = ctypes.c_longlong
        return fn
    return None


_COPY_CHECK = _load()
AVAILABLE = _COPY_CHECK is not None
"""Whether the C routine was built and loaded (protocol.message uses it for float32 data then)."""


def copy_check_f32(dest: np.ndarray, at: int, src: np.ndarray, checked: int) -> int:
    """Copy `src` (uint8) into dest[at:at + src.size] (uint8, writable, contiguous) and check the float32 elements
    of dest in [checked, (at + src.size) rounded down to whole elements): return that end, or NOT_FINITE when
    one of them is NaN or +-inf (everything is copied either way). The bounds are checked here, before C writes
    anything: a wrong offset must raise, never write outside the buffer."""
    if _COPY_CHECK is None:
        raise RuntimeError("tasklet.protocol._copycheck was not built")
    n = src.size
    if not (dest.dtype == np.uint8 and src.dtype == np.uint8 and dest.flags.c_contiguous and dest.flags.writeable
            and src.flags.c_contiguous and 0 <= checked <= at and at + n <= dest.size):
        raise ValueError(f"copy_check_f32: bad arguments (at {at}, {n} bytes, checked {checked}, "
                         f"buffer of {dest.size})")
    result = _COPY_CHECK(dest.ctypes.data, at, src.ctypes.data, n, checked)
    if result == -2:  # the C side refuses a misaligned buffer; numpy's own buffers never are
        raise ValueError("copy_check_f32: the destination buffer is not 4-byte aligned")
    return NOT_FINITE if result < 0 else int(result)
