"""Scheduler lifecycle: admission, completion, publication, cancellation (A1-A5, A13, U11, S6)."""

from __future__ import annotations

import copy

import pytest
from sched_harness import MS, QUEUE_AHEAD, Driver, ask, decode, measured, mixed, prefill, spec

from helios.scheduler import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    GraphDescriptor,
    GraphKind,
    LanePhase,
    PolicyConfig,
    RequestHandle,
    Scheduler,
    ValueSource,
)

P64, D1, D2, D4 = prefill(64), decode(1), decode(2), decode(4)
BASIC = {P64: 4.0, D1: 3.0, D2: 3.5, D4: 4.0}
TIMING = ExecutionTiming(device_ns=4 * MS, wall_ns=4 * MS)


def commit_next(s: Scheduler, fence: int):
    plan = s.plan()
    assert plan is not None
    s.commit(plan, fence)
    return plan


def prompt_records(plan):
    return [CompletionRecord(l.handle, prompt_consumed=l.prompt_tokens, tokens=(1,) if l.finishes_prompt else ())
            for l in plan.lanes]


def decoding(s: Scheduler, n: int, *, max_tokens: int = 50, fence: int = 0):
    """Admit n requests with 64-token prompts and prefill them; returns handles and the next fence."""
    handles = [s.admit(ask(64, max_tokens)) for _ in range(n)]
    while any(s.request_view(h).phase is LanePhase.PROMPT for h in handles):
        fence += 1
        plan = commit_next(s, fence)
        assert plan.graph.kind is GraphKind.PREFILL
        for t in s.complete(fence, prompt_records(plan), TIMING):
            s.published_output(t.handle, fence)
    return handles, fence


def test_U11_at_most_64_request_slots():
    with pytest.raises(ValueError, match="64"):
        Scheduler([D1], request_slots=65)
    Scheduler([D1], request_slots=64)


def test_admit_rejects_bad_requests_and_full_slots():
    s = Scheduler([P64, D1], request_slots=1)
    with pytest.raises(ValueError, match="context_limit"):
        s.admit(AdmitRequest(prompt_tokens=10, max_tokens=4, context_limit=10))
    with pytest.raises(ValueError, match="proposal sources"):
        s.admit(AdmitRequest(prompt_tokens=10, max_tokens=4, context_limit=99, proposal_sources=("magic",)))
    s.admit(ask())
    with pytest.raises(ValueError, match="no free request slot"):
        s.admit(ask())


def test_configure_policy_only_before_admission():
    s = Scheduler([P64, D1], request_slots=2)
    s.configure_policy(PolicyConfig.preset("throughput"))
    s.admit(ask())
    with pytest.raises(ValueError, match="before the first admission"):
        s.configure_policy(PolicyConfig())


def test_advance_to_is_monotonic():
    s = Scheduler([D1], request_slots=1)
    s.advance_to(5)
    with pytest.raises(ValueError, match="monotonic"):
        s.advance_to(4)


def test_A7_prefill_exposes_its_decoder_only_after_completion():
    s = measured(BASIC)
    h = s.admit(ask(64, 5))
    plan = commit_next(s, 1)
    assert plan.graph is P64 and plan.lanes[0].finishes_prompt
    assert s.plan() is None  # nothing can be queued behind a prefill, and no decoder exists yet
    assert s.request_view(h).phase is LanePhase.PROMPT
    out = s.complete(1, prompt_records(plan), TIMING)
    assert [t.tokens for t in out] == [(1,)]
    assert s.request_view(h).phase is LanePhase.DECODE
    assert s.plan().lanes[0].phase is LanePhase.DECODE


