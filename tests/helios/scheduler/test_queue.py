"""The two-frame execution queue (A6-A11, D5)."""

from __future__ import annotations

import dataclasses

import pytest
from sched_harness import MS, QUEUE_AHEAD, Driver, ask, decode, measured, prefill, spec
from test_core_lifecycle import TIMING, commit_next, decoding, prompt_records

from helios.scheduler import (
    CompletionRecord,
    ExecutionTiming,
    GraphKind,
    LanePhase,
    PolicyConfig,
    SelectionReason,
    ValueSource,
)
from tests.helios.scheduler import reference
from tests.helios.scheduler.reference import FrameService

P64, P512, D1, D2 = prefill(64), prefill(512), decode(1), decode(2)


def test_A7_decode_fills_both_frame_slots_and_no_more():
    s = measured({P64: 4.0, D2: 3.0}, policy=QUEUE_AHEAD)
    (a, b), fence = decoding(s, 2)
    first = commit_next(s, fence + 1)
    second = commit_next(s, fence + 2)
    assert first.graph is D2 and second.graph is D2 and not second.requires_feedback
    assert s.plan() is None
    with pytest.raises(ValueError, match="both frame slots"):
        s.commit(first, fence + 3)


def test_A7_prefill_drains_the_window():
    s = measured({P64: 4.0, D2: 3.0})
    (a,), fence = decoding(s, 1)
    s.admit(ask(640, 5))
    plan = s.plan()
    assert plan.graph is P64 and plan.requires_feedback
    s.commit(plan, fence + 1)
    assert s.plan() is None  # the decoder may not be queued behind a prefill
    decode_plan = D2  # and commit refuses a queued plan behind feedback-dependent work
    with pytest.raises(ValueError):
        s.commit(type(plan)(decode_plan, (), plan.reason, 3 * MS, 1.0, 0.0, requires_feedback=False), fence + 2)


def test_A8_winner_needing_an_empty_window_blocks_lower_value_queueable_work():
    # output tokens nearly worthless: a long prompt chunk is the best use of the device
    policy = PolicyConfig(output_token_value=0.01, token_fairness=0.01, delivery_fairness=0.0, decode_age_price=0.0,
                          queue_ahead_by_host_time=0)
    s = measured({P512: 5.0, D2: 3.0}, policy=policy)
    (a,), fence = decoding(s, 1, max_tokens=500)
    fence += 1
    assert commit_next(s, fence).graph is D2  # only a decoder exists: decode runs
    assert s.plan() is not None  # a second decode frame would be queueable ...
    s.admit(ask(4096, 5))
    assert s.plan() is None  # ... but the prefill wins, so nothing is submitted until the drain (A8)
    s.advance_to(3 * MS)
    s.complete(fence, [CompletionRecord(a, tokens=(1,))], TIMING)
    assert s.plan().graph is P512


def test_A9_overrun_suspends_queueing_without_excluding_the_graph():
    s = measured({P64: 4.0, D2: 3.0})
    (a, b), fence = decoding(s, 2)
    fence += 1
    commit_next(s, fence)
    s.advance_to(s._queue.frames[-1].end_ns + 1)  # the queued frame ran past its expected end
    assert s.plan() is None
    s.complete(fence, [CompletionRecord(a, tokens=(1,)), CompletionRecord(b, tokens=(1,))],
               ExecutionTiming(9 * MS, 9 * MS))
    assert s.plan().graph is D2  # no cap: the overrun graph stays eligible


def test_A9_expected_ends_restart_from_each_completion():
    # Every frame takes 1 ms beyond its 3 ms estimate, as each does on a host whose worker spends
    # time around the program call. The frame behind the completed one started at the completion,
    # so its expected end is the completion plus its estimate, and queueing never stops; ends
    # chained from commit time would fall 1 ms further behind per frame and be past within 3 frames.
    s = measured({P64: 4.0, D2: 3.0}, policy=QUEUE_AHEAD)
    (a, b), fence = decoding(s, 2, max_tokens=40)
    plans = {fence + 1: commit_next(s, fence + 1), fence + 2: commit_next(s, fence + 2)}
    committed = {frame.fence: frame for frame in s._queue.frames}  # as frozen at commit
    oldest, now = fence + 1, s.now_ns
    for _ in range(10):
        now += 4 * MS
        s.advance_to(now)
        done = plans.pop(oldest)
        for token in s.complete(oldest, [CompletionRecord(lane.handle, tokens=(1,)) for lane in done.lanes],
                                ExecutionTiming(4 * MS, 4 * MS)):
            s.published_output(token.handle, oldest)
        running = s._queue.frames[0]
        assert running.end_ns == now + running.plan.estimated_duration_ns
        # re-anchoring changes the end and nothing else of the frame (A10's frozen terms included)
        assert running == dataclasses.replace(committed[running.fence], end_ns=running.end_ns)
        next_fence = max(plans) + 1
        plans[next_fence] = commit_next(s, next_fence)  # queued behind the running frame: no overrun
        committed[next_fence] = s._queue.frames[-1]
        assert not plans[next_fence].requires_feedback
        oldest += 1


