"""One decision's rankings: lane values computed once per logical width or prompt capacity (U9).

Selection never re-sorts per shape: ``DecisionRankings`` ranks the decoders once per
(proposal source, logical width) and the prompters once per prompt capacity,
and every batch capacity reads the shared prefix sums.

A measured program's score stands for a cohort named by a ranking itself: a
``DecodeRanking`` for the best min(B, n) of its decoders (decode, speculative
and decoders-only mixed programs), a ``PromptRanking`` for the best min(B, n)
prompters (prefill), a ``PromptRow`` for a mixed program with a prompt row.
Each answers ``served`` and ``prompt_tokens``, which dominance pruning reads
(U12) before any candidate is built. Rankings are built once per decision and
shared by every batch capacity, so scoring allocates no record per program.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import TYPE_CHECKING, Sequence

from flare_contract.graphs import GraphDescriptor
from helios.scheduler.select.population import Population, cumulative_gains
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.utility import AdaptiveLane, OrderedLanes, RankedLanes, prompt_chunk_value

if TYPE_CHECKING:
    from helios.scheduler.select.catalog import CatalogInfo, PerDurations


@dataclass(slots=True)
class DecodeRanking:
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
    # what expected tokens are computed from, in eligibility order: the cumulative gains and the
    # room per lane, or None for width-one rows (one token each)
    gain_rows: list | None
    rooms: list[int] | None
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
            if self.gain_rows is None:
                self._expected = [1.0] * len(self.eligible)
            elif self.uncapped:  # the formula below with n = width and no cap that binds: the same floats
                rows, last = self.gain_rows, self.width - 1
                self._expected = [1.0 + rows[j][last] for j in self.ranked.order]
            else:  # S5: 1 + the gains of the first n - 1 drafts, capped by the room, per member
                order = self.ranked.order
                rows, rooms = map(self.gain_rows.__getitem__, order), map(self.rooms.__getitem__, order)
                self._expected = [
                    e if (e := 1.0 + (g[n - 1] if n <= len(g) else g[-1])) < r else float(r)
                    for g, n, r in zip(rows, self.lengths, rooms)
                ]
        return self._expected

    def decoders_served(self, graph: GraphDescriptor) -> int:
        """Decoders a program of this ranking serves: its best min(B, n)."""
        batch, n = graph.batch_capacity, len(self.eligible)
        return batch if batch < n else n

    served = decoders_served  # lanes the program serves (U12's cheap test)

    def prompt_tokens(self, graph: GraphDescriptor) -> int:
        """No prompt row (U12's cheap test)."""
        return 0

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
        """The best ``k`` members and their query lengths, sorted: what they do, whatever the shape (U12)."""
        if self.keys is None:
            self.keys = {}
        key = self.keys.get(k)
        if key is None:
            key = tuple(sorted(zip(self.members[:k], self.lengths[:k])))
            self.keys[k] = key
        return key


@dataclass(slots=True)
class PromptRanking:
    """Prompters ranked for one prompt capacity: each row consumes min(capacity, remaining) tokens (U13)."""

    ranked: RankedLanes
    tokens: list[int]  # per prompter (population order): the tokens a row of this capacity consumes

    def served(self, graph: GraphDescriptor) -> int:
        """Prompt rows a prefill program of this ranking serves: its best min(B, n)."""
        batch, n = graph.batch_capacity, len(self.tokens)
        return batch if batch < n else n

    def prompt_tokens(self, graph: GraphDescriptor) -> int:
        """Tokens of the program's prompt row when it is its only one (0 otherwise).

        A program of smaller prompt capacity cannot give that row as many
        tokens, so it cannot do the same logical work (U12); more rows are left
        to the full check.
        """
        return self.tokens[self.ranked.first()] if self.served(graph) == 1 else 0


@dataclass(slots=True)
class PromptRow:
    """A mixed program's cohort with a prompt row: ``row`` of ``prompts`` beside the best min(B - 1, n)
    members of ``decoders`` (P7). Without a row, a mixed program's cohort is its ``DecodeRanking``."""

    decoders: DecodeRanking
    prompts: PromptRanking
    row: int  # the prompter whose prompt rides with the decoders

    def decoders_served(self, graph: GraphDescriptor) -> int:
        batch, n = graph.batch_capacity - 1, len(self.decoders.eligible)
        return batch if batch < n else n

    def served(self, graph: GraphDescriptor) -> int:
        return self.decoders_served(graph) + 1

    def prompt_tokens(self, graph: GraphDescriptor) -> int:
        return self.prompts.tokens[self.row]


@dataclass(slots=True)
class SourceColumns:
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


@dataclass(slots=True)
class AdaptiveLanes:
    """Prefix-limit lanes of one (source, logical width), built once per decision (U10)."""

    members: list[int]  # decoder index per lane
    lanes: list[AdaptiveLane]
    slopes: list[float]  # c*sigma per lane
    orders: object  # ``adaptive_orderings(lanes)``


@dataclass(slots=True)
class AllSlopes:
    """Every decoder's age slope: whether they are one value, and their prefix sums if so."""

    uniform: bool
    prefix: list[float] | None


class DecisionRankings:
    """One decision's caches: rankings per width and per prompt capacity."""

    def __init__(self, population: Population, infos: "CatalogInfo") -> None:
        self.pop = population
        self.infos = infos
        # (source, width) untimed, (source, width, t_ms) for a duration when slopes differ
        self.decode_rankings: dict[tuple, DecodeRanking] = {}
        self.prompt_rankings: dict[int, PromptRanking] = {}
        self.adaptive_lanes: dict[tuple[str | None, int], AdaptiveLanes] = {}
        self.adaptive_prefixes: dict[tuple, list[float]] = {}
        self.cumulative: dict[str, list[list[float] | None]] = {}
        self.fixed: list[float] | None = None
        self.columns: dict[str | None, SourceColumns] = {}
        self.all_slopes: AllSlopes | None = None
        self.all_positive: bool | None = None  # SourceColumns.positive of every decoder
        self.gain_prefixes: dict[tuple[str, int], list[float]] = {}  # see next_gains
        self.empty_prompts: PromptRanking | None = None  # every capacity's ranking with no prompter
        self.scored: "DecisionRankings | None" = None  # rankings of ``population.scored`` (candidates.scored_rankings)
        # with room for every width, query lengths are the width itself
        self.least_room = min(population.decoders.room, default=0)
        self.t_ms: list[float] = []  # per graph: its known duration in ms, 0.0 while unknown (set by select)
        self.derived: "PerDurations | None" = None  # the catalog's caches for ``t_ms`` (set by select)
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

    def decode_ranking(self, source: str | None, width: int, timing: GraphTiming | None = None) -> DecodeRanking:
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

    def narrowest_ranked(self, source: str, below: int) -> int:
        """The widest untimed ranking of ``source`` already built below width ``below`` (0: none)."""
        return max((key[1] for key in self.decode_rankings if len(key) == 2 and key[0] == source and key[1] < below),
                   default=0)

    def source_columns(self, source: str | None) -> SourceColumns:
        """The eligible decoders of ``source`` and their columns (see ``SourceColumns``)."""
        found = self.columns.get(source)
        if found is None:
            found = self.columns[source] = self._gather(source)
        return found

    def _gather(self, source: str | None) -> SourceColumns:
        d = self.pop.decoders
        gains = None if source is None else self._gains(source)
        fixed = self._fixed_values()
        every = self.least_room >= 1 and (gains is None or None not in gains)
        if every:
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
        # whether the slopes are one value, and (if so) their prefix sums, which any order shares;
        # every decoder's columns: one check and one prefix for every source
        if every and self.all_slopes is not None:
            uniform, slope_prefix = self.all_slopes.uniform, self.all_slopes.prefix
        else:
            uniform = self.pop.uniform_slope or len(set(slopes)) <= 1
            slope_prefix = list(accumulate(slopes, initial=0.0)) if uniform else None
            if every:
                self.all_slopes = AllSlopes(uniform, slope_prefix)
        # every lane value is positive: token prices > 0, the rest >= 0 (vouched, or checked once)
        if self.pop.positive:
            positive = True
        elif every and self.all_positive is not None:
            positive = self.all_positive
        else:
            positive = min(prices, default=0.0) > 0.0 and min(fixed, default=0.0) >= 0.0
            if every:
                self.all_positive = positive
        found = SourceColumns(idx, slopes, uniform, prices, fixed, rows, rooms, slope_prefix=slope_prefix,
                              positive=positive)
        if rows is not None:
            found.shortest = min(map(len, rows), default=0)
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

    def _rank_decoders(self, source: str | None, width: int, t_ms: float | None) -> DecodeRanking:
        """Lane values of every eligible decoder at one logical width, ranked once (U9).

        With ``t_ms`` the values include each lane's c*sigma*T, and the slope
        prefix is zero (the graph duration is already priced in).
        """
        cols = self.source_columns(source)
        idx, prices, fixed, rows, rooms = cols.idx, cols.prices, cols.fixed, cols.rows, cols.rooms
        raw_lengths = None  # every lane's query length is the width itself
        uncapped = False
        if source is None:
            width, rows, rooms = 1, None, None
            values = [p + f for p, f in zip(prices, fixed)]  # one token: 1.0 * p + f, exactly
        elif self.least_room >= width and width <= cols.shortest:
            # n = width for every row and every row reaches it; and no room caps the tokens:
            # each gain is s ** alpha <= 1 (s in [0, 1]), so 1 + g[width - 1] <= width <= room
            last, uncapped = width - 1, True
            values = [(1.0 + g[last]) * p + f for g, p, f in zip(rows, prices, fixed)]
        else:
            # S5's expected tokens min(1 + g[n-1], room) times p, plus f: the hot loop of a decision
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
        return DecodeRanking(idx, width, raw_lengths, ranked, slope_prefix, cols.uniform, rows, rooms, uncapped)

    def _fixed_values(self) -> list[float]:
        """Per decoder: the width-independent part of its lane value (delivery and c*sigma*A)."""
        if self.fixed is None:
            d = self.pop.decoders
            # decode_lane_value(0, 0, delivery, 1, credit), whose zero terms add nothing: delivery + credit
            self.fixed = [dp + credit for dp, credit in zip(d.delivery_price, d.age_credit)]
        return self.fixed

    # -- prompters --------------------------------------------------------

    def prompt_ranking(self, capacity: int) -> PromptRanking:
        """The prompters ranked for rows of ``capacity`` prompt tokens (U13)."""
        ranking = self.prompt_rankings.get(capacity)
        if ranking is not None:
            return ranking
        p = self.pop.prompters
        if not p.handle:  # every capacity ranks nobody: one empty ranking for all
            if self.empty_prompts is None:
                self.empty_prompts = PromptRanking(RankedLanes([]), [])
            ranking = self.empty_prompts
        else:
            tokens = [r if r < capacity else capacity for r in p.remaining]  # min(capacity, r)
            # prompt_lane_value (tokens * price) plus the first output token a finishing row publishes;
            # with prefill times, a chunk that leaves prompt behind earns its share (prompt_chunk_value)
            if p.times is None:
                values = [t * price + (first if t == left else 0.0)
                          for t, price, first, left in zip(tokens, p.price, p.first_token, p.remaining)]
            else:
                values = [prompt_chunk_value(t, left, price, first, p.times)
                          for t, price, first, left in zip(tokens, p.price, p.first_token, p.remaining)]
            if self.pop.prompts_by_due and len(values) > 1 and len(p.due) == len(values):
                ranked = _in_order(p, tokens, sorted(range(len(values)), key=lambda i: (p.due[i], -values[i], p.recency[i])))
            elif self.pop.shortest_prompts_first and len(values) > 1:
                ranked = _shortest_first(p, tokens, values)
            else:
                # most prompt programs read only the best row (``top``): the prefix sums wait for a wider one
                ranked = RankedLanes.rank(values, None if self.prompters_lru else p.recency, lazy=True)
            ranking = PromptRanking(ranked, tokens)
        self.prompt_rankings[capacity] = ranking
        return ranking


def _shortest_first(p, tokens: list[int], values: list[float]) -> OrderedLanes:
    """``PolicyConfig.prompts_shortest_first``: prompt rows go to the prompters with the least prompt
    left (equal ones by value, then least recently selected), each row valued at the highest price
    among the prompters (docs/scheduling-utility.md, "Prompts in order").

    No prompt token is visible before its prompt finishes, so which prompter a row serves changes only
    which first token comes out first: the shortest first makes them all come sooner than taking turns
    (which the fairness price does by itself, a prompt just served having the lowest price). The price
    of the queue is its most deserving member's, so the order does not change how prompt work weighs
    against decoding; each row's chunk is still valued by its own prompt's length, so the program chosen
    for it splits that prompt in the least time.
    """
    recency = p.recency
    return _in_order(p, tokens, sorted(range(len(values)), key=lambda i: (p.remaining[i], -values[i], recency[i])))


def _in_order(p, tokens: list[int], order: list[int]) -> OrderedLanes:
    """Prompt rows in ``order``, each valued at the highest price among the prompters (``_shortest_first``,
    ``PolicyConfig.prompts_by_due``)."""
    top = max(p.price)
    congestion = top - 1.0  # price is 1 + f/x
    first_token = [(f - (price - 1.0)) + congestion if f > 0.0 else 0.0 for f, price in zip(p.first_token, p.price)]
    if p.times is None:
        priced = [t * top + (first if t == left else 0.0) for t, first, left in zip(tokens, first_token, p.remaining)]
    else:
        priced = [prompt_chunk_value(t, left, top, first, p.times)
                  for t, first, left in zip(tokens, first_token, p.remaining)]
    return OrderedLanes(priced, order)


def _nondecreasing(values: Sequence[int]) -> bool:
    return list(values) == sorted(values)  # sorting an already sorted list is one linear pass, in C
