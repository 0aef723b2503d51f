"""One stage replica's compute state: forward/backward per micro-batch, an exactly-once gradient sum, AdamW.

The runtime drives a :class:`StageCompute` from a single compute thread (it is not thread-safe). The protocol
of one training step, for one stage replica:

1. ``forward(mb, x)`` for each micro-batch leased to this pipeline; the output goes to the next stage. The
   input and output are stashed for the backward pass. On the last stage ``forward_loss(mb, x, targets)`` does
   forward, loss and backward in one call.
2. ``backward(mb, grad_out)``: the gradient w.r.t. the input goes back to the previous stage; the gradient
   w.r.t. this stage's parameters is added to the step's accumulated sum at once (memory: one gradient,
   whatever the number of micro-batches). A micro-batch already in the sum (a task re-done after a presumed
   failure) is not added again, which is how the *exactly once* invariant (docs/architecture.md,
   "Invariants") is kept locally; ``accumulated()`` lists the micro-batches in the sum, which the runtime
   checks against the task pool's commit record before averaging.
3. A pipeline dropped from a step (a member died) calls ``reset_step()``: its micro-batches are redone
   elsewhere, so nothing it accumulated may reach the update.
4. The replicas of the stage sum their ``accumulated_grad()`` (all-reduce / parameter server, outside this
   class) and every replica calls ``apply_update(summed, n_microbatches)``.

**Why ``summed / n_microbatches``.** The full batch's loss is the mean of ``n`` equal-size micro-batch losses
(each itself a mean over its ``B * T`` tokens): ``L = (1/n) sum_m L_m``, so ``dL/dθ = (1/n) sum_m dL_m/dθ``.
Every micro-batch's backward therefore runs on its own unscaled loss, and the ``1/n`` is applied once, after
the sum over all replicas — nobody needs to know ``n`` while the step is still running.

**Precision.** Parameters live as one flat fp32 *master* vector; the optimizer (``torch.optim.AdamW``) updates
per-parameter *views* of it, so its arithmetic is exactly that of AdamW on an ordinary model. In ``fp32``
the module's parameters alias the master (no copy). In ``bf16``/``fp16`` the module holds a low-precision
copy that is refreshed from the master after every step, while gradients are accumulated in fp32: small
updates that would round away in bf16 still accumulate in the master. ``fp16`` uses a static loss scale
(default 1024): the last stage multiplies the loss by it, the scale travels back inside the activation
gradients, and every stage divides its parameter gradients by it; a non-finite gradient is refused by
:meth:`apply_update`.

**Devices.** Inputs are moved to the compute device; everything this class *returns* (activations, gradients,
flat vectors) is a host (CPU) tensor, ready to serialise. Untested here (CPU-only CI): the CUDA path itself —
it is the same code with ``device=cuda`` (no device-specific branches except in ``peer/compute/device_choice.py``).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
from torch import nn

from tasklet.peer.compute.device_choice import check_precision, resolve_device
from tasklet.peer.compute.family import ModelSpec
from tasklet.peer.compute.model import is_weight_decayed, lm_loss

log = logging.getLogger(__name__)

STATE_FORMAT = 1
DEFAULT_FP16_LOSS_SCALE = 1024.0


class StageConfigError(ValueError):
    """A stage or optimizer configuration field is invalid; the message names the field."""


class UnknownMicrobatchError(LookupError):
    """A call names a micro-batch this stage holds no state for (never forwarded, or already backwarded)."""


class GradientError(ValueError):
    """A gradient handed to the stage has the wrong size/shape/dtype or holds NaN/inf."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters; ``grad_clip`` is a max global L2 norm (across *all* stages) or ``None``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = None

    def validate(self) -> OptimConfig:
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise StageConfigError(f"optim.lr must be a positive number, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise StageConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise StageConfigError(f"optim.eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise StageConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise StageConfigError(f"optim.grad_clip must be > 0 or None, got {self.grad_clip!r}")
        return self


@dataclass(frozen=True)
class StageComputeConfig:
    """What one stage replica computes: layers ``[first_layer, last_layer)`` of ``model`` (a spec of a registered
    family, ``peer.compute.family``: the byte GPT's ``ModelConfig``, a Hugging Face ``HFModelSpec``, ...)."""

    model: ModelSpec
    first_layer: int
    last_layer: int
    optim: OptimConfig = field(default_factory=OptimConfig)
    device: str = "cpu"
    precision: str = "fp32"
    loss_scale: float | None = None  # None: 1 for fp32/bf16, DEFAULT_FP16_LOSS_SCALE for fp16

    def resolved_loss_scale(self) -> float:
        if self.loss_scale is not None:
            if not (self.loss_scale > 0 and math.isfinite(self.loss_scale)):
                raise StageConfigError(f"loss_scale must be positive and finite, got {self.loss_scale!r}")
            return float(self.loss_scale)
        return DEFAULT_FP16_LOSS_SCALE if self.precision == "fp16" else 1.0


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor that scales a gradient of L2 norm ``total_norm`` down to at most ``max_norm``.

    ``min(1, max_norm / (total_norm + 1e-6))``, the formula of ``torch.nn.utils.clip_grad_norm_``; the 1e-6
    keeps a zero gradient finite. Shared by the stage runtime and the single-process reference.
    """
    return min(1.0, max_norm / (total_norm + 1e-6))


def shard_bounds(numel: int, n_shards: int) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``n_shards`` contiguous ``(start, end)`` ranges for a reduce-scatter.

    The first ``numel % n_shards`` shards get one extra element, so sizes differ by at most one and the
    ranges are a pure function of ``(numel, n_shards)`` — every replica computes the same split.
    """
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, n_shards)
    bounds, start = [], 0
    for i in range(n_shards):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class _Stash:
    """What backward needs: the (leaf) input and the output of the stage's forward pass."""

    inp: torch.Tensor
    out: torch.Tensor


