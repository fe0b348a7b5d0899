"""The shortcuts that make ``plan()`` fast decide exactly what the plain computations decide.

Each test puts one shortcut against a reference written here, without it:

- the probe search's gain bounds (read from selection gains) never prune the
  probe that ranking every lane's candidates together puts first (D8, S9);
- ``CatalogTiming`` keeps each family's fastest program per batch capacity
  (U5's reference interval) current per observation, as a fresh scan finds it,
  and keeps its timing list when an observation changes nothing (D2);
- the winner's decode lanes carry the expected tokens S5 defines, from the
  comprehension that replaced a per-lane call (A10 projects them).
- ranked lanes sum their best k over a plain sort of the values and build
  the keyed order (U8's least-recently-used ties) only when read;
- the lane-value comprehension that drops the room cap when no room can bind
  gives the S5 values of the capped formula;
- wider speculative widths bounded from a narrower one and skipped when they
  cannot reach the best score leave the decision as scoring every program
  makes it (U8 ties and U12 pruning included).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from exhaustive import EXAMPLES, expected_tokens
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sched_harness import MS, decode, mixed, prefill, spec

from flare_contract.graphs import GENERATION_KINDS, GraphDescriptor, GraphKind, ValueSource
from helios.scheduler.select.catalog import describe
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.evaluate import evaluate_scores
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Decoders, Population, Prompters, cumulative_gains
from helios.scheduler.select.rankings import DecisionRankings
from helios.scheduler.select.timing import GraphTiming, durations_ms
from helios.scheduler.catalog_timing import CatalogTiming
from helios.scheduler.cost import CostModel
from helios.scheduler.explore import Decision, Explorer, ProbeSubject, _wins_as_plan
from helios.scheduler.learning import (
    ProbeLane,
    WidthProgram,
    best_priced_term,
    priced_probe_terms,
    probe_basis,
    term_rank_key,
)
from helios.scheduler.service import DeliveryFamily, token_normalizer
from helios.scheduler.speculation import PrefixEstimate, PrefixSurvival
from helios.scheduler.utility import PrefillTimes
from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle
from tests.helios.scheduler.reference import best_probe

MAX_DEPTH = 5
CATALOG = [decode(1), decode(4), spec(1, 2), spec(4, 2), spec(1, 3), spec(2, 4), spec(1, 6), spec(4, 6)]


# ---------------------------------------------------------------------------
# D8: bounded probe search == ranking every lane's candidates
# ---------------------------------------------------------------------------


def _estimates(rng: random.Random) -> PrefixSurvival:
    depths = [PrefixEstimate(rng.choice([rng.random(), 1.0, 0.0]), rng.choice([rng.uniform(0, 128), 2.0, 0.01]))
              for _ in range(rng.randint(0, MAX_DEPTH))]
    return PrefixSurvival(depths=depths, prior_weight=rng.uniform(0.001, 2.0))


def _selection(estimates: PrefixSurvival, alpha: float) -> tuple[dict, dict]:
    """What the core keeps per request (``_refresh_survival``): the nonincreasing means and their gains."""
    means, envelope = [], 1.0
    for depth in range(1, MAX_DEPTH + 1):
        envelope = min(envelope, estimates.survival(depth))
        means.append(envelope)
    return {"learned": tuple(means)}, {"learned": cumulative_gains(means, alpha)}


def _probe_case(seed: int):
    rng = random.Random(seed)
    alpha = rng.choice([1.0, 0.5, 2.0])
    timings = [GraphTiming(int(rng.uniform(2, 12) * MS), True) for _ in CATALOG]
    winner_index = rng.choice([0, 1, 3])  # width one, or a width-two program of the lanes' source
    lanes, dec, requests = [], Decoders(), {}
    price_pool = [rng.uniform(0.1, 5) for _ in range(3)]  # shared prices make equal gains, so ties
    # shared estimates: lanes whose probe inputs differ only in price share a probe basis
    estimates_pool = [_estimates(rng) for _ in range(2)]
    kept = rng.random() < 0.7  # the population keeps each lane's means and weights, as the core's does
    for slot in range(rng.randint(1, 12)):
        handle = RequestHandle(slot, slot + 1)
        estimates = rng.choice(estimates_pool) if rng.random() < 0.6 else _estimates(rng)
        room = rng.choice([rng.randint(1, 9), 10_000])
        dec.handle.append(handle)
        dec.token_price.append(rng.choice(price_pool + [0.0]))
        dec.room.append(room)
        survival, gains = _selection(estimates, alpha)
        dec.survival.append(survival)
        dec.gains.append(gains)
        for column in (dec.delivery_price, dec.age_credit, dec.age_slope):
            column.append(0.0)
        dec.recency.append(slot)
        if kept:
            dec.estimates.append({"learned": estimates.means_and_weights(MAX_DEPTH)})
        requests[handle] = ProbeSubject(room, {"learned": estimates})
        lanes.append(PlannedLane(handle, LanePhase.DECODE, query_length=1))
    winner = Choice(CATALOG[winner_index], tuple(lanes), timings[winner_index], 1.0, 0.0, None)
    decision = Decision(winner, timings, Population(dec, Prompters(), 0.0, alpha), 0)
    return decision, requests, alpha


def _ranked_over_every_lane(explorer: Explorer, decision: Decision, requests, alpha: float):
    """The reference: every priced lane's candidates, ranked together (``learning.best_probe``)."""
    programs = explorer._programs("learned", decision.timings)
    ordinary = explorer._ordinary(decision.winner, "learned")
    d = decision.population.decoders
    views, handles = [], []
    for handle, price in zip(d.handle, d.token_price):
        if price > 0:
            request = requests[handle]
            views.append(ProbeLane.from_estimates(request.estimates["learned"], MAX_DEPTH, request.room, ordinary,
                                                  token_value=price, alpha=alpha))
            handles.append(handle)
    found = best_probe(views, programs)
    if found is None:
        return None
    return found, handles[next(i for i, v in enumerate(views) if v is found.lane)]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_D8_S9_bounded_probe_search_finds_the_probe_ranking_all_lanes_finds(seed):
    decision, requests, alpha = _probe_case(seed)
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=alpha, fixed_width=False)
    got = explorer._best_probe(decision, requests.__getitem__)
    want = _ranked_over_every_lane(explorer, decision, requests, alpha)
    assert (got is None) == (want is None)
    if want is not None:
        (found, handle), (expected, expected_handle) = got, want
        assert handle == expected_handle
        assert found.rank_key() == expected.rank_key()
        assert (found.program.key, found.offered_depth, found.optimistic_rate) == (
            expected.program.key, expected.offered_depth, expected.optimistic_rate)


