"""``PolicyConfig.acceptance_from_population`` (issue 20, eighth session, 2026-12-04; docs/scheduling-utility.md,
"Departures from the spec"): where the verified acceptance of completed rounds shows drafts that cannot pay
for themselves, a new request's acceptance starts there instead of at the prior 0.5**d."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helios.scheduler import PolicyConfig
from helios.scheduler.speculation import (PopulationPrior, PrefixSurvival, aging_factor, chernoff_upper,
                                         extrapolated_survival, optimistic_survival, prior_survival)
from helios.sim.files import FixedAcceptance, Trace, TraceRequest, load_catalog
from helios.sim.simulator import simulate
from sched_harness import ask, decode, measured, spec

MS = 1_000_000
DEFAULTS = PolicyConfig.preset("balanced")
DECODE, SPEC = decode(1), spec(1, 2)
DURATIONS = {DECODE: 2.58, SPEC: 3.11}  # a first draft pays for itself above 3.11 / 2.58 - 1 = 0.205


def _scheduler(**choices):
    return measured(DURATIONS, policy=replace(DEFAULTS, **choices))


def _first_draft(scheduler) -> float:
    handle = scheduler.admit(ask(sources=("learned",)))
    return scheduler.acceptance_of(handle).source("learned").survival(1)


def test_a_new_request_starts_at_the_population_when_its_drafts_cannot_pay():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(150):
        population.observe((0.0,))  # 150 verified rounds, nothing accepted
    assert population.mean(1) < 3.11 / 2.58 - 1
    assert _first_draft(scheduler) == pytest.approx(population.mean(1))
    off = _scheduler(acceptance_from_population=0)
    for _ in range(150):
        off.acceptance_population["learned"].observe((0.0,))
    assert _first_draft(off) == prior_survival(1)  # the choice off: S8's start at 0.5


def test_where_drafts_pay_a_new_request_keeps_the_prior_to_find_out_its_own():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(150):
        population.observe((0.0,) if _ % 4 else (1.0,))  # a quarter accepted: above the break-even 0.205
    assert 3.11 / 2.58 - 1 < population.mean(1) < prior_survival(1)
    assert _first_draft(scheduler) == prior_survival(1)


def test_a_population_of_a_few_rounds_does_not_close_the_prior_by_chance():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(4):
        population.observe((0.0,))  # four rejected first drafts: the mean reads 1/6, below 0.205
    assert population.mean(1) < 3.11 / 2.58 - 1
    assert _first_draft(scheduler) == prior_survival(1)  # S9's bound still allows that drafts pay


def test_an_admitted_requests_start_does_not_move_with_later_rounds_of_others():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(150):
        population.observe((0.0,))
    handle = scheduler.admit(ask(sources=("learned",)))
    start = scheduler.acceptance_of(handle).source("learned").survival(1)
    for _ in range(100):
        population.observe((0.0,))
    assert scheduler.acceptance_of(handle).source("learned").survival(1) == start  # S8: unobserved means stay
    assert population.mean(1) < start


def _late_speculative_rounds(policy) -> int:
    """Ordinary speculative rounds with a member of the last wave, on requests that accept nothing."""
    catalog = load_catalog("examples/simulation/catalog.yaml")
    waves = [TraceRequest(f"{wave}{i}", (400 * k + i) * MS, 32, 24, FixedAcceptance(0))
             for k, wave in enumerate("abcd") for i in range(8)]  # eight requests every 400 ms
    result = simulate(catalog, Trace(policy, 0, tuple(waves)))
    return sum(1 for plan in result.plans if plan.graph.kind.value == "speculative" and plan.reason == "ordinary"
               and any(member.startswith("d") for member in plan.cohort))


def test_completed_rounds_teach_the_population_so_later_requests_waste_no_drafts():
    off = _late_speculative_rounds(replace(DEFAULTS, acceptance_from_population=0))
    assert off >= 2  # at 0.5 each fresh request's estimate needs a few rejected rounds to fall
    assert _late_speculative_rounds(DEFAULTS) == 0  # the earlier waves' rounds taught the population


# ``PolicyConfig.population_gate_by_evidence`` (issue 20, ninth session, 2026-12-05): the gate reads the
# Chernoff bound at S9's confidence on the rounds alone. After n rejected first drafts and nothing else it is
# 1 - 20**(-1/n) exactly (kl(0, q) = -ln(1 - q)): 0.2058 at n = 13, above the break-even 3.11 / 2.58 - 1 =
# 0.2054, and 0.1926 at n = 14, below it. S9's Hoeffding bound on the prior-including mean needs about 43.
BREAK_EVEN = 3.11 / 2.58 - 1


def test_the_chernoff_bound_after_rejections_alone_is_exact_and_below_hoeffding():
    for n in (1, 4, 13, 14, 43, 64):
        assert chernoff_upper(0.0, n) == pytest.approx(1 - 20 ** (-1 / n), abs=1e-9)
    for mean in (0.0, 0.1, 0.35, 0.5, 0.9):
        for weight in (1.0, 6.0, 30.0, 64.0):
            hoeffding = optimistic_survival(mean, weight)
            assert mean <= chernoff_upper(mean, weight) <= hoeffding + 1e-9  # Pinsker
    assert chernoff_upper(0.3, 0.0) == 1.0


@pytest.mark.parametrize("rejections, opens", [(13, False), (14, True)])
def test_the_gate_opens_on_the_evidence_of_fourteen_rejected_drafts(rejections, opens):
    assert (1 - 20 ** (-1 / 13)) > BREAK_EVEN > (1 - 20 ** (-1 / 14))  # the arithmetic the cases rest on
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(rejections):
        population.observe((0.0,))
    expected = population.mean(1) if opens else prior_survival(1)
    assert _first_draft(scheduler) == pytest.approx(expected)


def test_the_choice_off_keeps_the_hoeffding_bound_on_the_prior_including_mean():
    off = _scheduler(population_gate_by_evidence=0)
    population = off.acceptance_population["learned"]
    for _ in range(14):
        population.observe((0.0,))
    assert population.optimistic(1) > BREAK_EVEN  # mean 1/16 + sqrt(ln 20 / 32) = 0.368
    assert _first_draft(off) == prior_survival(1)


def test_a_chance_run_of_a_population_that_pays_does_not_open_the_gate():
    # spec-low's traced start (true first-draft survival 0.35): four rejections, then one accepted in six
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for value in (0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0):
        population.observe((value,))
    assert population.evidence_bound(1) > BREAK_EVEN  # average 0.1 over 10: the bound reads 0.45
    assert _first_draft(scheduler) == prior_survival(1)


def _speculative_rounds_by_wave(policy) -> dict[str, int]:
    """Ordinary speculative rounds with a member of each wave of eight (every 400 ms, accepting nothing)."""
    catalog = load_catalog("examples/simulation/catalog.yaml")
    waves = [TraceRequest(f"{wave}{i}", (400 * k + i) * MS, 32, 24, FixedAcceptance(0))
             for k, wave in enumerate("abcd") for i in range(8)]
    result = simulate(catalog, Trace(policy, 0, tuple(waves)))
    rounds = [plan for plan in result.plans
              if plan.graph.kind.value == "speculative" and plan.reason == "ordinary"]
    return {wave: sum(1 for plan in rounds if any(member.startswith(wave) for member in plan.cohort))
            for wave in "abcd"}


def test_the_first_waves_rejections_are_evidence_enough_for_the_next_wave():
    # wave a: two rounds of its eight requests, enough rejected first drafts (14) to open the Chernoff gate;
    # S9's form on the prior-including mean needs about 43
    assert _speculative_rounds_by_wave(DEFAULTS) == {"a": 2, "b": 0, "c": 0, "d": 0}
    off = _speculative_rounds_by_wave(replace(DEFAULTS, population_gate_by_evidence=0))
    assert off["a"] == 2 and off["b"] >= 1  # the Hoeffding gate lets wave b waste rounds too


# ``PolicyConfig.population_bounds_probes`` (issue 20, tenth session, 2026-12-05): a request started from the
# population reads, for funded learning (D8), no more optimism at a depth it has not observed than the bound
# the gate read. Before, S9's bound at S8's starting weight 2 added sqrt(ln 20 / 4) = 0.87 to the copied mean,
# so every such request looked as promising to a probe as a fresh one.


def test_a_population_start_reads_the_populations_bound_as_its_optimism_not_s8s_weight_two():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(20):
        population.observe((0.0,))
    bound = population.evidence_bound(1)  # 1 - 20 ** (-1 / 20) = 0.139
    assert bound < BREAK_EVEN
    estimates = scheduler.acceptance_of(scheduler.admit(ask(sources=("learned",)))).source("learned")
    assert estimates.survival(1) == pytest.approx(population.mean(1))  # ordinary selection's mean is 12's start
    assert estimates.optimistic(1) == pytest.approx(bound)
    means, weights = estimates.means_and_weights(3)
    assert optimistic_survival(means[0], weights[0]) == pytest.approx(bound)  # what the probe search reads
    off = _scheduler(population_bounds_probes=0)
    for _ in range(20):
        off.acceptance_population["learned"].observe((0.0,))
    loose = off.acceptance_of(off.admit(ask(sources=("learned",)))).source("learned")
    assert loose.survival(1) == pytest.approx(population.mean(1))
    assert loose.optimistic(1) == pytest.approx(optimistic_survival(population.mean(1), 2.0))  # + 0.87
    assert loose.optimistic(1) > BREAK_EVEN


def test_a_request_on_the_prior_keeps_s9s_optimism():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(4):
        population.observe((0.0,))  # the gate stays shut: no copy, no bound
    estimates = scheduler.acceptance_of(scheduler.admit(ask(sources=("learned",)))).source("learned")
    assert estimates.optimistic(1) == optimistic_survival(prior_survival(1), 2.0)


def _probes_of_a_lone_late_request(policy) -> int:
    """Acceptance probes of one long request arriving alone after a wave that accepted nothing."""
    catalog = load_catalog("examples/simulation/catalog.yaml")
    wave = [TraceRequest(f"a{i}", i * MS, 32, 24, FixedAcceptance(0)) for i in range(8)]
    lone = TraceRequest("z", 300 * MS, 32, 400, FixedAcceptance(0))  # alone long enough to fill D8's credit
    result = simulate(catalog, Trace(policy, 0, (*wave, lone)))
    return sum(1 for plan in result.plans if plan.reason == "acceptance_learning" and "z" in plan.cohort)


def test_a_lone_request_started_from_the_population_is_not_probed_where_drafts_cannot_pay():
    assert _probes_of_a_lone_late_request(DEFAULTS) == 0
    assert _probes_of_a_lone_late_request(replace(DEFAULTS, population_bounds_probes=0)) >= 1


def test_a_population_starts_own_rounds_count_at_s8s_weight_and_lift_the_cap():
    scheduler = _scheduler()
    population = scheduler.acceptance_population["learned"]
    for _ in range(20):
        population.observe((0.0,))
    estimates = scheduler.acceptance_of(scheduler.admit(ask(sources=("learned",)))).source("learned")
    start = estimates.survival(1)
    estimates.observe((1.0,))  # the request's own first draft, accepted
    assert estimates.weight(1) == 3.0  # stored at S8's weight 2, not at the cap's
    assert estimates.survival(1) == pytest.approx(start + (1.0 - start) / 3.0)
    assert estimates.optimistic(1) == pytest.approx(optimistic_survival(estimates.survival(1), 3.0))
    assert estimates.optimistic(1) > population.evidence_bound(1)  # its own evidence, no longer the cap


def test_kept_weights_of_a_population_start_follow_its_estimates_through_plain_rounds(monkeypatch):
    """A plain round only ages a request's weights, and the core ages its kept weights instead of
    recomputing them (``PrefixSurvival.aged_weights``); an unobserved depth of a bounded population start
    reads the larger of the aged prior weight and a fixed one, so scaling alone would be wrong there: the
    kept means and weights always equal the estimates' own, before every decision of the lone request's run."""
    from helios.scheduler.core import Scheduler

    checked = {"bounded": 0}
    real = Scheduler._observe_acceptance

    def observe(self, state, lane, graph, record, sidecar):
        real(self, state, lane, graph, record, sidecar)
        for source, (means, weights) in state.estimates.items():
            estimates = state.acceptance.by_source[source]
            own_means, own_weights = estimates.means_and_weights(self._max_depth)
            assert weights == own_weights  # exactly: the probe search reads S9's bound from them
            assert means == extrapolated_survival(own_means, len(estimates.depths))
        checked["bounded"] += any(start.bounds for start in state.acceptance.starts.values())  # a bounded start

    monkeypatch.setattr(Scheduler, "_observe_acceptance", observe)
    _probes_of_a_lone_late_request(DEFAULTS)
    assert checked["bounded"] > 100  # the lone request's plain rounds, each checked


@pytest.mark.parametrize("bounds", [(), (0.3, 0.2), (0.3, 0.2, 0.1, 0.05, 0.02)])
def test_aged_weights_are_the_weights_read_again_after_aging(bounds):
    """``aged_weights`` from the weights read before a plain round equals reading them after it, exactly,
    for stored depths, unobserved ones, and unobserved ones a bounded start holds at a fixed weight."""
    estimates = PrefixSurvival(population=PopulationPrior(means=[0.2, 0.1, 0.04], bounds=list(bounds)))
    estimates.observe((1.0,))  # depth 1 stored; depths 2.. unobserved
    for tokens in (1, 1, 3, 40, 200, 1):
        _, before = estimates.means_and_weights(6)
        estimates.age(tokens)
        _, after = estimates.means_and_weights(6)
        assert estimates.aged_weights(before, aging_factor(tokens)) == after


def test_a_bounded_weight_follows_the_means_it_was_read_from():
    """``PopulationPrior.bounded_weight`` is read once per depth, and read again once an observation moves the
    means (a prior that is observed is never served stale)."""
    from helios.scheduler.speculation import bounded_weight

    prior = PopulationPrior(means=[0.2, 0.1], bounds=[0.3, 0.2])
    assert prior.bounded_weight(1) == bounded_weight(0.2, 0.3)
    prior.observe((0.25,))
    assert prior.mean(1) != 0.2
    assert prior.bounded_weight(1) == bounded_weight(prior.mean(1), 0.3)
    assert prior.bounded_weight(2) == bounded_weight(0.1, 0.2)
