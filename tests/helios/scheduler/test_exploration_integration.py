"""Funded exploration through the real Scheduler (issue 4, second half).

The ledgers and probe rules have their own unit and property tests
(test_refresh.py, test_learning.py, test_speculation_forecasts.py). Here the
core drives them: ordinary completions earn, ``plan`` spends, commit opens an
episode, completion closes it. Durations are chosen so that the spec's
thresholds (2,495 ms for the first refresh, 495 ms for the first probe) fall on
frame boundaries, and every tally a test compares against is kept by the test
from the frames it ran, not read back from the scheduler's ledgers.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_harness import MS, Driver, Executed, ask, decode, measured, prefill, spec

from helios.scheduler import (
    CompletionRecord,
    ExecutionTiming,
    GraphKind,
    LanePhase,
    PolicyConfig,
    Scheduler,
    SelectionReason,
    ValueSource,
)
from helios.scheduler.select.catalog import describe
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.explore import Explorer
from helios.scheduler.learning import ProbeLane, WidthProgram
from helios.scheduler.speculation import POPULATION_STEP
from tests.helios.scheduler.reference import best_probe

SCALE_CI = os.environ.get("FLARE_TEST_SCALE") == "ci"
REFRESH = SelectionReason.TIMING_REFRESH
LEARN = SelectionReason.ACCEPTANCE_LEARNING
ORDINARY = SelectionReason.ORDINARY
LONG_TTL = PolicyConfig(estimate_ttl_ns=10**15)  # nothing goes stale unless a test wants it


def _until_planned(drv: Driver, wanted: SelectionReason, limit: int = 20_000):
    """Run frames until, with an empty queue, the next plan has reason ``wanted``; return that plan."""
    for _ in range(limit):
        if not drv.queue:
            plan = drv.sched.plan()
            assert plan is not None, "the scheduler stopped planning before the wanted exploration"
            if plan.reason is wanted:
                return plan
        assert drv.step() is not None
    raise AssertionError(f"no {wanted.value} plan within {limit} frames")


def _ordinary_ms(drv: Driver) -> float:
    return sum(e.end_ms - e.start_ms for e in drv.executed if e.plan.reason is ORDINARY)


def _credit_reached_between_last_frames(drv: Driver, threshold_ms: float) -> None:
    """The threshold was crossed by one of the last two ordinary frames (the queue holds two)."""
    ordinary = [e.end_ms - e.start_ms for e in drv.executed if e.plan.reason is ORDINARY]
    assert sum(ordinary[:-2]) < threshold_ms <= sum(ordinary)


# ---------------------------------------------------------------------------
# Thresholds (D6, D8)
# ---------------------------------------------------------------------------


def test_D6_D7_first_refresh_needs_2495_ms_of_credited_ordinary_execution():
    d1, d2 = decode(1), decode(2)
    durations = {prefill(64): 5, d1: 5, d2: 6}
    sched = measured(durations, policy=PolicyConfig(estimate_ttl_ns=200 * MS))
    drv = Driver(sched, durations)
    drv.admit(ask(64, 5000))
    plan = _until_planned(drv, REFRESH)
    _credit_reached_between_last_frames(drv, 2495.0)
    assert not any(e.plan.reason is REFRESH for e in drv.executed)
    assert plan.graph == d2, "the measured stale alternative displaces the ordinary winner"
    assert plan.requires_feedback and plan.trace.reason is REFRESH
    assert plan.trace.timing_refresh_credit_ns == 5 * MS, "full credit is the 5 ms cap"
    assert plan.trace.observation_age_ns >= 200 * MS, "the refreshed estimate was stale"


def test_D8_first_probe_needs_495_ms_of_ordinary_execution():
    durations = {prefill(64): 5, decode(1): 5, spec(1, 4): 8}
    sched = measured(durations, policy=LONG_TTL)
    drv = Driver(sched, durations)
    h = drv.admit(ask(64, 5000, sources=("learned",)))
    drv.accepted[h.slot] = 0
    plan = _until_planned(drv, LEARN)
    _credit_reached_between_last_frames(drv, 495.0)
    assert plan.graph.kind is GraphKind.SPECULATIVE and plan.lanes[0].handle == h
    assert plan.lanes[0].query_length - 1 > 0, "a probe offers drafts the ordinary width-one round does not"
    assert plan.trace.acceptance_learning_credit_ns == 5 * MS


def test_D6_refresh_never_funded_by_busy_periods_shorter_than_2495_ms_separated_by_idle():
    """Ten busy periods of ~1 s each (10 s in all) never fund a refresh: idle discards the credit."""
    d1, d2 = decode(1), decode(2)
    durations = {prefill(64): 5, d1: 5, d2: 6}
    sched = measured(durations, policy=PolicyConfig(estimate_ttl_ns=200 * MS))
    drv = Driver(sched, durations)
    for _ in range(10):
        drv.admit(ask(64, 200))
        while drv.step() is not None:
            pass
        drv.idle_until(drv.now_ns / MS + 500)
    assert _ordinary_ms(drv) > 4 * 2495
    assert not any(e.plan.reason is REFRESH for e in drv.executed)
    assert sched.cost.is_stale(d2.cost_key(), sched.now_ns), "the unused estimate stays stale"
    assert sched.exploration.credit().timing_refresh_ns <= 0


def test_D6_one_long_busy_period_of_the_same_work_does_refresh():
    """The contrast to the idle case: the same ordinary work back to back funds a refresh."""
    d1, d2 = decode(1), decode(2)
    durations = {prefill(64): 5, d1: 5, d2: 6}
    sched = measured(durations, policy=PolicyConfig(estimate_ttl_ns=200 * MS))
    drv = Driver(sched, durations)
    drv.admit(ask(64, 2000))
    while drv.step() is not None:
        pass
    refreshes = [e for e in drv.executed if e.plan.reason is REFRESH]
    assert refreshes and not sched.cost.is_stale(d2.cost_key(), refreshes[0].end_ms * MS)


# ---------------------------------------------------------------------------
# Refresh order, attempts, cancellation (D7)
# ---------------------------------------------------------------------------


def test_D7_refresh_order_oldest_touch_first_then_higher_value():
    """Both alternatives were last observed at t=0: the higher-value (shorter) one goes first, then the other."""
    d1, d2, d4 = decode(1), decode(2), decode(4)
    durations = {prefill(64): 5, d1: 5, d2: 6, d4: 7}
    sched = measured(durations, policy=PolicyConfig(estimate_ttl_ns=200 * MS))
    drv = Driver(sched, durations)
    drv.admit(ask(64, 20_000))
    first = _until_planned(drv, REFRESH)
    drv.step()
    second = _until_planned(drv, REFRESH)
    assert (first.graph, second.graph) == (d2, d4)


def test_D7_attempts_advance_only_on_commit():
    d1, d2 = decode(1), decode(2)
    durations = {prefill(64): 5, d1: 5, d2: 6}
    sched = measured(durations, policy=PolicyConfig(estimate_ttl_ns=200 * MS))
    drv = Driver(sched, durations)
    drv.admit(ask(64, 5000))
    plan = _until_planned(drv, REFRESH)
    before = sched.cost.last_attempt_ns(d2.cost_key())
    assert sched.plan() == plan and sched.cost.last_attempt_ns(d2.cost_key()) == before
    sched.commit(plan, drv.fence + 1)
    assert sched.cost.last_attempt_ns(d2.cost_key()) == sched.now_ns


def test_D7_commit_refuses_an_exploration_plan_without_credit():
    durations = {prefill(64): 5, decode(1): 5}
    sched = measured(durations, policy=LONG_TTL)
    drv = Driver(sched, durations)
    drv.admit(ask(64, 50))
    drv.step()
    drv.step()
    plan = sched.plan()
    with pytest.raises(ValueError, match="full credit"):
        sched.commit(replace(plan, reason=REFRESH, requires_feedback=True), drv.fence + 1)


@pytest.mark.parametrize("ran", [False, True], ids=["never-ran", "ran-without-device-interval"])
def test_D7_cancelled_refresh_publishes_nothing_and_leaves_the_estimate_untouched(ran):
    d1, d2 = decode(1), decode(2)
    durations = {prefill(64): 5, d1: 5, d2: 6}
    sched = measured(durations, policy=PolicyConfig(estimate_ttl_ns=200 * MS))
    drv = Driver(sched, durations)
    h = drv.admit(ask(64, 5000))
    plan = _until_planned(drv, REFRESH)
    key = d2.cost_key()
    estimate, samples, observed = sched.cost.estimate_ns(key), sched.cost.samples(key), sched.cost.last_observation_ns(key)
    fence = drv.fence + 1
    sched.commit(plan, fence)
    sched.cancel(h)
    wall = 3 * MS if ran else 0
    out = sched.complete(fence, [], ExecutionTiming(device_ns=0, wall_ns=wall))
    assert out == []
    assert (sched.cost.estimate_ns(key), sched.cost.samples(key)) == (estimate, samples)
    assert sched.cost.last_observation_ns(key) == observed and sched.cost.is_stale(key, sched.now_ns)
    counters = sched.execution_counters()["timing_refresh"]
    assert (counters.executions, counters.nanoseconds) == (1, wall), "invalid timing pays its wall time"
    assert not sched.exploration.episode_open


# ---------------------------------------------------------------------------
# Probes (D8, S9)
# ---------------------------------------------------------------------------


def _acceptance_driver(speculation: str = "adaptive"):
    durations = {prefill(64): 5, decode(1): 5, spec(1, 4): 8}
    sched = Scheduler(list(durations), request_slots=4, policy=LONG_TTL, speculation=speculation)
    for g, ms in durations.items():
        sched.observe_duration(g.id, int(ms * MS))
    return Driver(sched, durations)


def test_D8_fixed_width_execution_never_probes():
    runs = {}
    for mode in ("adaptive", "fixed"):
        drv = _acceptance_driver(mode)
        h = drv.admit(ask(64, 1500, sources=("learned",)))
        drv.accepted[h.slot] = 0
        while drv.step() is not None:
            pass
        runs[mode] = sum(e.plan.reason is LEARN for e in drv.executed)
    assert runs["adaptive"] > 0, "the same workload probes when widths adapt"
    assert runs["fixed"] == 0


def test_D8_S9_rising_acceptance_is_followed_within_a_bounded_number_of_tokens():
    """Acceptance goes from none to full at token 600; after the next probe, ordinary rounds widen.

    Bound: the worst case is a probe just before the shift. Its debt (the probe's
    8 ms minus the 5 ms it found) plus the 5 ms for the next probe is earned at
    1/99 of ordinary time, one token per 5 ms decode frame.
    """
    drv = _acceptance_driver()
    h = drv.admit(ask(64, 2000, sources=("learned",)))
    drv.accepted[h.slot] = 0
    shift_at = None
    while drv.step() is not None:
        if shift_at is None and drv.produced(h) >= 600:
            drv.accepted[h.slot] = 3
            shift_at = (len(drv.executed), drv.produced(h))
    after = drv.executed[shift_at[0]:]
    probe = next(i for i, e in enumerate(after) if e.plan.reason is LEARN)
    follow = after[probe + 1:probe + 4]
    assert all(e.plan.reason is ORDINARY and e.plan.lanes[0].query_length == 4 for e in follow), \
        "ordinary rounds use the width the probe showed to pay off"
    tokens_to_probe = sum(1 for e in after[:probe])  # width-one frames: one token each
    bound = 99 * (8 + 5) // 5 + 2
    assert tokens_to_probe <= bound


def test_D8_probe_offers_a_depth_beyond_the_ordinary_choice_and_leaves_output():
    """With a wide and a narrow speculative program, a request whose narrow rounds pay is probed wider."""
    s2, s6 = spec(1, 2), spec(1, 6)
    durations = {prefill(64): 5, decode(1): 5, s2: 6, s6: 11}
    sched = measured(durations, policy=LONG_TTL)
    drv = Driver(sched, durations)
    h = drv.admit(ask(64, 3000, sources=("learned",)))
    drv.accepted[h.slot] = 1
    plan = _until_planned(drv, LEARN)
    ordinary = [e.plan for e in drv.executed[-3:] if e.plan.reason is ORDINARY]
    assert ordinary and all(p.graph == s2 for p in ordinary)
    assert plan.graph == s6 and plan.lanes[0].query_length - 1 > 1
    assert sched.request_view(h).produced + plan.lanes[0].query_length < 3000


# ---------------------------------------------------------------------------
# The aggregate bounds over long mixed histories (D7, D8)
# ---------------------------------------------------------------------------


def _mixed_catalog():
    return {
        prefill(64): 4, prefill(256): 9, decode(1): 5, decode(2): 5.5, decode(4): 6.5, decode(8): 8,
        spec(1, 2): 6, spec(2, 4): 9, spec(4, 4): 11, spec(4, 8, aggregate=16, source=ValueSource.PREFIX_LIMIT): 12,
    }


class _Tally:
    """The test's own exact account of ordinary time and each exploration kind (ns)."""

    def __init__(self):
        self.ordinary = 0
        self.spent = {REFRESH: 0, LEARN: 0}
        self.last = {REFRESH: 0, LEARN: 0}

    def add(self, reason, timing: ExecutionTiming):
        """Wall equals device whenever the device interval is valid, so queued or not, the interval is device."""
        if reason is ORDINARY and timing.device_ns > 0:
            self.ordinary += timing.device_ns
        elif reason in self.spent:
            paid = timing.device_ns or timing.wall_ns
            self.spent[reason] += paid
            self.last[reason] = paid

    def check(self):
        for reason, share in ((REFRESH, Fraction(2, 998)), (LEARN, Fraction(1, 99))):
            assert self.spent[reason] <= share * self.ordinary + self.last[reason], reason