HASH_THREADS = 8  # a digest of a large stage hashes on up to this many threads (BLAKE3 splits the input itself)


HASH_CHUNK_BYTES = 64 << 20  # a device tensor is hashed in chunks of this size, each copied while the last hashes


def _hasher(label: bytes) -> Any:
    """A BLAKE3 hasher fed ``label`` (length-prefixed, so no label is a prefix of another's input)."""
    return blake3.blake3(len(label).to_bytes(2, "big") + label, max_threads=min(HASH_THREADS, os.cpu_count() or 1))


def bytes_digest(data: memoryview, label: bytes) -> str:
    """BLAKE3 (hex) of ``label`` (length-prefixed, so no label is a prefix of another's input) and ``data``.

    BLAKE3, not sha256: it is a cryptographic hash too (a forged state must not match a signed digest) and, being
    a tree, hashes one input on several threads; a 608 MB stage hashes in about a third of the time the sha256
    tree of 64 MB parts took on this 2-core machine (docs/benchmarks/overhead.md)."""
    h = _hasher(label)
    h.update(data)
    return h.hexdigest()


def flat_digest(flat: torch.Tensor) -> str:
    """The digest (32 hex digits, :func:`bytes_digest`) of a flat parameter vector's fp32 bytes:
    :meth:`StageCompute.params_digest`, and what a leader computes of a stage state it fetched. A vector on a
    device is streamed to the host in chunks (:func:`streamed_digest`), never copied whole."""
    if flat.device.type != "cpu":
        return streamed_digest(flat, b"tasklet/params")[:32]
    host = flat.detach().to(torch.float32).contiguous().numpy()
    return bytes_digest(memoryview(host).cast("B"), b"tasklet/params")[:32]  # hashed in place: no copy


