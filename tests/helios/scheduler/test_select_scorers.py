"""U6 in one place: every fast scoring path of selection gives ``utility.value_rate``'s floats.

The group scorers (``select/scorers.py``) and the per-graph candidates
(``select/candidates.py``) score a measured program from shared rankings
without calling ``value_rate``; they promise the same operations in the same
order, so the floats are equal, not merely close. Each path is checked here
on random populations against ``value_rate`` of the value of the cohort its
flat payload names, and the fast leader's score against ``value_rate`` of the
value its lanes earn, summed independently (there the summation order
differs, so the tolerance is numerics.py's reordering bound).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from sched_harness import MS, decode, mixed, prefill, spec

from flare_contract.graphs import GraphKind
from helios.scheduler.select.candidates import generation_candidate, mixed_candidate, prefill_candidate, score_group
from helios.scheduler.select.catalog import GroupKind, describe
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Decoders, Population, Prompters, cumulative_gains
from helios.scheduler.select.rankings import DecisionRankings
from helios.scheduler.select.scorers import MISSING, Out, rate, score
from helios.scheduler.select.timing import GraphTiming, durations_ms
from helios.scheduler.types import LanePhase, RequestHandle
from helios.scheduler.utility import optimistic_work_score, value_rate
from tests.helios.numerics import reorder_tolerance

GRAPHS = (
    [decode(b) for b in (1, 2, 4, 8)]
    + [spec(b, w) for b in (1, 4, 8) for w in (2, 3, 5)]
    + [prefill(c, b) for c in (16, 64, 256) for b in (1, 2)]
    + [mixed(b, c) for b in (2, 4) for c in (16, 64)]
    + [mixed(b, 64, w, w - 1) for b in (2, 4) for w in (2, 3)]
)


def population(rng: random.Random, *, decoders: int, prompters: int, families: int) -> Population:
    """Random prices, room, survival and ages; ``families`` distinct age slopes (1: uniform)."""
    d, p = Decoders(), Prompters()
    slopes = [rng.uniform(0.0, 0.3) for _ in range(families)]
    for slot in range(decoders):
        d.handle.append(RequestHandle(slot, slot + 1))
        d.token_price.append(rng.uniform(0.2, 3.0))
        d.delivery_price.append(rng.uniform(0.0, 2.0))
        d.age_credit.append(rng.uniform(0.0, 1.5))
        d.age_slope.append(slopes[slot % families])
        d.room.append(rng.choice([1, 2, 3, 50]))
        survival = sorted((rng.random() for _ in range(rng.randint(1, 5))), reverse=True)
        d.survival.append({"learned": tuple(survival)})
        d.recency.append(slot)
    for i in range(prompters):
        slot = 100 + i
        remaining = rng.choice([5, 16, 40, 64, 300])
        p.handle.append(RequestHandle(slot, slot + 1))
        p.start.append(0)
        p.remaining.append(remaining)
        p.to_endpoint.append(remaining)
        p.price.append(rng.uniform(0.5, 2.0))
        p.first_token.append(rng.uniform(0.0, 4.0))
        p.recency.append(slot)
    return Population(d, p, rng.uniform(0.0, 0.5) * (decoders > 0), rng.choice([0.5, 1.0, 2.0]))


def timings(rng: random.Random) -> list[GraphTiming]:
    return [GraphTiming(int(rng.uniform(1.0, 40.0) * MS), True) for _ in GRAPHS]


CASES = [(seed, n, m, families) for seed in range(12) for n, m, families in ((6, 3, 1), (9, 2, 2), (3, 0, 1), (0, 4, 1))]


def scored(pop: Population, timed: list[GraphTiming]) -> tuple[DecisionRankings, Out]:
    """Every group scored into one ``Out``, as ``select`` scores them when nothing is skipped."""
    described = describe(GRAPHS)
    sel = DecisionRankings(pop, described)
    sel.t_ms = durations_ms(timed)
    sel.derived = described.per_durations.current(sel.t_ms)
    out = Out(len(GRAPHS))
    for group in described.groups:
        score_group(sel, group, GRAPHS, timed, out)
    return sel, out


def expected_rate(sel: DecisionRankings, index: int, timing: GraphTiming) -> float | None:
    """``value_rate`` of the cohort the program's flat payload names, from the same rankings."""
    graph, info, t = GRAPHS[index], sel.infos[index], timing.duration_ns / 1e6
    active = sel.pop.active_age_price
    if graph.kind is GraphKind.PREFILL:
        ranked = sel.prompt_ranking(graph.prefill_capacity).ranked
        k = min(graph.batch_capacity, len(ranked))
        return value_rate(ranked.prefix[k], t, active) if k else None
    r = sel.decode_ranking(info.source, info.width, timing)
    if graph.kind is not GraphKind.MIXED and _padded(sel, index, r.size):
        return None  # U12 prunes it: written nowhere
    k = min(graph.batch_capacity, r.size)
    decoders_only = value_rate(r.ranked.prefix[k] + r.slope_prefix[k] * t, t, active) if k else None
    if graph.kind is not GraphKind.MIXED or not sel.pop.prompters.handle:
        return decoders_only
    k2 = min(graph.batch_capacity - 1, r.size)
    top = sel.prompt_ranking(graph.prefill_capacity).ranked.top()
    with_row = value_rate(top + r.ranked.prefix[k2] + r.slope_prefix[k2] * t, t, active)
    return with_row if decoders_only is None or with_row >= decoders_only else decoders_only