def _uniform_lanes(prices, depths=((0.6, 100.0),), prior_weight=1e-9, kept=False, rooms=None):
    """Lanes priced ``prices``, all with the same estimates: by default one well-known first draft
    and unexplored deeper ones (optimism 1). ``kept``: the population keeps their means and weights."""
    dec, requests, lanes = Decoders(), {}, []
    rooms = rooms or [10_000] * len(prices)
    for slot, (price, room) in enumerate(zip(prices, rooms)):
        handle = RequestHandle(slot, slot + 1)
        estimates = PrefixSurvival(depths=[PrefixEstimate(m, w) for m, w in depths], prior_weight=prior_weight)
        survival, gains = _selection(estimates, 1.0)
        for column, value in ((dec.handle, handle), (dec.token_price, price), (dec.room, room),
                              (dec.survival, survival), (dec.gains, gains),
                              (dec.delivery_price, 0.0), (dec.age_credit, 0.0), (dec.age_slope, 0.0),
                              (dec.recency, slot)):
            column.append(value)
        if kept:
            dec.estimates.append({"learned": estimates.means_and_weights(MAX_DEPTH)})
        requests[handle] = ProbeSubject(room, {"learned": estimates})
        lanes.append(PlannedLane(handle, LanePhase.DECODE, query_length=2))
    timings = [GraphTiming(int(ms * MS), True) for ms in (3, 4, 5, 6, 4, 5, 6, 8)]
    winner = Choice(CATALOG[3], tuple(lanes), timings[3], 1.0, 0.0, None)
    return Decision(winner, timings, Population(dec, Prompters(), 0.0, 1.0), 0), requests


def test_D8_probe_gain_bound_is_tight_when_added_drafts_are_unexplored():
    decision, requests = _uniform_lanes([1.0])
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=1.0, fixed_width=False)
    (lane,) = explorer._probe_lanes(decision)
    (found,) = explorer._lane_bests(decision, requests[lane.handle], lane.price)
    gain = -found.key[0]
    assert gain <= explorer._gain_bound(decision, lane) <= gain * (1 + 1e-8)


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("price", [1.3, 0.9, 3.1])
def test_D8_a_lane_a_rounding_cheaper_still_wins_on_an_equal_or_rounded_up_gain(price, kept):
    """Two lanes with the same estimates, the first priced one unit in the last place below the
    second: it is searched second (its bound is lower), and its gain rounds to the same float or
    above, so it must still win, as ranking every lane makes it; also when both share one probe
    basis (``kept``) and only their prices are applied apart."""
    depths = ((0.6, 100.0), (0.3, 100.0), (0.1, 100.0))
    decision, requests = _uniform_lanes([math.nextafter(price, 0.0), price], depths=depths, prior_weight=1.0,
                                        kept=kept)
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=1.0, fixed_width=False)
    found, handle = explorer._best_probe(decision, requests.__getitem__)
    expected, expected_handle = _ranked_over_every_lane(explorer, decision, requests, 1.0)
    assert handle == expected_handle == RequestHandle(0, 1) and found.rank_key() == expected.rank_key()


def test_D8_kept_means_and_weights_spare_asking_for_each_request_and_share_one_basis(monkeypatch):
    """With the population keeping each lane's means and weights, the search asks for no request's
    estimates, computes one probe basis for lanes that share them, and finds what ranking every
    lane finds."""
    from helios.scheduler import explore

    prices = [1.0, 1.02, 0.97, 1.01, 0.99, 1.015]
    depths = ((0.6, 100.0), (0.3, 100.0), (0.1, 100.0))
    decision, requests = _uniform_lanes(prices, depths=depths, prior_weight=1.0, kept=True)
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=1.0, fixed_width=False)
    bases = []
    basis = explore.probe_basis
    monkeypatch.setattr(explore, "probe_basis", lambda *a: bases.append(a) or basis(*a))

    def not_asked(handle):
        raise AssertionError(f"asked for {handle}'s estimates")

    found, handle = explorer._best_probe(decision, not_asked)
    expected, expected_handle = _ranked_over_every_lane(explorer, decision, requests, 1.0)
    assert handle == expected_handle and found.rank_key() == expected.rank_key()
    assert (found.lane.means, found.lane.weights, found.lane.remaining_output) == (
        expected.lane.means, expected.lane.weights, expected.lane.remaining_output)
    assert len(bases) == 1


@pytest.mark.parametrize("rooms", [[10_000, 4], [4, 10_000], [3, 5], [10_000, 10_000]])
def test_D8_lanes_share_a_probe_basis_only_where_their_room_limits_no_depth(rooms):
    """Same estimates, rooms that cut the deeper programs' depth for one lane (or both): each lane
    gets the probe its own room allows, as ranking every lane does."""
    depths = ((0.6, 100.0), (0.3, 100.0), (0.1, 100.0))
    decision, requests = _uniform_lanes([1.0, 1.3], depths=depths, prior_weight=0.5, kept=True, rooms=rooms)
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=1.0, fixed_width=False)
    for order in ((0, 1), (1, 0)):  # either lane may compute the basis the other could reuse
        lanes, bases = explorer._probe_lanes(decision), {}
        for position in order:
            lane = lanes[position]
            kept = explorer._bests_of(decision, lane.estimates, lane.room, lane.price, bases)
            asked = explorer._lane_bests(decision, requests[lane.handle], lane.price)
            terms = [[(b.key, b.term[0].key, b.term[1]) for b in bests] for bests in (kept, asked)]
            assert terms[0] == terms[1]
    got = explorer._best_probe(decision, requests.__getitem__)
    want = _ranked_over_every_lane(explorer, decision, requests, 1.0)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[1] == want[1] and got[0].rank_key() == want[0].rank_key()


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_D8_best_priced_term_is_the_first_least_rank_key_of_all_priced_terms(seed):
    """The kept-estimates search picks a lane's term by a scan over the basis in the key's
    price-independent order; it must be the term ``min(terms, key=term_rank_key)`` picks,
    ties (equal durations, shapes and weights, so equal gains) included."""
    rng = random.Random(seed)
    estimates = _estimates(rng)
    means, weights = estimates.means_and_weights(MAX_DEPTH)
    durations = [rng.choice([3, 4, 4, 6]) * MS for _ in range(6)]
    programs = [WidthProgram(f"p{i}", rng.randint(1, 6), rng.randint(0, MAX_DEPTH - 1), durations[i],
                             rng.choice([8, 16]), rng.choice([2, 4])) for i in range(6)]
    ordinary = WidthProgram("ordinary", rng.randint(1, 2), 1, rng.choice([2, 3]) * MS, 4, 4)
    basis = probe_basis(means, weights, rng.choice([0, 2, 3, 5, 10_000]), ordinary, rng.choice([0.5, 1.0, 2.0]),
                        programs)
    price = rng.choice([0.3, 1.0, 2.7])
    depth, rate, terms = priced_probe_terms(basis, ordinary, price)
    got = best_priced_term(basis, ordinary, price)
    assert got == (depth, rate, min(terms, key=term_rank_key) if terms else None)


def test_D8_probe_search_evaluates_only_lanes_whose_bound_reaches_the_best_gain():
    decision, requests = _uniform_lanes([1.0, 1.0, 1.3, 1.0, 1.0, 1.0])
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=1.0, fixed_width=False)
    asked = []
    found, handle = explorer._best_probe(decision, lambda h: asked.append(h) or requests[h])
    assert handle == RequestHandle(2, 3) and asked == [handle]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 20.0), st.sampled_from([0.0, 0.05, 1.0]))
