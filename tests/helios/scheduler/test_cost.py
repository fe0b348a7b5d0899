"""Duration estimates: helios/scheduler/cost.py (spec checklist C11, D1, D2, D3, D5, D7)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.scheduler import AdmitRequest, Scheduler, SelectionReason
from helios.scheduler.cost import CostModel

TTL = 30_000_000_000
DECODE4 = GraphDescriptor(id="decode4", kind=GraphKind.DECODE, batch_capacity=4, estimated_duration_ns=7_000_000)
KEY = DECODE4.cost_key()


def test_C11_entries_start_unknown_whatever_the_descriptor_says():
    costs = CostModel(TTL)
    assert DECODE4.estimated_duration_ns > 0
    assert costs.estimate_ns(KEY) == 0
    assert not costs.is_known(KEY)
    assert costs.requires_feedback(KEY, now_ns=0)


def test_C11_the_scheduler_starts_unknown_whatever_its_descriptors_say():
    """Descriptors handed to the Scheduler directly (not through the loader, which zeroes the
    field) may carry an estimate; the scheduler must still start every program unknown, so its
    first plan is a discovery with no duration and completion feedback, like a cold catalog's."""
    prefill64 = GraphDescriptor(id="prefill64", kind=GraphKind.PREFILL, batch_capacity=1, prefill_capacity=64,
                                estimated_duration_ns=4_000_000)
    graphs = [prefill64, DECODE4]
    s = Scheduler(graphs, request_slots=4)
    for g in graphs:
        assert g.estimated_duration_ns > 0
        assert s.cost.estimate_ns(g.cost_key()) == 0 and not s.cost.is_known(g.cost_key())
    s.admit(AdmitRequest(prompt_tokens=64, max_tokens=8, context_limit=1 << 20))
    plan = s.plan()
    assert plan.graph is prefill64 and plan.reason is SelectionReason.DISCOVERY
    assert plan.estimated_duration_ns == 0 and plan.requires_feedback


def test_D1_identity_is_the_physical_shape():
    ragged = dict(kind=GraphKind.SPECULATIVE, batch_capacity=4, proposal_depth=3, width=4, ragged=True,
                  value_source=ValueSource.PREFIX_LIMIT)
    p8 = GraphDescriptor(id="a", aggregate=8, **ragged)
    p8_again = GraphDescriptor(id="b", aggregate=8, **ragged)
    p12 = GraphDescriptor(id="c", aggregate=12, **ragged)
    shallower = GraphDescriptor(id="d", aggregate=8, **{**ragged, "proposal_depth": 2})
    costs = CostModel(TTL)
    costs.observe(p8.cost_key(), 5_000_000, 0, now_ns=0)
    assert costs.estimate_ns(p8_again.cost_key()) == 5_000_000  # same B/D/W/P: same entry
    assert costs.estimate_ns(p12.cost_key()) == 0  # different P
    assert costs.estimate_ns(shallower.cost_key()) == 0  # smaller producer is a distinct program


def test_D2_first_positive_observation_sets_the_estimate():
    costs = CostModel(TTL)
    assert costs.observe(KEY, 3_000_000, 0, now_ns=10)
    assert costs.estimate_ns(KEY) == 3_000_000
    assert costs.last_observation_ns(KEY) == 10


def test_D2_median_of_the_last_nine():
    costs = CostModel(TTL)
    # an early outlier must leave the window once nine later samples arrive
    samples = [1_000_000_000] + [100 * (i + 1) for i in range(9)]
    for t, sample in enumerate(samples):
        costs.observe(KEY, sample, 0, now_ns=t)
    assert costs.samples(KEY) == tuple(samples[1:])
    assert costs.estimate_ns(KEY) == 500


def test_D2_even_count_averages_the_middle_pair():
    costs = CostModel(TTL)
    for t, sample in enumerate([100, 400, 200, 1000]):
        costs.observe(KEY, sample, 0, now_ns=t)
    assert costs.estimate_ns(KEY) == 300  # (200 + 400) / 2, not 200 or 400