def test_A10_projection_uses_expected_delivery_and_leaves_history_alone():
    s = measured({P64: 4.0, D1: 3.0})
    (a, b), fence = decoding(s, 2)
    s.advance_to(20 * MS)
    fence += 1
    plan = commit_next(s, fence)
    served = plan.lanes[0].handle
    other = b if served == a else a
    real = s.request_view(served).token_rate
    start = s._queue.frames[-1].end_ns
    population = s._population(start, s._timings())
    credit = dict(zip(population.decoders.handle, population.decoders.age_credit))
    price = dict(zip(population.decoders.handle, population.decoders.token_price))
    assert credit[served] == 0.0  # its queued frame is expected to deliver exactly at the planning start
    assert credit[other] > 0.0
    history = s._slots[served.slot].service
    projected = reference.prices(reference.projected(history, FrameService(1.0, 1.0, 3.0), 100.0), s.policy, delivery_fallback_rate=1.0)
    assert price[served] == pytest.approx(projected.output_token)
    assert price[served] != reference.prices(history, s.policy, delivery_fallback_rate=1.0).output_token
    assert s.request_view(served).token_rate == real  # projection never touches real history


def test_A11_queued_speculative_lane_advances_at_most_its_ceiling():
    A = spec(2, 4, aggregate=6, source=ValueSource.PREFIX_LIMIT)
    s = measured({P64: 4.0, A: 5.0}, policy=QUEUE_AHEAD)
    h = s.admit(ask(64, 7, sources=("learned",)))
    Driver(s, {P64: 4.0, A: 5.0}).run(1)  # prefill: one token out, 6 left
    first = commit_next(s, 10)
    assert first.lanes[0].ceiling == 4
    second = commit_next(s, 11)
    assert second.lanes[0].ceiling == 2  # 6 - min(4, P) = 2 tokens of room remain
    assert s.plan() is None


def test_A11_a_queued_lane_whose_ceiling_exceeds_P_counts_only_P():
    A = spec(2, 4, aggregate=3, source=ValueSource.PREFIX_LIMIT)  # ceiling 4 > P = 3
    s = measured({P64: 4.0, A: 5.0}, policy=QUEUE_AHEAD)
    s.admit(ask(64, 7, sources=("learned",)))
    Driver(s, {P64: 4.0, A: 5.0}).run(1)  # prefill: one token out, 6 left
    first = commit_next(s, 10)
    assert first.lanes[0].ceiling == 4
    second = commit_next(s, 11)
    assert second.lanes[0].ceiling == 3  # the first frame commits at most min(4, P) = 3: 3 of room remain


def test_D5_unknown_graph_is_discovered_only_with_an_empty_window():
    s = measured({P64: 4.0, D1: 3.0, D2: 3.5}, cold=(D2,))
    (a, b), fence = decoding(s, 2)
    plan = s.plan()
    assert plan.graph is D2 and plan.reason is SelectionReason.DISCOVERY
    assert plan.requires_feedback and plan.estimated_duration_ns == 0
    s.commit(plan, fence + 1)
    assert s.plan() is None
    s.complete(fence + 1, [CompletionRecord(l.handle, tokens=(1,)) for l in plan.lanes], ExecutionTiming(4 * MS, 4 * MS))
    again = s.plan()
    assert again.reason is SelectionReason.ORDINARY and again.estimated_duration_ns == 4 * MS


