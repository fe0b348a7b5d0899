"""Selection's output: the winning graph and cohort of one decision, before it becomes a plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flare_contract.graphs import GraphDescriptor
from helios.scheduler.select.timing import GraphTiming, needs_feedback
from helios.scheduler.types import PlannedLane, SelectionReason

if TYPE_CHECKING:
    from helios.scheduler.select.rankings import DecisionRankings


@dataclass(slots=True)
class Choice:
    """The winning graph and cohort of one decision, before it becomes a plan.

    Treated as immutable; not declared frozen because every decision builds one
    (and a funded probe several), and a frozen dataclass's initialisation costs
    about four times as much (see ``PlannedLane``).
    """

    graph: GraphDescriptor
    lanes: tuple[PlannedLane, ...]
    timing: GraphTiming
    score: float  # value rate (known) or optimistic work score (unknown)
    log_scale: float
    prefill_row: int | None
    # the decision's rankings and columns (a ``DecisionRankings``), which funded exploration
    # reuses to evaluate other programs on the same population (``evaluate_scores``'s ``selection``)
    selection: "DecisionRankings | None" = field(default=None, compare=False, repr=False)

    @property
    def reason(self) -> SelectionReason:
        # seam for the next issue: timing refresh and acceptance learning
        # selections will set their own reasons here.
        return SelectionReason.ORDINARY if self.timing.known else SelectionReason.DISCOVERY

    @property
    def requires_feedback(self) -> bool:
        return needs_feedback(self.graph, self.timing, self.lanes)
