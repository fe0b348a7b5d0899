"""V2/P7: mixed selection equals exhaustive enumeration of every legal cohort."""

from __future__ import annotations

from exhaustive import EXAMPLES, decoder_value, prompt_value, score, subsets
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_harness import MS, ask, measured, mixed, prefill
from test_core_lifecycle import TIMING, decoding

import pytest

from helios.scheduler import CompletionRecord, ExecutionTiming, PolicyConfig
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Decoders, Population, Prompters
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.types import RequestHandle

prices = st.floats(0.0, 100.0, allow_nan=False)


@st.composite
def mixed_cases(draw):
    batch = draw(st.sampled_from([2, 4]))
    width = draw(st.sampled_from([1, 2, 4]))
    capacity = draw(st.sampled_from([64, 128]))
    graph = mixed(batch, capacity, width, width - 1)
    slope = draw(st.floats(0.0, 2.0))
    shared_slope = draw(st.booleans())
    dec = Decoders()
    for i in range(draw(st.integers(0, 5))):
        dec.handle.append(RequestHandle(i, i + 1))
        dec.token_price.append(draw(prices))
        dec.delivery_price.append(draw(prices))
        dec.age_credit.append(draw(prices))
        dec.age_slope.append(slope if shared_slope else draw(st.floats(0.0, 2.0)))  # families may differ
        dec.room.append(draw(st.integers(1, 5)))
        s = sorted(draw(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3)), reverse=True)
        dec.survival.append({"learned": tuple(s)})
        dec.recency.append(draw(st.integers(0, 3)))
    prm = Prompters()
    for j in range(draw(st.integers(0, 3))):
        remaining = draw(st.integers(1, 300))
        prm.handle.append(RequestHandle(10 + j, 20 + j))
        prm.start.append(0)
        prm.remaining.append(remaining)
        prm.to_endpoint.append(remaining)
        prm.price.append(draw(st.floats(0.0, 10.0)))
        prm.first_token.append(draw(prices))
        prm.recency.append(0)
    t_ms = draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    active = draw(st.floats(0.0, 3.0))
    return graph, Population(dec, prm, active, draw(st.sampled_from([0.5, 1.0, 2.0]))), t_ms


def exhaustive_best(graph, population, t_ms):
    dec, prm = population.decoders, population.prompters
    source = "learned" if graph.width > 1 else None
    width = min(graph.width, graph.proposal_depth + 1) if source else 1
    t = t_ms or 0.0

    def dvalue(i):
        return decoder_value(dec, i, max(1, min(width, dec.room[i])), source, population.alpha, t)

    best = None
    for cohort in subsets(range(len(dec)), graph.batch_capacity):
        if cohort:
            v = score(sum(dvalue(i) for i in cohort), t_ms, population.active_age_price)
            best = v if best is None else max(best, v)
    for j in range(len(prm)):
        for cohort in subsets(range(len(dec)), graph.batch_capacity - 1):
            value = prompt_value(prm, j, graph.prefill_capacity) + sum(dvalue(i) for i in cohort)
            v = score(value, t_ms, population.active_age_price)
            best = v if best is None else max(best, v)
    return best


@settings(max_examples=EXAMPLES, deadline=None)
@given(mixed_cases())
def test_V2_P7_mixed_selection_equals_exhaustive_enumeration(case):
    graph, population, t_ms = case
    timing = GraphTiming(int(t_ms * MS) if t_ms else 0, True)
    if t_ms:
        t_ms = timing.duration_ns / MS
    choice = select([graph], [timing], population)
    best = exhaustive_best(graph, population, t_ms)
    if best is None:
        assert choice is None
        return
    assert choice.score == pytest.approx(best, rel=1e-9, abs=1e-9)
    prompt_rows = [l for l in choice.lanes if l.phase.value == "prompt"]
    assert len(prompt_rows) <= 1 and len(choice.lanes) <= graph.batch_capacity
    assert (choice.prefill_row is None) == (not prompt_rows)


def test_V2_fitting_prompt_tail_in_a_mixed_graph_publishes_the_first_token():
    M = mixed(4, 128)
    s = measured({prefill(64): 4.0, M: 5.0})
    (a,), fence = decoding(s, 1)
    b = s.admit(ask(100, 5))
    plan = s.plan()
    assert plan.graph is M
    row = plan.lanes[plan.prefill_row]
    assert row.handle == b and row.prompt_tokens == 100 and row.finishes_prompt


def test_V2_speculative_rows_in_a_mixed_graph_use_their_width():
    M = mixed(2, 64, width=4, depth=3)
    s = measured({prefill(64): 4.0, M: 5.0})
    a = s.admit(ask(64, 50, sources=("learned",)))
    plan = s.plan()
    s.commit(plan, 1)
    s.complete(1, [CompletionRecord(a, prompt_consumed=64, tokens=(1,))], TIMING)
    plan = s.plan()
    assert plan.graph is M and plan.prefill_row is None
    assert plan.lanes[0].query_length == 4
    s.commit(plan, 2)
    out = s.complete(2, [CompletionRecord(a, tokens=(1, 2, 3), offered=3)], TIMING)
    assert out[0].tokens == (1, 2, 3)  # a speculative row commits its accepted prefix


def test_V2_mixed_shapes_expire_independently():
    M2, M4 = mixed(2, 64), mixed(4, 64)
    ttl = PolicyConfig().estimate_ttl_ns
    s2 = measured({prefill(64): 4.0, M2: 5.0, M4: 6.0})
    s2.advance_to(ttl // 2)
    s2.observe_duration(M4.id, 6 * MS)  # only M4 is observed again half-way
    s2.advance_to(ttl + 1)
    assert s2.cost.is_stale(M2.cost_key(), s2.now_ns)
    assert not s2.cost.is_stale(M4.cost_key(), s2.now_ns)
    assert s2.cost.estimate_ns(M2.cost_key()) == 5 * MS  # expiry keeps the measured cost
    timings = dict(zip(s2.graphs, s2._timings()))
    assert not timings[M2].fresh and timings[M4].fresh
