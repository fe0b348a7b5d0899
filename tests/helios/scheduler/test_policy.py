"""Selection policy: the spec's V1 scenarios on measured synthetic catalogs, and the U/D/S rules.

Scenario catalogs are synthetic: durations in ms, fed once at t=0 through the
normal cost path (a "measured" catalog, spec V1).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from sched_harness import MS, Driver, ask, decode, measured, mixed, prefill, spec

from helios.scheduler import GraphKind, LanePhase, PolicyConfig, RequestHandle, SelectionReason, ValueSource
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Decoders, Population, Prompters
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.utility import decision_log_scale, prompt_chunk_value, value_rate
from tests.helios.scheduler.reference import scaled_rate

PREFILLS = {prefill(c): 2.0 + c * 0.008 for c in (64, 256, 1024, 4096)}
DECODES = {decode(b): 3.0 + 0.1 * b for b in (1, 2, 4, 8, 16)}
CATALOG = {**PREFILLS, **DECODES}
P64, P256, P1024, P4096 = PREFILLS
D1, D2, D4, D8, D16 = DECODES


# ---------------------------------------------------------------------------
# Direct populations for rule-level tests
# ---------------------------------------------------------------------------


def h(slot: int) -> RequestHandle:
    return RequestHandle(slot, slot + 1)


def decoders(values, *, room=100, survival=None, slope=0.0, recency=None) -> Decoders:
    d = Decoders()
    for i, v in enumerate(values):
        d.handle.append(h(i))
        d.token_price.append(v)
        d.delivery_price.append(0.0)
        d.age_credit.append(0.0)
        d.age_slope.append(slope)
        d.room.append(room)
        d.survival.append(survival[i] if survival else {})
        d.recency.append(recency[i] if recency else 0)
    return d


def prompters(remaining, *, price=1.0, first_token=0.0, endpoints=None, base_slot=50) -> Prompters:
    p = Prompters()
    for i, r in enumerate(remaining):
        p.handle.append(h(base_slot + i))
        p.start.append(0)
        p.remaining.append(r)
        p.to_endpoint.append(endpoints[i] if endpoints else r)
        p.price.append(price)
        p.first_token.append(first_token)
        p.recency.append(0)
    return p


def timing(ms: float | None, fresh: bool = True) -> GraphTiming:
    return GraphTiming(int(ms * MS) if ms else 0, fresh)


def choose(graphs_ms: dict, dec=None, prm=None, active=0.0, alpha=1.0) -> Choice | None:
    graphs = list(graphs_ms)
    population = Population(dec or Decoders(), prm or Prompters(), active, alpha)
    return select(graphs, [timing(graphs_ms[g]) for g in graphs], population)


# ---------------------------------------------------------------------------
# U6, U7, U14: the objective and its scaling
# ---------------------------------------------------------------------------


def test_U6_objective_matches_the_formula():
    # two served decoders worth 10 each with c*sigma = 0.5 and ages 4 ms, three active decoders (c = 0.1)
    served = 2 * 10 + 2 * 0.5 * 4 + 2 * 0.5 * 8  # priced service + c*sigma*(A + T), T = 8 ms
    assert value_rate(served, 8.0, 0.3) == pytest.approx(served / 8 - 8 / 2 * 0.3)
    dec = decoders([10.0, 10.0, 1.0], slope=0.5)
    dec.age_credit[:] = [2.0, 2.0, 2.0]
    choice = choose({D2: 8.0}, dec, active=0.3)
    assert choice.score == pytest.approx(served / 8 - 4 * 0.3)


M64, M1024 = mixed(2, 64), mixed(2, 1024)


@pytest.mark.parametrize("name, fast, slow, dec, prm, active", [
    # sixteen unit decoders: one lane in 1 ms (rate 1) or all sixteen in 10 ms (rate 1.6)
    ("decode", (D1, 1.0), (D16, 10.0), lambda: decoders([1.0] * 16), lambda: None, 0.2),
    # the same with per-lane age slopes that differ (each program ranks its own lanes)
    ("decode, unequal slopes", (D1, 1.0), (D16, 10.0),
     lambda: _with_slopes(decoders([1.0] * 16), [0.0, 0.001] * 8), lambda: None, 0.2),
    # a 1024-token prompt: 64 tokens in 1 ms (rate 64) or all of it in 10 ms (rate 102.4)
    ("prefill", (P64, 1.0), (P1024, 10.0), lambda: None, lambda: prompters([1024]), 10.0),
    # the same prompt row beside one unit decoder, in mixed programs
    ("mixed", (M64, 1.0), (M1024, 10.0), lambda: decoders([1.0]), lambda: prompters([1024]), 10.0),
])
def test_U6_waiting_cost_of_active_decoders_sends_the_decision_to_the_shorter_program(
        name, fast, slow, dec, prm, active):
    """U6 charges T/2 * sum(c) for every active decoder, served or not: a long program makes
    them all wait. Without that term the slow program has the higher rate and wins; with it
    the short one does, and each score is value / T - T/2 * sum(c) exactly."""
    (fast_graph, fast_ms), (slow_graph, slow_ms) = fast, slow
    graphs = {fast_graph: fast_ms, slow_graph: slow_ms}
    free = choose(graphs, dec(), prm(), active=0.0)
    assert free.graph is slow_graph  # no waiting cost: the higher value rate
    charged = choose(graphs, dec(), prm(), active=active)
    assert charged.graph is fast_graph
    for graph, ms in graphs.items():
        alone_free = choose({graph: ms}, dec(), prm(), active=0.0)
        alone = choose({graph: ms}, dec(), prm(), active=active)
        assert alone.score == pytest.approx(alone_free.score - ms / 2 * active)


def _with_slopes(d: Decoders, slopes) -> Decoders:
    d.age_slope[:] = slopes
    return d


def _plan_score(plan) -> float:
    """The plan's objective before the decision's common scaling (U7)."""
    return plan.scaled_value_rate / math.exp(plan.log_scale)


def _served_value(plan, population: Population) -> float:
    """U6's numerator for ``plan``'s lanes, from the prices the scheduler put in ``population``."""
    t_ms = plan.estimated_duration_ns / MS
    d, p = population.decoders, population.prompters
    total = 0.0
    for lane in plan.lanes:
        if lane.phase is LanePhase.PROMPT:
            i = p.handle.index(lane.handle)  # a chunk's value: docs/scheduling-utility.md, "Departures"
            total += prompt_chunk_value(lane.prompt_tokens, p.remaining[i], p.price[i], p.first_token[i], p.times)
        else:
            i = d.handle.index(lane.handle)
            total += (lane.expected_tokens * d.token_price[i] + d.delivery_price[i]
                      + d.age_credit[i] + d.age_slope[i] * t_ms)
    return total


def test_U6_U14_the_scheduler_charges_every_active_decoder_and_no_prompter():
    """Three decoders and D1, which serves one of them: the plan still pays T/2 * c for all
    three (U6). A fourth request that is still prefilling adds no waiting cost (U14): its
    prefill plan pays for the same three decoders, not four."""
    c = PolicyConfig().decode_age_price
    durations = {P64: 4.0, D1: 3.0}
    s = measured(durations)
    driver = Driver(s, durations)
    streams = [driver.admit(ask(64, 500)) for _ in range(3)]
    while any(s.request_view(h).phase is LanePhase.PROMPT for h in streams):
        driver.step()
    assert not driver.queue
    for late_prompt in (False, True):
        if late_prompt:
            driver.admit(ask(64, 500))
        plan = s.plan()
        assert plan.graph is (P64 if late_prompt else D1) and len(plan.lanes) == 1
        population = s._population(s.now_ns, s._timings())
        t_ms = plan.estimated_duration_ns / MS
        expected = _served_value(plan, population) / t_ms - t_ms / 2 * (3 * c)
        assert _plan_score(plan) == pytest.approx(expected, rel=1e-12)


def test_U7_common_scale_factor_and_invariance():
    small = choose({D1: 3.0, D2: 3.5}, decoders([1.0, 2.0, 3.0]))
    big = choose({D1: 3.0, D2: 3.5}, decoders([1e200, 2e200, 3e200]))
    assert small.graph is big.graph and [l.handle for l in small.lanes] == [l.handle for l in big.lanes]
    for c in (small, big):
        scaled = scaled_rate(c)
        assert 0.25 <= abs(scaled) <= 1.0  # within a factor of two of one after scaling
        assert scaled == pytest.approx(c.score * math.exp(c.log_scale))


def test_U7_scale_comes_from_the_winning_score_alone():
    """The factor brings the winner's score near one; programs that lose (here a slow one
    whose waiting cost gives the largest magnitude of the decision) leave it unchanged, so
    programs skipped without a score cannot change it either."""
    dec, active = decoders([1.0, 1.0]), 0.5
    alone = choose({D1: 3.0}, dec, active=active)
    with_loser = choose({D1: 3.0, D2: 4000.0}, dec, active=active)
    loser = choose({D2: 4000.0}, dec, active=active)
    assert with_loser.graph is D1 and loser.score < -abs(alone.score) * 4  # the loser is far larger in magnitude
    assert with_loser.log_scale == alone.log_scale == decision_log_scale(abs(alone.score))
    assert 0.5 <= abs(scaled_rate(with_loser)) < 1.0 + 1e-12


def test_U14_no_decoder_no_age_term_and_largest_full_prefill_wins():
    s = measured(CATALOG)
    s.admit(ask(8192, 10))
    plan = s.plan()
    assert plan.graph is P4096  # highest tokens per ms of the prefill family
    choice = choose({P4096: 34.768}, prm=prompters([8192]))
    assert choice.score == pytest.approx(4096 / 34.768)  # value / T exactly


def test_U14_prompts_alone_pay_no_waiting_cost_in_the_scheduler():
    """Two long prompts and no decoder: the scheduler's prefill plan scores value / T exactly,
    with no age term, however many requests are waiting for their prompts (U14)."""
    s = measured(CATALOG)
    for _ in range(2):
        s.admit(ask(8192, 10))
    plan = s.plan()
    assert plan.graph is P4096 and len(plan.lanes) == 1
    population = s._population(s.now_ns, s._timings())
    assert len(population.decoders) == 0 and len(population.prompters) == 2
    t_ms = plan.estimated_duration_ns / MS
    assert _plan_score(plan) == pytest.approx(_served_value(plan, population) / t_ms, rel=1e-12)


# ---------------------------------------------------------------------------
# U8: unknown beats known, and the tie order
# ---------------------------------------------------------------------------


def test_U8_unknown_beats_known_with_an_optimistic_finite_score():
    graphs = {D1: 1.0, D2: None}
    choice = choose(graphs, decoders([5.0, 1.0]))
    assert choice.graph is D2 and choice.reason is SelectionReason.DISCOVERY
    assert choice.score == pytest.approx(6.0) and math.isfinite(choice.score)


def test_U8_unknown_beats_known_even_when_its_optimistic_score_is_lower():
    """The rule itself, not the size of the scores, must decide: the measured D1 earns 5 value
    in 0.1 ms (a rate of 50), far above the unmeasured D2's optimistic work score of 6, and the
    unmeasured program still wins. Under score-only ranking D1 would win."""
    dec = decoders([5.0, 1.0])
    known_alone = choose({D1: 0.1}, dec)
    unknown_alone = choose({D2: None}, dec)
    assert known_alone.score == pytest.approx(50.0) and unknown_alone.score == pytest.approx(6.0)
    assert known_alone.score > unknown_alone.score  # on scores alone the measured program wins
    for order in ({D1: 0.1, D2: None}, {D2: None, D1: 0.1}):  # catalog order does not decide it
        choice = choose(order, dec)
        assert choice.graph is D2 and choice.reason is SelectionReason.DISCOVERY
        assert choice.score == pytest.approx(6.0)


def test_U8_ties_prefer_shorter_known_time():
    fast = choose({D2: 3.0, D1: 1.5}, decoders([4.0, 4.0]))  # one lane in half the time: equal rate
    assert fast.graph is D1


def test_U8_ties_prefer_more_served_requests():
    # same time and value: D4 also carries a zero-value lane, so it serves more requests
    choice = choose({D4: 4.0, D2: 4.0}, decoders([3.0, 3.0, 0.0]))
    assert choice.graph is D4 and len(choice.lanes) == 3


def test_U8_ties_prefer_less_recently_used_requests():
    dec = decoders([2.0, 2.0], recency=[50, 10])
    assert choose({D1: 3.0}, dec).lanes[0].handle == h(1)
    dec = decoders([2.0, 2.0], recency=[10, 50])
    assert choose({D1: 3.0}, dec).lanes[0].handle == h(0)


def test_U8_ties_prefer_smaller_physical_padding():
    # equal value, time, served count and recency; neither shape dominates the other
    wide, tall = prefill(112, batch=2), prefill(240)  # padding 124 vs 140 tokens for a 100-token prompt
    assert choose({tall: 5.0, wide: 5.0}, prm=prompters([100])).graph == wide
    wide, tall = prefill(128, batch=2), prefill(192)  # padding 156 vs 92
    assert choose({wide: 5.0, tall: 5.0}, prm=prompters([100])).graph == tall


# ---------------------------------------------------------------------------
# U9, U12: every capacity competes; padding is pruned, never preferred
# ---------------------------------------------------------------------------


def test_V1_U12_padded_batch_capacities_batch4_serving3_beats_batch2_and_unknown_batch8_is_pruned():
    d8 = decode(8)
    graphs = {D2: 3.0, D4: 3.2, d8: None}
    choice = choose(graphs, decoders([5.0, 5.0, 5.0]))
    assert choice.graph is D4 and len(choice.lanes) == 3  # unknown D8 does the same work with more padding
    assert choose({D2: 3.0, d8: None}, decoders([5.0, 5.0, 5.0])).graph is d8  # no narrower equal-work shape


def test_U12_batch4_serving3_competes_with_batch2_serving2():
    dec = decoders([5.0, 5.0, 5.0])
    assert choose({D2: 3.0, D4: 6.0}, dec).graph is D2  # 10/3 > 15/6
    assert choose({D2: 3.0, D4: 4.0}, dec).graph is D4  # 15/4 > 10/3


def test_U9_sorted_cohort_takes_the_highest_lane_values():
    choice = choose({D2: 3.0}, decoders([1.0, 9.0, 4.0, 7.0]))
    assert {l.handle for l in choice.lanes} == {h(1), h(3)}


# ---------------------------------------------------------------------------
# U13, D4: prefill capacities compete by the tokens they can consume
# ---------------------------------------------------------------------------


def test_U13_large_graph_on_a_short_tail_earns_only_the_tail():
    choice = choose({P4096: 34.768}, prm=prompters([64]))
    assert choice.score == pytest.approx(64 / 34.768)
    assert choice.lanes[0].prompt_tokens == 64 and choice.lanes[0].finishes_prompt


def test_V1_fitting_tail_uses_the_graph_that_fits_and_padded_tail_never_a_larger_one():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    a = d.admit(ask(4096 + 64, 5))
    d.run(2)
    # the 64 tokens beyond a full chunk fit P64 exactly; they run first, so that the chunk finishing
    # the prompt is the large one (docs/scheduling-utility.md, "Departures from the spec", 2)
    assert [e.plan.graph for e in d.executed] == [P64, P4096]
    assert [e.plan.lanes[0].prompt_tokens for e in d.executed] == [64, 4096]
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    d.admit(ask(4096 + 100, 5))
    d.run(3)
    prefills = [e.plan for e in d.executed if e.plan.graph.kind is GraphKind.PREFILL]
    # the 100 tokens beyond a full chunk cost one P256 (a P1024 or a second P4096 would only add
    # padding, U12), whichever of the two chunks holds the odd tokens
    assert sorted(p.graph.id for p in prefills) == sorted([P256.id, P4096.id])
    assert sum(p.lanes[0].prompt_tokens for p in prefills) == 4096 + 100


def test_D4_unmeasured_larger_prefill_skipped_when_a_smaller_one_reaches_the_endpoint():
    graphs = {P64: 2.5, P4096: None}
    near = choose(graphs, prm=prompters([1000], endpoints=[60]))
    assert near.graph is P64  # 64 tokens reach the endpoint; the cold 4096 is not explored
    far = choose(graphs, prm=prompters([1000], endpoints=[1000]))
    assert far.graph is P4096 and far.reason is SelectionReason.DISCOVERY


# ---------------------------------------------------------------------------
# V1 scenarios through the real Scheduler
# ---------------------------------------------------------------------------


def test_V1_one_long_prefill_runs_full_chunks_then_decodes():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    a = d.admit(ask(3 * 4096, 20))
    d.run(40)
    kinds = [e.plan.graph for e in d.executed]
    assert kinds[:3] == [P4096] * 3
    assert d.produced(a) == 20 and a in d.finished


def test_V1_two_long_prefills_use_full_graphs_until_a_decoder_exists():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    hs = [d.admit(ask(2 * 4096, 30)) for _ in range(2)]
    d.run(200)
    first_decoder = min(d.bursts[x][0][0] for x in hs)
    early = [e for e in d.executed if e.end_ms <= first_decoder]
    assert early and all(e.plan.graph is P4096 for e in early)
    assert all(d.produced(x) == 30 for x in hs)


def test_V1_sixteen_long_prefills_all_reach_output():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    hs = [d.admit(ask(4096 + 37, 8)) for _ in range(16)]
    d.run(2000)
    assert all(x in d.finished for x in hs)
    prefill_plans = [e.plan for e in d.executed if e.plan.graph.kind is GraphKind.PREFILL]
    # each prompt in the least prefill time: one P64 and one P4096 (64 + 4069 or 4096 + 37 tokens alike)
    assert sorted(p.graph.id for p in prefill_plans) == sorted([P64.id, P4096.id] * 16)
    assert all(len(p.lanes) == 1 for p in prefill_plans)


def test_V1_heterogeneous_cohort_serves_the_starved_request_first():
    s = measured({P64: 2.5, D1: 3.0})
    d = Driver(s, {P64: 2.5, D1: 3.0})
    hs = [d.admit(ask(64, 200)) for _ in range(3)]
    d.run(60)
    counts = [d.produced(x) for x in hs]
    assert max(counts) - min(counts) <= 2  # one row: fairness prices rotate it among all three


def test_V1_long_decode_pair_progresses_evenly():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    a, b = d.admit(ask(64, 1000)), d.admit(ask(64, 1000))
    d.run(300)
    assert abs(d.produced(a) - d.produced(b)) <= 1
    assert all(e.plan.graph is D2 for e in d.executed[2:])  # both ride one batch-2 round


def test_V1_prefill_decode_contention_decoders_keep_output_flowing():
    gaps = {}
    for name in ("balanced", "throughput"):
        s = measured(CATALOG, policy=PolicyConfig.preset(name))
        d = Driver(s, CATALOG)
        hs = [d.admit(ask(64, 400)) for _ in range(4)]
        d.run(10)
        big = d.admit(ask(16000, 10))
        d.run(150)
        assert big in d.bursts  # the long prompt is not starved either
        gaps[name] = max(max(d.output_gaps(x)) for x in hs)
    assert gaps["balanced"] < gaps["throughput"]  # the decode-age term interleaves decode rounds
    assert gaps["balanced"] < 80.0


def test_V1_output_gaps_stay_bounded_with_many_streams():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    hs = [d.admit(ask(64, 300)) for _ in range(12)]
    d.run(200)
    longest_round = max(CATALOG.values())
    for x in hs:
        assert max(d.output_gaps(x)) <= 4 * longest_round


def test_V1_graph_expiry_and_recovery():
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    a = d.admit(ask(64, 20))
    d.run(30)
    d.idle_until(d.now_ns / MS + 31_000)  # every estimate goes stale
    b = d.admit(ask(64, 20))
    plan = s.plan()
    assert plan.requires_feedback and plan.estimated_duration_ns > 0  # stale, still measured, still ranked
    d.run(40)
    assert b in d.finished
    assert any(not e.plan.requires_feedback for e in d.executed[-10:])  # queueing resumed after feedback


def test_V1_high_and_low_acceptance_choose_different_widths():
    graphs = {P64: 2.5, D4: 3.4, **{spec(4, w): 3.5 + 0.4 * w for w in (2, 4, 8)}}
    chosen = {}
    for name, p in (("high", 0.95), ("low", 0.05)):
        s = measured(graphs)
        hs = [s.admit(ask(64, 500, sources=("learned",))) for _ in range(4)]
        for x in hs:
            s._slots[x.slot].acceptance.source("learned").seed([p ** d for d in range(1, 8)], 64.0)
            s._refresh_survival(s._slots[x.slot])
        d = Driver(s, graphs, accepted={x.slot: 7 if name == "high" else 0 for x in hs})
        d.run(40)
        chosen[name] = Counter(e.plan.graph.width for e in d.executed[4:]).most_common(1)[0][0]
    assert chosen["high"] == 8
    assert chosen["low"] == 1


def test_S5_expected_tokens_use_alpha_and_limits():
    sv = {"learned": (0.8, 0.6, 0.4)}
    s4 = spec(1, 4)
    one = choose({s4: 4.0}, decoders([1.0], survival=[sv]), alpha=1.0)
    assert one.lanes[0].expected_tokens == pytest.approx(1 + 0.8 + 0.6 + 0.4)
    two = choose({s4: 4.0}, decoders([1.0], survival=[sv]), alpha=2.0)
    assert two.lanes[0].expected_tokens == pytest.approx(1 + 0.64 + 0.36 + 0.16)
    short = choose({s4: 4.0}, decoders([1.0], survival=[sv], room=2))
    assert short.lanes[0].query_length == 2 and short.lanes[0].expected_tokens == pytest.approx(1.8)


def test_speculative_rows_need_the_graphs_proposal_source():
    s4 = spec(2, 4, proposal="copy")
    dec = decoders([1.0, 1.0], survival=[{"learned": (0.9,) * 3}, {"copy": (0.9,) * 3}])
    choice = choose({s4: 4.0}, dec)
    assert [l.handle for l in choice.lanes] == [h(1)]


def test_D5_U8_lone_cold_request_tries_its_largest_useful_extent():
    cold = {**PREFILLS, D1: 3.0, **{spec(1, w): 3.0 + w for w in (2, 4, 8)}}
    s = measured(cold, cold=tuple(cold))
    h = s.admit(ask(3000, 50, sources=("learned",)))
    plan = s.plan()
    assert plan.graph is P4096 and plan.reason is SelectionReason.DISCOVERY  # 3000 tokens: the most work
    s.commit(plan, 1)
    from helios.scheduler import CompletionRecord, ExecutionTiming

    s.complete(1, [CompletionRecord(h, prompt_consumed=3000, tokens=(1,))], ExecutionTiming(30 * MS, 30 * MS))
    plan = s.plan()
    assert plan.graph.width == 8 and plan.reason is SelectionReason.DISCOVERY  # widest expected output


def test_U12_a_pruned_padded_candidate_does_not_hide_a_smaller_program():
    """U6/U12: the best-scoring prefix-limit program here is padding for a
    rectangular one and gets pruned; the deferred search must then still
    evaluate the next program whose bound could win (found by the direct
    scheduler's equivalence test), instead of settling for plain decode."""

    limit = ValueSource.PREFIX_LIMIT
    durations = {
        prefill(8): 1.0,
        decode(1): 1.0,
        spec(1, 3): 2.0,
        spec(1, 2, aggregate=2, source=limit): 1.0,
        spec(2, 3, aggregate=6, source=limit): 1.0,
    }
    scheduler = measured(durations, slots=4)
    driver = Driver(scheduler, durations)
    driver.admit(ask(1, 4, sources=("learned",)))
    driver.step()  # the one-token prompt; the request now decodes
    plan = scheduler.plan()
    assert plan is not None
    assert (plan.graph.batch_capacity, plan.graph.width, plan.graph.value_source) == (1, 2, limit)
