"""Value arithmetic and cohort selection (spec "Useful service and selection").

Everything here is a pure function of numbers: lane values in, the best
cohort and its value rate out. The ``select`` package builds the lane values from
request state; this module never sees a request.

Units: value in prompt-token units, durations in milliseconds, value rates in
value per millisecond.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence


# ---------------------------------------------------------------------------
# Lane values (U3, U6)
# ---------------------------------------------------------------------------


def prompt_lane_value(tokens: int, prompt_price: float) -> float:
    """Consumed uncached prompt tokens at the request's prefill price (U1, U3)."""
    return tokens * prompt_price


@dataclass(frozen=True, slots=True)
class PrefillTimes:
    """The catalog's fastest known one-row prefill programs: (prompt capacity, duration ms), capacity ascending.

    ``ms(tokens)`` estimates the least time to prefill ``tokens`` prompt tokens alone: the faster of
    the fastest known program holding them and full chunks of the most efficient program (least
    duration per prompt token of capacity) with the fastest program holding the rest. Only measured
    programs count; with none, there is no estimate (``of`` returns None).
    """

    capacities: tuple[int, ...]
    durations_ms: tuple[float, ...]

    @classmethod
    def of(cls, measured: Sequence[tuple[int, float]]) -> "PrefillTimes | None":
        """``measured``: (prompt capacity, duration ms) of each known one-row prefill program."""
        best: dict[int, float] = {}
        for capacity, duration_ms in measured:
            if duration_ms > 0 and capacity > 0:
                best[capacity] = min(duration_ms, best.get(capacity, math.inf))
        if not best:
            return None
        capacities = sorted(best)
        # a larger program that is also faster serves every smaller chunk: keep the running minimum from above
        durations = [best[c] for c in capacities]
        for i in range(len(durations) - 2, -1, -1):
            durations[i] = min(durations[i], durations[i + 1])
        return cls(tuple(capacities), tuple(durations))

    def ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        index = bisect.bisect_left(self.capacities, tokens)
        single = self.durations_ms[index] if index < len(self.capacities) else math.inf
        capacity, duration = min(zip(self.capacities, self.durations_ms), key=lambda p: (p[1] / p[0], -p[0]))
        full, tail = divmod(tokens, capacity)
        chunked = full * duration + (self.durations_ms[bisect.bisect_left(self.capacities, tail)] if tail else 0.0)
        return min(single, chunked)


def prompt_chunk_value(tokens: int, remaining: int, price: float, first_token: float,
                       times: PrefillTimes | None) -> float:
    """A prompt row's value: the chunk's share of the value of finishing the prompt (issue 20).

    A finishing chunk earns its tokens and the first output token, as U3 and U13 state. A chunk that
    leaves prompt behind earns the value of the whole remaining prompt (its tokens and the first output
    token) in proportion to the share of the remaining prefill time it does,
    ``T_chunk / (T_chunk + T_rest)`` with both times the least known prefill time (``PrefillTimes``):
    the prompt is worth something to its user when it is finished, and a split that leaves a tail for
    another program is worth less than one that does not (docs/scheduling-utility.md, "Departures from
    the spec"). Without measured prefill times the chunk earns its tokens (the spec's rule).

    Every chunk of a split with the least total time has the same rate, the prompt's value over that
    time; those exact ties are broken toward the smaller chunk (a relative 1e-9, far above rounding and
    far below any real difference), so that the chunk that finishes the prompt, which earns the
    whole remaining value, is the large one and no tail worth a few tokens is left to wait.
    """
    if tokens >= remaining:
        return tokens * price + first_token
    if times is None:
        return tokens * price
    chunk_ms = times.ms(tokens)
    share = chunk_ms / (chunk_ms + times.ms(remaining - tokens)) * (1.0 - CHUNK_TIE_BIAS * tokens / remaining)
    return (remaining * price + first_token) * share


CHUNK_TIE_BIAS = 1e-9
"""Relative tilt toward the smaller of equally good prompt chunks (``prompt_chunk_value``)."""


def decode_lane_value(
    expected_tokens: float,
    token_price: float,
    delivery_price: float,
    age_coefficient: float,
    age_ms: float,
) -> float:
    """Priced output service of one decode lane plus its age credit c*sigma*A (U6).

    ``age_coefficient`` is c_i * sigma_i; the remaining c_i*sigma_i*T part of the
    age credit depends on the graph and is added by :func:`value_rate`. A lane
    always delivers one visible burst, whatever its token count (U2).
    """
    return expected_tokens * token_price + delivery_price + age_coefficient * age_ms