def test_D8_probes_that_cannot_win_as_plans_are_not_searched_for_and_the_rest_are_found(seed, score, age):
    """``probes_win_as_plans``: the gate before the lane search returns None only where the probe the
    whole search finds would fail ``_wins_as_plan``; otherwise it is that probe."""
    decision, requests, alpha = _probe_case(seed)
    decision = dataclasses.replace(
        decision, winner=dataclasses.replace(decision.winner, score=score),
        population=dataclasses.replace(decision.population, active_age_price=age))
    gated = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=alpha, fixed_width=False,
                     probes_win_as_plans=True)
    searched = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=alpha, fixed_width=False)
    want = searched._best_probe(decision, requests.__getitem__)
    if want is not None and not _wins_as_plan(want[0], decision):
        want = None
    got = gated._best_probe(decision, requests.__getitem__)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[1] == want[1] and got[0].rank_key() == want[0].rank_key()


def test_D8_no_lane_is_read_when_no_probe_program_could_win_as_a_plan(monkeypatch):
    """A winner scoring above what any probe program could commit per ms (every draft accepted, at the
    highest lane price) stops the search before any lane's bound or estimates are read; a winner just
    below one program's limit does not."""
    prices = [1.0, 1.0, 1.3, 1.0]
    decision, requests = _uniform_lanes(prices)
    explorer = Explorer(CATALOG, describe(CATALOG), max_depth=MAX_DEPTH, alpha=1.0, fixed_width=False,
                        probes_win_as_plans=True)
    limit = max(1.3 * (1 + min(p.width - 1, p.proposal_depth)) * 1e6 / p.duration_ns
                for source in ("learned",) for p in explorer._source_view(decision, source).programs)
    read = []
    monkeypatch.setattr(Explorer, "_gain_bound", lambda self, d, lane: read.append(lane) or 1.0)
    above = dataclasses.replace(decision, winner=dataclasses.replace(decision.winner, score=limit * 1.01))
    assert explorer._best_probe(above, lambda h: read.append(h) or requests[h]) is None
    assert read == []
    below = dataclasses.replace(decision, winner=dataclasses.replace(decision.winner, score=limit * 0.99))
    explorer._best_probe(below, lambda h: read.append(h) or requests[h])
    assert len(read) >= len(prices)  # the search ran: every priced lane's bound was read


# ---------------------------------------------------------------------------
# U5 / D2: fastest shapes and timing lists kept current per observation
# ---------------------------------------------------------------------------


def _fresh_scan(graphs, timings, family: DeliveryFamily) -> dict[int, float]:
    fastest: dict[int, float] = {}
    for g, t in zip(graphs, timings):
        if family.serves(g) and t.duration_ns > 0:
            ms = t.duration_ns / 1e6
            fastest[g.batch_capacity] = min(ms, fastest.get(g.batch_capacity, ms))
    return fastest


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.sampled_from([0, 3, 3, 5, 8])), min_size=1, max_size=30),
       st.booleans())
def test_U5_D2_fastest_shapes_follow_every_observation(observations, read_early):
    graphs = [decode(1), decode(4), spec(1, 2), spec(4, 2), spec(4, 3), mixed(2, 64), mixed(4, 64, 2, 1),
              spec(2, 2, proposal="copy"), spec(4, 4, proposal="copy"), decode(8), prefill(64), prefill(256)]
    cost = CostModel(ttl_ns=10**15)
    table = CatalogTiming(graphs, cost)
    families = [DeliveryFamily(None), DeliveryFamily("learned"), DeliveryFamily("copy")]
    if read_early:  # families read before any observation must follow later ones too
        for family in families:
            table.fastest_shapes(family, table.at(0))
    for step, (index, ms) in enumerate(observations, start=1):
        before = table.at(step)
        cost.observe(graphs[index].cost_key(), ms * MS, 0, step)
        table.observed(graphs[index].cost_key(), step)
        timings = table.at(step)
        if timings == before:
            assert timings is before  # nothing changed: the same list, so derived caches stay valid
        for family in families:
            shapes = table.fastest_shapes(family, timings)
            assert {s.batch_capacity: s.duration_ms for s in shapes} == _fresh_scan(graphs, timings, family)
        # the durations and prefill times kept beside the list, updated per observation, are a fresh build's
        assert table.durations_ms(timings) == durations_ms(timings)
        assert table.prefill_times(timings) == PrefillTimes.of(
            [(g.prefill_capacity, t.duration_ns / 1e6) for g, t in zip(graphs, timings)
             if g.kind is GraphKind.PREFILL and t.known])
        measured = token_normalizer((g, t.duration_ns) for g, t in zip(graphs, timings) if g.kind in GENERATION_KINDS)
        assert table.normalizer(step) == (measured if measured is not None else
                                      token_normalizer((g, t.duration_ns) for g, t in zip(graphs, timings)))


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3), st.booleans()), min_size=1, max_size=40))
def test_D2_timings_turn_stale_when_a_table_built_afresh_sees_them_stale(steps):
    """The table scans its staleness times only once the clock passes a bound on the earliest;
    re-observing the earliest entry moves it later. Read at every step, it must give what a
    table built at that moment from the same cost model gives."""
    graphs = [decode(1), decode(4), spec(1, 2), spec(4, 3)]
    ttl = 10 * MS
    cost = CostModel(ttl_ns=ttl)
    table = CatalogTiming(graphs, cost)
    now = 0
    for advance_ms, index, observe in steps:
        now += advance_ms * MS // 4
        if observe:
            cost.observe(graphs[index].cost_key(), (index + 2) * MS, 0, now)
            table.observed(graphs[index].cost_key(), now)
        assert table.at(now) == CatalogTiming(graphs, cost).at(now)


def test_U5_fastest_shapes_of_another_timing_list_are_scanned_afresh():
    graphs = [decode(1), decode(4)]
    table = CatalogTiming(graphs, CostModel(ttl_ns=10**15))
    own = [GraphTiming(3 * MS, True), GraphTiming(0, True)]  # a scheduler with its own cost model
    (shape,) = table.fastest_shapes(DeliveryFamily(None), own)
    assert (shape.batch_capacity, shape.duration_ms) == (1, 3.0)


# ---------------------------------------------------------------------------
# S5 / A10: expected tokens of the winner's lanes
# ---------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_S5_A10_winner_lanes_carry_the_expected_tokens_of_their_rows(seed):
    rng = random.Random(seed)
    graph = rng.choice([spec(4, 2), spec(4, 4), spec(8, 3), mixed(4, 64, 4, 3)])
    alpha = rng.choice([1.0, 0.5])
    dec = Decoders()
    for slot in range(rng.randint(1, 8)):
        survival = tuple(sorted((rng.random() for _ in range(MAX_DEPTH)), reverse=True))
        dec.handle.append(RequestHandle(slot, slot + 1))
        dec.token_price.append(rng.uniform(0.5, 3))
        dec.delivery_price.append(rng.uniform(0, 1))
        dec.age_credit.append(0.0)
        dec.age_slope.append(0.0)
        dec.room.append(rng.choice([1, 2, 3, 50]))
        dec.survival.append({"learned": survival})
        dec.recency.append(rng.randint(0, 3))
    population = Population(dec, Prompters(), 0.0, alpha)
    choice = select([graph], [GraphTiming(5 * MS, True)], population)
    slot_of = {h: i for i, h in enumerate(dec.handle)}
    for lane in choice.lanes:
        i = slot_of[lane.handle]
        assert lane.query_length == min(describe([graph])[0].width, dec.room[i])
        assert lane.expected_tokens == pytest.approx(expected_tokens(dec, i, lane.query_length, "learned", alpha),
                                                     rel=1e-12)


