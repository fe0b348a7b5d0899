"""V2/U9/U10: ragged speculative cohorts against exhaustive enumeration; adaptive allocation rules."""

from __future__ import annotations

import heapq

import pytest
from exhaustive import EXAMPLES, decoder_value, score, subsets
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_harness import MS, spec

from helios.scheduler import ValueSource, rounds
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Decoders, Population, Prompters
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.types import RequestHandle
from helios.scheduler.utility import AdaptiveLane, best_adaptive_cohort, causal_allocation

prices = st.floats(0.0, 100.0, allow_nan=False)


@st.composite
def decoder_population(draw, most: int = 6):
    slope = draw(st.floats(0.0, 2.0))
    shared_slope = draw(st.booleans())
    dec = Decoders()
    for i in range(draw(st.integers(1, most))):
        dec.handle.append(RequestHandle(i, i + 1))
        dec.token_price.append(draw(prices))
        dec.delivery_price.append(draw(prices))
        dec.age_credit.append(draw(prices))
        dec.age_slope.append(slope if shared_slope else draw(st.floats(0.0, 2.0)))  # families may differ
        dec.room.append(draw(st.integers(1, 6)))
        s = sorted(draw(st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4)), reverse=True)
        dec.survival.append({"learned": tuple(s)})
        dec.recency.append(0)
    return Population(dec, Prompters(), draw(st.floats(0.0, 3.0)), draw(st.sampled_from([0.5, 1.0, 2.0])))


@st.composite
def ragged_cases(draw):
    batch = draw(st.integers(1, 4))
    width = draw(st.integers(2, 5))
    aggregate = draw(st.integers(batch, batch * width))
    graph = spec(batch, width, aggregate=aggregate, source=ValueSource.QUERY_LENGTH)
    t_ms = draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    return graph, draw(decoder_population()), t_ms


@settings(max_examples=EXAMPLES, deadline=None)
@given(ragged_cases())
def test_V2_U9_constrained_ragged_cohort_equals_exhaustive_enumeration(case):
    graph, population, t_ms = case
    timing = GraphTiming(int(t_ms * MS) if t_ms else 0, True)
    t_ms = timing.duration_ns / MS if t_ms else None
    dec = population.decoders
    width = min(graph.width, graph.proposal_depth + 1)
    lengths = [max(1, min(width, r)) for r in dec.room]
    best = None
    for cohort in subsets(range(len(dec)), graph.batch_capacity):
        if cohort and sum(lengths[i] for i in cohort) <= graph.target_rows:
            value = sum(decoder_value(dec, i, lengths[i], "learned", population.alpha, t_ms or 0.0) for i in cohort)
            v = score(value, t_ms, population.active_age_price)
            best = v if best is None else max(best, v)
    choice = select([graph], [timing], population)
    if best is None:  # no lane's full prefix fits P
        assert choice is None
        return
    assert choice.score == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert sum(l.query_length for l in choice.lanes) <= graph.target_rows
    assert len(choice.lanes) <= graph.batch_capacity


def frontier_by_steps(lanes, rows):
    """The device's allocation, literally: repeatedly admit the best immediate frontier position."""
    taken = [1] * len(lanes)
    for _ in range(rows - len(lanes)):
        frontier = [
            (-lane.survival[taken[i] - 1], taken[i], lane.slot, i)
            for i, lane in enumerate(lanes)
            if taken[i] - 1 < len(lane.survival)
        ]
        if not frontier:
            break
        _, _, _, i = min(frontier)
        taken[i] += 1
    return tuple(taken)


adaptive_lane = st.builds(
    lambda base, price, s, slot: AdaptiveLane(base, price, tuple(s), tuple(s), slot),
    prices, prices,
    st.lists(st.floats(0.0, 1.0), max_size=5).map(lambda s: sorted(s, reverse=True)),
    st.integers(0, 63),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(adaptive_lane, min_size=1, max_size=6, unique_by=lambda l: l.slot), st.integers(0, 12))
def test_S2_causal_allocation_is_the_device_frontier_process(lanes, spare):
    rows = len(lanes) + spare
    taken, value = causal_allocation(lanes, rows)
    assert taken == frontier_by_steps(lanes, rows)
    expected = sum(l.base + l.token_price * sum(l.weights[: t - 1]) for l, t in zip(lanes, taken))
    assert value == pytest.approx(expected)