def decode_age_price(c: float, beta: float, cadence_ms: float | None) -> float:
    """The age price c (U6), value/ms^2, priced by the catalog's cadence: at least beta / d^2.

    ``PolicyConfig.age_price_by_cadence`` (docs/scheduling-utility.md, "The age price from first
    principles"): ``cadence_ms`` is d, the reference interval (U5) of a plain decoder when every
    request slot decodes. A stream served every d ms receives output worth beta per d; at
    c = beta / d^2 a stream that has waited one such interval costs, per ms, what its output is worth
    per ms. Tied to the catalog's own decode duration, it transfers between catalogs; the policy's c
    stays the floor, and an unmeasured cadence leaves it as it is.
    """
    if cadence_ms:
        return max(c, beta / (cadence_ms * cadence_ms))
    return c


def value_rate(served_value: float, duration_ms: float, active_age_price: float) -> float:
    """The selection objective for a graph of known duration T (U6).

    ``served_value`` is the whole numerator: priced service plus every served
    decoder's c*sigma*(A+T). The waiting cost T/2 * sum of c over all active
    decoders is charged whether or not they are served (U14: it vanishes with
    no decoder).
    """
    if duration_ms <= 0:
        raise ValueError(f"value_rate needs a positive duration, got {duration_ms} ms")
    return served_value / duration_ms - 0.5 * duration_ms * active_age_price


def optimistic_work_score(served_value: float) -> float:
    """Score of a graph whose duration is unknown (U8): its useful value, no division."""
    return served_value


# ---------------------------------------------------------------------------
# Common scaling (U7)
# ---------------------------------------------------------------------------


def decision_log_scale(magnitude: float) -> float:
    """Natural log of a power-of-two factor bringing ``magnitude`` near one (U7).

    Every value of one decision is multiplied by the same factor, so comparisons
    are unchanged while very large prices (f/x for a starved request) stay in a
    comfortable floating-point range.
    """
    if not math.isfinite(magnitude) or magnitude <= 0:
        return 0.0
    _, exponent = math.frexp(magnitude)
    return -exponent * math.log(2.0)


# ---------------------------------------------------------------------------
# Cohorts of unconstrained graphs (U9): sort once, prefix sums shared
# ---------------------------------------------------------------------------


class RankedLanes:
    """Lanes sorted by value (descending) with prefix sums shared by every batch capacity.

    ``prefix[k]`` is the value of the best k lanes; ``order[j]`` the index (into
    the caller's lane list) of the j-th best lane, equal values least recently
    used first (U8).

    The prefix sums need only the values in sorted order, never which lane
    holds which: lanes of equal value add the same number in any order. So
    they are summed over a plain sort of the values, and the permutation (a
    keyed sort, several times dearer) is built on first use -- only the lanes
    of a winning or a pruning candidate ever need it.
    """

    __slots__ = ("values", "recency", "_prefix", "_order")

    def __init__(self, values: Sequence[float], recency: Sequence[int] | None = None, lazy: bool = False) -> None:
        self.values = values
        self.recency = recency
        # ``lazy``: summed on first use (prompt rankings are read mostly through ``top``)
        self._prefix: list[float] | None = None if lazy else _best_first_sums(values)
        self._order: tuple[int, ...] | None = None

    @property
    def prefix(self) -> list[float]:
        if self._prefix is None:
            self._prefix = _best_first_sums(self.values)
        return self._prefix

    def top(self) -> float:
        """``prefix[1]``, the best lane's value, without sorting (callers check there is a lane)."""
        if self._prefix is not None:
            return self._prefix[1]
        return 0.0 + max(self.values)  # prefix[1] is 0.0 + the largest value: the same float

    @classmethod
    def rank(cls, values: Sequence[float], recency: Sequence[int] | None = None, lazy: bool = False) -> "RankedLanes":
        """Rank by value; equal values go to the least recently used lane first (U8).

        Without ``recency`` the caller's list is already least recently used first.
        """
        return cls(values, recency, lazy)

    @property
    def order(self) -> tuple[int, ...]:
        if self._order is None:
            values, recency = self.values, self.recency
            if recency is None:  # a stable sort keeps list order among equal values
                self._order = tuple(sorted(range(len(values)), key=values.__getitem__, reverse=True))
            else:
                self._order = tuple(sorted(range(len(values)), key=lambda i: (-values[i], recency[i])))
        return self._order

    def first(self) -> int:
        """``order[0]`` without ranking the rest (callers check there is a lane)."""
        if self._order is not None:
            return self._order[0]
        values, recency = self.values, self.recency
        if recency is None:
            return values.index(max(values))
        return min(range(len(values)), key=lambda i: (-values[i], recency[i]))

    def __len__(self) -> int:
        return len(self.values)

    def best(self, capacity: int) -> tuple[int, float]:
        """How many lanes a graph of ``capacity`` rows serves, and their value."""
        k = min(capacity, len(self.values))
        return k, self.prefix[k]


