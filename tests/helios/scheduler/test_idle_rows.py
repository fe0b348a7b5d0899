"""A prompt whose request would then decode, before the decode round it would join (issue 22, 2026-12-05):
``PolicyConfig.finishing_prompts_fill_rows`` (docs/scheduling-utility.md, "Departures from the spec", 16)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_harness import MS, decode, prefill

from flare_contract.graphs import GraphKind
from helios.scheduler import PolicyConfig
from helios.scheduler.select.leader import select
from helios.scheduler.select.population import Decoders, Population, Prompters
from helios.scheduler.select.timing import GraphTiming
from helios.scheduler.types import RequestHandle
from helios.scheduler.utility import PrefillTimes
from helios.sim.files import Trace, TraceRequest, parse_catalog
from helios.sim.simulator import simulate

DEFAULTS = PolicyConfig.preset("balanced")
# the bundled catalog's shape on the development machine: no mixed program, a 64-token chunk costs four
# rounds of four rows, and two of them cost less than one 256-token program
ENGINE_LIKE = parse_catalog({
    "request_slots": 8,
    "graphs": [{"kind": "decode", "batch_capacity": b, "duration_ms": t} for b, t in ((1, 1.6), (4, 2.0), (8, 2.6))]
    + [{"kind": "prefill", "batch_capacity": 1, "prefill_capacity": c, "duration_ms": t} for c, t in ((64, 8.0), (256, 22.0))],
})


def _closed_loop_wave() -> tuple[TraceRequest, ...]:
    """Three streams decoding and a 128-token prompt (two 64-token chunks) arriving beside them."""
    return (*(TraceRequest(f"s{i}", i * MS, 64, 400) for i in range(3)), TraceRequest("p", 30 * MS, 128, 8))


def _rounds_between_chunks(result, request: str) -> int:
    """Plans that ran between a prompt's first and its last prefill chunk."""
    chunks = [plan.start_ns for plan in result.plans if request in plan.cohort and plan.graph.kind is GraphKind.PREFILL]
    return sum(1 for plan in result.plans if chunks[0] < plan.start_ns < chunks[-1])


def test_a_prompt_whose_first_chunk_ran_finishes_before_rounds_that_would_leave_its_row_idle():
    filled = simulate(ENGINE_LIKE, Trace(DEFAULTS, 0, _closed_loop_wave()))
    assert _rounds_between_chunks(filled, "p") == 0
    assert filled.request("p").first_output_ms() == pytest.approx(16.0)  # two 8 ms chunks, back to back
    # U6's value rate alone: the first chunk made the prompt look served, and rounds with an idle row
    # ran before its last chunk
    alone = simulate(ENGINE_LIKE, Trace(replace(DEFAULTS, finishing_prompts_fill_rows=0), 0, _closed_loop_wave()))
    assert _rounds_between_chunks(alone, "p") > 0
    assert alone.request("p").first_output_ms() > filled.request("p").first_output_ms()


# -- the rule itself, on one decision ------------------------------------------

GRAPHS = (decode(1), decode(4), prefill(64))
TIMINGS = (GraphTiming(int(1.6 * MS), True), GraphTiming(int(2.0 * MS), True), GraphTiming(int(8.0 * MS), True))
AGE_PRICE, ADAPTATION_MS, FIRST_TOKEN = 0.1, 10.0, 70.0
# P first while (adaptation / T_D) rounds of the new lane outweigh c * sum(A) * T_P:
# 5 * 70 = 350 against 0.1 * 3 * A * 8, so three decoders of age A < 145.8 ms
THRESHOLD_MS = ADAPTATION_MS / 2.0 * FIRST_TOKEN / (AGE_PRICE * 3 * 8.0)