def test_D5_stale_graph_needs_feedback_and_commit_rechecks_freshness():
    ttl = PolicyConfig().estimate_ttl_ns
    s = measured({P64: 4.0, D2: 3.0}, policy=QUEUE_AHEAD)
    (a, b), fence = decoding(s, 2)
    fence += 1
    commit_next(s, fence)
    fresh = s.plan()
    assert fresh is not None and not fresh.requires_feedback
    s.advance_to(s._queue.frames[0].end_ns)
    s.complete(fence, [CompletionRecord(a, tokens=(1,)), CompletionRecord(b, tokens=(1,))], TIMING)
    # a plan saved while fresh, committed behind queued work after the estimate expired
    queued = s.plan()
    s.commit(queued, fence + 1)
    saved = s.plan()
    assert saved is not None and not saved.requires_feedback
    s.advance_to(s.now_ns + ttl)
    with pytest.raises(ValueError, match="went stale"):
        s.commit(saved, fence + 2)


def test_D5_stale_winner_keeps_its_measured_cost_but_waits_for_feedback():
    ttl = PolicyConfig().estimate_ttl_ns
    s = measured({P64: 4.0, D2: 3.0})
    (a, b), fence = decoding(s, 2)
    s.advance_to(ttl + 1)
    plan = s.plan()
    assert plan.graph is D2 and plan.estimated_duration_ns == 3 * MS  # stale, still measured
    assert plan.requires_feedback and plan.reason is SelectionReason.ORDINARY
    s.commit(plan, fence + 1)
    assert s.plan() is None  # nothing queues behind a stale dispatch
    s.advance_to(s.now_ns + 3 * MS)
    s.complete(fence + 1, [CompletionRecord(a, tokens=(1,)), CompletionRecord(b, tokens=(1,))], TIMING)
    assert not s.plan().requires_feedback  # the completion made it fresh again


# PolicyConfig.queue_ahead_by_host_time (docs/scheduling-utility.md, "The second frame slot")


def test_A7_the_second_slot_stays_empty_while_completions_show_no_host_time():
    s = measured({P64: 4.0, D2: 3.0})
    (a, b), fence = decoding(s, 2)  # the prompt frames completed with wall time == device time
    assert commit_next(s, fence + 1).graph is D2
    assert s.plan() is None  # nothing to hide: the next frame is chosen at the completion
    assert measured({P64: 4.0, D2: 3.0}, policy=QUEUE_AHEAD)._queue_ahead_pays()


def test_A7_the_second_slot_fills_once_completions_show_host_time():
    s = measured({P64: 4.0, D2: 3.0})
    assert s._queue_ahead_pays()  # nothing measured yet: A7's second slot as it allows
    handles = [s.admit(ask(64, 50)) for _ in range(2)]
    fence = 0
    while any(s.request_view(h).phase is LanePhase.PROMPT for h in handles):
        fence += 1
        plan = commit_next(s, fence)
        s.advance_to(s.now_ns + 4 * MS)
        for token in s.complete(fence, prompt_records(plan), ExecutionTiming(4 * MS, 4 * MS + 300_000)):
            s.published_output(token.handle, fence)
    assert commit_next(s, fence + 1).graph is D2
    queued = s.plan()  # 0.3 ms of host time per frame: planning behind the running frame hides it
    assert queued is not None and queued.graph is D2 and not queued.requires_feedback


