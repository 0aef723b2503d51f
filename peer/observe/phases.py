"""What a volunteer sees of its peer: one line per phase of taking part, and a bar while a phase moves.

A peer measures (its device, then its links), waits for a plan (and says why: no leader the organiser trusts,
the swarm paused, no stage that fits this device's memory, not in the current plan), fetches a stage's state
(bytes, rate, ETA), trains (its own steps/s, tokens/s, how busy its compute is), and ends done (the run is
over) or left (stopped, or failed). :class:`PhaseReporter` holds that phase as a small state machine, fed by the
daemon (``peer.node.join_watch``), and shows it in one of four modes:

* ``fancy`` (a terminal): a line per phase change, and an in-place bar while fetching or training;
* ``plain`` (not a terminal: a pipe, a file, CI): the phase-change lines only, so a log gets no redraws;
* ``json`` (``--json-log``): each change, and at most every ``JSON_PROGRESS_S`` an update, as a log record whose
  fields ``peer.observe.logs.JsonFormatter`` writes out;
* ``off``: the state only (daemons inside tests).

A fetch holds its phase until training starts, the peer leaves, or no byte came for ``FETCH_HOLD_S``: while the
state arrives the worker holds no stage yet, and the daemon's "waiting" would otherwise cut the fetch's bar off.
Reasons carry text other peers chose, so each passes ``peer.observe.logs.clean`` before it is kept.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any

from tasklet.peer.observe.logs import PHASE_EVENT, clean
from tasklet.peer.observe.progress import restore_logging, route_logging

FETCH_HOLD_S = 20.0  # a fetch with no byte for this long has failed: other phases may be reported again
JSON_PROGRESS_S = 5.0  # in JSON mode, updates within a phase (bytes, rates) are written at most this often
REASON_CHARS = 240  # the longest reason kept (a hostile one is cut here)
MODES = ("fancy", "plain", "json", "off")

log = logging.getLogger("tasklet.peer.phase")


class Phase(Enum):
    STARTING = "starting"  # nothing reported yet
    MEASURING = "measuring"
    WAITING = "waiting"
    FETCHING = "fetching"
    TRAINING = "training"
    DONE = "done"  # the run is over
    LEFT = "left"  # this peer stopped before the end (a signal, an error)


FINAL = frozenset({Phase.DONE, Phase.LEFT})
TITLES = {Phase.STARTING: "starting", Phase.MEASURING: "measuring", Phase.WAITING: "waiting for a plan",
          Phase.FETCHING: "fetching", Phase.TRAINING: "training", Phase.DONE: "done", Phase.LEFT: "left"}


@dataclass(frozen=True)
class PhaseEvent:
    """A phase change (``kind`` "phase"), an update within a phase ("progress") or a fetch's end ("fetched")."""

    phase: Phase
    reason: str
    at_s: float  # seconds since the reporter started
    fields: dict[str, Any] = field(default_factory=dict)
    kind: str = "phase"

    def line(self) -> str:
        """``[   14.2s] fetching: stage 1 (layers 4..7) from 10.0.0.5:4101, 45.2 MB``."""
        return f"[{self.at_s:7.1f}s] {TITLES[self.phase]}: {self.reason}"

    def record(self) -> dict[str, Any]:
        return {"event": self.kind, "phase": self.phase.value, "reason": self.reason, **self.fields}


@dataclass
class FetchProgress:
    """One fetch of a stage's state: bytes so far of ``total``, since ``started`` (the reporter's clock), when
    ``base`` bytes had come (the first report already counts a chunk, which took no time of the reporter's)."""

    what: str
    total: int
    started: float
    done: int = 0
    last: float = 0.0  # when the last bytes came
    base: int = 0
    complete: bool = False

    def arrived(self, done: int, now: float) -> bool:
        """``done`` bytes have come by ``now``; True when that completes the fetch (once)."""
        self.done, self.last = done, now
        if done >= self.total and not self.complete:
            self.complete = True
            return True
        return False

    def rate(self, now: float) -> float | None:
        """Bytes per second since the fetch started (None before any time passed)."""
        elapsed = now - self.started
        return (self.done - self.base) / elapsed if elapsed > 0 and self.done > self.base else None

    def eta_s(self, now: float) -> float | None:
        """Seconds left at the rate so far (None while no rate is known)."""
        rate = self.rate(now)
        if rate is None or self.total <= 0:
            return None
        return max(0.0, (self.total - self.done) / rate)

    def fields(self, now: float) -> dict[str, Any]:
        rate, eta = self.rate(now), self.eta_s(now)
        return {"bytes_done": self.done, "bytes_total": self.total,
                "bytes_per_s": None if rate is None else round(rate, 1),
                "eta_s": None if eta is None else round(eta, 1)}


