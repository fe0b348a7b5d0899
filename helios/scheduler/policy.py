"""Candidates and selection (spec "Useful service and selection", "Mixed execution contract").

``select`` takes a columnar snapshot of the runnable population (``Decoders``
and ``Prompters``, built by the core from request state and prices) and the
duration knowledge of every prepared graph, and returns the single best
``Choice``. It never re-sorts per shape: lane values are computed once per
logical width (decoders) or per prompt capacity (prompters), ranked once, and
every batch capacity reads the shared prefix sums (U9).

Order of a decision:
1. best cohort per graph (U9, U10, U13, P7), optimistic work score when the
   duration is unknown (U8);
2. prefill exploration filter for unmeasured larger prompt graphs (D4);
3. dominance pruning of padded alternatives for the same logical work (U12);
4. unknown beats known, then value, then the tie order (U8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import attrgetter, itemgetter
from typing import Callable, Mapping, Sequence

from flare_contract.graphs import GENERATION_KINDS, GraphDescriptor, GraphKind
from helios.scheduler.types import LanePhase, PlannedLane, RequestHandle, SelectionReason
from helios.scheduler.utility import (
    AdaptiveLane,
    PrefillTimes,
    RankedLanes,
    adaptive_orderings,
    best_adaptive_cohort,
    best_constrained_cohort,
    ordering_prefix_values,
    decision_log_scale,
    decode_lane_value,
    optimistic_work_score,
    prompt_chunk_value,
    value_rate,
)

MAX_REQUEST_SLOTS = 64  # U11: selection is bounded to 64 request slots


# ---------------------------------------------------------------------------
# Inputs: a columnar snapshot of the runnable population
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Decoders:
    """Runnable decoding requests, least recently selected first (U8 tie order).

    token_price     beta + f/x      delivery_price  g/z
    age_credit      c_i*sigma_i*A_i (A projected to the planning start, A10)
    age_slope       c_i*sigma_i     (multiplies the graph duration T)
    room            output tokens the request may still commit after queued work
    survival        per proposal source, prefix-survival means 1 >= s_1 >= s_2 >= ... >= 0 (S5: a longer
                    prefix never survives more often; selection's bounds and shortcuts rely on it)
    gains           optional, per proposal source: ``cumulative_gains(survival, alpha)``,
                    for callers that keep it between decisions (empty: computed here)
    estimates       optional, per proposal source: (means, weights) of the request's estimates
                    at depths 1..D (``PrefixSurvival.means_and_weights``), which the acceptance
                    probe search reads (D8; empty: it asks for each lane's estimates)
    """

    handle: list[RequestHandle] = field(default_factory=list)
    token_price: list[float] = field(default_factory=list)
    delivery_price: list[float] = field(default_factory=list)
    age_credit: list[float] = field(default_factory=list)
    age_slope: list[float] = field(default_factory=list)
    room: list[int] = field(default_factory=list)
    survival: list[Mapping[str, Sequence[float]]] = field(default_factory=list)
    recency: list[int] = field(default_factory=list)
    gains: list[Mapping[str, Sequence[float]]] = field(default_factory=list)
    estimates: list[Mapping[str, tuple[Sequence[float], Sequence[float]]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.handle)


def cumulative_gains(survival: Sequence[float], alpha: float) -> list[float]:
    """0, s_1**a, s_1**a + s_2**a, ...: expected extra tokens of the first d drafts in selection (S5)."""
    row = [0.0]
    for p in survival:
        row.append(row[-1] + p ** alpha)
    return row


@dataclass(slots=True)
class Prompters:
    """Requests with uncached prompt left, least recently selected first.

    start        first prompt position not yet consumed (queued work included)
    remaining    prompt tokens left
    to_endpoint  tokens up to the next message/system endpoint or the prompt end
    price        1 + f/x
    first_token  value of the one output token a finishing prompt can publish
    times        the catalog's least known prefill times (``utility.PrefillTimes``) for the chunk share
                 of ``utility.prompt_chunk_value``; None: a chunk earns its tokens (the spec's U13 text)
    """

    handle: list[RequestHandle] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    to_endpoint: list[int] = field(default_factory=list)
    price: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    recency: list[int] = field(default_factory=list)
    times: PrefillTimes | None = None

    def __len__(self) -> int:
        return len(self.handle)


@dataclass(frozen=True, slots=True)
class GraphTiming:
    """What the cost table knows about one graph at this decision (D2, D5)."""

    duration_ns: int  # 0: unknown
    fresh: bool

    @property
    def known(self) -> bool:
        return self.duration_ns > 0


@dataclass(slots=True)
class Population:
    decoders: Decoders
    prompters: Prompters
    active_age_price: float  # sum of c_i over every active decoder (U6 waiting cost)
    alpha: float = 1.0  # adaptive_verification_alpha (S5)
    # Facts a caller may vouch for, so that a decision need not scan for them (False: it checks).
    # ``ordered``: both lists are least recently selected first (their ``recency`` nondecreasing);
    # ``uniform_slope``: every decoder has the same ``age_slope``; ``positive``: every token price
    # is > 0 and every delivery price and age credit >= 0 (as prices with beta > 0 always are).
    ordered: bool = False
    uniform_slope: bool = False
    positive: bool = False


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    """The winning graph and cohort of one decision, before it becomes a plan.

    Treated as immutable; not declared frozen because every decision builds one
    (and a funded probe several), and a frozen dataclass's initialisation costs
    about four times as much (see ``PlannedLane``).
    """

    graph: GraphDescriptor
    lanes: tuple[PlannedLane, ...]
    timing: GraphTiming
    score: float  # value rate (known) or optimistic work score (unknown)
    log_scale: float
    prefill_row: int | None
    # the decision's rankings and columns (a ``_Selector``), which funded exploration
    # reuses to evaluate other programs on the same population (``evaluate``'s ``selection``)
    selection: "_Selector | None" = field(default=None, compare=False, repr=False)

    @property
    def reason(self) -> SelectionReason:
        # seam for the next issue: timing refresh and acceptance learning
        # selections will set their own reasons here.
        return SelectionReason.ORDINARY if self.timing.known else SelectionReason.DISCOVERY

    @property
    def requires_feedback(self) -> bool:
        return needs_feedback(self.graph, self.timing, self.lanes)


def needs_feedback(graph: GraphDescriptor, timing: GraphTiming, lanes: Sequence[PlannedLane]) -> bool:
    """Whether a plan must run with an empty window and completion feedback (A7, D5).

    Only ordinary decode and complete speculative generation with a fresh
    measured cost may be queued behind other work; a prompt phase ending inside
    the plan is a phase transition, and copy proposals read the request's
    history, which only completion brings up to date (a history input).
    """
    if graph.kind not in GENERATION_KINDS or not timing.known or not timing.fresh:
        return True
    if graph.proposal_source == "copy" and graph.width > 1:
        return True
    return LanePhase.PROMPT in map(_PHASE, lanes)


_PHASE = attrgetter("phase")


# ---------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Candidate:
    index: int  # position in the catalog
    graph: GraphDescriptor
    timing: GraphTiming
    score: float
    served: int
    padding: int
    logical: Callable[[], tuple]  # U12: what the candidate does, independent of its physical shape
    build: Callable[[], tuple[tuple[PlannedLane, ...], int | None]]
    recency: int = 0

    def rank_key(self) -> tuple:
        return (self.timing.known is False, self.score)

    def tie_key(self) -> tuple:
        known_time = -self.timing.duration_ns if self.timing.known else 0
        return (known_time, self.served, -self.recency, -self.padding)

    def capacities(self) -> tuple[int, int, int, int]:
        g = self.graph
        return (g.batch_capacity, g.width, g.target_rows, g.prefill_capacity)

    def logical_key(self) -> tuple:
        key = self.logical
        return key() if callable(key) else key


@dataclass(frozen=True, slots=True)
class _Deferred:
    """An expensive candidate, evaluated only if its upper bound can still win."""

    bound: tuple  # an upper bound of the candidate's rank_key()
    make: Callable[[], "_Candidate | None"]


@dataclass(slots=True)
class _DecodeRanking:
    """Decoders eligible for one (proposal source, logical width), ranked once.

    Scoring reads only ``ranked.prefix``, ``slope_prefix`` and ``size``. What
    follows ranking order -- ``members``, ``lengths``, ``expected`` and
    ``length_prefix`` -- is built on first use: only the winner's lanes, the
    logical keys of pruning checks and ragged programs read them.
    """

    eligible: list[int]  # decoder indices, eligibility order
    width: int  # logical width: every lane's query length unless ``raw_lengths`` says otherwise
    raw_lengths: list[int] | None  # query length per eligible decoder (eligibility order); None: all ``width``
    ranked: RankedLanes  # over base values (eligibility order)
    slope_prefix: list[float]
    uniform_slope: bool  # every lane shares c*sigma: the order holds for any T
    # what expected tokens are computed from, in eligibility order: (cumulative gains, room) per
    # lane, or None for width-one rows (one token each)
    expected_inputs: tuple[list, list[int]] | None
    # every lane reaches the full width within its gains and its room: expected tokens are 1 + g[width - 1]
    uncapped: bool = False
    keys: dict[int, tuple] | None = None  # k -> logical key
    _members: list[int] | None = None
    _lengths: list[int] | None = None
    _expected: list[float] | None = None
    _length_prefix: list[int] | None = None

    @property
    def size(self) -> int:
        return len(self.eligible)

    @property
    def members(self) -> list[int]:
        """Decoder indices in ranking order."""
        if self._members is None:
            self._members = list(map(self.eligible.__getitem__, self.ranked.order))
        return self._members

    @property
    def lengths(self) -> list[int]:
        """Query length per member (ranking order)."""
        if self._lengths is None:
            raw = self.raw_lengths
            if raw is None:
                self._lengths = [self.width] * len(self.eligible)
            else:
                self._lengths = list(map(raw.__getitem__, self.ranked.order))
        return self._lengths

    @property
    def expected(self) -> list[float]:
        """Expected committed tokens per member (ranking order)."""
        if self._expected is None:
            if self.expected_inputs is None:
                self._expected = [1.0] * len(self.eligible)
            elif self.uncapped:  # the formula below with n = width and no cap that binds: the same floats
                rows, last = self.expected_inputs[0], self.width - 1
                self._expected = [1.0 + rows[j][last] for j in self.ranked.order]
            else:  # S5: 1 + the gains of the first n - 1 drafts, capped by the room, per member
                order = self.ranked.order
                rows, rooms = (map(column.__getitem__, order) for column in self.expected_inputs)
                self._expected = [
                    e if (e := 1.0 + (g[n - 1] if n <= len(g) else g[-1])) < r else float(r)
                    for g, n, r in zip(rows, self.lengths, rooms)
                ]
        return self._expected

    def length_prefix_at(self, k: int) -> int:
        """Rows the best ``k`` members use."""
        if self.raw_lengths is None:
            return k * self.width
        return self.length_prefix[k]

    @property
    def length_prefix(self) -> list[int]:
        if self._length_prefix is None:
            self._length_prefix = list(accumulate(self.lengths, initial=0))
        return self._length_prefix

    def logical(self, k: int) -> tuple:
        if self.keys is None:
            self.keys = {}
        key = self.keys.get(k)
        if key is None:
            key = tuple(sorted(zip(self.members[:k], self.lengths[:k])))
            self.keys[k] = key
        return key


@dataclass(slots=True)
class _SourceColumns:
    """What every ranking priced by one proposal source reads, gathered once per decision.

    ``idx`` are the eligible decoders (room left, and the source for wide rows);
    the other lists follow it. When every decoder is eligible they are the
    population's own columns, not copies.
    """

    idx: list[int]
    slopes: list[float]  # c*sigma
    uniform: bool  # all slopes equal
    prices: list[float]  # token price
    fixed: list[float]  # width-independent value: delivery price + age credit
    rows: list | None  # cumulative gains (None for width-one rows)
    rooms: list[int]
    shortest: int = 0  # the fewest cumulative gains any row has
    slope_prefix: list[float] | None = None  # prefix sums of ``slopes`` (uniform slopes: any order)
    positive: bool = False  # every lane value is positive (token prices positive, the rest not negative)


class _Selector:
    """One decision's caches: rankings per width and per prompt capacity."""

    def __init__(self, population: Population, infos: "CatalogInfo") -> None:
        self.pop = population
        self.infos = infos
        self.decode_rankings: dict[tuple, _DecodeRanking] = {}
        self.prompt_rankings: dict[int, tuple[RankedLanes, list[int]]] = {}
        self.adaptive_lanes: dict[tuple[str | None, int], list[tuple[int, AdaptiveLane, float]]] = {}
        self.adaptive_prefixes: dict[tuple, list[float]] = {}
        self.cumulative: dict[str, list[list[float] | None]] = {}
        self.fixed: list[float] | None = None
        self.columns: dict[str | None, _SourceColumns] = {}
        self.all_slopes: tuple[bool, list[float] | None] | None = None  # (uniform, prefix) of every decoder's slope
        self.all_positive: bool | None = None  # _SourceColumns.positive of every decoder
        self.gain_prefixes: dict[tuple[str, int], list[float]] = {}  # see next_gains
        # with room for every width, query lengths are the width itself
        self.least_room = min(population.decoders.room, default=0)
        self.t_ms: list[float] = []  # per graph: its known duration in ms, 0.0 while unknown (set by select)
        # a stable sort of an LRU-ordered population already breaks value ties by recency
        ordered = population.ordered
        self.decoders_lru = ordered or _nondecreasing(population.decoders.recency)
        self.prompters_lru = ordered or _nondecreasing(population.prompters.recency)

    # -- decoders ---------------------------------------------------------

    def _gains(self, source: str) -> list[list[float] | None]:
        """Per decoder: cumulative sums of s_d ** alpha for ``source`` (None without that source)."""
        gains = self.cumulative.get(source)
        if gains is None:
            d, alpha = self.pop.decoders, self.pop.alpha
            if len(d.gains) == len(d):  # the caller keeps them current per request
                gains = [g.get(source) for g in d.gains]
            else:
                gains = [None if (s := survival.get(source)) is None else cumulative_gains(s, alpha)
                         for survival in d.survival]
            self.cumulative[source] = gains
        return gains

    def decode_ranking(self, source: str | None, width: int, timing: GraphTiming | None = None) -> _DecodeRanking:
        """The ranking for one logical width, exact for a graph of this ``timing``.

        A lane's value for a graph of duration T is base + c*sigma*T. Within one
        delivery family c*sigma is shared, so one ranking by base serves every T.
        Only when the eligible lanes mix families (different sigma) does the
        order depend on T; then the ranking is rebuilt per distinct duration.
        """
        key = (source, width)
        ranking = self.decode_rankings.get(key)
        if ranking is None:
            ranking = self.decode_rankings[key] = self._rank_decoders(source, width, None)
        if ranking.uniform_slope or timing is None or not timing.known:
            return ranking
        t_ms = timing.duration_ns / 1e6
        timed = self.decode_rankings.get((source, width, t_ms))
        if timed is None:
            timed = self.decode_rankings[(source, width, t_ms)] = self._rank_decoders(source, width, t_ms)
        return timed

    def source_columns(self, source: str | None) -> _SourceColumns:
        """The eligible decoders of ``source`` and their columns (see ``_SourceColumns``)."""
        found = self.columns.get(source)
        if found is not None:
            return found
        d = self.pop.decoders
        gains = None if source is None else self._gains(source)
        fixed = self._fixed_values()
        if self.least_room >= 1 and (gains is None or None not in gains):
            # everyone (the usual case): the columns themselves, not copies
            idx, slopes, prices, rows, rooms = list(range(len(d))), d.age_slope, d.token_price, gains, d.room
        else:
            if source is None:
                idx = [i for i, r in enumerate(d.room) if r >= 1]
            else:
                idx = [i for i, r in enumerate(d.room) if r >= 1 and gains[i] is not None]
            slopes, prices, rooms = [d.age_slope[i] for i in idx], [d.token_price[i] for i in idx], [d.room[i] for i in idx]
            fixed = [fixed[i] for i in idx]
            rows = None if gains is None else [gains[i] for i in idx]
        if slopes is d.age_slope:  # every decoder: one slope check and prefix for every source
            if self.all_slopes is None:
                uniform = self.pop.uniform_slope or len(set(slopes)) <= 1
                self.all_slopes = (uniform, list(accumulate(slopes, initial=0.0)) if uniform else None)
            uniform, slope_prefix = self.all_slopes
        else:
            uniform = self.pop.uniform_slope or len(set(slopes)) <= 1
            slope_prefix = list(accumulate(slopes, initial=0.0)) if uniform else None  # uniform: any order's
        if self.pop.positive:
            positive = True
        elif prices is d.token_price and self.all_positive is not None:
            positive = self.all_positive  # every decoder's, computed for another source
        else:
            positive = min(prices, default=0.0) > 0.0 and min(fixed, default=0.0) >= 0.0
            if prices is d.token_price:
                self.all_positive = positive
        found = _SourceColumns(idx, slopes, uniform, prices, fixed, rows, rooms, slope_prefix=slope_prefix,
                               positive=positive)
        if rows is not None:
            found.shortest = min(map(len, rows), default=0)
        self.columns[source] = found
        return found

    def next_gains(self, source: str, w0: int) -> list[float]:
        """Prefix sums of the eligible lanes' next gains at width ``w0``, largest first.

        A lane's next gain is its token price times s_w0 ** alpha: the expected
        tokens one more draft adds (zero past its last survival).
        """
        prefix = self.gain_prefixes.get((source, w0))
        if prefix is None:
            cols = self.source_columns(source)
            if w0 < cols.shortest:  # every row has a gain at w0
                gains = [p * (g[w0] - g[w0 - 1]) for g, p in zip(cols.rows, cols.prices)]
            else:
                gains = [p * (g[w0] - g[w0 - 1]) if w0 < len(g) else 0.0 for g, p in zip(cols.rows, cols.prices)]
            prefix = self.gain_prefixes[(source, w0)] = list(accumulate(sorted(gains, reverse=True), initial=0.0))
        return prefix

    def _rank_decoders(self, source: str | None, width: int, t_ms: float | None) -> _DecodeRanking:
        """Lane values of every eligible decoder at one logical width, ranked once (U9).

        With ``t_ms`` the values include each lane's c*sigma*T, and the slope
        prefix is zero (the graph duration is already priced in).
        """
        cols = self.source_columns(source)
        idx, prices, fixed, rows, rooms = cols.idx, cols.prices, cols.fixed, cols.rows, cols.rooms
        raw_lengths = None  # every lane's query length is the width itself
        uncapped = False
        if source is None:
            width, inputs = 1, None
            values = [p + f for p, f in zip(prices, fixed)]  # one token: 1.0 * p + f, exactly
        else:
            inputs = (rows, rooms)
            # S5's expected tokens min(1 + g[n-1], room) times p, plus f: the hot loop of a decision
            if self.least_room >= width and width <= cols.shortest:
                # n = width for every row and every row reaches it; and no room caps the tokens:
                # each gain is s ** alpha <= 1 (s in [0, 1]), so 1 + g[width - 1] <= width <= room
                last, uncapped = width - 1, True
                values = [(1.0 + g[last]) * p + f for g, p, f in zip(rows, prices, fixed)]
            else:
                if self.least_room < width:
                    raw_lengths = [width if width < r else r for r in rooms]
                lengths = raw_lengths if raw_lengths is not None else repeat(width)
                values = [
                    (e if (e := 1.0 + (g[n - 1] if n <= len(g) else g[-1])) < r else float(r)) * p + f
                    for g, n, r, p, f in zip(rows, lengths, rooms, prices, fixed)
                ]
        if t_ms is not None:
            values = [v + t_ms * slope for v, slope in zip(values, cols.slopes)]
        ranked = RankedLanes(values, None if self.decoders_lru else [self.pop.decoders.recency[i] for i in idx])
        if t_ms is not None:
            slope_prefix = [0.0] * (len(idx) + 1)
        elif cols.uniform:
            slope_prefix = cols.slope_prefix
        else:
            slope_prefix = list(accumulate((cols.slopes[j] for j in ranked.order), initial=0.0))
        return _DecodeRanking(idx, width, raw_lengths, ranked, slope_prefix, cols.uniform, inputs, uncapped)

    def _fixed_values(self) -> list[float]:
        """Per decoder: the width-independent part of its lane value (delivery and c*sigma*A)."""
        if self.fixed is None:
            d = self.pop.decoders
            # decode_lane_value(0, 0, delivery, 1, credit), whose zero terms add nothing: delivery + credit
            self.fixed = [dp + credit for dp, credit in zip(d.delivery_price, d.age_credit)]
        return self.fixed


    # -- prompters --------------------------------------------------------

    def prompt_ranking(self, capacity: int) -> tuple[RankedLanes, list[int]]:
        ranking = self.prompt_rankings.get(capacity)
        if ranking is None:
            p = self.pop.prompters
            if not p.handle:  # every capacity ranks nobody: one empty ranking for all
                ranking = self.prompt_rankings[capacity] = self.prompt_rankings.setdefault(None, (RankedLanes([]), []))
                return ranking
            tokens = [r if r < capacity else capacity for r in p.remaining]  # min(capacity, r)
            # prompt_lane_value (tokens * price) plus the first output token a finishing row publishes;
            # with prefill times, a chunk that leaves prompt behind earns its share (prompt_chunk_value)
            if p.times is None:
                values = [t * price + (first if t == left else 0.0)
                          for t, price, first, left in zip(tokens, p.price, p.first_token, p.remaining)]
            else:
                values = [prompt_chunk_value(t, left, price, first, p.times)
                          for t, price, first, left in zip(tokens, p.price, p.first_token, p.remaining)]
            # most prompt programs read only the best row (``top``): the prefix sums wait for a wider one
            ranking = (RankedLanes.rank(values, None if self.prompters_lru else p.recency, lazy=True), tokens)
            self.prompt_rankings[capacity] = ranking
        return ranking


def durations_ms(timings: Sequence[GraphTiming]) -> list[float]:
    """Each graph's known duration in ms (0.0 while unknown), as ``_score`` divides it."""
    return [t.duration_ns / 1e6 if t.duration_ns > 0 else 0.0 for t in timings]


def _nondecreasing(values: Sequence[int]) -> bool:
    return list(values) == sorted(values)  # sorting an already sorted list is one linear pass, in C


def _score(served_value_base: float, slope: float, timing: GraphTiming, active: float) -> float:
    if not timing.known:
        return optimistic_work_score(served_value_base)
    t_ms = timing.duration_ns / 1e6
    return value_rate(served_value_base + slope * t_ms, t_ms, active)


@dataclass(frozen=True, slots=True)
class GraphInfo:
    """What selection derives from a descriptor alone; built once per catalog."""

    source: str | None  # proposal source pricing its rows; None for width-one rows
    width: int  # logical width: min(W, D + 1) for rows that draw proposals, else 1
    prefix_limit: bool  # the device allocates its rows within P (S2)
    capacities: tuple[int, int, int, int]  # (B, W, P, prompt capacity) for dominance (U12)


@dataclass(frozen=True, slots=True)
class CatalogInfo:
    """What selection derives from the catalog alone, built once per catalog (:func:`describe`).

    ``dominators[i]`` lists the graphs of graph i's kind whose capacities are
    all no larger and not all equal: the only shapes that can prune graph i as
    padding (U12) when they do the same logical work. It does not depend on
    requests, so it is never recomputed per decision.
    """

    graphs: tuple[GraphInfo, ...]
    dominators: tuple[tuple[int, ...], ...]
    prefill_sizes: tuple[int, ...]  # prompt capacities of the prefill graphs (D4)
    groups: tuple[_Group, ...] = ()  # graphs that share their rankings, scored together
    prefill_graphs: tuple[int, ...] = ()  # catalog indices of the prefill graphs
    # ``groups`` split for ``select``: ``bounded`` are the rectangular and mixed groups of each
    # proposal source beyond its narrowest logical width, by source then width; ``eager`` the rest
    eager: tuple[_Group, ...] = ()
    bounded: tuple[_Group, ...] = ()
    group_of: tuple[_Group | None, ...] = ()  # per graph: its group (None for graphs no group scores)
    same_depth_dominators: tuple[tuple[int, ...], ...] = ()  # ``dominators`` of the graph's proposal depth
    # id of a mixed group -> per member, the rectangular programs of the same source, width and batch
    siblings: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict, compare=False, repr=False)
    # kept per durations list: id of a mixed group -> (durations, whether _decode_only_beaten holds);
    # (source, w0, positive) -> (durations, _flat_bound_rows)
    beaten: dict[int, tuple] = field(default_factory=dict, compare=False, repr=False)
    bound_rows: dict[tuple, tuple] = field(default_factory=dict, compare=False, repr=False)
    # per proposal source: (its narrowest bounded width, its bounded groups)
    bounded_sources: tuple[tuple[str, int, tuple[_Group, ...]], ...] = ()

    def __getitem__(self, index: int) -> GraphInfo:
        return self.graphs[index]

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)


def describe(graphs: Sequence[GraphDescriptor]) -> CatalogInfo:
    infos = tuple(
        GraphInfo(
            _proposal_source(g),
            _logical_width(g),
            g.is_prefix_limit,
            (g.batch_capacity, g.width, g.target_rows, g.prefill_capacity),
        )
        for g in graphs
    )
    dominators = tuple(
        tuple(j for j, o in enumerate(graphs)
              if o.kind is g.kind and _dominates(infos[j].capacities, infos[i].capacities))
        for i, g in enumerate(graphs)
    )
    prefill_sizes = tuple(g.prefill_capacity for g in graphs if g.kind is GraphKind.PREFILL)
    prefill_graphs = tuple(i for i, g in enumerate(graphs) if g.kind is GraphKind.PREFILL)
    groups = _groups(graphs, infos)
    eager, bounded = _split_groups(groups)
    group_of: list[_Group | None] = [None] * len(graphs)
    for group in groups:
        for index in group.members:
            group_of[index] = group
    sources: dict[str, list[_Group]] = {}
    for group in bounded:
        sources.setdefault(group.source, []).append(group)
    described = CatalogInfo(
        infos, dominators, prefill_sizes, groups, prefill_graphs, eager, bounded, tuple(group_of),
        bounded_sources=tuple((source, min(g.width for g in members), tuple(members)) for source, members in sources.items()),
        same_depth_dominators=tuple(tuple(j for j in found if graphs[j].proposal_depth == graphs[i].proposal_depth)
                                    for i, found in enumerate(dominators)),
    )
    rectangular = {}
    for group in groups:
        if group.scorer is _score_rectangular:
            for index, batch in group.batches:
                rectangular.setdefault((group.source, group.width, batch), []).append(index)
    for group in groups:
        if group.scorer is _score_mixed and all((group.source, group.width, b) in rectangular for _, b in group.batches):
            described.siblings[id(group)] = tuple(tuple(rectangular[(group.source, group.width, b)])
                                                  for _, b in group.batches)
    return described


def _split_groups(groups: Sequence[_Group]) -> tuple[tuple[_Group, ...], tuple[_Group, ...]]:
    """(eager, bounded): see ``_score_bounded``. Per proposal source, the rectangular and mixed
    groups of its narrowest logical width are eager (they give the first bound its base)."""
    widths: dict[str, int] = {}
    for group in groups:
        if group.source is not None and group.scorer in _BOUNDABLE:
            widths[group.source] = min(widths.get(group.source, group.width), group.width)
    bounded = [g for g in groups
               if g.source is not None and g.scorer in _BOUNDABLE and g.width > widths[g.source]]
    eager = tuple(g for g in groups if all(g is not b for b in bounded))
    return eager, tuple(sorted(bounded, key=lambda g: (g.source, g.width)))


@dataclass(frozen=True, slots=True)
class _Group:
    """Graphs whose candidates read the same rankings: one logical width and source, one prompt capacity.

    ``scorer`` scores every member from those shared rankings; only the batch
    capacity (and the duration) differs between members (U9).
    """

    scorer: Callable
    source: str | None
    width: int
    prefill_capacity: int
    members: tuple[int, ...]
    batches: tuple[tuple[int, int], ...] = ()  # (member, its batch capacity)


def _groups(graphs: Sequence[GraphDescriptor], infos: Sequence[GraphInfo]) -> tuple[_Group, ...]:
    found: dict[tuple, list[int]] = {}
    for index, (g, info) in enumerate(zip(graphs, infos)):
        if g.kind in GENERATION_KINDS and not info.prefix_limit and not g.ragged:
            key = (_score_rectangular, info.source, info.width, 0)
        elif g.kind is GraphKind.PREFILL:
            key = (_score_prefill, None, 1, 0)  # one group: each member reads its capacity's ranking
        elif g.kind is GraphKind.MIXED:
            key = (_score_mixed, info.source, info.width, g.prefill_capacity)
        elif g.kind in _CANDIDATES:
            key = (_score_one_by_one, info.source, info.width, g.prefill_capacity)
        else:
            continue
        found.setdefault(key, []).append(index)
    return tuple(
        _Group(*key, tuple(members), tuple((i, graphs[i].batch_capacity) for i in members))
        for key, members in found.items()
    )


def _proposal_source(graph: GraphDescriptor) -> str | None:
    """Source whose acceptance prices the graph's rows; None for width-one rows."""
    if not graph.draws_proposals:
        return None
    return graph.proposal_source or "learned"


def _logical_width(graph: GraphDescriptor) -> int:
    if not graph.draws_proposals:
        return 1
    return min(graph.width, graph.proposal_depth + 1)


# ---------------------------------------------------------------------------
# Per-kind candidates
# ---------------------------------------------------------------------------


def _decode_lanes(sel: _Selector, r: _DecodeRanking, k: int) -> list[PlannedLane]:
    """The best ``k`` members of ``r`` as decode lanes (ranking order); a winner may hold 64."""
    handles = map(sel.pop.decoders.handle.__getitem__, r.members[:k])
    return PlannedLane.decode_rows(handles, r.lengths[:k], r.expected)


def _prompt_lane(sel: _Selector, i: int, tokens: int) -> PlannedLane:
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


def _generation_candidate(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Decode and speculative programs: rectangular, constrained ragged or adaptive.

    A rectangular cohort is scored here and built only if needed
    (:func:`_built_generation`). Constrained and adaptive cohorts are costlier
    to search, so they come back as a ``_Deferred`` carrying an upper bound: the
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
        bound = (not timing.known, _score(base, r.slope_prefix[k], timing, active))
        return _Deferred(bound, lambda: _adaptive_candidate(sel, index, graph, timing))
    k, base = r.ranked.best(graph.batch_capacity)
    if graph.ragged and r.length_prefix_at(k) > graph.target_rows:
        bound = (not timing.known, _score(base, r.slope_prefix[k], timing, active))
        return _Deferred(bound, lambda: _constrained_candidate(sel, index, graph, timing, r))
    return (not timing.known, _score(base, r.slope_prefix[k], timing, active)), index, (r, k)


def _built_generation(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming, score: float, payload):
    r, k = payload
    logical = lambda: (graph.kind, graph.proposal_depth, r.logical(k))  # noqa: E731
    return _Candidate(
        index=index,
        graph=graph,
        timing=timing,
        score=score,
        served=k,
        padding=graph.target_rows - r.length_prefix_at(k),
        logical=logical,
        build=lambda: (tuple(_decode_lanes(sel, r, k)), None),
    )


def _constrained_candidate(sel, index, graph, timing, r: _DecodeRanking):
    """Host-allocated ragged program whose P binds: exact best cohort fitting B and P (U9)."""
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    n = r.size
    base, slope = r.ranked.prefix, r.slope_prefix
    values = [base[j + 1] - base[j] + t_ms * (slope[j + 1] - slope[j]) for j in range(n)]
    total, chosen = best_constrained_cohort(values, r.lengths, graph.batch_capacity, graph.target_rows)
    if not chosen:
        return None
    chosen = tuple(sorted(chosen))  # keep ranking order for the lanes
    score = value_rate(total, t_ms, sel.pop.active_age_price) if timing.known else optimistic_work_score(total)
    rows = sum(r.lengths[j] for j in chosen)

    def build():
        d = sel.pop.decoders
        return tuple(
            PlannedLane(
                handle=d.handle[r.members[j]],
                phase=LanePhase.DECODE,
                query_length=r.lengths[j],
                expected_tokens=r.expected[j],
            )
            for j in chosen
        ), None

    logical = (graph.kind, graph.proposal_depth, tuple(sorted((r.members[j], r.lengths[j]) for j in chosen)))
    return _Candidate(index, graph, timing, score, len(chosen), graph.target_rows - rows, logical, build)


def _adaptive_lanes(sel: _Selector, source: str, width: int):
    """Prefix-limit lanes for one (source, logical width), built once per decision."""
    key = (source, width)
    cached = sel.adaptive_lanes.get(key)
    if cached is not None:
        return cached
    d, alpha = sel.pop.decoders, sel.pop.alpha
    lanes = []
    for i in range(len(d)):
        survival = d.survival[i].get(source)
        if survival is None or d.room[i] < 1:
            continue
        ceiling = max(1, min(width, d.room[i]))
        s = tuple(survival[: ceiling - 1])
        base = decode_lane_value(1.0, d.token_price[i], d.delivery_price[i], 1.0, d.age_credit[i])
        lane = AdaptiveLane(base, d.token_price[i], s, tuple(p ** alpha for p in s), d.handle[i].slot)
        lanes.append((i, lane, d.age_slope[i]))
    orders = adaptive_orderings([lane for _, lane, _ in lanes])
    cached = (lanes, orders)
    sel.adaptive_lanes[key] = cached
    return cached


def _adaptive_candidate(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Device-allocated program: cohort prefixes under three orderings (U10)."""
    info = sel.infos[index]
    lanes, orders = _adaptive_lanes(sel, info.source, info.width)
    if not lanes:
        return None
    t_ms = timing.duration_ns / 1e6 if timing.known else 0.0
    plain = [lane for _, lane, _ in lanes]
    key = (info.source, info.width)

    def prefix_values(name, order, rows, limit):
        cached = sel.adaptive_prefixes.get((key, name, rows))
        if cached is None or len(cached) < limit:
            cached = sel.adaptive_prefixes[(key, name, rows)] = ordering_prefix_values(plain, order, rows, limit)
        return cached

    value, chosen, taken = best_adaptive_cohort(
        plain,
        graph.batch_capacity,
        graph.target_rows,
        orders=orders,
        extra=[t_ms * slope for _, _, slope in lanes],
        prefix_values=prefix_values,
    )
    if not chosen:
        return None
    score = value_rate(value, t_ms, sel.pop.active_age_price) if timing.known else optimistic_work_score(value)
    d = sel.pop.decoders

    def build():
        out = []
        for j, rows in zip(chosen, taken):
            i, lane, _ = lanes[j]
            expected = min(float(d.room[i]), 1.0 + sum(lane.weights[: rows - 1]))
            out.append(PlannedLane(d.handle[i], LanePhase.DECODE, query_length=lane.ceiling,
                                   ceiling=lane.ceiling, expected_tokens=expected))
        return tuple(out), None

    logical = (graph.kind, graph.proposal_depth, tuple((lanes[j][0], lanes[j][1].ceiling) for j in chosen))
    return _Candidate(index, graph, timing, score, len(chosen), graph.target_rows - sum(taken), logical, build)


def _prefill_candidate(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Prompt rows earn the tokens they can actually consume (U13).

    Each of the B rows serves one prompter and consumes up to the graph's
    prompt capacity; unused capacity is padding and earns nothing.
    """
    ranked, tokens = sel.prompt_ranking(graph.prefill_capacity)
    k, base = ranked.best(graph.batch_capacity)
    if k == 0:
        return None
    return (not timing.known, _score(base, 0.0, timing, sel.pop.active_age_price)), index, (ranked, tokens, k)


def _built_prefill(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming, score: float, payload):
    ranked, tokens, k = payload
    rows = ranked.order[:k]
    used = sum(tokens[i] for i in rows)
    logical = lambda: (graph.kind, tuple(sorted((i, tokens[i]) for i in rows)))  # noqa: E731
    return _Candidate(
        index=index,
        graph=graph,
        timing=timing,
        score=score,
        served=k,
        padding=graph.prefill_capacity * graph.batch_capacity - used,
        logical=logical,
        build=lambda: (tuple(_prompt_lane(sel, i, tokens[i]) for i in rows), None),
    )


def _mixed_candidate(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming):
    """Best decode-only cohort vs best prompt row plus the best B-1 decoders (P7)."""
    info = sel.infos[index]
    untimed = sel.decode_ranking(info.source, info.width)
    return _mixed_entry(sel, index, graph, timing, untimed, sel.prompt_ranking(graph.prefill_capacity))


def _mixed_entry(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming,
                 untimed: _DecodeRanking, prompts):
    """``_mixed_candidate`` from rankings already in hand (shared by every mixed graph of one group)."""
    r = untimed if untimed.uniform_slope or not timing.known else sel.decode_ranking(
        sel.infos[index].source, sel.infos[index].width, timing)
    active = sel.pop.active_age_price
    prefix, slopes, n = r.ranked.prefix, r.slope_prefix, r.size
    best = None  # (score, prompt row or None, decoders served)
    k = min(graph.batch_capacity, n)
    if k:
        best = (_score(prefix[k], slopes[k], timing, active), None, k)
    ranked, tokens = prompts
    if len(ranked) and graph.prefill_capacity:
        k2 = min(graph.batch_capacity - 1, n)
        score = _score(ranked.top() + prefix[k2], slopes[k2], timing, active)
        if best is None or score >= best[0]:  # on a tie the prompt row wins
            best = (score, ranked.first(), k2)
    if best is None:
        return None
    score, prompt, k = best
    return (not timing.known, score), index, (r, prompt, k, tokens)


def _built_mixed(sel: _Selector, index: int, graph: GraphDescriptor, timing: GraphTiming, score: float, payload):
    r, prompt, k, tokens = payload
    rows = r.length_prefix_at(k) + (tokens[prompt] if prompt is not None else 0)

    def build():
        lanes = _decode_lanes(sel, r, k)
        if prompt is None:
            return tuple(lanes), None
        return (_prompt_lane(sel, prompt, tokens[prompt]), *lanes), 0

    prompt_key = None if prompt is None else (prompt, tokens[prompt])
    logical = lambda: (graph.kind, graph.proposal_depth, prompt_key, r.logical(k))  # noqa: E731
    served = k + (prompt is not None)
    padding = graph.max_packed_tokens - rows
    return _Candidate(index, graph, timing, score, served, padding, logical, build)


def _score_rectangular(sel: _Selector, group: _Group, graphs, timings, out: list) -> None:
    """Rectangular decode and speculative programs of one width: the best B lanes of one ranking (U9).

    The hottest loop of a decision, so it reads the shared prefix sums directly:
    an unknown duration scores its optimistic work (U8), a known one its value
    rate (U6), with ``value_rate``'s arithmetic written out (same operations, same order).
    """
    untimed = sel.decode_ranking(group.source, group.width)
    n = untimed.size
    if n == 0:
        return
    active = sel.pop.active_age_price
    prefix, slopes, uniform, durations = untimed.ranked.prefix, untimed.slope_prefix, untimed.uniform_slope, sel.t_ms
    scores, payloads = out.scores, out.payloads
    for index, batch in group.batches:
        t = durations[index]
        k = batch if batch < n else n
        if t <= 0.0:
            out.entries[index] = (True, prefix[k]), index, (untimed, k)
        elif uniform:
            scores[index] = (prefix[k] + slopes[k] * t) / t - 0.5 * t * active
            payloads[index] = (untimed, k)
        else:
            timing = timings[index]
            r = sel.decode_ranking(group.source, group.width, timing)
            scores[index] = _score(r.ranked.prefix[k], r.slope_prefix[k], timing, active)
            payloads[index] = (r, k)


def _score_prefill(sel: _Selector, group: _Group, graphs, timings, out: list) -> None:
    """Every prefill program: ``_prefill_candidate`` of each, written out like ``_score_rectangular``.

    (``value_rate`` of the cohort's value with no age term: base / T - T/2 * sum c.)
    """
    if not sel.pop.prompters.handle:
        return
    active, durations = sel.pop.active_age_price, sel.t_ms
    for index, batch in group.batches:
        ranked, tokens = sel.prompt_ranking(graphs[index].prefill_capacity)
        n = len(ranked.values)
        k = batch if batch < n else n
        if k:
            t = durations[index]
            if t > 0.0:
                out.scores[index] = (ranked.top() if k == 1 else ranked.prefix[k]) / t - 0.5 * t * active
                out.payloads[index] = (ranked, tokens, k)
            else:
                out.entries[index] = (True, ranked.prefix[k]), index, (ranked, tokens, k)


def _score_mixed(sel: _Selector, group: _Group, graphs, timings, out: list) -> None:
    """Mixed programs of one prompt capacity and width: ``_mixed_entry`` of each, from the shared rankings.

    Inlined like ``_score_rectangular`` when every lane shares one age slope
    (the usual case); otherwise a known duration needs its own ranking, which
    ``_mixed_entry`` builds.
    """
    untimed = sel.decode_ranking(group.source, group.width)
    prompts = sel.prompt_ranking(group.prefill_capacity)
    if not untimed.uniform_slope:
        for index in group.members:
            out.add(_mixed_entry(sel, index, graphs[index], timings[index], untimed, prompts))
        return
    ranked, tokens = prompts
    has_row = len(ranked) > 0 and group.prefill_capacity > 0
    row_value, row = (ranked.top(), ranked.first()) if has_row else (0.0, None)
    prefix, slopes, n = untimed.ranked.prefix, untimed.slope_prefix, untimed.size
    active, durations = sel.pop.active_age_price, sel.t_ms
    for index, batch in group.batches:
        t = durations[index]
        known = t > 0.0
        k = batch if batch < n else n
        # the decode-only cohort, then the prompt row with the best B - 1 decoders; on a tie the row wins
        if k:
            score = (prefix[k] + slopes[k] * t) / t - 0.5 * t * active if known else prefix[k]
            if has_row:
                k2 = batch - 1 if batch - 1 < n else n
                value = row_value + prefix[k2]
                with_row = (value + slopes[k2] * t) / t - 0.5 * t * active if known else value
                if with_row >= score:
                    out.put(index, known, with_row, (untimed, row, k2, tokens))
                    continue
            out.put(index, known, score, (untimed, None, k, tokens))
        elif has_row:
            k2 = batch - 1 if batch - 1 < n else n
            value = row_value + prefix[k2]
            with_row = (value + slopes[k2] * t) / t - 0.5 * t * active if known else value
            out.put(index, known, with_row, (untimed, row, k2, tokens))


def _score_one_by_one(sel: _Selector, group: _Group, graphs, timings, out: list) -> None:
    """Ragged and prefix-limit programs: their own candidate functions (which may defer)."""
    for index in group.members:
        graph = graphs[index]
        found = _CANDIDATES[graph.kind](sel, index, graph, timings[index])
        if found is not None:
            out.entries[index] = found


_BOUNDABLE = (_score_rectangular, _score_mixed)


# ---------------------------------------------------------------------------
# Wider widths only when they can win
# ---------------------------------------------------------------------------

# A bound is trusted only with this relative margin over the rounding of the
# sums it bounds (64 positive terms and a few operations: far below 1e-12).
_BOUND_MARGIN = 1e-9


def _score_bounded(sel: _Selector, groups: Sequence[_Group], graphs, timings, out: _Out) -> list[_Group]:
    """Score the wider speculative groups unless none can reach the best measured score; return
    the groups left unscored (all of them, or none).

    Called once the eager groups are scored. A lane's expected tokens grow with
    the width by the survival of each further draft, and survival never rises
    with depth (S5: prefix survival), so from the narrowest width w0 ranked,
    width w adds at most (w - w0) times the lane's next gain, p * s_w0 ** alpha.
    The best k lanes at width w are then worth at most the best k at w0 plus
    (w - w0) times the best k of those gains; every program of the groups is
    bounded with that value (its own duration, the same age terms; a mixed
    program also with its best prompt row). If every bound stays below the best
    score, none is scored: none can win, tie (U8), or prune the winner as
    padding (a program of a wider logical width at the winner's depth never
    does the same work), so the decision is the one scoring everything gives.
    Otherwise every one is scored.

    Only lanes sharing one age slope are bounded this way (otherwise rankings
    depend on the duration), and only while everything scored is measured.
    """
    top = max(out.scores, default=_MISSING)
    if top != _MISSING and not out.entries and groups and _none_can_reach(sel, top):
        return list(groups)
    for group in groups:
        group.scorer(sel, group, graphs, timings, out)
    return []


def _none_can_reach(sel: _Selector, top: float) -> bool:
    """Whether every bounded program's bound (see ``_score_bounded``) is below ``top``: one
    comprehension over all of them per source, and one more per prompt capacity whose best
    row may ride in a mixed program; each bound trusted with a margin of ``_BOUND_MARGIN``
    times its terms. The decoders-only cohorts of mixed programs beaten by a faster
    rectangular sibling (``_decode_only_beaten``) are left out: they cannot win either.
    """
    active, margin, prompters = sel.pop.active_age_price, _BOUND_MARGIN, bool(sel.pop.prompters.handle)
    for source, first_width, groups in sel.infos.bounded_sources:
        cols = sel.source_columns(source)
        w0 = max((key[1] for key in sel.decode_rankings if len(key) == 2 and key[0] == source and key[1] < first_width),
                 default=0)
        base = sel.decode_rankings.get((source, w0))
        if not cols.uniform or base is None:
            return False
        flat = _flat_bound_rows(sel, source, groups, w0, cols.positive)
        if flat is None:
            return False
        gains, value, slopes, n = sel.next_gains(source, w0), base.ranked.prefix, cols.slope_prefix, base.size
        for capacity, (rows, inverse, steps_inverse, half) in flat.items():
            if not rows:
                continue
            if capacity:  # the best prompt row of that capacity beside the best B - 1 decoders
                if not prompters:
                    continue
                row = sel.prompt_ranking(capacity)[0].top()
                best = max([(row + value[k]) * inv + gains[k] * s_inv + slopes[k] - t_half * active
                            for b, inv, s_inv, t_half in rows for k in (b - 1 if b - 1 < n else n,)])
            else:  # decoders only
                row = 0.0
                best = max([value[k] * inv + gains[k] * s_inv + slopes[k] - t_half * active
                            for b, inv, s_inv, t_half in rows for k in (b if b < n else n,)])
            if best + margin * ((row + value[n]) * inverse + gains[n] * steps_inverse + slopes[n] + half * active) >= top:
                return False
    return True


def _flat_bound_rows(sel: _Selector, source: str, groups: Sequence[_Group], w0: int, positive: bool):
    """The programs of ``groups`` for ``_none_can_reach``, or None if a duration is unknown.

    By prompt capacity (0: decoders-only cohorts, which beaten mixed programs
    leave out): per program (batch, 1/T, (width - w0)/T, T/2), and the largest
    1/T, (width - w0)/T and T/2. Kept for one durations list.
    """
    durations = sel.t_ms
    key = (source, w0, positive)
    cached = sel.infos.bound_rows.get(key)
    if cached is not None and cached[0] is durations:
        return cached[1]
    by_capacity: dict[int, list] = {0: []}
    for group in groups:
        steps = group.width - w0
        rows = [(batch, 1.0 / t, steps / t, 0.5 * t) for index, batch in group.batches if (t := durations[index]) > 0.0]
        if len(rows) < len(group.batches):
            sel.infos.bound_rows[key] = (durations, None)
            return None
        if group.scorer is _score_mixed:
            if group.prefill_capacity:
                by_capacity.setdefault(group.prefill_capacity, []).extend(rows)
            if positive and _decode_only_beaten(sel, group):
                continue
        by_capacity[0].extend(rows)
    flat = {capacity: (rows, max((r[1] for r in rows), default=0.0), max((r[2] for r in rows), default=0.0),
                       max((r[3] for r in rows), default=0.0)) for capacity, rows in by_capacity.items()}
    sel.infos.bound_rows[key] = (durations, flat)
    return flat


def _decode_only_beaten(sel: _Selector, group: _Group) -> bool:
    """Whether every program of a mixed ``group`` scores its decoders-only cohort strictly below
    a rectangular program of the same source, width and batch measured faster.

    The two take the same lanes, worth the same (positive) value; over a
    longer duration that value earns a lower rate and the waiting cost is
    larger (U6). So such a cohort never wins or ties (U8): the rectangular
    program, scored or bounded below the best score, is ahead of it.
    """
    cols = sel.source_columns(group.source)
    if not cols.positive:
        return False
    durations = sel.t_ms
    cached = sel.infos.beaten.get(id(group))
    if cached is None or cached[0] is not durations:
        siblings = sel.infos.siblings.get(id(group))
        beaten = siblings is not None and all(
            durations[index] > 0.0 and any(0.0 < durations[other] < durations[index] for other in others)
            for index, others in zip(group.members, siblings))
        cached = sel.infos.beaten[id(group)] = (durations, beaten)
    return cached[1]


_CANDIDATES = {
    GraphKind.DECODE: _generation_candidate,
    GraphKind.SPECULATIVE: _generation_candidate,
    GraphKind.PREFILL: _prefill_candidate,
    GraphKind.MIXED: _mixed_candidate,
}

_BUILT = {
    GraphKind.DECODE: _built_generation,
    GraphKind.SPECULATIVE: _built_generation,
    GraphKind.PREFILL: _built_prefill,
    GraphKind.MIXED: _built_mixed,
}


# ---------------------------------------------------------------------------
# Filters and the final choice
# ---------------------------------------------------------------------------


_MISSING = -math.inf  # ``_Out.scores`` of a graph with no measured candidate (scores are finite)


class _Out:
    """Where the group scorers write a decision's candidates.

    A measured program's score and payload go to two flat lists indexed by
    catalog position (no per-program rank tuple: the leader is then found by
    ``max``, ``count`` and ``index`` over plain floats); anything else -- an
    unknown duration's entry, a deferred candidate, a ragged or prefix-limit
    program's own result -- goes to ``entries`` as the full entry it is.
    """

    __slots__ = ("scores", "payloads", "entries")

    def __init__(self, size: int) -> None:
        self.scores: list[float] = [_MISSING] * size
        self.payloads: list = [None] * size
        self.entries: dict[int, object] = {}

    def put(self, index: int, known: bool, score: float, payload) -> None:
        if known:
            self.scores[index] = score
            self.payloads[index] = payload
        else:
            self.entries[index] = (True, score), index, payload

    def add(self, entry) -> None:
        if entry is not None:
            self.entries[entry[1]] = entry

    def entry(self, index: int):
        """The classic ``(rank key, index, payload)`` entry of a graph, or None (or a ``_Deferred``)."""
        score = self.scores[index]
        if score != _MISSING:
            return (False, score), index, self.payloads[index]
        return self.entries.get(index)

    def all_entries(self) -> list:
        """Every graph's entry in catalog order (deferred candidates included), as the scorers once wrote them."""
        return [self.entry(index) for index in range(len(self.scores))]


class _FlatIndex:
    """``_Scored.by_index`` read straight from ``_Out`` (the fast path builds no dict)."""

    __slots__ = ("out",)

    def __init__(self, out: _Out) -> None:
        self.out = out

    def get(self, index: int):
        found = self.out.entry(index)
        return found if type(found) is tuple else None


class _Scored:
    """Every graph's candidate of one decision, scored; full candidates are built on demand.

    Scoring all graphs is the hot loop, so it keeps one small tuple per graph,
    ``(rank key, catalog index, payload)``: the payload is what the kind's
    builder needs (a ranking and a cohort size) or an already built
    ``_Candidate`` (deferred ones). Only the candidates that can still decide
    the outcome -- the best ranked, and the smaller shapes that might prune them
    (U12) -- are ever built.
    """

    def __init__(self, sel: _Selector, graphs: Sequence[GraphDescriptor], timings: Sequence[GraphTiming],
                 by_index: "dict[int, tuple] | _FlatIndex | None" = None) -> None:
        self.sel = sel
        self.graphs = graphs
        self.timings = timings
        self.entries: list[tuple] = []
        self.by_index = {} if by_index is None else by_index  # entries by catalog index (pruning checks read it)
        self.built: dict[int, _Candidate] = {}
        self._leaders: list[tuple] | None = None  # best_undominated() of the current entries

    def add(self, entry: tuple) -> None:
        self.entries.append(entry)
        self.by_index[entry[1]] = entry
        self._leaders = None

    def add_all(self, entries: list[tuple]) -> None:
        self.entries.extend(entries)
        self.by_index.update(zip(map(itemgetter(1), entries), entries))
        self._leaders = None

    def add_built(self, c: _Candidate) -> None:
        self.built[c.index] = c
        self.add((c.rank_key(), c.index, c))

    def drop(self, index: int) -> None:
        del self.by_index[index]
        self.entries = [e for e in self.entries if e[1] != index]
        self._leaders = None

    def candidate(self, entry: tuple) -> _Candidate:
        rank, index, payload = entry
        c = self.built.get(index)
        if c is None:
            graph = self.graphs[index]
            c = _BUILT[graph.kind](self.sel, index, graph, self.timings[index], rank[1], payload)
            self.built[index] = c
        return c

    def is_dominated(self, entry: tuple) -> bool:
        """U12: another shape of the same kind does the same logical work with no larger capacity."""
        served, depth, key = self.served(entry), self.graphs[entry[1]].proposal_depth, None
        for other in self.sel.infos.dominators[entry[1]]:
            found = self.by_index.get(other)
            # every logical key names its served lanes, and generation keys the depth:
            # a cheap necessary condition before any candidate or key is built
            if found is None or self.served(found) != served or self.graphs[other].proposal_depth != depth:
                continue
            key = self.candidate(entry).logical_key() if key is None else key
            if self.candidate(found).logical_key() == key:
                return True
        return False

    def served(self, entry: tuple) -> int:
        """Lanes the entry's candidate serves, read from its payload without building it."""
        rank, index, payload = entry
        if isinstance(payload, _Candidate):
            return payload.served
        if self.graphs[index].kind is GraphKind.MIXED:
            _, prompt, k, _ = payload
            return k + (prompt is not None)
        return payload[-1]  # generation (ranking, k) and prefill (ranking, tokens, k)

    def best_undominated(self) -> list[tuple]:
        """Every entry tied at the best rank among those no padded alternative dominates.

        Pruning only ever removes candidates, so it is enough to test the best
        ones in rank order (usually the first rank level holds the answer); the
        logical keys of the rest are never built. Kept until the entries change.
        """
        if self._leaders is None:
            self._leaders = self._undominated_leaders()
        return self._leaders

    def _undominated_leaders(self) -> list[tuple]:
        if not self.entries:
            return []
        top = max(map(_rank_of, self.entries))
        tied = [e for e in self.entries if e[0] == top and not self.is_dominated(e)]
        if tied:
            return tied
        for e in sorted(self.entries, key=_rank_of, reverse=True):
            if tied and e[0] < tied[0][0]:
                break
            if not self.is_dominated(e):
                tied.append(e)
        return tied


_rank_of = itemgetter(0)  # an entry's rank key


def _explores_redundantly(c: _Candidate, sel: _Selector, prefill_sizes: Sequence[int]) -> bool:
    """D4: an unmeasured prefill graph is skipped when a smaller capacity reaches the same endpoint."""
    if c.timing.known or c.graph.kind is not GraphKind.PREFILL:
        return False
    lanes, _ = c.build()
    p = sel.pop.prompters
    slot_to_index = {h.slot: i for i, h in enumerate(p.handle)}
    capacity = c.graph.prefill_capacity
    reach = max(min(capacity, p.to_endpoint[slot_to_index[lane.handle.slot]]) for lane in lanes)
    return any(reach <= size < capacity for size in prefill_sizes)


def _dominates(small: tuple[int, ...], large: tuple[int, ...]) -> bool:
    return small != large and all(a <= b for a, b in zip(small, large))


def _recency(c: _Candidate, sel: _Selector) -> int:
    by_slot = {}
    for cols in (sel.pop.decoders, sel.pop.prompters):
        for h, r in zip(cols.handle, cols.recency):
            by_slot[h.slot] = r
    lanes, _ = c.build()
    return max((by_slot[lane.handle.slot] for lane in lanes), default=0)


def _add_deferred(scored: _Scored, deferred: Sequence[_Deferred]) -> None:
    """Evaluate expensive candidates best bound first, skipping those that cannot win.

    A bound strictly below the best *undominated* candidate in hand cannot win.
    The comparison is always against the undominated best: a candidate just
    built may score highest and still be pruned as padding (U12), and a bound
    compared with it would skip a program that wins once it is pruned.
    (A skipped shape could in principle have dominated that candidate with the
    same logical work at a longer measured duration; that corner is accepted.)
    """
    leaders = scored.best_undominated()
    best = leaders[0][0] if leaders else None
    for d in sorted(deferred, key=lambda d: d.bound, reverse=True):
        if best is not None and d.bound < best:
            break
        c = d.make()
        if c is not None:
            scored.add_built(c)
            leaders = scored.best_undominated()
            best = leaders[0][0] if leaders else None


def select(
    graphs: Sequence[GraphDescriptor],
    timings: Sequence[GraphTiming],
    population: Population,
    described: CatalogInfo | None = None,
    durations: Sequence[float] | None = None,
) -> Choice | None:
    """The best graph and cohort for the population, or None when nothing can run.

    ``described`` is :func:`describe` of ``graphs`` and ``durations`` is
    :func:`durations_ms` of ``timings``; callers planning repeatedly on one
    catalog pass them to skip recomputing them.
    """
    described = described if described is not None else describe(graphs)
    sel = _Selector(population, described)
    sel.t_ms = durations if durations is not None else durations_ms(timings)
    out = _Out(len(graphs))
    skipped = []  # groups whose programs cannot win (the general path scores them)
    for group in described.eager:
        if group.scorer is _score_mixed and _decode_only_beaten(sel, group) and not (
                group.prefill_capacity and sel.pop.prompters.handle):
            skipped.append(group)  # no prompt row to carry: its decoders run faster elsewhere
            continue
        group.scorer(sel, group, graphs, timings, out)
    skipped += _score_bounded(sel, described.bounded, graphs, timings, out)
    if not out.entries:
        fast = _measured_leader(sel, _Scored(sel, graphs, timings, _FlatIndex(out)), out, skipped)
        if fast is not None:
            return fast
    for group in skipped:  # the general path below ranks every program
        group.scorer(sel, group, graphs, timings, out)
    scored = _Scored(sel, graphs, timings)
    found = out.all_entries()
    # catalog order: ties keep it (U8)
    scored.add_all([c for c in found if type(c) is tuple])
    deferred = [c for c in found if type(c) is _Deferred]
    # D4 reads unmeasured prefill programs only
    for entry in [e for i in described.prefill_graphs if type(e := found[i]) is tuple and e[0][0]]:
        if _explores_redundantly(scored.candidate(entry), sel, described.prefill_sizes):
            scored.drop(entry[1])
    _add_deferred(scored, deferred)
    tied = [scored.candidate(e) for e in scored.best_undominated()]
    if not tied:
        return None
    if len(tied) > 1:
        for c in tied:
            c.recency = _recency(c, sel)
    best = max(tied, key=_Candidate.tie_key)
    lanes, prefill_row = best.build()
    return Choice(best.graph, lanes, best.timing, best.score, decision_log_scale(abs(best.score)), prefill_row, sel)


def _measured_leader(sel: _Selector, scored: _Scored, out: _Out, skipped: Sequence[_Group]) -> Choice | None:
    """The usual decision, read from the flat scores: every candidate measured and rectangular,
    mixed or prefill, and one program strictly best and not padding (U12). None otherwise,
    and then ``select`` ranks every entry as it always has. ``scored`` reads its entries
    from ``out`` (``_FlatIndex``); only the pruning check looks any up.

    With a single best score there is no tie to break (U8), no deferred program
    to consult and no unmeasured prefill for D4, so the entry ``select`` would
    pick is the one at that score. Programs of ``skipped`` groups score below it
    (``_score_bounded``); if one of them could prune it as padding, this
    declines too, and ``select`` scores them all.
    """
    scores = out.scores
    top = max(scores, default=_MISSING)
    if top == _MISSING or scores.count(top) != 1:
        return None
    index = scores.index(top)
    if skipped:
        group_of, skipped_ids = sel.infos.group_of, {id(group) for group in skipped}
        if any(id(group_of[other]) in skipped_ids for other in sel.infos.same_depth_dominators[index]):
            return None
    payloads, graphs = out.payloads, scored.graphs
    entry = (False, top), index, payloads[index]
    # is_dominated's first test (the same served count and depth) on the flat payloads, and
    # for a prompt row, whether the smaller program could give it as many tokens
    graph, payload = graphs[index], payloads[index]
    served, prompt_tokens = _flat_served(graph, payload), _flat_prompt_tokens(graph, payload)
    if any(payloads[other] is not None and _flat_served(graphs[other], payloads[other]) == served
           and prompt_tokens <= graphs[other].prefill_capacity for other in sel.infos.same_depth_dominators[index]):
        if scored.is_dominated(entry):
            return None
    graph, log_scale = graphs[index], decision_log_scale(abs(top))
    if graph.kind in _RECTANGULAR_KINDS:  # what _built_generation's candidate would build: its lanes
        r, k = payloads[index]
        return Choice(graph, tuple(_decode_lanes(sel, r, k)), scored.timings[index], top, log_scale, None, sel)
    best = scored.candidate(entry)
    lanes, prefill_row = best.build()
    return Choice(best.graph, lanes, best.timing, best.score, log_scale, prefill_row, sel)


_RECTANGULAR_KINDS = (GraphKind.DECODE, GraphKind.SPECULATIVE)  # flat payloads of these are (ranking, k)


def _flat_prompt_tokens(graph: GraphDescriptor, payload) -> int:
    """Tokens of a measured program's prompt row when it is its only one (0 otherwise).

    A program of smaller prompt capacity cannot give that row as many tokens,
    so it cannot do the same logical work (U12); more rows are left to the
    full check.
    """
    if graph.kind is GraphKind.PREFILL:
        ranked, tokens, k = payload
        return tokens[ranked.first()] if k == 1 else 0
    if graph.kind is GraphKind.MIXED and payload[1] is not None:
        return payload[3][payload[1]]
    return 0


def _flat_served(graph: GraphDescriptor, payload) -> int:
    """``_Scored.served`` of a measured program's flat payload."""
    if graph.kind is GraphKind.MIXED:
        return payload[2] + (payload[1] is not None)
    return payload[-1]


def evaluate(
    graphs: Sequence[GraphDescriptor],
    timings: Sequence[GraphTiming],
    population: Population,
    infos: Sequence[GraphInfo],
    indices: Sequence[int],
    selection: "_Selector | None" = None,
) -> dict[int, Choice]:
    """Each listed graph's own best cohort, as ``select`` would build it, by catalog index.

    Funded exploration (D7, D8) needs the cohort and ordinary value of
    programs that did not win; graphs with nothing to run are left out.
    ``log_scale`` is 0: callers scale by the winning decision's factor.
    """
    found = evaluate_scores(graphs, timings, population, infos, indices, selection)
    return {index: evaluated.choice() for index, evaluated in found.items()}


@dataclass(frozen=True, slots=True)
class Evaluated:
    """One graph's own best cohort, scored; its lanes are built only when its ``Choice`` is asked for."""

    candidate: _Candidate

    @property
    def score(self) -> float:
        return self.candidate.score

    def choice(self) -> Choice:
        c = self.candidate
        lanes, prefill_row = c.build()
        return Choice(c.graph, lanes, c.timing, c.score, 0.0, prefill_row)


def evaluate_scores(
    graphs: Sequence[GraphDescriptor],
    timings: Sequence[GraphTiming],
    population: Population,
    infos: Sequence[GraphInfo],
    indices: Sequence[int],
    selection: "_Selector | None" = None,
) -> dict[int, Evaluated]:
    """``evaluate`` without building lanes: timing refresh ranks every stale program by its
    score and runs one, so only that one needs its cohort's lanes (64 per program at most).

    ``selection`` is a ``Choice.selection`` of a decision on the same population:
    its rankings are reused (they depend on the population alone).
    """
    if isinstance(selection, _Selector) and selection.pop is population:
        sel = selection
    else:
        sel = _Selector(population, infos)
    scored = _Scored(sel, graphs, timings)
    out = {}
    for index in indices:
        graph = graphs[index]
        make = _CANDIDATES.get(graph.kind)
        c = make(sel, index, graph, timings[index]) if make else None
        if isinstance(c, _Deferred):
            c = c.make()
        elif c is not None:
            c = scored.candidate(c)
        if c is not None:
            out[index] = Evaluated(c)
    return out