def _padded(sel: DecisionRankings, index: int, n: int) -> bool:
    """U12 from the descriptors: a rectangular program of the same kind, depth, source and logical width,
    capacities no larger and not all equal, serves all ``n`` decoders too (so the same lanes)."""
    graph, info = GRAPHS[index], sel.infos[index]
    return any(
        other.kind is graph.kind and other.proposal_depth == graph.proposal_depth and not other.ragged
        and not o.prefix_limit and (o.source, o.width) == (info.source, info.width)
        and o.capacities != info.capacities and all(a <= b for a, b in zip(o.capacities, info.capacities))
        and other.batch_capacity >= n
        for other, o in zip(GRAPHS, sel.infos))


@pytest.mark.parametrize("seed, decoders, prompters, families", CASES)
def test_U6_every_group_scorer_gives_value_rate_floats(seed, decoders, prompters, families):
    """Rectangular (uniform and mixed age slopes), prefill and mixed (decoders only or with a prompt
    row) programs: the flat score is ``value_rate`` of the named cohort, bit for bit."""
    rng = random.Random(seed)
    pop, timed = population(rng, decoders=decoders, prompters=prompters, families=families), timings(rng)
    sel, out = scored(pop, timed)
    kinds = set()
    for index, graph in enumerate(GRAPHS):
        want = expected_rate(sel, index, timed[index])
        entry = out.entry(index)  # (rank key, index, cohort): measured, so the rank key is (False, score)
        if want is None:
            assert entry is None, graph.id
            continue
        assert entry[0] == (False, want), (graph.id, entry[0], want)
        assert (out.scores[index] != MISSING) == (families == 1 or graph.kind is not GraphKind.MIXED)
        kinds.add(sel.infos.group_of[index].kind)
    if decoders and prompters and families == 1:
        assert kinds == {GroupKind.RECTANGULAR, GroupKind.PREFILL, GroupKind.MIXED}


@pytest.mark.parametrize("seed, decoders, prompters, families", CASES)
def test_U6_per_graph_candidates_give_the_group_scorers_floats(seed, decoders, prompters, families):
    """``evaluate_scores``'s per-graph candidates score each program as its group does (one U6 home)."""
    rng = random.Random(seed)
    pop, timed = population(rng, decoders=decoders, prompters=prompters, families=families), timings(rng)
    sel, out = scored(pop, timed)
    per_kind = {GraphKind.DECODE: generation_candidate, GraphKind.SPECULATIVE: generation_candidate,
                GraphKind.PREFILL: prefill_candidate, GraphKind.MIXED: mixed_candidate}
    for index, graph in enumerate(GRAPHS):
        found = per_kind[graph.kind](sel, index, graph, timed[index])
        rectangular = graph.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE)
        if found is None or rectangular and _padded(sel, index, len(pop.decoders.handle)):
            assert out.entry(index) is None, graph.id  # padded: the group leaves to U12 what it would prune
        else:
            assert found[0] == out.entry(index)[0], graph.id


def test_U6_U8_rate_and_score_are_value_rate_and_the_optimistic_work():
    rng = random.Random(5)
    for _ in range(2000):
        value, slope, t, active = rng.uniform(0, 500), rng.uniform(0, 3), rng.uniform(0.05, 80), rng.uniform(0, 4)
        assert rate(value, slope, t, active) == value_rate(value + slope * t, t, active)
        assert score(value, slope, GraphTiming(int(t * MS), True), active) == value_rate(
            value + slope * (int(t * MS) / 1e6), int(t * MS) / 1e6, active)
        assert score(value, slope, GraphTiming(0, False), active) == optimistic_work_score(value)


def lane_value(pop: Population, lane, alpha: float) -> float:
    """What a lane earns, from the population's columns alone (S5, U13): not from any ranking."""
    if lane.phase is LanePhase.PROMPT:
        p = pop.prompters
        i = p.handle.index(lane.handle)
        return lane.prompt_tokens * p.price[i] + (p.first_token[i] if lane.finishes_prompt else 0.0)
    d = pop.decoders
    i = d.handle.index(lane.handle)
    gains = cumulative_gains(d.survival[i]["learned"], alpha)
    n = lane.query_length
    expected = min(1.0 + (gains[n - 1] if n <= len(gains) else gains[-1]), float(d.room[i])) if n > 1 else 1.0
    return expected * d.token_price[i] + d.delivery_price[i] + d.age_credit[i]


@pytest.mark.parametrize("seed, decoders, prompters, families", CASES)
def test_U6_the_fast_leader_scores_value_rate_of_what_its_lanes_earn(seed, decoders, prompters, families):
    """``select``'s winner (the fast leader path when it applies) scores ``value_rate`` of its lanes'
    value plus their c*sigma*T, summed here lane by lane: equal within the reordering bound."""
    rng = random.Random(seed)
    pop, timed = population(rng, decoders=decoders, prompters=prompters, families=families), timings(rng)
    choice = select(GRAPHS, timed, pop)
    if choice is None:
        assert not decoders and not prompters
        return
    t = choice.timing.duration_ns / 1e6
    slots = {h.slot: i for i, h in enumerate(pop.decoders.handle)}
    terms = [lane_value(pop, lane, pop.alpha) for lane in choice.lanes]
    terms += [pop.decoders.age_slope[slots[lane.handle.slot]] * t
              for lane in choice.lanes if lane.phase is LanePhase.DECODE]
    want = value_rate(math.fsum(terms), t, pop.active_age_price)
    magnitude = sum(abs(x) for x in terms) / t + 0.5 * t * pop.active_age_price
    assert choice.score == pytest.approx(want, rel=0, abs=reorder_tolerance(torch.float64, len(terms) + 3) * magnitude)
