"""Brute-force reference for V2: score every legal cohort of one graph, independently of helios/scheduler/select."""

from __future__ import annotations

import os
from itertools import combinations

from helios.scheduler.select.population import Decoders, Prompters

EXAMPLES = 60 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 300


def expected_tokens(dec: Decoders, i: int, length: int, source: str | None, alpha: float) -> float:
    if source is None:
        return 1.0
    s = dec.survival[i][source]
    return min(float(dec.room[i]), 1.0 + sum(p ** alpha for p in s[: length - 1]))


def decoder_value(dec, i, length, source, alpha, t_ms) -> float:
    e = expected_tokens(dec, i, length, source, alpha)
    return e * dec.token_price[i] + dec.delivery_price[i] + dec.age_credit[i] + dec.age_slope[i] * t_ms


def prompt_value(prm: Prompters, j: int, capacity: int) -> float:
    tokens = min(capacity, prm.remaining[j])
    return tokens * prm.price[j] + (prm.first_token[j] if tokens == prm.remaining[j] else 0.0)


def score(value: float, t_ms: float | None, active: float) -> float:
    if t_ms is None:
        return value
    return value / t_ms - 0.5 * t_ms * active


def subsets(items, most: int):
    for k in range(0, min(most, len(items)) + 1):
        yield from combinations(items, k)
