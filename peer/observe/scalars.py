"""Training scalars for TensorBoard (``[log] tensorboard_dir``) and, when installed and asked for, W&B.

Only the leader writes (it is the one that knows each step's loss). Events go through
``torch.utils.tensorboard.SummaryWriter`` into ``tensorboard_dir``; each writer makes its own event file, so a
leader that took over from another on the same machine adds a file next to its predecessor's and TensorBoard
shows one curve. W&B is optional: with ``[log] wandb_project`` set and ``wandb`` importable, every scalar is
also logged there; a missing package or a failing W&B is a warning, never a reason to stop training.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class ScalarWriter:
    """``add(step, {"loss": ..., ...})``; writes nothing when neither destination is configured."""

    def __init__(
        self,
        tensorboard_dir: str = "",
        wandb_project: str = "",
        run_name: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                Path(tensorboard_dir).mkdir(parents=True, exist_ok=True)
                self._tb = SummaryWriter(log_dir=tensorboard_dir)
                log.info("writing TensorBoard scalars to %s", tensorboard_dir)
            except (ImportError, OSError) as exc:  # monitoring must not stop training
                log.warning("[log] tensorboard_dir %s: cannot write TensorBoard events (%s)", tensorboard_dir, exc)
        if wandb_project:
            self._wandb = _start_wandb(wandb_project, run_name, config)

    @property
    def enabled(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def add(self, step: int, values: dict[str, float | None]) -> None:
        """Record finite ``values`` at ``step`` (None and NaN are skipped) and flush, so a crash loses nothing."""
        clean = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if not clean:
            return
        if self._tb is not None:
            for name, value in clean.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            try:
                self._wandb.log(clean, step=step)
            except Exception as exc:  # monitoring must not stop training
                log.warning("W&B logging failed, turning it off: %s", exc)
                self._wandb = None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:
                log.info("W&B finish: %s", exc)
            self._wandb = None


def _start_wandb(project: str, run_name: str, config: dict[str, Any] | None) -> Any:
    try:
        import wandb  # optional: not a dependency of Tasklet
    except ImportError:
        log.warning("[log] wandb_project is set but the wandb package is not installed; not logging to W&B")
        return None
    try:
        return wandb.init(project=project, name=run_name or None, config=config or {})
    except Exception as exc:  # no login, no network: train anyway
        log.warning("W&B could not start (%s); not logging to W&B", exc)
        return None
