"""Tasklet's scheduler: pure planning of (pipeline stage x data-parallel replica) tasklets onto devices.

No I/O beyond reading scenario / workload files, no network, no torch. See ``docs/scheduler.md``.
"""

from .api import plan
from .cluster import DEFAULT_MEMORY_GB, DEFAULT_TFLOPS, Cluster
from .errors import PlanningError
from .memetic import MemeticConfig
from .plan import Plan
from .replan import replan
from .search import SearchConfig
from .workload import Workload

__all__ = ["Cluster", "Workload", "Plan", "PlanningError", "SearchConfig", "MemeticConfig", "plan", "replan",
           "DEFAULT_TFLOPS", "DEFAULT_MEMORY_GB"]
