"""Faulty workers for tests and emulated swarms: a peer that is broken or malicious on purpose.

The production :class:`~peer.runtime.worker.StageWorker` knows nothing of faults; a fault is a subclass that
tampers with what the worker sends (its one outgoing seam, ``_send``), so the receivers' checks are exercised
exactly as a real broken peer would exercise them. A slow peer (:class:`BusyGpuWorker`) stretches its emulated
compute instead (the other seam, ``_emulate``).
"""

from __future__ import annotations

import threading

import torch

from peer.runtime.worker import StageWorker, Tasklet
from protocol import tasklet_pb2 as pb
from protocol.codec import COMPRESSIONS, decode_tensor, encode_tensor


class NanGradWorker(StageWorker):
    """Sends NaN activation gradients and gradient shards: the receivers must refuse them and report it."""

    def _send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind in (pb.ACTIVATION_GRAD, pb.GRAD_SHARD):
            names = {code: name for name, code in COMPRESSIONS.items()}
            tampered = []
            for msg in env.tensors:
                good = decode_tensor(msg)
                tampered.append(encode_tensor(msg.name, torch.full_like(good, float("nan")), names[msg.compression]))
            del env.tensors[:]
            env.tensors.extend(tampered)
        super()._send(t, endpoint, env)


class HugeGradWorker(StageWorker):
    """Sends finite but 1000x too large gradient shards (plausible in form, wrong in size): the owners of the
    shards must refuse them as outliers of the replica group and report the sender."""

    def _send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind == pb.GRAD_SHARD:
            names = {code: name for name, code in COMPRESSIONS.items()}
            tampered = [encode_tensor(m.name, decode_tensor(m) * 1000.0, names[m.compression]) for m in env.tensors]
            del env.tensors[:]
            env.tensors.extend(tampered)
        super()._send(t, endpoint, env)


class BusyGpuWorker(StageWorker):
    """A volunteer whose GPU gets busy: from step ``BUSY_FROM_STEP`` on, every op takes ``BUSY_SLOWDOWN`` x its
    emulated time (needs an emulated device: ``emulate_tflops``). It is healthy while the run warms up and the
    coordinator measures it, so its first slow step is a step that counts (``bench.stragglers``)."""

    BUSY_FROM_STEP = 2
    BUSY_SLOWDOWN = 5.0
    _op_step = threading.local()  # the step of the op the compute thread is running

    def _do_forward(self, t: Tasklet, step: int, *args: object, **kwargs: object) -> None:
        self._op_step.step = step
        super()._do_forward(t, step, *args, **kwargs)  # type: ignore[arg-type]

    def _do_backward(self, t: Tasklet, step: int, *args: object) -> None:
        self._op_step.step = step
        super()._do_backward(t, step, *args)  # type: ignore[arg-type]

    def _emulate(self, t: Tasklet, started: float, forward_units: float) -> None:
        if getattr(self._op_step, "step", -1) >= self.BUSY_FROM_STEP:
            forward_units *= self.BUSY_SLOWDOWN
        super()._emulate(t, started, forward_units)


FAULTS: dict[str, type[StageWorker]] = {"nan-grad": NanGradWorker, "huge-grad": HugeGradWorker,
                                        "busy-gpu": BusyGpuWorker}


def worker_class(fault: str | None) -> type[StageWorker]:
    """The worker class that behaves like ``fault`` (None: a healthy worker)."""
    if fault is None:
        return StageWorker
    if fault not in FAULTS:
        raise ValueError(f"fault: unknown fault {fault!r} (known: {', '.join(sorted(FAULTS))})")
    return FAULTS[fault]
