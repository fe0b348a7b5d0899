"""Checkpoint retention decisions (spec "Planning and the execution queue", CHECKLIST K1-K3).

The snapshot/restore programs that act on these decisions are not captured yet
(issue 21); these tests pin the decisions themselves.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helios.scheduler.checkpoints import (
    Anchor,
    AnchorRole,
    CheckpointIndex,
    ExtraWorkAllowance,
    RowUse,
    anchor_order,
)

MESSAGE, PROMPT_END = AnchorRole.MESSAGE, AnchorRole.PROMPT_END


def test_K1_last_completed_message_first_then_earlier_in_reverse_then_the_prompt_end():
    assert anchor_order([12, 40, 75], 90) == [
        Anchor(75, MESSAGE), Anchor(40, MESSAGE), Anchor(12, MESSAGE), Anchor(90, PROMPT_END)]


def test_K1_the_prompt_end_substitutes_when_no_message_is_eligible():
    assert anchor_order([], 30) == [Anchor(30, PROMPT_END)]
    # ends at or before the restored part are not eligible
    assert anchor_order([10, 20], 30, cached=20) == [Anchor(30, PROMPT_END)]


def test_K1_a_prompt_end_that_is_a_message_end_is_offered_once():
    assert anchor_order([10, 30], 30) == [Anchor(30, MESSAGE), Anchor(10, MESSAGE)]


def test_K1_nothing_to_capture_when_the_whole_prompt_is_restored():
    assert anchor_order([10], 30, cached=30) == []


@given(st.lists(st.integers(0, 200), max_size=8), st.integers(1, 200), st.integers(0, 200))
def test_K1_anchors_are_distinct_past_the_cache_and_inside_the_prompt(ends, prompt_end, cached):
    anchors = anchor_order(ends, prompt_end, cached=cached)
    lengths = [a.length for a in anchors]
    assert len(set(lengths)) == len(lengths)
    assert all(cached < n <= prompt_end for n in lengths)
    messages = [a.length for a in anchors if a.role is MESSAGE]
    assert messages == sorted(messages, reverse=True)
    assert all(a.role is PROMPT_END for a in anchors[len(messages):])


def test_K2_extras_fit_the_fraction_of_estimated_uncached_prefill_work():
    allowance = ExtraWorkAllowance.for_prefill(200.0, fraction=0.05)  # 10 ms of extras
    assert allowance.admits(6.0)
    allowance.spend(6.0)
    assert allowance.admits(4.0) and not allowance.admits(4.5)
    assert allowance.left_ms == pytest.approx(4.0)


def test_K2_unknown_costs_disable_extras():
    assert not ExtraWorkAllowance.for_prefill(None).admits(0.0)
    assert not ExtraWorkAllowance.for_prefill(1000.0).admits(None)


def test_K2_productive_decode_earns_the_same_fraction_for_a_terminal_capture():
    allowance = ExtraWorkAllowance.for_prefill(None, fraction=0.05)
    allowance.earn_decode(100.0)
    assert allowance.admits(5.0) and not allowance.admits(5.1)


def test_K2_the_fraction_is_validated():
    with pytest.raises(ValueError, match="fraction"):
        ExtraWorkAllowance.for_prefill(10.0, fraction=1.5)


def test_reuse_finds_the_longest_retained_strict_prefix_and_refreshes_its_demand():
    index = CheckpointIndex()
    index.add([1, 2, 3], row=0, role=MESSAGE, stamp=1)
    index.add([1, 2, 3, 4, 5], row=1, role=MESSAGE, stamp=2)
    index.add([9, 9], row=2, role=MESSAGE, stamp=3)
    hit = index.lookup([1, 2, 3, 4, 5, 6], stamp=10)
    assert hit.cached_tokens == 5 and hit.checkpoint.row == 1 and hit.checkpoint.last_demand == 10
    # an identical prompt keeps one token to prefill: the shorter checkpoint serves it
    assert index.lookup([1, 2, 3, 4, 5], stamp=11).cached_tokens == 3
    assert index.lookup([2, 3], stamp=12).checkpoint is None


def test_reuse_aliases_share_one_row():
    index = CheckpointIndex()
    first = index.add([4, 5], row=0, role=PROMPT_END, stamp=1)
    again = index.add([4, 5], row=7, role=MESSAGE, stamp=5)
    assert again is first and len(index) == 1 and first.role is MESSAGE and first.last_demand == 5
    with pytest.raises(ValueError, match="row 0"):
        index.add([6], row=0, role=MESSAGE, stamp=6)


def test_K3_victims_by_demand_recency_then_role_then_endpoint_length():
    index = CheckpointIndex()
    old_message = index.add([1] * 50, row=0, role=MESSAGE, stamp=1)
    old_prompt_end = index.add([2] * 50, row=1, role=PROMPT_END, stamp=1)
    old_short_message = index.add([3] * 10, row=2, role=MESSAGE, stamp=1)
    index.add([4] * 5, row=3, role=PROMPT_END, stamp=9)  # recent: kept longest
    order = []
    while (victim := index.victim()) is not None:
        order.append(victim.row)
        index.remove(victim)
    assert order == [old_prompt_end.row, old_short_message.row, old_message.row, 3]


@pytest.mark.parametrize("use", [RowUse.GUARDED, RowUse.ARMED, RowUse.COPYING])
def test_K3_guarded_armed_and_copying_rows_are_never_victims(use):
    index = CheckpointIndex()
    held = index.add([1, 2], row=0, role=PROMPT_END, stamp=0)
    held.use = use
    index.add([3, 4], row=1, role=MESSAGE, stamp=5)
    assert index.victim().row == 1
    with pytest.raises(ValueError, match=use.value):
        index.remove(held)



def test_K3_an_extra_cut_needs_an_obtainable_destination():
    index = CheckpointIndex()
    index.add([1], row=0, role=MESSAGE, stamp=0).use = RowUse.COPYING
    assert index.destination(free_rows=[0]) is None  # the only row is being copied into
    assert index.destination(free_rows=[0, 1]) == 1
    index.add([2], row=1, role=MESSAGE, stamp=1)
    assert index.destination(free_rows=[0, 1]) == 1 and len(index) == 1  # the free-to-evict one is given up
