"""The Helios scheduler: pure Python, no torch, no wall clock.

Time enters only through ``Scheduler.advance_to(now_ns)`` and the
``ExecutionTiming`` handed to ``complete``; the same code therefore runs in the
server, in the tests and on the simulator's discrete-event clock.
"""

from flare_contract.graphs import CostKey, GraphDescriptor, GraphKind, ValueSource
from helios.scheduler.config import PolicyConfig
from helios.scheduler.core import Scheduler
from helios.scheduler.types import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    Fence,
    GeneratedToken,
    LanePhase,
    PlannedLane,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)

__all__ = [
    "AdmitRequest",
    "CompletionRecord",
    "CostKey",
    "ExecutionTiming",
    "Fence",
    "GeneratedToken",
    "GraphDescriptor",
    "GraphKind",
    "LanePhase",
    "PlannedLane",
    "PolicyConfig",
    "RequestHandle",
    "ScheduledPlan",
    "Scheduler",
    "SelectionReason",
    "ValueSource",
]
