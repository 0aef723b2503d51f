"""peer.net.allocator: a peer reuses freed multi-MiB buffers (as gRPC's received chunks are) instead of faulting in
fresh pages for each one. Measured in fresh processes, with the page faults the kernel counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A thread (its own malloc arena, as gRPC's server threads) makes and frees three 4 MiB buffers 20 times.
PROBE = """
import resource, sys, threading
from tasklet.peer.net.allocator import keep_freed_buffers
applied = keep_freed_buffers() if sys.argv[1] == "1" else False
if sys.argv[1] == "client":  # a sender: constructing a PeerClient applies the policy (no server in the process)
    from tasklet.peer.net.client import PeerClient
    from tasklet.peer.net.config import TransportConfig
    client = PeerClient("127.0.0.1:9", TransportConfig(tls=None))
    applied = keep_freed_buffers()
    client.close()
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


def _faults(apply: bool | str) -> tuple[bool, int]:
    mode = apply if isinstance(apply, str) else "1" if apply else "0"
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          timeout=60, check=True)
    applied, faults = done.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: the policy applies on Linux")
def test_freed_buffers_are_reused_instead_of_faulted_in_again(processes: None) -> None:
    applied, kept = _faults(True)
    _, default = _faults(False)
    assert applied
    assert kept < 2 * PAGES_OF_THREE_BUFFERS, kept  # the first touch of the three buffers, then reuse
    assert default > 5 * kept, (default, kept)  # glibc's default gives the pages back and faults them in again


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: the policy applies on Linux")
def test_a_sender_alone_keeps_freed_buffers_too(processes: None) -> None:
    """Each pushed chunk is a fresh multi-MiB bytes object on the sender: a process with only a PeerClient
    reuses that memory as a server does."""
    applied, faults = _faults("client")
    assert applied
    assert faults < 2 * PAGES_OF_THREE_BUFFERS, faults
