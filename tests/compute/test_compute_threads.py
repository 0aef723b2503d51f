"""A peer process keeps one OpenMP team, its computing thread's (peer.compute.threads): in a fresh interpreter,
after ``prepare_process`` and ``claim_compute_threads``, the claiming thread computes with every thread the
process may use and any other thread with one, so no second team slows the first (docs/benchmarks/overhead.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.light_processes]

CHILD = """
import json, os, threading
from tasklet.peer.compute.threads import claim_compute_threads, prepare_process
prepare_process()
import torch
claimed = claim_compute_threads()
a = torch.randn(256, 256)
(a @ a).sum()
seen = {}
def other():
    (a @ a).sum()
    seen["other"] = torch.get_num_threads()
t = threading.Thread(target=other)
t.start()
t.join()
print(json.dumps({"claimed": claimed, "main": torch.get_num_threads(), "other": seen["other"],
                  "env": os.environ.get("OMP_NUM_THREADS")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: PyTorch's Linux CPU builds")
def test_the_claiming_thread_computes_with_every_thread_and_the_others_with_one() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                            "TASKLET_COMPUTE_THREADS")}
    env["OMP_NUM_THREADS"] = "2"  # what the process may use, as a volunteer would set it
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"claimed": 2, "main": 2, "other": 1, "env": "1"}, got


def test_too_late_is_a_no_op() -> None:
    """torch already imported (this test process): nothing changes, nothing is claimed."""
    code = ("import torch, os\nfrom tasklet.peer.compute.threads import claim_compute_threads, prepare_process\n"
            "n = torch.get_num_threads()\nprepare_process()\nprint(claim_compute_threads(), "
            "os.environ.get('TASKLET_COMPUTE_THREADS'), torch.get_num_threads() == n)")
    env = {k: v for k, v in os.environ.items() if k != "TASKLET_COMPUTE_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None", "True"]
