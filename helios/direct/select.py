"""The direct scheduler's choices: one prefill chunk, or the best decode round.

Decode rounds follow Helios's selection (spec "Useful service and selection"):
the same lane values and U6 score from ``helios.scheduler.utility``, the same
cohort rules (U9 best lanes per batch capacity, exact constrained ragged
cohorts, U10 adaptive orderings), U12 dominance pruning and the U8 tie order.
The loop is written plainly, one graph at a time, with none of Helios's
shared rankings or deferred evaluation: it is the reference a diagnostic
server wants, not a fast one.

Prefill is deliberately simple: the least recently served prompt gets its next
chunk, in the largest prefill program it fills completely (the smallest one
when only a tail is left), alone in its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

from flare_contract.graphs import GENERATION_KINDS, GraphDescriptor, GraphKind
from helios.scheduler.select.choice import Choice
from helios.scheduler.select.population import Population, cumulative_gains
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.types import LanePhase, PlannedLane
from helios.scheduler.utility import (
    AdaptiveLane,
    RankedLanes,
    best_adaptive_cohort,
    best_constrained_cohort,
    decision_log_scale,
    decode_lane_value,
    optimistic_work_score,
    value_rate,
)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One program's best cohort in this decision."""

    graph: GraphDescriptor
    timing: GraphTiming
    score: float  # U6 value rate, or the optimistic work score when unmeasured (U8)
    lanes: tuple[PlannedLane, ...]
    padding: int  # target rows the cohort leaves unused
    recency: int  # latest selection time among its requests (U8: less recently used wins)
    row_search: bool = False  # priced by a row-budget search (constrained ragged or adaptive)
    bound: tuple = ()  # row searches: the rank of the same lanes at full width, which no row budget exceeds

    def rank(self) -> tuple:
        return (not self.timing.known, self.score)  # unmeasured first, then value

    def tie(self) -> tuple:
        known_time = -self.timing.duration_ns if self.timing.known else 0
        # past U8's order, Helios prefers the programs it scores directly, then row searches by their
        # bound (the order it evaluates them in); then catalog order (``max`` keeps the first)
        return (known_time, len(self.lanes), -self.recency, -self.padding, not self.row_search, self.bound)

    def logical(self) -> tuple:
        """U12: what the round does, whatever its physical shape."""
        rows = tuple(sorted((lane.handle.slot, lane.query_length) for lane in self.lanes))
        return (self.graph.kind, self.graph.proposal_depth, rows)

    def capacities(self) -> tuple[int, int, int, int]:
        g = self.graph
        return (g.batch_capacity, g.width, g.target_rows, g.prefill_capacity)


# ---------------------------------------------------------------------------
# Decode rounds
# ---------------------------------------------------------------------------


def decode_candidates(graphs: Sequence[GraphDescriptor], timings: Sequence[GraphTiming],
                      pop: Population) -> list[Candidate]:
    """Every decode and speculative program's best cohort, catalog order (mixed programs are not used)."""
    out = []
    for graph, timing in zip(graphs, timings):
        if graph.kind not in GENERATION_KINDS:
            continue
        found = (_adaptive(graph, timing, pop) if graph.is_prefix_limit
                 else _host_allocated(graph, timing, pop))
        if found is not None:
            out.append(found)
    return out


def best_decode(graphs: Sequence[GraphDescriptor], timings: Sequence[GraphTiming],
                pop: Population) -> tuple[Candidate | None, list[Candidate]]:
    """The winner after dominance pruning and the tie order, and every candidate scored."""
    candidates = decode_candidates(graphs, timings, pop)
    kept = [c for c in candidates if not is_padding(c, candidates)]
    if not kept:
        return None, candidates
    top = max(c.rank() for c in kept)
    return max((c for c in kept if c.rank() == top), key=Candidate.tie), candidates


def as_choice(best: Candidate) -> Choice:
    """Helios's plan-building type, with the decision's common scaling (U7: from the winner's score)."""
    return Choice(best.graph, best.lanes, best.timing, best.score, decision_log_scale(abs(best.score)), None)


def is_padding(c: Candidate, candidates: Sequence[Candidate]) -> bool:
    """U12: another program does the same logical work on smaller capacities."""
    return any(dominates(o, c) for o in candidates)


