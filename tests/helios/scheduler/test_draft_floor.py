"""Adaptive speculation with the plain floor (docs/scheduling-utility.md, "Departures": the plain floor).

With ordinary decode loaded beside the draft-keeping programs, a frame of an
ordinary program leaves its rows' draft caches behind, and nothing catches
them up: the scheduler marks those requests and never offers them a learned
round again (width-one twins and copy rounds read no draft, so they stay).
Everything else is selection as usual: measured value per time (U6).
"""

from __future__ import annotations

import pytest

from helios.scheduler import GraphDescriptor, GraphKind, LanePhase
from helios.scheduler.core import draft_keeping_twins, skips_draft_absorption
from sched_harness import MS, Driver, ask, decode, mixed, prefill, spec
from sched_harness import measured as measured_any

PREFILL = prefill(64)
DECODE = decode(1)
TWIN = GraphDescriptor("spec_b1_d0_w1", GraphKind.SPECULATIVE, 1, proposal_source="learned", speculation_enabled=True)
LEARNED = spec(1, 2)  # a learned width-two round
COPY = GraphDescriptor("spec_b1_d1_w2_copy", GraphKind.SPECULATIVE, 1, 1, 2, proposal_source="copy")
SURE = [(1, 1)] * 60  # a history of accepted drafts: s_1 near 1


def measured(durations):
    """``sched_harness.measured`` with draft tracking on, as an adaptive engine with the plain floor has it."""
    sched = measured_any(durations)
    assert sched.track_draft_state()
    return sched


def kinds_for(driver: Driver, handle) -> list[str]:
    """Graph ids of the executed frames with a decode lane for ``handle``, in order."""
    return [e.plan.graph.id for e in driver.executed
            if any(lane.handle == handle and lane.phase is LanePhase.DECODE for lane in e.plan.lanes)]


def now_pays(sched, durations, graph, ms: float = 12.0) -> None:
    """``graph`` now takes ``ms`` (2 tokens in 12 ms against plain decode's 1 in 10), and the scheduler's
    median of nine has seen only that."""
    durations[graph] = ms
    for _ in range(9):
        sched.observe_duration(graph.id, int(ms * MS))


def test_ordinary_decode_and_mixed_skip_draft_absorption_and_nothing_else_does():
    assert skips_draft_absorption(DECODE) and skips_draft_absorption(mixed(2, 64))
    assert not any(skips_draft_absorption(g) for g in (PREFILL, TWIN, LEARNED, COPY, mixed(2, 64, 2, 1)))
    twin_mixed = GraphDescriptor("mixed_twin", GraphKind.MIXED, 2, prefill_capacity=64, proposal_source="learned",
                                 speculation_enabled=True)
    assert not skips_draft_absorption(twin_mixed)


def test_a_row_that_ran_an_ordinary_frame_is_never_offered_a_learned_round_again():
    # the learned round is measured slow at first: plain decode (10 ms) beats it and the twin (11 ms)
    durations = {PREFILL: 5.0, DECODE: 10.0, TWIN: 11.0, LEARNED: 40.0}
    sched = measured(durations)
    driver = Driver(sched, durations, accepted={0: 1, 1: 1})
    stale = driver.admit(ask(prompt=16, max_tokens=40, sources=("learned",)))
    sched.seed_acceptance(stale, "learned", SURE)
    driver.run(3)  # prefill, then ordinary decode frames
    assert kinds_for(driver, stale)[:2] == [DECODE.id, DECODE.id]
    assert not sched.draft_current(stale)
    # now the learned round pays for anyone whose draft is current: 2 tokens in 12 ms against 1 in 10
    now_pays(sched, durations, LEARNED)
    before = len(kinds_for(driver, stale))
    driver.run(200)
    later = kinds_for(driver, stale)[before:]
    assert later and set(later) <= {DECODE.id, TWIN.id}, later
    # the same estimates on a request whose draft is current do run the learned round
    fresh = driver.admit(ask(prompt=16, max_tokens=12, sources=("learned",)))
    sched.seed_acceptance(fresh, "learned", SURE)
    driver.run(200)
    assert LEARNED.id in kinds_for(driver, fresh) and fresh in driver.finished


def test_copy_rounds_read_no_draft_and_stay_open_to_a_row_behind():
    durations = {PREFILL: 5.0, DECODE: 10.0, TWIN: 11.0, LEARNED: 40.0, COPY: 40.0}
    sched = measured(durations)
    driver = Driver(sched, durations, accepted={0: 1})
    handle = driver.admit(ask(prompt=16, max_tokens=40, sources=("learned", "copy")))
    sched.seed_acceptance(handle, "learned", SURE)
    sched.seed_acceptance(handle, "copy", SURE)
    driver.run(3)
    assert not sched.draft_current(handle)
    for graph in (LEARNED, COPY):
        now_pays(sched, durations, graph)
    before = len(kinds_for(driver, handle))
    driver.run(200)
    later = kinds_for(driver, handle)[before:]
    assert COPY.id in later and LEARNED.id not in later, later


