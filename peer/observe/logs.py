"""How a daemon's log reads: human lines with control characters made inert, or one JSON object per line.

Log messages and phase reasons carry text other peers chose (an advert's device name, a leader's pause reason,
a refusal quoting an order): an escape sequence in one would act on the terminal that shows it. :func:`clean`
writes every control and format character as its escape (``\\x1b``), so the text stays readable and inert.
``--json-log`` (`peer start` / `peer join`) swaps the human format for :class:`JsonFormatter`: ``ts``,
``level``, ``logger``, ``msg``, and for a phase event (``peer.observe.phases``) its ``event``, ``phase``,
``reason`` and fields.
"""

from __future__ import annotations

import json
import logging
import math
import re
from datetime import UTC, datetime
from typing import Any

HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PHASE_EVENT = "phase_event"  # the attribute of a log record that carries a phase event's fields
# a JSON line's level names, fixed: hivemind renames WARNING to WARN process-wide
LEVELS = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
          logging.CRITICAL: "CRITICAL"}

# C0 and C1 controls, DEL, and the format characters that reorder or hide text (bidi overrides, zero widths)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def clean(text: object, limit: int | None = None, keep: str = "") -> str:
    """``text`` with every control character written as its escape (those in ``keep`` stay), cut after ``limit``
    characters (None: whole)."""
    s = text if isinstance(text, str) else str(text)
    cut = limit is not None and len(s) > limit
    if cut:
        s = s[:limit]

    def inert(m: re.Match[str]) -> str:
        ch = m.group()
        if ch in keep:
            return ch
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"

    s = _CONTROL.sub(inert, s)
    return s + "..." if cut else s


def json_value(value: Any) -> Any:
    """A value fit for a JSON line: finite numbers, cleaned strings, None for the rest of the floats."""
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return clean(value, 500)


class CleanFormatter(logging.Formatter):
    """The human format, control characters inert (newlines and tabs of a traceback kept)."""

    def format(self, record: logging.LogRecord) -> str:
        return clean(super().format(record), keep="\n\t")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``; a phase event's fields
    after them; ``exc`` with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": LEVELS.get(record.levelno, record.levelname),
            "logger": record.name,
            "msg": clean(record.getMessage()),
        }
        event = getattr(record, PHASE_EVENT, None)
        if isinstance(event, dict):
            out.update({str(k): json_value(v) for k, v in event.items() if k not in out})
        if record.exc_info:
            out["exc"] = clean(self.formatException(record.exc_info), keep="\n")
        return json.dumps(out, separators=(",", ":"))


def log_formatter(json_log: bool) -> logging.Formatter:
    """The JSON format (``--json-log``) or the human one, control characters inert in both."""
    return JsonFormatter() if json_log else CleanFormatter(HUMAN_FORMAT)