# ---------------------------------------------------------------------------
# D7: stale programs are ranked by score; only the refreshed one builds lanes
# ---------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_D7_scores_without_lanes_match_each_program_selected_alone(seed):
    """A stale program's refresh score is its own best cohort: what selection finds on it alone."""
    rng = random.Random(seed)
    graphs = CATALOG + [mixed(2, 64), mixed(4, 64, 2, 1)]
    timings = [GraphTiming(rng.choice([0, int(rng.uniform(2, 9) * MS)]), rng.random() < 0.5) for _ in graphs]
    decision, _, _ = _probe_case(seed)
    population = decision.population
    indices = rng.sample(range(len(graphs)), rng.randint(1, len(graphs)))
    scored = evaluate_scores(graphs, timings, population, describe(graphs), indices)
    for index in indices:
        alone = select([graphs[index]], [timings[index]], population)
        assert (index in scored) == (alone is not None)
        if alone is not None:
            assert scored[index].score == alone.score
            assert scored[index].choice().lanes == alone.lanes


# ---------------------------------------------------------------------------
# U8 / U9: prefix sums from a plain sort, lane order only when read
# ---------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 0.25, 1.0, 1.5, 3.0, 7.25]) | st.floats(0, 50), max_size=24),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_U8_U9_ranked_lanes_sum_and_order_as_a_keyed_sort_does(values, with_recency, seed):
    """The prefix sums over sorted values are those of the keyed ranking; ties go least recently used first."""
    from itertools import accumulate

    from helios.scheduler.utility import RankedLanes

    rng = random.Random(seed)
    recency = [rng.randint(0, 3) for _ in values] if with_recency else None
    ranked = RankedLanes.rank(values, recency)
    key = (lambda i: (-values[i], recency[i])) if recency else (lambda i: -values[i])
    order = tuple(sorted(range(len(values)), key=key))  # stable: list order among full ties
    assert ranked.prefix == list(accumulate((values[i] for i in order), initial=0.0))
    if values:
        assert ranked.first() == order[0]  # read before the full order exists
        top = RankedLanes.rank(values, recency, lazy=True).top()  # the best value without the sort
        assert (top, math.copysign(1.0, top)) == (ranked.prefix[1], math.copysign(1.0, ranked.prefix[1]))
    assert ranked.order == order


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_S5_U9_uncapped_shortcut_values_equal_the_capped_formula(seed):
    """Within every lane's room, ``(1 + g[w-1]) * p + f`` is the S5 value ``min(1 + g[w-1], room) * p + f``.

    Rooms straddle the expected tokens so both the shortcut and the capped
    formula run; the winner's score must be the plain per-lane computation's.
    """
    rng = random.Random(seed)
    width = rng.randint(2, MAX_DEPTH + 1)
    graph = spec(rng.choice([1, 2, 4, 8]), width)
    alpha = rng.choice([1.0, 0.5, 2.0])
    dec = Decoders()
    for slot in range(rng.randint(1, 10)):
        survival = tuple(sorted((rng.choice([1.0, rng.random()]) for _ in range(MAX_DEPTH)), reverse=True))
        dec.handle.append(RequestHandle(slot, slot + 1))
        dec.token_price.append(rng.uniform(0.0, 3))
        dec.delivery_price.append(rng.uniform(0, 1))
        dec.age_credit.append(rng.uniform(0, 1))
        dec.age_slope.append(0.0)
        dec.room.append(rng.choice([width - 1, width, width + 1, 10_000]) or 1)
        dec.survival.append({"learned": survival})
        dec.recency.append(slot)
    population = Population(dec, Prompters(), 0.0, alpha)
    choice = select([graph], [GraphTiming(5 * MS, True)], population)
    values = sorted(
        (expected_tokens(dec, i, min(width, dec.room[i]), "learned", alpha) * dec.token_price[i]
         + dec.delivery_price[i] + dec.age_credit[i] for i in range(len(dec))),
        reverse=True,
    )
    served = sum(values[: graph.batch_capacity])
    assert choice.score == pytest.approx(served / 5.0, rel=1e-12)


# ---------------------------------------------------------------------------
# U9 / U12 / U8: wider widths skipped by their bound decide what scoring them decides
# ---------------------------------------------------------------------------

def _unit_decoders(count: int, survival: dict, room: int = 100) -> Decoders:
    """``count`` decoders at token price one, nothing else priced, the same survival and room."""
    dec = Decoders()
    for slot in range(count):
        dec.handle.append(RequestHandle(slot, slot + 1))
        for column, value in ((dec.token_price, 1.0), (dec.delivery_price, 0.0), (dec.age_credit, 0.0),
                              (dec.age_slope, 0.0), (dec.room, room), (dec.recency, slot)):
            column.append(value)
        dec.survival.append(survival)
    return dec


_BOUND_POOL = (
    [decode(b) for b in (1, 2, 4, 8)]
    + [spec(b, w) for b in (1, 2, 4, 8) for w in (2, 3, 4, 5, 6)]
    + [spec(4, 6, depth=3), spec(2, 5, depth=3)]  # logical width capped by the depth
    # ragged (query-length) and prefix-limit programs: scored one by one, bounded like the wider widths
    + [spec(8, 4, depth=3, aggregate=16), spec(8, 4, depth=3, aggregate=16, source=ValueSource.PREFIX_LIMIT),
       spec(4, 3, depth=2, aggregate=6), spec(2, 3, depth=2, aggregate=4, source=ValueSource.PREFIX_LIMIT)]
    + [mixed(b, c) for b in (2, 4) for c in (16, 64)]
    + [mixed(b, 64, w, w - 1) for b in (2, 4, 8) for w in (2, 3, 5)]
    + [GraphDescriptor(f"prefill_c{c}", GraphKind.PREFILL, 1, prefill_capacity=c) for c in (16, 64)]
)