def dominates(small: Candidate, large: Candidate) -> bool:
    """U12: the same logical work on capacities all no larger and not all equal."""
    a, b = small.capacities(), large.capacities()
    return (small.graph.kind is large.graph.kind and a != b and all(x <= y for x, y in zip(a, b))
            and small.logical() == large.logical())


@dataclass(frozen=True, slots=True)
class _Lane:
    index: int  # into the population's decoders
    length: int  # query length
    expected: float  # expected committed tokens
    value: float  # lane value; includes c*sigma*T when the slopes differ


def _source_and_width(graph: GraphDescriptor) -> tuple[str | None, int]:
    if not graph.draws_proposals:
        return None, 1
    return graph.proposal_source or "learned", min(graph.width, graph.proposal_depth + 1)


def _gains(pop: Population, i: int, source: str) -> Sequence[float] | None:
    d = pop.decoders
    if len(d.gains) == len(d):
        return d.gains[i].get(source)
    survival = d.survival[i].get(source)
    return None if survival is None else cumulative_gains(survival, pop.alpha)


def _eligible(pop: Population, source: str | None) -> list[int]:
    d = pop.decoders
    return [i for i in range(len(d)) if d.room[i] >= 1 and (source is None or _gains(pop, i, source) is not None)]


def _expected(pop: Population, i: int, source: str | None, length: int) -> float:
    """1 + the selection gains of the first length-1 drafts, capped by the room (S5)."""
    if source is None:
        return 1.0
    g = _gains(pop, i, source)
    e = 1.0 + (g[length - 1] if length <= len(g) else g[-1])
    return e if e < pop.decoders.room[i] else float(pop.decoders.room[i])


def _ranked_lanes(graph: GraphDescriptor, timing: GraphTiming, pop: Population) -> tuple[list[_Lane], list[float]]:
    """Eligible lanes best first, and their c*sigma slopes (zeros when already priced into the values)."""
    d = pop.decoders
    source, width = _source_and_width(graph)
    idx = _eligible(pop, source)
    slopes = [d.age_slope[i] for i in idx]
    timed = timing.known and len(set(slopes)) > 1  # mixed families: the order depends on T
    t_ms = timing.duration_ns / 1e6
    lanes = []
    for i, slope in zip(idx, slopes):
        length = min(width, d.room[i])
        expected = _expected(pop, i, source, length)
        value = expected * d.token_price[i] + decode_lane_value(0.0, 0.0, d.delivery_price[i], 1.0, d.age_credit[i])
        lanes.append(_Lane(i, length, expected, value + t_ms * slope if timed else value))
    ranked = RankedLanes.rank([lane.value for lane in lanes], [d.recency[i] for i in idx])
    ordered = [lanes[j] for j in ranked.order]
    return ordered, [0.0 if timed else slopes[j] for j in ranked.order]


def _score(value: float, timing: GraphTiming, pop: Population) -> float:
    if not timing.known:
        return optimistic_work_score(value)
    return value_rate(value, timing.duration_ns / 1e6, pop.active_age_price)


def _host_allocated(graph: GraphDescriptor, timing: GraphTiming, pop: Population) -> Candidate | None:
    """Rectangular and QueryLength programs: the best B lanes, or the best fitting B and P (U9)."""
    ordered, slopes = _ranked_lanes(graph, timing, pop)
    if not ordered:
        return None
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    chosen = ordered[: graph.batch_capacity]
    total = sum(lane.value for lane in chosen) + sum(slopes[: len(chosen)]) * t_ms
    row_search = graph.ragged and sum(lane.length for lane in chosen) > graph.target_rows
    bound = (not timing.known, _score(total, timing, pop)) if row_search else ()
    if row_search:
        chosen, total = _constrained(graph, ordered, slopes, t_ms)
    if not chosen:
        return None
    lanes = tuple(PlannedLane(pop.decoders.handle[lane.index], LanePhase.DECODE, query_length=lane.length,
                              expected_tokens=lane.expected) for lane in chosen)
    padding = graph.target_rows - sum(lane.length for lane in chosen)
    return Candidate(graph, timing, _score(total, timing, pop), lanes, padding, _recency(pop, chosen), row_search,
                     bound)


