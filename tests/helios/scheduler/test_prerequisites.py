"""P1-P4: the prerequisite lookahead's exact pair cohort and the continuation index, against brute force.

The brute force below scores every legal joint cohort of two fixed shapes from
the spec's text ("Prerequisites and completion"), independently of
helios/scheduler/prerequisites.py: each newly ready row served by the following
graph passes through the prerequisite; ready rows fill the following graph;
terminal rows fill the prerequisite; the sequence is scored over T+F with
decoder ages running to T+F and served terminals' waiting stopping at T; the
productive first stage (its terminal completions over T) is compared too.
"""

from __future__ import annotations

from itertools import combinations

from exhaustive import EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from helios.scheduler.prerequisites import (
    Continuation,
    PairShape,
    Ready,
    Terminal,
    Waiting,
    best_pair,
    chain_rate,
)

EPS = 2.0 ** -53
values = st.floats(0.0, 200.0, allow_nan=False)


def _subsets(items, least, most):
    for k in range(least, min(most, len(items)) + 1):
        yield from combinations(items, k)


def brute_force(shape: PairShape, newly, ready, terminals, waiting: Waiting, least=1, fixed=0.0):
    """(best score, its magnitude for the rounding bound) over every legal joint cohort, or None.

    ``fixed``: a following-graph row outside the enumerated rows (a mixed graph's prompt row);
    ``least``: the fewest newly ready rows the following rows serve."""
    t, f = shape.first_ms, shape.following_ms
    total = t + f
    best = None
    for served in _subsets(newly, least, min(shape.first_rows, shape.following_rows)):
        for rows in _subsets(ready, 0, shape.following_rows - len(served)):
            for done in _subsets(terminals, 0, shape.first_rows - len(served)):
                value = fixed + sum(served) + sum(r.value + r.slope * total for r in rows) + sum(x.value for x in done)
                waiting_rows = waiting.terminals - len(done)
                cost = 0.5 * total * total * (waiting.decoders + waiting.terminal * waiting_rows)
                cost += 0.5 * t * t * waiting.terminal * len(done)  # completed at T: stops waiting (P2)
                whole = (value - cost) / total
                first = (sum(x.value for x in done)
                         - 0.5 * t * t * (waiting.decoders + waiting.terminal * waiting.terminals)) / t
                score = max(whole, first)
                magnitude = (abs(value) + cost) / total + abs(first) + 1.0
                if best is None or score > best[0]:
                    best = (score, magnitude)
    return best


@st.composite
def pair_cases(draw):
    shape = PairShape(draw(st.floats(0.25, 30.0)), draw(st.integers(1, 4)),
                      draw(st.floats(0.25, 30.0)), draw(st.integers(1, 4)))
    newly = draw(st.lists(values, min_size=0, max_size=4))
    ready = [Ready(draw(values), draw(st.floats(0.0, 3.0))) for _ in range(draw(st.integers(0, 4)))]
    terminals = [Terminal(draw(values)) for _ in range(draw(st.integers(0, 3)))]
    waiting = Waiting(draw(st.floats(0.0, 2.0)), draw(st.floats(0.0, 2.0)), len(terminals) + draw(st.integers(0, 2)))
    # the mixed contract's cases: a prompt row outside these rows, itself newly ready (least 0) or not
    least, fixed = draw(st.sampled_from([(1, 0.0), (1, None), (0, None)]))
    return shape, newly, ready, terminals, waiting, least, draw(values) if fixed is None else fixed


@settings(max_examples=EXAMPLES, deadline=None)
@given(pair_cases())
def test_P1_P2_pair_cohort_equals_exhaustive_enumeration(case):
    """P1: sorted prefix sums over k >= 1 give the exact best joint cohort of two fixed shapes;
    P2: scored over T+F, terminals stop at T, the productive first stage compared too."""
    shape, newly, ready, terminals, waiting, least, fixed = case
    choice = best_pair(shape, newly, ready, terminals, waiting, least=least, fixed=fixed)
    expected = brute_force(shape, newly, ready, terminals, waiting, least, fixed)
    if expected is None:
        assert choice is None
        return
    score, magnitude = expected
    assert choice.score == pytest.approx(score, rel=0, abs=64 * EPS * magnitude)
    assert least <= choice.served <= min(shape.first_rows, shape.following_rows)
    assert choice.served + choice.ready <= shape.following_rows
    assert choice.newly + choice.terminals <= shape.first_rows


def test_P1_at_least_one_newly_ready_row_is_served():
    """A following graph whose ready rows are worth more must still serve one newly ready row."""
    shape = PairShape(1.0, 1, 1.0, 2)
    choice = best_pair(shape, [1.0], [Ready(100.0), Ready(90.0), Ready(80.0)], [], Waiting())
    assert choice.served == 1 and choice.ready == 1
    assert choice.score == pytest.approx((1.0 + 100.0) / 2.0)
    assert best_pair(shape, [], [Ready(100.0)], [], Waiting()) is None


def test_P2_productive_first_stage_is_compared():
    """A large terminal completion scores better over T alone than diluted over T+F."""
    shape = PairShape(1.0, 2, 100.0, 1)
    choice = best_pair(shape, [1.0], [], [Terminal(500.0)], Waiting(0.0, 0.0, 1))
    assert not choice.sequence
    assert choice.score == pytest.approx(500.0)
    assert choice.terminals == 1


def test_P2_terminal_completed_first_stops_aging_at_T():
    """The saved waiting cost of a terminal row completed at T: 0.5 * price * ((T+F)^2 - T^2)."""
    shape = PairShape(2.0, 2, 8.0, 1)
    waiting = Waiting(0.0, 1.0, 1)
    choice = best_pair(shape, [10.0], [], [Terminal(0.0)], waiting)
    total = 10.0
    assert choice.terminals == 1 and choice.sequence
    assert choice.score == pytest.approx((10.0 - 0.5 * 2.0 * 2.0) / total)


def test_P2_equal_rates_prefer_advancing_more_requests():
    """Spare prerequisite rows restore more requests at no extra cost: the plan advances them."""
    shape = PairShape(1.0, 4, 1.0, 1)
    choice = best_pair(shape, [5.0, 5.0, 5.0], [], [], Waiting())
    assert choice.served == 1 and choice.newly == 3


def test_P4_continuation_contributes_V_T_over_T_plus_F():
    """Two continuations, capacity one: the nearer smaller one wins by V*T/(T+F), not by V."""
    far, near = Continuation(100.0, 99.0), Continuation(30.0, 1.0)
    choice = chain_rate(1.0, 1, [far, near], [], Waiting(0.5))
    # far: 100 * 1/100 = 1; near: 30 * 1/2 = 15
    assert choice.score == pytest.approx(15.0 / 1.0 - 0.5 * 1.0 * 0.5)
    assert chain_rate(1.0, 1, [near, far], [], Waiting(0.5)).score == choice.score
    both = chain_rate(1.0, 2, [far, near], [], Waiting())
    assert both.score == pytest.approx(16.0) and both.rows == 2


def test_P4_unknown_durations_compare_by_useful_value():
    choice = chain_rate(0.0, 1, [Continuation(100.0, 99.0), Continuation(30.0, 1.0)], [], Waiting())
    assert not choice.known and choice.score == 100.0