class OrderedLanes(RankedLanes):
    """Lanes taken in a given ``order`` rather than by value: ``prefix[k]`` is the value of the first
    k lanes of ``order`` (``PolicyConfig.prompts_shortest_first``: prompters, least prompt left first)."""

    __slots__ = ()

    def __init__(self, values: Sequence[float], order: Sequence[int]) -> None:
        super().__init__(values, None, lazy=True)
        self._order = tuple(order)

    @property
    def prefix(self) -> list[float]:
        if self._prefix is None:
            self._prefix = list(accumulate((self.values[i] for i in self._order), initial=0.0))
        return self._prefix

    def top(self) -> float:
        return 0.0 + self.values[self._order[0]]

    def first(self) -> int:
        return self._order[0]


def _best_first_sums(values: Sequence[float]) -> list[float]:
    """0, then the sums of the best 1, 2, ... values."""
    return list(accumulate(sorted(values, reverse=True), initial=0.0))


# ---------------------------------------------------------------------------
# Constrained ragged cohorts (U9): fixed lane lengths, count <= B, rows <= P
# ---------------------------------------------------------------------------


def best_constrained_cohort(
    values: Sequence[float], lengths: Sequence[int], batch: int, rows: int
) -> tuple[float, tuple[int, ...]]:
    """Exact best subset with at most ``batch`` lanes and at most ``rows`` total length.

    Lanes of equal length are interchangeable except for value, so within a
    length group the best j are always its top j. A small dynamic program over
    (lanes used, rows used) combines the groups; the number of groups is at most
    the graph width, so this never enumerates request subsets.
    """
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(i)
    # state: (count, rows) -> (value, picks per group)
    states: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    ranked_groups = []
    for length, members in sorted(groups.items()):
        members.sort(key=values.__getitem__, reverse=True)
        prefix = list(accumulate((values[i] for i in members), initial=0.0))
        ranked_groups.append((length, members, prefix))
        states = _extend_states(states, length, prefix, batch, rows)
    value, picks = max(states.values(), key=lambda s: (s[0], sum(s[1])))
    chosen = [i for (_, members, _), j in zip(ranked_groups, picks) for i in members[:j]]
    return value, tuple(chosen)


def _extend_states(states, length, prefix, batch, rows):
    out: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
    for (count, used), (value, picks) in states.items():
        for j in range(len(prefix)):
            c, r = count + j, used + j * length
            if c > batch or r > rows:
                break
            candidate = (value + prefix[j], picks + (j,))
            if (c, r) not in out or candidate[0] > out[(c, r)][0]:
                out[(c, r)] = candidate
    return out


# ---------------------------------------------------------------------------
# Adaptive ragged cohorts (U10): three orderings, causal allocation pricing
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdaptiveLane:
    """One prefix-limit lane as the host prices it.

    base        value of the pending-token row alone (token, delivery, age credit)
    token_price price of each further expected output token
    survival    nonincreasing joint prefix probabilities of draft positions 1..ceiling-1
                (what the device allocates by)
    weights     the expected tokens each allocated position yields in selection
                (survival raised to adaptive_verification_alpha)
    slot        request slot: the device's tie-break after prefix length
    """

    base: float
    token_price: float
    survival: tuple[float, ...]
    weights: tuple[float, ...]
    slot: int

    @property
    def ceiling(self) -> int:
        return 1 + len(self.survival)

    def full_value(self) -> float:
        return self.base + self.token_price * sum(self.weights)


