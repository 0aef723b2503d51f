"""The run's named choices and defaults, in a module that imports nothing heavy.

``peer.config`` declares run.toml from these, and ``peer init`` / ``peer --help`` must answer without loading
torch, so they live apart from ``peer.runtime.spec`` (which validates against them) and
``peer.runtime.checkpoints``.
"""

from __future__ import annotations

from tasklet.protocol import SPARSE_COMPRESSIONS

COMPRESSIONS = ("none", "fp16", "int8", "int4", "int2")  # int4/int2: protocol/lowbit.py
PRECISIONS = ("fp32", "bf16", "fp16")
# of DiLoCo pseudo-gradients in the outer round (peer.runtime.outer); the sparse ones go with error feedback:
# "topk" (protocol.lowbit), "topk2" and "topk4" (one entry per block of 64 in 2 or 4 bits, protocol.sparse)
PSEUDO_GRAD_COMPRESSIONS = ("none", "int8", *SPARSE_COMPRESSIONS)
ERROR_FEEDBACK_COMPRESSIONS = SPARSE_COMPRESSIONS
DEFAULT_KEEP = 3  # checkpoints kept on the leader's disk
# the norm check's k (peer.runtime.stage.gradient_checks.NormCheck): above every honest spike measured, 174 x at
# most (bench.gradient_tails, docs/security.md), so it refuses only a size no honest gradient came near
GRAD_OUTLIER_FACTOR = 1000.0
