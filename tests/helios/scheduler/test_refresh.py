"""Exploration credit: helios/scheduler/refresh.py (spec checklist D6, D7, D8, D9)."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flare_contract.graphs import CostKey, GraphKind
from helios.scheduler.cost import CostModel
from helios.scheduler.refresh import (
    AcceptanceLearningLedger,
    ExplorationAccounts,
    StaleAlternative,
    TimingRefreshLedger,
    refresh_choice,
    refresh_order,
    stale_alternatives,
)
from helios.scheduler.types import ExecutionTiming, SelectionReason

ORDINARY = SelectionReason.ORDINARY
DISCOVERY = SelectionReason.DISCOVERY
REFRESH = SelectionReason.TIMING_REFRESH
PROBE = SelectionReason.ACCEPTANCE_LEARNING
MS = 1_000_000
EXAMPLES = 60 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 300


def timing(device_ms: float, wall_ms: float | None = None) -> ExecutionTiming:
    wall = device_ms if wall_ms is None else wall_ms
    return ExecutionTiming(device_ns=round(device_ms * MS), wall_ns=round(wall * MS))


def run_ordinary(accounts: ExplorationAccounts, total_ms: int, step_ms: int = 5) -> None:
    for _ in range(total_ms // step_ms):
        accounts.record(ORDINARY, timing(step_ms), queued=True)


# -- D6: earning ---------------------------------------------------------------


def test_D6_first_refresh_needs_exactly_2495_ms_of_ordinary_execution():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 2490)
    accounts.record(ORDINARY, timing(4.999999), queued=True)
    assert not accounts.can_begin(REFRESH)  # one nanosecond short
    accounts.record(ORDINARY, ExecutionTiming(device_ns=1, wall_ns=1), queued=True)
    assert accounts.can_begin(REFRESH)
    assert accounts.credit_ns(REFRESH) == 5 * MS


def test_D8_first_probe_needs_exactly_495_ms_of_ordinary_execution():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 490)
    accounts.record(ORDINARY, ExecutionTiming(device_ns=5 * MS - 1, wall_ns=0), queued=True)
    assert not accounts.can_begin(PROBE)
    accounts.record(ORDINARY, ExecutionTiming(device_ns=1, wall_ns=0), queued=True)
    assert accounts.can_begin(PROBE) and not accounts.can_begin(REFRESH)


def test_D6_queued_frames_credit_the_device_interval_isolated_ones_the_larger_of_device_and_wall():
    queued, isolated = ExplorationAccounts(), ExplorationAccounts()
    queued.record(ORDINARY, timing(10, wall_ms=30), queued=True)
    isolated.record(ORDINARY, timing(10, wall_ms=30), queued=False)
    assert queued.credit_ns(REFRESH) == pytest.approx(10 * MS / 499)
    assert isolated.credit_ns(REFRESH) == pytest.approx(30 * MS / 499)
    assert isolated.credit_ns(PROBE) == pytest.approx(30 * MS / 99)


def test_D6_missing_device_interval_and_discovery_earn_nothing():
    accounts = ExplorationAccounts()
    accounts.record(ORDINARY, ExecutionTiming(device_ns=0, wall_ns=50 * MS), queued=False)
    accounts.record(DISCOVERY, timing(3000), queued=False)
    assert accounts.credit_ns(REFRESH) == 0 and accounts.credit_ns(PROBE) == 0
    assert accounts.counters.executions(DISCOVERY) == 1
    assert accounts.counters.nanoseconds(DISCOVERY) == 3000 * MS


def test_D6_balance_caps_at_five_ms():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 10_000)
    assert accounts.credit_ns(REFRESH) == 5 * MS
    assert accounts.credit_ns(PROBE) == 5 * MS


def test_D6_idle_discards_positive_credit():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 2000)
    accounts.idle()
    run_ordinary(accounts, 2000)
    assert not accounts.can_begin(REFRESH)  # 4,000 ms in total, never 2,495 in one busy period


def test_D6_D7_repeated_short_busy_periods_never_fund_a_refresh():
    accounts = ExplorationAccounts()
    for _ in range(200):
        run_ordinary(accounts, 2400, step_ms=40)
        assert not accounts.can_begin(REFRESH)
        accounts.idle()
    assert accounts.counters.executions(REFRESH) == 0


# -- D7: episodes ----------------------------------------------------------------


def funded(reason: SelectionReason) -> ExplorationAccounts:
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 2500)
    assert accounts.can_begin(reason)
    return accounts


def test_D7_an_episode_pays_its_actual_duration_into_debt_and_idle_keeps_the_debt():
    accounts = funded(REFRESH)
    accounts.begin(REFRESH)
    accounts.record(REFRESH, timing(40, wall_ms=42), queued=False)
    assert accounts.credit_ns(REFRESH) == pytest.approx(5 * MS - 42 * MS)
    accounts.idle()
    assert accounts.credit_ns(REFRESH) == pytest.approx(-37 * MS)
    assert accounts.timing.last_episode_ns == 42 * MS


def test_D7_invalid_timing_pays_its_wall_time():
    accounts = funded(REFRESH)
    accounts.begin(REFRESH)
    accounts.record(REFRESH, ExecutionTiming(device_ns=0, wall_ns=7 * MS), queued=False)
    assert accounts.credit_ns(REFRESH) == pytest.approx(-2 * MS)
    assert accounts.counters.nanoseconds(REFRESH) == 7 * MS


def test_D7_one_episode_at_a_time_and_the_next_needs_full_credit_again():
    accounts = funded(REFRESH)
    accounts.begin(REFRESH)
    assert not accounts.can_begin(REFRESH) and not accounts.can_begin(PROBE)
    with pytest.raises(ValueError, match="already in flight"):
        accounts.begin(PROBE)
    accounts.record(REFRESH, timing(1), queued=False)
    assert not accounts.can_begin(REFRESH)  # 4 ms left: needs 1 ms more, i.e. 499 ms of ordinary work
    run_ordinary(accounts, 495)
    assert not accounts.can_begin(REFRESH)
    run_ordinary(accounts, 5)
    assert accounts.can_begin(REFRESH)


def test_D7_begin_without_full_credit_or_record_without_begin_is_an_error():
    accounts = ExplorationAccounts()
    with pytest.raises(ValueError, match="needs full credit"):
        accounts.begin(REFRESH)
    with pytest.raises(ValueError, match="no open acceptance_learning episode"):
        accounts.record(PROBE, timing(1), queued=False)
    assert accounts.counters.executions(PROBE) == 0  # the rejected record changed nothing
    with pytest.raises(ValueError, match="spend no exploration credit"):
        accounts.begin(ORDINARY)


def test_D7_idle_during_an_episode_is_a_caller_error():
    accounts = funded(PROBE)
    accounts.begin(PROBE)
    with pytest.raises(ValueError, match="in flight"):
        accounts.idle()


def test_D7_a_frame_that_never_ran_closes_its_episode_without_a_charge():
    accounts = funded(REFRESH)
    accounts.begin(REFRESH)
    accounts.record(REFRESH, ExecutionTiming(device_ns=0, wall_ns=0), queued=False)
    assert not accounts.episode_open
    assert accounts.credit_ns(REFRESH) == 5 * MS


def test_D8_each_ledger_pays_only_for_its_own_episodes():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 3000)
    accounts.begin(PROBE)
    accounts.record(PROBE, timing(3), queued=False)
    assert accounts.credit_ns(PROBE) == pytest.approx(2 * MS)
    assert accounts.credit_ns(REFRESH) == 5 * MS  # the refresh ledger was not charged
    accounts.begin(REFRESH)
    accounts.record(REFRESH, timing(4), queued=False)
    assert accounts.credit_ns(REFRESH) == pytest.approx(1 * MS)
    assert accounts.credit_ns(PROBE) == pytest.approx(2 * MS)


def test_D8_exploration_executions_earn_no_credit():
    accounts = funded(PROBE)
    accounts.begin(PROBE)
    accounts.record(PROBE, timing(1), queued=False)
    before = (accounts.credit_ns(REFRESH), accounts.credit_ns(PROBE))
    assert before[1] == pytest.approx(4 * MS)
    assert accounts.credit_ns(REFRESH) == 5 * MS


# -- D9: counters -------------------------------------------------------------------


def test_D9_counters_split_executions_and_nanoseconds_by_reason():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 3000, step_ms=10)  # 300 executions
    accounts.record(DISCOVERY, timing(2, wall_ms=3), queued=False)
    accounts.begin(REFRESH)
    accounts.record(REFRESH, timing(6), queued=False)
    accounts.begin(PROBE)
    accounts.record(PROBE, timing(4, wall_ms=9), queued=False)
    labels = accounts.counters.as_labels()
    assert labels == {
        "ordinary": (300, 3000 * MS),
        "discovery": (1, 3 * MS),
        "timing_refresh": (1, 6 * MS),
        "acceptance_learning": (1, 9 * MS),
    }


# -- D7: which stale alternative ---------------------------------------------------


def test_D7_stale_alternatives_oldest_touch_first_then_value():
    a = StaleAlternative("a", last_observation_ns=100, last_attempt_ns=900, value=9.0)  # touched at 900
    b = StaleAlternative("b", last_observation_ns=500, last_attempt_ns=None, value=1.0)
    c = StaleAlternative("c", last_observation_ns=300, last_attempt_ns=500, value=5.0)
    d = StaleAlternative("d", last_observation_ns=200, last_attempt_ns=None, value=0.5)
    assert [x.key for x in refresh_order([a, b, c, d])] == ["d", "c", "b", "a"]
    assert refresh_choice([a, b]).key == "b"
    assert refresh_choice([]) is None


def test_D7_an_attempt_moves_an_alternative_behind_untouched_ones():
    never = StaleAlternative("never", 1_000, None, 1.0)
    tried = StaleAlternative("tried", 0, None, 1.0)
    assert refresh_choice([never, tried]).key == "tried"
    tried_again = StaleAlternative("tried", 0, 2_000, 1.0)  # a committed attempt, timing invalid
    assert refresh_choice([never, tried_again]).key == "never"


# -- the aggregate bounds, over arbitrary histories ----------------------------------

# mostly ordinary work, so that long histories reach the 2,495 ms refresh threshold often
KINDS = ["ordinary"] * 16 + ["discovery", "idle", "refresh", "refresh", "probe", "probe", "never_ran"]
operations = st.tuples(
    st.sampled_from(KINDS), st.integers(0, 400), st.integers(0, 400), st.booleans()
)


class Tally:
    """Independent totals of what the histories did, in integer nanoseconds."""

    def __init__(self) -> None:
        self.ordinary = 0  # credited ordinary time O (the same for both ledgers)
        self.paid = {REFRESH: 0, PROBE: 0}
        self.last = {REFRESH: 0, PROBE: 0}


def apply(accounts: ExplorationAccounts, tally: Tally, op) -> None:
    kind, device_ms, wall_ms, flag = op
    if kind in ("refresh", "probe"):
        device_ms, wall_ms = device_ms // 4, wall_ms // 4  # episodes up to 100 ms: overruns into debt
    t = ExecutionTiming(device_ns=device_ms * MS, wall_ns=wall_ms * MS)
    if kind == "idle":
        accounts.idle()
    elif kind in ("ordinary", "discovery"):
        reason = ORDINARY if kind == "ordinary" else DISCOVERY
        accounts.record(reason, t, queued=flag)
        if reason is ORDINARY and device_ms > 0:
            tally.ordinary += (device_ms if flag else max(device_ms, wall_ms)) * MS
    else:
        reason = PROBE if kind == "probe" else REFRESH
        if kind == "never_ran":  # committed, then dropped before it ran
            device_ms, wall_ms, reason = 0, 0, REFRESH
            t = ExecutionTiming(0, 0)
        if not accounts.can_begin(reason):
            return
        accounts.begin(reason)
        # invalid device interval (0) pays wall time; an isolated frame pays max(device, wall)
        charged = max(device_ms, wall_ms) * MS
        accounts.record(reason, t, queued=False)
        tally.paid[reason] += charged
        tally.last[reason] = charged


@settings(max_examples=EXAMPLES // 3, deadline=None)
@given(st.lists(operations, min_size=100, max_size=300))
def test_D7_D8_aggregate_exploration_bounds_hold_over_any_history(ops):
    """Queued/isolated ordinary frames, discovery, idle gaps, episodes with invalid timings or none."""
    accounts, tally = ExplorationAccounts(), Tally()
    inverse_shares = {REFRESH: 499, PROBE: 99}  # 0.998 / 0.002 and 0.99 / 0.01
    for op in ops:
        apply(accounts, tally, op)
        for reason, inverse in inverse_shares.items():
            # P <= O / inverse + D, with D the actual duration of the latest episode
            assert inverse * tally.paid[reason] <= tally.ordinary + inverse * tally.last[reason]
            assert accounts.credit_ns(reason) <= 5 * MS
        assert accounts.counters.nanoseconds(REFRESH) == tally.paid[REFRESH]
        assert accounts.counters.nanoseconds(PROBE) == tally.paid[PROBE]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50_000_000), st.integers(0, 50_000_000), st.booleans()), max_size=400))
def test_D6_D8_funding_arrives_exactly_at_the_threshold(frames):
    """Without idle or episodes, a ledger is full exactly once its credited time reaches 2,495 / 495 ms."""
    accounts = ExplorationAccounts()
    credited = 0
    for device_ns, wall_ns, queued in frames:
        accounts.record(ORDINARY, ExecutionTiming(device_ns, wall_ns), queued=queued)
        credited += device_ns if queued else max(device_ns, wall_ns)
        assert accounts.can_begin(REFRESH) == (credited >= 2_495 * MS)
        assert accounts.can_begin(PROBE) == (credited >= 495 * MS)


def test_ledgers_name_their_shares():
    assert TimingRefreshLedger().share == Fraction(1, 499)
    assert AcceptanceLearningLedger().share == Fraction(1, 99)


# -- feeding D7's order from the cost model -------------------------------------------


def test_D7_stale_alternatives_come_from_measured_stale_entries_only():
    def key(batch: int) -> CostKey:
        return CostKey(GraphKind.DECODE, batch, 1, 0, 0, batch)

    cost = CostModel(ttl_ns=1_000)
    cost.observe(key(1), 5 * MS, 0, now_ns=0)  # stale by 2,000
    cost.observe(key(2), 5 * MS, 0, now_ns=100)
    cost.mark_attempt(key(2), now_ns=1_500)  # stale, but attempted more recently
    cost.observe(key(4), 5 * MS, 0, now_ns=1_900)  # fresh
    values = {key(1): 1.0, key(2): 9.0, key(4): 5.0, key(8): 7.0}  # key(8): never measured
    found = stale_alternatives(cost, values, now_ns=2_000)
    assert [a.key for a in refresh_order(found)] == [key(1), key(2)]
    assert found[1].last_touched_ns == 1_500


def test_A12_credit_snapshot_names_both_balances():
    accounts = ExplorationAccounts()
    run_ordinary(accounts, 990)
    credit = accounts.credit()
    assert credit.timing_refresh_ns == pytest.approx(990 * MS / 499)
    assert credit.acceptance_learning_ns == 5 * MS
