"""When each request is sent: gamma-distributed gaps, as vLLM's ``bench serve`` draws them.

A gap has shape ``burstiness`` and mean ``1 / rate``: burstiness 1 is a
Poisson process, below 1 bursts cluster, above 1 arrivals even out. An
infinite rate sends everything at time zero.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times in seconds from the start: the first at 0, then cumulative gamma gaps."""
    assert rate > 0 and burstiness > 0, f"rate ({rate}) and burstiness ({burstiness}) must be positive"
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