def _bounded_case(rng: random.Random):
    graphs = rng.sample(_BOUND_POOL, rng.randint(2, len(_BOUND_POOL)))
    tick = rng.choice([0.5, 1.0])  # coarse durations make exact ties between programs
    timings = [GraphTiming(int(rng.randint(2, 24) * tick * MS), True) for _ in graphs]
    alpha = rng.choice([1.0, 0.5, 2.0])
    dec, slope = Decoders(), rng.choice([0.0, 0.05])
    speculating = rng.random() < 0.7  # otherwise decode and mixed programs compete alone
    for slot in range(rng.randint(0, 12)):
        survival = tuple(sorted((rng.choice([1.0, 0.0, rng.random()]) for _ in range(rng.randint(0, 5))),
                                reverse=True))
        dec.handle.append(RequestHandle(slot, slot + 1))
        dec.token_price.append(rng.choice([1.0, 2.0, rng.uniform(0.1, 4), 0.0]))
        dec.delivery_price.append(rng.choice([0.0, rng.uniform(0, 2)]))
        dec.age_credit.append(rng.uniform(0, 1))
        dec.age_slope.append(slope if rng.random() < 0.9 else rng.choice([slope, 0.1]))
        dec.room.append(rng.choice([1, 2, 3, 10_000]))
        dec.survival.append({"learned": survival} if speculating and rng.random() < 0.9 else {})
        dec.recency.append(rng.randint(0, 3))
    prm = Prompters()
    for slot in range(rng.choice([0, 0, 1, 3])):
        remaining = rng.choice([8, 64, 300])
        prm.handle.append(RequestHandle(40 + slot, 1))
        prm.start.append(0)
        prm.remaining.append(remaining)
        prm.to_endpoint.append(remaining)
        prm.price.append(rng.uniform(0.05, 2))
        prm.first_token.append(rng.uniform(0, 2))
        prm.recency.append(rng.randint(0, 3))
    # the price-flow choices that charge a deferred round and drop prefill beside decoders (mixed catalogs)
    return graphs, timings, Population(dec, prm, slope * len(dec) * rng.choice([0.0, 1.0]), alpha,
                                       defers_decode=rng.random() < 0.5, prompts_beside_decoders=rng.random() < 0.5)


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(st.integers(0, 2**32 - 1))
@example(11163)  # a mixed group is not "decode-only beaten" by a sibling wider than the decoders (U12 drops it)
@example(0)  # a wider mixed group scored after the deferred round was charged to the narrower ones
@example(185)  # a wider group the general path scores: charged as well
@example(49984)  # a "decode-only beaten" group the general path scores: charged as well
def test_U9_U12_skipped_wider_widths_decide_what_scoring_every_width_decides(seed):
    """Selection that bounds wider speculative widths from narrower ones and skips those that cannot
    win picks the graph, the cohort and the score that scoring every program picks, with its
    ties (U8) and padding pruning (U12), under the deferred-round charge and the prefill-beside-decoders
    drop (each drawn on or off): the reference scores every group eagerly."""
    graphs, timings, population = _bounded_case(random.Random(seed))
    described = describe(graphs)
    everything = dataclasses.replace(described, eager=described.groups, bounded=(), speculation_bounded=False,
                                     ragged_padded_by=())  # no padding read off the catalog: built and pruned
    fast = select(graphs, timings, population, described)
    plain = select(graphs, timings, population, everything)
    assert (fast is None) == (plain is None)
    if fast is not None:
        assert (fast.graph, fast.lanes, fast.score, fast.log_scale, fast.prefill_row) == \
            (plain.graph, plain.lanes, plain.score, plain.log_scale, plain.prefill_row)


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_U9_U12_skipped_ragged_programs_decide_what_scoring_them_decides(seed):
    """Ragged and prefix-limit programs priced around the crossover with plain decode and the narrowest
    speculative width (high acceptance past the first draft, where only their full width shows what they
    are worth): bounding them and skipping those that cannot win decides what scoring them all decides."""
    rng = random.Random(seed)
    graphs = [decode(4), decode(8), spec(8, 2), spec(4, 2),
              spec(8, 4, depth=3, aggregate=16), spec(8, 4, depth=3, aggregate=16, source=ValueSource.PREFIX_LIMIT),
              spec(4, 3, depth=2, aggregate=6), spec(4, 4, depth=3, aggregate=8, source=ValueSource.PREFIX_LIMIT)]
    timings = [GraphTiming(int(ms * MS), True) for ms in
               (3, 4, rng.uniform(4, 9), rng.uniform(3, 7)) + tuple(rng.uniform(2.5, 12) for _ in range(4))]
    dec, slope = Decoders(), rng.choice([0.0, 0.05])
    for slot in range(rng.randint(1, 12)):
        survival = tuple(sorted((rng.choice([1.0, 0.95, rng.uniform(0.5, 1)]) for _ in range(rng.randint(1, 4))),
                                reverse=True))
        dec.handle.append(RequestHandle(slot, slot + 1))
        dec.token_price.append(rng.choice([1.0, rng.uniform(0.1, 4), 0.0]))
        dec.delivery_price.append(rng.choice([0.0, rng.uniform(0, 2)]))
        dec.age_credit.append(rng.uniform(0, 1))
        dec.age_slope.append(slope)
        dec.room.append(rng.choice([2, 3, 10_000]))
        dec.survival.append({"learned": survival})
        dec.recency.append(rng.randint(0, 3))
    population = Population(dec, Prompters(), slope * len(dec) * rng.choice([0.0, 1.0]), rng.choice([1.0, 0.5]))
    described = describe(graphs)
    everything = dataclasses.replace(described, eager=described.groups, bounded=(), speculation_bounded=False,
                                     ragged_padded_by=())  # no padding read off the catalog: built and pruned
    fast, plain = select(graphs, timings, population, described), select(graphs, timings, population, everything)
    assert (fast is None) == (plain is None)
    if fast is not None:
        assert (fast.graph, fast.lanes, fast.score, fast.log_scale) == \
            (plain.graph, plain.lanes, plain.score, plain.log_scale)


def test_U9_no_speculative_ranking_is_built_when_the_plain_ranking_bounds_every_width_below_decode(monkeypatch):
    """In a catalog without mixed programs, speculative programs that cost several decode steps are
    bounded from the width-one ranking alone (a draft adds at most the lane's price): no speculative
    ranking is built and plain decode wins; priced cheaply, their rankings are built and they win."""
    graphs = [decode(4), decode(16), spec(4, 2), spec(16, 2), spec(16, 4), spec(16, 4, depth=3, aggregate=32),
              spec(16, 2, proposal="copy")]
    dec = _unit_decoders(16, {"learned": (0.9, 0.8, 0.7), "copy": (0.9,)})
    population = Population(dec, Prompters(), 0.0, 1.0)
    built = []
    real = DecisionRankings.decode_ranking
    monkeypatch.setattr(DecisionRankings, "decode_ranking",
                        lambda self, source, width, timing=None: built.append((source, width))
                        or real(self, source, width, timing))
    slow = [GraphTiming(int(ms * MS), True) for ms in (2, 5, 7, 11, 25, 25, 11)]
    assert select(graphs, slow, population).graph.id == "decode_b16"
    assert {source for source, _ in built} == {None}
    built.clear()
    cheap = [GraphTiming(int(ms * MS), True) for ms in (2, 5, 7, 6, 25, 25, 11)]
    assert select(graphs, cheap, population).graph.id == graphs[3].id
    assert ("learned", 2) in built


@pytest.mark.parametrize("survival, speculative", [(0.1, False), (0.9, True)])
def test_U9_S5_drafts_rarely_accepted_bound_a_cheap_speculative_program_below_decode(monkeypatch, survival,
                                                                                    speculative):
    """A width-two round at 1.5 decode steps could win if every draft were accepted; at a tenth accepted
    (each draft worth p * s_1) neither source's ranking is built and plain decode wins; at nine tenths the
    rankings are built and a speculative program wins."""
    graphs = [decode(4), spec(4, 2), spec(4, 2, proposal="copy")]
    timings = [GraphTiming(int(ms * MS), True) for ms in (2, 3, 3)]
    dec = _unit_decoders(4, {"learned": (survival,), "copy": (survival * 0.9,)})
    built = []
    real = DecisionRankings.decode_ranking
    monkeypatch.setattr(DecisionRankings, "decode_ranking",
                        lambda self, source, width, timing=None: built.append(source)
                        or real(self, source, width, timing))
    choice = select(graphs, timings, Population(dec, Prompters(), 0.0, 1.0))
    assert (choice.graph.kind is GraphKind.SPECULATIVE) == speculative
    assert (set(built) == {None}) != speculative


