"""What the core asks of selection, and Helios's answer (``Scheduler(selector=...)``).

The core owns request state, the execution queue and accounting; a selector
owns the choice. Each ``Scheduler.plan`` that the queue admits (A7, A9) calls

1. ``select(timings, population)``: the ordinary winner on the snapshot
   projected to the queue's end (A8, A10), or None;
2. with the queue empty, ``fund(decision, accounts, subject)``: a funded
   timing refresh or acceptance probe that replaces the winner (D7, D8), or
   None; with work queued, ``would_fund(...)`` instead, since a funded plan
   would wait for the empty window like any plan needing feedback (A8);
3. ``planned(plan, now_ns)`` once the plan is handed to the caller (the
   direct scheduler logs decisions there).

``configure(policy)`` follows ``Scheduler.configure_policy``.

``HeliosSelector`` is the default: ``select.leader.select`` and funded exploration
(``explore.Explorer``), which reads a ``CostModel``'s observation history.
``helios.direct.select.DirectSelector`` is the debug server's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from flare_contract.graphs import GraphDescriptor
from helios.scheduler.select.catalog import describe
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.leader import select as select_plan
from helios.scheduler.select.population import Population
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.catalog_timing import CatalogTiming
from helios.scheduler.config import PolicyConfig
from helios.scheduler.cost import CostModel
from helios.scheduler.explore import Decision, Explorer, Funded, ProbeSubject
from helios.scheduler.refresh import ExplorationAccounts
from helios.scheduler.types import RequestHandle, ScheduledPlan

Subject = Callable[[RequestHandle], ProbeSubject]


class Selector(Protocol):
    """The choice of one plan (see the module docstring)."""

    def select(self, timings: Sequence[GraphTiming], population: Population) -> Choice | None: ...

    def fund(self, decision: Decision, accounts: ExplorationAccounts, subject: Subject) -> Funded | None: ...

    def would_fund(self, decision: Decision, accounts: ExplorationAccounts, subject: Subject) -> bool: ...

    def planned(self, plan: ScheduledPlan, now_ns: int) -> None: ...

    def configure(self, policy: PolicyConfig) -> None: ...


class HeliosSelector:
    """``select.leader.select`` over one catalog, with funded exploration over a ``CostModel``."""

    def __init__(self, graphs: Sequence[GraphDescriptor], timing: CatalogTiming, cost: CostModel,
                 policy: PolicyConfig, *, fixed_width: bool) -> None:
        if not isinstance(cost, CostModel):
            raise ValueError("Helios's selector funds timing refreshes from a CostModel's observation history; "
                             f"with a {type(cost).__name__} pass a selector of its own")
        self.graphs = tuple(graphs)
        self.infos = describe(self.graphs)
        self._timing = timing
        self._cost = cost
        self._fixed_width = fixed_width
        self._max_depth = max((g.proposal_depth for g in self.graphs), default=0)
        self._explorer = self._make_explorer(policy)

    def _make_explorer(self, policy: PolicyConfig) -> Explorer:
        return Explorer(self.graphs, self.infos, max_depth=self._max_depth,
                        alpha=policy.adaptive_verification_alpha, fixed_width=self._fixed_width,
                        probes_win_as_plans=bool(policy.probes_win_as_plans))

    def select(self, timings: Sequence[GraphTiming], population: Population) -> Choice | None:
        return select_plan(self.graphs, timings, population, self.infos, self._timing.durations_ms(timings))

    def fund(self, decision: Decision, accounts: ExplorationAccounts, subject: Subject) -> Funded | None:
        return self._explorer.choose(decision, accounts, self._cost, subject)

    def would_fund(self, decision: Decision, accounts: ExplorationAccounts, subject: Subject) -> bool:
        return self._explorer.would_fund(decision, accounts, self._cost, subject)

    def planned(self, plan: ScheduledPlan, now_ns: int) -> None:
        pass  # Helios keeps no log of its decisions (the plan's trace says what A12 asks)

    def configure(self, policy: PolicyConfig) -> None:
        self._explorer = self._make_explorer(policy)