def test_finish_by_max_tokens_context_and_termination_frees_the_handle():
    s = measured(BASIC)
    a = s.admit(ask(64, 2))  # max_tokens 2: prefill token + one decode token
    b = s.admit(ask(64, 50, context=66))  # context: 64 prompt + 2 outputs
    c = s.admit(ask(64, 50))
    fence = 0
    while any(s.request_view(h).phase is LanePhase.PROMPT for h in (a, b, c)):
        fence += 1
        plan = commit_next(s, fence)
        s.complete(fence, prompt_records(plan), TIMING)
    fence += 1
    plan = commit_next(s, fence)
    assert {l.handle for l in plan.lanes} == {a, b, c}
    records = [CompletionRecord(l.handle, tokens=(9,), terminated=l.handle == c) for l in plan.lanes]
    out = {t.handle: t for t in s.complete(fence, records, TIMING)}
    assert out[a].finished and out[a].finish_reason == "length"
    assert out[b].finished and out[b].finish_reason == "length"
    assert out[c].finished and out[c].finish_reason == "stop"
    for h in (a, b, c):
        assert not s.is_active(h)
        with pytest.raises(ValueError, match="not an active request"):
            s.cancel(h)
    assert s.plan() is None


def test_A2_malformed_completion_raises_and_changes_nothing():
    s = measured(BASIC)
    handles, fence = decoding(s, 2)
    fence += 1
    plan = commit_next(s, fence)
    snapshot = copy.deepcopy((s._slots, s._queue.frames, s.cost._entries))
    good = [CompletionRecord(l.handle, tokens=(1,)) for l in plan.lanes]
    bad_cases = [
        good[:1],  # a lane without its record
        good + good[:1],  # a duplicate record
        [good[0], CompletionRecord(plan.lanes[1].handle, tokens=(1, 2))],  # more tokens than its query length
        [good[0], CompletionRecord(plan.lanes[1].handle, tokens=())],  # a decode row commits nothing
        [good[0], CompletionRecord(plan.lanes[1].handle, tokens=(1,), prompt_consumed=3)],
    ]
    for records in bad_cases:
        with pytest.raises(ValueError):
            s.complete(fence, records, TIMING)
        assert copy.deepcopy((s._slots, s._queue.frames, s.cost._entries)) == snapshot
    with pytest.raises(ValueError, match="fence order"):
        s.complete(fence + 1, good, TIMING)
    out = s.complete(fence, good, TIMING)
    assert len(out) == 2


def test_A2_A3_service_from_committed_counters_and_zero_for_unselected():
    s = measured({P64: 4.0, D1: 3.0})  # one row: a decode round serves one of two decoders
    (a, b), fence = decoding(s, 2)
    rates = {h: s.request_view(h).token_rate for h in (a, b)}
    fence += 1
    plan = commit_next(s, fence)
    served = plan.lanes[0].handle
    other = b if served == a else a
    s.complete(fence, [CompletionRecord(served, tokens=(1,))], ExecutionTiming(10 * MS, 10 * MS))
    assert s.request_view(served).token_rate > rates[served] * 0.9  # one token over 10 ms moves it up
    decay = pytest.approx(rates[other] * __import__("math").exp(-10 / 100))
    assert s.request_view(other).token_rate == decay  # zero service over the interval


def test_A3_isolated_frames_charge_the_longer_wall_interval():
    s = measured({P64: 4.0, D1: 3.0})
    (a, b), fence = decoding(s, 2)
    rate = {h: s.request_view(h).token_rate for h in (a, b)}
    fence += 1
    plan = commit_next(s, fence)
    other = b if plan.lanes[0].handle == a else a
    s.complete(fence, [CompletionRecord(plan.lanes[0].handle, tokens=(1,))], ExecutionTiming(3 * MS, 30 * MS))
    import math

    assert s.request_view(other).token_rate == pytest.approx(rate[other] * math.exp(-30 / 100))


def test_A3_missing_device_interval_records_no_service_and_no_cost():
    s = measured({P64: 4.0, D1: 3.0})
    (a, b), fence = decoding(s, 2)
    rate = {h: s.request_view(h).token_rate for h in (a, b)}
    fence += 1
    plan = commit_next(s, fence)
    samples = s.cost.samples(D1.cost_key())
    s.complete(fence, [CompletionRecord(plan.lanes[0].handle, tokens=(1,))], ExecutionTiming(0, 30 * MS))
    assert {h: s.request_view(h).token_rate for h in (a, b)} == rate
    assert s.cost.samples(D1.cost_key()) == samples