def _constrained(graph, ordered: list[_Lane], slopes: list[float], t_ms: float) -> tuple[list[_Lane], float]:
    """Exact best cohort within B lanes and P rows; values are differences of the ranked prefix
    sums, as Helios prices them, so equal requests stay equal."""
    base = list(accumulate((lane.value for lane in ordered), initial=0.0))
    slope = list(accumulate(slopes, initial=0.0))
    values = [base[j + 1] - base[j] + t_ms * (slope[j + 1] - slope[j]) for j in range(len(ordered))]
    total, picks = best_constrained_cohort(values, [lane.length for lane in ordered],
                                           graph.batch_capacity, graph.target_rows)
    return [ordered[j] for j in sorted(picks)], total


def _adaptive(graph: GraphDescriptor, timing: GraphTiming, pop: Population) -> Candidate | None:
    """PrefixLimit programs: cohort prefixes under U10's three orderings, priced by causal allocation."""
    d = pop.decoders
    source, width = _source_and_width(graph)
    idx = [i for i in range(len(d)) if d.room[i] >= 1 and d.survival[i].get(source) is not None]
    if not idx:
        return None
    lanes = []
    for i in idx:
        ceiling = max(1, min(width, d.room[i]))
        s = tuple(d.survival[i][source][: ceiling - 1])
        base = decode_lane_value(1.0, d.token_price[i], d.delivery_price[i], 1.0, d.age_credit[i])
        lanes.append(AdaptiveLane(base, d.token_price[i], s, tuple(p ** pop.alpha for p in s), d.handle[i].slot))
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    value, chosen, taken = best_adaptive_cohort(lanes, graph.batch_capacity, graph.target_rows,
                                                extra=[t_ms * d.age_slope[i] for i in idx])
    if not chosen:
        return None
    planned = tuple(
        PlannedLane(d.handle[idx[j]], LanePhase.DECODE, query_length=lanes[j].ceiling, ceiling=lanes[j].ceiling,
                    expected_tokens=min(float(d.room[idx[j]]), 1.0 + sum(lanes[j].weights[: rows - 1])))
        for j, rows in zip(chosen, taken))
    recency = max(d.recency[idx[j]] for j in chosen)
    return Candidate(graph, timing, _score(value, timing, pop), planned, graph.target_rows - sum(taken), recency,
                     row_search=True, bound=_full_width_rank(graph, timing, pop))


def _full_width_rank(graph: GraphDescriptor, timing: GraphTiming, pop: Population) -> tuple:
    """The best min(B, P) lanes valued at the program's full logical width."""
    ordered, slopes = _ranked_lanes(graph, timing, pop)
    k = min(graph.batch_capacity, graph.target_rows, len(ordered))
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    total = sum(lane.value for lane in ordered[:k]) + sum(slopes[:k]) * t_ms
    return (not timing.known, _score(total, timing, pop))


def _recency(pop: Population, chosen: Sequence[_Lane]) -> int:
    return max(pop.decoders.recency[lane.index] for lane in chosen)


# ---------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------


def chunk_program(graphs: Sequence[GraphDescriptor], remaining: int,
                  kind: GraphKind = GraphKind.PREFILL) -> GraphDescriptor | None:
    """The largest prefill capacity (of ``kind``: scored prompts take SCORED_PREFILL programs, spec C1) the
    prompt fills, else the smallest (a tail); one row is enough."""
    prefills = [g for g in graphs if g.kind is kind]
    if not prefills:
        return None
    fitting = [g for g in prefills if g.prefill_capacity <= remaining]
    if fitting:
        capacity = max(g.prefill_capacity for g in fitting)
    else:
        capacity = min(g.prefill_capacity for g in prefills)
    same = [g for g in prefills if g.prefill_capacity == capacity]
    return min(same, key=lambda g: g.batch_capacity)


def prefill_lane(pop: Population, graph: GraphDescriptor) -> PlannedLane:
    """The next chunk of the least recently served prompt (population order)."""
    p = pop.prompters
    tokens = min(graph.prefill_capacity, p.remaining[0])
    finishes = tokens == p.remaining[0]
    return PlannedLane(p.handle[0], LanePhase.PROMPT, prompt_start=p.start[0], prompt_tokens=tokens,
                       expected_tokens=1.0 if finishes else 0.0, finishes_prompt=finishes)
