"""From per-request results to the run's figures, and the ``--json`` document (vLLM's key names)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from helios.bench.client import RequestResult
from helios.bench.metrics import Distribution, RequestLatency, Slo, Stream, windowed_jain
from helios.bench.server_metrics import ServerDeltas

SECONDS_PER_MS = 1e-3
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_goodput: float | None  # None when no SLO was given
    latencies_ms: dict[str, Distribution]  # by LATENCIES name
    jain_fairness_index: float  # nan when no window had two streams active throughout
    server: ServerDeltas | None

    def per_second(self, count: float) -> float:
        return count / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def request_throughput(self) -> float:
        return self.per_second(self.completed)

    @property
    def output_throughput(self) -> float:
        return self.per_second(self.total_output_tokens)

    @property
    def total_token_throughput(self) -> float:
        return self.per_second(self.total_input_tokens + self.total_output_tokens)


def latency(result: RequestResult) -> RequestLatency:
    return RequestLatency.of(result.sent, result.chunk_times, result.output_tokens, SECONDS_PER_MS)


def stream(result: RequestResult) -> Stream:
    """Output tokens spread over the chunks in proportion to their text (one burst may carry several tokens)."""
    chars = sum(result.chunk_chars)
    steps = result.chunk_chars if chars > 0 else [1] * len(result.chunk_times)
    total, running, cumulative = sum(steps), 0, []
    for step in steps:
        running += step
        cumulative.append(result.output_tokens * running / total)
    return Stream(tuple(result.chunk_times), tuple(cumulative))


def summarize(results: list[RequestResult], duration_s: float, slo: Slo, fairness_window_s: float,
              server: ServerDeltas | None = None) -> Summary:
    done = [r for r in results if r.ok]
    latencies = [latency(r) for r in done]
    good = sum(lat.meets(slo) for lat in latencies)
    return Summary(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=sum(_prompt_tokens(r) for r in done),
        total_output_tokens=sum(r.output_tokens for r in done),
        request_goodput=(good / duration_s if duration_s > 0 else math.nan) if slo.given else None,
        latencies_ms={
            "ttft": Distribution.of([lat.ttft_ms for lat in latencies]),
            "tpot": Distribution.of([lat.tpot_ms for lat in latencies if lat.tpot_ms is not None]),
            "itl": Distribution.of([gap for lat in latencies for gap in lat.itl_ms]),
            "e2el": Distribution.of([lat.e2el_ms for lat in latencies]),
        },
        jain_fairness_index=windowed_jain([stream(r) for r in done], fairness_window_s),
        server=server,
    )


def _prompt_tokens(result: RequestResult) -> int:
    return result.prompt_tokens if result.prompt_tokens is not None else result.request.estimated_prompt_tokens


def to_json(summary: Summary, results: list[RequestResult]) -> dict:
    """vLLM's keys where they exist; NaN (nothing to measure) becomes null."""
    document = {
        "duration": summary.duration_s,
        "completed": summary.completed,
        "failed": summary.failed,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
    }
    if summary.request_goodput is not None:
        document["request_goodput"] = summary.request_goodput
    for name, dist in summary.latencies_ms.items():
        for stat in ("mean", "median", "p90", "p99", "max"):
            document[f"{stat}_{name}_ms"] = getattr(dist, stat)
    document["jain_fairness_index"] = summary.jain_fairness_index
    document["server_metrics"] = summary.server.to_json() if summary.server else None
    document |= _per_request(results)
    return {key: _finite(value) for key, value in document.items()}


def _per_request(results: list[RequestResult]) -> dict:
    """vLLM's per-request lists (seconds, as vLLM writes them), failed requests included."""
    return {
        "input_lens": [_prompt_tokens(r) for r in results],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "ttfts": [r.chunk_times[0] - r.sent if r.ok else 0.0 for r in results],
        "itls": [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] for r in results],
        "errors": [r.error or "" for r in results],
    }


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value
