"""Serving metrics of one simulated run, with the definitions of vLLM's ``bench serve``.

The latency, goodput and Jain definitions are ``helios.bench.metrics``, shared
with ``flare bench``; this module maps simulated outcomes onto them.

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

# The shared definitions (flare bench measures real servers with the same ones); jain_index is re-exported.
from helios.bench.metrics import Distribution, RequestLatency, Slo, Stream, jain_index  # noqa: F401
from helios.bench.metrics import windowed_jain as shared_windowed_jain
from helios.sim.files import Trace
from helios.sim.simulator import RequestOutcome, SimulationResult

NS_PER_MS = 1_000_000


def request_latency(outcome: RequestOutcome) -> RequestLatency | None:
    """None for a request that never finished."""
    if outcome.finished_ns is None or not outcome.bursts:
        return None
    return RequestLatency.of(outcome.arrival_ns, [burst.time_ns for burst in outcome.bursts], outcome.tokens, NS_PER_MS)


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


def windowed_jain(outcomes: tuple[RequestOutcome, ...] | list[RequestOutcome], window_ms: float) -> float:
    """Mean Jain index over windows with at least two streams active throughout and some service."""
    return shared_windowed_jain([_stream(o) for o in outcomes], int(window_ms * NS_PER_MS))


def _stream(outcome: RequestOutcome) -> Stream:
    times = tuple(burst.time_ns for burst in outcome.bursts)
    return Stream(times, tuple(float(total) for total in np.cumsum([burst.tokens for burst in outcome.bursts])))


def service_difference(result: SimulationResult, trace: Trace, clients: dict[str, str], window_ms: float,
                       input_weight: float = 1.0, output_weight: float = 2.0) -> list[float]:
    """Per window: most minus least weighted service among clients backlogged throughout, per second."""
    prompts = {r.id: r.prompt_tokens for r in trace.requests}
    by_client: dict[str, list[RequestOutcome]] = defaultdict(list)
    for outcome in result.requests:
        by_client[clients.get(outcome.id, "default")].append(outcome)
    window = int(int(window_ms * NS_PER_MS))
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
