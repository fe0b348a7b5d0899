"""What selection knows of each graph's duration, and what that means for queueing (D2, D5, A7).

D2 (an estimate is stale once its last valid sample is older than the TTL,
30 s by default) is decided by the cost model and reaches selection as
``GraphTiming.fresh``; A7 (a plan that needs completion feedback runs with an
empty window) is decided here from that freshness, by ``needs_feedback``.
These are the only places selection reads either rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

from flare_contract.graphs import GENERATION_KINDS, GraphDescriptor
from helios.scheduler.types import LanePhase, PlannedLane


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class GraphTiming:
    """What the cost table knows about one graph at this decision (D2, D5)."""

    duration_ns: int  # 0: unknown
    fresh: bool  # D2: measured within the estimate TTL (CostModel.is_stale)

    @property
    def known(self) -> bool:
        return self.duration_ns > 0


def durations_ms(timings: Sequence[GraphTiming]) -> list[float]:
    """Each graph's known duration in ms (0.0 while unknown), as the scorers divide it."""
    return [t.duration_ns / 1e6 if t.duration_ns > 0 else 0.0 for t in timings]


def needs_feedback(graph: GraphDescriptor, timing: GraphTiming, lanes: Sequence[PlannedLane]) -> bool:
    """Whether a plan must run with an empty window and completion feedback (A7, D5).

    Only ordinary decode and complete speculative generation with a fresh
    measured cost may be queued behind other work; a prompt phase ending inside
    the plan is a phase transition, and copy proposals read the request's
    history, which only completion brings up to date (a history input).
    """
    if graph.kind not in GENERATION_KINDS or not timing.known or not timing.fresh:
        return True
    if graph.proposal_source == "copy" and graph.width > 1:
        return True
    return LanePhase.PROMPT in map(_PHASE, lanes)


_PHASE = attrgetter("phase")
