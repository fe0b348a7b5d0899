"""Confidence forecasts, survival observations, proposal draws: helios/scheduler/speculation.py.

Spec checklist S7, S9, S10, S11, S12 and the forecast ceiling of D8.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helios.scheduler.speculation import (
    CompletedRound,
    PopulationPrior,
    PrefixEstimate,
    ProposalDraws,
    RequestAcceptance,
    forecast_observations,
    rank_zero_confidence,
    survival_observations,
)


def confidence_round(rows, ceiling, generated=1, source="learned", offered=0, accepted=0):
    return CompletedRound(
        source=source,
        generated_tokens=generated,
        offered=offered,
        accepted=accepted,
        confidence=tuple(tuple(r) for r in rows),
        ceiling=ceiling,
    )


# -- S7: the population prior ----------------------------------------------------


def test_S7_population_prior_starts_at_half_to_the_depth():
    prior = PopulationPrior()
    assert [prior.mean(d) for d in (1, 2, 3, 6)] == [0.5, 0.25, 0.125, 0.5**6]


def test_S7_population_prior_moves_one_sixty_fourth_toward_each_completed_probability():
    prior = PopulationPrior()
    prior.observe([1.0, 0.25])
    assert prior.mean(1) == pytest.approx(0.5 + 0.5 / 64)
    assert prior.mean(2) == 0.25  # already there
    assert prior.mean(3) == 0.125  # not observed
    for _ in range(2000):
        prior.observe([0.9])
    assert prior.mean(1) == pytest.approx(0.9, abs=1e-6)


# -- S7: a request's forecast ---------------------------------------------------------


def test_S7_forecast_averages_completed_probabilities_from_the_population_prior():
    population, acceptance = PopulationPrior(), RequestAcceptance()
    acceptance.complete(confidence_round([[0.8, 0.6]], ceiling=3, generated=0), population)
    forecast = acceptance.forecast_estimates(population)
    # weight-2 prior at the population mean, then one observation
    assert forecast.survival(1) == pytest.approx((2 * 0.5 + 0.8) / 3)
    assert forecast.survival(2) == pytest.approx((2 * 0.25 + 0.6) / 3)
    assert forecast.weight(1) == 3.0
    # the population moved after the request took its starting point
    assert population.mean(1) == pytest.approx(0.5 + 0.3 / 64)


def test_S7_an_untrained_request_forecasts_what_the_population_has_learned():
    population = PopulationPrior()
    veteran, newcomer = RequestAcceptance(), RequestAcceptance()
    for _ in range(200):
        veteran.complete(confidence_round([[0.95, 0.9]], ceiling=3, generated=0), population)
    fresh = newcomer.forecast_estimates(population)
    assert fresh.survival(1) == population.mean(1) > 0.9
    assert fresh.weight(1) == 2.0
    assert newcomer.forecast is None  # reading stored nothing (S11)


def test_S7_first_observation_starts_from_the_population_mean_of_that_moment():
    population = PopulationPrior(means=[0.8])
    acceptance = RequestAcceptance()
    acceptance.complete(confidence_round([[0.2]], ceiling=2, generated=0), population)
    assert acceptance.forecast_estimates(population).survival(1) == pytest.approx((2 * 0.8 + 0.2) / 3)
    population.observe([1.0] * 1)
    # the stored depth is the request's own now; the population no longer moves it
    assert acceptance.forecast_estimates(population).survival(1) == pytest.approx((2 * 0.8 + 0.2) / 3)


def test_S8_forecast_weights_cap_and_age_like_acceptance():
    population, acceptance = PopulationPrior(), RequestAcceptance()
    for _ in range(300):
        acceptance.complete(confidence_round([[0.7]], ceiling=2, generated=0), population)
    forecast = acceptance.forecast_estimates(population)
    assert forecast.weight(1) == 128.0
    acceptance.age(128)
    assert forecast.weight(1) == pytest.approx(64.0)
    assert forecast.survival(1) == pytest.approx(0.7, abs=1e-3)  # aging keeps the mean


def test_S8_a_forecast_first_used_late_starts_with_the_aged_prior_weight():
    population, acceptance = PopulationPrior(), RequestAcceptance()
    acceptance.age(256)
    assert acceptance.forecast_estimates(population).weight(1) == pytest.approx(0.5)
    acceptance.complete(confidence_round([[1.0]], ceiling=2, generated=0), population)
    assert acceptance.forecast_estimates(population).weight(1) == pytest.approx(1.5)


def test_D8_S7_forecast_observations_stop_at_the_frozen_lane_ceiling():
    assert forecast_observations([0.9, 0.8, 0.7, 0.6], ceiling=3) == (0.9, 0.8)
    assert forecast_observations([0.9, 0.8], ceiling=1) == ()
    population, acceptance = PopulationPrior(), RequestAcceptance()
    acceptance.complete(confidence_round([[0.9, 0.8, 0.7, 0.6]], ceiling=3, generated=0), population)
    forecast = acceptance.forecast_estimates(population)
    assert forecast.weight(2) == 3.0 and forecast.weight(3) == 2.0
    assert population.mean(3) == 0.125 and population.mean(2) != 0.25
    with pytest.raises(ValueError, match="ceiling"):
        forecast_observations([0.5], ceiling=0)


# -- S11: rank zero, completed rounds only -----------------------------------------------


def test_S11_rank_zero_drives_decisions_and_peers_need_only_be_probabilities():
    rows = [[0.9, 0.5], [0.91, 0.49], [0.1, 0.0]]
    assert rank_zero_confidence(rows) == (0.9, 0.5)
    population, acceptance = PopulationPrior(), RequestAcceptance()
    acceptance.complete(confidence_round(rows, ceiling=3, generated=0), population)
    assert acceptance.forecast_estimates(population).survival(1) == pytest.approx((2 * 0.5 + 0.9) / 3)


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan])
def test_S11_an_invalid_peer_row_is_rejected_before_anything_changes(bad):
    population, acceptance = PopulationPrior(), RequestAcceptance()
    outcome = CompletedRound(
        source="learned",
        generated_tokens=64,
        offered=2,
        accepted=2,
        confidence=((0.9, 0.8), (0.9, bad)),
        ceiling=3,
    )
    with pytest.raises(ValueError, match="rank 1 confidence at depth 2"):
        acceptance.complete(outcome, population)
    assert acceptance.prior_weight == 2.0  # not even aged
    assert acceptance.source("learned").weight(1) == 2.0
    assert population.mean(1) == 0.5 and acceptance.forecast is None


def test_S11_confidence_without_a_rank_row_or_population_is_an_error():
    with pytest.raises(ValueError, match="one row per rank"):
        rank_zero_confidence([])
    with pytest.raises(ValueError, match="PopulationPrior"):
        RequestAcceptance().complete(confidence_round([[0.5]], ceiling=2), None)


def test_S7_forecasts_and_verified_acceptance_are_separate_observations():
    population, acceptance = PopulationPrior(), RequestAcceptance()
    acceptance.complete(confidence_round([[0.1, 0.05]], ceiling=3, generated=3, offered=2, accepted=2), population)
    assert acceptance.source("learned").survival(1) > 0.5  # verified: both accepted
    assert acceptance.forecast_estimates(population).survival(1) < 0.5  # forecast: low confidence


# -- S10: survival observations ---------------------------------------------------------


def test_S10_survival_products_replace_binary_observations_at_the_depths_they_cover():
    assert survival_observations(3, 3, False, (0.9, 0.6)) == (0.9, 0.6, 1.0)
    assert survival_observations(3, 1, False, (0.9, 0.6, 0.3, 0.2)) == (0.9, 0.6, 0.3)
    assert survival_observations(3, 1, False, None) == (1.0, 0.0, 0.0)


def test_S10_survival_never_adds_censored_or_unoffered_depths():
    assert survival_observations(4, 1, True, (0.9, 0.6, 0.3)) == (0.9,)
    assert survival_observations(0, 0, False, (0.9,)) == ()


def test_S10_survival_moves_the_estimates_instead_of_the_binary_outcome():
    binary, graded = RequestAcceptance(), RequestAcceptance()
    binary.complete(CompletedRound("learned", generated_tokens=3, offered=2, accepted=2))
    graded.complete(CompletedRound("learned", generated_tokens=3, offered=2, accepted=2, survival=(0.8, 0.4)))
    aged_prior = 2.0 * 0.5 ** (3 / 128)
    assert binary.source("learned").survival(2) == pytest.approx((aged_prior * 0.25 + 1.0) / (aged_prior + 1))
    assert graded.source("learned").survival(2) == pytest.approx((aged_prior * 0.25 + 0.4) / (aged_prior + 1))


def test_S10_an_invalid_survival_row_is_rejected_before_anything_changes():
    acceptance = RequestAcceptance()
    with pytest.raises(ValueError, match="survival at depth 2"):
        acceptance.complete(CompletedRound("learned", generated_tokens=5, offered=2, accepted=1, survival=(0.5, 1.2)))
    assert acceptance.prior_weight == 2.0 and not acceptance.by_source


def test_S6_complete_matches_complete_round_without_sidecars():
    old, new = RequestAcceptance(), RequestAcceptance()
    for generated, offered, accepted, terminated in [(3, 4, 2, False), (1, 3, 0, False), (2, 4, 1, True)]:
        old.complete_round("copy", generated, offered, accepted, terminated)
        new.complete(CompletedRound("copy", generated, offered, accepted, terminated))
    for depth in range(1, 6):
        assert new.source("copy").survival(depth) == old.source("copy").survival(depth)
        assert new.source("copy").weight(depth) == old.source("copy").weight(depth)


# -- S12: copy proposals draw nothing ---------------------------------------------------------


def test_S12_copy_rounds_add_no_learned_proposal_draws():
    draws = ProposalDraws()
    draws.record("learned", lanes=3, proposal_depth=4)
    draws.record("copy", lanes=4, proposal_depth=7)
    draws.record("copy", lanes=1, proposal_depth=7)
    assert draws.learned_draws == 12
    assert draws.copy_rounds == 2
    with pytest.raises(ValueError, match="unknown proposal source 'mtp'"):
        draws.record("mtp", lanes=1, proposal_depth=1)


# -- S9: the optimistic estimate ----------------------------------------------------------------


@given(st.floats(0.0, 1.0), st.floats(0.01, 128.0), st.floats(0.01, 128.0))
def test_S9_optimistic_estimate_bounds_the_mean_and_shrinks_with_information(mean, w1, w2):
    low, high = sorted((w1, w2))
    less, more = PrefixEstimate(mean, low), PrefixEstimate(mean, high)
    assert mean <= more.optimistic() <= less.optimistic() <= 1.0
    expected = min(1.0, mean + math.sqrt(math.log(20) / (2 * high)))
    assert more.optimistic() == pytest.approx(expected)