def _run_mixed_history(seed: int, frames: int) -> _Tally:
    """Bursts of requests with idle gaps, shifting acceptance, cancellations and frames that never ran."""
    rng = random.Random(seed)
    durations = _mixed_catalog()
    sched = measured(durations, slots=8, policy=PolicyConfig(estimate_ttl_ns=150 * MS))
    drv = Driver(sched, durations)
    tally, live = _Tally(), []
    for _ in range(frames):
        live = [h for h in live if sched.is_active(h)]
        if len(live) < 4 and rng.random() < 0.05:
            h = drv.admit(ask(rng.choice([32, 64, 200]), rng.randint(20, 400), sources=("learned",)))
            live.append(h)
        for h in live:
            if rng.random() < 0.02:
                drv.accepted[h.slot] = rng.randint(0, 7)  # acceptance shifts mid-stream
        if live and rng.random() < 0.01:
            sched.cancel(live.pop(rng.randrange(len(live))))
        if not _step(drv, rng, tally):
            drv.idle_until(drv.now_ns / MS + rng.choice([1, 50, 400]))
        tally.check()
    return tally


def _step(drv: Driver, rng: random.Random, tally: _Tally) -> bool:
    """Like Driver.step, with invalid device intervals and skipped (never-run) frames mixed in."""
    drv.fill()
    if not drv.queue:
        return False
    fence, plan, start, end = drv.queue.pop(0)
    drv.now_ns = max(drv.now_ns, end)
    drv.sched.advance_to(drv.now_ns)
    budget = [plan.graph.target_rows - len(plan.lanes)]
    records = [drv.record(plan, lane, budget) for lane in plan.lanes if drv.sched.is_active(lane.handle)]
    duration, roll = end - start, rng.random()
    timing = ExecutionTiming(device_ns=0 if roll < 0.03 else duration, wall_ns=duration)
    if not records and roll < 0.5:
        timing = ExecutionTiming(0, 0)  # every lane was cancelled: the engine never ran it
    tally.add(plan.reason, timing)
    if plan.graph.is_prefix_limit:
        out = drv.sched.complete_packed_round(fence, records, timing, None)
    else:
        out = drv.sched.complete(fence, records, timing)
    for token in out:
        drv.sched.published_output(token.handle, fence)
    drv.executed.append(Executed(fence, plan, start / MS, end / MS))
    return True


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2 if SCALE_CI else 4))
def test_D7_D8_aggregate_bounds_hold_over_long_mixed_histories(seed):
    """P <= 0.002/0.998 * O + D and P <= 0.01/0.99 * O + D after every frame of a long history."""
    tally = _run_mixed_history(seed, 3000 if SCALE_CI else 8000)
    assert tally.spent[LEARN] > 0 and tally.spent[REFRESH] > 0, "the history exercised both kinds"


