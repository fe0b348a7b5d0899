"""Issue 20's price-flow choices (docs/scheduling-utility.md, "Departures from the spec").

- ``prompt_chunk_share`` (default on): a prompt chunk that leaves prompt behind earns its share of the
  remaining prompt's value by prefill time, so a prompt is not split into a chunk that just fits and
  a tail of a few tokens that then waits behind decode rounds;
- ``token_rate_by_value`` (default on): x counts a consumed prompt token as 1/beta output token, where
  the catalog has a mixed program with a prompt row, and a newcomer starts at a batch-feasible share;
- ``prompt_outside_rate`` (default off): with x by value, a consumed prompt token adds nothing to x, so
  concurrent prompts keep their order instead of taking turns.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from sched_harness import Driver, ask, decode, measured, mixed, prefill

from helios.scheduler import GraphKind, PolicyConfig
from helios.scheduler.config import CHOICE_FIELDS
from helios.scheduler.types import LanePhase
from helios.scheduler.utility import PrefillTimes, prompt_chunk_value

P64, P128, P256, P1024 = prefill(64), prefill(128), prefill(256), prefill(1024)
D4 = decode(4)
# the example catalog's figures: a prompt bucket costs more per token the smaller it is
CATALOG = {P64: 2.96, P128: 3.92, P256: 5.84, P1024: 17.36, D4: 2.82}
M4 = mixed(4, 256)
WITH_MIXED = {**CATALOG, M4: 6.66}  # a mixed program with a prompt row: token_rate_by_value applies


def test_prefill_times_take_the_fastest_program_holding_the_tokens_and_full_chunks_beyond():
    times = PrefillTimes.of([(64, 2.96), (128, 3.92), (256, 5.84), (1024, 17.36), (256, 9.0)])
    assert times.ms(1) == times.ms(64) == 2.96
    assert times.ms(65) == 3.92 and times.ms(256) == 5.84  # the faster of two 256-token programs
    assert times.ms(1024 * 2 + 3) == pytest.approx(2 * 17.36 + 2.96)
    assert times.ms(0) == 0.0
    assert PrefillTimes.of([(64, 0.0)]) is None  # nothing measured: no estimate


def test_a_larger_faster_program_serves_the_smaller_chunk():
    times = PrefillTimes.of([(64, 5.0), (256, 4.0)])
    assert times.ms(10) == 4.0


def test_chunk_value_is_the_time_share_of_finishing_the_prompt():
    times = PrefillTimes.of([(128, 3.92), (256, 5.84)])
    price, first = 20.0, 80.0
    whole = 131 * price + first
    assert prompt_chunk_value(131, 131, price, first, times) == whole  # a finishing chunk: U13's value
    share = prompt_chunk_value(128, 131, price, first, times)
    assert share == pytest.approx(whole * 3.92 / (3.92 + 3.92), rel=1e-8)  # the 3-token tail costs a P128
    # per ms the finishing P256 beats the chunk that leaves a tail; by tokens alone it would not
    assert whole / 5.84 > share / 3.92
    assert (128 * price) / 3.92 > whole / 5.84
    assert prompt_chunk_value(128, 131, price, first, None) == 128 * price  # unmeasured: tokens, as U13


def test_equally_good_chunks_tilt_toward_the_smaller():
    times = PrefillTimes.of([(64, 2.5), (4096, 34.8)])
    small = prompt_chunk_value(64, 4160, 10.0, 50.0, times) / times.ms(64)
    large = prompt_chunk_value(4096, 4160, 10.0, 50.0, times) / times.ms(4096)
    assert small > large and math.isclose(small, large, rel_tol=1e-8)


def _first_output_plans(policy: PolicyConfig):
    s = measured(CATALOG, policy=policy)
    d = Driver(s, CATALOG)
    streams = [d.admit(ask(64, 400)) for _ in range(3)]
    d.run(12)  # the three streams decode
    prompt = d.admit(ask(131, 4))
    d.run(40)
    return d, streams, prompt


@pytest.mark.parametrize("share", [1, 0])
def test_a_prompt_beside_decoders_is_not_split_into_a_waiting_tail(share):
    """131 tokens while three streams decode. With the chunk share the prompt is prefilled whole in
    one P256 and publishes at once; with the spec text's token value (share off) P128 takes 128
    tokens and the 3-token tail loses to decode rounds for many frames. (``finishing_prompts_fill_rows``
    off, which would move that tail too: ``test_idle_rows.py``.)"""
    policy = dataclasses.replace(PolicyConfig(), prompt_chunk_share=share, finishing_prompts_fill_rows=0)
    d, streams, prompt = _first_output_plans(policy)
    chunks = [e for e in d.executed if any(l.handle == prompt for l in e.plan.lanes)
              and e.plan.graph.kind is GraphKind.PREFILL]
    if share:
        assert [(e.plan.graph, e.plan.lanes[0].prompt_tokens) for e in chunks] == [(P256, 131)]
    else:
        assert [e.plan.lanes[0].prompt_tokens for e in chunks][:1] == [128]
        tail_at = chunks[1].start_ms if len(chunks) > 1 else math.inf
        between = [e for e in d.executed if chunks[0].end_ms <= e.start_ms < tail_at]
        assert len(between) >= 3  # the tail waited behind decode rounds (here: past the end of the run)


def _one_prefill(catalog, by_value: int):
    """x after one P256 frame that serves a 256-token prompt and its first output token."""
    policy = dataclasses.replace(PolicyConfig(), token_rate_by_value=by_value)
    s = measured(catalog, policy=policy)
    d = Driver(s, catalog)
    h = d.admit(ask(256, 4))
    d.run(1)
    executed = d.executed[0]
    assert executed.plan.graph is P256
    interval = executed.end_ms - executed.start_ms
    decay = math.exp(-interval / policy.adaptation_ms)
    return s._state(h).service.token_rate, decay, interval, s


def test_token_rate_by_value_counts_a_prompt_token_as_one_over_beta():
    for by_value, weight in ((0, 1.0), (1, 1.0 / 64.0)):
        assert dataclasses.replace(PolicyConfig(), token_rate_by_value=by_value).prompt_service_weight == weight
        x, decay, interval, s = _one_prefill(WITH_MIXED, by_value)
        # the only participant. One for one: the whole normalizer (the best generation rate, D4's
        # 4 rows / 2.82 ms); by value: what a program gives one request, D4's one row / 2.82 ms
        start = s._normalizer() if not by_value else 1.0 / 2.82
        assert s._normalizer() == pytest.approx(4.0 / 2.82, rel=1e-12)
        served = 256 * weight + 1
        assert x == pytest.approx(decay * start + (1 - decay) * served / interval, rel=1e-12)


def test_token_rate_by_value_takes_effect_only_with_a_mixed_program():
    """Without a mixed program nothing carries a prompt beside decoders, and a prompt priced against a
    by-value x runs its chunks back to back (docs/scheduling-utility.md, "What x measures"): there the
    choice leaves x one for one, starting point included."""
    plain, _, _, _ = _one_prefill(CATALOG, 0)
    chosen, _, _, _ = _one_prefill(CATALOG, 1)
    assert chosen == plain
    with_mixed, _, _, _ = _one_prefill(WITH_MIXED, 1)
    assert with_mixed < plain / 10  # 256 prompt tokens add 4 output-token equivalents, not 256


def test_by_value_start_is_a_batch_feasible_share():
    """By value, a newcomer starts at the best min(rows, n) / T over generation programs, shared by n."""
    policy = dataclasses.replace(PolicyConfig(), token_rate_by_value=1)
    catalog = {**WITH_MIXED, decode(1): 2.58, decode(2): 2.66}
    s = measured(catalog, policy=policy)
    assert s._fair_rate(1) == pytest.approx(1 / 2.58 / 1, rel=1e-12)
    assert s._fair_rate(2) == pytest.approx(2 / 2.66 / 2, rel=1e-12)
    assert s._fair_rate(3) == pytest.approx(3 / 2.82 / 3, rel=1e-12)  # D4, the one holding 3, serves 3
    assert s._fair_rate(8) == pytest.approx(4 / 2.82 / 8, rel=1e-12)
    one_for_one = measured(catalog, policy=dataclasses.replace(PolicyConfig(), token_rate_by_value=0))
    assert one_for_one._fair_rate(2) == pytest.approx(4 / 2.82 / 2, rel=1e-12)


def test_prompt_outside_rate_leaves_a_prompting_x_to_decay():
    """With the choice, a chunk that leaves prompt behind is no service for x: x only decays (the
    frame's interval, nothing served); without it the chunk's 1024 / beta output-token equivalents
    raise it."""
    rates = {}
    for on in (0, 1):
        policy = dataclasses.replace(PolicyConfig(), prompt_outside_rate=on)
        assert policy.prompt_service_weight == (0.0 if on else 1.0 / 64.0)
        s = measured(WITH_MIXED, policy=policy)
        d = Driver(s, WITH_MIXED)
        h = d.admit(ask(3072, 4))
        d.fill()  # committed: the request's history starts at its fair share
        before = s._state(h).service.token_rate
        executed = d.step()
        (lane,) = executed.plan.lanes
        assert lane.phase is LanePhase.PROMPT and not lane.finishes_prompt
        interval = executed.end_ms - executed.start_ms
        decay = math.exp(-interval / policy.adaptation_ms)
        served = lane.prompt_tokens * policy.prompt_service_weight
        assert s._state(h).service.token_rate == pytest.approx(decay * before + (1 - decay) * served / interval,
                                                               rel=1e-12)
        rates[on] = s._state(h).service.token_rate / (decay * before)
    assert rates[1] == pytest.approx(1.0, rel=1e-12) and rates[0] > 1.2  # 1024 / 64 served in 17.36 ms


def test_prompt_outside_rate_finishes_concurrent_prompts_one_after_another():
    """Three equal 3072-token prompts admitted together, nothing decoding. Counted by value, the prompt
    just served has the lowest congestion price, so they take turns chunk by chunk (processor sharing:
    all three first outputs come late). With the choice their x decay alike while they prefill, the
    order holds, and each finishes before the next starts."""
    for on, expected in ((0, [0, 1, 2] * 3), (1, [0] * 3 + [1] * 3 + [2] * 3)):
        # rows by value (prompts_shortest_first off), so that only this choice orders them
        policy = dataclasses.replace(PolicyConfig(), prompt_outside_rate=on, prompts_shortest_first=0)
        s = measured(WITH_MIXED, policy=policy)
        d = Driver(s, WITH_MIXED)
        handles = [d.admit(ask(3072, 8)) for _ in range(3)]
        d.run(12)
        served = [handles.index(lane.handle) for e in d.executed for lane in e.plan.lanes
                  if lane.phase is LanePhase.PROMPT]
        assert served == expected


def _prompt_rows(catalog, policy) -> list:
    s = measured(catalog, policy=policy)
    d = Driver(s, catalog)
    handles = [d.admit(ask(3072, 8)) for _ in range(3)]
    d.run(12)
    return [(handles.index(lane.handle), e.plan.graph.id) for e in d.executed for lane in e.plan.lanes
            if lane.phase is LanePhase.PROMPT]


def test_prompts_shortest_first_applies_only_without_mixed_prompt_rows():
    """Beside a mixed program with a prompt row the rows stay by value (the report measured the choice
    worse there: docs/scheduling-utility.md, "Prompts in order")."""
    on, off = (dataclasses.replace(PolicyConfig(), prompts_shortest_first=v) for v in (1, 0))
    assert _prompt_rows(WITH_MIXED, on) == _prompt_rows(WITH_MIXED, off)
    assert _prompt_rows(CATALOG, on) != _prompt_rows(CATALOG, off)


def test_prompts_shortest_first_finishes_concurrent_prompts_one_after_another():
    """Three equal 3072-token prompts admitted together, nothing decoding, x counting their prompt
    tokens: by value they take turns chunk by chunk (the prompt just served has the lowest price), so
    all three first outputs come late. With the choice (the default) the prompt with the least left
    gets the next row, so each finishes before the next starts, in the same chunks."""
    catalog = CATALOG
    runs = {}
    for on in (0, 1):
        s = measured(catalog, policy=dataclasses.replace(PolicyConfig(), prompts_shortest_first=on))
        d = Driver(s, catalog)
        handles = [d.admit(ask(3072, 8)) for _ in range(3)]
        d.run(12)
        runs[on] = [(handles.index(lane.handle), e.plan.graph.id) for e in d.executed for lane in e.plan.lanes
                    if lane.phase is LanePhase.PROMPT]
    turns, in_order = [h for h, _ in runs[0]], [h for h, _ in runs[1]]
    assert len(set(turns[:3])) == 3  # by value: every prompt starts before any finishes
    runs_of_one_prompt = [h for i, h in enumerate(in_order) if i == 0 or in_order[i - 1] != h]
    assert sorted(runs_of_one_prompt) == [0, 1, 2], in_order  # each prompt's chunks back to back
    assert sorted(g for _, g in runs[0]) == sorted(g for _, g in runs[1])  # the same chunks, reordered


def test_prompts_shortest_first_gives_the_row_to_the_least_prompt_left():
    """A 256-token prompt admitted after a 3072-token one has started: its row comes next (the order is by
    prompt left, not by arrival), and the long prompt resumes after it."""
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    long = d.admit(ask(3072, 8))
    d.run(1)
    short = d.admit(ask(256, 8))
    d.run(3)
    served = [lane.handle for e in d.executed for lane in e.plan.lanes if lane.phase is LanePhase.PROMPT]
    assert served[0] is long and served[1] is short, served


def test_prompts_shortest_first_values_rows_at_the_queues_highest_price():
    """Two decoders running, three 3072-token prompts admitted together (three chunks each). The rows go
    to the prompt with the least left, priced as the most deserving waiting prompt: while another prompt
    still waits, a started prompt's next chunk weighs against the decoders as that prompt would, so the
    first two prompts run their chunks back to back. Valued at the served prompt's own price (x just
    raised by its chunk) decode rounds would cut in between them."""
    s = measured(CATALOG)
    d = Driver(s, CATALOG)
    for _ in range(2):
        d.admit(ask(16, 400))
    d.run(6)
    prompts = [d.admit(ask(3072, 8)) for _ in range(3)]
    d.run(40)
    kinds = []
    for e in d.executed[6:]:
        rows = [lane.handle for lane in e.plan.lanes if lane.phase is LanePhase.PROMPT]
        kinds.append(prompts.index(rows[0]) if rows else None)
    first = next(i for i, k in enumerate(kinds) if k is not None)
    finishing = [k for k in kinds if k is not None]
    two = {finishing[0], finishing[3]}
    assert len(two) == 2 and kinds[first:first + 6] == finishing[:6], kinds  # no decode round in between
    assert all(len([k for k in kinds if k == h]) == 3 for h in range(3))  # every prompt finished


def test_the_choices_are_zero_or_one():
    for name in CHOICE_FIELDS:
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            dataclasses.replace(PolicyConfig(), **{name: 2})
    # every derived choice is the default (docs/scheduling-utility.md, "Departures from the spec")
    default = PolicyConfig()
    assert (default.token_rate_by_value, default.prompt_chunk_share, default.prefill_defers_decode,
            default.age_price_by_cadence, default.prompts_shortest_first) == (1, 1, 1, 1, 1)
    assert default.prompt_outside_rate == 0  # measured, not better overall (scripts/scheduling_sim/README.md)
    # the throughput preset drops the cadence preferences (its c is 0) and keeps the token accounting
    fast = PolicyConfig.preset("throughput")
    assert (fast.token_rate_by_value, fast.age_price_by_cadence, fast.prefill_defers_decode) == (1, 0, 0)


def test_simulation_traces_set_the_choices_and_refuse_other_values():
    from helios.sim.files import SimulationFileError, parse_trace

    request = [{"prompt_tokens": 4, "max_tokens": 2}]
    trace = parse_trace({"policy": {"prompt_chunk_share": 0, "token_rate_by_value": 1}, "requests": request}, "t")
    assert (trace.policy.prompt_chunk_share, trace.policy.token_rate_by_value) == (0, 1)
    with pytest.raises(SimulationFileError, match="prompt_chunk_share must be 0 or 1"):
        parse_trace({"policy": {"prompt_chunk_share": 2}, "requests": request}, "t")


def test_prefill_times_chunk_long_prompts_with_the_most_efficient_program():
    """A measured catalog can make a small bucket the cheapest per token (flare-tiny-measured.yaml:
    256 tokens in 22 ms, 1024 in 306 ms): long prompts are timed in chunks of that one."""
    times = PrefillTimes.of([(64, 16.3), (256, 22.0), (1024, 306.3)])
    assert times.ms(1024) == pytest.approx(4 * 22.0)  # four P256 beat the one P1024 that holds them
    assert times.ms(2048 + 10) == pytest.approx(8 * 22.0 + 16.3)
    assert times.ms(200) == 22.0


def test_configure_policy_applies_the_new_choices():
    """A policy set after construction (``configure_policy``) takes its price-flow choices with it."""
    s = measured(WITH_MIXED)
    assert (s._prompt_weight, s._by_cadence) == (1.0 / 64.0, True)  # the defaults, with a mixed program
    s.configure_policy(dataclasses.replace(PolicyConfig(), token_rate_by_value=0, age_price_by_cadence=0))
    assert (s._prompt_weight, s._by_cadence) == (1.0, False)