def _decision(ages_ms: float, decoders: int = 3, remaining: int = 64, times: PrefillTimes | None = None,
              first_token: float = FIRST_TOKEN, adaptation_ms: float = ADAPTATION_MS, fills: bool = True,
              graphs=GRAPHS, timings=TIMINGS) -> str:
    d, p = Decoders(), Prompters(times=times)
    for slot in range(decoders):
        d.handle.append(RequestHandle(slot, slot + 1))
        d.token_price.append(75.0)  # an output token's price is far above a prompt token's: U6 picks the round
        d.delivery_price.append(1.0)
        d.age_slope.append(0.5)
        d.age_credit.append(0.5 * ages_ms)  # A = credit / slope
        d.room.append(100)
        d.survival.append({})
        d.recency.append(slot)
    p.handle.append(RequestHandle(10, 11))
    p.start.append(0)
    p.remaining.append(remaining)
    p.to_endpoint.append(remaining)
    p.price.append(1.5)
    p.first_token.append(first_token)
    p.recency.append(10)
    population = Population(d, p, AGE_PRICE * decoders, prompts_join_rounds=fills, age_price=AGE_PRICE,
                            adaptation_ms=adaptation_ms)
    choice = select(graphs, timings, population)
    assert choice is not None
    return choice.graph.id


def test_u6_alone_picks_the_round_in_these_decisions():
    """The decisions below differ from U6's only by the rule: without it, each picks the round."""
    for ages in (0.0, THRESHOLD_MS):
        assert _decision(ages, fills=False) == "decode_b4"
    assert _decision(0.0, remaining=72, times=PrefillTimes.of([(64, 8.0)]), adaptation_ms=20.0, fills=False) == "decode_b4"


def test_the_finishing_prefill_goes_before_the_round_while_it_fills_an_idle_row():
    assert _decision(0.0, decoders=3) == "prefill_b1_c64"
    # no room: four decoders hold decode_b4's every row, and no program holds five
    assert _decision(0.0, decoders=4) == "decode_b4"


def test_the_prefill_goes_first_only_while_the_lane_it_adds_outweighs_the_age_it_adds():
    assert _decision(0.97 * THRESHOLD_MS) == "prefill_b1_c64"
    assert _decision(1.03 * THRESHOLD_MS) == "decode_b4"


def test_a_prompt_that_would_not_decode_or_cannot_finish_within_the_adaptation_time_does_not_move():
    assert _decision(0.0, first_token=0.0) == "decode_b4"  # a cut prompt, or one with no output room
    # with no measured prefill time the rest cannot be timed, so only a finishing chunk moves
    assert _decision(0.0, remaining=100) == "decode_b4"
    # 72 tokens: a 64-token chunk and a tail, 16 ms to finish; longer than a 10 ms adaptation time,
    # within a 20 ms one, and then its first chunk goes before the round
    times = PrefillTimes.of([(64, 8.0)])
    assert times.ms(72) == pytest.approx(16.0)
    assert _decision(0.0, remaining=72, times=times) == "decode_b4"
    assert _decision(0.0, remaining=72, times=times, adaptation_ms=20.0) == "prefill_b1_c64"


def test_past_a_full_round_the_prefill_goes_first_while_the_larger_round_costs_little_more():
    """Two decoders fill decode_b2; a third needs decode_b4. Deferring the prompt costs it its lane in
    the rounds ahead; going first costs every round the larger program's extra time."""
    graphs = (decode(1), decode(2), decode(4), prefill(64))

    def timed(b4_ms: float):
        return tuple(GraphTiming(int(t * MS), True) for t in (1.6, 1.8, b4_ms, 8.0))

    assert _decision(0.0, decoders=2, graphs=graphs, timings=timed(2.0), fills=False) == "decode_b2"
    assert _decision(0.0, decoders=2, graphs=graphs, timings=timed(2.0)) == "prefill_b1_c64"
    # a decode_b4 of 30 ms: every round after the prefill would cost far more than the lane it adds
    assert _decision(0.0, decoders=2, graphs=graphs, timings=timed(30.0), fills=False) == "decode_b2"
    assert _decision(0.0, decoders=2, graphs=graphs, timings=timed(30.0)) == "decode_b2"