# ---------------------------------------------------------------------------
# Completion feeds forecasts, survival and draws (S7, S10, S12, A2); D9 counters
# ---------------------------------------------------------------------------


def _packed_round_scheduler():
    wide = spec(2, 4, aggregate=8, source=ValueSource.PREFIX_LIMIT)
    durations = {prefill(64): 5, wide: 8}
    sched = measured(durations, policy=LONG_TTL)
    a = sched.admit(ask(64, 100, sources=("learned",)))
    b = sched.admit(ask(64, 100, sources=("learned",)))
    fence = 0
    while sched.request_view(a).phase is LanePhase.PROMPT or sched.request_view(b).phase is LanePhase.PROMPT:
        plan = sched.plan()
        fence += 1
        sched.commit(plan, fence)
        records = [CompletionRecord(l.handle, prompt_consumed=l.prompt_tokens, tokens=(1,) if l.finishes_prompt else ())
                   for l in plan.lanes]
        sched.complete(fence, records, ExecutionTiming(5 * MS, 5 * MS))
    plan = sched.plan()
    assert plan.graph == wide and len(plan.lanes) == 2
    sched.commit(plan, fence + 1)
    return sched, plan, fence + 1


def test_S7_A2_confidence_rows_validated_for_every_lane_before_any_lane_applies():
    sched, plan, fence = _packed_round_scheduler()
    records = [CompletionRecord(l.handle, tokens=(1, 2), offered=1) for l in plan.lanes]
    before = list(sched.acceptance_prior.means)
    with pytest.raises(ValueError, match="probabilities"):
        sched.complete_packed_round(fence, records, ExecutionTiming(8 * MS, 8 * MS), [(0.9, 0.8, 0.7), (0.9, 1.5, 0.1)])
    assert sched.acceptance_prior.means == before and sched.queued_fences == (fence,)
    assert all(sched.acceptance_of(l.handle).forecast is None for l in plan.lanes)
    sched.complete_packed_round(fence, records, ExecutionTiming(8 * MS, 8 * MS), [(0.9, 0.8, 0.7), (0.9, 0.6, 0.1)])
    ceiling = plan.lanes[0].ceiling
    learned = min(3, ceiling - 1)
    assert len(sched.acceptance_prior.means) == learned, "forecast observations stop below the lane ceiling"
    # two lanes moved depth 1 toward 0.9 from the prior 0.5, 1/64 of the way each time
    expected = 0.5 + (0.9 - 0.5) * POPULATION_STEP
    expected += (0.9 - expected) * POPULATION_STEP
    assert sched.acceptance_prior.means[0] == pytest.approx(expected)
    assert all(sched.acceptance_of(l.handle).forecast is not None for l in plan.lanes)