def causal_allocation(lanes: Sequence[AdaptiveLane], rows: int) -> tuple[tuple[int, ...], float]:
    """Rows each lane receives from the device's frontier allocation, and their value.

    Every lane holds its pending-token row; the remaining rows go one at a time
    to the highest joint prefix probability on the causal frontier, ties to the
    shorter prefix, then the smaller slot (spec S2). Because each lane's
    probabilities do not increase with depth, the frontier process equals taking
    the best remaining (probability, depth, slot) entries overall.
    """
    spare = rows - len(lanes)
    if spare < 0:
        raise ValueError(f"{len(lanes)} lanes do not fit {rows} target rows")
    entries = (
        (-p, depth, lane.slot, index)
        for index, lane in enumerate(lanes)
        for depth, p in enumerate(lane.survival, start=1)
    )
    taken = [1] * len(lanes)
    value = sum(lane.base for lane in lanes)
    for _, depth, _, index in heapq.nsmallest(spare, entries):
        taken[index] += 1
        lane = lanes[index]
        value += lane.token_price * lane.weights[depth - 1]
    return tuple(taken), value


ADAPTIVE_ORDERINGS = ("total_value", "pending_delivery", "value_per_row")


def adaptive_orderings(lanes: Sequence[AdaptiveLane]) -> dict[str, tuple[int, ...]]:
    """The three bounded orderings of U10, each a permutation of lane indices."""
    idx = range(len(lanes))
    return {
        "total_value": tuple(sorted(idx, key=lambda i: -lanes[i].full_value())),
        "pending_delivery": tuple(sorted(idx, key=lambda i: -lanes[i].base)),
        "value_per_row": tuple(sorted(idx, key=lambda i: -lanes[i].full_value() / lanes[i].ceiling)),
    }


def ordering_prefix_values(
    lanes: Sequence[AdaptiveLane], order: Sequence[int], rows: int, limit: int | None = None
) -> list[float]:
    """Causal-allocation value of every cohort prefix ``order[:k]``, k = 1..limit, in one pass.

    ``limit`` defaults to min(rows, n), the most lanes the rows can hold.

    The device's allocation of a prefix is its pending rows plus the best
    ``rows - k`` draft positions by (probability desc, depth, slot) among its
    lanes (see :func:`causal_allocation`). Keeping those positions in one sorted
    list as lanes join makes each prefix cost one insertion per draft position
    and one slice sum, instead of a fresh allocation.
    """
    keys: list[tuple[float, int, int]] = []
    gains: list[float] = []
    base, out = 0.0, []
    most = min(rows, len(order)) if limit is None else min(limit, rows, len(order))
    for k in range(1, most + 1):
        lane = lanes[order[k - 1]]
        base += lane.base
        for depth, p in enumerate(lane.survival, start=1):
            key = (-p, depth, lane.slot)
            at = bisect.bisect(keys, key)
            keys.insert(at, key)
            gains.insert(at, lane.token_price * lane.weights[depth - 1])
        out.append(base + sum(gains[: rows - k]))
    return out


def best_adaptive_cohort(
    lanes: Sequence[AdaptiveLane],
    batch: int,
    rows: int,
    *,
    orders: dict[str, tuple[int, ...]] | None = None,
    extra: Sequence[float] | None = None,
    prefix_values=None,
) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """Best cohort prefix over the three orderings, priced by its causal allocation.

    ``orders`` may be precomputed once per decision (they do not depend on the
    graph); ``extra`` adds a per-lane value that does (the c*sigma*T age credit);
    ``prefix_values(name, order, rows, limit)`` may memoize :func:`ordering_prefix_values`
    across graphs sharing P. Returns (value, chosen lane indices, rows allocated
    to each chosen lane). Evaluates at most 3 * min(B, P, n) prefixes: bounded,
    never exponential.
    """
    orders = orders if orders is not None else adaptive_orderings(lanes)
    best: tuple[float, str, int] | None = None
    limit = min(batch, rows, len(lanes))
    for name, order in orders.items():
        if prefix_values is not None:
            values = prefix_values(name, order, rows, limit)
        else:
            values = ordering_prefix_values(lanes, order, rows, limit)
        added = 0.0
        for k in range(1, limit + 1):
            added += extra[order[k - 1]] if extra is not None else 0.0
            value = values[k - 1] + added
            if best is None or value > best[0]:
                best = (value, name, k)
    if best is None:
        return (0.0, (), ())
    value, name, k = best
    chosen = tuple(sorted(orders[name][:k]))
    taken, _ = causal_allocation([lanes[i] for i in chosen], rows)
    return value, chosen, taken
