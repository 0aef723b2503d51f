"""Faulty workers for tests and emulated swarms: a peer that is broken or malicious on purpose.

The production :class:`~peer.runtime.stage.worker.StageWorker` knows nothing of faults; a fault is built from
its seams, so the receivers' checks are exercised exactly as a real broken peer would exercise them. A
tampering :class:`~peer.runtime.stage.outbox.Outbox` changes what the worker sends (:class:`NanGradOutbox`,
:class:`HugeGradOutbox`, :class:`ScaleShardOutbox`, :class:`NoiseGradOutbox`,
:class:`WrongActivationsOutbox`, :class:`LateWrongActivationsOutbox`); a slowing device clock stretches its
emulated compute (:class:`BusyGpuClock`).
:func:`worker_class` gives a factory of an otherwise unmodified worker.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tasklet.peer.emulation.network import DeclaredSpeedClock
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.sketch import PER_POINT, seed_of, sketch
from tasklet.peer.runtime.spec import Assignment
from tasklet.peer.runtime.stage.outbox import Outbox
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.runtime.stage.worker import StageWorker
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import COMPRESSIONS, decode_tensor, encode_tensor


def _retensor(env: pb.Envelope, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every tensor of ``env`` by ``change`` of it, encoded as it was."""
    names = {code: name for name, code in COMPRESSIONS.items()}
    tampered = [encode_tensor(m.name, change(decode_tensor(m)), names[m.compression]) for m in env.tensors]
    del env.tensors[:]
    env.tensors.extend(tampered)


class NanGradOutbox(Outbox):
    """Sends NaN activation gradients and gradient shards: the receivers must refuse them and report it."""

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind in (pb.ACTIVATION_GRAD, pb.GRAD_SHARD):
            _retensor(env, lambda good: torch.full_like(good, float("nan")))
        super().send(t, endpoint, env)


HUGE_GRAD_FACTOR = 1e6  # HugeGradOutbox's scale: 5,700 x the worst honest spike measured (bench.gradient_tails)


class HugeGradOutbox(Outbox):
    """Sends finite but a million times too large gradient shards (plausible in form, far beyond any honest
    spike in size): the owners of the shards must refuse them as outliers of the replica group and report the
    sender."""

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind == pb.GRAD_SHARD:
            _retensor(env, lambda good: good * HUGE_GRAD_FACTOR)
        super().send(t, endpoint, env)


class ScaleShardOutbox(Outbox):
    """An owner that steers its shard: the summed shard it sends the other replicas in the all-gather is 1000 x
    the true sum (its contributions are honest, so the reduce-scatter's checks pass). The receivers' all-gather
    digest check must refuse it before anyone applies it and report the owner."""

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind == pb.PARAM_SHARD and env.tensors:
            _retensor(env, lambda good: good * 1000.0)
        super().send(t, endpoint, env)


class NoiseGradOutbox(Outbox):
    """Sends Gaussian noise of exactly its honest gradient shards' norm instead of them (passes the norm check):
    the owners' direction test must refuse it and report the sender."""

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind == pb.GRAD_SHARD:
            _retensor(env, lambda good: (lambda n: n * (good.norm() / n.norm().clamp_min(1e-30)))(
                torch.randn_like(good)))
        super().send(t, endpoint, env)


class WrongActivationsOutbox(Outbox):
    """Sends its output activations x 1.1 (finite, of a plausible size, wrong) and reports the sketch of what it
    actually sent, as a patched client that knows the spot checks would: its own pipeline's sketches agree with
    each other, so only a copy of the micro-batch on another pipeline shows it (``peer.runtime.lead.spot``)."""

    FACTOR = 1.1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent: dict[tuple[int, int], tuple[float, ...]] = {}  # (step, mb) -> sketch of what it sent

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.kind == pb.ACTIVATION and env.tensors:
            def wrong(good: torch.Tensor) -> torch.Tensor:
                bad = good * self.FACTOR
                seed = seed_of(t.spec.run_id, env.key.step, env.key.microbatch, "act_out", t.assignment.stage)
                self._sent[(env.key.step, env.key.microbatch)] = sketch(bad, seed)
                return bad
            _retensor(env, wrong)
        super().send(t, endpoint, env)

    def report(self, t: Tasklet, msg: ctl.Message) -> Future[None]:
        lie = self._sent.pop((msg.step, msg.microbatch), None) if isinstance(msg, ctl.Sketch) else None
        if lie is not None and "act_out" in msg.points:
            at = msg.points.index("act_out") * PER_POINT
            msg = dataclasses.replace(msg, values=(*msg.values[:at], *lie, *msg.values[at + PER_POINT:]))
        return super().report(t, msg)


class LateWrongActivationsOutbox(WrongActivationsOutbox):
    """A patient cheater: honest in its first ``HONEST_STEPS`` steps (it waits out its probation, when every
    micro-batch of its pipeline is checked), then :class:`WrongActivationsOutbox` on every micro-batch. Spot
    checks at a low rate let some of its corrupted work through before one catches it: the run must roll back
    to before that work (``peer.runtime.lead.driver``)."""

    HONEST_STEPS = 1

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        if env.key.step < self.HONEST_STEPS:
            Outbox.send(self, t, endpoint, env)
        else:
            super().send(t, endpoint, env)


class BusyGpuClock(DeclaredSpeedClock):
    """A volunteer whose GPU gets busy: from step ``BUSY_FROM_STEP`` on, every op takes ``BUSY_SLOWDOWN`` x its
    emulated time (an emulated device of a declared speed). It is healthy while the run warms up and the
    coordinator measures it, so its first slow step is a step that counts (``bench.stragglers``)."""

    BUSY_FROM_STEP = 2
    BUSY_SLOWDOWN = 5.0

    def finish(self, a: Assignment, step: int, started: float, forward_units: float) -> tuple[float, bool]:
        if step >= self.BUSY_FROM_STEP:
            forward_units *= self.BUSY_SLOWDOWN
        return super().finish(a, step, started, forward_units)


def _busy_gpu(tflops: float | None) -> dict[str, Any]:
    if tflops is None:
        raise ValueError("fault busy-gpu: needs an emulated device (a declared TFLOP/s) to slow down")
    return {"clock": BusyGpuClock(tflops)}


# fault -> the seams it replaces (keyword arguments of StageWorker), given the device's declared TFLOP/s
FAULTS: dict[str, Callable[[float | None], dict[str, Any]]] = {
    "nan-grad": lambda tflops: {"outbox": NanGradOutbox},
    "huge-grad": lambda tflops: {"outbox": HugeGradOutbox},
    "scale-shard": lambda tflops: {"outbox": ScaleShardOutbox},
    "noise-grad": lambda tflops: {"outbox": NoiseGradOutbox},
    "wrong-activations": lambda tflops: {"outbox": WrongActivationsOutbox},
    "late-wrong-activations": lambda tflops: {"outbox": LateWrongActivationsOutbox},
    "busy-gpu": _busy_gpu,
}


def worker_class(fault: str | None, tflops: float | None = None) -> Callable[..., StageWorker]:
    """A factory of workers that behave like ``fault`` (None: a healthy worker), called like StageWorker; with
    ``tflops``, on an emulated device of that declared speed."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault: unknown fault {fault!r} (known: {', '.join(sorted(FAULTS))})")
    seams: dict[str, Any] = {} if tflops is None else {"clock": DeclaredSpeedClock(tflops)}
    if fault is not None:
        seams.update(FAULTS[fault](tflops))
    return functools.partial(StageWorker, **seams) if seams else StageWorker
