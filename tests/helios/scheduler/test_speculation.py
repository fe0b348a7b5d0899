"""Acceptance estimates: helios/scheduler/speculation.py (spec checklist S5, S6, S8, S9, S10 seam)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helios.scheduler.speculation import (
    CompletedRound,
    OutputBounds,
    PopulationPrior,
    PrefixSurvival,
    RequestAcceptance,
    aging_factor,
    round_observations,
)

ROOMY = OutputBounds(proposal_depth=16, output_remaining=1000, context_remaining=1000)


def test_S8_untrained_estimates_start_at_the_prior_with_weight_two():
    estimates = PrefixSurvival()
    assert [estimates.survival(d) for d in (1, 2, 3, 7)] == [0.5, 0.25, 0.125, 0.5**7]
    assert estimates.weight(1) == 2.0 and estimates.weight(9) == 2.0


def test_S8_observations_average_with_the_prior_weight():
    estimates = PrefixSurvival()
    for _ in range(3):
        estimates.observe([1.0])
    # prior 0.5 with weight 2, then three ones: (2*0.5 + 3) / 5
    assert estimates.survival(1) == pytest.approx(0.8)
    assert estimates.weight(1) == 5.0


def test_S8_weight_caps_at_128():
    estimates = PrefixSurvival()
    for _ in range(500):
        estimates.observe([1.0])
    assert estimates.weight(1) == 128.0
    before = estimates.survival(1)
    estimates.observe([0.0])
    assert estimates.survival(1) == pytest.approx(before * (1 - 1 / 128))


def test_S8_weights_age_with_a_half_life_of_128_tokens_and_means_stay():
    estimates = PrefixSurvival()
    for _ in range(30):
        estimates.observe([1.0, 0.0])
    means = (estimates.survival(1), estimates.survival(2))
    estimates.age(128)
    assert estimates.weight(1) == pytest.approx(32.0 / 2)
    estimates.age(64)
    estimates.age(64)
    assert estimates.weight(1) == pytest.approx(32.0 / 4)  # aging composes over token counts
    assert (estimates.survival(1), estimates.survival(2)) == means


def test_S8_aged_history_follows_new_behaviour_faster():
    fresh, aged = PrefixSurvival(), PrefixSurvival()
    for estimates in (fresh, aged):
        for _ in range(100):
            estimates.observe([1.0])
    aged.age(512)
    for estimates in (fresh, aged):
        for _ in range(5):
            estimates.observe([0.0])
    assert aged.survival(1) < fresh.survival(1) - 0.2


def test_S6_accepted_prefix_positive_rejection_zero_for_longer_offers():
    assert round_observations(offered=4, accepted=2, terminated=False) == (1.0, 1.0, 0.0, 0.0)
    acceptance = RequestAcceptance()
    acceptance.observe_round("learned", offered=4, accepted=2, terminated=False)
    learned = acceptance.source("learned")
    assert learned.survival(1) == pytest.approx((2 * 0.5 + 1) / 3)
    assert learned.survival(3) == pytest.approx((2 * 0.125 + 0) / 3)
    assert learned.survival(5) == 0.5**5  # not offered: untouched


def test_S6_termination_censors_the_rejected_suffix():
    assert round_observations(offered=4, accepted=1, terminated=True) == (1.0,)
    acceptance = RequestAcceptance()
    acceptance.observe_round("learned", offered=4, accepted=1, terminated=True)
    learned = acceptance.source("learned")
    assert learned.survival(2) == 0.25 and learned.weight(2) == 2.0


def test_S6_width_one_rounds_observe_nothing():
    acceptance = RequestAcceptance()
    acceptance.observe_round("learned", offered=0, accepted=0, terminated=False)
    assert acceptance.source("learned").survival(1) == 0.5
    assert acceptance.source("learned").weight(1) == 2.0


def test_S6_sources_are_tracked_separately():
    acceptance = RequestAcceptance()
    for _ in range(10):
        acceptance.observe_round("copy", offered=2, accepted=2, terminated=False)
    assert acceptance.source("copy").survival(2) > 0.8
    assert acceptance.source("learned").survival(2) == 0.25


def test_S8_unobserved_suffix_keeps_its_mean():
    estimates = PrefixSurvival()
    estimates.observe([1.0, 1.0, 1.0, 1.0])
    estimates.observe([1.0, 0.0])
    assert estimates.survival(3) == pytest.approx((2 * 0.125 + 1) / 3)
    estimates.age(300)
    assert estimates.survival(3) == pytest.approx((2 * 0.125 + 1) / 3)


def test_S10_seam_fractional_survival_observations_are_accepted():
    estimates = PrefixSurvival()
    estimates.observe([0.9, 0.72, 0.36])
    assert estimates.survival(2) == pytest.approx((2 * 0.25 + 0.72) / 3)
    with pytest.raises(ValueError, match="depth 2"):
        estimates.observe([0.5, 1.5])


def test_S5_expected_output_sums_survival_to_width_minus_one():
    estimates = PrefixSurvival()
    estimates.seed([0.9, 0.8, 0.6, 0.3], weight=64)
    assert estimates.expected_output(1, 1.0, ROOMY) == 1.0
    assert estimates.expected_output(3, 1.0, ROOMY) == pytest.approx(1 + 0.9 + 0.8)
    assert estimates.expected_output(5, 1.0, ROOMY) == pytest.approx(1 + 0.9 + 0.8 + 0.6 + 0.3)


def test_S5_alpha_raises_each_survival_estimate():
    estimates = PrefixSurvival()
    estimates.seed([0.9, 0.8, 0.6], weight=64)
    assert estimates.expected_output(4, 2.0, ROOMY) == pytest.approx(1 + 0.81 + 0.64 + 0.36)
    assert estimates.expected_output(4, 0.5, ROOMY) == pytest.approx(1 + math.sqrt(0.9) + math.sqrt(0.8) + math.sqrt(0.6))


def test_S5_bounded_by_proposal_work_output_and_context():
    estimates = PrefixSurvival()
    estimates.seed([1.0] * 8, weight=64)
    assert estimates.expected_output(8, 1.0, OutputBounds(3, 100, 100)) == 4.0  # D = 3 proposals
    assert estimates.expected_output(8, 1.0, OutputBounds(7, 2, 100)) == 2.0  # two tokens left
    assert estimates.expected_output(8, 1.0, OutputBounds(7, 100, 5)) == 5.0  # five positions left
    assert estimates.expected_output(8, 1.0, OutputBounds(7, 0, 100)) == 0.0


def _exact_expected_tokens(survival, width, bounds):
    """E[min(1 + accepted, W, D + 1, L)] from the accepted-length distribution."""
    limit = min(width, bounds.proposal_depth + 1, bounds.output_remaining, bounds.context_remaining)
    if limit <= 0:
        return 0.0
    tail = list(survival) + [0.0]
    expected, previous = 0.0, 1.0
    for accepted in range(len(survival) + 1):
        probability = previous - tail[accepted]  # P(exactly `accepted` drafts survive)
        expected += probability * min(1 + accepted, limit)
        previous = tail[accepted]
    return expected


@given(
    st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=9),
    st.integers(min_value=0, max_value=8),
    st.integers(min_value=0, max_value=10),
    st.integers(min_value=0, max_value=10),
)
def test_S5_expected_output_is_the_exact_bounded_expectation(draws, width, depth, output_left, context_left):
    survival = []
    for value in draws:  # a valid prefix-survival curve is non-increasing
        survival.append(min(value, survival[-1]) if survival else value)
    estimates = PrefixSurvival()
    estimates.seed(survival, weight=64)
    bounds = OutputBounds(min(depth, len(survival)), output_left, context_left)
    expected = _exact_expected_tokens(survival, width, bounds)
    assert estimates.expected_output(width, 1.0, bounds) == pytest.approx(expected)


def test_S5_crossing_depth_estimates_use_the_running_minimum():
    estimates = PrefixSurvival()
    estimates.seed([0.2, 0.6], weight=8)  # depth 2 above depth 1 cannot be a survival curve
    assert estimates.expected_output(3, 1.0, ROOMY) == pytest.approx(1 + 0.2 + 0.2)


def test_S9_optimistic_bound():
    estimates = PrefixSurvival()
    assert estimates.optimistic(1) == pytest.approx(min(1.0, 0.5 + math.sqrt(math.log(20) / 4)))
    estimates.seed([0.3], weight=128)
    assert estimates.optimistic(1) == pytest.approx(0.3 + math.sqrt(math.log(20) / 256))
    estimates.age(128 * 10)
    assert estimates.optimistic(1) == 1.0  # a forgotten estimate is fully optimistic


def test_bad_rounds_are_rejected():
    with pytest.raises(ValueError, match="accepted=3, offered=2"):
        round_observations(offered=2, accepted=3, terminated=False)
    with pytest.raises(ValueError, match="depth starts at 1"):
        PrefixSurvival().survival(0)


@given(
    st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=8),
    st.integers(min_value=1, max_value=9),
    st.floats(min_value=0.25, max_value=4.0),
    st.integers(min_value=0, max_value=12),
)
def test_S5_all_widths_in_one_pass_agree_with_each_width(means, max_width, alpha, output_left):
    estimates = PrefixSurvival()
    estimates.seed(means, weight=16)
    bounds = OutputBounds(proposal_depth=6, output_remaining=output_left, context_remaining=50)
    by_width = estimates.expected_output_by_width(max_width, alpha, bounds)
    assert len(by_width) == max_width
    for width in range(1, max_width + 1):
        assert by_width[width - 1] == pytest.approx(estimates.expected_output(width, alpha, bounds))


def test_S6_S8_a_completed_round_ages_before_it_observes():
    acceptance = RequestAcceptance()
    acceptance.complete_round("learned", generated_tokens=128, offered=1, accepted=1, terminated=False)
    learned = acceptance.source("learned")
    assert learned.weight(1) == pytest.approx(2.0 / 2 + 1)  # prior halved, then one observation
    assert learned.survival(1) == pytest.approx((1.0 * 0.5 + 1.0) / 2.0)
    acceptance.complete_round(None, generated_tokens=128, offered=0, accepted=0, terminated=False)
    assert learned.weight(1) == pytest.approx(1.0)  # ordinary rounds only age


@pytest.mark.parametrize("generated", [1, 3, 64])
def test_S6_S8_a_plain_round_aged_by_one_factor_leaves_what_completing_it_leaves(generated):
    """``age_by(aging_factor(n))`` (the core's path for a round that offered no drafts) and ``complete``
    of that round leave the same floats in every source, the prior and the forecast."""
    states = [RequestAcceptance(), RequestAcceptance()]
    populations = [PopulationPrior(), PopulationPrior()]  # a forecast round folds into its population too
    for acceptance, population in zip(states, populations):  # the same history: two sources, a forecast
        acceptance.complete_round("learned", generated_tokens=3, offered=3, accepted=2, terminated=False)
        acceptance.complete_round("copy", generated_tokens=1, offered=2, accepted=0, terminated=False)
        acceptance.complete(CompletedRound("learned", 2, offered=2, accepted=1, confidence=((0.9, 0.6),),
                                           ceiling=3), population)
    by_complete, by_factor = states
    unaged = by_factor.prior_weight
    by_complete.complete(CompletedRound(None, generated), populations[0])
    by_factor.age_by(aging_factor(generated))

    def floats(acceptance):
        rows = {name: acceptance.source(name).means_and_weights(4) for name in ("learned", "copy")}
        return acceptance.prior_weight, rows, acceptance.forecast.means_and_weights(4)

    assert by_complete.forecast is not None
    assert floats(by_factor) == floats(by_complete)  # exactly: the same products in the same order
    assert by_factor.prior_weight < unaged  # not vacuous: the round aged them


def test_S8_state_depends_on_history_not_on_what_was_read():
    read, unread = RequestAcceptance(), RequestAcceptance()
    read.source("learned").optimistic(6)  # reading a deep depth and a source stores nothing
    for acceptance in (read, unread):
        acceptance.complete_round("learned", generated_tokens=256, offered=2, accepted=2, terminated=False)
        acceptance.complete_round(None, generated_tokens=128, offered=0, accepted=0, terminated=False)
    for depth in (1, 2, 6):
        assert read.source("learned").weight(depth) == unread.source("learned").weight(depth)
    # the prior of a source or depth first used late has aged with the request: 2 * 0.5**3
    assert read.source("copy").weight(1) == pytest.approx(0.25)
    assert read.source("learned").weight(6) == pytest.approx(0.25)
    assert read.source("learned").survival(6) == 0.5**6


@given(
    st.lists(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5), max_size=6),
    st.integers(0, 300),
    st.booleans(),
    st.integers(0, 9),
)
def test_S6_S8_means_and_weights_read_together_equal_the_separate_reads(rounds, generated, forecasts, depths):
    """Stored depths, aged weights and (population) priors beyond them, read in one pass."""
    population = PopulationPrior() if forecasts else None
    if population is not None:
        population.observe([0.9, 0.7, 0.4])
    estimates = PrefixSurvival(population=population)
    for values in rounds:
        estimates.observe(values)
    estimates.age(generated)
    assert estimates.means_and_weights(depths) == (estimates.means(depths), estimates.weights(depths))


# ---------------------------------------------------------------------------
# Malformed packed-round completions are refused before anything changes (S2, S6, A2)
# ---------------------------------------------------------------------------


def _packed_round(max_tokens=(100, 100)):
    """A measured prefix-limit catalog with one committed round for len(max_tokens) decoding lanes."""
    from sched_harness import MS, Driver, ask, measured, prefill, spec

    from helios.scheduler import ExecutionTiming, ValueSource

    packed = spec(2, 4, aggregate=6, source=ValueSource.PREFIX_LIMIT)
    durations = {prefill(64): 4.0, packed: 5.0}
    s = measured(durations)
    handles = [s.admit(ask(64, n, sources=("learned",))) for n in max_tokens]
    Driver(s, durations).run(len(handles))  # both prompts done
    plan = s.plan()
    assert plan is not None and plan.graph is packed
    s.commit(plan, 10)
    return s, plan, handles, ExecutionTiming(5 * MS, 5 * MS)


def _estimates(s, handles):
    return [s.acceptance_of(h).source("learned").survival(1) for h in handles], s.queued_fences


def _rejected(s, handles, call, match):
    before = _estimates(s, handles)
    with pytest.raises(ValueError, match=match):
        call()
    assert _estimates(s, handles) == before  # nothing changed: the frame is still queued, estimates untouched


def test_S2_A2_a_row_verified_beyond_its_lane_ceiling_is_refused_before_any_change():
    from helios.scheduler import CompletionRecord

    s, plan, (long, short), timing = _packed_round(max_tokens=(100, 3))  # the prefill published one token: room 2
    ceilings = {lane.handle: lane.ceiling for lane in plan.lanes}
    assert ceilings[short] == 2 and ceilings[long] == 4
    beyond = [CompletionRecord(long, tokens=(1,), offered=0), CompletionRecord(short, tokens=(1, 2), offered=2)]
    _rejected(s, (long, short), lambda: s.complete_packed_round(10, beyond, timing, None), "beyond the lane's ceiling 2")
    good = [CompletionRecord(long, tokens=(1,), offered=0), CompletionRecord(short, tokens=(1, 2), offered=1)]
    assert len(s.complete_packed_round(10, good, timing, None)) == 2  # the same fence completes once it is valid


def test_S2_A2_rows_summing_beyond_P_are_refused_before_any_change():
    from helios.scheduler import CompletionRecord

    s, plan, handles, timing = _packed_round()
    records = [CompletionRecord(h, tokens=(1, 2, 3, 4), offered=3) for h in handles]  # 8 rows > P = 6
    _rejected(s, handles, lambda: s.complete_packed_round(10, records, timing, None), "more than P = 6")


@pytest.mark.parametrize("confidence, survival, match", [
    ([(0.5, 0.25, 0.1)], None, "one row per record"),  # one row for two records
    ([(0.5, 0.25, 0.1, 0.05)] * 2, None, "at most D = 3"),
    ([(0.5, 1.5, 0.1)] * 2, None, "probabilities in \\[0, 1\\]"),
    ([(0.5, float("nan"), 0.1)] * 2, None, "probabilities in \\[0, 1\\]"),
    ([(0.5, 0.25, 0.1)] * 2, [(0.9, -0.1), (0.9,)], "probabilities in \\[0, 1\\]"),
    ([(0.5, 0.25, 0.1)] * 2, [(0.9,)], "one row per record"),
])
def test_S6_C12_C13_A2_malformed_sidecars_are_refused_before_any_change(confidence, survival, match):
    from helios.scheduler import CompletionRecord

    s, plan, handles, timing = _packed_round()
    records = [CompletionRecord(h, tokens=(1, 2), offered=2) for h in handles]

    def complete():
        if survival is None:
            return s.complete_packed_round(10, records, timing, confidence)
        return s.complete_packed_round_with_survival(10, records, timing, confidence, survival)

    _rejected(s, handles, complete, match)
    out = s.complete_packed_round_with_survival(10, records, timing, [(0.5, 0.25, 0.1)] * 2, [(0.9, 0.4)] * 2)
    assert [len(t.tokens) for t in out] == [2, 2]
