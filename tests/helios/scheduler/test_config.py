"""PolicyConfig: the spec's defaults (Y1) and the CLI presets and overrides (Y2)."""

from __future__ import annotations

import math

import pytest

from helios.scheduler import PolicyConfig


def test_Y1_defaults_are_the_spec_table():
    config = PolicyConfig()
    assert (config.output_token_value, config.token_fairness, config.delivery_fairness) == (64, 16, 4)
    assert (config.decode_age_price, config.terminal_value, config.terminal_age_price) == (0.1, 256, 1)
    assert (config.adaptation_ms, config.estimate_ttl_ns, config.adaptive_verification_alpha) == (100, 30_000_000_000, 1)


def test_Y2_throughput_drops_cadence_preferences_and_keeps_token_ones():
    balanced, throughput = PolicyConfig.preset("balanced"), PolicyConfig.preset("throughput")
    assert balanced == PolicyConfig()
    assert (throughput.delivery_fairness, throughput.decode_age_price) == (0, 0)
    assert (throughput.token_fairness, throughput.output_token_value) == (balanced.token_fairness, balanced.output_token_value)
    assert (throughput.terminal_value, throughput.terminal_age_price) == (balanced.terminal_value, balanced.terminal_age_price)


def test_Y2_terminal_and_alpha_overrides_apply_after_the_preset():
    config = PolicyConfig.preset("throughput", terminal_value=0, terminal_age_price=2.5, adaptive_verification_alpha=0.5)
    assert (config.terminal_value, config.terminal_age_price, config.adaptive_verification_alpha) == (0, 2.5, 0.5)
    assert config.delivery_fairness == 0  # the preset still holds


@pytest.mark.parametrize("field", ["terminal_value", "terminal_age_price", "token_fairness", "decode_age_price"])
@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_Y2_coefficients_must_be_finite_and_nonnegative(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**{field: value})


@pytest.mark.parametrize("alpha", [0.0, -0.5, math.inf])
def test_Y2_alpha_must_be_finite_and_positive(alpha):
    with pytest.raises(ValueError, match="adaptive_verification_alpha"):
        PolicyConfig(adaptive_verification_alpha=alpha)


def test_Y2_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="balanced, throughput"):
        PolicyConfig.preset("fast")