def test_S2_ties_go_to_shorter_prefixes_then_smaller_slots():
    a = AdaptiveLane(0.0, 1.0, (0.5, 0.5), (0.5, 0.5), slot=3)
    b = AdaptiveLane(0.0, 1.0, (0.5,), (0.5,), slot=1)
    assert causal_allocation([a, b], 3)[0] == (1, 2)  # equal probability, equal depth: slot 1 first
    assert causal_allocation([a, b], 4)[0] == (2, 2)  # then a's depth 1 before a's depth 2
    assert causal_allocation([a, b], 5)[0] == (3, 2)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(adaptive_lane, min_size=1, max_size=7, unique_by=lambda l: l.slot), st.integers(1, 4), st.integers(0, 8))
def test_U10_adaptive_search_is_bounded_and_priced_by_causal_allocation(lanes, batch, spare):
    rows = min(batch, len(lanes)) + spare
    evaluated = []
    import helios.scheduler.utility as utility

    real = utility.ordering_prefix_values

    def counting(*args):
        values = real(*args)
        evaluated.append(len(values))
        return values

    utility.ordering_prefix_values = counting
    try:
        value, chosen, taken = best_adaptive_cohort(lanes, batch, rows)
    finally:
        utility.ordering_prefix_values = real
    assert len(evaluated) == 3 and sum(evaluated) <= 3 * min(batch, rows, len(lanes))  # three bounded passes
    assert 1 <= len(chosen) <= batch
    expected_taken, expected_value = causal_allocation([lanes[i] for i in chosen], rows)
    assert taken == expected_taken and value == pytest.approx(expected_value)
    # never worse than the best prefix of any single ordering
    by_total = sorted(range(len(lanes)), key=lambda i: -lanes[i].full_value())
    for k in range(1, min(batch, rows, len(lanes)) + 1):
        assert value >= causal_allocation([lanes[i] for i in sorted(by_total[:k])], rows)[1] * (1 - 1e-12) - 1e-9


def test_U10_adaptive_graph_plans_ceilings_and_prices_allocation():
    g = spec(3, 4, aggregate=6, source=ValueSource.PREFIX_LIMIT)
    dec = Decoders()
    for i, (s, room) in enumerate([((0.9, 0.8, 0.7), 10), ((0.2, 0.1, 0.0), 10), ((0.9, 0.9, 0.9), 2)]):
        dec.handle.append(RequestHandle(i, i + 1))
        dec.token_price.append(10.0)
        dec.delivery_price.append(1.0)
        dec.age_credit.append(0.0)
        dec.age_slope.append(0.0)
        dec.room.append(room)
        dec.survival.append({"learned": s})
        dec.recency.append(0)
    choice = select([g], [GraphTiming(5 * MS, True)], Population(dec, Prompters(), 0.0))
    ceilings = {l.handle.slot: l.ceiling for l in choice.lanes}
    assert ceilings == {0: 4, 1: 4, 2: 2}  # min(D + 1, W, room), may sum above P = 6 (S2)
    # 3 pending rows + 3 spare rows: 0.9 (slot 0), 0.9 (slot 2), 0.8 (slot 0)
    expected = {0: 1 + 0.9 + 0.8, 1: 1.0, 2: 1 + 0.9}
    assert {l.handle.slot: l.expected_tokens for l in choice.lanes} == pytest.approx(expected)


def test_S1_S2_S3_A11_round_bounds():
    q = spec(4, 4, depth=2, aggregate=10, source=ValueSource.QUERY_LENGTH)
    assert rounds.query_length(q, room=10) == 3  # D + 1 bounds the verified prefix
    assert rounds.query_length(q, room=2) == 2  # shortened only by the request's limit
    a = spec(4, 4, aggregate=6, source=ValueSource.PREFIX_LIMIT)
    assert a.is_prefix_limit and not q.is_prefix_limit
    assert rounds.prefix_ceiling(a, room=9) == 4 and rounds.prefix_ceiling(a, room=3) == 3
    assert rounds.reservation_rows([4, 4, 4], draft_extent=3) == 15  # above P: every ceiling is covered
    assert rounds.queued_advance(4, spec(1, 8, aggregate=3, source=ValueSource.PREFIX_LIMIT)) == 3
    with pytest.raises(ValueError):
        rounds.reservation_rows([1], draft_extent=-1)
