"""An owner's availability hours (``peer join --schedule "22:00-08:00"``) and how the swarm plans around them.

The schedule is one or more daily windows of local time, ``HH:MM[:SS]-HH:MM[:SS]`` separated by commas; a window
whose end is not after its start runs over midnight. Inside a window the peer takes part; outside it the peer
is paused (``peer.node.control_socket``: a departure, no penalty) and it resumes at the next window's start.
While inside a window the peer's advert carries ``leaves_at``, the wall-clock time the window ends, and the
leader leaves a peer that leaves within :data:`SCHEDULE_NOTICE_S` out of its plans: the re-plan happens at a step
boundary before the peer goes, so its leaving costs the swarm no step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

SCHEDULE_NOTICE_S = 60.0  # a peer leaving within this is planned around (a step boundary comes first)
MAX_WINDOWS = 8
DAY_S = 24 * 3600
_TIME = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


class ScheduleError(ValueError):
    """The schedule text is malformed; the message names the part."""


def _seconds(text: str) -> int:
    m = _TIME.match(text.strip())
    if not m:
        raise ScheduleError(f"{text.strip()!r} is not a time of day (HH:MM or HH:MM:SS)")
    h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if h > 23 or mi > 59 or s > 59:
        raise ScheduleError(f"{text.strip()!r} is not a time of day (HH:MM or HH:MM:SS)")
    return h * 3600 + mi * 60 + s


@dataclass(frozen=True)
class Schedule:
    """Daily windows ``(start, end)`` in seconds after local midnight; ``end <= start`` runs over midnight."""

    windows: tuple[tuple[int, int], ...]

    def _spans(self, at: datetime) -> list[tuple[datetime, datetime]]:
        """Every window's occurrences that start yesterday, today or tomorrow, as datetimes."""
        midnight = at.replace(hour=0, minute=0, second=0, microsecond=0)
        spans = []
        for day in (-1, 0, 1):
            base = midnight + timedelta(days=day)
            for start, end in self.windows:
                length = (end - start) % DAY_S or DAY_S
                begin = base + timedelta(seconds=start)
                spans.append((begin, begin + timedelta(seconds=length)))
        return spans

    def window_end(self, at: datetime) -> datetime | None:
        """The end of the window ``at`` lies in (the latest, if windows overlap); None outside every window."""
        ends = [end for begin, end in self._spans(at) if begin <= at < end]
        return max(ends) if ends else None

    def active(self, at: datetime) -> bool:
        return self.window_end(at) is not None


def parse_schedule(text: str) -> Schedule:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ScheduleError("empty schedule (expected e.g. 22:00-08:00)")
    if len(parts) > MAX_WINDOWS:
        raise ScheduleError(f"at most {MAX_WINDOWS} windows, got {len(parts)}")
    windows = []
    for part in parts:
        start, sep, end = part.partition("-")
        if not sep:
            raise ScheduleError(f"{part.strip()!r} is not a window (expected START-END, e.g. 22:00-08:00)")
        windows.append((_seconds(start), _seconds(end)))
    return Schedule(tuple(windows))


def leaves_at(schedule: Schedule | None, at: datetime) -> float | None:
    """What the advert announces: the Unix time this peer's current window ends (None: no schedule, or outside)."""
    end = None if schedule is None else schedule.window_end(at)
    return None if end is None else end.timestamp()


def action(schedule: Schedule | None, at: datetime, paused: bool, paused_by_schedule: bool) -> str | None:
    """What the schedule asks now: "pause" when outside every window and running, "resume" when inside one and
    paused by the schedule (never a pause the owner asked for), else None."""
    if schedule is None:
        return None
    inside = schedule.active(at)
    if not inside and not paused:
        return "pause"
    if inside and paused and paused_by_schedule:
        return "resume"
    return None


def leaving_soon(extra: dict[str, Any], now_s: float, notice_s: float = SCHEDULE_NOTICE_S) -> bool:
    """Whether an advert's ``leaves_at`` (its owner's window end) is within ``notice_s`` of ``now_s``. A value
    that is not a finite number is ignored: a peer's own advert can only take itself out of plans."""
    value = extra.get("leaves_at")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value - now_s < notice_s
