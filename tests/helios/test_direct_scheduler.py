"""ignition debug-serve --direct: its scheduler against Helios's, and its moving-average cost model.

Spec, first section: the direct path reproduces Helios's selection for decode
rounds only, and estimates costs with a 7/8 moving average that reverts to
unmeasured after 30 seconds.
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helios.direct import select
from helios.direct.cost import MovingAverageCost
from helios.direct.scheduler import DirectScheduler
from helios.scheduler import CompletionRecord, ExecutionTiming, LanePhase, Scheduler, ValueSource
from helios.scheduler.types import PlannedLane, ScheduledPlan, SelectionReason
from tests.helios.scheduler.sched_harness import MS, ask, decode, prefill, spec

EXAMPLES = 60 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 300
S = 1_000_000_000


# ---------------------------------------------------------------------------
# The cost model, on an injected clock
# ---------------------------------------------------------------------------


def test_first_sample_sets_then_seven_eighths_average():
    cost, key = MovingAverageCost(), decode(1).cost_key()
    assert cost.estimate_ns(key, 0) == 0  # unmeasured (C11)
    cost.observe(key, 8_000, 0, now_ns=0)
    assert cost.estimate_ns(key, 0) == 8_000
    cost.observe(key, 16_000, 0, now_ns=1)
    assert cost.estimate_ns(key, 1) == 9_000  # 7/8 * 8000 + 1/8 * 16000
    cost.observe(key, 1_000, 0, now_ns=2)
    assert cost.estimate_ns(key, 2) == round(7 / 8 * 9_000 + 1 / 8 * 1_000)


def test_zero_or_missing_interval_changes_nothing_D3():
    cost, key = MovingAverageCost(), decode(1).cost_key()
    cost.observe(key, 4_000, 0, now_ns=0)
    assert not cost.observe(key, 0, 0, now_ns=10 * S)
    assert cost.estimate_ns(key, 10 * S) == 4_000
    assert cost.age_ns(key, 10 * S) == 10 * S  # the empty sample did not refresh it


def test_reverts_to_unmeasured_thirty_seconds_after_the_last_sample():
    cost, key = MovingAverageCost(), decode(2).cost_key()
    cost.observe(key, 5_000, 0, now_ns=0)
    cost.observe(key, 5_000, 0, now_ns=20 * S)
    assert cost.estimate_ns(key, 49 * S) == 5_000  # 29 s after the last sample
    assert cost.estimate_ns(key, 50 * S) == 0  # 30 s: unmeasured again
    assert cost.requires_feedback(key, 50 * S)
    cost.observe(key, 40_000, 0, now_ns=51 * S)
    assert cost.estimate_ns(key, 51 * S) == 40_000  # a fresh start, not averaged with the forgotten value


def test_scheduler_plans_discovery_once_an_estimate_expires():
    graphs = [decode(1), decode(2), prefill(8, 1)]
    direct = DirectScheduler(graphs, request_slots=2)
    s = direct.scheduler
    for g in graphs:
        s.observe_duration(g.id, 3 * MS)
    assert all(p["estimate_ns"] == 3 * MS for p in direct.programs_state())
    h = s.admit(ask(4, 8))
    chunk = s.plan()
    assert chunk.graph.kind.value == "prefill" and chunk.reason is SelectionReason.ORDINARY
    s.commit(chunk, 1)
    s.complete(1, [CompletionRecord(h, prompt_consumed=4, tokens=(5,))], ExecutionTiming(0, 0))  # no sample
    s.advance_to(31 * S)
    assert all(p["estimate_ns"] == 0 and p["age_ns"] == 31 * S for p in direct.programs_state())
    plan = s.plan()  # the core's timing table over the moving average lapsed with it
    assert plan.reason is SelectionReason.DISCOVERY and plan.estimated_duration_ns == 0


def test_C1_a_scored_prompt_runs_in_scored_prefill_chunks_on_the_direct_path_too():
    import dataclasses

    from helios.scheduler import GraphDescriptor, GraphKind

    scored = GraphDescriptor("scored_p8", GraphKind.SCORED_PREFILL, 1, prefill_capacity=8)
    graphs = [decode(1), prefill(8, 1), scored]
    s = DirectScheduler(graphs, request_slots=2).scheduler
    for g in graphs:
        s.observe_duration(g.id, 3 * MS)
    plain, marked = s.admit(ask(4, 2)), s.admit(dataclasses.replace(ask(12, 0), scored_prompt=True))
    kinds, fence = {}, 0
    while (plan := s.plan()) is not None:
        fence += 1
        s.commit(plan, fence)
        lanes = plan.lanes
        for lane in lanes:
            if lane.phase is LanePhase.PROMPT:
                kinds.setdefault(lane.handle, set()).add(plan.graph.kind)
        s.complete(fence, [CompletionRecord(l.handle, prompt_consumed=l.prompt_tokens,
                                            tokens=(5,) if l.finishes_prompt or l.phase is LanePhase.DECODE else ())
                           for l in lanes], ExecutionTiming(3 * MS, 3 * MS))
    assert kinds == {plain: {GraphKind.PREFILL}, marked: {GraphKind.SCORED_PREFILL}}
    assert not s.is_active(plain) and not s.is_active(marked)


# ---------------------------------------------------------------------------
# Decode rounds: the same program and cohort as Helios (U6, U8, U9, U10, U12)
# ---------------------------------------------------------------------------


def _generation_graphs():
    shapes = st.sampled_from([1, 2, 4, 8])
    widths = st.integers(2, 4)
    one = st.one_of(
        shapes.map(decode),
        st.builds(lambda b, w: spec(b, w), shapes, widths),
        st.builds(lambda b, w, f: spec(b, w, aggregate=max(b, b * w - f), source=ValueSource.QUERY_LENGTH),
                  shapes, widths, st.integers(1, 6)),
        st.builds(lambda b, w, f: spec(b, w, aggregate=max(b, b * w - f), source=ValueSource.PREFIX_LIMIT),
                  shapes, widths, st.integers(0, 6)),
    )
    return st.lists(one, min_size=1, max_size=6, unique_by=lambda g: g.id)


@st.composite
def situations(draw):
    graphs = draw(_generation_graphs())
    # programs sharing a cost key (D1) share one duration, or the average and the median would differ
    by_key = {g.cost_key(): draw(st.floats(0.5, 20.0)) for g in graphs}
    durations = {g: by_key[g.cost_key()] for g in graphs}
    n = draw(st.integers(1, 6))
    requests = [draw(st.builds(lambda p, m, s: ask(p, m, sources=s), st.integers(1, 8), st.integers(2, 24),
                               st.sampled_from([("learned",), ()]))) for _ in range(n)]
    seeds = [draw(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3)).map(lambda t: (t[0], min(t)))
                           , max_size=4)) for _ in range(n)]
    rounds_before = draw(st.integers(0, 4))
    accepted = [draw(st.integers(0, 3)) for _ in range(n)]
    gaps = draw(st.lists(st.floats(0.0, 50.0), min_size=2 * (rounds_before + 2), max_size=2 * (rounds_before + 2)))
    return graphs, durations, requests, seeds, rounds_before, accepted, gaps


class Twins:
    """One Helios scheduler and one direct scheduler, driven through the same events."""

    def __init__(self, graphs, durations, slots: int) -> None:
        self.warmup = prefill(8, slots)  # only brings prompts into decode; no prompt is left when comparing
        catalog = [*graphs, self.warmup]
        self.direct = DirectScheduler(catalog, request_slots=slots)
        self.pair = (Scheduler(catalog, request_slots=slots), self.direct.scheduler)
        self.durations = {**durations, self.warmup: 1.0}
        for s in self.pair:
            for g, ms in self.durations.items():
                s.observe_duration(g.id, int(ms * MS))
        self.now_ns, self.fence = 0, 0

    def each(self, call):
        return [call(s) for s in self.pair]

    def run(self, plan: ScheduledPlan, accepted, gap_ms: float, publish_ms: float) -> None:
        """Commit the same plan to both, complete it after its measured duration (so the average and the
        median agree), then publish each burst ``publish_ms`` later."""
        self.fence += 1
        self.each(lambda s: s.commit(plan, self.fence))
        self._advance(gap_ms + self.durations[plan.graph])
        budget = [plan.graph.target_rows - len(plan.lanes)]
        records = [_record(plan, lane, accepted, budget) for lane in plan.lanes]
        timing = ExecutionTiming(int(self.durations[plan.graph] * MS), int(self.durations[plan.graph] * MS))
        if plan.graph.is_prefix_limit:
            outs = self.each(lambda s: s.complete_packed_round(self.fence, records, timing, None))
        else:
            outs = self.each(lambda s: s.complete(self.fence, records, timing))
        self._advance(publish_ms)
        for s, out in zip(self.pair, outs):
            for token in out:
                s.published_output(token.handle, self.fence)

    def _advance(self, ms: float) -> None:
        self.now_ns += int(ms * MS)
        self.each(lambda s: s.advance_to(self.now_ns))


def _record(plan, lane, accepted, budget) -> CompletionRecord:
    if lane.phase is LanePhase.PROMPT:
        return CompletionRecord(lane.handle, prompt_consumed=lane.prompt_tokens, tokens=(7,))
    rows = lane.ceiling or lane.query_length
    if lane.ceiling:
        extra = min(rows - 1, budget[0])
        budget[0] -= extra
        rows = 1 + extra
    offered = min(plan.graph.proposal_depth, rows - 1) if plan.graph.draws_proposals else 0
    took = min(accepted[lane.handle.slot], offered)
    return CompletionRecord(lane.handle, tokens=(5,) * min(1 + took, rows), offered=offered)


def _whole_prompts(twins: Twins, handles, requests) -> ScheduledPlan:
    lanes = tuple(PlannedLane(h, LanePhase.PROMPT, prompt_start=0, prompt_tokens=r.prompt_tokens,
                              expected_tokens=1.0, finishes_prompt=True) for h, r in zip(handles, requests))
    return ScheduledPlan(twins.warmup, lanes, SelectionReason.ORDINARY, MS, 0.0, 0.0)


def _helios_skipped_a_row_search(direct: Scheduler, helios_plan: ScheduledPlan | None) -> bool:
    """Whether the choices differ only because Helios never evaluated a row-budget program.

    Helios prices constrained ragged and adaptive programs only when an upper bound can beat the best
    candidate in hand (select/leader.py:_add_deferred), and that candidate may itself be pruned as padding (U12)
    afterwards. Two outcomes follow, both seen here: Helios's winner is padding for a program it skipped,
    or a skipped program had the higher value. The direct scheduler evaluates every program.
    """
    if helios_plan is None:
        return False
    timings, pop = direct.selection_inputs()
    candidates = select.decode_candidates(direct.graphs, timings, pop)
    winner = next(c for c in candidates if c.graph.id == helios_plan.graph.id)
    if _cohort(helios_plan)[1] != _cohort_of(winner):
        return False
    best, _ = select.best_decode(direct.graphs, timings, pop)
    padding = any(select.dominates(o, winner) and o.row_search for o in candidates)
    return padding or (best.row_search and best.rank() > winner.rank())


def _cohort_of(c: select.Candidate):
    return sorted((lane.handle.slot, lane.handle.generation, lane.query_length, lane.ceiling) for lane in c.lanes)


def _score(plan: ScheduledPlan) -> float:
    """The winner's value rate before the decision's common scaling (U7)."""
    return plan.selection_value_rate() / math.exp(plan.selection_log_scale())


def _cohort(plan: ScheduledPlan | None):
    if plan is None:
        return None
    return plan.graph.id, sorted((lane.handle.slot, lane.handle.generation, lane.query_length, lane.ceiling) for lane in plan.lanes)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(situations())
def test_U6_U9_U10_U12_decode_rounds_choose_what_helios_chooses(case):
    graphs, durations, requests, seeds, rounds_before, accepted, gaps = case
    twins = Twins(graphs, durations, slots=8)
    handles = [twins.each(lambda s: s.admit(r))[0] for r in requests]
    for h, r, seen in zip(handles, requests, seeds):
        if r.proposal_sources:
            twins.each(lambda s: s.seed_acceptance(h, "learned", seen))
    twins.run(_whole_prompts(twins, handles, requests), accepted, gaps[0], gaps[1])
    for step in range(rounds_before + 1):
        helios, direct = twins.each(lambda s: s.plan())
        if _cohort(direct) != _cohort(helios) and _helios_skipped_a_row_search(twins.pair[1], helios):
            event("Helios skipped a row-budget program that decides")
            return  # the direct path follows U6/U12 here; later rounds would diverge
        assert _cohort(direct) == _cohort(helios)
        event("same choice" if helios is not None else "nothing to run")
        if helios is None:
            return
        assert _score(direct) == pytest.approx(_score(helios), rel=1e-9)
        if step < rounds_before:
            twins.run(helios, accepted, gaps[2 + 2 * step], gaps[3 + 2 * step])
