"""peer.net.allocator: a peer reuses freed multi-MiB buffers (as gRPC's received chunks are) instead of faulting in
fresh pages for each one. Measured in fresh processes, with the page faults the kernel counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A thread (its own malloc arena, as gRPC's server threads) makes and frees three 4 MiB buffers 20 times.
PROBE = """
import resource, sys, threading
from peer.net.allocator import keep_freed_buffers
applied = keep_freed_buffers() if sys.argv[1] == "1" else False
out = {}
def work():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        blocks = [bytes(4 << 20) for _ in range(3)]
        del blocks
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
t = threading.Thread(target=work)
t.start()
t.join()
print(applied, out["faults"])
"""
PAGES_OF_THREE_BUFFERS = 3 * (4 << 20) // 4096


def _faults(apply: bool) -> tuple[bool, int]:
    done = subprocess.run([sys.executable, "-c", PROBE, "1" if apply else "0"], capture_output=True, text=True,
                          timeout=60, check=True)
    applied, faults = done.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.unit
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: the policy applies on Linux")
def test_freed_buffers_are_reused_instead_of_faulted_in_again() -> None:
    applied, kept = _faults(True)
    _, default = _faults(False)
    assert applied
    assert kept < 2 * PAGES_OF_THREE_BUFFERS, kept  # the first touch of the three buffers, then reuse
    assert default > 5 * kept, (default, kept)  # glibc's default gives the pages back and faults them in again