def test_S10_survival_rows_replace_binary_observations_and_S12_counts_learned_draws():
    s4 = spec(1, 4)
    durations = {prefill(64): 5, s4: 8}
    sched = measured(durations, policy=LONG_TTL)
    h = sched.admit(ask(64, 100, sources=("learned",)))
    plan = sched.plan()
    sched.commit(plan, 1)
    sched.complete(1, [CompletionRecord(h, prompt_consumed=64, tokens=(1,))], ExecutionTiming(5 * MS, 5 * MS))
    plan = sched.plan()
    assert plan.graph == s4
    sched.commit(plan, 2)
    # 2 of 3 drafts accepted; survival products 0.9, 0.6 replace the binary 1, 1 (depth 3 stays binary 0)
    record = CompletionRecord(h, tokens=(1, 2, 3), offered=3)
    sched.complete_with_survival(2, [record], ExecutionTiming(8 * MS, 8 * MS), [(0.9, 0.6)])
    est = sched.acceptance_of(h).source("learned")
    weight = est.weight(1)
    prior_weight = weight - 1
    for depth, value in ((1, 0.9), (2, 0.6), (3, 0.0)):
        prior = 0.5**depth
        assert est.survival(depth) == pytest.approx(prior + (value - prior) / (prior_weight + 1))
    assert sched.proposal_draws.learned_draws == 3