def test_a_request_arriving_during_a_decode_frame_joins_the_next_frame_on_the_simulator():
    from helios.sim.files import Trace, TraceRequest, load_catalog
    from helios.sim.simulator import simulate

    catalog = load_catalog("examples/simulation/catalog.yaml")
    streams = [TraceRequest(f"s{i}", 0, 64, 200) for i in range(4)]
    late = TraceRequest("late", 40 * MS + MS // 2, 64, 8)  # arrives inside a decode round
    for policy, frames_later in ((PolicyConfig.preset("balanced"), 0), (QUEUE_AHEAD, 1)):
        result = simulate(catalog, Trace(policy, 0, (*streams, late)))
        running = next(p for p in result.plans if p.start_ns <= late.arrival_ns < p.end_ns)
        assert "late" not in running.cohort and running.graph.kind is GraphKind.DECODE
        after = [p for p in result.plans if p.start_ns >= running.end_ns]
        first = next(i for i, p in enumerate(after) if "late" in p.cohort)
        assert first == frames_later  # with the second slot filled, the frame after the running one was taken


# PolicyConfig.prefill_fills_second_slot (docs/scheduling-utility.md, "Departures from the spec", 15)

HOST_TIME = ExecutionTiming(4 * MS, 4 * MS + 300_000)  # completions showing 0.3 ms of host time to hide


def _decoding_with_host_time(s, n: int):
    """n requests prefilled one frame at a time, each completion showing host time; handles and last fence."""
    handles = [s.admit(ask(64, 50)) for _ in range(n)]
    fence = 0
    while any(s.request_view(h).phase is LanePhase.PROMPT for h in handles):
        fence += 1
        plan = commit_next(s, fence)
        s.advance_to(s.now_ns + 4 * MS)
        for token in s.complete(fence, prompt_records(plan), HOST_TIME):
            s.published_output(token.handle, fence)
    return handles, fence


def test_A7_departure_a_measured_prefill_fills_the_second_slot_once_completions_show_host_time():
    s = measured({P64: 4.0, D2: 3.0})
    (a,), fence = _decoding_with_host_time(s, 1)
    assert commit_next(s, fence + 1).graph is D2  # the decoder runs
    newcomer = s.admit(ask(64, 5))
    queued = s.plan()  # behind the running decode frame: the newcomer's prompt
    assert queued is not None and queued.graph is P64 and not queued.requires_feedback
    assert [lane.handle for lane in queued.lanes] == [newcomer]
    s.commit(queued, fence + 2)
    assert s.request_view(newcomer).phase is LanePhase.PROMPT  # its decoder exists only after completion


def test_A7_departure_behind_a_queued_prefill_only_a_prefill_may_follow():
    s = measured({P64: 4.0, D2: 3.0})
    (a,), fence = _decoding_with_host_time(s, 1)
    first = s.admit(ask(64, 5))
    prefill_plan = commit_next(s, fence + 1)
    assert prefill_plan.graph is P64 and not prefill_plan.requires_feedback
    assert s.plan() is None  # the decoder's round waits for the prefill's completion (its decoder joins then)
    decode_plan = type(prefill_plan)(D2, (), SelectionReason.ORDINARY, 3 * MS, 1.0, 0.0, requires_feedback=False)
    with pytest.raises(ValueError, match="feedback"):
        s.commit(decode_plan, fence + 2)  # and commit refuses one planned elsewhere
    second = s.admit(ask(64, 5))
    behind = s.plan()  # another prompt may follow the prefill
    assert behind is not None and behind.graph is P64 and [lane.handle for lane in behind.lanes] == [second]
    assert first not in [lane.handle for lane in behind.lanes]  # the queued prompt is no prompter


@pytest.mark.parametrize("policy, completions", [(PolicyConfig(prefill_fills_second_slot=0), HOST_TIME),
                                                 (PolicyConfig(), TIMING)])
def test_A7_prefill_drains_the_window_under_the_spec_text_or_without_host_time(policy, completions):
    s = measured({P64: 4.0, D2: 3.0}, policy=policy)
    handles = [s.admit(ask(64, 50))]
    plan = commit_next(s, 1)
    s.advance_to(4 * MS)
    for token in s.complete(1, prompt_records(plan), completions):
        s.published_output(token.handle, 1)
    assert commit_next(s, 2).graph is D2
    s.admit(ask(64, 5))
    assert s.plan() is None  # the prefill winner needs the empty window (A7, A8)
    s.advance_to(7 * MS)
    s.complete(2, [CompletionRecord(handles[0], tokens=(1,))], completions)
    prefill_plan = commit_next(s, 3)
    assert prefill_plan.graph is P64 and prefill_plan.requires_feedback
    assert s.plan() is None


def test_A7_departure_an_unmeasured_prefill_still_needs_the_empty_window():
    s = measured({P64: 4.0, P512: 12.0, D2: 3.0}, cold=(P512,))
    (a,), fence = _decoding_with_host_time(s, 1)
    assert commit_next(s, fence + 1).graph is D2
    s.admit(ask(512, 5))  # P512 never ran: its discovery (U8) wins and needs the empty window (D5)
    assert s.plan() is None
    s.advance_to(s.now_ns + 3 * MS)
    s.complete(fence + 1, [CompletionRecord(a, tokens=(1,))], HOST_TIME)
    discovery = commit_next(s, fence + 2)
    assert discovery.graph is P512 and discovery.requires_feedback
