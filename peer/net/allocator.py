"""Keep freed buffers of a few MiB in the process instead of handing them back to the kernel (glibc malloc).

Why: gRPC's Python receive path makes each message a fresh bytes object (4 MiB chunks here), and glibc's default
policy returns such blocks to the kernel when freed (its dynamic mmap threshold starts at 128 KiB, and a free top
of more than twice that threshold is trimmed). Every chunk then lands in pages the kernel must fault in and zero
again: measured on the bench's receiver (bench.transport, 16 MiB messages), 100,000-200,000 page faults per GB
received and 0.3 s of CPU per GB, about a quarter of the receiver's work. With blocks up to 32 MiB served from
malloc's arenas and up to 128 MiB of free memory kept per arena, the same stream faults almost never (under
15,000 per GB) and the receiver's CPU per GB drops by 25-35 % (bare gRPC's and ours alike). A sender makes a
fresh bytes object of each chunk it pushes (protocol.chunking.encode_chunk), so PeerClient applies it too: the
bench sender's faults drop from 35,000-38,000 to under 8,000 per GB, and its CPU per GB by 6-9 %.

The cost is memory the process keeps after a burst: at most TRIM_THRESHOLD_BYTES of free memory at the top of
each malloc arena (blocks above MMAP_THRESHOLD_BYTES are still mapped and unmapped on their own).
"""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 128 << 20

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_buffers() -> bool:
    """Apply the policy above once per process; True when the C library took it (glibc), False elsewhere."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(
                M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES
            )
            logger.debug("malloc keeps freed buffers: %s", _applied)
        return _applied


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, ...): its allocator's own policy applies
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1
