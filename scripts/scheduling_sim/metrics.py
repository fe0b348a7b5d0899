"""Serving metrics of one simulated run, with the definitions of vLLM's ``bench serve``.

Per request (bursts are the visible publications the simulator records; a
speculative burst carries several tokens and counts as one chunk, as one SSE
chunk does):
- TTFT: first burst minus arrival;
- ITL: the gaps between consecutive bursts, pooled over all requests;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for outputs longer than one token;
- E2EL: last burst minus arrival.
Per run: request and output-token throughput over the run's duration (first
arrival to last completion), goodput (requests meeting every given SLO per
second), mean / median / p90 / p99 of each latency (numpy's linear
percentiles, as vLLM), plus the maximum (one long stall hides below the p99
of thousands of gaps).

Added for the comparison:
- Jain's fairness index, (sum x)^2 / (n sum x^2), over the output-token rates
  of the streams active through a window (a stream is active from its first
  to its last burst), averaged over windows that served someone;
- the Virtual Token Counter paper's service difference: per window, each
  backlogged client's weighted service (1 per prompt token, credited at its
  first burst, 2 per output token), the spread between the most and the least
  served client, in weighted tokens per second; max and mean over windows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from helios.simulation_files import Trace
from helios.simulator import RequestOutcome, SimulationResult

NS_PER_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class Slo:
    """Goodput targets in milliseconds; None leaves a latency unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    median: float
    p90: float
    p99: float
    max: float  # not in vLLM's set: a single long stall hides below p99 of thousands of gaps

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
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

    def meets(self, slo: Slo) -> bool:
        checks = ((slo.ttft_ms, self.ttft_ms), (slo.tpot_ms, self.tpot_ms or 0.0), (slo.e2el_ms, self.e2el_ms))
        return all(limit is None or value <= limit for limit, value in checks)


def request_latency(outcome: RequestOutcome) -> RequestLatency | None:
    """None for a request that never finished."""
    if outcome.finished_ns is None or not outcome.bursts:
        return None
    ttft = (outcome.bursts[0].time_ns - outcome.arrival_ns) / NS_PER_MS
    e2el = (outcome.bursts[-1].time_ns - outcome.arrival_ns) / NS_PER_MS
    tokens = outcome.tokens
    tpot = (e2el - ttft) / (tokens - 1) if tokens > 1 else None
    return RequestLatency(ttft, e2el, tpot, tuple(outcome.gaps_ms()))


@dataclass(frozen=True, slots=True)
class Metrics:
    completed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    request_goodput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    jain_fairness_index: float  # nan: no window had two active streams
    service_difference_max: float  # nan: fewer than two clients
    service_difference_mean: float


def measure(result: SimulationResult, trace: Trace, clients: dict[str, str], slo: Slo,
            fairness_window_ms: float = 100.0, service_window_ms: float = 500.0) -> Metrics:
    latencies = [lat for lat in map(request_latency, result.requests) if lat is not None]
    duration_s = _duration_ns(result) / 1e9
    per_second = (lambda count: count / duration_s) if duration_s > 0 else (lambda count: math.nan)
    spread = service_difference(result, trace, clients, service_window_ms) if len(set(clients.values())) > 1 else []
    return Metrics(
        completed=len(latencies),
        duration_s=duration_s,
        request_throughput=per_second(len(latencies)),
        output_throughput=per_second(sum(o.tokens for o in result.requests)),
        request_goodput=per_second(sum(lat.meets(slo) for lat in latencies)),
        ttft_ms=Distribution.of([lat.ttft_ms for lat in latencies]),
        tpot_ms=Distribution.of([lat.tpot_ms for lat in latencies if lat.tpot_ms is not None]),
        itl_ms=Distribution.of([gap for lat in latencies for gap in lat.itl_ms]),
        e2el_ms=Distribution.of([lat.e2el_ms for lat in latencies]),
        jain_fairness_index=windowed_jain(result.requests, fairness_window_ms),
        service_difference_max=max(spread, default=math.nan),
        service_difference_mean=float(np.mean(spread)) if spread else math.nan,
    )


def _duration_ns(result: SimulationResult) -> int:
    finished = [o.finished_ns for o in result.requests if o.finished_ns is not None]
    start = min((o.arrival_ns for o in result.requests), default=0)
    return max(finished, default=start) - start


def jain_index(rates: list[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one takes everything."""
    squares = sum(x * x for x in rates)
    if not rates or squares == 0:
        return math.nan
    return sum(rates) ** 2 / (len(rates) * squares)


def windowed_jain(outcomes: tuple[RequestOutcome, ...] | list[RequestOutcome], window_ms: float) -> float:
    """Mean Jain index over windows with at least two streams active throughout and some service."""
    window = int(window_ms * NS_PER_MS)
    streams = [o for o in outcomes if len(o.bursts) >= 2]
    if not streams:
        return math.nan
    start = min(o.bursts[0].time_ns for o in streams)
    end = max(o.bursts[-1].time_ns for o in streams)
    indices = []
    for left in range(start, end - window + 1, window):
        right = left + window
        active = [o for o in streams if o.bursts[0].time_ns <= left and o.bursts[-1].time_ns >= right]
        rates = [o.tokens_by(right) - o.tokens_by(left) for o in active]
        if len(active) >= 2 and sum(rates) > 0:
            indices.append(jain_index([float(r) for r in rates]))
    return float(np.mean(indices)) if indices else math.nan


def service_difference(result: SimulationResult, trace: Trace, clients: dict[str, str], window_ms: float,
                       input_weight: float = 1.0, output_weight: float = 2.0) -> list[float]:
    """Per window: most minus least weighted service among clients backlogged throughout, per second."""
    prompts = {r.id: r.prompt_tokens for r in trace.requests}
    by_client: dict[str, list[RequestOutcome]] = defaultdict(list)
    for outcome in result.requests:
        by_client[clients.get(outcome.id, "default")].append(outcome)
    window = int(window_ms * NS_PER_MS)
    spreads = []
    for left in range(0, result.end_ns - window + 1, window):
        right = left + window
        served = [
            _weighted_service(group, prompts, left, right, input_weight, output_weight)
            for group in by_client.values()
            if _backlogged(group, left, right)
        ]
        if len(served) >= 2:
            spreads.append((max(served) - min(served)) / (window_ms / 1000.0))
    return spreads


def _weighted_service(group: list[RequestOutcome], prompts: dict[str, int], left: int, right: int,
                      input_weight: float, output_weight: float) -> float:
    total = 0.0
    for outcome in group:
        total += output_weight * (outcome.tokens_by(right) - outcome.tokens_by(left))
        if outcome.bursts and left < outcome.bursts[0].time_ns <= right:
            total += input_weight * prompts[outcome.id]
    return total


def _backlogged(group: list[RequestOutcome], left: int, right: int) -> bool:
    """True when the client had an unfinished request at every instant of [left, right]."""
    covered = left
    for outcome in sorted(group, key=lambda o: o.arrival_ns):
        finish = outcome.finished_ns if outcome.finished_ns is not None else right
        if outcome.arrival_ns > covered:
            break
        covered = max(covered, finish)
        if covered >= right:
            return True
    return False