def test_D9_execution_counters_split_time_by_reason():
    drv = _acceptance_driver()
    h = drv.admit(ask(64, 800, sources=("learned",)))
    drv.accepted[h.slot] = 0
    while drv.step() is not None:
        pass
    counters = drv.sched.execution_counters()
    for reason in SelectionReason:
        frames = [e for e in drv.executed if e.plan.reason is reason]
        assert counters[reason.value].executions == len(frames)
        assert counters[reason.value].nanoseconds == round(sum(e.end_ms - e.start_ms for e in frames) * MS)
    assert counters["acceptance_learning"].executions > 0


# ---------------------------------------------------------------------------
# The explorer's program shortlist changes no probe decision
# ---------------------------------------------------------------------------


@settings(max_examples=40 if SCALE_CI else 200, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.integers(2, 6), st.integers(3, 12)), min_size=1, max_size=12),
    means=st.lists(st.floats(0, 1), min_size=5, max_size=5),
    weights=st.lists(st.floats(0, 128), min_size=5, max_size=5),
    remaining=st.integers(0, 10),
)
def test_D8_shortlist_of_fastest_program_per_draft_cap_picks_the_same_probe(shapes, means, weights, remaining):
    graphs = [decode(1)] + [spec(b, w) for b, w, _ in dict(((b, w), (b, w, ms)) for b, w, ms in shapes).values()]
    durations = [5] + [ms for _, _, ms in dict(((b, w), (b, w, ms)) for b, w, ms in shapes).values()]
    timings = [GraphTiming(int(ms * MS), True) for ms in durations]
    explorer = Explorer(graphs, describe(graphs), max_depth=5, alpha=1.0, fixed_width=False)
    everything = [WidthProgram.of(g, t.duration_ns) for g, t in zip(graphs[1:], timings[1:])]
    lane = ProbeLane(tuple(means), tuple(weights), remaining, WidthProgram.of(graphs[0], 5 * MS))
    full, short = best_probe([lane], everything), best_probe([lane], explorer._programs("learned", timings))
    assert (full is None) == (short is None)
    if full is not None:
        assert (full.program.key, full.gain_per_ms) == (short.program.key, short.gain_per_ms)