class PhaseReporter:
    """The phase a peer is in, shown as the module docstring says. Thread-safe: fetch bytes arrive on a gRPC
    thread, the rest on the daemon's control loop. Never raises on what it is given."""

    def __init__(self, mode: str = "off", stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.mode, self.stream, self.clock = mode, stream if stream is not None else sys.stderr, clock
        self.started = clock()
        self.phase, self.reason = Phase.STARTING, ""
        self.fields: dict[str, Any] = {}
        self.fetch: FetchProgress | None = None
        self.trained: dict[str, Any] = {}  # the last training figures (the final line names them)
        self.events: list[PhaseEvent] = []  # the phase changes so far (a test's, a status's)
        self._json_at = -1e18
        self._lock = threading.RLock()
        self._bar = _Bar(self.stream) if mode == "fancy" else None

    @classmethod
    def for_stream(cls, stream: IO[str], *, enabled: bool, json_log: bool) -> PhaseReporter:
        """``json`` with ``--json-log``, ``fancy`` on a terminal, else ``plain``; ``off`` when not ``enabled``."""
        isatty = getattr(stream, "isatty", lambda: False)
        mode = "off" if not enabled else "json" if json_log else "fancy" if isatty() else "plain"
        return cls(mode, stream)

    @property
    def fancy(self) -> bool:
        return self.mode == "fancy"

    # ------------------------------------------------------------------------------------------ reports
    def measuring(self, reason: str, **fields: Any) -> None:
        self.report(Phase.MEASURING, reason, **fields)

    def waiting(self, reason: str, **fields: Any) -> None:
        self.report(Phase.WAITING, reason, **fields)

    def training(self, reason: str, **fields: Any) -> None:
        """``fields``: ``steps_per_s``, ``tokens_per_s``, ``busy_share`` (compute busy / wall time), ``device_share``
        (the device's share of a step, where the worker measures it), ``run_step``, ``run_steps``, ``loss``."""
        self.report(Phase.TRAINING, reason, **fields)

    def done(self, reason: str) -> None:
        self.report(Phase.DONE, reason)

    def left(self, reason: str) -> None:
        self.report(Phase.LEFT, reason)

    def report(self, phase: Phase, reason: str, **fields: Any) -> None:
        """This peer is in ``phase`` because of ``reason``: a line when either changed, else an update."""
        with self._lock:
            now = self.clock()
            if self.phase in FINAL or phase is Phase.FETCHING or self._held(phase, now):
                return
            reason = clean(reason, REASON_CHARS)
            if phase is self.phase and reason == self.reason:
                self._update(fields, now)
                return
            if phase in FINAL and self.trained:
                reason += f" (trained at {rates_text(self.trained) or 'no measured rate'})"
            self._change(phase, reason, fields, now)

    def fetch_progress(self, what: str, done: int, total: int) -> None:
        """``done`` of ``total`` bytes of a stage's state (``what``: which, from where) have arrived. Called from
        inside the fetch: it never raises, or the fetch would fail with it."""
        if not isinstance(done, int) or not isinstance(total, int) or done < 0 or total < 0:
            return
        try:
            self._fetch_progress(what, done, total)
        except Exception as exc:
            log.debug("fetch progress: %s", exc)

    def _fetch_progress(self, what: str, done: int, total: int) -> None:
        with self._lock:
            if self.phase in FINAL:
                return
            now, what = self.clock(), clean(what, REASON_CHARS)
            f = self.fetch
            if self.phase is not Phase.FETCHING or f is None or f.what != what or done < f.done:
                f = self.fetch = FetchProgress(what, total, now, done, now, base=done)
                self._change(Phase.FETCHING, f"{what}, {size_text(total)}", f.fields(now), now)
            if f.arrived(done, now):
                took = now - f.started
                line = f"{what}: complete, {size_text(total)} in {took:.1f} s"
                self.fields = f.fields(now)
                self._emit(PhaseEvent(Phase.FETCHING, line + (f" ({size_text(total / took)}/s)" if took > 0 else ""),
                                      now - self.started, self.fields, kind="fetched"))
                self._draw()
            elif not f.complete:
                self._update(f.fields(now), now)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.hide()

    # ------------------------------------------------------------------------------------------- inside
    def _held(self, phase: Phase, now: float) -> bool:
        """Whether a fetch in progress keeps its phase against ``phase`` (module docstring)."""
        f = self.fetch
        return (self.phase is Phase.FETCHING and f is not None and phase not in (Phase.TRAINING, *FINAL)
                and now - f.last < FETCH_HOLD_S)

    def _change(self, phase: Phase, reason: str, fields: dict[str, Any], now: float) -> None:
        self.phase, self.reason, self.fields = phase, reason, dict(fields)
        if phase is Phase.TRAINING:
            self.trained = dict(fields)
        event = PhaseEvent(phase, reason, now - self.started, dict(fields))
        self.events.append(event)
        self._json_at = now
        self._emit(event)
        self._draw()
        if phase in FINAL:
            self.close()

    def _update(self, fields: dict[str, Any], now: float) -> None:
        if not fields:
            return
        self.fields.update(fields)
        if self.phase is Phase.TRAINING:
            self.trained.update(fields)
        if self.mode == "json" and now - self._json_at >= JSON_PROGRESS_S:
            self._json_at = now
            self._emit(PhaseEvent(self.phase, self.reason, now - self.started, dict(self.fields), kind="progress"))
        self._draw()

    def _emit(self, event: PhaseEvent) -> None:
        try:
            if self.mode == "json":
                log.info(event.line(), extra={PHASE_EVENT: event.record()})
            elif self.mode == "plain":
                print(event.line(), file=self.stream, flush=True)
            elif self._bar is not None and event.kind != "progress":
                self._bar.say(event.line())
        except (OSError, ValueError):  # a closed stream must not stop the peer
            pass

    def _draw(self) -> None:
        """The terminal's bar: the fetch's bytes, or the run's steps with this peer's rates; none otherwise."""
        if self._bar is None:
            return
        if self.phase is Phase.FETCHING and self.fetch is not None:
            f, now = self.fetch, self.clock()
            rate, eta = f.rate(now), f.eta_s(now)
            info = ", ".join(part for part in (f"{size_text(rate)}/s" if rate else "",
                                               f"ETA {duration_text(eta)}" if eta is not None and not f.complete
                                               else "") if part)
            self._bar.show("fetching", f.done, f.total or None,
                           f"{size_text(f.done)}/{size_text(f.total)}", info)
        elif self.phase is Phase.TRAINING:
            step, steps = self.fields.get("run_step"), self.fields.get("run_steps")
            step = step if _count(step) else 0
            steps = steps if _count(steps) else None
            loss = self.fields.get("loss")
            info = ", ".join(p for p in (rates_text(self.fields),
                                         f"loss {loss:.4f}" if isinstance(loss, float) else "") if p)
            self._bar.show("training", step, steps, f"step {step}" + (f"/{steps}" if steps else ""), info)
        else:
            self._bar.hide()


class _Bar:
    """The in-place bar of a terminal (rich), live only while there is something to draw; log lines and phase
    lines land above it."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._progress: Any = None
        self._task: Any = None
        self._title = ""
        self._routed: list[Any] = []

    def say(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        else:
            print(line, file=self.stream, flush=True)

    def show(self, title: str, completed: float, total: float | None, count: str, info: str) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(file=self.stream)
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[count]}", markup=False),
                TimeElapsedColumn(), TextColumn("{task.fields[info]}", markup=False), console=console,
                transient=True, redirect_stderr=self.stream is sys.stderr, redirect_stdout=self.stream is sys.stdout,
            )
            self._task = self._progress.add_task(title, total=total, completed=completed, count=count, info=info)
            self._progress.start()
            self._routed = route_logging(console, self.stream)
            self._title = title
            return
        if self._title != title:  # another phase: its own bar, its own elapsed time
            self._progress.reset(self._task, description=title, completed=completed, total=total, count=count,
                                 info=info)
        else:
            self._progress.update(self._task, completed=completed, total=total, count=count, info=info)
        self._title = title

    def hide(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            restore_logging(self._routed)
            self._progress = None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def rates_text(fields: dict[str, Any]) -> str:
    """``0.81 steps/s, 1234 tokens/s, compute 63% busy, device 41% of a step`` (what is known of it)."""
    steps, tokens = _number(fields.get("steps_per_s")), _number(fields.get("tokens_per_s"))
    busy, device = _number(fields.get("busy_share")), _number(fields.get("device_share"))
    return ", ".join(part for part in (
        f"{steps:.3g} steps/s" if steps is not None else "",
        f"{tokens:.0f} tokens/s" if tokens is not None else "",
        f"compute {busy:.0%} busy" if busy is not None else "",
        f"device {device:.0%} of a step" if device is not None else "",
    ) if part)


def size_text(n: float | None) -> str:
    """Bytes in decimal units: ``45.2 MB``."""
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def duration_text(s: float) -> str:
    """``9 s``, ``3 min 5 s``, ``1 h 2 min``."""
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