def test_A4_A5_first_publication_counts_one_delivery_and_starts_the_history():
    s = measured({P64: 4.0, D1: 3.0})
    (a,), fence = decoding(s, 1)
    view = s.request_view(a)
    assert view.delivery_rate == pytest.approx(1 / 4.0)  # A5: one delivery over the 4 ms prefill frame
    fence += 1
    plan = commit_next(s, fence)
    s.complete(fence, [CompletionRecord(a, tokens=(1,))], ExecutionTiming(5 * MS, 5 * MS))
    zero = s.request_view(a).delivery_rate
    assert zero < view.delivery_rate  # completion alone records zero deliveries
    s.published_output(a, fence)
    once = s.request_view(a).delivery_rate
    assert once > zero
    s.published_output(a, fence)  # later tokens of the same burst are not new deliveries
    assert s.request_view(a).delivery_rate == once


def test_A5_A10_queue_projection_starts_a_missing_delivery_history_at_one_per_queued_frame():
    """A decoder whose first token is still unpublished has no delivery history. Planning
    behind its queued decode frame projects that frame's first burst as one delivery over
    the frame's duration (A5 within the A10 projection), so its delivery price is g * T."""
    g = PolicyConfig().delivery_fairness
    s = measured({P64: 4.0, D1: 3.0}, policy=QUEUE_AHEAD)
    a = s.admit(ask(64, 50))
    commit_next(s, 1)
    s.complete(1, [CompletionRecord(a, prompt_consumed=64, tokens=(1,))], TIMING)  # never published
    assert s.request_view(a).delivery_rate is None
    queued = commit_next(s, 2)
    assert queued.graph is D1 and not queued.requires_feedback
    population = s._population(s._queue.end_ns(s.now_ns), s._timings())
    frame_ms = queued.estimated_duration_ns / MS
    assert population.decoders.handle == [a]
    assert population.decoders.delivery_price[0] == pytest.approx(g * frame_ms)  # g / z, z = 1 / T
    assert s.plan() is not None  # the projection is what the second frame slot is planned on


def test_A4_output_age_uses_publication_time():
    s = measured({P64: 4.0, D1: 3.0, D2: 3.5})
    (a, b), fence = decoding(s, 2)
    s.advance_to(50 * MS)
    s.published_output(a, fence)  # a's burst became visible late; b's stays as published at t=0
    population = s._population(s.now_ns, s._timings())
    age = dict(zip(population.decoders.handle, population.decoders.age_credit))
    assert age[b] > age[a]


def test_A1_cancelled_handle_never_charges_the_next_occupant():
    s = measured({P64: 4.0, D1: 3.0}, slots=1)
    (a,), fence = decoding(s, 1)
    fence += 1
    plan = commit_next(s, fence)
    s.cancel(a)
    assert not s.is_active(a)
    with pytest.raises(ValueError, match="no free request slot"):
        s.admit(ask())  # the slot stays owned through a's last submitted fence
    s.complete(fence, [], TIMING)
    b = s.admit(ask())
    assert b.slot == a.slot and b.generation != a.generation
    rate = s.request_view(b).token_rate
    s.published_output(a, fence)  # a late publication for the old generation changes nothing
    assert s.request_view(b).token_rate == rate
    assert s.request_view(b).delivery_rate is None


def test_cancel_stops_selection_at_once():
    s = measured(BASIC)
    (a, b), fence = decoding(s, 2)
    s.cancel(a)
    plan = s.plan()
    assert [l.handle for l in plan.lanes] == [b]


def test_A6_commit_rejects_stale_plans_and_repeated_fences():
    s = measured(BASIC)
    h = s.admit(ask(128, 5))
    plan = s.plan()
    s.commit(plan, 1)
    with pytest.raises(ValueError, match="fences must strictly increase"):
        s.commit(plan, 1)
    s.complete(1, prompt_records(plan), TIMING)
    with pytest.raises(ValueError, match="stale plan"):
        s.commit(plan, 2)  # the same prompt chunk again
    s.cancel(h)
    with pytest.raises(ValueError, match="not an active request"):
        s.commit(plan, 3)


