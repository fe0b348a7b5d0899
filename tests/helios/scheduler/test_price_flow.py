"""Issue 20's price-flow choices (docs/scheduling-utility.md, "Departures from the spec").

- ``prompt_chunk_share`` (default on): a prompt chunk that leaves prompt behind earns its share of the
  remaining prompt's value by prefill time, so a prompt is not split into a chunk that just fits and
  a tail of a few tokens that then waits behind decode rounds;
- ``token_rate_by_value`` (default off): x counts a consumed prompt token as 1/beta output token.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from sched_harness import Driver, ask, decode, measured, prefill

from helios.scheduler import GraphKind, PolicyConfig
from helios.scheduler.utility import PrefillTimes, prompt_chunk_value

P64, P128, P256, P1024 = prefill(64), prefill(128), prefill(256), prefill(1024)
D4 = decode(4)
# the example catalog's figures: a prompt bucket costs more per token the smaller it is
CATALOG = {P64: 2.96, P128: 3.92, P256: 5.84, P1024: 17.36, D4: 2.82}


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
    tokens and the 3-token tail loses to decode rounds for many frames."""
    policy = dataclasses.replace(PolicyConfig(), prompt_chunk_share=share)
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


def test_token_rate_by_value_counts_a_prompt_token_as_one_over_beta():
    for by_value, weight in ((0, 1.0), (1, 1.0 / 64.0)):
        policy = dataclasses.replace(PolicyConfig(), token_rate_by_value=by_value)
        assert policy.prompt_service_weight == weight
        s = measured(CATALOG, policy=policy)
        d = Driver(s, CATALOG)
        h = d.admit(ask(256, 4))
        d.run(1)  # one P256 frame serves 256 prompt tokens and the first output token
        executed = d.executed[0]
        assert executed.plan.graph is P256
        interval = executed.end_ms - executed.start_ms
        decay = math.exp(-interval / policy.adaptation_ms)
        state = s._state(h)
        start = s._normalizer()  # the only participant: the whole normalizer
        served = 256 * weight + 1
        assert state.service.token_rate == pytest.approx(decay * start + (1 - decay) * served / interval, rel=1e-12)


def test_the_choices_are_zero_or_one():
    for name in ("token_rate_by_value", "prompt_chunk_share"):
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            dataclasses.replace(PolicyConfig(), **{name: 2})
    assert PolicyConfig().prompt_chunk_share == 1 and PolicyConfig().token_rate_by_value == 0


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
