"""Prerequisite lookahead: a state program scored with the inference it enables (spec "Prerequisites and completion").

Pure numbers, as ``utility.py``: lane contributions in, the best joint cohort
and its value rate out. ``state_ops.py`` builds the contributions from request
state and turns the winner into lanes.

- ``best_pair`` (P1, P2): a prerequisite shape of duration T and ``first_rows``
  rows, followed by an inference shape of duration F and ``following_rows`` rows.
  For every k >= 1 newly ready rows served by the following graph, the k
  largest newly ready contributions, the largest already ready contributions
  in the following graph's remaining rows, and the largest terminal-completion
  contributions in the prerequisite's remaining rows, by sorted prefix sums:
  the exact best cohort of the two fixed shapes without enumerating subsets.
  The sequence is scored over T+F (a served decoder's age runs to T+F; a
  terminal row completed in the first graph stops aging at T, and its waiting
  cost over F is saved); the productive first stage (its terminal completions
  alone, over T) is compared as well, and the better of the two is the score.
  Equal scores prefer advancing more requests.
- ``chain_rate`` (P4): a longer chain, where each enabled row's continuation
  is worth V in a further F ms: the row contributes V*T/(T+F).

Units: value in prompt-token units, durations in ms, rates in value per ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True, slots=True)
class Ready:
    """An already ready row the following graph may serve: its priced value and age slope c*sigma.

    ``value`` holds its service and c*sigma*A; the slope multiplies the time to
    its service, T+F, as ``scorers.rate`` multiplies T for a single graph.
    """

    value: float
    slope: float = 0.0


@dataclass(frozen=True, slots=True)
class Terminal:
    """A terminal snapshot the prerequisite graph may complete (P6): terminal_value + price*sigma*A."""

    value: float


@dataclass(frozen=True, slots=True)
class PairShape:
    """Two fixed shapes: the prerequisite (T ms, rows) and the following inference (F ms, rows).

    A duration of 0 is unknown (U8): the pair then scores its useful value, no division.
    """

    first_ms: float
    first_rows: int
    following_ms: float
    following_rows: int

    @property
    def known(self) -> bool:
        return self.first_ms > 0 and self.following_ms > 0


@dataclass(frozen=True, slots=True)
class Waiting:
    """The common waiting cost: every active decoder's c and every held terminal's price (P6).

    ``terminal`` is the one coefficient a held terminal row adds (terminal_age_price:
    every terminal row of a family shares it).
    """

    decoders: float = 0.0  # sum of c over active decoders
    terminal: float = 0.0  # terminal_age_price
    terminals: int = 0  # held terminal rows (served or not)


@dataclass(frozen=True, slots=True)
class PairChoice:
    """The best joint cohort of one shape pair: how many of each sorted list, and its score."""

    score: float
    known: bool
    newly: int  # newly ready rows in both graphs, best first (the following graph serves ``served``)
    served: int  # k: newly ready rows the following graph serves
    ready: int  # already ready rows in the following graph, best first
    terminals: int  # terminal rows completed by the prerequisite, best first
    sequence: bool  # the whole sequence scored best (False: the productive first stage did)

    @property
    def advanced(self) -> int:
        """Requests the prerequisite advances (the equal-rate tie order)."""
        return self.newly + self.terminals

    def key(self) -> tuple:
        """Rank: unknown first (U8), then score, then more requests advanced (P2)."""
        return (not self.known, self.score, self.advanced)


def _sums(values: Sequence[float]) -> list[float]:
    return [0.0, *accumulate(sorted(values, reverse=True))]


def _terminal_saving(waiting: Waiting, first_ms: float, following_ms: float) -> float:
    """Waiting cost a terminal row completed at T saves over the rest of the sequence (P2, P6)."""
    total = first_ms + following_ms
    return 0.5 * waiting.terminal * (total * total - first_ms * first_ms)


def sequence_rate(value: float, shape: PairShape, waiting: Waiting, saved: float) -> float:
    """(value - waiting cost of everyone held over T+F + what served terminals saved) / (T+F)."""
    total = shape.first_ms + shape.following_ms
    held = waiting.decoders + waiting.terminal * waiting.terminals
    return (value + saved) / total - 0.5 * total * held


def prefix_rate(terminal_value: float, shape: PairShape, waiting: Waiting) -> float:
    """The productive first stage alone: its terminal completions over T, everyone waiting T."""
    held = waiting.decoders + waiting.terminal * waiting.terminals
    return terminal_value / shape.first_ms - 0.5 * shape.first_ms * held


def best_pair(shape: PairShape, newly: Sequence[float], ready: Sequence[Ready],
              terminals: Sequence[Terminal], waiting: Waiting, *, least: int = 1,
              fixed: float = 0.0) -> PairChoice | None:
    """P1/P2: the exact best joint cohort of two fixed shapes, or None when no newly ready row fits.

    ``newly``: each newly ready row's value in the following graph (it passes
    through the prerequisite first). The prerequisite's rows left after k
    served rows and the terminal rows advance further newly ready rows at no
    extra physical cost (they earn nothing now; equal rates prefer them).

    The mixed contract's cases: ``fixed`` is the value of a following-graph row
    outside these rows (a mixed graph's prompt row), and ``least`` the fewest
    newly ready rows the following rows must serve (0 when that prompt row is
    itself newly ready: the pair already serves one).
    """
    limit = min(len(newly), shape.first_rows, shape.following_rows)
    if limit < least:
        return None
    total_ms = shape.first_ms + shape.following_ms
    new_sums = _sums(newly)
    ready_sums = _sums([r.value + r.slope * total_ms for r in ready])
    term_values = sorted((t.value for t in terminals), reverse=True)
    saving = _terminal_saving(waiting, shape.first_ms, shape.following_ms) if shape.known else 0.0
    term_sums = [0.0, *accumulate(term_values)]
    best = None
    for k in range(least, limit + 1):
        r = min(len(ready), shape.following_rows - k)
        t = min(len(term_values), shape.first_rows - k)
        value = fixed + new_sums[k] + ready_sums[r] + term_sums[t]
        extra = min(len(newly), shape.first_rows - t) - k  # more restored rows: no extra cost
        if shape.known:
            whole = sequence_rate(value, shape, waiting, t * saving)
            first = prefix_rate(term_sums[t], shape, waiting)
            score, sequence = (whole, True) if whole >= first else (first, False)
        else:
            score, sequence = value, True
        choice = PairChoice(score, shape.known, k + extra, k, r, t, sequence)
        if best is None or choice.key() > best.key():
            best = choice
    return best


@dataclass(frozen=True, slots=True)
class Continuation:
    """P4: an enabled row whose continuation supplies ``value`` in a further ``ms`` (0: unknown)."""

    value: float
    ms: float


def continuation_index(continuation: Continuation, first_ms: float) -> float:
    """V*T/(T+F): the row's cohort-ranking contribution; an unknown F compares by V (optimistic)."""
    if continuation.ms <= 0 or first_ms <= 0:
        return continuation.value
    return continuation.value * first_ms / (first_ms + continuation.ms)


@dataclass(frozen=True, slots=True)
class ChainChoice:
    score: float
    known: bool
    rows: int  # continuing rows, best contribution first
    terminals: int

    def key(self) -> tuple:
        return (not self.known, self.score, self.rows + self.terminals)


def chain_rate(first_ms: float, first_rows: int, continuing: Sequence[Continuation],
               terminals: Sequence[Terminal], waiting: Waiting) -> ChainChoice | None:
    """P4: sum the best contributions that fit the prerequisite, divide by T, charge the waiting cost.

    Rows are ranked by V*T/(T+F); terminal rows completed by the same program add their own
    value. Every continuing row is worth its index and every terminal its value, so the best
    cohort takes the largest of both together (at least one continuing row).
    """
    if not continuing or first_rows < 1:
        return None
    indexed = sorted((continuation_index(c, first_ms) for c in continuing), reverse=True)
    term = sorted((t.value for t in terminals), reverse=True)
    taken_rows, taken_terms, value = 1, 0, indexed[0]
    i, j = 1, 0
    while taken_rows + taken_terms < first_rows and (i < len(indexed) or j < len(term)):
        if j >= len(term) or (i < len(indexed) and indexed[i] >= term[j]):
            value += indexed[i]
            i, taken_rows = i + 1, taken_rows + 1
        else:
            value += term[j]
            j, taken_terms = j + 1, taken_terms + 1
    if first_ms <= 0:
        return ChainChoice(value, False, taken_rows, taken_terms)
    held = waiting.decoders + waiting.terminal * waiting.terminals
    return ChainChoice(value / first_ms - 0.5 * first_ms * held, True, taken_rows, taken_terms)
