"""Service histories and prices: helios/scheduler/service.py (spec checklist U3, U4, U5, A3, A4, A5, A10)."""

from __future__ import annotations

import math
from itertools import cycle, islice

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from helios.scheduler.config import PolicyConfig
from helios.scheduler.service import (
    COLD_TOKEN_RATE_PER_MS,
    DeliveryFamily,
    ServiceHistory,
    ShapeTiming,
    fair_token_rate,
    reference_interval_ms,
    token_normalizer,
)
from tests.helios.scheduler import reference
from tests.helios.scheduler.reference import FrameService, utility_rate

POLICY = PolicyConfig()
TAU = POLICY.adaptation_ms


def _history(x=2.0, z=None):
    return ServiceHistory(token_rate=x, delivery_rate=z)


def test_U3_prices():
    policy = PolicyConfig(output_token_value=64, token_fairness=16, delivery_fairness=4)
    prices = reference.prices(_history(x=0.5, z=0.1), policy, delivery_fallback_rate=1.0)
    assert prices.prefill_token == pytest.approx(1 + 16 / 0.5)
    assert prices.output_token == pytest.approx(64 + 16 / 0.5)
    assert prices.delivery == pytest.approx(4 / 0.1)


def test_U3_missing_delivery_history_uses_the_fallback_rate():
    prices = reference.prices(_history(z=None), POLICY, delivery_fallback_rate=0.05)
    assert prices.delivery == pytest.approx(POLICY.delivery_fairness / 0.05)


@given(
    st.floats(min_value=1e-3, max_value=1e3),
    st.floats(min_value=1e-3, max_value=1e3),
    st.sampled_from(["prompt", "output"]),
)
def test_U3_prices_are_the_gradients_of_the_utility_rate(x, z, phase):
    """Numeric partial derivatives of v*x + f log x + g log z match the stored prices."""
    value = 1.0 if phase == "prompt" else POLICY.output_token_value
    prices = reference.prices(_history(x, z), POLICY, delivery_fallback_rate=1.0)
    hx, hz = x * 1e-6, z * 1e-6
    d_x = (utility_rate(x + hx, z, value, POLICY) - utility_rate(x - hx, z, value, POLICY)) / (2 * hx)
    d_z = (utility_rate(x, z + hz, value, POLICY) - utility_rate(x, z - hz, value, POLICY)) / (2 * hz)
    token_price = prices.prefill_token if phase == "prompt" else prices.output_token
    assert d_x == pytest.approx(token_price, rel=1e-5)
    assert d_z == pytest.approx(prices.delivery, rel=1e-5)


def test_U4_prompt_and_output_prices_share_one_token_history():
    """A phase change keeps the request's token congestion price (physical units, one x)."""
    prices = reference.prices(_history(x=0.25), POLICY, delivery_fallback_rate=1.0)
    assert prices.output_token - POLICY.output_token_value == pytest.approx(prices.prefill_token - 1.0)


def _integrate_filter(x, rate, interval_ms, steps=20_000):
    """Euler integration of tau dx/dt = rate - x: the continuous process the update solves."""
    dt = interval_ms / steps
    for _ in range(steps):
        x += dt * (rate - x) / TAU
    return x


@pytest.mark.parametrize("tokens, interval_ms", [(40, 10.0), (0, 25.0), (4096, 300.0)])
def test_A3_interval_update_solves_the_first_order_filter(tokens, interval_ms):
    history = _history(x=3.0)
    history.record_interval(1, tokens, interval_ms, TAU)
    expected = _integrate_filter(3.0, tokens / interval_ms, interval_ms)
    assert history.token_rate == pytest.approx(expected, rel=1e-3)


@given(
    st.floats(min_value=0.01, max_value=100.0),
    st.floats(min_value=0.0, max_value=50.0),
    st.floats(min_value=0.1, max_value=500.0),
)
def test_A3_splitting_an_interval_does_not_change_the_history(x, rate, interval_ms):
    whole, halves = _history(x), _history(x)
    whole.record_interval(1, rate * interval_ms, interval_ms, TAU)
    halves.record_interval(1, rate * interval_ms / 2, interval_ms / 2, TAU)
    halves.record_interval(2, rate * interval_ms / 2, interval_ms / 2, TAU)
    assert halves.token_rate == pytest.approx(whole.token_rate, rel=1e-9)