def test_A13_mixed_completion_commits_by_phase():
    M = mixed(4, 64)
    s = measured({P64: 4.0, D1: 3.0, M: 4.05})
    (a,), fence = decoding(s, 1)
    b = s.admit(ask(64, 5))
    fence += 1
    plan = commit_next(s, fence)
    assert plan.graph is M and plan.prefill_row is not None
    prompt_lane = plan.lanes[plan.prefill_row]
    assert prompt_lane.handle == b and prompt_lane.finishes_prompt
    assert s.plan() is None  # A13: nothing queues behind a mixed submission
    short = [CompletionRecord(b, prompt_consumed=10), CompletionRecord(a, tokens=(1,))]
    with pytest.raises(ValueError, match="scheduled 64"):
        s.complete(fence, short, TIMING)
    two_tokens = [CompletionRecord(b, prompt_consumed=64, tokens=(1, 2)), CompletionRecord(a, tokens=(1,))]
    with pytest.raises(ValueError, match="at most one first token"):
        s.complete(fence, two_tokens, TIMING)
    assert s.request_view(a).produced == 1 and s.request_view(b).prompt_done == 0
    out = s.complete(fence, [CompletionRecord(b, prompt_consumed=64, tokens=(3,)), CompletionRecord(a, tokens=(1,))], TIMING)
    assert {t.handle: t.tokens for t in out} == {a: (1,), b: (3,)}
    assert s.request_view(b).phase is LanePhase.DECODE


def test_A13_a_decode_only_mixed_frame_still_needs_completion_feedback():
    """A13 makes every mixed submission wait for its completion, with or without a prompt row.
    Here the mixed program is the fastest way to serve two decoders and carries no prompt, yet
    its plan needs feedback and nothing is queued behind it until it completes. (Its 8-token
    prompt row is too small to take the prefills from P64 by U6's own rate; the deferred round,
    which would send the second prompt into that row beside the first decoder, is off here.)"""
    M = mixed(4, 8)
    s = measured({P64: 4.0, D1: 3.0, D2: 3.5, M: 2.5}, policy=PolicyConfig(prefill_defers_decode=0))
    (a, b), fence = decoding(s, 2)
    fence += 1
    plan = commit_next(s, fence)
    assert plan.graph is M and plan.prefill_row is None
    assert {lane.phase for lane in plan.lanes} == {LanePhase.DECODE}
    assert plan.requires_feedback
    assert s.plan() is None  # the second frame slot stays empty behind the mixed frame
    s.complete(fence, [CompletionRecord(h, tokens=(1,)) for h in (a, b)], TIMING)
    assert s.plan() is not None  # completion feedback reopens the window


def test_S6_speculative_completion_teaches_acceptance_width_one_does_not():
    S4 = spec(2, 4)
    s = measured({P64: 4.0, S4: 6.0})
    h = s.admit(ask(64, 100, sources=("learned",)))
    d = Driver(s, {P64: 4.0, S4: 6.0}, accepted={h.slot: 3})
    d.run(1)
    estimates = s._slots[h.slot].acceptance.source("learned")
    before = estimates.survival(3)
    d.run(6)
    assert {e.plan.graph for e in d.executed[1:]} == {S4}
    assert estimates.survival(3) > before
    s2 = measured({P64: 4.0, D1: 3.0})
    h2 = s2.admit(ask(64, 100, sources=("learned",)))
    d2 = Driver(s2, {P64: 4.0, D1: 3.0})
    d2.run(5)
    assert s2._slots[h2.slot].acceptance.source("learned").survival(1) == 0.5  # untouched prior


def test_packed_rounds_need_their_entry_point():
    A = spec(2, 4, aggregate=6, source=ValueSource.PREFIX_LIMIT)
    s = measured({P64: 4.0, A: 5.0})
    h = s.admit(ask(64, 100, sources=("learned",)))
    Driver(s, {P64: 4.0, A: 5.0}).run(1)
    plan = commit_next(s, 10)
    assert plan.graph is A and plan.lanes[0].ceiling == 4
    record = [CompletionRecord(h, tokens=(1, 2), offered=3)]
    with pytest.raises(ValueError, match="complete_packed_round"):
        s.complete(10, record, TIMING)
    with pytest.raises(ValueError, match="probabilities"):
        s.complete_packed_round(10, record, TIMING, [(0.5, 1.5, 0.2)])
    out = s.complete_packed_round(10, record, TIMING, [(0.9, 0.5, 0.2)])
    assert out[0].tokens == (1, 2)