def test_U9_U12_never_run_padding_and_sources_no_lane_may_take_leave_the_width_one_bound_standing(monkeypatch):
    """Four decoders with rarely accepted learned drafts and no copy source: the never-run batch-eight
    programs are padding (the batch-four ones serve all four), and the never-run copy program has no lane,
    so neither stops the bound: no speculative ranking is built and decode_b4 wins. A fifth decoder makes
    the batch-eight programs real candidates, never run, which U8 scores."""
    graphs = [decode(4), decode(8), spec(4, 2), spec(8, 2), spec(4, 2, aggregate=6), spec(8, 2, aggregate=12),
              spec(4, 2, proposal="copy")]
    timings = [GraphTiming(2 * MS, True), GraphTiming(0, False), GraphTiming(3 * MS, True), GraphTiming(0, False),
               GraphTiming(3 * MS, True), GraphTiming(0, False), GraphTiming(0, False)]
    built = []
    real = DecisionRankings.decode_ranking
    monkeypatch.setattr(DecisionRankings, "decode_ranking",
                        lambda self, source, width, timing=None: built.append(source)
                        or real(self, source, width, timing))
    four = Population(_unit_decoders(4, {"learned": (0.1,)}), Prompters(), 0.0, 1.0)
    assert select(graphs, timings, four).graph.id == "decode_b4" and set(built) == {None}
    built.clear()
    five = Population(_unit_decoders(5, {"learned": (0.1,)}), Prompters(), 0.0, 1.0)
    assert not select(graphs, timings, five).timing.known and "learned" in built


def test_U9_a_ragged_or_prefix_limit_program_that_cannot_win_is_never_searched(monkeypatch):
    """At full acceptance of one draft and none beyond, a ragged and a prefix-limit program of width four
    cost three decode steps for at most two tokens a lane (and width two costs more than twice a decode
    step): bounded below plain decode, their candidate
    searches never run and the decision takes the flat path; priced cheaply, they are searched."""
    from helios.scheduler.select import candidates

    graphs = [decode(8), spec(8, 2), spec(8, 4, depth=3, aggregate=16),
              spec(8, 4, depth=3, aggregate=16, source=ValueSource.PREFIX_LIMIT)]
    population = Population(_unit_decoders(8, {"learned": (1.0, 0.0, 0.0)}), Prompters(), 0.0, 1.0)
    searched = []
    real = dict(candidates.CANDIDATES)
    monkeypatch.setitem(candidates.CANDIDATES, GraphKind.SPECULATIVE,
                        lambda sel, index, graph, timing: searched.append(graph.id)
                        or real[GraphKind.SPECULATIVE](sel, index, graph, timing))
    slow = [GraphTiming(int(ms * MS), True) for ms in (4, 9, 12, 12)]
    assert select(graphs, slow, population).graph.id == "decode_b8" and searched == []
    cheap = [GraphTiming(int(ms * MS), True) for ms in (4, 9, 4.5, 4.5)]
    select(graphs, cheap, population)
    assert set(searched) == {g.id for g in graphs[2:]}


def test_U9_a_wide_width_that_cannot_win_is_never_scored(monkeypatch):
    """The skip is real: with acceptance that ends after one draft, widths past two gain nothing,
    cost more, and are never ranked; with full acceptance the widest wins and is ranked."""
    graphs = [decode(8)] + [spec(8, w) for w in (2, 3, 4, 5, 6)]
    timings = [GraphTiming(int((3 + w) * MS), True) for w in (1, 2, 3, 4, 5, 6)]
    described = describe(graphs)
    ranked = []
    original = DecisionRankings._rank_decoders
    monkeypatch.setattr(DecisionRankings, "_rank_decoders",
                        lambda self, source, width, t_ms: ranked.append(width) or original(self, source, width, t_ms))
    for survival, winner_width, widths_ranked in (((1.0, 0.0, 0.0, 0.0, 0.0), 2, [1, 2]),
                                                   ((1.0,) * 5, 6, [1, 2, 3, 4, 5, 6])):
        ranked.clear()
        dec = _unit_decoders(8, {"learned": survival})
        choice = select(graphs, timings, Population(dec, Prompters(), 0.0, 1.0), described)
        assert choice.graph.width == winner_width
        assert sorted(ranked) == widths_ranked


def test_U12_a_narrower_width_still_prunes_a_faster_wider_program_doing_its_work():
    """Rooms of two make widths three and four do the same work at depth three; the wider
    program measured faster scores best, but the narrower one (whose bound alone is below the
    width-two program) dominates it as padding, so width two wins (U12)."""
    graphs = [spec(8, 2, depth=1), spec(4, 3, depth=3), spec(4, 4, depth=3)]
    timings = [GraphTiming(int(ms * MS), True) for ms in (8, 20, 4)]
    population = Population(_unit_decoders(4, {"learned": (1.0, 1.0, 1.0)}, room=2), Prompters(), 0.0, 1.0)
    wide_alone = select(graphs[2:], timings[2:], population)
    choice = select(graphs, timings, population)
    assert wide_alone.score == pytest.approx(2.0)  # 4 lanes x 2 tokens in 4 ms: the best score
    assert choice.graph is graphs[0] and choice.score == pytest.approx(1.0)


