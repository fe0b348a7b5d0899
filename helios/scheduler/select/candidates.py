"""Candidates per kind: each graph's best cohort (U9, U10, U13, P7), scored, built on demand.

A measured rectangular, prefill or mixed program is scored by its group
(``scorers.py``) and kept as its cohort (``scorers.Cohort``); ``BUILT`` turns the few that can
still decide the outcome into full ``Candidate``s (lanes, padding, logical
key). Ragged and prefix-limit programs search their own cohorts here
(``CANDIDATES``); the costly searches come back ``Deferred`` behind an upper
bound. ``Scored`` holds one decision's entries and builds candidates lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Sequence

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler.select import dominance
from helios.scheduler.select.catalog import Group, GroupKind
from helios.scheduler.select.population import Decoders, Population, Prompters
from helios.scheduler.select.rankings import AdaptiveLanes, DecodeRanking, PromptRanking, PromptRow, DecisionRankings
from helios.scheduler.select.scorers import Out, mixed_entry, score, score_mixed, score_prefill, score_rectangular
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.types import LanePhase, PlannedLane
from helios.scheduler.utility import (
    AdaptiveLane,
    adaptive_orderings,
    best_adaptive_cohort,
    best_constrained_cohort,
    decode_lane_value,
    optimistic_work_score,
    ordering_prefix_values,
    value_rate,
)


@dataclass(slots=True)
class Candidate:
    index: int  # position in the catalog
    graph: GraphDescriptor
    timing: GraphTiming
    score: float
    served: int
    padding: int
    logical: Callable[[], tuple] | tuple  # U12: what the candidate does, independent of its physical shape
    build: Callable[[], tuple[tuple[PlannedLane, ...], int | None]]
    recency: int = 0

    def rank_key(self) -> tuple:
        return (self.timing.known is False, self.score)

    def tie_key(self) -> tuple:
        known_time = -self.timing.duration_ns if self.timing.known else 0
        return (known_time, self.served, -self.recency, -self.padding)

    def logical_key(self) -> tuple:
        key = self.logical
        return key() if callable(key) else key


@dataclass(frozen=True, slots=True)
class Deferred:
    """An expensive candidate, evaluated only if its upper bound can still win."""

    bound: tuple  # an upper bound of the candidate's rank_key()
    make: Callable[[], "Candidate | None"]


def decode_lanes(sel: DecisionRankings, r: DecodeRanking, k: int) -> list[PlannedLane]:
    """The best ``k`` members of ``r`` as decode lanes (ranking order); a winner may hold 64."""
    handles = map(sel.pop.decoders.handle.__getitem__, r.members[:k])
    return PlannedLane.decode_rows(handles, r.lengths[:k], r.expected)


def _prompt_lane(sel: DecisionRankings, i: int, tokens: int) -> PlannedLane:
    p = sel.pop.prompters
    finishes = tokens == p.remaining[i]
    return PlannedLane(
        handle=p.handle[i],
        phase=LanePhase.PROMPT,
        prompt_start=p.start[i],
        prompt_tokens=tokens,
        expected_tokens=1.0 if finishes else 0.0,
        finishes_prompt=finishes,
    )


# -- decode and speculative ---------------------------------------------------


def generation_candidate(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Decode and speculative programs: rectangular, constrained ragged or adaptive.

    A rectangular cohort is scored here and built only if needed
    (:func:`built_generation`). Constrained and adaptive cohorts are costlier
    to search, so they come back as a ``Deferred`` carrying an upper bound: the
    rectangular value of the same lanes at full width, which no row budget can
    exceed.
    """
    info = sel.infos[index]
    r = sel.decode_ranking(info.source, info.width, timing)
    if not r.size:
        return None
    active = sel.pop.active_age_price
    if info.prefix_limit:
        k, base = r.ranked.best(min(graph.batch_capacity, graph.target_rows))
        bound = (not timing.known, score(base, r.slope_prefix[k], timing, active))
        return Deferred(bound, lambda: _adaptive_candidate(sel, index, graph, timing))
    k, base = r.ranked.best(graph.batch_capacity)
    if graph.ragged and r.length_prefix_at(k) > graph.target_rows:
        bound = (not timing.known, score(base, r.slope_prefix[k], timing, active))
        return Deferred(bound, lambda: _constrained_candidate(sel, index, graph, timing, r))
    return (not timing.known, score(base, r.slope_prefix[k], timing, active)), index, r


def built_generation(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming, value: float,
                     r: DecodeRanking) -> Candidate:
    k = r.decoders_served(graph)
    return Candidate(
        index=index,
        graph=graph,
        timing=timing,
        score=value,
        served=k,
        padding=graph.target_rows - r.length_prefix_at(k),
        logical=lambda: (graph.kind, graph.proposal_depth, r.logical(k)),
        build=lambda: (tuple(decode_lanes(sel, r, k)), None),
    )