@given(st.lists(st.integers(min_value=1, max_value=10**9), min_size=1, max_size=30))
def test_D2_fresh_estimate_is_the_median_of_the_last_nine(samples):
    costs = CostModel(TTL)
    for t, sample in enumerate(samples):
        costs.observe(KEY, sample, 0, now_ns=t)
    window = samples[-9:]
    assert costs.estimate_ns(KEY) == int(statistics.median(window) // 1)


def test_D2_stale_after_ttl_but_still_usable():
    costs = CostModel(ttl_ns=1000)
    costs.observe(KEY, 400, 0, now_ns=0)
    assert not costs.is_stale(KEY, now_ns=999)
    assert costs.is_stale(KEY, now_ns=1000)
    assert costs.estimate_ns(KEY) == 400  # elapsed time never makes it unknown
    assert costs.is_stale(KEY, now_ns=10**15) and costs.is_known(KEY)
    assert costs.requires_feedback(KEY, now_ns=1000)  # D5: stale needs an empty queue
    assert not costs.requires_feedback(KEY, now_ns=999)


def test_D2_first_valid_sample_of_a_stale_entry_replaces_it():
    costs = CostModel(ttl_ns=1000)
    for t, sample in enumerate([400, 410, 420]):
        costs.observe(KEY, sample, 0, now_ns=t)
    costs.observe(KEY, 900, 0, now_ns=5000)
    assert costs.estimate_ns(KEY) == 900  # not the median of 400, 410, 420, 900
    assert costs.samples(KEY) == (900,)
    assert not costs.is_stale(KEY, now_ns=5001)
    costs.observe(KEY, 1000, 0, now_ns=5002)  # fresh again: the median resumes from the new window
    assert costs.estimate_ns(KEY) == 950


def test_D3_missing_interval_changes_nothing_and_does_not_refresh():
    costs = CostModel(ttl_ns=1000)
    assert not costs.observe(KEY, 0, 0, now_ns=0)
    assert not costs.is_known(KEY) and costs.last_observation_ns(KEY) is None
    costs.observe(KEY, 500, 0, now_ns=0)
    assert not costs.observe(KEY, 0, 0, now_ns=2000)
    assert costs.estimate_ns(KEY) == 500
    assert costs.last_observation_ns(KEY) == 0
    assert costs.is_stale(KEY, now_ns=2000)


def test_D3_readiness_delay_is_subtracted_with_a_positive_floor():
    costs = CostModel(TTL)
    costs.observe(KEY, 5_000, 1_500, now_ns=0)
    assert costs.estimate_ns(KEY) == 3_500
    other = CostModel(TTL, min_sample_ns=10)
    other.observe(KEY, 5_000, 7_000, now_ns=0)  # delay measured longer than the interval
    assert other.estimate_ns(KEY) == 10 and other.is_known(KEY)


def test_D7_attempts_are_tracked_apart_from_observations():
    costs = CostModel(ttl_ns=1000)
    assert costs.last_attempt_ns(KEY) is None and costs.last_touched_ns(KEY) is None
    costs.mark_attempt(KEY, now_ns=50)
    assert costs.last_attempt_ns(KEY) == 50
    assert not costs.is_known(KEY)  # a dispatch alone measures nothing
    costs.observe(KEY, 100, 0, now_ns=80)
    assert costs.last_touched_ns(KEY) == 80
    costs.mark_attempt(KEY, now_ns=3000)
    assert costs.last_touched_ns(KEY) == 3000
    assert costs.is_stale(KEY, now_ns=3000)  # an attempt does not make the estimate fresh


def test_bad_input_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="ttl_ns"):
        CostModel(0)
    with pytest.raises(ValueError, match="device_ns=-1"):
        CostModel(TTL).observe(KEY, -1, 0, now_ns=0)