@settings(max_examples=EXAMPLES * 4, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_U12_U8_padded_ragged_and_prefix_limit_programs_left_unscored_decide_nothing(seed):
    """Ragged and prefix-limit programs that ``CatalogInfo.ragged_padded_by`` leaves unwritten (rows that
    cannot bind, a rectangular program of their ranking with batch >= n) decide nothing: selection picks
    what scoring every program eagerly and pruning only by building each candidate (U12) picks, measured
    or never run (U8), at prices every lane adds value at (the population the core vouches for)."""
    rng = random.Random(seed)
    pl, pool = ValueSource.PREFIX_LIMIT, [decode(1), decode(2), decode(4), decode(8)]
    pool += [spec(b, w) for b in (1, 2, 4, 8) for w in (2, 3, 4)]
    pool += [spec(8, 4, depth=3, aggregate=16, source=pl), spec(4, 4, depth=3, aggregate=8, source=pl),
             spec(8, 3, depth=2, aggregate=12, source=pl), spec(8, 4, depth=3, aggregate=16),
             spec(4, 3, depth=2, aggregate=6), spec(16, 2, aggregate=24)]
    graphs = rng.sample(pool, rng.randint(2, len(pool)))
    timings = [GraphTiming(0 if rng.random() < 0.3 else int(rng.randint(2, 24) * 0.5 * MS), True) for _ in graphs]
    dec, slope = Decoders(), rng.choice([0.0, 0.05])
    positive = rng.random() < 0.7  # else some lanes are worth nothing, and the population is not vouched for
    for slot in range(rng.randint(1, 10)):
        survival = tuple(sorted((rng.choice([1.0, 0.0, rng.random()]) for _ in range(rng.randint(1, 4))),
                                reverse=True))
        free = not positive and rng.random() < 0.5
        dec.handle.append(RequestHandle(slot, slot + 1))
        dec.token_price.append(0.0 if free else rng.choice([1.0, rng.uniform(0.1, 4)]))
        dec.delivery_price.append(0.0 if free else rng.choice([0.0, rng.uniform(0, 2)]))
        dec.age_credit.append(0.0 if free else rng.uniform(0, 1))
        dec.age_slope.append(slope)
        dec.room.append(rng.choice([1, 2, 3, 10_000]))
        dec.survival.append({"learned": survival} if rng.random() < 0.9 else {})
        dec.recency.append(rng.randint(0, 3))
    population = Population(dec, Prompters(), slope * len(dec), rng.choice([1.0, 0.5]), positive=positive)
    described = describe(graphs)
    everything = dataclasses.replace(described, eager=described.groups, bounded=(), speculation_bounded=False,
                                     ragged_padded_by=())
    fast, plain = select(graphs, timings, population, described), select(graphs, timings, population, everything)
    assert (fast is None) == (plain is None)
    if fast is not None:
        assert (fast.graph, fast.lanes, fast.score, fast.log_scale) == \
            (plain.graph, plain.lanes, plain.score, plain.log_scale)


@pytest.mark.parametrize("decoders, winner, general", [(1, "decode_b1", False), (3, "decode_b4", False),
                                                      (5, "decode_b8", True)])
def test_U12_U8_unmeasured_padded_programs_take_no_decision_off_the_flat_path(monkeypatch, decoders, winner,
                                                                             general):
    """Never-run larger batch capacities (decode_b8 and decode_b16 at one stream, for a whole run, and a
    ragged program of batch 16) are padding for the measured smaller program serving the same decoders: the decision is read from the flat
    scores, as it would be without them. An unmeasured program that is not padding (decode_b8 with five
    decoders) still wins by U8 through the general path. A ragged and a prefix-limit program that full
    acceptance would let win, scored at the lanes' low acceptance (entries beside the flat scores, ranked or
    bounded below the leader), leave it on the flat path."""
    from helios.scheduler.select import leader

    graphs = [decode(1), decode(4), decode(8), decode(16), spec(1, 2), spec(4, 2), spec(8, 2),
              spec(4, 2, aggregate=6), spec(2, 2, aggregate=3, source=ValueSource.PREFIX_LIMIT), spec(16, 2, aggregate=24)]
    timings = [GraphTiming(2 * MS, True), GraphTiming(3 * MS, True), GraphTiming(0, False), GraphTiming(0, False),
               GraphTiming(3 * MS, True), GraphTiming(12 * MS, True), GraphTiming(15 * MS, True),
               GraphTiming(5 * MS, True), GraphTiming(5 * MS, True), GraphTiming(0, False)]
    population = Population(_unit_decoders(decoders, {"learned": (0.1, 0.05)}), Prompters(), 0.0, 1.0)
    took = []
    real = leader._general
    monkeypatch.setattr(leader, "_general", lambda *a: took.append(True) or real(*a))
    choice = select(graphs, timings, population)
    assert choice.graph.id == winner and bool(took) == general
    assert len(choice.lanes) == decoders


@pytest.mark.parametrize("remaining, winner, general", [(100, "prefill_b1_c256", False),
                                                        (300, "prefill_b1_c1024", True)])
def test_D4_never_run_larger_prefills_a_waiting_prompt_cannot_use_keep_the_flat_path(monkeypatch, remaining,
                                                                                 winner, general):
    """A 100-token prompt fits the measured 256-token prefill, so the never-run 1024 and 4096 ones would
    be dropped by D4 whichever prompt they took: the decision is read from the flat scores. A 300-token
    prompt reaches past 256: the 1024 program is explored (U8) through the general path, and the 4096 one,
    which reaches no further, is not."""
    from helios.scheduler.select import leader

    graphs = [decode(4), prefill(256), prefill(1024), prefill(4096)]
    timings = [GraphTiming(3 * MS, True), GraphTiming(6 * MS, True), GraphTiming(0, False), GraphTiming(0, False)]
    prm = Prompters()
    for column, value in ((prm.handle, RequestHandle(9, 1)), (prm.start, 0), (prm.remaining, remaining),
                          (prm.to_endpoint, remaining), (prm.price, 1.0), (prm.first_token, 1.0), (prm.recency, 0)):
        column.append(value)
    took = []
    real = leader._general
    monkeypatch.setattr(leader, "_general", lambda *a: took.append(True) or real(*a))
    choice = select(graphs, timings, Population(_unit_decoders(2, {}), prm, 0.0, 1.0))
    assert choice.graph.id == winner and bool(took) == general


def test_U8_an_unmeasured_ragged_program_serving_more_decoders_than_any_smaller_shape_is_explored():
    """Five decoders: the rectangular program of batch four serves only four, so the ragged program of
    batch eight (all five lanes, rows to spare) is not padding and, never measured, wins by U8."""
    graphs = [decode(4), spec(4, 2), spec(8, 2, aggregate=12)]
    timings = [GraphTiming(3 * MS, True), GraphTiming(4 * MS, True), GraphTiming(0, False)]
    population = Population(_unit_decoders(5, {"learned": (0.5,)}), Prompters(), 0.0, 1.0)
    choice = select(graphs, timings, population)
    assert choice.graph is graphs[2] and len(choice.lanes) == 5


@pytest.mark.parametrize("known_depths, winner, general", [(3, "decode_b4", False),
                                                           (1, "spec_b8_w4_d3_p16_prefix_limit", True)])
def test_U12_U8_a_never_run_prefix_limit_program_is_padding_only_where_its_ceilings_are_the_widths(
        monkeypatch, known_depths, winner, general):
    """Three decoders beside a never-run prefix-limit program of batch eight and a measured rectangular one
    of batch four at the same width. Where each lane's survival reaches depth three, the prefix-limit
    program's ceilings are the width, the rectangular program does its work in a smaller shape (U12),
    and plain decode wins, read from the flat scores (at four streams a speculating server met such a
    program in a third of its decisions). Where the lanes know one depth only, their ceilings are two:
    other work, never measured, so it is explored (U8), bound or no bound (the width-one bound must not
    skip it)."""
    from helios.scheduler.select import leader

    graphs = [decode(1), decode(4), spec(4, 4), spec(8, 4, depth=3, aggregate=16, source=ValueSource.PREFIX_LIMIT)]
    timings = [GraphTiming(2 * MS, True), GraphTiming(3 * MS, True), GraphTiming(30 * MS, True), GraphTiming(0, False)]
    decoders = _unit_decoders(3, {"learned": (0.05,) * known_depths})
    population = Population(decoders, Prompters(), 0.0, 1.0, ordered=True, uniform_slope=True, positive=True)
    assert describe(graphs).speculation_bounded
    took = []
    real = leader._general
    monkeypatch.setattr(leader, "_general", lambda *a: took.append(True) or real(*a))
    choice = select(graphs, timings, population)
    assert choice.graph.id == winner and len(choice.lanes) == 3 and bool(took) == general


def test_U12_a_ragged_entry_below_the_flat_leader_still_prunes_it_as_padding():
    """Three decoders at width two fill six rows: the ragged program of aggregate six does the rectangular
    width-two program's work (eight rows) in a smaller shape. The rectangular one is measured faster and
    scores best, but U12 prunes it, so the ragged program wins though its own score is lower."""
    graphs = [decode(4), spec(4, 2), spec(4, 2, aggregate=6)]
    timings = [GraphTiming(int(ms * MS), True) for ms in (4, 5, 6)]
    population = Population(_unit_decoders(3, {"learned": (1.0,)}), Prompters(), 0.0, 1.0)
    rectangular_alone = select(graphs[:2], timings[:2], population)
    choice = select(graphs, timings, population)
    assert rectangular_alone.graph is graphs[1] and rectangular_alone.score == pytest.approx(6 / 5)
    assert choice.graph is graphs[2] and choice.score == pytest.approx(6 / 6)


@pytest.mark.parametrize("mixed_ms, winner", [(5.0, "mixed"), (7.0, "decode")])
def test_U6_mixed_decoders_only_cohort_is_left_out_only_when_a_faster_rectangular_program_takes_it(mixed_ms, winner):
    """Without prompts a mixed program serves decoders only: the same lanes as the decode
    program of its batch, so the faster of the two wins, and the slower is never scored."""
    graphs = [decode(4), mixed(4, 64)]
    timings = [GraphTiming(6 * MS, True), GraphTiming(int(mixed_ms * MS), True)]
    choice = select(graphs, timings, Population(_unit_decoders(4, {}), Prompters(), 0.0, 1.0))
    assert choice.graph.kind.value == winner and choice.score == pytest.approx(4 / min(6.0, mixed_ms))


def test_decode_rows_build_the_lanes_the_constructor_builds():
    """``PlannedLane.decode_rows`` skips ``__init__``; its lanes equal the constructor's field for field
    (a field added to the class but not set there leaves it unset and fails the comparison)."""
    handles = [RequestHandle(slot, slot + 1) for slot in range(5)]
    lengths, expected = [1, 2, 3, 2, 1], [1.0, 1.5, 2.25, 1.75, 1.0]
    built = PlannedLane.decode_rows(handles, lengths, expected)
    plain = [PlannedLane(h, LanePhase.DECODE, query_length=n, expected_tokens=e)
             for h, n, e in zip(handles, lengths, expected)]
    assert built == plain
    assert [dataclasses.astuple(lane) for lane in built] == [dataclasses.astuple(lane) for lane in plain]


@pytest.mark.parametrize("remaining, winner_capacity", [(64, 64), (65, 128), (40, 64)])
def test_U12_a_faster_larger_prefill_program_is_still_padding(remaining, winner_capacity):
    """A prompt of 64 tokens or fewer does the same work in the 64- and the 128-token program:
    the larger one, though measured faster, is padding and pruned (U12); at 65 tokens it is not.
    (The fast leader's pre-check compares the prompt row's tokens with each smaller capacity.)"""
    graphs = [GraphDescriptor(f"prefill_c{c}", GraphKind.PREFILL, 1, prefill_capacity=c) for c in (64, 128)]
    timings = [GraphTiming(5 * MS, True), GraphTiming(4 * MS, True)]
    prm = Prompters()
    prm.handle.append(RequestHandle(0, 1))
    for column, value in ((prm.start, 0), (prm.remaining, remaining), (prm.to_endpoint, remaining),
                          (prm.price, 1.0), (prm.first_token, 0.0), (prm.recency, 0)):
        column.append(value)
    choice = select(graphs, timings, Population(Decoders(), prm, 0.0, 1.0))
    assert choice.graph.prefill_capacity == winner_capacity


def test_U12_a_skipped_mixed_program_still_prunes_a_faster_larger_one():
    """Without prompts, mixed(4, 64) is left unscored (decode(4) takes its lanes faster);
    mixed(8, 256), with no decode(8) beside it, scores best serving the same four decoders as
    padding. The skipped mixed(4, 64) dominates it (U12), so the fast path must not pick it."""
    graphs = [decode(4), mixed(4, 64), mixed(8, 256)]
    timings = [GraphTiming(ms * MS, True) for ms in (3, 5, 2)]
    population = Population(_unit_decoders(4, {}), Prompters(), 0.0, 1.0)
    assert select(graphs[2:], timings[2:], population).score == pytest.approx(2.0)  # 4 lanes in 2 ms
    choice = select(graphs, timings, population)
    assert choice.graph is graphs[0] and choice.score == pytest.approx(4 / 3)


# ---------------------------------------------------------------------------
# Facts the core vouches for in its population (ordered, uniform slope, positive)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, policy, copy_share", [
    ("one family", None, 0.0),
    ("two families", None, 0.4),
    ("output tokens worth nothing", {"output_token_value": 0.0}, 0.3),
])
def test_U5_U8_D8_population_facts_the_core_vouches_for_hold_and_decide_nothing(monkeypatch, name, policy,
                                                                              copy_share):
    """Every snapshot the core plans on is ordered, uniform and positive when it says so, and
    selecting on it without those facts (the selector then checks them itself) decides the same;
    the means and weights it keeps per request are those of the request's estimates then."""
    from plan_regression_cases import random_trace, varied_catalog

    from helios.scheduler import selector as selector_module
    from helios.sim.files import parse_catalog, parse_trace
    from helios.sim.simulator import Simulation, SimulationOptions

    seen = {"ordered": 0, "uniform_slope": 0, "positive": 0, "decisions": 0, "estimates": 0}

    def checking_select(graphs, timings, population, described=None, durations=None):
        d, p = population.decoders, population.prompters
        if population.ordered:
            seen["ordered"] += 1
            assert d.recency == sorted(d.recency) and p.recency == sorted(p.recency)
        if population.uniform_slope:
            seen["uniform_slope"] += 1
            assert len(set(d.age_slope)) <= 1
        for handle, kept in zip(d.handle, d.estimates):  # the probe search's means and weights are current
            acceptance = simulation.scheduler._slots[handle.slot].acceptance
            assert kept == {source: _as_selection_reads(simulation.scheduler, acceptance.by_source[source])
                            for source in kept}
            seen["estimates"] += 1
        if population.positive:
            seen["positive"] += 1
            assert all(price > 0.0 for price in d.token_price)
            assert all(v >= 0.0 for v in d.delivery_price + d.age_credit)
        plain = dataclasses.replace(population, ordered=False, uniform_slope=False, positive=False)
        got, want = select(graphs, timings, population, described, durations), select(graphs, timings, plain)
        if want is None:
            assert got is None
        else:
            seen["decisions"] += 1
            assert (got.graph, got.lanes, got.score, got.prefill_row) == (want.graph, want.lanes, want.score,
                                                                          want.prefill_row)
        return got

    monkeypatch.setattr(selector_module, "select_plan", checking_select)
    trace = random_trace(11, 24, 150.0, copy_share=copy_share, policy=policy)
    simulation = Simulation(parse_catalog(varied_catalog(), name), parse_trace(trace, name),
                            SimulationOptions(until_ns=1_500 * MS))
    simulation.run()
    assert seen["decisions"] > 50 and seen["ordered"] >= seen["decisions"] and seen["estimates"] > 1000
    assert seen["positive"] == (0 if policy else seen["ordered"])
    if copy_share == 0.0:
        assert seen["uniform_slope"] == seen["ordered"]  # one delivery family: one slope, always
    else:
        assert 0 < seen["uniform_slope"] < seen["ordered"]  # two families live at once in some snapshots


def _as_selection_reads(scheduler, estimates):
    """A request's means and weights as the core keeps them for selection and probes: the stored estimates,
    with ``PolicyConfig.extrapolate_unobserved_depths`` continuing the deepest observed depth."""
    from helios.scheduler.speculation import extrapolated_survival

    means, weights = estimates.means_and_weights(scheduler._max_depth)
    if scheduler.policy.extrapolate_unobserved_depths:
        means = extrapolated_survival(means, len(estimates.depths))
    return means, weights
