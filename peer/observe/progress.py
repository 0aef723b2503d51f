"""Live training progress on a terminal (a rich progress bar), plain lines when the output is not one.

`peer swarm` and `peer start` call :meth:`ProgressDisplay.update` whenever they read the leader's progress.
On a terminal the bar redraws in place and log lines written meanwhile appear above it (the root logger's
stream handlers are pointed through rich while the bar is live). Elsewhere (a pipe, a file, CI) one line is
written per new step, which is what a log reader wants.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any


def progress_line(
    elapsed_s: float, step: int, total: int | None, *, loss: Any = None, step_s: Any = None,
    tokens_per_s: Any = None, epoch: Any = None, peers: int | None = None,
) -> str:
    """``[  12.3s] plan epoch 1: step 3/20, loss 5.4321, 0.52 s/step, 1234 tokens/s (4 peers live)``."""
    of = f"/{total}" if total else ""
    loss_s = f"loss {loss:.4f}" if isinstance(loss, float) else "loss -"
    extra = f", {step_s or 0:.2f} s/step, {tokens_per_s:.0f} tokens/s" if tokens_per_s else ""
    live = f" ({peers} peers live)" if peers is not None else ""
    return f"[{elapsed_s:6.1f}s] plan epoch {epoch}: step {step}{of}, {loss_s}{extra}{live}"


def route_logging(console: Any, stream: IO[str]) -> list[tuple[logging.StreamHandler, Any]]:
    """Point the root logger's handlers that write to ``stream`` through ``console`` (a live rich display on it),
    so log lines land above the bar; what :func:`restore_logging` takes to undo it."""
    from rich.file_proxy import FileProxy

    proxy, routed = FileProxy(console, stream), []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
            routed.append((handler, handler.stream))
            handler.setStream(proxy)
    return routed


def restore_logging(routed: list[tuple[logging.StreamHandler, Any]]) -> None:
    for handler, stream in routed:
        handler.setStream(stream)
    routed.clear()


class ProgressDisplay:
    """Shows the run's progress; ``fancy`` None = a rich bar exactly when ``stream`` is a terminal."""

    def __init__(
        self,
        total_steps: int | None,
        *,
        stream: IO[str] | None = None,
        plain: Callable[[str], None] | None = None,
        fancy: bool | None = None,
        started: float | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.total = total_steps
        self.started = time.monotonic() if started is None else started  # time.monotonic() the clock starts at
        self._plain = plain or (lambda line: print(line, file=self.stream, flush=True))
        self._last_step: int | None = None
        self._progress: Any = None
        self._task: Any = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        isatty = getattr(self.stream, "isatty", lambda: False)
        if fancy if fancy is not None else isatty():
            self._start_rich()

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(file=self.stream)
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            redirect_stderr=self.stream is sys.stderr,
            redirect_stdout=self.stream is sys.stdout,
        )
        self._task = self._progress.add_task("train", total=self.total, info="waiting for the first plan")
        self._progress.start()
        self._handlers = route_logging(console, self.stream)

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fancy(self) -> bool:
        return self._progress is not None

    def update(self, step: int | None, **info: Any) -> None:
        """The newest progress (``loss``, ``step_s``, ``tokens_per_s``, ``epoch``, ``peers``); repeats are cheap."""
        if step is None:
            return
        elapsed = time.monotonic() - self.started
        if self._progress is not None:
            loss = info.get("loss")
            tps = info.get("tokens_per_s")
            text = "  ".join(
                part
                for part in (
                    f"loss {loss:.4f}" if isinstance(loss, float) else "",
                    f"{tps:.0f} tokens/s" if tps else "",
                    f"epoch {info.get('epoch')}" if info.get("epoch") is not None else "",
                    f"{info['peers']} peers" if info.get("peers") is not None else "",
                )
                if part
            )
            self._progress.update(self._task, completed=step, info=text)
        elif step != self._last_step:
            self._plain(progress_line(elapsed, step, self.total, **info))
        self._last_step = step

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            restore_logging(self._handlers)
            self._progress = None