def _cohort_score(total: float, timing: GraphTiming, active: float) -> float:
    t_ms = timing.duration_ns / 1e6
    return value_rate(total, t_ms, active) if timing.known else optimistic_work_score(total)


def _constrained_candidate(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming,
                           r: DecodeRanking) -> Candidate | None:
    """Host-allocated ragged program whose P binds: exact best cohort fitting B and P (U9)."""
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    base, slope = r.ranked.prefix, r.slope_prefix
    values = [base[j + 1] - base[j] + t_ms * (slope[j + 1] - slope[j]) for j in range(r.size)]
    total, chosen = best_constrained_cohort(values, r.lengths, graph.batch_capacity, graph.target_rows)
    if not chosen:
        return None
    chosen = tuple(sorted(chosen))  # keep ranking order for the lanes
    rows = sum(r.lengths[j] for j in chosen)

    def build():
        d = sel.pop.decoders
        return tuple(
            PlannedLane(handle=d.handle[r.members[j]], phase=LanePhase.DECODE, query_length=r.lengths[j],
                        expected_tokens=r.expected[j])
            for j in chosen
        ), None

    logical = (graph.kind, graph.proposal_depth, tuple(sorted((r.members[j], r.lengths[j]) for j in chosen)))
    return Candidate(index, graph, timing, _cohort_score(total, timing, sel.pop.active_age_price), len(chosen),
                     graph.target_rows - rows, logical, build)


def _adaptive_lanes(sel: DecisionRankings, source: str, width: int) -> AdaptiveLanes:
    """Prefix-limit lanes for one (source, logical width), built once per decision."""
    key = (source, width)
    cached = sel.adaptive_lanes.get(key)
    if cached is not None:
        return cached
    d, alpha = sel.pop.decoders, sel.pop.alpha
    members, lanes, slopes = [], [], []
    for i in range(len(d)):
        survival = d.survival[i].get(source)
        if survival is None or d.room[i] < 1:
            continue
        ceiling = max(1, min(width, d.room[i]))
        s = tuple(survival[: ceiling - 1])
        base = decode_lane_value(1.0, d.token_price[i], d.delivery_price[i], 1.0, d.age_credit[i])
        members.append(i)
        lanes.append(AdaptiveLane(base, d.token_price[i], s, tuple(p ** alpha for p in s), d.handle[i].slot))
        slopes.append(d.age_slope[i])
    cached = sel.adaptive_lanes[key] = AdaptiveLanes(members, lanes, slopes, adaptive_orderings(lanes))
    return cached


def _adaptive_candidate(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming) -> Candidate | None:
    """Device-allocated program: cohort prefixes under three orderings (U10)."""
    info = sel.infos[index]
    found = _adaptive_lanes(sel, info.source, info.width)
    if not found.lanes:
        return None
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    plain, key = found.lanes, (info.source, info.width)

    def prefix_values(name, order, rows, limit):
        cached = sel.adaptive_prefixes.get((key, name, rows))
        if cached is None or len(cached) < limit:
            cached = sel.adaptive_prefixes[(key, name, rows)] = ordering_prefix_values(plain, order, rows, limit)
        return cached

    value, chosen, taken = best_adaptive_cohort(
        plain, graph.batch_capacity, graph.target_rows, orders=found.orders,
        extra=[t_ms * slope for slope in found.slopes], prefix_values=prefix_values,
    )
    if not chosen:
        return None
    d = sel.pop.decoders

    def build():
        out = []
        for j, rows in zip(chosen, taken):
            i, lane = found.members[j], plain[j]
            expected = min(float(d.room[i]), 1.0 + sum(lane.weights[: rows - 1]))
            out.append(PlannedLane(d.handle[i], LanePhase.DECODE, query_length=lane.ceiling,
                                   ceiling=lane.ceiling, expected_tokens=expected))
        return tuple(out), None

    logical = (graph.kind, graph.proposal_depth, tuple((found.members[j], plain[j].ceiling) for j in chosen))
    return Candidate(index, graph, timing, _cohort_score(value, timing, sel.pop.active_age_price), len(chosen),
                     graph.target_rows - sum(taken), logical, build)


# -- prefill ------------------------------------------------------------------


