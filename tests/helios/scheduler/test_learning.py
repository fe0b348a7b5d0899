"""Acceptance probes: helios/scheduler/learning.py (spec checklist D8, S9)."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler.learning import (
    ProbeCandidate,
    ProbeLane,
    WidthProgram,
    choose_exploration,
    rank_probes,
)
from helios.scheduler.refresh import ExplorationAccounts, StaleAlternative
from helios.scheduler.speculation import PrefixSurvival
from helios.scheduler.types import ExecutionTiming, SelectionReason
from tests.helios.scheduler.reference import best_lane_probe, best_probe, probe_candidates

MS = 1_000_000
BONUS = math.sqrt(math.log(20) / 256)  # S9's optimism at the capped weight 128
EXAMPLES = 60 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 300


def program(width: int, depth: int, ms: float, batch: int = 1, key: str | None = None) -> WidthProgram:
    return WidthProgram(key or f"w{width}d{depth}b{batch}", width, depth, round(ms * MS), batch * width, batch)


W1 = program(1, 0, 10)
W2 = program(2, 1, 13)
W3 = program(3, 2, 14)
W5 = program(5, 4, 20)
LADDER = (W1, W2, W3, W5)
LOW_MEANS = (0.1, 0.05, 0.02, 0.01)


def lane(weights, means=LOW_MEANS, ordinary=W1, remaining=100, **options) -> ProbeLane:
    return ProbeLane(tuple(means), tuple(weights), remaining, ordinary, **options)


def test_D8_S9_well_informed_low_acceptance_is_not_probed():
    # under the means, plain decode wins; even with S9's small optimism at weight 128, no wider round does:
    assert (1 + 0.1 + BONUS) / 13 < 1 / 10
    assert (1 + (0.1 + BONUS) + (0.05 + BONUS)) / 14 < 1 / 10
    assert probe_candidates(lane([128.0] * 4), LADDER) == []


def test_D8_S9_forgotten_estimates_are_probed_best_gain_per_time_first():
    # aged weights make every added depth fully optimistic (survival 1)
    candidates = probe_candidates(lane([0.5] * 4), LADDER)
    ordinary_rate = 1 / 10
    gains = {W2.key: (2 / 13 - ordinary_rate) / 13, W3.key: (3 / 14 - ordinary_rate) / 14, W5.key: (5 / 20 - ordinary_rate) / 20}
    assert [c.program.key for c in candidates] == sorted(gains, key=gains.get, reverse=True)
    for c in candidates:
        assert c.gain_per_ms == pytest.approx(gains[c.program.key])
        assert c.ordinary_depth == 0


def test_D8_a_probe_offers_at_least_one_depth_beyond_the_ordinary_choice():
    same_depth = program(4, 2, 15, key="wider-but-same-D")
    # offered depths keep their means (0.9, 0.8); the added ones are optimistic, under the envelope
    high = (0.9, 0.8, 0.3, 0.2)
    assert (1 + 0.9 + 0.8 + 0.8 + 0.8) / 20 > (1 + 0.9 + 0.8) / 14
    candidates = probe_candidates(lane([0.5] * 4, means=high, ordinary=W3), (W1, W2, same_depth, W5))
    assert [c.program.key for c in candidates] == [W5.key]
    assert candidates[0].offered_depth == 4 and candidates[0].ordinary_depth == 2


def test_D8_depths_the_ordinary_choice_offers_keep_their_means():
    # depth 1 is barely informed but ordinary already offers it: only depth 2 gets optimism,
    # and the envelope keeps it below depth 1's mean, so W3 cannot look better than W2
    probe_lane = lane([0.01, 128.0], means=(0.2, 0.2), ordinary=program(2, 1, 12))
    assert probe_candidates(probe_lane, (program(3, 2, 14),)) == []


def test_D8_a_probe_leaves_output_to_use_what_it_learns():
    roomy = probe_candidates(lane([0.5] * 4, remaining=6), LADDER)
    assert W5.key in [c.program.key for c in roomy]  # 4 drafts + bonus = 5 tokens, 1 left
    tight = probe_candidates(lane([0.5] * 4, remaining=5), LADDER)
    assert W5.key not in [c.program.key for c in tight]
    assert [c.program.key for c in probe_candidates(lane([0.5] * 4, remaining=3), LADDER)] == [W2.key]
    assert probe_candidates(lane([0.5] * 4, remaining=2), LADDER) == []


def test_D8_a_probe_must_beat_the_ordinary_choice_under_optimism():
    slow = program(5, 4, 60, key="slow")  # even 5 sure tokens in 60 ms lose to 1 token in 10 ms
    assert probe_candidates(lane([0.5] * 4), (slow,)) == []


def test_D8_fixed_width_execution_never_probes():
    assert probe_candidates(lane([0.5] * 4, fixed_width=True), LADDER) == []
    assert best_probe([lane([0.5] * 4, fixed_width=True)], LADDER) is None


def test_D8_equal_gains_prefer_the_least_informed_added_prefix():
    # both lanes are fully optimistic (weights 0.3 and 0.6 both give survival 1): equal gains
    informed, uninformed = lane([0.6] * 4), lane([0.3] * 4)
    choice = best_probe([informed, uninformed], LADDER)
    assert choice.lane is uninformed and choice.added_weight == 0.3


def test_D8_then_shorter_execution_then_smaller_geometry():
    base = lane([0.5] * 4)

    def candidate(prog, gain=1.0, weight=0.5):
        return ProbeCandidate(base, prog, 0, 1, 2.0, 1.0, gain, weight)

    short, long_ = program(2, 1, 12, key="short"), program(2, 1, 13, key="long")
    small, big = program(2, 1, 12, batch=2, key="small"), program(2, 1, 12, batch=4, key="big")
    ranked = rank_probes([candidate(big), candidate(long_), candidate(small), candidate(short, gain=0.5)])
    assert [c.program.key for c in ranked] == ["small", "big", "long", "short"]
    ranked = rank_probes([candidate(short), candidate(long_, weight=0.1)])
    assert [c.program.key for c in ranked] == ["long", "short"]  # information before duration


def test_D8_the_added_prefix_is_as_informed_as_its_least_informed_depth():
    weights = (0.5, 0.2, 0.4, 0.3)  # all small enough for full optimism
    added = {c.program.key: c.added_weight for c in probe_candidates(lane(weights), LADDER)}
    assert added == {W2.key: 0.5, W3.key: 0.2, W5.key: 0.2}


def test_D8_token_value_makes_gains_comparable_across_lanes():
    cheap, dear = lane([0.5] * 4, token_value=1.0), lane([0.5] * 4, token_value=3.0)
    assert best_probe([cheap, dear], LADDER).lane is dear


def test_D8_alpha_discounts_optimistic_survival_like_ordinary_selection():
    # at alpha 2 an added depth at optimistic 0.6 counts 0.36
    probe_lane = lane([128.0, 128.0], means=(0.6 - BONUS, 0.0), ordinary=W1, alpha=2.0)
    (only,) = probe_candidates(probe_lane, (program(2, 1, 11),))
    assert only.optimistic_rate == pytest.approx((1 + 0.36) / 11)


def test_lane_from_estimates_and_bad_input():
    estimates = PrefixSurvival()
    estimates.seed([0.9, 0.7], weight=8.0)
    built = ProbeLane.from_estimates(estimates, 3, remaining_output=50, ordinary=W1)
    assert built.means == (0.9, 0.7, 0.125) and built.weights == (8.0, 8.0, 2.0)
    with pytest.raises(ValueError, match="offers depth 4; the lane has estimates for 3"):
        probe_candidates(built, (W5,))
    with pytest.raises(ValueError, match="measured programs"):
        program(2, 1, 0)
    with pytest.raises(ValueError, match="one weight per mean"):
        ProbeLane((0.5,), (), 10, W1)
    graph = GraphDescriptor("spec-b2-w3", GraphKind.SPECULATIVE, batch_capacity=2, proposal_depth=2, width=3)
    assert WidthProgram.of(graph, 7 * MS) == WidthProgram("spec-b2-w3", 3, 2, 7 * MS, 6, 2)


lanes = st.builds(
    lambda means, weights, remaining, ordinary: (means, weights[: len(means)], remaining, ordinary),
    st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
    st.lists(st.floats(0.0, 128.0), min_size=4, max_size=4),
    st.integers(0, 12),
    st.sampled_from(LADDER),
)
durations = st.lists(st.integers(1, 40), min_size=4, max_size=4)


@settings(max_examples=EXAMPLES, deadline=None)
@given(lanes, durations, st.floats(0.05, 1.0))
def test_D8_S9_every_candidate_qualifies_and_less_information_never_removes_one(spec, ms, shrink):
    means, weights, remaining, ordinary = spec
    ladder = [program(p.width, p.proposal_depth, t) for p, t in zip(LADDER, ms)]
    ordinary = next(p for p in ladder if p.width == ordinary.width)
    probe_lane = ProbeLane(tuple(means), tuple(weights), remaining, ordinary)
    found = probe_candidates(probe_lane, ladder)
    ordinary_depth = max(0, min(ordinary.width - 1, ordinary.proposal_depth, remaining - 1))
    for c in found:
        assert c.offered_depth > ordinary_depth
        assert remaining > c.offered_depth + 1
        assert c.optimistic_rate > c.ordinary_rate
    assert [c.gain_per_ms for c in found] == sorted((c.gain_per_ms for c in found), reverse=True)
    forgetful = ProbeLane(tuple(means), tuple(w * shrink for w in weights), remaining, ordinary)
    assert {c.program.key for c in found} <= {c.program.key for c in probe_candidates(forgetful, ladder)}



@settings(max_examples=EXAMPLES, deadline=None)
@given(lanes, st.lists(st.integers(1, 6), min_size=4, max_size=4), st.floats(0.1, 3.0))
def test_D8_best_lane_probe_is_the_ranking_head_ties_included(spec, ms, token_value):
    """Durations from a small set make equal rank keys common: the first of them (catalog order) must win."""
    means, weights, remaining, ordinary = spec
    ladder = [program(p.width, p.proposal_depth, t) for p, t in zip(LADDER, ms)]
    twins = [program(p.width, p.proposal_depth, p.duration_ns / MS, key=f"twin-{p.key}") for p in ladder]
    probe_lane = ProbeLane(tuple(means), tuple(weights), remaining, ordinary, token_value=token_value)
    programs = [p for pair in zip(ladder, twins) for p in pair]
    ranked = probe_candidates(probe_lane, programs)
    best = best_lane_probe(probe_lane, programs)
    assert best == (ranked[0] if ranked else None)
    if best is not None:
        assert not best.program.key.startswith("twin-")  # the twin ties it and comes later

# -- refresh first, then probes (D7, D8) -------------------------------------------------


def _accounts(ordinary_ms: int):
    accounts = ExplorationAccounts()
    for _ in range(ordinary_ms // 5):
        accounts.record(SelectionReason.ORDINARY, ExecutionTiming(5 * MS, 5 * MS), queued=True)
    return accounts


def test_D8_timing_refresh_takes_precedence_over_a_probe():
    stale = [StaleAlternative("decode-b4", 0, None, 1.0)]
    probes = probe_candidates(lane([0.5] * 4), LADDER)
    both = choose_exploration(_accounts(2500), stale, probes)
    assert both.reason is SelectionReason.TIMING_REFRESH and both.choice.key == "decode-b4"
    nothing_stale = choose_exploration(_accounts(2500), [], probes)
    assert nothing_stale.reason is SelectionReason.ACCEPTANCE_LEARNING and nothing_stale.choice is probes[0]
    only_probe_funded = choose_exploration(_accounts(500), stale, probes)
    assert only_probe_funded.reason is SelectionReason.ACCEPTANCE_LEARNING
    assert choose_exploration(_accounts(490), stale, probes) is None


def test_D8_no_exploration_while_an_episode_is_in_flight():
    accounts = _accounts(3000)
    accounts.begin(SelectionReason.ACCEPTANCE_LEARNING)
    assert choose_exploration(accounts, [], probe_candidates(lane([0.5] * 4), LADDER)) is None