def test_A3_unserved_participants_decay_so_their_price_rises():
    history = _history(x=2.0, z=0.1)
    before = reference.prices(history, POLICY, delivery_fallback_rate=1.0)
    history.record_interval(7, 0, TAU * math.log(2), TAU)
    after = reference.prices(history, POLICY, delivery_fallback_rate=1.0)
    assert history.token_rate == pytest.approx(1.0)
    assert history.delivery_rate == pytest.approx(0.05)
    # the congestion part of the price doubles every tau*ln 2 without service
    assert after.prefill_token - 1 == pytest.approx(2 * (before.prefill_token - 1))
    assert after.delivery == pytest.approx(2 * before.delivery)


def test_A3_long_starvation_keeps_prices_finite():
    history = _history(x=2.0, z=0.1)
    history.record_interval(1, 0, 1e9, TAU)
    prices = reference.prices(history, POLICY, delivery_fallback_rate=1.0)
    assert math.isfinite(prices.prefill_token) and math.isfinite(prices.delivery)


def test_A4_completion_records_zero_deliveries_until_publication():
    served, published = _history(z=0.1), _history(z=0.1)
    for history in (served, published):
        history.record_interval(5, 1, 10.0, TAU)
    assert served.delivery_rate < 0.1  # zero deliveries recorded
    assert published.amend_delivery(5)
    a = math.exp(-10.0 / TAU)
    assert published.delivery_rate == pytest.approx(a * 0.1 + (1 - a) * 1 / 10.0)
    assert published.token_rate == served.token_rate  # the amend only touches deliveries


def test_A4_later_tokens_of_the_burst_and_other_fences_change_nothing():
    history = _history(z=0.1)
    history.record_interval(5, 1, 10.0, TAU)
    assert history.amend_delivery(5)
    once = history.delivery_rate
    assert not history.amend_delivery(5)
    assert history.delivery_rate == once
    history.record_interval(6, 1, 10.0, TAU)
    assert not history.amend_delivery(5)  # superseded: no rewind through later intervals


def test_A5_first_burst_starts_delivery_history_at_one_per_frame():
    history = _history(z=None)
    history.record_interval(3, 1, 40.0, TAU)
    assert history.delivery_rate is None
    assert history.amend_delivery(3)
    assert history.delivery_rate == pytest.approx(1 / 40.0)


def test_A10_projection_leaves_the_real_history_untouched():
    history = _history(x=2.0, z=0.1)
    history.record_interval(9, 1, 10.0, TAU)
    snapshot = (history.token_rate, history.delivery_rate, history.last_interval)
    projected = reference.projected(history, FrameService(tokens=4, deliveries=1, duration_ms=12.0), TAU)
    assert (history.token_rate, history.delivery_rate, history.last_interval) == snapshot
    assert projected is not history and projected.token_rate != history.token_rate
    assert history.amend_delivery(9)  # the real interval can still be amended


@given(
    st.floats(min_value=0.01, max_value=10.0),
    st.one_of(st.none(), st.floats(min_value=0.001, max_value=1.0)),
    st.integers(min_value=0, max_value=64),
    st.floats(min_value=0.5, max_value=200.0),
)
def test_A10_projection_matches_the_update_the_completion_would_make(x, z, tokens, duration_ms):
    """Projecting a frame that delivers = recording it and publishing its burst."""
    real = _history(x, z)
    projected = reference.projected(real, FrameService(tokens, 1, duration_ms), TAU)
    real.record_interval(1, tokens, duration_ms, TAU)
    real.amend_delivery(1)
    assert projected.token_rate == pytest.approx(real.token_rate)
    assert projected.delivery_rate == pytest.approx(real.delivery_rate)