def test_A1_requests_admitted_after_dispatch_are_outside_the_interval():
    s = measured({P64: 4.0, D1: 3.0}, slots=4)
    (a,), fence = decoding(s, 1)
    fence += 1
    commit_next(s, fence)
    late = s.admit(ask(64, 5))
    s.advance_to(s.now_ns + 1)  # late's starting history must not see this frame's interval
    start = s.request_view(late).token_rate
    s.complete(fence, [CompletionRecord(a, tokens=(1,))], ExecutionTiming(10 * MS, 10 * MS))
    assert s.request_view(late).token_rate == start


def test_U2_a_speculative_burst_is_one_delivery_whatever_its_size():
    S4 = spec(1, 4)
    rates = []
    for tokens in ((1,), (1, 2, 3, 4)):
        s = measured({P64: 4.0, S4: 5.0})
        h = s.admit(ask(64, 100, sources=("learned",)))
        Driver(s, {P64: 4.0, S4: 5.0}).run(1)
        plan = commit_next(s, 10)
        s.complete(10, [CompletionRecord(h, tokens=tokens, offered=3)], ExecutionTiming(5 * MS, 5 * MS))
        s.published_output(h, 10)
        rates.append(s.request_view(h).delivery_rate)
    assert rates[0] == rates[1]


def test_U4_phase_transition_keeps_the_token_rate():
    s = measured({P64: 4.0, D1: 3.0})
    h = s.admit(ask(64, 5))
    plan = commit_next(s, 1)
    s.complete(1, prompt_records(plan), TIMING)
    after_prefill = s.request_view(h).token_rate
    assert s.request_view(h).phase is LanePhase.DECODE
    s.advance_to(s.now_ns + 50 * MS)
    assert s.request_view(h).token_rate == after_prefill  # no reset on becoming a decoder; time alone changes nothing


def test_U5_reference_interval_counts_decoders_only():
    s = measured({P64: 4.0, D1: 3.0, D2: 4.0})
    (a, b), fence = decoding(s, 2)
    s.admit(ask(4096, 5))  # a prompter: no delivery coordinate, does not enlarge K
    timings = s._timings()
    sigma = s._reference_intervals({None: 2}, timings)  # two ordinary decoders, one family
    # K = k = 2: min over graphs of T/min(B, 2) is D2's 4/2 = 2 ms; sigma = 2 * 2 ms
    assert list(sigma.values()) == [pytest.approx(4.0)]
    population = s._population(s.now_ns, timings)
    assert population.active_age_price == pytest.approx(2 * s.policy.decode_age_price)
    assert population.decoders.age_slope == pytest.approx([0.1 * 4.0] * 2)


def test_survival_variants_validate_their_rows_before_anything_changes():
    S4 = spec(1, 4)
    s = measured({P64: 4.0, S4: 5.0})
    h = s.admit(ask(64, 100, sources=("learned",)))
    Driver(s, {P64: 4.0, S4: 5.0}).run(1)
    commit_next(s, 10)
    record = [CompletionRecord(h, tokens=(1, 2), offered=3)]
    with pytest.raises(ValueError, match="at most D = 3"):
        s.complete_with_survival(10, record, TIMING, [(0.9, 0.8, 0.7, 0.6)])
    with pytest.raises(ValueError, match="one row per record"):
        s.complete_with_survival(10, record, TIMING, [])
    with pytest.raises(ValueError, match="host-allocated"):
        s.complete_packed_round_with_survival(10, record, TIMING, None, [(0.9,)])
    assert s.request_view(h).produced == 1
    out = s.complete_with_survival(10, record, TIMING, [(0.9, 0.5, 0.1)])
    assert out[0].tokens == (1, 2) and s.request_view(h).produced == 3


def test_bad_handles_and_graph_ids_get_clear_errors():
    s = measured(BASIC)
    with pytest.raises(ValueError, match="unknown graph id"):
        s.observe_duration("no-such-graph", 5)
    with pytest.raises(ValueError, match="never admitted"):
        s.published_output(RequestHandle(0, 99), 1)
    with pytest.raises(ValueError, match="no submitted frame"):
        s.complete(1, [], TIMING)
