"""Scored prefill as schedulable work (spec C1; issue 18 item 1).

A request admitted with ``scored_prompt`` has its prompt lanes placed only in
SCORED_PREFILL programs, and an ordinary request never in them; both compete
by the same value-per-time selection (U6, U13). ``max_tokens`` 0 ends the
request when its prompt is consumed, without an output token.
"""

from __future__ import annotations

import dataclasses

import pytest
from sched_harness import MS, Driver, ask, decode, measured, mixed, prefill

from helios.scheduler import CompletionRecord, ExecutionTiming, GraphDescriptor, GraphKind, LanePhase

TIMING = ExecutionTiming(device_ns=4 * MS, wall_ns=4 * MS)


def scored(cap: int) -> GraphDescriptor:
    return GraphDescriptor(f"scored_prefill_p{cap}", GraphKind.SCORED_PREFILL, 1, prefill_capacity=cap)


S64, P64, P256, D1, D4, M = scored(64), prefill(64), prefill(256), decode(1), decode(4), mixed(4, 64)
CATALOG = {S64: 5.0, P64: 4.0, P256: 6.0, D1: 3.0, D4: 4.0, M: 4.5}


def scored_ask(prompt: int, max_tokens: int = 1):
    return dataclasses.replace(ask(prompt, max_tokens), scored_prompt=True)


def run_all(d: Driver, steps: int = 200) -> None:
    d.run(steps)


def prompt_graphs(d: Driver, handle) -> set[GraphKind]:
    """The kinds of the programs that ran a prompt lane of ``handle``."""
    return {e.plan.graph.kind for e in d.executed
            for lane in e.plan.lanes if lane.handle == handle and lane.phase is LanePhase.PROMPT}


def test_C1_scored_prompts_run_only_in_scored_programs_and_ordinary_ones_never():
    d = Driver(measured(CATALOG), CATALOG)
    plain = [d.admit(ask(100, 4)) for _ in range(2)]
    marked = [d.admit(scored_ask(150, 1)) for _ in range(2)]
    run_all(d)
    for h in marked:
        assert prompt_graphs(d, h) == {GraphKind.SCORED_PREFILL}
        assert d.produced(h) == 1  # generation follows: max_tokens 1 is one output token
    for h in plain:
        assert GraphKind.SCORED_PREFILL not in prompt_graphs(d, h) and prompt_graphs(d, h)
        assert d.produced(h) == 4
    # a scored prompt longer than the program is consumed in chunks, every position once
    chunks = [lane for e in d.executed for lane in e.plan.lanes if lane.handle == marked[0]
              and lane.phase is LanePhase.PROMPT]
    assert [(c.prompt_start, c.prompt_tokens) for c in chunks] == [(0, 64), (64, 64), (128, 22)]
    assert [c.finishes_prompt for c in chunks] == [False, False, True]
    assert set(d.finished) == {*plain, *marked}


def test_C1_scored_prompt_then_decodes_like_any_request():
    d = Driver(measured(CATALOG), CATALOG)
    h = d.admit(scored_ask(40, 6))
    run_all(d)
    assert d.produced(h) == 6
    decode_kinds = {e.plan.graph.kind for e in d.executed
                    for lane in e.plan.lanes if lane.handle == h and lane.phase is LanePhase.DECODE}
    assert decode_kinds and GraphKind.SCORED_PREFILL not in decode_kinds


def test_C1_max_tokens_zero_ends_with_the_prompt_and_outputs_nothing():
    s = measured(CATALOG)
    h = s.admit(scored_ask(100, 0))
    fence, out = 0, []
    while s.is_active(h):
        plan = s.plan()
        assert plan is not None and plan.graph is S64
        fence += 1
        s.commit(plan, fence)
        lane = plan.lanes[0]
        # the program samples a token after the final chunk, as prefill does; it is not output
        out = s.complete(fence, [CompletionRecord(h, prompt_consumed=lane.prompt_tokens,
                                                  tokens=(3,) if lane.finishes_prompt else (),
                                                  terminated=lane.finishes_prompt)], TIMING)
        if lane.finishes_prompt:
            break
        assert out == []  # a prompt chunk ends nothing, although max_tokens is 0
    assert fence == 2
    assert [(t.tokens, t.finished, t.finish_reason) for t in out] == [((), True, "length")]
    assert not s.is_active(h) and s.plan() is None


def test_C1_scored_and_ordinary_prompts_compete_by_value_per_time():
    # Only the programs' durations differ: the faster program's prompter goes first (U6).
    for fast_scored in (True, False):
        durations = {S64: 2.0 if fast_scored else 8.0, P64: 8.0 if fast_scored else 2.0, D1: 3.0}
        s = measured(durations)
        s.admit(ask(64, 4))
        s.admit(scored_ask(64, 4))
        first = s.plan()
        assert first.graph.kind is (GraphKind.SCORED_PREFILL if fast_scored else GraphKind.PREFILL)


def test_C1_a_catalog_without_scored_programs_refuses_scored_prompts():
    s = measured({P64: 4.0, D1: 3.0})
    with pytest.raises(ValueError, match="scored_prefill"):
        s.admit(scored_ask(10))


def test_C1_admission_rules_of_scored_prompts():
    s = measured(CATALOG)
    with pytest.raises(ValueError, match="max_tokens"):
        s.admit(ask(10, 0))  # 0 only for a scored prompt
    with pytest.raises(ValueError, match="cached_tokens"):
        s.admit(dataclasses.replace(scored_ask(10), cached_tokens=4))
    s.admit(scored_ask(10, 0))


def test_C1_an_unmeasured_scored_program_is_explored_only_when_someone_needs_it():
    s = measured(CATALOG, cold=(S64,))
    s.admit(ask(64, 4))
    assert s.plan().graph.kind is not GraphKind.SCORED_PREFILL  # nobody to score: never a candidate
    s2 = measured(CATALOG, cold=(S64,))
    s2.admit(scored_ask(64, 4))
    assert s2.plan().graph is S64
