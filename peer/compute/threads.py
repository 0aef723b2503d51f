"""One OpenMP thread team per peer process, on the thread that computes.

libgomp (the OpenMP runtime of PyTorch's Linux CPU builds) spins between parallel regions only while the threads
of all teams it manages fit the cores; past that it sleeps on a futex after a few spins, and every parallel region
pays for the wake-ups. A peer's process has many threads that touch torch (the control loop, gRPC handlers, the
leader's coordinator), and each one that runs a parallel op gets a team of its own. Measured on a 2-core machine
(docs/benchmarks/overhead.md): one more team made the same training loop 25-35 % slower.

So, before torch is imported, :func:`prepare_process` makes one thread the default for every thread
(``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``, read once by the runtimes when they load) and remembers how many
the computing thread may use; :func:`claim_compute_threads`, on that thread, sets its own OpenMP and MKL thread
counts to that number, through the runtime PyTorch itself loaded. Anywhere this does not apply (another OpenMP
runtime, torch imported first, an unknown build) both are no-ops and torch keeps its defaults.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "TASKLET_COMPUTE_THREADS"


def prepare_process() -> None:
    """Call before torch is imported: every thread defaults to one compute thread; the computing thread may
    claim what the process would have used (``OMP_NUM_THREADS`` as given, else every core)."""
    import sys

    if "torch" in sys.modules or ENV in os.environ:
        return  # too late for the runtimes to read it, or already done (a child inherits the environment)
    given = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(given) if given.isdigit() and int(given) > 0 else (os.cpu_count() or 1)
    os.environ[ENV] = str(threads)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"


def claim_compute_threads() -> int | None:
    """On the computing thread: use the threads :func:`prepare_process` kept, for this thread only; returns
    them, or None where it does not apply."""
    text = os.environ.get(ENV, "")
    if not text.isdigit() or int(text) <= 1:
        return None
    threads = int(text)
    gomp = _loaded("libgomp")
    if gomp is None:
        return None
    try:
        ctypes.CDLL(str(gomp)).omp_set_num_threads(threads)
    except (OSError, AttributeError) as exc:
        log.debug("cannot set the compute thread's OpenMP threads: %s", exc)
        return None
    torch_cpu = _loaded("libtorch_cpu")
    if torch_cpu is not None:
        # MKL's Fortran-style entry (a pointer to the count); absent from builds without MKL
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(str(torch_cpu)).mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(threads)))
    log.info("compute: %d threads on this thread, 1 on every other", threads)
    return threads


def _loaded(stem: str) -> Path | None:
    """The file of a shared library this process has loaded from torch's own folder (never another copy: two
    OpenMP runtimes in one process do not mix)."""
    try:
        import torch

        folder = Path(torch.__file__).parent / "lib"
        maps = Path("/proc/self/maps").read_text()
    except (ImportError, OSError):
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if path.startswith(str(folder)) and Path(path).name.startswith(stem):
            return Path(path)
    return None