def test_starting_rate_is_a_fair_share_of_the_measured_catalog():
    prefill = GraphDescriptor(id="p", kind=GraphKind.PREFILL, batch_capacity=1, prefill_capacity=512)
    decode = GraphDescriptor(id="d", kind=GraphKind.DECODE, batch_capacity=8)
    unknown = GraphDescriptor(id="u", kind=GraphKind.PREFILL, batch_capacity=1, prefill_capacity=4096)
    normalizer = token_normalizer([(prefill, 8_000_000), (decode, 2_000_000), (unknown, 0)])
    assert normalizer == pytest.approx(64.0)  # 512 tokens in 8 ms beats 8 tokens in 2 ms
    assert fair_token_rate(normalizer, participants=4) == pytest.approx(16.0)
    assert token_normalizer([(unknown, 0)]) is None
    assert fair_token_rate(None, participants=3) == COLD_TOKEN_RATE_PER_MS
    with pytest.raises(ValueError, match="participants"):
        fair_token_rate(64.0, participants=0)


def _simulated_delivery_interval(total, family, shape):
    """Brute force: uniform round-robin cohorts inside the family; the family holds
    k/K of wall time, so every family dispatch of T ms costs T*K/k of wall time."""
    rows = min(shape.batch_capacity, family)
    dispatches = family * rows  # several full cycles of the rotation
    served = [0] * family
    for stream in islice(cycle(range(family)), dispatches * rows):
        served[stream] += 1
    assert len(set(served)) == 1  # uniform cohorts serve every stream equally
    wall_ms = dispatches * shape.duration_ms * total / family
    return wall_ms / served[0]


@given(
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=0, max_value=12),
    st.lists(
        st.builds(ShapeTiming, st.floats(min_value=0.5, max_value=50.0), st.sampled_from([1, 2, 4, 8, 16])),
        min_size=1,
        max_size=5,
    ),
)
def test_U5_sigma_is_the_best_uniform_family_schedule(family, others, shapes):
    total = family + others
    brute = min(_simulated_delivery_interval(total, family, shape) for shape in shapes)
    assert reference_interval_ms(total, family, shapes) == pytest.approx(brute)


def test_U5_sigma_picks_batch_feasible_rate_and_ignores_unmeasured():
    shapes = [ShapeTiming(10.0, 8), ShapeTiming(4.0, 2), ShapeTiming(0.0, 64)]
    # three streams: B=8 serves all 3 in 10 ms (3.33 ms each); B=2 serves 2 in 4 ms (2 ms each)
    assert reference_interval_ms(5, 3, shapes) == pytest.approx(5 * 4.0 / 2)
    assert reference_interval_ms(5, 3, [ShapeTiming(0.0, 8)]) is None
    with pytest.raises(ValueError, match="k=3, K=2"):
        reference_interval_ms(2, 3, shapes)


def test_U5_families_are_separated_by_proposal_source():
    decode = GraphDescriptor(id="d", kind=GraphKind.DECODE, batch_capacity=4)
    learned = GraphDescriptor(
        id="s", kind=GraphKind.SPECULATIVE, batch_capacity=4, proposal_depth=3, width=4,
        value_source=ValueSource.QUERY_LENGTH, proposal_source="learned",
    )
    prefill = GraphDescriptor(id="p", kind=GraphKind.PREFILL, batch_capacity=1, prefill_capacity=64)
    assert DeliveryFamily().serves(decode) and not DeliveryFamily().serves(learned)
    assert DeliveryFamily("learned").serves(learned) and not DeliveryFamily("copy").serves(learned)
    assert not DeliveryFamily().serves(prefill)  # prefill-only work carries no deliveries


def test_bad_intervals_are_rejected():
    with pytest.raises(ValueError, match="must be > 0 ms"):
        _history().record_interval(1, 3, 0.0, TAU)
    with pytest.raises(ValueError, match="served tokens"):
        _history().record_interval(1, -1, 5.0, TAU)
    with pytest.raises(ValueError, match="starting token rate"):
        ServiceHistory.starting_at(0.0)