def prefill_candidate(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Prompt rows earn the tokens they can actually consume (U13).

    Each of the B rows serves one prompter and consumes up to the graph's
    prompt capacity; unused capacity is padding and earns nothing.
    """
    prompts = sel.prompt_ranking(graph.prefill_capacity)
    k, base = prompts.ranked.best(graph.batch_capacity)
    if k == 0:
        return None
    return (not timing.known, score(base, 0.0, timing, sel.pop.active_age_price)), index, prompts


def built_prefill(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming, value: float,
                  prompts: PromptRanking) -> Candidate:
    tokens, k = prompts.tokens, prompts.served(graph)
    rows = prompts.ranked.order[:k]
    used = sum(tokens[i] for i in rows)
    return Candidate(
        index=index,
        graph=graph,
        timing=timing,
        score=value,
        served=k,
        padding=graph.prefill_capacity * graph.batch_capacity - used,
        logical=lambda: (graph.kind, tuple(sorted((i, tokens[i]) for i in rows))),
        build=lambda: (tuple(_prompt_lane(sel, i, tokens[i]) for i in rows), None),
    )


# -- scored prefill -----------------------------------------------------------


def scored_rankings(sel: DecisionRankings) -> DecisionRankings:
    """The decision's rankings of the prompters whose prompt must be scored (``Population.scored``), once.

    They are prompters like any other (U13's value, the same prices), ranked apart so that their
    lanes go only to scored-prefill programs and nobody else's do (spec C1).
    """
    if sel.scored is None:
        pop = sel.pop
        sub = Population(Decoders(), pop.scored or Prompters(), pop.active_age_price, pop.alpha, ordered=pop.ordered)
        sel.scored = DecisionRankings(sub, sel.infos)
    return sel.scored


def scored_prefill_candidate(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """A scored-prefill program: a prefill program over the scored prompters only."""
    if not sel.pop.scored:
        return None
    return prefill_candidate(scored_rankings(sel), index, graph, timing)


def built_scored_prefill(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming,
                         value: float, prompts: PromptRanking) -> Candidate:
    return built_prefill(scored_rankings(sel), index, graph, timing, value, prompts)


# -- mixed --------------------------------------------------------------------


def mixed_candidate(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Best decode-only cohort vs best prompt row plus the best B-1 decoders (P7)."""
    info = sel.infos[index]
    untimed = sel.decode_ranking(info.source, info.width)
    return mixed_entry(sel, index, graph, timing, untimed, sel.prompt_ranking(graph.prefill_capacity))


def built_mixed(sel: DecisionRankings, index: int, graph: GraphDescriptor, timing: GraphTiming, value: float,
                cohort: DecodeRanking | PromptRow) -> Candidate:
    """A mixed program's candidate: decoders only (its ``DecodeRanking``) or with a ``PromptRow``."""
    k = cohort.decoders_served(graph)
    if type(cohort) is PromptRow:
        r, prompt, tokens = cohort.decoders, cohort.row, cohort.prompts.tokens
    else:
        r, prompt, tokens = cohort, None, None
    rows = r.length_prefix_at(k) + (tokens[prompt] if prompt is not None else 0)

    def build():
        lanes = decode_lanes(sel, r, k)
        if prompt is None:
            return tuple(lanes), None
        return (_prompt_lane(sel, prompt, tokens[prompt]), *lanes), 0

    prompt_key = None if prompt is None else (prompt, tokens[prompt])
    served = k + (prompt is not None)
    return Candidate(index, graph, timing, value, served, graph.max_packed_tokens - rows,
                     lambda: (graph.kind, graph.proposal_depth, prompt_key, r.logical(k)), build)


CANDIDATES = {
    GraphKind.DECODE: generation_candidate,
    GraphKind.SPECULATIVE: generation_candidate,
    GraphKind.PREFILL: prefill_candidate,
    GraphKind.SCORED_PREFILL: scored_prefill_candidate,
    GraphKind.MIXED: mixed_candidate,
}

BUILT = {
    GraphKind.DECODE: built_generation,
    GraphKind.SPECULATIVE: built_generation,
    GraphKind.PREFILL: built_prefill,
    GraphKind.SCORED_PREFILL: built_scored_prefill,
    GraphKind.MIXED: built_mixed,
}


# -- groups -------------------------------------------------------------------


def _score_one_by_one(sel: DecisionRankings, group: Group, graphs: Sequence[GraphDescriptor], timings, out: Out) -> None:
    """Ragged and prefix-limit programs: their own candidate functions (which may defer).

    A ragged program whose rows all fit serves all n decoders where a rectangular program of its ranking
    with batch >= n serves them too: U12 prunes it (``CatalogInfo.ragged_padded_by``), so it is not written.
    So is a prefix-limit program whose rows cannot bind (n lanes of at most its logical width each fit its
    P): where every lane adds value (``Population.positive``), its cohort search takes all n at their full
    ceilings (``utility.best_adaptive_cohort``), the rectangular program's work. Unmeasured, such programs
    would otherwise send every low-concurrency decision down the general path (a never-run prefix-limit
    program of batch eight at four streams, in a third of a speculating server's decisions).
    """
    padded_by = sel.infos.ragged_padded_by
    for index in group.members:
        graph = graphs[index]
        found = CANDIDATES[graph.kind](sel, index, graph, timings[index])
        if found is None:
            continue
        if padded_by and padded_by[index]:
            if type(found) is tuple:
                if padded_by[index] >= found[2].size:
                    continue  # found[2]: the ranking whose best min(B, n) lanes it serves, all n of them here
            elif _prefix_limit_padding(sel, index):
                continue
        out.entries[index] = found


def _prefix_limit_padding(sel: DecisionRankings, index: int) -> bool:
    """Whether U12 prunes prefix-limit program ``index`` whatever its cohort search finds: a rectangular
    program of its ranking with batch >= n (``CatalogInfo.ragged_padded_by``) serves the same n lanes at
    the same query lengths. That holds where every lane adds value (``Population.positive``: with its rows
    unable to bind, the search takes all n; they cannot, since that dominator's B x W rows, at least n x W,
    are no more than its P) and each lane's ceiling is its rectangular query length min(W, room) (its
    survival reaches that deep: a lane with fewer known depths gets a shorter ceiling, and a prefix-limit
    program serving it is other work)."""
    info = sel.infos[index]
    if not (info.prefix_limit and sel.pop.positive):
        return False
    r = sel.decode_ranking(info.source, info.width)  # built by the candidate already
    if sel.infos.ragged_padded_by[index] < r.size:
        return False
    d, source, width = sel.pop.decoders, info.source, info.width
    return all(len(d.survival[i][source]) >= min(width, d.room[i]) - 1 for i in r.members)


SCORERS = {  # how each kind of group scores its members into an ``Out``
    GroupKind.RECTANGULAR: score_rectangular,
    GroupKind.PREFILL: score_prefill,
    GroupKind.MIXED: score_mixed,
    GroupKind.ONE_BY_ONE: _score_one_by_one,
}


def score_group(sel: DecisionRankings, group: Group, graphs: Sequence[GraphDescriptor], timings, out: Out) -> None:
    """Score every member of ``group`` into ``out``, by the group's kind."""
    SCORERS[group.kind](sel, group, graphs, timings, out)


# -- one decision's entries ---------------------------------------------------


class Scored:
    """Every graph's candidate of one decision, scored; full candidates are built on demand.

    Scoring all graphs is the hot loop, so it keeps one small entry per graph,
    ``(rank key, catalog index, payload)``: the payload is the cohort the
    kind's builder reads, or an already built ``Candidate`` (deferred ones).
    Only the candidates that can still decide the outcome -- the best ranked,
    and the smaller shapes that might prune them (U12) -- are ever built.
    """

    def __init__(self, sel: DecisionRankings, graphs: Sequence[GraphDescriptor], timings: Sequence[GraphTiming],
                 by_index=None) -> None:
        self.sel = sel
        self.graphs = graphs
        self.timings = timings
        self.entries: list[tuple] = []
        self.by_index = {} if by_index is None else by_index  # entries by catalog index (pruning checks read it)
        self.built: dict[int, Candidate] = {}
        self._leaders: list[tuple] | None = None  # best_undominated() of the current entries

    def add_all(self, entries: list[tuple]) -> None:
        self.entries.extend(entries)
        self.by_index.update(zip(map(itemgetter(1), entries), entries))
        self._leaders = None

    def add_built(self, c: Candidate) -> None:
        self.built[c.index] = c
        entry = (c.rank_key(), c.index, c)
        self.entries.append(entry)
        self.by_index[c.index] = entry
        self._leaders = None

    def drop(self, index: int) -> None:
        del self.by_index[index]
        self.entries = [e for e in self.entries if e[1] != index]
        self._leaders = None

    def candidate(self, entry: tuple) -> Candidate:
        rank, index, payload = entry
        c = self.built.get(index)
        if c is None:
            graph = self.graphs[index]
            c = self.built[index] = BUILT[graph.kind](self.sel, index, graph, self.timings[index], rank[1], payload)
        return c

    def served(self, entry: tuple) -> int:
        """Lanes the entry's candidate serves, read from its payload without building it."""
        _, index, payload = entry
        if isinstance(payload, Candidate):
            return payload.served
        return payload.served(self.graphs[index])

    def best_undominated(self) -> list[tuple]:
        """``dominance.undominated_leaders`` of the current entries, kept until they change."""
        if self._leaders is None:
            self._leaders = dominance.undominated_leaders(self)
        return self._leaders


class FlatIndex:
    """``Scored.by_index`` read straight from ``Out`` (the fast path builds no dict)."""

    __slots__ = ("out",)

    def __init__(self, out: Out) -> None:
        self.out = out

    def get(self, index: int):
        found = self.out.entry(index)
        return found if type(found) is tuple else None
