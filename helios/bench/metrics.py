"""Serving metrics with the definitions of vLLM's ``bench serve``, plus Jain's fairness index.

Pure functions over timelines, shared by ``flare bench`` (wall-clock streams)
and ``scripts/scheduling_sim`` (simulated bursts), so both report the same
figures the same way:

- TTFT: first content chunk minus send time; E2EL: last content chunk minus
  send time; ITL: gaps between consecutive content chunks, pooled over
  requests; TPOT: (E2EL - TTFT) / (output tokens - 1) when more than one token;
- goodput: requests meeting every given SLO, per second of the run (a
  one-token output has TPOT 0 for this check, as in vLLM);
- each distribution as mean, median, p90, p99 (numpy's linear percentiles)
  and max;
- Jain's index (sum x)^2 / (n sum x^2) over the output tokens each stream got
  inside a fixed window, counting only streams active for the whole window
  (first to last chunk), averaged over windows where at least two such
  streams got some service (docs/cli.md, "flare bench").
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Slo:
    """Goodput targets in milliseconds; None leaves a latency unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def given(self) -> bool:
        return any(limit is not None for limit in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    median: float
    p90: float
    p99: float
    max: float  # not in vLLM's set: a single long stall hides below p99 of thousands of gaps

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan)
        data = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(data, [50, 90, 99])
        return cls(float(data.mean()), float(p50), float(p90), float(p99), float(data.max()))


@dataclass(frozen=True, slots=True)
class RequestLatency:
    ttft_ms: float
    e2el_ms: float
    tpot_ms: float | None  # None for a one-token output
    itl_ms: tuple[float, ...]

    @classmethod
    def of(cls, send: float, chunk_times: Sequence[float], tokens: int, units_per_ms: float) -> RequestLatency:
        """From a send time and the content chunks' times, in any unit (``units_per_ms`` converts)."""
        assert chunk_times, "a request without content chunks has no latency"
        ttft = (chunk_times[0] - send) / units_per_ms
        e2el = (chunk_times[-1] - send) / units_per_ms
        tpot = (e2el - ttft) / (tokens - 1) if tokens > 1 else None
        gaps = tuple((later - earlier) / units_per_ms for earlier, later in zip(chunk_times, chunk_times[1:]))
        return cls(ttft, e2el, tpot, gaps)

    def meets(self, slo: Slo) -> bool:
        checks = ((slo.ttft_ms, self.ttft_ms), (slo.tpot_ms, self.tpot_ms or 0.0), (slo.e2el_ms, self.e2el_ms))
        return all(limit is None or value <= limit for limit, value in checks)


def jain_index(rates: Sequence[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one takes everything."""
    squares = sum(x * x for x in rates)
    if not rates or squares == 0:
        return math.nan
    return sum(rates) ** 2 / (len(rates) * squares)


@dataclass(frozen=True, slots=True)
class Stream:
    """One stream's cumulative output tokens: a step up at each chunk time (ascending)."""

    times: tuple[float, ...]
    cumulative: tuple[float, ...]  # tokens delivered up to and including each chunk

    def tokens_by(self, time: float) -> float:
        index = bisect.bisect_right(self.times, time)
        return self.cumulative[index - 1] if index else 0.0


def windowed_jain(streams: Sequence[Stream], window: float) -> float:
    """Mean Jain index over consecutive windows with two or more streams active throughout and some service.

    Windows tile the span from the first stream's first chunk; a stream is
    active from its first to its last chunk. nan when no window qualifies.
    """
    streams = [s for s in streams if len(s.times) >= 2]
    if not streams or window <= 0:
        return math.nan
    start = min(s.times[0] for s in streams)
    end = max(s.times[-1] for s in streams)
    indices = []
    for k in range(int((end - start) // window)):
        left = start + k * window
        right = left + window
        active = [s for s in streams if s.times[0] <= left and s.times[-1] >= right]
        served = [float(s.tokens_by(right) - s.tokens_by(left)) for s in active]
        if len(active) >= 2 and sum(served) > 0:
            indices.append(jain_index(served))
    return float(np.mean(indices)) if indices else math.nan
