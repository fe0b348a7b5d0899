"""The Helios scheduler: pure Python, no torch, no wall clock.

Time enters only through ``Scheduler.advance_to(now_ns)`` and the
``ExecutionTiming`` handed to ``complete``; the same code therefore runs in the
server, in the tests and on the simulator's discrete-event clock.
"""

from helios.scheduler.types import (
    CostKey,
    GraphDescriptor,
    GraphKind,
    ValueSource,
)

__all__ = ["CostKey", "GraphDescriptor", "GraphKind", "ValueSource"]