@pytest.mark.parametrize("twin_ms", [11.0, 10.0, 9.0])
def test_the_plain_floor_runs_plain_decode_where_no_wider_round_pays(twin_ms):
    """Plain decode when the wider round does not pay, even when the draft-keeping twin was measured as
    fast or faster: the twin runs plain decode's work and the draft's step besides, so such a measurement
    is noise (an early sample the loser of the decision never corrects; issue 22, item 6)."""
    durations = {PREFILL: 5.0, DECODE: 10.0, TWIN: twin_ms, LEARNED: 40.0}
    sched = measured(durations)
    driver = Driver(sched, durations)
    handle = driver.admit(ask(prompt=16, max_tokens=24, sources=("learned",)))
    driver.run(100)
    ran = kinds_for(driver, handle)
    assert handle in driver.finished
    assert ran and set(ran) == {DECODE.id}, ran


def test_a_twin_reads_just_past_its_plain_program_and_follows_it():
    """With draft tracking, a draft-keeping twin measured at or below its plain program reads one
    nanosecond past the plain estimate, and follows it as it moves; above it, its own estimate stands.
    Without tracking (nothing to choose between), the twin reads its own estimate."""
    durations = {PREFILL: 5.0, DECODE: 10.0, TWIN: 9.0, LEARNED: 40.0}
    sched = measured(durations)
    assert sched.duration_estimates()[TWIN.id] == int(10.0 * MS) + 1
    for _ in range(9):
        sched.observe_duration(DECODE.id, int(8.0 * MS))
    assert sched.duration_estimates()[TWIN.id] == int(9.0 * MS)  # now above plain decode: its own
    for _ in range(9):
        sched.observe_duration(DECODE.id, int(12.0 * MS))
    assert sched.duration_estimates()[TWIN.id] == int(12.0 * MS) + 1
    assert measured_any(durations).duration_estimates()[TWIN.id] == int(9.0 * MS)


def test_draft_keeping_twins_pair_width_one_programs_with_the_plain_program_of_their_shape():
    twin_mixed = GraphDescriptor("mixed_twin", GraphKind.MIXED, 2, prefill_capacity=64, proposal_source="learned",
                                 speculation_enabled=True)
    graphs = [PREFILL, DECODE, TWIN, LEARNED, COPY, mixed(2, 64), twin_mixed, mixed(2, 256), decode(2)]
    assert draft_keeping_twins(graphs) == {2: 1, 6: 5}


def test_without_draft_tracking_every_program_counts_as_draft_keeping():
    """The scheduler's default (the spec's catalogs never load ordinary decode beside learned rounds):
    nothing is tracked, so the learned round runs after ordinary frames once it pays."""
    durations = {PREFILL: 5.0, DECODE: 10.0, TWIN: 11.0, LEARNED: 40.0}
    sched = measured_any(durations)
    driver = Driver(sched, durations, accepted={0: 1})
    handle = driver.admit(ask(prompt=16, max_tokens=40, sources=("learned",)))
    sched.seed_acceptance(handle, "learned", SURE)
    driver.run(3)
    assert sched.draft_current(handle)
    now_pays(sched, durations, LEARNED)
    driver.run(200)
    assert LEARNED.id in kinds_for(driver, handle)


def test_draft_tracking_is_chosen_before_the_first_admission_and_needs_both_kinds_of_program():
    sched = measured_any({PREFILL: 5.0, DECODE: 10.0, LEARNED: 12.0})
    assert sched.track_draft_state()
    sched.admit(ask(sources=("learned",)))
    with pytest.raises(ValueError, match="before the first admission"):
        sched.track_draft_state()
    assert not measured_any({PREFILL: 5.0, TWIN: 10.0, LEARNED: 12.0}).track_draft_state()  # the draft floor
    assert not measured_any({PREFILL: 5.0, DECODE: 10.0, COPY: 12.0}).track_draft_state()  # no draft state


def test_a_learned_plan_for_a_row_behind_is_refused_at_commit():
    durations = {PREFILL: 5.0, DECODE: 10.0, TWIN: 11.0, LEARNED: 12.0}
    sched = measured(durations)
    driver = Driver(sched, durations, accepted={0: 1})
    handle = driver.admit(ask(prompt=16, max_tokens=40, sources=("learned",)))
    sched.seed_acceptance(handle, "learned", SURE)
    driver.run(1)  # the prefill
    plan = sched.plan()
    assert plan.graph == LEARNED
    sched._draft_falls_behind(sched._slots[handle.slot])  # as an ordinary frame's commit would
    with pytest.raises(ValueError, match="draft cache is behind"):
        sched.commit(plan, driver.fence + 1)
