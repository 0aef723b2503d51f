"""The one exception type of the scheduler: bad input, named by field.

Every user-facing failure (malformed scenario, impossible workload, a model that fits no device) is raised as
:class:`PlanningError` with the offending field, so the CLI can print ``error: <field>: <reason>`` and exit
with status 2 instead of a traceback.
"""

from __future__ import annotations


class PlanningError(ValueError):
    """Invalid input to the planner; ``field`` names what is wrong (``bandwidth_gbps[3][1]``, ``stages``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
