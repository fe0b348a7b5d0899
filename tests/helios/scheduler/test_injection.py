"""Scheduler(cost=, selector=): the duration model and the choice of each plan are injected.

The core keeps request state, the queue (A6-A11) and accounting; whatever
selector it is given is asked for the ordinary winner, for a funded
replacement only with the queue empty (A8), and told which plans it handed
out. The timing table runs over the injected cost model, never over a
default one beside it.
"""

from __future__ import annotations

import pytest
from sched_harness import MS, QUEUE_AHEAD, decode, measured, prefill
from test_core_lifecycle import decoding

from helios.direct.cost import MovingAverageCost
from helios.direct.scheduler import DirectSelector
from helios.scheduler import Scheduler
from helios.scheduler.cost import CostModel
from helios.scheduler.selector import HeliosSelector

S = 1_000_000_000


def test_defaults_are_helios_cost_model_and_selector():
    s = Scheduler([decode(1)], request_slots=1)
    assert isinstance(s.cost, CostModel) and isinstance(s.selector, HeliosSelector)


def test_helios_selector_refuses_a_cost_model_without_observation_history():
    """Funded timing refresh reads CostModel's staleness and attempts (D7): another model needs its own selector."""
    with pytest.raises(ValueError, match="pass a selector of its own"):
        Scheduler([decode(1)], request_slots=1, cost=MovingAverageCost())


class Recording:
    """Wraps Helios's selector and records what the core asks."""

    def __init__(self, inner: HeliosSelector) -> None:
        self.inner, self.calls = inner, []

    def select(self, timings, population):
        self.calls.append("select")
        return self.inner.select(timings, population)

    def fund(self, decision, accounts, subject):
        self.calls.append("fund")
        return self.inner.fund(decision, accounts, subject)

    def would_fund(self, decision, accounts, subject):
        self.calls.append("would_fund")
        return self.inner.would_fund(decision, accounts, subject)

    def planned(self, plan, now_ns):
        self.calls.append(("planned", plan.graph.id))

    def configure(self, policy):
        self.inner.configure(policy)


def test_A8_the_core_asks_fund_only_with_the_queue_empty_and_reports_the_plans_it_hands_out():
    s = measured({prefill(64): 4.0, decode(2): 3.0}, policy=QUEUE_AHEAD)
    _, fence = decoding(s, 2)
    recording = s.selector = Recording(s.selector)
    first = s.plan()
    assert recording.calls == ["select", "fund", ("planned", first.graph.id)]
    s.commit(first, fence + 1)
    recording.calls.clear()
    second = s.plan()  # a second decode frame may queue: only whether a funded plan is due is asked
    assert recording.calls == ["select", "would_fund", ("planned", second.graph.id)]
    s.commit(second, fence + 2)
    recording.calls.clear()
    assert s.plan() is None and recording.calls == []  # both frame slots busy: nothing is selected (A7)


def test_the_timing_table_runs_over_the_injected_cost_model():
    """An estimate that lapses in the injected model lapses in what selection reads (no table over another)."""
    cost = MovingAverageCost()
    graphs = [decode(1), prefill(8)]
    s = Scheduler(graphs, request_slots=1, cost=cost, selector=DirectSelector(graphs))
    s.observe_duration(decode(1).id, 2 * MS)
    assert s.duration_estimates() == {decode(1).id: 2 * MS, prefill(8).id: 0}
    s.observe_duration(decode(1).id, 10 * MS)
    assert s.duration_estimates()[decode(1).id] == cost.estimate_ns(decode(1).cost_key(), 0) == 3 * MS
    s.advance_to(30 * S)
    assert s.duration_estimates() == {decode(1).id: 0, prefill(8).id: 0}