def streamed_digest(flat: torch.Tensor, label: bytes, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """:func:`bytes_digest` of a flat tensor's fp32 bytes, copied to the host a chunk at a time into two reused
    buffers: on a CUDA (or ROCm) device pinned ones, each chunk's copy running while the one before is hashed.
    The same digest as hashing the whole vector at once (BLAKE3 hashes a stream), without a host copy of the
    stage's size or a pageable copy's slower transfer every step."""
    x = flat.detach().reshape(-1)
    step = max(1, chunk_bytes // 4)
    n = x.numel()
    h = _hasher(label)
    if n == 0:
        return h.hexdigest()
    cuda = x.device.type == "cuda"
    buffers = [torch.empty(min(step, n), dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
    pending: tuple[torch.Tensor, Any] | None = None  # the chunk copied last, and its copy's event
    for i, lo in enumerate(range(0, n, step)):
        part = buffers[i % 2][: min(n, lo + step) - lo]
        part.copy_(x[lo:lo + part.numel()], non_blocking=cuda)  # the other buffer was hashed already
        done = torch.cuda.Event() if cuda else None
        if done is not None:
            done.record()
        if pending is not None:
            _hash_when_copied(h, *pending)
        pending = (part, done)
    assert pending is not None
    _hash_when_copied(h, *pending)
    return h.hexdigest()


def _hash_when_copied(h: Any, part: torch.Tensor, done: Any) -> None:
    if done is not None:
        done.synchronize()
    h.update(memoryview(part.numpy()).cast("B"))


class StageCompute:
    """Compute state of one replica of one pipeline stage (see the module docstring for the protocol)."""

    def __init__(self, cfg: StageComputeConfig) -> None:
        cfg.model.validate()
        cfg.optim.validate()
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = check_precision(cfg.precision, self.device)
        self.loss_scale = cfg.resolved_loss_scale()
        module = cfg.model.build_stage(cfg.first_layer, cfg.last_layer)  # fp32 on the CPU, seeded or loaded

        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self._shapes = [p.shape for _, p in named]
        sizes = [p.numel() for _, p in named]
        self._offsets = [0, *itertools.accumulate(sizes)]
        self.numel = self._offsets[-1]

        self._master = torch.cat([p.detach().reshape(-1) for _, p in named]).to(self.device, torch.float32)
        self._digest: str | None = None  # params_digest() of the master as it is now; cleared on every change
        self._master_grad = torch.zeros_like(self._master)
        self._master_views = [nn.Parameter(v) for v in self._views(self._master)]
        for param, grad_view in zip(self._master_views, self._views(self._master_grad), strict=True):
            param.grad = grad_view  # the optimizer reads these; never zero_grad(set_to_none=True)

        self._aliased = self.dtype == torch.float32
        if self._aliased:
            for (_, param), view in zip(named, self._master_views, strict=True):
                param.data = view.data
            self.module = module.to(self.device)  # no-op on data already on the device
        else:
            self.module = module.to(self.device, self.dtype)
            self._sync_compute_weights()
        self._compute_params = [p for _, p in self.module.named_parameters()]

        o = cfg.optim
        named_master = list(zip(self.names, self._master_views, strict=True))
        decay = [p for n, p in named_master if is_weight_decayed(n, p)]
        no_decay = [p for n, p in named_master if not is_weight_decayed(n, p)]
        groups = [g for g in ({"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
        self._slices = {id(v): (a, b) for v, a, b in
                        zip(self._master_views, self._offsets[:-1], self._offsets[1:], strict=True)}

        self.step = 0
        self._stash: dict[int, _Stash] = {}
        self._accumulated: set[int] = set()  # micro-batches whose gradient is in _accum
        self._accum = torch.zeros_like(self._master)
        self._accum_views = self._views(self._accum)
        self._accum_stale = False  # the sum holds an ended step's values: the next addition overwrites them
        self.optimizer_s = 0.0  # seconds in AdamW's step (the arithmetic any training loop does)
        self.accumulate_s = 0.0  # host seconds spent adding micro-batch gradients to the sum (peer.runtime timing)
        # speculative copies (runtime pool, stragglers): their gradient is held apart until settle()
        self._tentative: set[int] = set()
        self._held: dict[int, torch.Tensor] = {}

    # ----------------------------------------------------------------------------------------- layout helpers
    @property
    def is_first(self) -> bool:
        return self.cfg.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.cfg.last_layer == self.cfg.model.n_layers

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b].view(shape) for a, b, shape in
                zip(self._offsets[:-1], self._offsets[1:], self._shapes, strict=True)]

    def _sync_compute_weights(self) -> None:
        """Copy (and cast) the fp32 master into the low-precision compute weights (no-op when aliased); every
        change of the master passes here, so the cached digest is dropped here."""
        self._digest = None
        if self._aliased:
            return
        with torch.no_grad():
            for param, master in zip(self.module.parameters(), self._master_views, strict=True):
                param.copy_(master)

    def _flatten_grads(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """fp32 flat parameter gradient of one micro-batch, loss scale removed (an unused parameter -> 0)."""
        flat = torch.cat([
            (g if g is not None else torch.zeros(shape, device=self.device)).reshape(-1).float()
            for g, shape in zip(grads, self._shapes, strict=True)
        ])
        return flat / self.loss_scale if self.loss_scale != 1.0 else flat

    # --------------------------------------------------------------------------------- forward and backward
    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.dtype != torch.int64:
                raise ValueError(f"first stage expects int64 token ids, got {x.dtype}")
            return x.to(self.device)
        if not x.is_floating_point():
            raise ValueError(f"stage {self.cfg.first_layer} expects float hidden states, got {x.dtype}")
        return x.to(self.device, self.dtype).detach().requires_grad_(True)

    def _run_forward(self, mb: int, x: torch.Tensor) -> _Stash:
        inp = self._prepare_input(x)
        with torch.enable_grad():
            out = self.module(inp)
        if mb in self._stash:
            log.info("stage %d-%d: micro-batch %d forwarded again; replacing its stash",
                     self.cfg.first_layer, self.cfg.last_layer, mb)
        return _Stash(inp=inp, out=out)

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        """Forward micro-batch ``mb``; stash what backward needs; return the output on the host.

        Returns hidden states in the compute dtype (bf16 stays bf16 on the wire: half the traffic), or logits
        on the last stage.
        """
        stash = self._run_forward(mb, x)
        self._stash[mb] = stash
        return stash.out.detach().cpu()

    def forward_loss(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor
    ) -> tuple[float, torch.Tensor | None]:
        """Last stage: forward, mean cross-entropy and backward at once.

        Returns ``(loss, grad_input)``: the unscaled loss value, and the gradient w.r.t. this stage's input
        (``None`` when this stage is also the first). The parameter gradient is added to the step's sum.
        """
        if not self.is_last:
            raise RuntimeError(f"forward_loss on stage {self.cfg.first_layer}-{self.cfg.last_layer}, "
                               "which is not the last stage")
        stash = self._run_forward(mb, x)
        self._stash.pop(mb, None)
        targets = targets.to(self.device)
        with torch.enable_grad():
            loss = lm_loss(stash.out, targets)
            seed = loss * self.loss_scale if self.loss_scale != 1.0 else loss
            grad_input = self._backward_from(mb, stash, seed, None)
        return float(loss.detach()), grad_input

    def backward(self, mb: int, grad_out: torch.Tensor) -> torch.Tensor | None:
        """Backward of micro-batch ``mb`` given the gradient w.r.t. its output; return the input gradient.

        ``None`` on the first stage (its input is token ids). Raises :class:`UnknownMicrobatchError` if ``mb``
        was never forwarded here (or was already backwarded), ``ValueError`` if ``grad_out`` has the wrong shape.
        """
        stash = self._stash.get(mb)
        if stash is None:
            raise UnknownMicrobatchError(f"backward for micro-batch {mb}, which this stage has not forwarded")
        if tuple(grad_out.shape) != tuple(stash.out.shape):
            raise ValueError(f"grad_out shape {tuple(grad_out.shape)} does not match the output "
                             f"shape {tuple(stash.out.shape)} of micro-batch {mb}")
        if not grad_out.is_floating_point():
            raise ValueError(f"grad_out must be floating point, got {grad_out.dtype}")
        del self._stash[mb]
        grad = grad_out.to(self.device, stash.out.dtype)
        return self._backward_from(mb, stash, stash.out, grad)

    def _backward_from(self, mb: int, stash: _Stash, root: torch.Tensor,
                       grad: torch.Tensor | None) -> torch.Tensor | None:
        inputs = list(self._compute_params) + ([] if self.is_first else [stash.inp])
        grads = torch.autograd.grad(root, inputs, grad_outputs=grad, allow_unused=True)
        t0 = time.perf_counter()
        if mb in self._accumulated:
            log.info("micro-batch %d already accumulated this step; duplicate ignored", mb)
        elif mb in self._tentative:
            self._held[mb] = self._flatten_grads(grads[: len(self._compute_params)])
        else:
            self._accumulate(grads[: len(self._compute_params)])
            self._accumulated.add(mb)
        self.accumulate_s += time.perf_counter() - t0
        if self.is_first:
            return None
        grad_input = grads[-1]
        if grad_input is None:  # cannot happen for a real stage; keep the contract anyway
            grad_input = torch.zeros_like(stash.inp)
        return grad_input.detach().cpu()

    def _accumulate(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Add one micro-batch's parameter gradient to the step's sum, tensor by tensor into the sum's views.

        The same values as adding :meth:`_flatten_grads` (each element ``sum + float(g)``, in fp32), without
        a flat temporary of the stage's size: no allocation, one pass less. With a loss scale other than 1 the
        division comes first, as there."""
        if self.loss_scale != 1.0:
            self._add_flat(self._flatten_grads(grads))
            return
        first, self._accum_stale = self._accum_stale, False
        pairs = [(view, g) for view, g in zip(self._accum_views, grads, strict=True) if g is not None]
        if first:  # the step's first gradient is copied in (0 + g is g): no zeroing pass, no read of the sum
            for view, g in zip(self._accum_views, grads, strict=True):
                if g is None:
                    view.zero_()
        same = [(v, g) for v, g in pairs if g.dtype == torch.float32]
        if same:
            (torch._foreach_copy_ if first else torch._foreach_add_)([v for v, _ in same], [g for _, g in same])
        for view, g in pairs:
            if g.dtype != torch.float32:  # fp32 (+)= bf16/fp16: promoted to fp32 first, as g.float() would be
                view.copy_(g) if first else view.add_(g)

    def _add_flat(self, flat: torch.Tensor) -> None:
        """Add a flat fp32 gradient to the step's sum (copied in when the sum holds an ended step's values)."""
        if self._accum_stale:
            self._accum.copy_(flat)
            self._accum_stale = False
        else:
            self._accum += flat

    def _fresh_accum(self) -> torch.Tensor:
        """The step's sum, zeroed first if nothing was added since the last step ended."""
        if self._accum_stale:
            self._accum.zero_()
            self._accum_stale = False
        return self._accum

    # ------------------------------------------------------------------------------- exactly-once bookkeeping
    def accumulated(self) -> set[int]:
        """The micro-batches whose gradient is in the step's sum."""
        return set(self._accumulated)

    def mark_tentative(self, mb: int) -> None:
        """Hold ``mb``'s gradient apart from the step's sum (a speculative copy another pipeline also runs)."""
        if mb not in self._accumulated:
            self._tentative.add(mb)

    def settle(self, mine: set[int]) -> list[int]:
        """Add the held gradients of the micro-batches in ``mine`` to the sum (ascending), drop the others;
        return the ones added. Called when the reduce says which micro-batches count for this pipeline."""
        added = sorted(mb for mb in self._held if mb in mine and mb not in self._accumulated)
        for mb in added:
            self._add_flat(self._held[mb])
            self._accumulated.add(mb)
        self._held.clear()  # _tentative stays: a copy whose backward arrives late is still held apart
        return added

    def accumulated_grad(self) -> torch.Tensor:
        """The step's accumulated gradient sum, flat fp32 on the host (a copy)."""
        return self._fresh_accum().detach().to("cpu", copy=True)  # one copy, from a GPU or on the host

    def accumulated_view(self) -> torch.Tensor:
        """The step's accumulated gradient sum itself, on the compute device (no copy): for a caller that hands
        it back to :meth:`apply_update` before anything else is added to the sum (a group of one replica). It
        changes with every micro-batch added, and the step's end makes it stale (the next addition overwrites it)."""
        return self._fresh_accum().detach()

    # ------------------------------------------------------------------------------------- optimizer step
    def _check_flat(self, flat: torch.Tensor, what: str, finite: bool = True) -> None:
        """Shape and dtype, and (``finite``) no NaN or inf; a caller passing ``finite=False`` checks that on
        the compute device, where it is a fraction of the host pass."""
        if not isinstance(flat, torch.Tensor):
            raise GradientError(f"{what} must be a tensor, got {type(flat).__name__}")
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise GradientError(f"{what} must be a flat vector of {self.numel} values, got shape "
                                f"{tuple(flat.shape)}")
        if flat.dtype != torch.float32:
            raise GradientError(f"{what} must be float32, got {flat.dtype}")
        if finite and not bool(torch.isfinite(flat).all()):
            raise GradientError(f"{what} holds NaN or inf values")

    def grad_sq_norm(self, summed_grad: torch.Tensor, n_microbatches: int) -> float:
        """``||summed / n||^2`` of this stage in fp64; the global clip norm is the sqrt of the stages' sum."""
        self._check_flat(summed_grad, "summed_grad")
        return float(((summed_grad.double() / n_microbatches) ** 2).sum())

    def apply_update(self, summed_grad: torch.Tensor, n_microbatches: int,
                     global_grad_norm: float | None = None) -> None:
        """AdamW step with gradient ``summed_grad / n_microbatches``; clear the step's state; ``step += 1``.

        ``summed_grad`` is the sum over all replicas of their :meth:`accumulated_grad`. With ``grad_clip``
        set, ``global_grad_norm`` must be the norm of the *whole model's* averaged gradient (sqrt of the sum
        of every stage's :meth:`grad_sq_norm`), because clipping each stage by its own norm would not be the
        same optimisation as clipping the full model; a stage holding the whole model computes it itself.
        Bad input raises :class:`GradientError` and leaves the state untouched.
        """
        self._check_flat(summed_grad, "summed_grad", finite=False)
        if not (isinstance(n_microbatches, int) and n_microbatches >= 1):
            raise GradientError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
        grad = self._master_grad  # the optimizer's gradient buffer, overwritten each step: no new allocation
        own_sum = summed_grad.device == grad.device and summed_grad.data_ptr() == self._accum.data_ptr()
        if n_microbatches == 1 and own_sum:  # our own sum of one micro-batch is the gradient as it is: no copy
            if not math.isfinite(float(summed_grad.sum())):
                raise GradientError("summed_grad holds NaN or inf values")
            self._take_sum_as_grad()
            grad = self._master_grad
        else:
            if summed_grad.device == grad.device:
                torch.div(summed_grad, n_microbatches, out=grad)  # bitwise copy_ then div_, in one pass
            else:
                grad.copy_(summed_grad)  # from the host
                grad.div_(n_microbatches)
            if not math.isfinite(float(grad.sum())):  # NaN or inf anywhere makes the sum so: one pass, on the device
                raise GradientError("summed_grad holds NaN or inf values")
        clip = self.cfg.optim.grad_clip
        if clip is not None:
            if global_grad_norm is None:
                if not (self.is_first and self.is_last):
                    raise GradientError("optim.grad_clip is set: pass global_grad_norm (over all stages)")
                global_grad_norm = float(grad.double().norm())
            if not (math.isfinite(global_grad_norm) and global_grad_norm >= 0):
                raise GradientError(f"global_grad_norm must be finite and >= 0, got {global_grad_norm!r}")
            coef = clip_coefficient(global_grad_norm, clip)
            if coef < 1.0:
                grad.mul_(coef)
        t0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer_s += time.perf_counter() - t0
        self._sync_compute_weights()
        self._clear_step_state()
        self.step += 1

    def _take_sum_as_grad(self) -> None:
        """The step's sum becomes the optimizer's gradient buffer and the old buffer the next step's (stale) sum:
        the two swap places, the parameters' ``.grad`` views are pointed at the new buffer, nothing is copied."""
        self._accum, self._master_grad = self._master_grad, self._accum
        self._accum_views = self._views(self._accum)
        for param, view in zip(self._master_views, self._views(self._master_grad), strict=True):
            param.grad = view
        self._accum_stale = True

    def skip_update(self) -> None:
        """End a step without an optimizer step (``step += 1``, AdamW untouched).

        A DiLoCo inner step whose pipeline committed no micro-batch (peer.runtime.outer): the pipeline's inner
        optimizer does not move, exactly as a single-process replay of the same commit record does.
        """
        self._clear_step_state()
        self.step += 1

    def set_params(self, flat: torch.Tensor) -> None:
        """Replace the fp32 master parameters (an outer optimizer step); AdamW state and ``step`` stay."""
        self._check_flat(flat, "params")
        with torch.no_grad():
            self._master.copy_(flat.to(self.device))
        self._sync_compute_weights()

    def reset_step(self) -> None:
        """Forget everything of the current step (stashes and the accumulated gradient).

        The runtime calls this when its pipeline is dropped from a step (a member died): its micro-batches are
        redone elsewhere, so nothing it accumulated may reach the update.
        """
        self._clear_step_state()

    def _clear_step_state(self) -> None:
        self._accum_stale = True  # zeroed lazily: the next step's first gradient is copied over it
        self._accumulated.clear()
        self._stash.clear()
        self._tentative.clear()
        self._held.clear()

    # ------------------------------------------------------------------------------------ parameters / state
    def flat_params(self) -> torch.Tensor:
        """The fp32 master parameters as one flat host vector (a copy), in ``self.names`` order."""
        return self._master.detach().cpu().clone()

    def params_digest(self) -> str:
        """A short hash (:func:`flat_digest`, 32 hex digits) of the fp32 master parameters: replicas that applied
        the same steps agree bitwise. Computed once per change of the parameters (a large stage's takes a while)."""
        digest = self._digest
        if digest is None:
            digest = self._digest = flat_digest(self._master)
        return digest

    @property
    def known_digest(self) -> str | None:
        """:meth:`params_digest` if it was computed since the last change, else None (never computes)."""
        return self._digest

    def named_params(self) -> dict[str, torch.Tensor]:
        """fp32 master parameters by name; names are those of the full model (global layer indices)."""
        flat = self.flat_params()
        return {n: v.clone() for n, v in zip(self.names, self._views(flat), strict=True)}

    def _flat_optimizer_state(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        exp_avg = torch.zeros(self.numel)
        exp_avg_sq = torch.zeros(self.numel)
        adam_step = 0.0
        for param, a, b in zip(self._master_views, self._offsets[:-1], self._offsets[1:], strict=True):
            state = self.optimizer.state.get(param)
            if state:
                exp_avg[a:b] = state["exp_avg"].detach().reshape(-1).cpu()
                exp_avg_sq[a:b] = state["exp_avg_sq"].detach().reshape(-1).cpu()
                adam_step = float(state["step"])
        return exp_avg, exp_avg_sq, adam_step

    def state_dict(self) -> dict[str, Any]:
        """Parameters, AdamW state and step, as flat host tensors (for checkpoints and stage hand-over)."""
        exp_avg, exp_avg_sq, adam_step = self._flat_optimizer_state()
        return {
            "format": STATE_FORMAT,
            "model": self.cfg.model.to_dict(),
            "layers": [self.cfg.first_layer, self.cfg.last_layer],
            "step": self.step,
            "params": self.flat_params(),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
            "adam_step": adam_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace parameters, optimizer state and step; validate everything first (state untouched on error).

        Clears the current step's accumulated gradient: it was computed with the old parameters.
        """
        if state.get("format") != STATE_FORMAT:
            raise StageConfigError(f"stage state format {state.get('format')!r} is not {STATE_FORMAT}")
        if state.get("model") != self.cfg.model.to_dict():
            raise StageConfigError("stage state is for a different model config")
        if list(state.get("layers", ())) != [self.cfg.first_layer, self.cfg.last_layer]:
            raise StageConfigError(f"stage state holds layers {state.get('layers')!r}, this stage holds "
                                   f"[{self.cfg.first_layer}, {self.cfg.last_layer}]")
        for key in ("params", "exp_avg", "exp_avg_sq"):
            self._check_flat(state.get(key), f"state[{key!r}]")  # type: ignore[arg-type]
        step, adam_step = state.get("step"), state.get("adam_step")
        if not (isinstance(step, int) and step >= 0):
            raise StageConfigError(f"state['step'] must be a non-negative integer, got {step!r}")
        if not (isinstance(adam_step, (int, float)) and adam_step >= 0):
            raise StageConfigError(f"state['adam_step'] must be >= 0, got {adam_step!r}")

        with torch.no_grad():
            self._master.copy_(state["params"])
        if adam_step > 0:
            # torch's optimizer state dict numbers parameters in param-group order; build it in that order.
            osd = self.optimizer.state_dict()
            params_in_order = [p for group in self.optimizer.param_groups for p in group["params"]]
            ids_in_order = [pid for group in osd["param_groups"] for pid in group["params"]]
            osd["state"] = {}
            for pid, param in zip(ids_in_order, params_in_order, strict=True):
                a, b = self._slices[id(param)]
                osd["state"][pid] = {
                    "step": torch.tensor(float(adam_step)),
                    "exp_avg": state["exp_avg"][a:b].view(param.shape).clone(),
                    "exp_avg_sq": state["exp_avg_sq"][a:b].view(param.shape).clone(),
                }
            self.optimizer.load_state_dict(osd)
        else:
            self.optimizer.state.clear()
        self._sync_compute_weights()
        self._clear_step_state()
        self.step = step
